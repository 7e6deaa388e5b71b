"""``collector=sync`` and ``collector=async``: envs stepped in worker processes.

sync: each batch gathers ``frames_per_batch`` frames from all workers in lock-step; workers pick
up new weights between batches. async: workers collect continuously into two shared-memory
buffers each; the learner takes whichever worker's batch is ready (``frames_per_batch`` frames
from one worker), and workers pick up new weights between steps.

Every wait has a deadline and watches the workers' process sentinels: a worker that raises comes
back as a CollectorError carrying its traceback, one that dies as a CollectorError naming it and
its exit code.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import signal
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait

import torch
from tensordict import TensorDict

from rltrain.collectors.batch import as_batch
from rltrain.collectors.rollout import allocate_frames
from rltrain.collectors.worker import worker_main
from rltrain.envs.batched import EnvSpec
from rltrain.errors import CollectorError
from rltrain.protocols import Collector
from rltrain.sync.base import WeightReceiver

MODES = ("sync", "async")


class MultiprocessCollector(Collector):
    """``workers`` processes with ``envs_per_worker`` envs each, in ``mode`` sync or async."""

    def __init__(
        self,
        make_env: Callable,
        make_policy: Callable,
        make_receiver: Callable[[], WeightReceiver],
        env_spec: EnvSpec,
        frames_per_batch: int,
        workers: int = 2,
        envs_per_worker: int = 4,
        mode: str = "sync",
        max_lag: int | None = None,
        start_method: str = "spawn",
        timeout_s: float = 60.0,
        seed: int = 0,
    ):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES} (got {mode!r})")
        envs_per_batch = workers * envs_per_worker if mode == "sync" else envs_per_worker
        if frames_per_batch % envs_per_batch:
            raise ValueError(f"frames_per_batch ({frames_per_batch}) must be a multiple of {envs_per_batch}")
        self.mode, self.workers, self.max_lag, self.timeout_s = mode, workers, max_lag, timeout_s
        self._env_id = env_spec.id
        self.frames_per_batch = frames_per_batch
        steps = frames_per_batch // envs_per_batch
        n_buffers = 1 if mode == "sync" else 2
        self._buffers = [[allocate_frames(env_spec, steps, envs_per_worker, shared=True) for _ in range(n_buffers)]
                         for _ in range(workers)]
        ctx = mp.get_context(start_method)
        self._conns, self._procs, self._receivers = [], [], []
        try:
            for i in range(workers):
                parent_conn, child_conn = ctx.Pipe()
                worker_env = functools.partial(make_env, num_envs=envs_per_worker, seed=seed + i * envs_per_worker)
                self._receivers.append(make_receiver())
                proc = ctx.Process(
                    target=worker_main, name=f"rltrain-collector-{i}", daemon=True,
                    args=(i, child_conn, worker_env, make_policy, self._receivers[-1], self._buffers[i], mode,
                          seed + 10_000 + i),
                )
                try:
                    proc.start()
                finally:
                    child_conn.close()
                self._conns.append(parent_conn)
                self._procs.append(proc)
                self._receivers[-1].after_spawn()
            pending = set(range(workers))
            while pending:
                for i, _msg in self._wait(pending, "ready"):
                    pending.discard(i)
        except BaseException:
            self.close()
            raise

    def __iter__(self) -> Iterator[TensorDict]:
        return self._sync_batches() if self.mode == "sync" else self._async_batches()

    def _sync_batches(self) -> Iterator[TensorDict]:
        everyone = set(range(self.workers))
        while True:
            for i in everyone:
                self._send(i, ("collect",))
            pending = set(everyone)
            while pending:
                for i, _msg in self._wait(pending, "batch"):
                    pending.discard(i)
            keys = self._buffers[0][0].keys()
            # Concatenating along the env dim copies the frames out of the shared buffers.
            yield as_batch({k: torch.cat([self._buffers[i][0][k] for i in range(self.workers)], dim=1) for k in keys})

    def _async_batches(self) -> Iterator[TensorDict]:
        everyone = set(range(self.workers))
        while True:
            for i, msg in self._wait(everyone, "batch"):
                slot = msg[1]
                frames = {k: v.clone() for k, v in self._buffers[i][slot].items()}
                self._send(i, ("free", slot))
                yield as_batch(frames)

    def _send(self, i: int, msg: tuple) -> None:
        try:
            self._conns[i].send(msg)
        except OSError:  # the worker's end is gone
            self._raise_dead(i)

    def _wait(self, workers: set[int], what: str) -> list[tuple[int, tuple]]:
        """``what`` messages (a tag: ready, batch, state, loaded) from any of ``workers``; raises
        CollectorError on a worker error, death or timeout, or on any other message."""
        deadline = time.monotonic() + self.timeout_s
        by_handle = {self._conns[i]: i for i in workers} | {self._procs[i].sentinel: i for i in workers}
        while True:
            ready = wait(list(by_handle), timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            messages = []
            for handle in ready:
                i = by_handle[handle]
                if handle is self._conns[i]:
                    try:
                        msg = handle.recv()
                    except (EOFError, OSError):
                        self._raise_dead(i)
                    if msg[0] == "error":
                        when = " while starting" if what == "ready" else ""
                        raise CollectorError(f"collector worker {i} (pid {self._procs[i].pid}) failed{when}: {msg[1]}",
                                             details=msg[2])
                    if msg[0] != what:  # out of step: never read a buffer the worker may be writing
                        raise CollectorError(f"collector worker {i} sent {msg[0]!r} while the learner waited for "
                                             f"{what!r}")
                    messages.append((i, msg))
                elif not self._conns[i].poll():  # died with nothing left to say
                    self._raise_dead(i)
            if messages:
                return messages
            if time.monotonic() > deadline:
                pids = ", ".join(str(self._procs[i].pid) for i in sorted(workers))
                raise CollectorError(f"no {what!r} message from collector worker(s) {sorted(workers)} within "
                                     f"{self.timeout_s}s (collector.timeout_s); they are alive but stuck (pids "
                                     f"{pids}; a {self._env_id} step or reset that never returns?). If the env is "
                                     "just slow, raise collector.timeout_s")

    def _raise_dead(self, i: int):
        proc = self._procs[i]
        proc.join(timeout=1.0)
        code = proc.exitcode
        how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        hint = ("; SIGKILL often comes from the out-of-memory killer (see dmesg)" if code == -signal.SIGKILL else
                "; an env that calls os._exit or crashes its interpreter?" if code not in (None, 0) else "")
        raise CollectorError(f"collector worker {i} (pid {proc.pid}) died ({how}) while stepping {self._env_id}{hint}")

    def state_dict(self) -> dict | None:
        """sync mode: every worker's envs mid-episode and its sampling generator, asked for between
        batches. async workers never pause, so theirs are not saved: a resumed run starts them on
        fresh episodes (the factory reseeds them so they do not replay the first run's)."""
        if self.mode != "sync":
            return None
        states = self._ask_all(("state",), "state")
        return None if any(s is None for s in states) else {"workers": states}

    def load_state_dict(self, state: dict) -> None:
        if self.mode != "sync":
            raise ValueError("collector=async does not restore worker envs")
        if len(state["workers"]) != self.workers:
            raise ValueError(f"the checkpoint holds {len(state['workers'])} workers' envs, this collector has "
                             f"{self.workers}")
        errors = self._ask_all([("load", s) for s in state["workers"]], "loaded")
        failed = [f"worker {i}: {e}" for i, e in enumerate(errors) if e is not None]
        if failed:
            raise ValueError("; ".join(failed))

    def _ask_all(self, messages, what: str) -> list:
        """Send each worker its message (one for all, or a list) and return their answers in order."""
        for i in range(self.workers):
            self._send(i, messages[i] if isinstance(messages, list) else messages)
        answers, pending = [None] * self.workers, set(range(self.workers))
        while pending:
            for i, msg in self._wait(pending, what):
                answers[i] = msg[1]
                pending.discard(i)
        return answers

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(("close",))
            except OSError:
                pass
        deadline = time.monotonic() + 5.0
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
        for conn in self._conns:
            conn.close()
        for receiver in self._receivers:  # the learner's copies (a pipe's read end, say)
            receiver.close()
        self._conns, self._procs, self._receivers = [], [], []
