"""The weight-sync interface every scheme implements.

The learner's ``WeightSender`` publishes versioned snapshots of the policy (parameters and
buffers); each collector's ``WeightReceiver`` copies the newest one into its own policy at a
boundary it chooses. Receivers are built on the learner and handed to collectors (in another
process for the multi-process collectors), so they hold only picklable state until ``connect``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from tensordict import TensorDict
from torch import nn

from rltrain.errors import SyncError


class WeightSender(ABC):
    """Learner side: ``push`` publishes the policy's current weights as version ``version + 1``."""

    version: int = 0
    pushes: int = 0

    @abstractmethod
    def push(self) -> int:
        """Snapshot the learner's policy and publish it; returns the new version."""

    def close(self) -> None:
        """Release what the sender holds (shared memory, pipes, process groups)."""


class WeightReceiver(ABC):
    """Collector side: applies the newest published snapshot to a local policy copy."""

    version: int = 0

    @abstractmethod
    def connect(self, policy: nn.Module) -> None:
        """Bind to the collector's policy, check its layout against the snapshot, apply the newest one."""

    @abstractmethod
    def poll(self) -> bool:
        """Apply the newest snapshot if it is newer than ``version``; return whether weights changed."""

    def close(self) -> None:
        """Release what the receiver holds."""


class WeightSyncScheme(ABC):
    """A way of moving weights from one learner to its collectors."""

    @abstractmethod
    def sender(self, policy: nn.Module) -> WeightSender:
        """Create the learner's sender for ``policy``; call once, before any receiver."""

    @abstractmethod
    def receiver(self) -> WeightReceiver:
        """Create a receiver for one collector (or collector worker)."""


def weights_of(policy: nn.Module) -> TensorDict:
    """The policy's parameters and buffers as a TensorDict of plain tensors sharing its storage."""
    return TensorDict.from_module(policy).data


def check_same_layout(expected: TensorDict, actual: TensorDict) -> None:
    """Raise SyncError naming every entry whose presence, shape or dtype differs."""
    problems = []
    exp_keys = set(expected.keys(include_nested=True, leaves_only=True))
    act_keys = set(actual.keys(include_nested=True, leaves_only=True))
    problems += [f"missing in the collector's policy: {_name(k)}" for k in sorted(exp_keys - act_keys, key=str)]
    problems += [f"not in the learner's snapshot: {_name(k)}" for k in sorted(act_keys - exp_keys, key=str)]
    for key in sorted(exp_keys & act_keys, key=str):
        e, a = expected[key], actual[key]
        if e.shape != a.shape or e.dtype != a.dtype:
            problems.append(f"{_name(key)}: learner {tuple(e.shape)} {e.dtype}, collector {tuple(a.shape)} {a.dtype}")
    if problems:
        raise SyncError("weight snapshot does not match the collector's policy: " + "; ".join(problems))


def _name(key) -> str:
    return ".".join(key) if isinstance(key, tuple) else str(key)
