"""``sync=pipe``: each push writes the whole snapshot down one pipe per receiver.

A message is the version (8 bytes) followed by every weight's raw bytes in a fixed order; the
receiver reads it straight into its policy's tensors (readv-style, no intermediate copies). The
learner writes to every receiver's pipe in parallel threads and returns once every receiver has
taken the snapshot, so a lock-step batch commanded after a push acts with it. That is also why
receivers must live in other processes: workers read their pipe while they wait for commands
and between steps. Simple and portable; unlike ``shared_mem`` its cost grows with receivers.
"""

from __future__ import annotations

import fcntl
import functools
import multiprocessing as mp
import os
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

import torch
from torch import nn

from rltrain.errors import SyncError
from rltrain.rules import PositiveNumber
from rltrain.sync.base import FlatBuffer, WeightReceiver, WeightSender, WeightSyncScheme, named_weights

_PIPE_BYTES = 1 << 20  # a bigger kernel pipe buffer: fewer context switches per megabyte sent


def _raw_bytes(tensors: list[torch.Tensor]) -> list[memoryview]:
    return [memoryview(t.reshape(-1).numpy()).cast("B") for t in tensors]


class _PipeSender(WeightSender):
    def __init__(self, policy: nn.Module, layout: dict, writers: list, timeout_s: float):
        weights = named_weights(policy)
        self._sources = [weights[name] for name in layout]
        self._on_gpu = any(t.is_cuda for t in self._sources)
        # A host copy of the last push: what collectors act with until the next one (for
        # checkpoints), and what a GPU learner's weights are sent from.
        self._stage = FlatBuffer(layout, shared=False, pinned=self._on_gpu)
        self._stage.copy_from(weights)
        self._writers, self._timeout_s = writers, timeout_s
        self._pool: ThreadPoolExecutor | None = None

    def published(self) -> dict[str, torch.Tensor]:
        return {name: view.clone() for name, view in self._stage.views.items()}

    def push(self) -> int:
        version = self.version + 1
        keep = functools.partial(self._stage.copy_from, dict(zip(self._stage.layout, self._sources)))
        if self._on_gpu:
            keep()
            chunks = _raw_bytes(list(self._stage.views.values()))
        else:  # CPU weights are sent in place (push returns only once every receiver has read them)
            chunks = _raw_bytes(self._sources)
        message = [memoryview(version.to_bytes(8, "little", signed=True)), *chunks]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=len(self._writers) + 1, thread_name_prefix="rltrain-push")
        futures = [self._pool.submit(_write_all, w.fileno(), message) for w in self._writers]
        if not self._on_gpu:  # the host copy is made while the pipes drain
            futures.append(self._pool.submit(keep))
        done, pending = wait_futures(futures, timeout=self._timeout_s)
        if pending:
            raise SyncError(f"pipe: a collector did not take weights version {version} within "
                            f"{self._timeout_s}s (sync.timeout_s)")
        for i, future in enumerate(futures):
            try:
                future.result()
            except OSError as e:
                raise SyncError(f"pipe: weights version {version} could not reach receiver {i} ({e}); "
                                "its collector worker has exited") from None
        self.version = version
        return version

    def close(self) -> None:
        # The trainer closes collectors first: every reader is gone, so a blocked write fails fast
        # and the threads can be joined before their file descriptors are closed under them.
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        for writer in self._writers:
            writer.close()


def _write_all(fd: int, chunks: list[memoryview]) -> None:
    for chunk in chunks:
        while chunk:
            chunk = chunk[os.write(fd, chunk):]


def _read_exact(fd: int, chunks: list[memoryview]) -> None:
    for chunk in chunks:
        while chunk:
            n = os.readv(fd, [chunk])
            if n == 0:
                raise SyncError("pipe: the learner closed the weight pipe mid-snapshot")
            chunk = chunk[n:]


class _PipeReceiver(WeightReceiver):
    def __init__(self, reader, initial: FlatBuffer, version: int = 0):
        self._reader, self._initial, self.version = reader, initial, version
        self._header = bytearray(8)
        self._targets: list[memoryview] | None = None

    @property
    def waitable(self):
        """What a worker may wait on (with its command pipe) so pushes never wait for its poll."""
        return self._reader

    def after_spawn(self) -> None:
        # The worker holds its own duplicate; without ours, a dead worker makes pushes fail at once.
        self._reader.close()

    def connect(self, policy: nn.Module) -> None:
        self._initial.check_matches(policy)
        weights = named_weights(policy)
        self._initial.copy_into(weights)
        self._targets = [memoryview(self._header), *_raw_bytes([weights[name] for name in self._initial.layout])]
        self.poll()

    def poll(self) -> bool:
        if self._reader.closed or not self._reader.poll():
            return False
        with torch.no_grad():
            while self._reader.poll():  # drain: the newest snapshot wins
                _read_exact(self._reader.fileno(), self._targets)
        self.version = int.from_bytes(self._header, "little", signed=True)
        return True

    def close(self) -> None:
        self._reader.close()


class PipeSync(WeightSyncScheme):
    """Whole snapshots over one pipe per receiver (in other processes: a push waits for them to read)."""

    CROSS_PROCESS_ONLY = True

    def __init__(self, every: int | None = 1, timeout_s: PositiveNumber = 30.0):
        super().__init__(every)
        self.timeout_s = timeout_s
        self._initial: FlatBuffer | None = None
        self._initial_version = 0
        self._writers: list = []

    def sender(self, policy: nn.Module, version: int = 0) -> WeightSender:
        self._initial = FlatBuffer.like(policy, shared=False)
        self._initial.copy_from(named_weights(policy))  # the initial version travels inside each receiver
        self._initial_version = version
        sender = _PipeSender(policy, self._initial.layout, self._writers, self.timeout_s)
        sender.version = version
        return sender

    def receiver(self) -> WeightReceiver:
        if self._initial is None:
            raise SyncError("PipeSync.receiver() called before sender(): the learner's policy defines the layout")
        reader, writer = mp.get_context("spawn").Pipe(duplex=False)
        try:
            fcntl.fcntl(writer.fileno(), fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
        except OSError:
            pass  # above the system's pipe-max-size: keep the default
        self._writers.append(writer)
        return _PipeReceiver(reader, self._initial, self._initial_version)
