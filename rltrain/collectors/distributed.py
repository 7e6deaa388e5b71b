"""``collector=distributed``: envs stepped on the other ranks of a torchrun job, on this machine
or others. Rank 0 is the learner; every other rank is a collector rank.

Each collector rank runs a collector of its own machine (``workers_per_rank: 0``, its envs in its
own process; N, N lock-step worker processes fed through ``shared_mem``: weights cross the network
once per rank and fan out through shared memory) and collects one batch per command of the learner.
Batches travel over rltrain's ``collect`` gloo group as one flat buffer, stamped with the versions
that acted, as everywhere else.

- ``mode: lockstep``: every rank collects at once and a batch gathers all of them (a rank applies
  the newest pushed weights first, so a seeded run repeats exactly).
- ``mode: async``: each rank's batch arrives on its own; the learner takes the oldest ready one
  first and commands a rank again once it took its batch, unless a batch begun now would be over
  ``max_lag`` when its turn came (backpressure: it waits for a push rather than collect waste).

Messages on the group: learner -> rank ``COLLECT`` (argument: the version to act with at least),
``STATE``, ``LOAD`` (payload: a state), ``CLOSE``; rank -> learner ``BATCH`` (payload: the frames),
``OBJECT`` (ready, a state, a load's outcome) and ``ERROR`` (what and the traceback). A rank that
dies or stops answering for ``timeout_s`` fails the learner with its rank, host and pid named.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator

import numpy as np
import torch
from tensordict import TensorDict

from rltrain import distributed as rd
from rltrain import stop_signals
from rltrain.collectors.batch import as_batch, batch_key
from rltrain.collectors.rollout import frame_layout
from rltrain.collectors.worker import Backlog
from rltrain.envs.batched import EnvSpec
from rltrain.errors import CollectorError, ConfigError
from rltrain.protocols import Collector
from rltrain.sync.base import FlatWeights

log = logging.getLogger("rltrain")

COLLECT, STATE, LOAD, CLOSE = 1, 2, 3, 4  # learner -> rank
BATCH, OBJECT, ERROR = 1, 2, 3  # rank -> learner
MODES = ("lockstep", "async")
_LEARNER_SILENCE_S = 3600.0  # a collector rank waits this long for its next command (a dead learner: at once)


def rank_steps(frames_per_batch: int, mode: str, ranks: int, envs_per_rank: int) -> int:
    """Steps of one rank's batch: lock-step batches split over every rank, async ones come from one."""
    return frames_per_batch // (envs_per_rank * (ranks if mode == "lockstep" else 1))


def check(world: rd.World | None, frames_per_batch: int, mode: str, envs_per_rank: int, workers_per_rank: int) -> int:
    """The number of collector ranks, or ConfigError (before anything starts, on every rank)."""
    if world is None:
        raise ConfigError("collector=distributed runs collectors on the other ranks of a torchrun job, but this "
                          "process is not in one (WORLD_SIZE is unset or 1); launch with torchrun --nproc-per-node=3 "
                          "-m rltrain collector=distributed sync=distributed (rank 0 learns, the rest collect), or "
                          "use collector=lockstep|async on one machine")
    if mode not in MODES:
        raise ConfigError(f"collector.mode must be {' or '.join(MODES)} (got {mode!r})")
    ranks = world.size - 1
    span = envs_per_rank * (ranks if mode == "lockstep" else 1)
    if frames_per_batch % span:
        what = (f"collector ranks x collector.envs_per_rank ({ranks} x {envs_per_rank})" if mode == "lockstep" else
                f"collector.envs_per_rank ({envs_per_rank})")
        raise ConfigError(f"collector.frames_per_batch ({frames_per_batch}) must be a multiple of {what}; e.g. "
                          f"collector.frames_per_batch={max(1, frames_per_batch // span) * span}")
    if workers_per_rank and envs_per_rank % workers_per_rank:
        raise ConfigError(f"collector.envs_per_rank ({envs_per_rank}) must be a multiple of collector.workers_per_rank "
                          f"({workers_per_rank}): each worker steps the same number of envs")
    return ranks


def _frame_buffer(spec: EnvSpec, steps: int, envs: int) -> FlatWeights:
    """One flat buffer with a view per frame key: a batch travels as one message."""
    layout = {k: (shape, torch.from_numpy(np.zeros(0, dtype)).dtype)
              for k, (shape, dtype) in frame_layout(spec, steps, envs).items()}
    return FlatWeights(layout, shared=False)


class DistributedCollector(Collector):
    """The learner's side (rank 0): commands the collector ranks and yields their batches."""

    BATCH_ENVS = ("collector.envs_per_rank",)
    ON_OTHER_RANKS = True

    @staticmethod
    def check_job(world: rd.World | None, config: dict) -> None:
        """ConfigError for a job this collector cannot run in (checked on every rank by validate)."""
        check(world, config["frames_per_batch"], config.get("mode", "lockstep"), config.get("envs_per_rank", 8),
              config.get("workers_per_rank", 0))

    def __init__(self, env_spec: EnvSpec, frames_per_batch: int, sender, mode: str = "lockstep",
                 envs_per_rank: int = 8, workers_per_rank: int = 0, max_lag: int | None = 2,
                 start_method: str = "spawn", timeout_s: float = 60.0):
        world = rd.current()
        n = check(world, frames_per_batch, mode, envs_per_rank, workers_per_rank)
        self.frames_per_batch, self.mode, self.timeout_s = frames_per_batch, mode, timeout_s
        self.max_lag = max_lag
        self._sender, self._ranks = sender, list(range(1, n + 1))
        steps = rank_steps(frames_per_batch, mode, n, envs_per_rank)
        self._buffers = {r: _frame_buffer(env_spec, steps, envs_per_rank) for r in self._ranks}
        self._frame_keys = list(frame_layout(env_spec, 1, 1))
        self._backlog = Backlog(n + 1, max_lag) if mode == "async" and max_lag is not None else None
        self._done: queue.Queue = queue.Queue()
        self._receiving: dict[int, threading.Thread] = {}  # async: the batch each commanded rank is sending
        self._owed: set[int] = set()  # ranks commanded whose answer was not read yet
        self._lost: set[int] = set()  # ranks that died or stopped answering
        self._who = {r: f"rank {r}" for r in self._ranks}
        try:
            # The watch has a store connection of its own: the join's waits hold the job's for up to timeout_s.
            watch = functools.partial(rd.raise_failures, world.address.connect(timeout_s), self._ranks)
            self._group = rd.gloo_group(world.store, "collect", 0, world.size, timeout_s, watch=watch)
        except TimeoutError as e:
            raise CollectorError(f"collector=distributed: the collector ranks did not all join within {timeout_s:g}s "
                                 f"(collector.timeout_s): {e}") from None
        for r in self._ranks:
            info = self._receive(r, OBJECT)
            self._who[r] = f"rank {r} ({info['host']}, pid {info['pid']})"
            if info["nbytes"] != self._buffers[r].buffer.numel():
                raise CollectorError(f"collector rank {r}'s batches have {info['nbytes']} bytes, the learner expects "
                                     f"{self._buffers[r].buffer.numel()}: do all ranks run the same config?")
        log.info("collector=distributed: %d collector ranks (%s), %s", n, ", ".join(self._who.values()), mode)

    # -- talking to the ranks

    def _command(self, r: int, kind: int, payload: torch.Tensor | None = None, arg: int = 0) -> None:
        try:
            rd.send_frame(self._group, r, kind, payload, arg)
        except RuntimeError as e:
            raise self._failure(r, e) from None
        self._owed.add(r)  # until its answer is read: a rank sending it cannot take another message

    def _receive(self, r: int, expect: int):
        """The next message from rank ``r``: its batch (into its buffer) or an object; raises
        CollectorError for the rank's error, its death, or its silence past ``timeout_s``."""
        try:
            kind, nbytes, _ = rd.recv_header(self._group, r, self.timeout_s)
            payload = rd.recv_payload(self._group, r, self._buffers[r].buffer if kind == BATCH else None, nbytes,
                                      self.timeout_s)
        except RuntimeError as e:
            raise self._failure(r, e) from None
        finally:
            self._owed.discard(r)
        if kind == ERROR:
            what, details = rd.decode(payload)
            raise CollectorError(f"collector {self._who[r]} failed: {what}", details=details)
        if kind != expect:
            raise CollectorError(f"collector {self._who[r]} sent message {kind} while the learner waited for {expect}")
        return None if kind == BATCH else rd.decode(payload)

    def _failure(self, r: int, e: RuntimeError) -> CollectorError:
        self._lost.add(r)
        if rd.is_peer_gone(e):
            return CollectorError(f"collector {self._who[r]} died (its connection closed; killed, or out of memory? "
                                  f"see ranks/{r}.log in the run dir and that machine's dmesg)")
        return CollectorError(f"collector {self._who[r]} sent nothing within {self.timeout_s:g}s "
                              "(collector.timeout_s): "
                              f"alive but stuck (an env step that never returns?), or its machine is unreachable. If "
                              f"the env is just slow, raise collector.timeout_s ({str(e).splitlines()[0]})")

    def _receive_in_background(self, r: int) -> None:
        def run():
            try:
                self._receive(r, BATCH)
                self._done.put((r, None))
            except BaseException as e:  # noqa: BLE001  (handed to the learner's thread)
                self._done.put((r, e))
        self._receiving[r] = threading.Thread(target=run, name=f"rltrain-recv-{r}", daemon=True)
        self._receiving[r].start()

    def _next_done(self) -> int:
        try:
            r, error = self._done.get(timeout=self.timeout_s + 5.0)  # each receive has its own timeout_s
        except queue.Empty:
            raise CollectorError(f"no collector rank answered within {self.timeout_s:g}s "
                                 "(collector.timeout_s)") from None
        if error is not None:
            raise error
        return r

    def _frames(self, r: int) -> dict[str, torch.Tensor]:
        return self._buffers[r].views

    # -- the Collector interface

    def __iter__(self) -> Iterator[TensorDict]:
        return self._lockstep() if self.mode == "lockstep" else self._async()

    def _lockstep(self) -> Iterator[TensorDict]:
        while True:
            for r in self._ranks:
                self._command(r, COLLECT, arg=self._sender.version)
            for r in self._ranks:
                self._receive(r, BATCH)
            yield as_batch({k: torch.cat([self._frames(r)[k] for r in self._ranks], dim=1) for k in self._frame_keys})

    def _async(self) -> Iterator[TensorDict]:
        idle, backlog, ready = set(self._ranks), self._backlog, []
        while True:
            for r in sorted(idle):
                if backlog is None or not backlog.too_long(r):
                    self._command(r, COLLECT, arg=-1)
                    idle.discard(r)
                    if backlog is not None:
                        backlog.started[r] += 1
                    self._receive_in_background(r)
            if not ready:
                ready.append(self._next_done())
            while not self._done.empty():
                ready.append(self._next_done())
            ready.sort(key=lambda r: int(self._frames(r)["policy_version"][0, 0]))  # the oldest: closest to max_lag
            r = ready.pop(0)
            frames = {k: v.clone() for k, v in self._frames(r).items()}
            idle.add(r)
            if backlog is not None:
                backlog.taken[r] += 1
            yield as_batch(frames)
            if backlog is not None:  # asked for the next batch: updated on this one, pushed after
                backlog.finished += 1

    def state_dict(self) -> dict | None:
        """Each rank's envs mid-episode (lock-step only: async ranks never pause). A rank that is gone,
        or fails to answer, is saved as None and resumes with fresh episodes: the learner's last
        checkpoint is written whatever the ranks do (a signal may have stopped one first)."""
        if self.mode != "lockstep":
            return None
        self._drop_owed_answers()
        asked = [r for r in self._ranks if r not in self._lost and self._ask(r, STATE)]
        answers = {r: self._answer(r) for r in asked}
        states = [answers.get(r) for r in self._ranks]
        if gone := [self._who[r] for r in self._ranks if r not in answers]:
            log.warning("checkpoint without the envs of collector %s (gone): they start fresh episodes on resume",
                        ", ".join(gone))
        return {"ranks": states} if any(s is not None for s in states) else None

    def _ask(self, r: int, kind: int) -> bool:
        try:
            self._command(r, kind)
        except CollectorError:
            return False
        return True

    def _answer(self, r: int):
        try:
            return self._receive(r, OBJECT)
        except CollectorError as e:
            log.warning("%s", e)
            return None

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("ranks", ())
        if self.mode != "lockstep" or len(saved) != len(self._ranks):
            raise ValueError(f"the checkpoint holds {len(saved)} collector ranks' envs, this job has "
                             f"{len(self._ranks)} ({self.mode})")
        loading = [(r, s) for r, s in zip(self._ranks, saved) if s is not None]
        for r, s in loading:
            self._command(r, LOAD, rd.encode(s))
        errors = [(r, self._receive(r, OBJECT)) for r, _ in loading]
        if fresh := [str(r) for r, s in zip(self._ranks, saved) if s is None]:
            log.warning("resume: the envs of collector rank(s) %s start fresh episodes (the checkpoint does not "
                        "hold them: the rank was gone when it was written)", ", ".join(fresh))
        failed = [f"rank {r}: {e}" for r, e in errors if e is not None]
        if failed:
            raise ValueError("; ".join(failed))

    def _drop_owed_answers(self) -> None:
        """Read and drop the answers of ranks commanded but not heard yet (a rank sending one takes no
        other message); ranks that died or stopped answering are left out (they would wait out the
        timeout)."""
        for r in sorted(self._owed - set(self._receiving) - self._lost):
            try:
                self._receive(r, BATCH)
            except CollectorError:
                pass

    def close(self) -> None:
        self._drop_owed_answers()
        for r in [r for r in self._ranks if r not in self._lost]:
            try:
                rd.send_frame(self._group, r, CLOSE)
            except RuntimeError:
                pass  # already gone
        # Batches still on their way: a thread left waiting in gloo would abort this process's exit.
        for thread in self._receiving.values():
            thread.join(min(self.timeout_s, 10.0))
        self._ranks, self._receiving = [], {}

    # -- the collector rank's side

    @staticmethod
    def serve(world: rd.World, make_env: Callable, make_policy: Callable, receiver, env_spec: EnvSpec,
              seed: int, version: int, frames_per_batch: int, mode: str = "lockstep", envs_per_rank: int = 8,
              workers_per_rank: int = 0, max_lag: int | None = 2, start_method: str = "spawn",
              timeout_s: float = 60.0) -> None:
        """Run collector rank ``world.rank`` until the learner says close (or is gone)."""
        n = check(world, frames_per_batch, mode, envs_per_rank, workers_per_rank)
        _RankServer(world, make_env, make_policy, receiver, env_spec, seed, version, n, frames_per_batch, mode,
                    envs_per_rank, workers_per_rank, start_method, timeout_s).run()


class _RankServer:
    """One collector rank: its local collector, its weights receiver (relayed to its workers
    through shared memory, if it has workers), and the learner's commands."""

    def __init__(self, world, make_env, make_policy, receiver, env_spec, seed, version, ranks, frames_per_batch, mode,
                 envs_per_rank, workers_per_rank, start_method, timeout_s):
        from rltrain.collectors.local import LocalCollector
        from rltrain.collectors.lockstep import LockstepCollector
        from rltrain.sync.shared_mem import SharedMemSync

        self.world, self.receiver, self.timeout_s = world, receiver, timeout_s
        self.group = None
        steps = rank_steps(frames_per_batch, mode, ranks, envs_per_rank)
        self.buffer = _frame_buffer(env_spec, steps, envs_per_rank)
        self.relay = None
        self.collector = None
        try:
            if workers_per_rank:  # weights arrive here once, then fan out to this machine's workers
                policy = make_policy()
                receiver.connect(policy)
                receiver.wait_for(version)
                local = SharedMemSync(timeout_s=timeout_s)
                self.relay = local.sender(policy, version=receiver.version)
                self.collector = LockstepCollector(make_env, make_policy, local.receiver, env_spec,
                                                   steps * envs_per_rank,
                                                   workers=workers_per_rank,
                                                   envs_per_worker=envs_per_rank // workers_per_rank,
                                                   start_method=start_method, timeout_s=timeout_s, seed=seed)
            else:  # the rank's own envs, acting with the received weights in place
                self.collector = LocalCollector(functools.partial(make_env, num_envs=envs_per_rank, seed=seed),
                                                make_policy, lambda: receiver, steps * envs_per_rank)
                receiver.wait_for(version)
            self.batches = iter(self.collector)
            self.group = rd.gloo_group(world.store, "collect", world.rank, world.size, timeout_s)
            rd.send_frame(self.group, 0, OBJECT, rd.encode({"host": world.host, "pid": os.getpid(),
                                                            "nbytes": self.buffer.buffer.numel()}))
        except BaseException:
            self._report_and_close()
            raise

    def run(self) -> None:
        """Serve the learner's commands until it says close (or is gone). A stop signal (SIGINT,
        SIGTERM) waits, as worker processes ignore it: a scheduler or torchrun signals every rank at
        once, and the learner still asks this rank for its envs' state for its last checkpoint. The
        rank then exits as stopped by that signal; a second Ctrl-C stops it at once."""
        requested: list[signal.Signals] = []

        def on_request(signum: signal.Signals) -> None:
            if not requested:
                log.warning("%s: the learner saves the run, then stops this rank (Ctrl-C again to stop at once)",
                            signum.name)
            requested.append(signum)

        try:
            with stop_signals.after_step(on_request):
                self._serve()
        except BaseException:
            self._report_and_close()
            raise
        finally:
            self._close()
        if requested:  # handed to the handler that was there before (the CLI's: exit with 128 + N)
            signal.raise_signal(requested[0])

    def _serve(self) -> None:
        while True:
            try:
                kind, nbytes, arg = rd.recv_header(self.group, 0, _LEARNER_SILENCE_S)
                payload = rd.recv_payload(self.group, 0, None, nbytes, self.timeout_s)
            except RuntimeError as e:
                if rd.is_peer_gone(e):
                    log.error("the learner (rank 0) is gone; this collector rank stops")
                    return
                raise
            if kind == CLOSE:  # the learner's weights sender says its last word right after
                self.receiver.wait_ended(5.0)
                return
            if kind == COLLECT:
                self._collect(arg)
                rd.send_frame(self.group, 0, BATCH, self.buffer.buffer)
            elif kind == STATE:
                rd.send_frame(self.group, 0, OBJECT, rd.encode(self.collector.state_dict()))
            elif kind == LOAD:
                rd.send_frame(self.group, 0, OBJECT, rd.encode(self._load(rd.decode(payload))))

    def _collect(self, version: int) -> None:
        if version >= 0:  # lock-step: act with the version pushed before this command, or newer
            self.receiver.wait_for(version)
        elif self.relay is not None:
            self.receiver.poll()
        if self.relay is not None and self.receiver.version > self.relay.version:
            self.relay.version = self.receiver.version - 1  # the workers see the learner's version numbers
            self.relay.push()
        batch = next(self.batches)
        views = self.buffer.views
        for key, view in views.items():
            view.copy_(batch[batch_key(key)])

    def _load(self, state) -> str | None:
        try:
            self.collector.load_state_dict(state)
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {e}"
        return None

    def _report_and_close(self) -> None:
        """Tell the learner what failed (it shows this rank's traceback) and wait, up to
        ``timeout_s``, until it has heard (torchrun stops every rank once this one exits), then stop."""
        e = sys.exc_info()[1]
        if not isinstance(e, KeyboardInterrupt):
            what, details = f"{type(e).__name__}: {e}", f"collector rank {self.world.rank}:\n{traceback.format_exc()}"
            try:
                if self.group is not None:
                    rd.send_frame(self.group, 0, ERROR, rd.encode((what, details)))
                    rd.recv_header(self.group, 0, self.timeout_s)  # the learner's close, or its exit
                else:
                    report_and_wait(self.world, what, details, self.timeout_s)
            except (RuntimeError, TimeoutError):
                pass
        self._close()

    def _close(self) -> None:
        """Stop this rank's collector (its workers), relay and receiver; safe to call twice."""
        if self.collector is not None:
            self.collector.close()
            self.collector = None
        if self.relay is not None:
            self.relay.close()
            self.relay = None
        self.receiver.close()


def report_and_wait(world: rd.World, what: str, details: str, timeout_s: float) -> None:
    """A rank's failure before its groups formed: through the store, until the learner saw it."""
    rd.report_failure(world.store, world.rank, what, details)
    try:
        rd.wait_for_key(world.store, f"failure_seen/{world.rank}", timeout_s)
    except TimeoutError:
        pass  # the learner may be gone itself
