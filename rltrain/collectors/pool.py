"""The worker processes that ``collector=lockstep`` and ``collector=async`` share: starting them,
talking to them, and noticing (and naming) one that raises, dies or hangs.

Every wait has a deadline and watches the workers' process sentinels: a worker that raises comes
back as a CollectorError carrying its traceback (in ``details``), one that dies as a CollectorError
naming it, its pid and its exit code or signal.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import signal
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Annotated

from rltrain.collectors.rollout import allocate_frames
from rltrain.collectors.worker import worker_main
from rltrain.envs.spaces import EnvSpec
from rltrain.errors import CollectorError
from rltrain.rules import OneOf
from rltrain.sync.base import WeightReceiver

# How worker processes start (multiprocessing's start methods; collector.start_method).
StartMethod = Annotated[str, OneOf(("spawn", "forkserver", "fork"))]


class WorkerPool:
    """``workers`` processes with ``envs_per_worker`` envs each, running ``serve`` (a loop of
    rltrain.collectors.worker) over ``buffers_per_worker`` shared-memory batch buffers each, of
    ``steps`` steps. The constructor returns once every worker is ready."""

    def __init__(
        self,
        serve: Callable,
        make_env: Callable,
        make_policy: Callable,
        make_receiver: Callable[[], WeightReceiver],
        env_spec: EnvSpec,
        steps: int,
        workers: int,
        envs_per_worker: int,
        buffers_per_worker: int,
        start_method: StartMethod,
        timeout_s: float,
        seed: int,
    ):
        self.size, self.timeout_s, self._env_id = workers, timeout_s, env_spec.id
        self.buffers = [[allocate_frames(env_spec, steps, envs_per_worker, shared=True)
                         for _ in range(buffers_per_worker)] for _ in range(workers)]
        ctx = mp.get_context(start_method)
        self._conns, self._procs, self._receivers = [], [], []
        try:
            for i in range(workers):
                parent_conn, child_conn = ctx.Pipe()
                worker_env = functools.partial(make_env, num_envs=envs_per_worker, seed=seed + i * envs_per_worker)
                self._receivers.append(make_receiver())
                proc = ctx.Process(target=worker_main, name=f"rltrain-collector-{i}", daemon=True,
                                   args=(i, child_conn, worker_env, make_policy, self._receivers[-1],
                                         self.buffers[i], serve, seed + 10_000 + i))
                try:
                    proc.start()
                finally:
                    child_conn.close()
                self._conns.append(parent_conn)
                self._procs.append(proc)
                self._receivers[-1].after_spawn()
            pending = set(range(workers))
            while pending:
                for i, _msg in self.wait(pending, "ready"):
                    pending.discard(i)
        except BaseException:
            self.close()
            raise

    def send(self, i: int, msg: tuple) -> None:
        try:
            self._conns[i].send(msg)
        except OSError:  # the worker's end is gone
            self._raise_dead(i)

    def wait(self, workers: set[int], what: str) -> list[tuple[int, tuple]]:
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

    def ask_all(self, messages: tuple | list[tuple], what: str) -> list:
        """Send each worker its message (one for all, or a list) and return their answers in order."""
        for i in range(self.size):
            self.send(i, messages[i] if isinstance(messages, list) else messages)
        answers, pending = [None] * self.size, set(range(self.size))
        while pending:
            for i, msg in self.wait(pending, what):
                answers[i] = msg[1]
                pending.discard(i)
        return answers

    def _raise_dead(self, i: int):
        proc = self._procs[i]
        proc.join(timeout=1.0)
        code = proc.exitcode
        how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        hint = ("; SIGKILL often comes from the out-of-memory killer (see dmesg)" if code == -signal.SIGKILL else
                "; an env that calls os._exit or crashes its interpreter?" if code not in (None, 0) else "")
        raise CollectorError(f"collector worker {i} (pid {proc.pid}) died ({how}) while stepping {self._env_id}{hint}")

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self._procs]

    def close(self) -> None:
        """Ask every worker to stop, kill those that do not within 5 s; safe to call twice."""
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
