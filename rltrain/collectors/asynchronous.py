"""``collector=async``: envs stepped in free-running worker processes.

Each worker collects non-stop into two shared-memory buffers of its own; the learner takes
whichever worker's batch is ready (``frames_per_batch`` frames from one worker) and workers pick
up new weights between env steps, so a batch may mix versions: every frame is stamped with the
one it acted with, and the trainer drops batches older than ``max_lag`` versions. A worker whose
next batch would already be that old when the learner reached it waits instead (backpressure,
``worker.Backlog``), so dropped batches stay the exception even with a slow learner. Workers
never pause for checkpoints, so their envs are not saved (a resumed run starts fresh episodes).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

from tensordict import TensorDict

from rltrain.collectors.backlog import Backlog
from rltrain.collectors.batch import MaxLag, as_batch, batch_steps
from rltrain.collectors.pool import StartMethod, WorkerPool
from rltrain.collectors.worker import serve_async
from rltrain.envs.spaces import EnvSpec
from rltrain.protocols import Collector
from rltrain.rules import PositiveInt, PositiveNumber
from rltrain.sync.base import WeightReceiver


class AsyncCollector(Collector):
    """``workers`` free-running processes with ``envs_per_worker`` envs each; a batch is ``[T, envs_per_worker]``."""

    BATCH_ENVS = ("collector.envs_per_worker",)  # the envs one batch spans: frames_per_batch is a multiple

    def __init__(self, make_env: Callable, make_policy: Callable, make_receiver: Callable[[], WeightReceiver],
                 env_spec: EnvSpec, frames_per_batch: PositiveInt, workers: PositiveInt = 2,
                 envs_per_worker: PositiveInt = 8, max_lag: MaxLag = 2, start_method: StartMethod = "spawn",
                 timeout_s: PositiveNumber = 60.0, seed: int = 0, state_size: int = 0):
        steps = batch_steps(frames_per_batch, envs_per_worker, " x ".join(self.BATCH_ENVS))
        self.frames_per_batch, self.max_lag = frames_per_batch, max_lag
        # Backpressure: a worker holds off rather than collect a batch the learner would drop as too old.
        self._backlog = Backlog(workers, max_lag) if max_lag is not None else None
        serve = functools.partial(serve_async, backlog=self._backlog)
        self.pool = WorkerPool(serve, make_env, make_policy, make_receiver, env_spec, steps=steps, workers=workers,
                               envs_per_worker=envs_per_worker, buffers_per_worker=2, start_method=start_method,
                               timeout_s=timeout_s, seed=seed, state_size=state_size)

    def __iter__(self) -> Iterator[TensorDict]:
        pool, everyone = self.pool, set(range(self.pool.size))
        while True:
            ready = pool.wait(everyone, "batch")  # the oldest first: it is the closest to max_lag
            for i, msg in sorted(ready, key=lambda m: int(pool.buffers[m[0]][m[1][1]]["policy_version"][0, 0])):
                slot = msg[1]
                frames = {k: v.clone() for k, v in pool.buffers[i][slot].items()}
                if self._backlog is not None:
                    self._backlog.taken[i] += 1
                pool.send(i, ("free", slot))
                yield as_batch(frames)
                if self._backlog is not None:  # asked for the next batch: updated on it, pushed after
                    self._backlog.finished += 1

    def close(self) -> None:
        self.pool.close()
