"""``sync=shared_mem``: versioned snapshots in preallocated shared-memory slots, read in place.

The learner copies its weights into a slot that is neither published nor in use, then publishes
``version`` and the slot index together. A receiver that sees a newer version pins the published
slot and makes its views the policy's weights: no copy on the collector side, so a push costs one
copy of the weights whatever the number of collectors. A pinned slot is never written, so a
collector never acts with a mix of two versions, and in-place changes to the learner's live
weights never reach it. The slot choice and the pins are guarded by one inter-process lock held
for microseconds; the copies happen outside it.

That lock is an ``flock`` on an unnamed file, not a multiprocessing semaphore: a named semaphore
stays in /dev/shm when the process group is SIGKILLed (only its resource tracker, killed with it,
would unlink it), while the kernel drops an unnamed file and its locks with the last process.
"""

from __future__ import annotations

import fcntl
import multiprocessing as mp
import os
import tempfile
import time
from multiprocessing import reduction
from typing import Annotated

import torch
from torch import nn

from rltrain.errors import SyncError
from rltrain.rules import Integer, PositiveNumber
from rltrain.sync.base import (
    FlatBuffer,
    WeightReceiver,
    WeightSender,
    WeightSyncScheme,
    bind_weights,
    named_weights,
    on_gpu,
)
from rltrain.sync.node_shared import shared_slots


class _FileLock:
    """An inter-process lock: ``flock`` on a file that has no name (O_TMPFILE), handed to spawned
    processes as a file descriptor. Each process locks through an open file description of its own
    (reopened via /proc/self/fd), since flock does not exclude holders of one description."""

    def __init__(self, fd: int | None = None, owner: int | None = None):
        self._fd = _unnamed_file() if fd is None else fd
        self._owner = os.getpid() if owner is None else owner  # the process whose description _fd is

    @staticmethod
    def supported() -> bool:
        return os.path.isdir("/proc/self/fd")  # Linux: an open file, even unlinked, can be reopened there

    def __reduce__(self):  # while spawning a process: the fd travels as a Connection's does
        return _received_lock, (reduction.DupFd(self._fd),)

    def acquire(self, timeout: float) -> bool:
        if self._owner != os.getpid():  # inherited (fork) or received (spawn): reopen as this process's
            inherited, self._fd = self._fd, os.open(f"/proc/self/fd/{self._fd}", os.O_RDWR)
            os.close(inherited)
            self._owner = os.getpid()
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.00005)

    def release(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def __del__(self):
        try:
            os.close(self._fd)
        except OSError:
            pass


def _unnamed_file() -> int:
    """An open file with no name, gone with its last descriptor: O_TMPFILE where the file system
    has it, else a temporary file unlinked at once (overlayfs before Linux 6.6, NFS)."""
    try:
        return os.open(tempfile.gettempdir(), os.O_TMPFILE | os.O_RDWR, 0o600)
    except (AttributeError, OSError):
        fd, path = tempfile.mkstemp(prefix="rltrain-lock-")
        os.unlink(path)
        return fd


def _received_lock(dup) -> _FileLock:
    return _FileLock(dup.detach(), owner=-1)


class _Shared:
    """The state sender and receivers share: slots, the published word, one pin per receiver."""

    def __init__(self, slots: list[FlatBuffer], timeout_s: float):
        self.slots = slots
        self.word = torch.zeros(1, dtype=torch.int64).share_memory_()  # version * len(slots) + slot
        # Elsewhere than Linux: a multiprocessing lock (which SIGKILL may leave in /dev/shm).
        self.lock = _FileLock() if _FileLock.supported() else mp.get_context("spawn").Lock()
        self.pins: list[torch.Tensor] = []
        self.timeout_s = timeout_s

    def locked(self):
        if not self.lock.acquire(timeout=self.timeout_s):
            raise SyncError(f"shared_mem: weight-sync lock not acquired within {self.timeout_s}s "
                            "(a collector process stopped while holding it?)")
        return _Release(self.lock)


class _Release:
    def __init__(self, lock):
        self.lock = lock

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.lock.release()


class _SharedMemSender(WeightSender):
    def __init__(self, policy: nn.Module, shared: _Shared, weights_of=named_weights):
        self._policy = policy  # its tensors are read at each push: a relay's policy is rebound to new ones
        self._shared = shared
        self._weights_of = weights_of

    def push(self) -> int:
        shared, n_slots = self._shared, len(self._shared.slots)
        slot = self._free_slot()
        shared.slots[slot].copy_from(self._weights_of(self._policy))  # nobody reads this slot: unpublished, unpinned
        version = self.version + 1
        with shared.locked():
            shared.word.fill_(version * n_slots + slot)
        self.version = version
        return version

    def _free_slot(self) -> int:
        """A slot neither published nor pinned, waiting up to ``timeout_s`` for one. Slots that the ranks of a
        sharded learner share (``NodeBuffer``) are written by all of them: the slot must be free on every rank,
        and the ranks decide together, at each look, whether to go on waiting."""
        shared, n_slots = self._shared, len(self._shared.slots)
        anywhere = getattr(shared.slots[0], "anywhere", None)
        deadline = time.monotonic() + shared.timeout_s
        while True:
            failed = None
            try:
                with shared.locked():
                    busy = [s == int(shared.word) % n_slots or any(int(p) == s for p in shared.pins)
                            for s in range(n_slots)]
            except SyncError as e:  # (told to the other ranks first: none is left waiting)
                failed, busy = e, [True] * n_slots
            late = time.monotonic() > deadline
            if anywhere is not None:
                *busy, late, stopped = anywhere([*busy, late, failed is not None])
                if stopped and failed is None:
                    raise SyncError("shared_mem: another rank of the learner could not take its weight-sync lock")
            if failed is not None:
                raise failed
            if not all(busy):
                return busy.index(False)
            if late:
                raise SyncError(f"shared_mem: every weight slot stayed in use for {shared.timeout_s}s; "
                                "a collector is not polling for new weights")
            time.sleep(0.0002)

    def published(self) -> dict[str, torch.Tensor]:
        # The published slot is never written while it is published, and pushes happen on this thread.
        slot = self._shared.slots[int(self._shared.word) % len(self._shared.slots)]
        return {name: view.clone() for name, view in slot.views.items()}


class _SharedMemReceiver(WeightReceiver):
    def __init__(self, shared: _Shared, pin: torch.Tensor):
        self._shared, self._pin = shared, pin
        self._policy: nn.Module | None = None
        self.version = -1  # the first poll (in connect) binds whatever is published

    def connect(self, policy: nn.Module) -> None:
        self._shared.slots[0].check_matches(policy)
        self._policy = policy
        self.poll()

    def poll(self) -> bool:
        shared, n_slots = self._shared, len(self._shared.slots)
        if int(shared.word) // n_slots == self.version:  # lock-free fast path: nothing new
            return False
        word = self._pin_newest()
        bind_weights(self._policy, shared.slots[word % n_slots].views)
        self.version = word // n_slots
        return True

    def _pin_newest(self) -> int:
        """Pin the published slot (the sender writes no pinned slot); its word (version * slots + slot)."""
        shared = self._shared
        with shared.locked():
            word = int(shared.word)
            self._pin.fill_(word % len(shared.slots))
        return word

    def close(self) -> None:
        self._pin.fill_(-1)


SLOTS = Integer(2, note="one published, one being written")  # sync.slots


class SharedMemSync(WeightSyncScheme):
    """Versioned snapshots in ``slots`` shared-memory buffers, read in place by every collector."""

    _sender_class, _receiver_class = _SharedMemSender, _SharedMemReceiver  # a subclass's own, where it has them

    def __init__(self, every: int | None = 1, slots: Annotated[int, SLOTS] = 3, timeout_s: PositiveNumber = 30.0):
        SLOTS.check("sync.slots", slots)  # also when built from Python, not from a config
        super().__init__(every)
        self.n_slots, self.timeout_s = slots, timeout_s
        self._shared: _Shared | None = None

    @staticmethod
    def weights_of(policy: nn.Module) -> dict[str, torch.Tensor]:
        """What a push publishes of the learner's policy: its weights, by name."""
        return named_weights(policy)

    def sender(self, policy: nn.Module, version: int = 0) -> WeightSender:
        # A GPU learner's slots are page-locked: each push is one device-to-host copy into a free slot.
        weights = self.weights_of(policy)
        slots = shared_slots(weights, self.n_slots, pinned=on_gpu(policy))  # (a sharded learner's ranks': shared)
        slots[0].copy_from(weights)  # the initial weights, in slot 0
        self._shared = _Shared(slots, self.timeout_s)
        self._shared.word.fill_(version * self.n_slots)
        sender = self._sender_class(policy, self._shared, self.weights_of)
        sender.version = version
        return sender

    def receiver(self) -> WeightReceiver:
        if self._shared is None:
            raise SyncError("SharedMemSync.receiver() called before sender(): the learner's policy defines the layout")
        pin = torch.full((1,), -1, dtype=torch.int64).share_memory_()
        self._shared.pins.append(pin)
        return self._receiver_class(self._shared, pin)
