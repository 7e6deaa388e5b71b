"""``collector=distributed``: envs stepped on the other ranks of a torchrun job, on this machine
or others. Rank 0 is the learner; every other rank is a collector rank.

Each collector rank runs a collector of its own machine (``workers_per_rank: 0``, its envs in its
own process; N, N lock-step worker processes fed through ``shared_mem``: weights cross the network
once per rank and fan out through shared memory) and collects one batch per command of the learner.
Batches travel over rltrain's ``collect`` gloo group as one flat buffer, stamped with the versions
that acted, as everywhere else. A rank that dies or stops answering for ``timeout_s`` fails the
learner with its rank, host and pid named.

``mode`` picks the class, here and nowhere else: ``lockstep`` (``LockstepRankCollector``: every
rank collects at once and a batch gathers all of them) or ``async`` (``AsyncRankCollector``: each
rank's batch arrives on its own). Their shared part is ``rank_pool``; a rank's body is ``rank_server``.
"""

from __future__ import annotations

from typing import Annotated

from rltrain import process_groups
from rltrain.collectors.async_ranks import AsyncRankCollector
from rltrain.collectors.batch import MaxLag
from rltrain.collectors.lockstep_ranks import LockstepRankCollector
from rltrain.collectors.pool import StartMethod
from rltrain.envs.spaces import EnvSpec
from rltrain.protocols import Collector
from rltrain.rules import Integer, OneOf, PositiveInt, PositiveNumber

KINDS: dict[str, type[LockstepRankCollector | AsyncRankCollector]] = {
    "lockstep": LockstepRankCollector, "async": AsyncRankCollector}
MODES = tuple(KINDS)


MODE = OneOf(MODES)


def kind(mode: str) -> type[LockstepRankCollector | AsyncRankCollector]:
    """The class of ``collector.mode``, or ConfigError naming the modes there are."""
    MODE.check("collector.mode", mode)
    return KINDS[mode]


class DistributedCollector(Collector):
    """What ``collector=distributed`` names: constructing it makes the class of ``mode``, with the
    other arguments (so the config keeps one name and one set of keys for both)."""

    BATCH_ENVS = ("collector.envs_per_rank",)
    ON_OTHER_RANKS = True

    @staticmethod
    def check_job(world: process_groups.World | None, config: dict) -> None:
        """ConfigError for a job this collector cannot run in (checked on every rank by validate)."""
        kind(config.get("mode", "lockstep")).check_job(world, config)

    @staticmethod
    def rank_frames(config: dict, ranks: int) -> int:
        """The frames of one collector rank's batch (``serve_rank`` sizes the rank's collector by it)."""
        return kind(config.get("mode", "lockstep")).rank_frames(config, ranks)

    def __new__(cls, env_spec: EnvSpec, frames_per_batch: PositiveInt, sender,
                mode: Annotated[str, MODE] = "lockstep", envs_per_rank: PositiveInt = 8,
                workers_per_rank: Annotated[int, Integer(0, note="0: a rank steps its envs itself")] = 0,
                max_lag: MaxLag = 2, start_method: StartMethod = "spawn", timeout_s: PositiveNumber = 60.0,
                state_size: int = 0):
        return kind(mode)(env_spec, frames_per_batch, sender, envs_per_rank=envs_per_rank,
                          workers_per_rank=workers_per_rank, max_lag=max_lag, start_method=start_method,
                          timeout_s=timeout_s, state_size=state_size)
