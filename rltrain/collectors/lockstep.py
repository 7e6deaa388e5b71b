"""``collector=lockstep``: envs stepped in worker processes, in lock-step.

Each batch gathers ``frames_per_batch`` frames from all workers at once; workers pick up new
weights between batches, so a batch acts with the newest pushed weights (and a seeded run repeats
exactly). Between batches every worker can hand over its envs mid-episode for a checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from tensordict import TensorDict

from rltrain.collectors.batch import as_batch, batch_steps
from rltrain.collectors.pool import StartMethod, WorkerPool
from rltrain.collectors.worker import serve_lockstep
from rltrain.envs.spaces import EnvSpec
from rltrain.protocols import Collector
from rltrain.rules import PositiveInt, PositiveNumber
from rltrain.sync.base import WeightReceiver


class LockstepCollector(Collector):
    """``workers`` processes with ``envs_per_worker`` envs each; a batch is ``[T, workers x envs_per_worker]``."""

    # The envs one batch spans (a product of these config keys): frames_per_batch must be a multiple.
    BATCH_ENVS = ("collector.workers", "collector.envs_per_worker")
    RANK_SPLIT = ("collector.workers",)  # strategy=ddp: each rank runs its share of the worker processes

    def __init__(self, make_env: Callable, make_policy: Callable, make_receiver: Callable[[], WeightReceiver],
                 env_spec: EnvSpec, frames_per_batch: PositiveInt, workers: PositiveInt = 2,
                 envs_per_worker: PositiveInt = 8, start_method: StartMethod = "spawn",
                 timeout_s: PositiveNumber = 60.0, seed: int = 0, state_size: int = 0):
        steps = batch_steps(frames_per_batch, workers * envs_per_worker, " x ".join(self.BATCH_ENVS))
        self.frames_per_batch = frames_per_batch
        self.pool = WorkerPool(serve_lockstep, make_env, make_policy, make_receiver, env_spec, steps=steps,
                               workers=workers, envs_per_worker=envs_per_worker, buffers_per_worker=1,
                               start_method=start_method, timeout_s=timeout_s, seed=seed, state_size=state_size)

    def __iter__(self) -> Iterator[TensorDict]:
        pool, everyone = self.pool, set(range(self.pool.size))
        while True:
            for i in everyone:
                pool.send(i, ("collect",))
            pending = set(everyone)
            while pending:
                for i, _msg in pool.wait(pending, "batch"):
                    pending.discard(i)
            # Concatenating along the env dim copies the frames out of the shared buffers.
            buffers = [worker[0] for worker in pool.buffers]
            yield as_batch({k: torch.cat([b[k] for b in buffers], dim=1) for k in buffers[0]})

    def state_dict(self) -> dict | None:
        """Every worker's envs mid-episode and its sampling generator, asked for between batches."""
        states = self.pool.ask_all(("state",), "state")
        return None if any(s is None for s in states) else {"workers": states}

    def load_state_dict(self, state: dict) -> None:
        if len(state["workers"]) != self.pool.size:
            raise ValueError(f"the checkpoint holds {len(state['workers'])} workers' envs, this collector has "
                             f"{self.pool.size}")
        errors = self.pool.ask_all([("load", s) for s in state["workers"]], "loaded")
        failed = [f"worker {i}: {e}" for i, e in enumerate(errors) if e is not None]
        if failed:
            raise ValueError("; ".join(failed))

    def close(self) -> None:
        self.pool.close()
