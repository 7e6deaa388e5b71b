"""``sync=pipe``: each push sends the whole snapshot down one multiprocessing pipe per receiver.

The learner flattens its weights into one buffer (one copy) and writes it to every receiver's
pipe in parallel threads; a push returns once every receiver has taken it (so a lock-step batch
commanded after it acts with it), which is why receivers must live in other processes: workers
read their pipe while they wait for commands, and between steps. A receiver reads every pending
snapshot, keeps the newest and copies it into its policy. Simple and portable; costs grow with the number of
receivers, unlike ``shared_mem``.
"""

from __future__ import annotations

import fcntl
import multiprocessing as mp
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

import torch
from torch import nn

from rltrain.errors import SyncError
from rltrain.sync.base import FlatWeights, WeightReceiver, WeightSender, WeightSyncScheme, named_weights

_PIPE_BYTES = 1 << 20  # a bigger kernel pipe buffer: fewer context switches per megabyte sent


class _PipeSender(WeightSender):
    def __init__(self, policy: nn.Module, flat: FlatWeights, writers: list, timeout_s: float):
        self._weights, self._flat, self._writers, self._timeout_s = named_weights(policy), flat, writers, timeout_s
        self._pool: ThreadPoolExecutor | None = None

    def push(self) -> int:
        version = self.version + 1
        self._flat.copy_from(self._weights)
        header = version.to_bytes(8, "little", signed=True)
        body = self._flat.buffer.numpy()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=max(1, len(self._writers)), thread_name_prefix="rltrain-push")
        futures = [self._pool.submit(_send, w, header, body) for w in self._writers]
        done, pending = wait_futures(futures, timeout=self._timeout_s)
        if pending:
            raise SyncError(f"pipe: a collector did not take weights version {version} within "
                            f"{self._timeout_s}s (sync.timeout_s)")
        for future in done:
            future.result()  # re-raises BrokenPipeError & co.
        self.version, self.pushes = version, self.pushes + 1
        return version

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        for writer in self._writers:
            writer.close()


def _send(writer, header: bytes, body) -> None:
    writer.send_bytes(header)
    writer.send_bytes(body)


class _PipeReceiver(WeightReceiver):
    def __init__(self, reader, initial: FlatWeights):
        self._reader, self._flat = reader, initial
        self._header = bytearray(8)
        self._weights: dict[str, torch.Tensor] | None = None

    @property
    def waitable(self):
        """What a worker may wait on (with its command pipe) so pushes never wait for its poll."""
        return self._reader

    def connect(self, policy: nn.Module) -> None:
        self._flat.check_matches(policy)
        self._weights = named_weights(policy)
        self._flat.copy_into(self._weights)
        self.poll()

    def poll(self) -> bool:
        if not self._reader.poll():
            return False
        body = self._flat.buffer.numpy()
        while self._reader.poll():  # drain: only the newest snapshot matters
            self._reader.recv_bytes_into(self._header)
            self._reader.recv_bytes_into(body)
        self._flat.copy_into(self._weights)
        self.version = int.from_bytes(self._header, "little", signed=True)
        return True

    def close(self) -> None:
        self._reader.close()


class PipeSync(WeightSyncScheme):
    """Whole snapshots over one pipe per receiver."""

    def __init__(self, timeout_s: float = 30.0):
        self.timeout_s = timeout_s
        self._flat: FlatWeights | None = None
        self._writers: list = []

    def sender(self, policy: nn.Module) -> WeightSender:
        self._flat = FlatWeights.like(policy, shared=False)
        self._flat.copy_from(named_weights(policy))  # version 0 travels inside each receiver
        return _PipeSender(policy, self._flat, self._writers, self.timeout_s)

    def receiver(self) -> WeightReceiver:
        if self._flat is None:
            raise SyncError("PipeSync.receiver() called before sender(): the learner's policy defines the layout")
        reader, writer = mp.get_context("spawn").Pipe(duplex=False)
        try:
            fcntl.fcntl(writer.fileno(), fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
        except OSError:
            pass  # above the system's pipe-max-size: keep the default
        self._writers.append(writer)
        initial = FlatWeights(self._flat.layout, shared=False)
        initial.buffer.copy_(self._flat.buffer)
        return _PipeReceiver(reader, initial)
