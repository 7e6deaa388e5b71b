"""``sync=distributed``: each push is a torch.distributed broadcast of the snapshot, in a few
flat buckets, to every receiver: worker processes of this machine, collector ranks of a torchrun
job on any machine, and processes of the user's own (``listen``).

The learner (rank 0 of rltrain's own ``weights`` gloo group) tells each receiver the version
coming, broadcasts the buckets (copying bucket k+1 out of its weights while bucket k is on the
wire; a GPU learner stages all of them to pinned host memory first, with one synchronization),
and returns once every receiver has acknowledged it: a lock-step batch commanded after a push
acts with it, and the push time is the time until every receiver holds the new version.

Each receiver takes part in the broadcasts from a thread of its own, into one of three buffer
sets (never the one its policy acts with, nor the newest not yet applied), so a push never waits
for a collector to poll; ``poll`` then makes the newest set the policy's weights, without a copy.

Who receives: with worker processes (``collector=lockstep|async``), the receivers the learner
makes and pickles into them (they carry the initial weights; the group forms at the first push,
once every worker exists). Under torchrun (``collector=distributed``), every other rank of the
job (they get the initial weights by the first broadcast, when the learner's sender is made).
In both, ``sync.listeners`` more processes of the user's own, which join through ``sync.json``.
"""

from __future__ import annotations

import functools
import json
import pickle
import threading
import time
from pathlib import Path

import torch
from torch import distributed as dist
from torch import nn

from rltrain import distributed as rd
from rltrain.errors import SyncError
from rltrain.sync.base import (
    FlatWeights,
    WeightReceiver,
    WeightSender,
    WeightSyncScheme,
    bind_weights,
    layout_of,
    named_weights,
    on_gpu,
)

CONTACT_FILE = "sync.json"
_VERSION, _ACK, _CLOSE, _FAILED = 1, 2, 3, 4
_SETS = 3  # receiver buffer sets: acting, newest received, being received
_IDLE_S = 7 * 24 * 3600.0  # a receiver waits this long for the next push (the learner's death ends it at once)


class _DistributedSender(WeightSender):
    def __init__(self, policy: nn.Module, scheme: DistributedSync, version: int):
        self._weights = named_weights(policy)
        self._scheme = scheme
        self._on_gpu = on_gpu(policy)
        self._stage = FlatWeights.like(policy, shared=False, pinned=self._on_gpu)
        self._stage.copy_from(self._weights)  # what collectors act with until the first push (for checkpoints)
        self._buckets = self._stage.buckets(scheme.bucket_bytes)
        self._group = None
        self._broken = False
        self.version = version

    def contact(self) -> dict | None:
        if not self._scheme.listeners:
            return None
        a = self._scheme.address
        return {"host": a.host, "port": a.port, "prefix": a.prefix, "listeners": self._scheme.listeners,
                "bucket_bytes": self._scheme.bucket_bytes, "loopback": self._scheme.loopback}

    def published(self) -> dict[str, torch.Tensor]:
        return {name: view.clone() for name, view in self._stage.views.items()}

    def connect(self) -> None:
        """Form the weights group with every receiver (blocks until all have joined)."""
        scheme = self._scheme
        receivers = scheme.receivers()
        size = 1 + receivers + scheme.listeners
        scheme.store.set("listeners_at", str(1 + receivers))
        scheme.store.set("size", str(size))
        try:
            watch = functools.partial(rd.raise_failures, scheme.store, range(1, size))
            self._group = rd.gloo_group(scheme.store, "weights", 0, size, scheme.timeout_s, scheme.loopback, watch)
        except TimeoutError as e:
            who = f"{receivers} collector receiver(s)" + (
                f" and {scheme.listeners} listener(s) (sync.listeners: processes of your own calling "
                "rltrain.sync.listen)" if scheme.listeners else "")
            raise SyncError(f"sync=distributed: the weights group of the learner, {who} did not form: {e} "
                            "(sync.timeout_s)") from None
        self._peers = list(range(1, size))

    def start(self) -> None:
        if self._scheme._world is not None:  # collector ranks built their own policy copies: the initial weights
            self._publish(self.version, copy=False)

    def push(self) -> int:
        self._publish(self.version + 1)
        return self.version

    def _publish(self, version: int, copy: bool = True) -> None:
        """Broadcast the weights as ``version`` (``copy=False``: what the stage already holds)."""
        try:
            self._publish_unguarded(version, copy)
        except BaseException:
            self._broken = True  # receivers may be stuck mid-broadcast: close must not wait on them
            raise

    def _publish_unguarded(self, version: int, copy: bool) -> None:
        if self._group is None:
            self.connect()
        group, timeout_s = self._group, self._scheme.timeout_s
        for peer in self._peers:
            self._talk(peer, version, lambda p=peer: rd.send_frame(group, p, _VERSION, arg=version))
        if copy and self._on_gpu:
            self._stage.copy_from(self._weights)  # one synchronization, then every bucket is on the host
        works = []
        for names, chunk in self._buckets:
            if copy and not self._on_gpu:  # this bucket's copy overlaps the previous bucket's broadcast
                self._stage.copy_from(self._weights, names)
            options = dist.BroadcastOptions()
            options.rootRank, options.timeout = 0, rd.seconds(timeout_s)
            works.append(group.broadcast([chunk], options))
        try:
            for work in works:
                work.wait()
        except RuntimeError as e:
            dead = self._gone_peer() if rd.is_peer_gone(e) else None
            if dead is not None:
                raise SyncError(f"sync=distributed: {self._scheme.describe(dead)} died (its connection closed) while "
                                f"weights version {version} was broadcast") from None
            raise SyncError(f"sync=distributed: broadcast of weights version {version} failed: "
                            f"{str(e).splitlines()[0]}") from None
        for peer in self._peers:
            self._talk(peer, version, lambda p=peer: self._ack(p, version))
        self.version = version

    def _gone_peer(self) -> int | None:
        """After a failed broadcast: the receiver whose connection closed (gloo's error names only
        its address). A live one stays silent and is passed over after a moment."""
        for peer in self._peers:
            try:
                rd.recv_header(self._group, peer, 0.2)
            except RuntimeError as e:
                if rd.is_peer_gone(e):
                    return peer
        return None

    def _ack(self, peer: int, version: int) -> None:
        kind, _, acked = rd.recv_header(self._group, peer, self._scheme.timeout_s)
        if kind == _FAILED:  # its part of the broadcast failed: a receiver further down gloo's tree died?
            dead = self._gone_peer()
            raise SyncError(f"sync=distributed: {self._scheme.describe(dead if dead is not None else peer)} "
                            f"{'died (its connection closed)' if dead is not None else 'could not receive'} while "
                            f"weights version {version} was broadcast")
        if kind != _ACK or acked != version:
            raise SyncError(f"sync=distributed: receiver {peer} answered {kind}/{acked} to weights version {version}")

    def _talk(self, peer: int, version: int, action) -> None:
        try:
            action()
        except RuntimeError as e:
            if rd.is_peer_gone(e):
                raise SyncError(f"sync=distributed: {self._scheme.describe(peer)} died (its connection closed) while "
                                f"weights version {version} was pushed") from None
            raise SyncError(f"sync=distributed: {self._scheme.describe(peer)} did not answer within "
                            f"{self._scheme.timeout_s:g}s (sync.timeout_s) while weights version {version} was "
                            f"pushed: {str(e).splitlines()[0]}") from None

    def close(self) -> None:
        if self._group is None or self._broken:
            return
        for peer in self._peers:  # each receiver's thread ends; a receiver already gone is no error here
            try:
                rd.send_frame(self._group, peer, _CLOSE)
            except RuntimeError:
                pass
        self._group = None


class DistributedReceiver(WeightReceiver):
    """The receiving end of ``sync=distributed``, for a collector or a process of your own.

    ``connect(module)`` checks the module against the learner's snapshot (names, shapes, dtypes)
    and starts receiving in the background; ``poll()`` makes the newest received version the
    module's weights (``version``); ``wait_for(version)`` waits until at least that one arrived;
    ``ended`` turns true once the run has finished.
    """

    def __init__(self, address: rd.StoreAddress, rank: int | None, bucket_bytes: int, timeout_s: float,
                 loopback: bool = False, listener: int | None = None,
                 initial: FlatWeights | None = None, version: int = -1):
        self._address, self._rank, self._listener = address, rank, listener
        self._bucket_bytes, self._timeout_s, self._loopback = bucket_bytes, timeout_s, loopback
        self._initial, self.version = initial, version
        self._policy: nn.Module | None = None
        self.ended = False  # the run has finished: no more versions will come

    def __getstate__(self):
        state = self.__dict__.copy()
        for key in ("_lock", "_thread", "_sets", "_group"):
            state.pop(key, None)
        return state

    def connect(self, policy: nn.Module) -> None:
        store = self._address.connect(self._timeout_s)
        layout = (self._initial.layout if self._initial is not None else
                  pickle.loads(rd.wait_for_key(store, "layout", self._timeout_s)))
        self._sets = [FlatWeights(layout, shared=False) for _ in range(_SETS)]
        self._sets[0].check_matches(policy)
        self._policy = policy
        self._lock = threading.Condition()
        self._bound, self._ready, self._ready_version = None, None, None
        self._error: str | None = None
        self._closing = False
        if self._initial is not None:  # the learner's initial weights came inside this receiver
            self._sets[0].buffer.copy_(self._initial.buffer)
            self._initial = None
            self._bound = 0
            bind_weights(policy, self._sets[0].views)
        self._thread = threading.Thread(target=self._receive, args=(store,), name="rltrain-weights", daemon=True)
        self._thread.start()

    def poll(self) -> bool:
        with self._lock:
            if self._error is not None:
                raise SyncError(self._error)
            ready, version = self._ready, self._ready_version
            if ready is None:
                return False
            self._ready = None
            self._bound = ready
        bind_weights(self._policy, self._sets[ready].views)
        self.version = version
        return True

    def wait_for(self, version: int, timeout_s: float | None = None) -> int:
        """Wait until weights ``version`` (or newer) arrived, apply them, and return the version."""
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            self.poll()
            if self.version >= version:
                return self.version
            with self._lock:
                if self.ended and self._ready is None:
                    raise SyncError(f"sync=distributed: the run ended at weights version {self.version}, before "
                                    f"version {version}")
                if self._ready is None and self._error is None:
                    self._lock.wait(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            if time.monotonic() > deadline and self._ready is None:
                raise SyncError(f"sync=distributed: weights version {version} did not arrive within {timeout_s:g}s "
                                f"(now at version {self.version})")

    def _receive(self, store) -> None:
        try:
            size = int(rd.wait_for_key(store, "size", _IDLE_S, self._stopping))
            rank = self._rank
            if rank is None:
                rank = int(rd.wait_for_key(store, "listeners_at", self._timeout_s)) + self._listener
            group = rd.gloo_group(store, "weights", rank, size, self._timeout_s, self._loopback)
            buckets = [s.buckets(self._bucket_bytes) for s in self._sets]
            while True:
                kind, _, version = rd.recv_header(group, 0, _IDLE_S)
                if kind == _CLOSE:
                    # Kept: destroying a group here could race the interpreter's exit (once
                    # ``ended`` is seen), which aborts the process; it goes with the receiver.
                    self._group = group
                    with self._lock:
                        self.ended = True
                        self._lock.notify_all()
                    return
                with self._lock:
                    target = next(i for i in range(_SETS) if i not in (self._bound, self._ready))
                try:
                    for _names, chunk in buckets[target]:
                        options = dist.BroadcastOptions()
                        options.rootRank, options.timeout = 0, rd.seconds(self._timeout_s)
                        group.broadcast([chunk], options).wait()
                except RuntimeError as e:  # the learner hears at once (it then names whoever died)
                    try:
                        rd.send_frame(group, 0, _FAILED, arg=version)
                    except RuntimeError:
                        pass
                    raise RuntimeError(f"receiving weights version {version} failed (a peer's connection closed?): "
                                       f"{str(e).splitlines()[0]}") from None
                with self._lock:
                    self._ready, self._ready_version = target, version
                    self._lock.notify_all()
                rd.send_frame(group, 0, _ACK, arg=version)
        except BaseException as e:  # noqa: BLE001  (the collector's next poll raises it)
            if self._closing:
                return
            gone = isinstance(e, RuntimeError) and rd.is_peer_gone(e) and "receiving weights version" not in str(e)
            with self._lock:
                self._error = ("sync=distributed: the learner is gone" if gone else
                               f"sync=distributed: receiving weights failed: {type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else ''}")
                self._lock.notify_all()

    def _stopping(self) -> bool:
        return self._closing

    def wait_ended(self, timeout_s: float) -> None:
        """Wait (up to ``timeout_s``) for the learner's last message, which ends the receiving thread."""
        self._thread.join(timeout_s)

    def close(self) -> None:
        self._closing = True  # the thread ends at the learner's close message, or with this process


class DistributedSync(WeightSyncScheme):
    """Pushes as bucketed torch.distributed broadcasts (gloo) to every receiver, on one machine
    or many: worker processes, the other ranks of a torchrun job, and ``listeners`` processes
    of your own (``rltrain.sync.listen``)."""

    CROSS_PROCESS_ONLY = True
    REACHES_OTHER_RANKS = True

    def __init__(self, every: int | None = 1, bucket_mb: float = 16.0, listeners: int = 0, timeout_s: float = 30.0):
        self.every, self.listeners, self.timeout_s = every, listeners, timeout_s
        self.bucket_bytes = int(bucket_mb * (1 << 20))
        self._world = rd.current()
        self._made: list[DistributedReceiver] = []
        self._initial: FlatWeights | None = None
        self._version = 0
        self._server = None
        self.store, self.address, self.loopback = None, None, False

    def receivers(self) -> int:
        """The collector receivers the learner pushes to: the job's other ranks, or the workers' receivers."""
        return self._world.size - 1 if self._world is not None else len(self._made)

    def describe(self, peer: int) -> str:
        receivers = self.receivers()
        if peer > receivers:
            return f"listener {peer - receivers - 1} (a process of your own, rank {peer} of the weights group)"
        return f"collector rank {peer}" if self._world is not None else f"collector worker {peer - 1}'s receiver"

    def sender(self, policy: nn.Module, version: int = 0) -> WeightSender:
        if self._world is not None:  # a torchrun job: the other ranks receive, through the job's store
            self.store, self.address = self._world.store, self._world.address
        else:  # worker processes of this machine, through a store of the learner's
            self._server, self.address = rd.local_store(self.timeout_s)
            self.store, self.loopback = self._server, True
        self.store.set("layout", pickle.dumps(layout_of(policy)))
        sender = _DistributedSender(policy, self, version)
        self._initial, self._version = sender._stage, version
        return sender

    def receiver(self) -> WeightReceiver:
        world = self._world
        if world is not None and world.rank != 0:  # on a collector rank: receive as this rank
            return DistributedReceiver(world.address, world.rank, self.bucket_bytes, self.timeout_s)
        if self._initial is None:
            raise SyncError("DistributedSync.receiver() called before sender(): the learner's policy defines "
                            "the layout")
        receiver = DistributedReceiver(self.address, len(self._made) + 1, self.bucket_bytes, self.timeout_s,
                                       loopback=self.loopback, initial=self._initial, version=self._version)
        self._made.append(receiver)
        return receiver


def listen(run_dir: str | Path, index: int = 0, timeout_s: float = 60.0) -> DistributedReceiver:
    """Receive the weights a ``sync=distributed`` run pushes, in a process of your own.

    ``run_dir`` is the run's dir (it holds ``sync.json`` once the run has started; this waits up
    to ``timeout_s`` for it); ``index`` is this process's number among the run's
    ``sync.listeners``. Then ``receiver.connect(module)`` (a module with the policy's layout) and
    ``receiver.poll()`` / ``receiver.wait_for(version)``; ``receiver.version`` is the version held.
    """
    path = Path(run_dir) / CONTACT_FILE
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise SyncError(f"{path} did not appear within {timeout_s:g}s: is a sync=distributed run with "
                            "sync.listeners >= 1 running in that dir?")
        time.sleep(0.1)
    contact = json.loads(path.read_text())
    if not 0 <= index < contact["listeners"]:
        raise SyncError(f"listener index {index} is out of range: the run at {run_dir} has sync.listeners="
                        f"{contact['listeners']}")
    address = rd.StoreAddress(contact["host"], contact["port"], contact["prefix"])
    return DistributedReceiver(address, None, contact["bucket_bytes"], timeout_s, loopback=contact["loopback"],
                               listener=index)
