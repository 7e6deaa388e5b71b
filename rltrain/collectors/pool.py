"""The worker processes that ``collector=lockstep`` and ``collector=async`` share: starting them,
talking to them, and noticing (and naming) one that raises, dies or hangs.

Every wait has a deadline and watches the workers' process sentinels (``rltrain.child_process``): a
worker that raises comes back as a CollectorError carrying its traceback (in ``details``), one that
dies as a CollectorError naming it, its pid and its exit code or signal.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Annotated

from rltrain.child_process import ChildProcess, answers, close_all
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
        state_size: int = 0,  # the policy's memory per env (frames then hold the state each action came from)
    ):
        self.size, self.timeout_s, self._env_id = workers, timeout_s, env_spec.id
        self.buffers = [[allocate_frames(env_spec, steps, envs_per_worker, shared=True, state_size=state_size)
                         for _ in range(buffers_per_worker)] for _ in range(workers)]
        self._children: list[ChildProcess] = []
        self._receivers: list[WeightReceiver] = []
        try:
            for i in range(workers):
                worker_env = functools.partial(make_env, num_envs=envs_per_worker, seed=seed + i * envs_per_worker)
                self._receivers.append(receiver := make_receiver())
                self._children.append(ChildProcess(
                    functools.partial(worker_main, i),
                    (worker_env, make_policy, receiver, self.buffers[i], serve, seed + 10_000 + i),
                    f"collector worker {i}", name=f"rltrain-collector-{i}", method=start_method,
                    error=CollectorError, task=f"stepping {self._env_id}",
                    exit_hint="an env that calls os._exit or crashes its interpreter?"))
                receiver.after_spawn()
            pending = set(range(workers))
            while pending:
                for i, _msg in self.wait(pending, "ready"):
                    pending.discard(i)
                    self._children[i].doing = None  # from now on its own error says what it was doing
        except BaseException:
            self.close()
            raise

    def send(self, i: int, msg: tuple) -> None:
        self._children[i].send(msg)

    def wait(self, workers: set[int], what: str) -> list[tuple[int, tuple]]:
        """``what`` messages (a tag: ready, batch, state, loaded) from any of ``workers``; raises
        CollectorError on a worker error, death or timeout, or on any other message."""
        deadline = time.monotonic() + self.timeout_s
        index = {self._children[i]: i for i in workers}
        while not (got := answers(index, what, deadline)):
            if time.monotonic() > deadline:
                pids = ", ".join(str(self._children[i].pid) for i in sorted(workers))
                raise CollectorError(f"no {what!r} message from collector worker(s) {sorted(workers)} within "
                                     f"{self.timeout_s}s (collector.timeout_s); they are alive but stuck (pids "
                                     f"{pids}; a {self._env_id} step or reset that never returns?). If the env is "
                                     "just slow, raise collector.timeout_s")
        return [(index[child], msg) for child, msg in got]

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

    @property
    def pids(self) -> list[int]:
        return [child.pid for child in self._children]

    def close(self) -> None:
        """Ask every worker to stop, kill those that do not within 5 s; safe to call twice."""
        close_all(self._children, 5.0)
        for receiver in self._receivers:  # the learner's copies (a pipe's read end, say)
            receiver.close()
        self._children, self._receivers = [], []
