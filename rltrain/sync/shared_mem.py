"""``sync=shared_mem``: snapshots in preallocated shared-memory buffers.

Two snapshot slots (double buffering): the learner writes the slot nobody is told to read, then
publishes ``version`` and the slot index in one int64 store. Each slot has a sequence counter
that is odd while it is written (a seqlock), so a reader that raced a second push notices and
re-reads: a policy never holds a mix of two versions. One push is one copy, whatever the number
of receivers; each receiver copies the slot into its own policy when it polls.
"""

from __future__ import annotations

import time

import torch
from tensordict import TensorDict
from torch import nn

from rltrain.errors import SyncError
from rltrain.sync.base import WeightReceiver, WeightSender, WeightSyncScheme, check_same_layout, weights_of

_META_WORD, _META_SEQ = 0, 1  # meta[0] = version * 2 + slot; meta[1 + slot] = that slot's sequence counter


class _SharedMemSender(WeightSender):
    def __init__(self, policy: nn.Module, slots: list[TensorDict], meta: torch.Tensor):
        self._source = weights_of(policy)
        self._slots, self._meta = slots, meta

    def push(self) -> int:
        version = self.version + 1
        slot = 1 - int(self._meta[_META_WORD]) % 2
        seq = self._meta[_META_SEQ + slot : _META_SEQ + slot + 1]
        seq += 1  # odd: being written
        self._slots[slot].update_(self._source)
        seq += 1  # even: complete
        self._meta[_META_WORD] = version * 2 + slot
        self.version, self.pushes = version, self.pushes + 1
        return version


class _SharedMemReceiver(WeightReceiver):
    def __init__(self, slots: list[TensorDict], meta: torch.Tensor, timeout_s: float):
        self._slots, self._meta, self._timeout_s = slots, meta, timeout_s
        self._local: TensorDict | None = None
        self.version = -1  # forces the first poll (at connect) to apply the published snapshot

    def connect(self, policy: nn.Module) -> None:
        self._local = weights_of(policy)
        check_same_layout(self._slots[0], self._local)
        self.poll()

    def poll(self) -> bool:
        deadline = time.monotonic() + self._timeout_s
        while True:
            word = int(self._meta[_META_WORD])
            version, slot = word // 2, word % 2
            if version == self.version:
                return False
            before = int(self._meta[_META_SEQ + slot])
            if before % 2 == 0:
                self._local.update_(self._slots[slot])
                if int(self._meta[_META_SEQ + slot]) == before:
                    self.version = version
                    return True
            if time.monotonic() > deadline:  # a writer died mid-copy, or pushes outrun every read
                raise SyncError(f"shared_mem: no consistent weight snapshot within {self._timeout_s}s")


class SharedMemSync(WeightSyncScheme):
    """Versioned snapshots in shared memory, double-buffered with a seqlock."""

    def __init__(self, timeout_s: float = 30.0):
        if timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        self.timeout_s = timeout_s
        self._slots: list[TensorDict] | None = None
        self._meta: torch.Tensor | None = None

    def sender(self, policy: nn.Module) -> WeightSender:
        snapshot = weights_of(policy).to("cpu")
        self._slots = [snapshot.clone().share_memory_() for _ in range(2)]
        self._meta = torch.zeros(3, dtype=torch.int64).share_memory_()  # version 0 is in slot 0
        return _SharedMemSender(policy, self._slots, self._meta)

    def receiver(self) -> WeightReceiver:
        if self._slots is None:
            raise SyncError("SharedMemSync.receiver() called before sender(): the learner's policy defines the layout")
        return _SharedMemReceiver(self._slots, self._meta, self.timeout_s)
