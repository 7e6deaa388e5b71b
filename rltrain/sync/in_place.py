"""``sync=in_place``: nothing moves. What acts holds the learner's own weights (``engine=learner``
generates with the learner's model), so every push is the learner's weights as they are: a push only
numbers the new version, which the engine stamps on the completions it generates."""

from __future__ import annotations

from torch import nn

from rltrain.sync.base import WeightReceiver, WeightSender, WeightSyncScheme


class _Versions:
    """The version the learner's weights are at, which the sender advances and the receivers read."""

    def __init__(self, version: int):
        self.version = version


class _NumberingSender(WeightSender):
    def __init__(self, versions: _Versions):
        self._versions = versions
        self.version = versions.version

    def push(self) -> int:
        self._versions.version = self.version = self.version + 1
        return self.version


class _LearnerWeightsReceiver(WeightReceiver):
    def __init__(self, versions: _Versions):
        self._versions = versions
        self.version = versions.version

    def connect(self, policy: nn.Module) -> None:
        """Nothing to bind: ``policy`` is the learner's model."""

    def poll(self) -> bool:
        changed, self.version = self.version != self._versions.version, self._versions.version
        return changed


class InPlaceSync(WeightSyncScheme):
    """The learner's weights are what acts: an engine of the learner's process generating with its model."""

    DELIVERS = "learner"

    def __init__(self):
        super().__init__(every=1)  # a version per update: the engine always generates with the newest weights
        self._versions = _Versions(0)

    def sender(self, policy: nn.Module, version: int = 0) -> WeightSender:
        self._versions.version = version
        return _NumberingSender(self._versions)

    def receiver(self) -> WeightReceiver:
        return _LearnerWeightsReceiver(self._versions)
