"""The training loop: pulls batches from a collector, updates the algorithm, fires hooks.

Events, in order: ``start``; per batch ``batch`` then (after the update) ``update`` for each hook
whose schedule is due; then ``end`` once the run finished normally, or ``interrupt`` when SIGINT
or SIGTERM asked it to stop (the step under way is finished first; a second Ctrl-C stops at
once). A run that fails outside the learner (a collector, an engine, a reward, an evaluation, a
weight push) fires ``failure`` first, so that what the learner has is kept (a checkpoint, the
model). Every hook is ``close``d in all cases, after ``summary.json`` is written (also on error).

With a data-parallel learner (``strategy=ddp``) every rank runs this loop on its own share of each batch,
and the ranks agree at three points of each step, so that every rank takes the same decisions: whether
to go on (a stop signal or a hook's stop seen by any rank), what the batch was (frames, episodes, lag of
every rank's share: the state's figures are the whole job's) and, after the update, its metrics
(averaged over the ranks) and which hooks are due (rank 0's schedules decide). Rank 0 writes
summary.json; hooks run on rank 0 only unless they say ``ALL_RANKS``.
"""

from __future__ import annotations

import functools
import json
import logging
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from tensordict import TensorDict

from rltrain import stop_signals
from rltrain.errors import CollectorError, NonFiniteError, SyncError
from rltrain.hooks.base import Hook
from rltrain.loggers import Logger
from rltrain.loggers.files import json_safe
from rltrain.protocols import Algo, Collector
from rltrain.rules import PositiveInt, Satisfies, finite_number
from rltrain.run_dir import RunDirLock
from rltrain.state import TrainState
from rltrain.stop_signals import StopRequested
from rltrain.strategies import Single, Strategy

log = logging.getLogger("rltrain")
# trainer.stop_at_return; build() turns auto into the env's reward threshold.
STOP_AT_RETURN = Satisfies(lambda v: v is None or v == "auto" or finite_number(v),
                           "a number, auto (the env's reward threshold) or null (never stop early)")


class Trainer:
    def __init__(
        self,
        collector: Collector,
        algo: Algo,
        hooks: Mapping[str, Hook],
        loggers: list[Logger],
        run_dir: str | Path,
        total_frames: PositiveInt,
        stop_at_return: Annotated[float | None, STOP_AT_RETURN] = None,
        return_window: PositiveInt = 10,
        max_lag: int | None = None,
        run_dir_lock: RunDirLock | None = None,
        strategy: Strategy = Single(),
    ):
        self.collector, self.algo, self.hooks, self.loggers = collector, algo, dict(hooks), list(loggers)
        self.stop_at_return = stop_at_return
        self.max_lag = max_lag  # drop batches with frames more than this many versions old
        self.run_dir_lock = run_dir_lock  # released last, once everything is closed
        self.state = TrainState(Path(run_dir), total_frames, return_window)
        self._in_update = False  # between a batch being counted and the end of its update
        self.strategy = strategy
        self._parallel = strategy.PARALLEL
        if self._parallel:  # each phase as it begins: a rank that stops answering is named by what it last began
            self.state.timer.entered = self._note
        self._signal_seen: int | None = None  # data-parallel: a signal this rank got, until the ranks agree on it
        self._step = 1  # the step (collect, update, hooks) under way or last ended: the updates before it + 1

    def fit(self) -> dict[str, Any]:
        """Train until ``total_frames`` (or ``stop_at_return``); returns what it writes to summary.json."""
        if self._already_finished() and self.strategy.broadcast(self._saved_status()) == "completed":
            return self._nothing_to_do()
        status = "failed: unknown"
        with stop_signals.after_step(self._request_stop):  # until everything is closed: a second Ctrl-C stops at once
            try:
                for hook in self.hooks.values():
                    hook.schedule.catch_up(self.state)  # a resumed run: no hook fires for the past
                self._fire("start")
                status = self._train()
            except KeyboardInterrupt:
                status = "interrupted"
                raise
            except BaseException as e:
                status = f"failed: {type(e).__name__}: {e}"
                if self._learner_whole(e):
                    self._fire_failure(e)
                raise
            finally:
                summary = self.summary(status)
                if self.strategy.is_main:
                    write_summary(self.state.run_dir, summary)
                self._close(summary)
        return summary

    def _train(self) -> str:
        """The loop, then the end of the run (``end``) or the stop a signal asked for (``interrupt``);
        returns the run's status."""
        try:
            self._loop()
            # A signal during the last step (but not mid-way through its update) still ends the run normally,
            # unless it ends the final evaluation (StopRequested).
            state = self.state
            if state.stop_signal is None or (self._already_finished() and not state.progress.mid_update_frames):
                self._fire("end")
                return "completed"
        except StopRequested:  # an evaluation (periodic or final) cut short by the signal
            log.info("stopped during %s", "the final evaluation" if self._already_finished() else "an evaluation")
        self._fire("interrupt")
        return "interrupted"

    def _learner_whole(self, error: BaseException) -> bool:
        """Whether the learner has something to keep, whole, after ``error``: it trained; the failure came
        from outside an update (a collector, an engine, a reward, an evaluation, a weight push, a hook
        after an update), not from one or between a batch's arrival and its update's end; and nothing in
        it went NaN or infinite (the last checkpoint then stays the last finite state)."""
        return (isinstance(error, Exception) and not isinstance(error, NonFiniteError) and self.state.frames > 0
                and not self._in_update and not self.state.progress.mid_update_frames)

    def _fire_failure(self, error: Exception) -> None:
        """``on_failure`` of every hook (a checkpoint, the model saved): what the learner has is kept
        before the run ends failed. A hook that fails here is logged; the run's own error goes on."""
        for name, hook in self.hooks.items():
            try:
                with self.state.timer.phase(f"hooks/{name}" if hook.phase == "hooks" else hook.phase):
                    hook.on_failure(self.state, error)
            except Exception as e:  # noqa: BLE001
                log.error("after the failure, hook %s could not keep what it keeps: %s: %s", name, type(e).__name__, e)

    def _already_finished(self) -> bool:
        """A resumed run that had already reached its frames or its target return."""
        s = self.state
        solved = s.progress.solved_at_frames is not None
        return s.frames >= s.total_frames or (self.stop_at_return is not None and solved)

    def _nothing_to_do(self) -> dict[str, Any]:
        s = self.state
        why = (f"reached its {s.total_frames:,} frames (raise trainer.total_frames to train on)"
               if s.frames >= s.total_frames else
               f"was solved at {s.progress.solved_at_frames:,} frames (trainer.stop_at_return=null trains on)")
        log.info("nothing to do: this run already %s", why)
        summary = json.loads((s.run_dir / "summary.json").read_text())
        self._close(summary)
        return summary

    def _saved_status(self) -> str | None:
        """The status in the run dir's summary.json (a resumed run's previous session), if any."""
        try:
            return json.loads((self.state.run_dir / "summary.json").read_text()).get("status")
        except (OSError, ValueError):
            return None

    def _request_stop(self, signum: signal.Signals) -> None:
        """SIGINT/SIGTERM: finish the current step, then stop (checkpoint, summary)."""
        if self.state.stop_signal is None and self._signal_seen is None:
            log.warning("%s: stopping after the current step (Ctrl-C again to stop at once)", signum.name)
        if self._parallel:  # every rank stops after the same step: at the next agreement
            self._signal_seen = self._signal_seen or signum
        else:
            self.state.stop_signal = signum

    def _loop(self) -> None:
        """Collect and update until done or asked to stop. Once a stop is asked for, a collector or a
        weight push that fails (a scheduler signals a job's every process, and one may end first)
        ends the loop as the stop would: the run is checkpointed as it stands."""
        try:
            self._steps()
        except Exception as e:
            if self._parallel and (failure := self.strategy.failure(e, self._doing())) is not None:
                raise failure from e
            if not isinstance(e, (CollectorError, SyncError)):
                raise
            if self.state.stop_signal is None:
                raise
            log.warning("stopping as asked; what failed after the stop request is left out: %s", e)

    def _note(self, phase: str | None) -> None:
        self.strategy.note(f"{self._words(phase)} in step {self._step}")

    def _doing(self) -> str:
        """What this rank was doing when a step failed, as a data-parallel learner's error names it."""
        return self._words(self.state.timer.failed_in)

    @staticmethod
    def _words(phase: str | None) -> str:
        told = {"collect": "collecting its share of a batch", "update": "the update (its gradient averages)",
                "sync": "a weight push", None: "an agreement of the ranks on the step"}
        return told[phase] if phase in told else f"hook {phase.removeprefix('hooks/')}"

    def _steps(self) -> None:
        state, timer = self.state, self.state.timer
        self._step = state.progress.updates + 1
        if state.progress.mid_update_frames and not self._update(None):  # resumed mid-update: finish it first
            return
        batches = iter(self.collector)
        while state.frames < state.total_frames and not self._stopping():
            self._step = state.progress.updates + 1
            with timer.phase("collect"):
                batch = next(batches)
            lag = state.sync.version - batch["policy_version"]
            if self.max_lag is not None and int(lag.max()) > self.max_lag:
                state.sync.dropped_batches += 1
                state.sync.dropped_frames += batch.numel()
                state.window.add({"sync/dropped_batches": 1})
                continue
            self._in_update = True  # the batch is counted: the learner is whole again once it is trained on
            self._account(batch, lag)
            self._fire("batch", batch)
            if not self._update(batch):
                return

    def _update(self, batch: TensorDict | None) -> bool:
        """Update on ``batch`` (None: finish the interrupted update), then fire the update hooks.
        False if the run is to stop here: a stop request interrupted the update, or it is solved."""
        state, progress = self.state, self.state.progress
        self._in_update = True  # from here to the update's end, a failure leaves the learner half-way
        try:
            with state.timer.phase("update"):
                metrics = self.algo.update(batch, self._stop_requested)
        except NonFiniteError as e:
            raise NonFiniteError(f"update {progress.updates + 1} (after {state.frames:,} frames): {e}") from e
        if metrics is None:
            progress.mid_update_frames = batch.numel() if batch is not None else progress.mid_update_frames
            log.info("stopped between two gradient steps; the checkpoint holds the rest of this update")
            return False
        progress.mid_update_frames = 0
        if skipped := metrics.pop("nonfinite/skipped_steps", 0):
            state.nonfinite.skipped_steps += skipped
            state.window.accumulate({"nonfinite/skipped_steps": skipped})
        progress.updates += 1
        self._in_update = False
        due = None
        if self._parallel:
            metrics, due = self._agree_on_update(metrics)
        state.metrics = metrics
        state.window.add(metrics)
        if solved := self._solved():
            progress.solved_at_frames = progress.frames
            log.info("solved: training return %.1f >= %s after %d frames",
                     state.episodes.mean_return, self.stop_at_return, progress.frames)
        self._fire("update", last=solved or state.frames >= state.total_frames, due=due)
        return not solved

    def _stop_requested(self) -> bool:
        # Data-parallel ranks finish every update they begin: each gradient step is a collective of all ranks.
        return self.state.stop_signal is not None and not self._parallel

    def _stopping(self) -> bool:
        """Whether to stop before the next batch: a hook asked to, or a signal did (data-parallel: on any rank)."""
        state = self.state
        if self._parallel:
            self._note(None)
            stop, signum = self.strategy.max([int(state.should_stop), int(self._signal_seen or 0)])
            state.should_stop = bool(stop)
            state.stop_signal = state.stop_signal or signum or None
        return state.should_stop or state.stop_signal is not None

    def _agree_on_update(self, metrics: dict) -> tuple[dict, set[str]]:
        """Data-parallel: the update's metrics averaged over the ranks, and the hooks due (rank 0's schedules)."""
        state = self.state
        due = {name for name, hook in self.hooks.items() if hook.schedule.due(state)} if self.strategy.is_main else None
        self._note(None)
        everyone = self.strategy.gather((metrics, due))
        values: dict[str, list] = {}
        for rank_metrics, _ in everyone:
            for key, value in rank_metrics.items():
                values.setdefault(key, []).append(value)
        return {key: sum(v) / len(v) for key, v in values.items()}, everyone[0][1]

    def _account(self, batch: TensorDict, lag) -> None:
        state = self.state
        done = batch["done"]
        figures = {"frames": batch.numel(), "returns": batch["episode_return"][done].tolist(),
                   "lengths": batch["episode_length"][done].tolist(), "nonfinite": int(batch["nonfinite"].sum()),
                   "lag_mean": lag.float().mean().item(), "lag_max": int(lag.max())}
        if self._parallel:  # the whole job's batch: every rank's share
            self._note(None)
            shares = self.strategy.gather(figures)
            figures = {"frames": sum(f["frames"] for f in shares),
                       "returns": [r for f in shares for r in f["returns"]],
                       "lengths": [n for f in shares for n in f["lengths"]],
                       "nonfinite": sum(f["nonfinite"] for f in shares),
                       "lag_mean": sum(f["lag_mean"] for f in shares) / len(shares),
                       "lag_max": max(f["lag_max"] for f in shares)}
        state.progress.frames += figures["frames"]
        state.progress.batches += 1
        if figures["returns"]:
            state.episodes.add(figures["returns"], figures["lengths"])
        if replaced := figures["nonfinite"]:
            state.nonfinite.env_frames += replaced
            state.window.accumulate({"nonfinite/env_frames": replaced})
        state.sync.lag_sum += figures["lag_mean"]
        state.sync.lag_max = max(state.sync.lag_max, figures["lag_max"])
        state.window.add({"sync/lag": figures["lag_mean"]})

    def _solved(self) -> bool:
        episodes = self.state.episodes
        return (self.stop_at_return is not None and len(episodes.recent_returns) == episodes.recent_returns.maxlen
                and episodes.mean_return >= self.stop_at_return)

    def _fire(self, event: str, batch: TensorDict | None = None, last: bool = False,
              due: set[str] | None = None) -> None:
        """Call ``on_<event>`` of every hook (``update``: those due, or those named in ``due``). After the
        ``last`` update, a hook that runs at the end (``at_end``) waits for it: one final log row, with the
        final evaluation."""
        state = self.state
        for name, hook in self.hooks.items():
            if event == "update" and (not (hook.schedule.due(state) if due is None else name in due)
                                      or (last and hook.at_end)):
                continue
            with state.timer.phase(f"hooks/{name}" if hook.phase == "hooks" else hook.phase):
                if event == "batch":
                    hook.on_batch(state, batch)
                else:
                    getattr(hook, f"on_{event}")(state)

    def summary(self, status: str) -> dict[str, Any]:
        return summarize(self.state, status, self.stop_at_return)

    def _close(self, summary: dict[str, Any]) -> None:
        # Everything is closed even if one close fails. The collector goes first: its workers
        # must be gone before the weight sender (a hook) closes the channels they read; the run
        # dir's lock goes last, once nothing of this run writes there any more.
        closers = [self.collector.close]
        closers += [functools.partial(hook.close, self.state, summary) for hook in self.hooks.values()]
        closers += [functools.partial(logger.close, summary) for logger in self.loggers]
        if self.run_dir_lock is not None:
            closers.append(self.run_dir_lock.release)
        closers.append(self.strategy.close)
        stopped_at_once = None
        for close in closers:
            try:
                close()
            except KeyboardInterrupt as e:  # a second Ctrl-C: still close the rest, then stop
                stopped_at_once = e
            except Exception as e:  # noqa: BLE001
                log.error("error while closing the run: %s", e)
        if stopped_at_once is not None:
            raise stopped_at_once


# What ``python -m rltrain`` may return to a sweeper (the ``objective`` key): keys of summary.json.
OBJECTIVES = ("eval_return", "mean_eval_return", "train_return")


def summarize(s: TrainState, status: str, stop_at_return: float | None) -> dict[str, Any]:
    """What summary.json holds for a run in state ``s`` (also for one that failed to start)."""
    wall, sync = s.timer.elapsed(), s.sync
    summary = {
        "status": status,
        "frames": s.frames,
        "updates": s.updates,
        "episodes": s.episodes.count,
        "wall_time_s": round(wall, 3),
        "fps": round(s.frames / wall, 1) if wall > 0 else 0.0,
        "eval_return": s.evals.last_return,
        "mean_eval_return": s.evals.mean_return,
        "evaluations": s.evals.count,
        "train_return": s.episodes.mean_return,
        "time": s.timer.breakdown(),
        "time_hooks": s.timer.hook_breakdown(),
        "sync": {
            "pushes": sync.pushes,
            "version": sync.version,
            "mean_lag": sync.lag_sum / s.batches if s.batches else 0.0,
            "max_lag": sync.lag_max,
            "dropped_batches": sync.dropped_batches,
            "dropped_frames": sync.dropped_frames,
            "dropped_share": round(s.dropped_share, 4),
        },
        "nonfinite": {"env_frames": s.nonfinite.env_frames, "skipped_steps": s.nonfinite.skipped_steps},
    }
    # Without a target return (stop_at_return null, or an env without a threshold) solved is null.
    summary["solved"] = None if stop_at_return is None else s.progress.solved_at_frames is not None
    summary["frames_to_solve"] = s.progress.solved_at_frames
    summary["stop_at_return"] = stop_at_return
    return summary


def result_line(summary: dict[str, Any]) -> str:
    """A run's result in one line, as the CLI ends with it whatever the loggers."""
    fields = [f"status {summary['status']}", f"frames {summary['frames']:,}",
              f"{summary['wall_time_s']:.1f}s", f"{summary['fps']:,.0f} fps"]
    if summary.get("train_return") is not None:
        fields.append(f"train return {summary['train_return']:.1f}")
    if summary.get("eval_return") is not None:
        fields.append(f"eval return {summary['eval_return']:.1f}")
    if summary.get("solved"):
        fields.append(f"solved at {summary['frames_to_solve']:,} frames")
    return "done: " + " | ".join(fields)


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    """Write summary.json atomically (a reader never sees half a file)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "summary.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(json_safe(summary), indent=2) + "\n")
    tmp.replace(path)
