"""Collectors: run envs with a policy copy fed by weight sync, and yield TensorDict batches.

Attributes are imported lazily: a spawned worker imports ``rltrain.collectors.worker`` and must
not pull in tensordict through this package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rltrain.collectors.local import LocalCollector
    from rltrain.collectors.multiprocess import MultiprocessCollector

__all__ = ["LocalCollector", "MultiprocessCollector"]


def __getattr__(name: str):
    if name == "LocalCollector":
        from rltrain.collectors.local import LocalCollector

        return LocalCollector
    if name == "MultiprocessCollector":
        from rltrain.collectors.multiprocess import MultiprocessCollector

        return MultiprocessCollector
    raise AttributeError(f"module 'rltrain.collectors' has no attribute {name!r}")
