"""Collectors: run envs with a policy copy fed by weight sync, and yield TensorDict batches.

One class per way of working, over shared pieces (``Rollout``, the ``WorkerPool``, the batch
buffers): ``LocalCollector`` (in the learner's process), ``LockstepCollector`` and
``AsyncCollector`` (worker processes), ``LockstepRankCollector`` and ``AsyncRankCollector`` (other
ranks of a torchrun job; ``DistributedCollector``, what ``collector=distributed`` names, picks one).
Attributes are imported lazily: a spawned worker imports
``rltrain.collectors.worker`` and must not pull in tensordict through this package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rltrain.collectors.async_ranks import AsyncRankCollector
    from rltrain.collectors.asynchronous import AsyncCollector
    from rltrain.collectors.distributed import DistributedCollector
    from rltrain.collectors.generation import GenerationCollector
    from rltrain.collectors.local import LocalCollector
    from rltrain.collectors.lockstep import LockstepCollector
    from rltrain.collectors.lockstep_ranks import LockstepRankCollector

_MODULES = {"LocalCollector": "local", "LockstepCollector": "lockstep", "AsyncCollector": "asynchronous",
            "DistributedCollector": "distributed", "LockstepRankCollector": "lockstep_ranks",
            "AsyncRankCollector": "async_ranks", "GenerationCollector": "generation"}
__all__ = ["AsyncCollector", "AsyncRankCollector", "DistributedCollector", "GenerationCollector", "LocalCollector",
           "LockstepCollector", "LockstepRankCollector"]


def __getattr__(name: str):
    if name in _MODULES:
        return getattr(importlib.import_module(f"rltrain.collectors.{_MODULES[name]}"), name)
    if name == "MultiprocessCollector":
        raise AttributeError("rltrain.collectors.MultiprocessCollector is now two classes: LockstepCollector "
                             "(it was mode: sync) and AsyncCollector (mode: async)")
    raise AttributeError(f"module 'rltrain.collectors' has no attribute {name!r}")
