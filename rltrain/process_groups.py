"""rltrain's place in torch.distributed: the torchrun job a process belongs to (``World``), the
process groups rltrain makes for itself, and framed messages over them.

rltrain never touches torch.distributed's default group: a user's own ``init_process_group``
(their DDP, say) is neither replaced nor destroyed. Each of rltrain's groups is a
``ProcessGroupGloo`` of its own over a TCPStore, under a key prefix of this job and restart
attempt (so a torchrun restart never reads the keys of the attempt before it):

- under torchrun, the job's store (``MASTER_ADDR:MASTER_PORT``: torchrun's agent hosts it, or
  rank 0 does, shared with the user's group through ``multi_tenant``);
- for worker processes of one learner (``sync=distributed`` with ``collector=lockstep|async``),
  a store the learner hosts on 127.0.0.1 at a port the kernel picks.

Waits on a peer fail at once when its process dies (its sockets close) and after a timeout when
it is alive but silent. Only torch here: spawned collector workers import this module.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import distributed as dist

from rltrain.errors import CollectorError, ConfigError

# Frames on a group: a header (kind, payload bytes, argument) then, if any, the payload.
HEADER = 3


def seconds(s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=s)


@dataclass(frozen=True)
class StoreAddress:
    """Where a group's store is and the key prefix of this job: picklable, so it can be handed
    to a spawned process or written to a file for a process of the user's own."""

    host: str
    port: int
    prefix: str

    def connect(self, timeout_s: float) -> dist.Store:
        try:
            store = dist.TCPStore(self.host, self.port, None, False, timeout=seconds(timeout_s),
                                  wait_for_workers=False)
        except (RuntimeError, dist.DistError) as e:
            raise ConnectionError(f"cannot reach rltrain's store at {self.host}:{self.port} within {timeout_s:g}s "
                                  f"({type(e).__name__}: {str(e).splitlines()[0]})") from None
        return dist.PrefixStore(self.prefix, store)


class World:
    """This process's rank in a torchrun job of ``size`` processes (rank 0: the learner), and
    rltrain's keys in the job's store."""

    def __init__(self, rank: int, size: int, local_rank: int, address: StoreAddress, store: dist.Store,
                 server: dist.Store | None = None):
        self.rank, self.size, self.local_rank, self.address = rank, size, local_rank, address
        self.store = store
        self._server = server  # rank 0's store server, when torchrun's agent does not host one

    @property
    def host(self) -> str:
        return socket.gethostname()

    @classmethod
    def from_env(cls) -> World | None:
        """The job torchrun (or any launcher setting its variables) started this process in; None
        outside one, or in a job of one process. ``RLTRAIN_CONNECT_TIMEOUT_S`` (default 60) bounds
        the wait for the job's store."""
        env = os.environ
        timeout_s = float(env.get("RLTRAIN_CONNECT_TIMEOUT_S", "60"))
        if "RANK" not in env or "WORLD_SIZE" not in env:
            return None
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing:
            raise ConfigError(f"RANK and WORLD_SIZE are set but {' and '.join(missing)} is not; launch with torchrun "
                              "(which sets them all) or set them yourself")
        rank, size = int(env["RANK"]), int(env["WORLD_SIZE"])
        if size < 2:
            return None
        host, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
        job = env.get("TORCHELASTIC_RUN_ID", "job")
        prefix = f"rltrain/{job}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        server = None
        if rank == 0 and env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            try:  # the user's own env:// group may host one on the same port: multi_tenant shares it
                server = dist.TCPStore(host, port, None, True, timeout=seconds(timeout_s), wait_for_workers=False,
                                       multi_tenant=True)
            except (RuntimeError, dist.DistError) as e:
                raise ConnectionError(f"rank 0 cannot host the job's store at MASTER_ADDR:MASTER_PORT={host}:{port} "
                                      f"({e}); is the port free on this machine?") from None
        address = StoreAddress(host, port, prefix)
        try:
            store = address.connect(timeout_s)
        except ConnectionError as e:
            raise ConnectionError(f"{e}: check MASTER_ADDR/MASTER_PORT (torchrun's --rdzv-endpoint or --master-addr/"
                                  "--master-port), that rank 0 is running, and that the port is open") from None
        return cls(rank, size, int(env.get("LOCAL_RANK", rank)), address, store, server)


_current: World | None = None
_looked = False


def current() -> World | None:
    """The job this process belongs to (read once from torchrun's variables), or None."""
    global _current, _looked
    if not _looked:
        _current, _looked = World.from_env(), True
    return _current


def local_store(timeout_s: float) -> tuple[dist.Store, StoreAddress]:
    """A store hosted by this process on 127.0.0.1 (at a port the kernel picks), for worker
    processes of this machine. Keep the returned store alive as long as the group is used."""
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=seconds(timeout_s), wait_for_workers=False)
    address = StoreAddress("127.0.0.1", server.port, f"rltrain/local-{os.getpid()}/")
    return dist.PrefixStore(address.prefix, server), address


def gloo_group(store: dist.Store, name: str, rank: int, size: int, timeout_s: float,
               loopback: bool = False, watch: Callable[[], None] | None = None) -> dist.ProcessGroupGloo:
    """rltrain's own gloo group ``name`` (its keys apart from any other group's); blocks until
    all ``size`` ranks have joined, raising TimeoutError after ``timeout_s``. Meanwhile ``watch()``
    is called every 0.1 s (it raises to give up: a rank that failed while starting, say)."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = seconds(timeout_s)
    if loopback:
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    else:
        options._devices = [dist.ProcessGroupGloo.create_default_device()]
    made: dict = {}

    def join():
        try:
            made["group"] = dist.ProcessGroupGloo(dist.PrefixStore(f"{name}/", store), rank, size, options)
        except (RuntimeError, dist.DistError) as e:
            made["error"] = e

    thread = threading.Thread(target=join, name=f"rltrain-join-{name}", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.1)
        if watch is not None and thread.is_alive():
            watch()
    if "error" in made:
        raise TimeoutError(f"{name}: not every one of the {size} processes joined within {timeout_s:g}s "
                           f"({str(made['error']).splitlines()[0]})") from None
    return made["group"]


def wait_for_key(store: dist.Store, key: str, timeout_s: float, stop: Callable[[], bool] | None = None) -> bytes:
    """``store[key]`` once some process has set it (looked for every 20 ms: the store's own wait
    logs a warning at every timeout), or TimeoutError, or ``stop()`` turned true."""
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if (stop is not None and stop()) or time.monotonic() > deadline:
            raise TimeoutError(f"{key!r} was not published within {timeout_s:g}s")
        time.sleep(0.02)
    return store.get(key)


def report_failure(store: dist.Store, rank: int, what: str, details: str) -> None:
    """A rank that failed before its groups formed: the learner's ``raise_failures`` names it."""
    store.set(f"failed/{rank}", pickle.dumps((what, details)))
    store.add("failures", 1)


def raise_failures(store: dist.Store, ranks: Iterable[int]) -> None:
    """Raise CollectorError (with the traceback) if one of ``ranks`` reported a failure."""
    if not store.add("failures", 0):
        return
    for r in ranks:
        if store.check([f"failed/{r}"]):
            what, details = pickle.loads(store.get(f"failed/{r}"))
            store.set(f"failure_seen/{r}", "1")
            raise CollectorError(f"collector rank {r} failed while starting: {what}", details=details)


def exit_without_teardown(code: int) -> None:
    """End this process now, its output flushed, skipping the interpreter's teardown: a thread may
    still wait in gloo (for a push or broadcast that will not come), or still be releasing a finished
    collective's tensors (which takes the GIL); tearing down under either aborts the process or holds
    it up to the wait's timeout. For rltrain's own processes only (collector workers, the ranks of a
    torchrun job), whose cleanup is done by then."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def send_frame(group, dst: int, kind: int, payload: torch.Tensor | None = None, arg: int = 0) -> None:
    """A header, then ``payload`` (a contiguous CPU tensor) if any; returns once both are sent."""
    nbytes = payload.numel() * payload.element_size() if payload is not None else 0
    group.send([torch.tensor([kind, nbytes, arg], dtype=torch.int64)], dst, 0).wait()
    if payload is not None and nbytes:
        group.send([payload], dst, 1).wait()


def recv_header(group, src: int, timeout_s: float) -> tuple[int, int, int]:
    header = torch.zeros(HEADER, dtype=torch.int64)
    group.recv([header], src, 0).wait(seconds(timeout_s))
    kind, nbytes, arg = header.tolist()
    return kind, nbytes, arg


def recv_payload(group, src: int, into: torch.Tensor | None, nbytes: int, timeout_s: float) -> torch.Tensor:
    """The payload after a header: into ``into`` (its size must be ``nbytes``) or a new byte tensor."""
    buffer = torch.empty(nbytes, dtype=torch.uint8) if into is None else into
    if nbytes:
        group.recv([buffer], src, 1).wait(seconds(timeout_s))
    return buffer


def encode(obj) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def decode(buffer: torch.Tensor):
    return pickle.loads(buffer.numpy().tobytes())


def is_peer_gone(e: BaseException) -> bool:
    """Whether a failed wait means the other process is gone (rather than silent)."""
    text = str(e)
    return "closed by peer" in text or "Connection reset" in text or "Broken pipe" in text or "EOF" in text
