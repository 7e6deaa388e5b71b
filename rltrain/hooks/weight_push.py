"""When the collectors get new weights: every ``sync.every`` batches, through the sync scheme.

This is the one place that decides it. ``sync.every`` is the scheme's ``every`` (the key of
``rltrain/configs/sync/*.yaml``); ``sync=none`` has none, so it never pushes.
"""

from __future__ import annotations

import time

from rltrain.hooks.base import Hook
from rltrain.state import TrainState
from rltrain.sync import WeightSender, WeightSyncScheme


class WeightPushHook(Hook):
    """Publishes a new weights version every ``sync.every`` batches."""

    phase = "sync"
    ALL_RANKS = True  # each rank of a data-parallel learner feeds its own collector

    def __init__(self, sender: WeightSender, sync: WeightSyncScheme):
        super().__init__({"batches": sync.every} if sync.every else None)
        self.sender = sender

    def on_update(self, state: TrainState) -> None:
        t0 = time.perf_counter()
        state.sync.version = self.sender.push()
        state.sync.pushes += 1
        state.window.add({"sync/push_ms": (time.perf_counter() - t0) * 1e3})

    def close(self, state: TrainState, summary) -> None:
        self.sender.close()
