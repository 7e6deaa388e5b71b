"""``collector=distributed`` with ``mode: async``: each collector rank's batch arrives on its own,
``[T, envs_per_rank]``, acting with the newest weights the rank holds.

The learner takes the oldest ready batch first and commands a rank again once it took its batch,
unless a batch begun now would be over ``max_lag`` when its turn came (backpressure, as for async
worker processes: it waits for a push rather than collect waste). Ranks never pause for
checkpoints, so their envs are not saved (a resumed run starts fresh episodes).
"""

from __future__ import annotations

from collections.abc import Iterator

from tensordict import TensorDict

from rltrain import process_groups
from rltrain.collectors.backlog import Backlog
from rltrain.collectors.batch import as_batch
from rltrain.collectors.rank_pool import COLLECT, RankCollector, check_rank_batch, collector_ranks
from rltrain.envs.spaces import EnvSpec


class AsyncRankCollector(RankCollector):
    """The learner's side: keeps every collector rank collecting; a batch is one rank's
    ``frames_per_batch`` frames."""

    KIND = "async"

    @staticmethod
    def check_job(world: process_groups.World | None, config: dict) -> None:
        """ConfigError for a job this collector cannot run in (checked on every rank by validate)."""
        collector_ranks(world)
        envs = config.get("envs_per_rank", 8)
        check_rank_batch(config["frames_per_batch"], envs, "collector.envs_per_rank", str(envs), envs,
                         config.get("workers_per_rank", 0))

    @staticmethod
    def rank_frames(config: dict, ranks: int) -> int:
        """The frames of one rank's batch: each is a batch of its own."""
        return config["frames_per_batch"]

    def __init__(self, env_spec: EnvSpec, frames_per_batch: int, sender=None, envs_per_rank: int = 8,
                 workers_per_rank: int = 0, max_lag: int | None = 2, start_method: str = "spawn",
                 timeout_s: float = 60.0, state_size: int = 0):
        # ``sender`` is not needed: a rank acts with the newest weights it holds, whatever their version.
        super().__init__(env_spec, frames_per_batch, None, envs_per_rank, workers_per_rank, max_lag, start_method,
                         timeout_s, state_size)
        # Backpressure: a rank is not commanded for a batch the learner would drop as too old (indexed by rank).
        self._backlog = Backlog(len(self.pool.ranks) + 1, max_lag) if max_lag is not None else None

    def __iter__(self) -> Iterator[TensorDict]:
        pool, backlog = self.pool, self._backlog
        idle, ready = set(pool.ranks), []
        while True:
            for r in sorted(idle):
                if backlog is None or not backlog.too_long(r):
                    pool.command(r, COLLECT, arg=-1)
                    idle.discard(r)
                    if backlog is not None:
                        backlog.started[r] += 1
                    pool.receive_in_background(r)
            if not ready:
                ready.append(pool.next_done())
            while pool.any_done():
                ready.append(pool.next_done())
            ready.sort(key=lambda r: int(pool.frames(r)["policy_version"][0, 0]))  # the oldest: closest to max_lag
            r = ready.pop(0)
            frames = {k: v.clone() for k, v in pool.frames(r).items()}
            idle.add(r)
            if backlog is not None:
                backlog.taken[r] += 1
            yield as_batch(frames)
            if backlog is not None:  # asked for the next batch: updated on this one, pushed after
                backlog.finished += 1

    def load_state_dict(self, state: dict) -> None:
        raise ValueError(f"the checkpoint holds {len(state.get('ranks', ()))} collector ranks' envs, this job has "
                         f"{len(self.pool.ranks)} (async)")

