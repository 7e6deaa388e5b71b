"""Pushes the learner's policy weights to the collectors through the weight-sync sender."""

from __future__ import annotations

import time
from collections.abc import Mapping

from rltrain.hooks.base import Hook
from rltrain.sync import WeightSender


class WeightPushHook(Hook):
    """Publishes a new weights version on its schedule (``sync.every`` batches by default)."""

    phase = "sync"

    def __init__(self, sender: WeightSender, every: Mapping[str, float] | None = None):
        super().__init__(every)
        self.sender = sender

    def on_update(self, state) -> None:
        t0 = time.perf_counter()
        version = self.sender.push()
        if version != state.version:  # sync=none publishes nothing
            state.version, state.pushes = version, state.pushes + 1
        state.window.add({"sync/push_ms": (time.perf_counter() - t0) * 1e3})

    def close(self, state, summary) -> None:
        self.sender.close()
