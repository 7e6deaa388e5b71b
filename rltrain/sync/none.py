"""``sync=none``: the learner never pushes; collectors keep the learner's initial weights."""

from __future__ import annotations

from torch import nn

from rltrain.sync.base import FlatBuffer, WeightReceiver, WeightSender, WeightSyncScheme, named_weights


class _NoSender(WeightSender):
    def __init__(self, initial: FlatBuffer):
        self._initial = initial

    def push(self) -> int:
        return self.version

    def published(self) -> dict:
        return {name: view.clone() for name, view in self._initial.views.items()}


class _InitialWeightsReceiver(WeightReceiver):
    def __init__(self, initial: FlatBuffer, version: int):
        self._initial, self.version = initial, version

    def connect(self, policy: nn.Module) -> None:
        self._initial.check_matches(policy)
        self._initial.copy_into(named_weights(policy))

    def poll(self) -> bool:
        return False


class NoSync(WeightSyncScheme):
    """Never moves weights after the start: a baseline, or for collectors with a fixed policy."""

    PUSHES = False

    def __init__(self):
        self._initial: FlatBuffer | None = None
        self._version = 0

    def sender(self, policy: nn.Module, version: int = 0) -> WeightSender:
        self._initial = FlatBuffer.like(policy, shared=False)
        self._initial.copy_from(named_weights(policy))
        self._version = version
        sender = _NoSender(self._initial)
        sender.version = version
        return sender

    def receiver(self) -> WeightReceiver:
        return _InitialWeightsReceiver(self._initial, self._version)
