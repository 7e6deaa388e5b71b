"""``collector=distributed`` with ``mode: lockstep``: every collector rank collects at once and a
batch gathers all of them, ``[T, ranks x envs_per_rank]``.

A rank applies the newest pushed weights before each batch (the learner names the version), so a
seeded run repeats exactly. Between batches every rank can hand over its envs mid-episode for a
checkpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
from tensordict import TensorDict

from rltrain import process_groups
from rltrain.collectors.batch import as_batch
from rltrain.collectors.rank_pool import (
    BATCH,
    COLLECT,
    LOAD,
    OBJECT,
    STATE,
    RankCollector,
    check_rank_batch,
    collector_ranks,
)

log = logging.getLogger("rltrain")


class LockstepRankCollector(RankCollector):
    """The learner's side: commands every collector rank at once; a batch is each rank's
    ``frames_per_batch / ranks`` frames side by side."""

    KIND = "lockstep"

    @staticmethod
    def check_job(world: process_groups.World | None, config: dict) -> None:
        """ConfigError for a job this collector cannot run in (checked on every rank by validate)."""
        ranks, envs = collector_ranks(world), config.get("envs_per_rank", 8)
        check_rank_batch(config["frames_per_batch"], ranks * envs, "collector ranks x collector.envs_per_rank",
                         f"{ranks} x {envs}", envs, config.get("workers_per_rank", 0))

    @staticmethod
    def rank_frames(config: dict, ranks: int) -> int:
        """The frames of one rank's batch: every rank's together make one."""
        return config["frames_per_batch"] // ranks

    def __iter__(self) -> Iterator[TensorDict]:
        pool = self.pool
        while True:
            for r in pool.ranks:
                pool.command(r, COLLECT, arg=self._sender.version)
            for r in pool.ranks:
                pool.receive(r, BATCH)
            yield as_batch({k: torch.cat([pool.frames(r)[k] for r in pool.ranks], dim=1) for k in pool.frame_keys})

    def state_dict(self) -> dict | None:
        """Each rank's envs mid-episode. A rank that is gone, or fails to answer, is saved as None
        and resumes with fresh episodes: the learner's last checkpoint is written whatever the
        ranks do (a signal may have stopped one first)."""
        pool = self.pool
        pool.drop_owed_answers()
        asked = [r for r in pool.ranks if r not in pool.lost and pool.ask(r, STATE)]
        answers = {r: pool.answer(r) for r in asked}
        states = [answers.get(r) for r in pool.ranks]
        if gone := [pool.who[r] for r in pool.ranks if r not in answers]:
            log.warning("checkpoint without the envs of collector %s (gone): they start fresh episodes on resume",
                        ", ".join(gone))
        return {"ranks": states} if any(s is not None for s in states) else None

    def load_state_dict(self, state: dict) -> None:
        pool, saved = self.pool, state.get("ranks", ())
        if len(saved) != len(pool.ranks):
            raise ValueError(f"the checkpoint holds {len(saved)} collector ranks' envs, this job has "
                             f"{len(pool.ranks)} (lockstep)")
        loading = [(r, s) for r, s in zip(pool.ranks, saved) if s is not None]
        for r, s in loading:
            pool.command(r, LOAD, process_groups.encode(s))
        errors = [(r, pool.receive(r, OBJECT)) for r, _ in loading]
        if fresh := [str(r) for r, s in zip(pool.ranks, saved) if s is None]:
            log.warning("resume: the envs of collector rank(s) %s start fresh episodes (the checkpoint does not "
                        "hold them: the rank was gone when it was written)", ", ".join(fresh))
        failed = [f"rank {r}: {e}" for r, e in errors if e is not None]
        if failed:
            raise ValueError("; ".join(failed))

