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

A listener watches its run's dir while it waits (for ``sync.json``, the store, the group, a push):
a run that is over (``run.lock`` free, its status in ``summary.json``) is said at once, in one
line, rather than after torch's retries. A listener whose module does not fit the policy tells the
learner why through the store before it leaves, and the learner fails at once, naming it.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import socket
import threading
import time
from pathlib import Path

import torch
from torch import distributed as dist
from torch import nn

from rltrain import process_groups
from rltrain.errors import SyncError
from rltrain.rules import NonNegativeInt, PositiveNumber
from rltrain.sync.base import (
    FlatBuffer,
    WeightReceiver,
    WeightSender,
    WeightSyncScheme,
    bind_weights,
    layout_of,
    named_weights,
    on_gpu,
)

CONTACT_FILE = "sync.json"
SUMMARY_FILE = "summary.json"  # written by the trainer when a run ends (rltrain.trainer.write_summary)
_REJECTED, _REJECTIONS = "listener_rejected", "listener_rejections"  # store keys: why listener i left; how many did
_WATCH_S = 1.0  # a listener looks at its run's dir this often while it waits
_GRACE_S = 5.0  # once the dir says the run is over, its learner's last message may still be on the way
_VERSION, _ACK, _CLOSE, _FAILED = 1, 2, 3, 4
_SETS = 3  # receiver buffer sets: acting, newest received, being received
_IDLE_S = 7 * 24 * 3600.0  # a receiver waits this long for the next push (the learner's death ends it at once)


class _DistributedSender(WeightSender):
    def __init__(self, policy: nn.Module, scheme: DistributedSync, version: int):
        self._weights = named_weights(policy)
        self._scheme = scheme
        self._on_gpu = on_gpu(policy)
        self._stage = FlatBuffer.like(policy, shared=False, pinned=self._on_gpu)
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
            # Its own connection: the join's waits hold the store's for up to sync.timeout_s each.
            watch = functools.partial(self._raise_failures, scheme.address.connect(scheme.timeout_s), size)
            self._group = process_groups.gloo_group(scheme.store, "weights", 0, size, scheme.timeout_s, scheme.loopback,
                                                    watch)
        except TimeoutError as e:
            who = f"{receivers} collector receiver(s)" + (
                f" and {scheme.listeners} listener(s) (sync.listeners: processes of your own calling "
                "rltrain.sync.listen)" if scheme.listeners else "")
            raise SyncError(f"sync=distributed: the weights group of the learner, {who} did not form: {e} "
                            "(sync.timeout_s)") from None
        self._peers = list(range(1, size))

    def _raise_failures(self, store: dist.Store, size: int) -> None:
        """While the group forms: a collector rank that failed to start, or a listener that left."""
        process_groups.raise_failures(store, range(1, size))
        self._raise_rejected(store)

    def _raise_rejected(self, store: dist.Store) -> None:
        """A listener whose module does not fit the policy leaves, saying why in the store (its
        ``connect``): fail now, naming it, rather than wait ``sync.timeout_s`` for it to join."""
        scheme = self._scheme
        if not scheme.listeners or not store.add(_REJECTIONS, 0):
            return
        for index in range(scheme.listeners):
            key = f"{_REJECTED}/{index}"
            if store.check([key]):
                host, pid, why = pickle.loads(store.get(key))
                raise SyncError(f"sync=distributed: listener {index} (pid {pid} on {host}, a process of your own "
                                f"calling rltrain.sync.listen; sync.listeners={scheme.listeners}) was rejected and "
                                f"left: {why}. Give it a module built as the run's algo.network (same parameter "
                                "names and shapes)")

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
            self._talk(peer, version, lambda p=peer: process_groups.send_frame(group, p, _VERSION, arg=version))
        if copy and self._on_gpu:
            self._stage.copy_from(self._weights)  # one synchronization, then every bucket is on the host
        works = []
        for names, chunk in self._buckets:
            if copy and not self._on_gpu:  # this bucket's copy overlaps the previous bucket's broadcast
                self._stage.copy_from(self._weights, names)
            options = dist.BroadcastOptions()
            options.rootRank, options.timeout = 0, process_groups.seconds(timeout_s)
            works.append(group.broadcast([chunk], options))
        try:
            for work in works:
                work.wait()
        except RuntimeError as e:
            dead = self._gone_peer() if process_groups.is_peer_gone(e) else None
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
                process_groups.recv_header(self._group, peer, 0.2)
            except RuntimeError as e:
                if process_groups.is_peer_gone(e):
                    return peer
        return None

    def _ack(self, peer: int, version: int) -> None:
        kind, _, acked = process_groups.recv_header(self._group, peer, self._scheme.timeout_s)
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
            if process_groups.is_peer_gone(e):
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
                process_groups.send_frame(self._group, peer, _CLOSE)
            except RuntimeError:
                pass
        self._group = None


class DistributedReceiver(WeightReceiver):
    """The receiving end of ``sync=distributed``, for a collector or a process of your own.

    ``connect(module)`` checks the module against the learner's snapshot (names, shapes, dtypes)
    and starts receiving in the background; ``poll()`` makes the newest received version the
    module's weights (``version``); ``wait_for(version)`` waits until at least that one arrived;
    ``ended`` turns true once the run has finished. A listener (``listen``) also watches its run's
    dir: a run that is over without a word to it (its learner died, or lives on after a failed
    push) ends it too, ``ended`` for a completed run and ``poll``'s SyncError (with the run's
    status) for any other end; a module that does not fit tells the learner, which fails naming it.
    """

    def __init__(self, address: process_groups.StoreAddress, rank: int | None, bucket_bytes: int, timeout_s: float,
                 loopback: bool = False, listener: int | None = None,
                 initial: FlatBuffer | None = None, version: int = -1, run_dir: Path | None = None):
        self._address, self._rank, self._listener = address, rank, listener
        self._run_dir = run_dir  # a listener's: whether its run is over bounds every wait
        self._bucket_bytes, self._timeout_s, self._loopback = bucket_bytes, timeout_s, loopback
        self._initial, self.version = initial, version
        self._policy: nn.Module | None = None
        self.ended = False  # the run has finished: no more versions will come

    def __getstate__(self):
        state = self.__dict__.copy()
        for key in ("_lock", "_thread", "_watch", "_sets", "_group"):
            state.pop(key, None)
        return state

    def connect(self, policy: nn.Module) -> None:
        self._raise_if_over()
        store = self._connect_store()
        layout = (self._initial.layout if self._initial is not None else
                  pickle.loads(process_groups.wait_for_key(store, "layout", self._timeout_s)))
        self._sets = [FlatBuffer(layout, shared=False) for _ in range(_SETS)]
        self._check_matches(policy, store)
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
        if self._run_dir is not None:
            self._watch = threading.Thread(target=self._watch_run, name="rltrain-watch-run", daemon=True)
            self._watch.start()

    def _connect_store(self) -> dist.Store:
        """The learner's store once its port answers: a plain connection is tried first, because
        torch's store retries a closed port until its timeout, logging a C++ stack at each try;
        meanwhile a listener sees its run end."""
        host, port = self._address.host, self._address.port
        deadline = time.monotonic() + self._timeout_s
        while not _answers(host, port):
            self._raise_if_over()
            if time.monotonic() > deadline:
                raise ConnectionError(f"cannot reach rltrain's store at {host}:{port} within {self._timeout_s:g}s: "
                                      "is the learner's machine reachable from this one (a firewall)?")
            time.sleep(0.2)
        return self._address.connect(self._timeout_s)  # the store's own waits (the group's join) take its timeout

    def _check_matches(self, policy: nn.Module, store: dist.Store) -> None:
        """The module's layout against the learner's; a listener that does not fit tells the
        learner why before it leaves (the learner then fails at once, naming it)."""
        if self._listener is None:
            self._sets[0].check_matches(policy)
            return
        try:
            self._sets[0].check_matches(policy)
        except SyncError as e:
            try:
                store.set(f"{_REJECTED}/{self._listener}", pickle.dumps((socket.gethostname(), os.getpid(), str(e))))
                store.add(_REJECTIONS, 1)
            except (RuntimeError, dist.DistError):
                pass  # the learner is gone already: nobody to tell
            raise SyncError(f"sync=distributed: listener {self._listener}'s module does not fit the run at "
                            f"{self._run_dir}: {e}. Build it as the run's algo.network (same parameter names and "
                            "shapes); the run fails too, naming this listener") from None

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
        """Wait until weights ``version`` (or newer) arrived, apply them, and return the version
        (woken by the receiving thread; None: ``sync.timeout_s``)."""
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
            size = int(process_groups.wait_for_key(store, "size", _IDLE_S, self._stop_waiting))
            rank = self._rank
            if rank is None:
                first = process_groups.wait_for_key(store, "listeners_at", self._timeout_s, self._stop_waiting)
                rank = int(first) + self._listener
            group = process_groups.gloo_group(store, "weights", rank, size, self._timeout_s, self._loopback,
                                              self._raise_if_stopping)
            # Kept, however this thread ends: destroying a group here could race the interpreter's
            # exit (once ``ended`` or the error is seen), which aborts the process; it goes with the receiver.
            self._group = group
            buckets = [s.buckets(self._bucket_bytes) for s in self._sets]
            while True:
                kind, _, version = process_groups.recv_header(group, 0, _IDLE_S)
                if kind == _CLOSE:
                    with self._lock:
                        self.ended = True
                        self._lock.notify_all()
                    return
                with self._lock:
                    target = next(i for i in range(_SETS) if i not in (self._bound, self._ready))
                try:
                    for _names, chunk in buckets[target]:
                        options = dist.BroadcastOptions()
                        options.rootRank, options.timeout = 0, process_groups.seconds(self._timeout_s)
                        group.broadcast([chunk], options).wait()
                except RuntimeError as e:  # the learner hears at once (it then names whoever died)
                    try:
                        process_groups.send_frame(group, 0, _FAILED, arg=version)
                    except RuntimeError:
                        pass
                    raise RuntimeError(f"receiving weights version {version} failed (a peer's connection closed?): "
                                       f"{str(e).splitlines()[0]}") from None
                with self._lock:
                    self._ready, self._ready_version = target, version
                    self._lock.notify_all()
                process_groups.send_frame(group, 0, _ACK, arg=version)
        except BaseException as e:  # noqa: BLE001  (the collector's next poll raises it)
            if self._stopping():  # closed, or the watch on the run said why already
                return
            # A store whose process died fails with DistNetworkError ("Failed to recv"), a group with "closed by peer".
            gone = (isinstance(e, dist.DistNetworkError)
                    or isinstance(e, RuntimeError) and process_groups.is_peer_gone(e)) and (
                "receiving weights version" not in str(e))
            over = self._run_over_soon() if gone else None
            if over is not None:  # a listener's learner died with its run: say how the run ended
                self._end(*over)
                return
            with self._lock:
                self._error = ("sync=distributed: the learner is gone" if gone else
                               f"sync=distributed: receiving weights failed: {type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else ''}")
                self._lock.notify_all()

    def _stopping(self) -> bool:
        return self._closing or self.ended or self._error is not None

    def _stop_waiting(self) -> bool:
        """Looked at before each look at the store: closing, or a listener's run is over. A learner
        that ends frees its dir's lock before its process (and so its store) goes, so the run's end
        is seen here rather than as a dead socket, which torch logs with a C++ stack."""
        if self._stopping():
            return True
        over = self._run_over()
        if over is not None:
            self._end(*over)
        return over is not None

    def _raise_if_stopping(self) -> None:
        """The weights group's join gives up (closing, or a listener's run is over)."""
        if self._stop_waiting():
            raise RuntimeError("stopped while joining the weights group")

    def _run_over(self) -> tuple[str, str] | None:
        """A listener's run that is over: its status and what to tell the user; None while it lives
        (or before it started, or for a collector's receiver, whose learner's death ends its waits)."""
        if self._run_dir is None:
            return None
        status = _ended_status(self._run_dir)
        if status is not None:
            return status, _ended_message(self._run_dir, status, listening=self._policy is not None)
        contact = _read_json(self._run_dir / CONTACT_FILE)
        a = self._address
        if contact is not None and (contact["host"], contact["port"], contact["prefix"]) != (a.host, a.port, a.prefix):
            return "restarted", (f"sync=distributed: the run at {self._run_dir} restarted (its {CONTACT_FILE} names "
                                 "another store now, as after a torchrun restart): call listen() again to receive "
                                 "from it")
        return None

    def _raise_if_over(self) -> None:
        over = self._run_over()
        if over is not None:
            raise SyncError(over[1])

    def _watch_run(self) -> None:
        """A listener's look at its run's dir while it receives. A run that is over without a word to
        this listener (a learner that ended before its first push, or failed mid-broadcast, in a
        process that lives on, as in a notebook; a store that outlives the learner, as torchrun's
        does) would otherwise leave it waiting days for the next push. A completed run ends the
        listener (``ended``: nothing more will come); any other end is its next ``poll``'s error."""
        while True:
            self._thread.join(_WATCH_S)
            if not self._thread.is_alive() or self._closing:
                return
            over = self._run_over()
            if over is None:
                continue
            self._thread.join(_GRACE_S)  # a learner closing as it should: its last message is on the way
            if self._thread.is_alive():
                self._end(*over)
            return

    def _run_over_soon(self) -> tuple[str, str] | None:
        """After the learner's connection closed: a listener's run, once its dir says it is over
        (the learner's process frees the lock as it exits, a moment after its sockets close)."""
        deadline = time.monotonic() + _GRACE_S
        while self._run_dir is not None:
            over = self._run_over()
            if over is not None or time.monotonic() > deadline:
                return over
            time.sleep(0.1)
        return None

    def _end(self, status: str, why: str) -> None:
        """The run is over: a completed one ends this receiver (nothing more will come); any other
        end is the next ``poll``'s error, ``why``."""
        with self._lock:
            if status == "completed":
                self.ended = True
            elif self._error is None:
                self._error = why
            self._lock.notify_all()

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

    def __init__(self, every: int | None = 1, bucket_mb: PositiveNumber = 16.0, listeners: NonNegativeInt = 0,
                 timeout_s: PositiveNumber = 30.0):
        super().__init__(every)
        self.listeners, self.timeout_s = listeners, timeout_s
        self.bucket_bytes = int(bucket_mb * (1 << 20))
        self._world = process_groups.current()
        self._made: list[DistributedReceiver] = []
        self._initial: FlatBuffer | None = None
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
            self._server, self.address = process_groups.local_store(self.timeout_s)
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

    A run that is over (or ends while this waits) raises SyncError saying so and with what status;
    a finished run's ``sync.json`` stays in its dir, but there is nothing to listen to.
    """
    run_dir = Path(run_dir)
    contact = _wait_for_contact(run_dir, timeout_s)
    if not 0 <= index < contact["listeners"]:
        raise SyncError(f"listener index {index} is out of range: the run at {run_dir} has sync.listeners="
                        f"{contact['listeners']}")
    address = process_groups.StoreAddress(contact["host"], contact["port"], contact["prefix"])
    return DistributedReceiver(address, None, contact["bucket_bytes"], timeout_s, loopback=contact["loopback"],
                               listener=index, run_dir=run_dir)


def _wait_for_contact(run_dir: Path, timeout_s: float) -> dict:
    """The live run's ``sync.json``, once it is written (up to ``timeout_s``); a run that is over,
    or ends meanwhile (failing to start, say), is said at once."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = _ended_status(run_dir)
        if status is not None:
            raise SyncError(_ended_message(run_dir, status))
        contact = _read_json(run_dir / CONTACT_FILE)
        if contact is not None:
            return contact
        if time.monotonic() > deadline:
            raise SyncError(f"{run_dir / CONTACT_FILE} did not appear within {timeout_s:g}s: is a sync=distributed "
                            "run with sync.listeners >= 1 running in that dir?")
        time.sleep(0.1)


def _ended_status(run_dir: Path) -> str | None:
    """The status the run in ``run_dir`` ended with, or None while it lives or before it started.
    It is over once its lock is free (the kernel frees a killed run's) and it left a summary.json
    or a sync.json; a sync.json newer than its summary.json is a session that wrote none (killed)."""
    from rltrain.run_dir import lock_held  # listeners only: collector ranks import this module too

    summary, contact = run_dir / SUMMARY_FILE, run_dir / CONTACT_FILE
    if not (summary.exists() or contact.exists()) or lock_held(run_dir):
        return None
    unknown = f"unknown: its process is gone without writing {SUMMARY_FILE} (killed?)"
    try:
        if contact.exists() and (not summary.exists() or contact.stat().st_mtime_ns > summary.stat().st_mtime_ns):
            return unknown
    except FileNotFoundError:  # a run starting in that dir now: look again
        return None
    status = (_read_json(summary) or {}).get("status")
    return unknown if status is None else status


def _ended_message(run_dir: Path, status: str, listening: bool = False) -> str:
    """What a listener says at a run that is over: before it listened, or while it did."""
    ended = f"sync=distributed: the run at {run_dir} has ended with status {status!r}"
    if listening:
        return f"{ended}: no more weights will come"
    no_contact = "" if (run_dir / CONTACT_FILE).exists() else (
        f" (it wrote no {CONTACT_FILE}: it ended before its weights sync started, or it was not started with "
        "sync=distributed sync.listeners>=1)")
    return (f"{ended}{no_contact}, so there is nothing to listen to: start the run first (listen() waits for it), "
            "or point listen() at a live run's dir")


def _read_json(path: Path) -> dict | None:
    """The file's JSON, or None while it is missing or half written (sync.json is written in place)."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def _answers(host: str, port: int) -> bool:
    """Whether something listens at ``host:port`` (one plain TCP connection, closed at once)."""
    try:
        socket.create_connection((host, port), timeout=1.0).close()
    except OSError:
        return False
    return True
