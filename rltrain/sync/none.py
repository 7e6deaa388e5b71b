"""``sync=none``: the learner never pushes; collectors keep the weights they started with."""

from __future__ import annotations

from torch import nn

from rltrain.sync.base import WeightReceiver, WeightSender, WeightSyncScheme


class _NoSender(WeightSender):
    def push(self) -> int:
        return self.version


class _NoReceiver(WeightReceiver):
    def connect(self, policy: nn.Module) -> None:
        pass

    def poll(self) -> bool:
        return False


class NoSync(WeightSyncScheme):
    """Never moves weights: useful as a baseline, or for collectors with a fixed policy."""

    def sender(self, policy: nn.Module) -> WeightSender:
        return _NoSender()

    def receiver(self) -> WeightReceiver:
        return _NoReceiver()
