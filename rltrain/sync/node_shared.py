"""Weight slots that every rank of a sharded learner on one machine maps: pushes that gather nothing.

Each rank of ``strategy=fsdp`` holds a shard of every weight (FSDP2 cuts dim 0 into one run of rows per rank).
Made whole the usual way, a push all-gathers each weight over the process group, so that every rank ends with
a whole copy of it (gloo on loopback moves the bytes through sockets). Where all the learner's ranks share one
machine, ``shared_slots`` gives them the same shared-memory slots instead: each rank copies its own rows into
place, a barrier says the slot is whole, and every rank's engine reads that one copy. A push then costs each
rank a copy of its shard, not a gather of the whole.

Each slot lives in a file of /dev/shm that the first rank creates and removes once every rank has opened it
(the kernel frees the memory with the last mapping); one left by a process killed in between is removed the
next time slots are made. Where /dev/shm has no room for them, the run stops, saying so. A slot handed to
another process (an engine's) travels as its open file. Where the ranks span machines, or cannot open one
another's files (containers with a /dev/shm each), the slots are each rank's own and a push gathers as before
(``FlatBuffer.copy_from``).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import socket
import time
import uuid
import weakref
from multiprocessing import reduction
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rltrain.errors import SyncError
from rltrain.sync.base import FlatBuffer

log = logging.getLogger("rltrain")

_SHM = Path("/dev/shm")
_PREFIX = "rltrain-slots-"


def shared_slots(weights: dict[str, torch.Tensor], count: int, pinned: bool) -> list[FlatBuffer]:
    """``count`` shared-memory slots for ``weights`` (a learner's, by name): shared by the ranks of a sharded
    learner that all run on this machine (every one of them calls this, together), else this process's own."""
    layout = {name: (tuple(t.shape), t.dtype) for name, t in weights.items()}
    group = _one_machine_group(weights)
    files = None if group is None else _open_together(FlatBuffer.nbytes(layout), count, group)
    if files is None:
        return [FlatBuffer(layout, shared=True, pinned=pinned) for _ in range(count)]
    return [NodeBuffer(layout, group, fd, pinned) for fd in files]


def _one_machine_group(weights: dict[str, torch.Tensor]) -> dist.ProcessGroup | None:
    """The process group that the sharded ``weights`` (DTensors) are split over, if all its ranks run on this
    machine and see the same /dev/shm; None for a learner that is not sharded, or spans machines."""
    sharded = [t for t in weights.values() if isinstance(t, DTensor)]
    if not sharded or sharded[0].device_mesh.ndim != 1:
        return None
    group = sharded[0].device_mesh.get_group()
    machines = [None] * dist.get_world_size(group)
    # (containers of one host sharing its network have its name and boot id, and each may have a /dev/shm of its
    # own: a file system is told from another by its device number)
    shm = _SHM.stat().st_dev if _SHM.is_dir() else None
    dist.all_gather_object(machines, (socket.gethostname(), _boot_id(), shm), group=group)
    return group if len(set(machines)) == 1 and shm is not None else None


def _boot_id() -> str:
    """What tells this machine from another of the same host name (containers): its kernel's boot id."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


class NodeBuffer(FlatBuffer):
    """A ``FlatBuffer`` that every rank of ``group`` (one machine's) maps, from ``fd`` (``_open_together``'s):
    ``copy_from`` writes this rank's rows of each sharded weight, and returns once every rank has written its own."""

    def __init__(self, layout: dict, group: dist.ProcessGroup, fd: int, pinned: bool = False):
        self.group, self._rank, self._fd = group, dist.get_rank(group), fd
        weakref.finalize(self, os.close, fd)
        buffer = _mapped(fd, FlatBuffer.nbytes(layout))
        buffer.zero_()  # each process maps every page now, not at its pushes (a fault per page of the slot)
        dist.barrier(group=group)  # (before any rank writes weights into it)
        super().__init__(layout, shared=True, pinned=pinned, buffer=buffer)

    def file(self) -> tuple[int, int]:
        return self._fd, self.buffer.numel()

    def __getstate__(self):  # to another process of this machine (an engine's): the open file, mapped again there
        return {"layout": self.layout, "_offsets": self._offsets, "nbytes": self.buffer.numel(),
                "fd": reduction.DupFd(self._fd)}

    def __setstate__(self, state):
        fd, nbytes = state.pop("fd").detach(), state.pop("nbytes")
        self.group, self._rank, self._fd = None, None, fd
        weakref.finalize(self, os.close, fd)
        super().__setstate__({**state, "buffer": _mapped(fd, nbytes)})

    def copy_from(self, weights: dict[str, torch.Tensor], names: list[str] | None = None) -> None:
        """Every rank of the group calls it, together: each weight's rows that this rank holds go into place
        (a weight it holds whole, or split some other way: rank 0 writes it, gathered by every rank)."""
        for name in list(self.views) if names is None else names:
            tensor, view = weights[name], self.views[name]
            if isinstance(tensor, DTensor):
                if (rows := _own_rows(tensor)) is None:
                    whole = tensor.full_tensor()  # (a collective: every rank takes part)
                    if self._rank == 0:
                        view.copy_(whole)
                else:
                    start, local = rows
                    view[start:start + local.shape[0]].copy_(local)
            elif self._rank == 0:
                view.copy_(tensor)
        dist.barrier(group=self.group)

    def anywhere(self, flags: list[bool]) -> list[bool]:
        """Each of ``flags`` (one list, the same length on every rank of the group): whether any rank set it.
        Every rank calls it, together."""
        device = "cuda" if dist.get_backend(self.group) == "nccl" else "cpu"
        mask = torch.tensor(flags, dtype=torch.int32, device=device)
        dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=self.group)
        return [bool(f) for f in mask.tolist()]


def _own_rows(tensor: DTensor) -> tuple[int, torch.Tensor] | None:
    """Where this rank's rows of ``tensor`` start, and the rows: FSDP2's dim-0 shards (``torch.chunk``'s runs,
    the last ranks' shorter or empty); None for any other placement (the same on every rank: it decides
    whether every rank gathers the weight)."""
    if len(tensor.placements) != 1 or not tensor.placements[0].is_shard(0):
        return None
    rows, ranks = tensor.shape[0], tensor.device_mesh.size()
    per_rank = -(-rows // ranks)
    start = min(tensor.device_mesh.get_local_rank() * per_rank, rows)
    local = tensor.to_local()
    if local.shape[0] != min(per_rank, rows - start):
        raise RuntimeError(f"a shard of {local.shape[0]} rows where FSDP2 cuts {min(per_rank, rows - start)} "
                           f"of {rows} over {ranks} ranks: a placement this push does not know")
    return start, local


def _open_together(nbytes: int, count: int, group: dist.ProcessGroup) -> list[int] | None:
    """``count`` open shared-memory files of ``nbytes`` each, the same on every rank of ``group`` (all call it):
    rank 0 makes them in /dev/shm, every rank opens them, and rank 0 removes their names. None on every rank
    where a rank could not open them (each rank then keeps slots of its own); a SyncError on every rank where
    /dev/shm has no room for them."""
    made, fds, problem = [None, None], [], None  # made: the files' paths, or why they could not be made
    if dist.get_rank(group) == 0:
        *made, fds = _make(nbytes, count)
    dist.broadcast_object_list(made, group=group, group_src=0)
    paths, error = made
    if error is not None:
        raise SyncError(error)
    if dist.get_rank(group):
        try:
            fds = [os.open(path, os.O_RDWR) for path in paths]
        except OSError as e:
            problem = f"rank {dist.get_rank()}: {e}"
    problems = [None] * dist.get_world_size(group)
    dist.all_gather_object(problems, problem, group=group)
    if dist.get_rank(group) == 0:
        for path in paths:
            os.unlink(path)  # every rank holds them open: the memory stays until the last descriptor and mapping go
    if any(problems):
        for fd in fds:
            os.close(fd)
        log.warning("the learner's ranks keep weight slots of their own (each push gathers the weights), since "
                    "they cannot open one another's in /dev/shm: %s", next(p for p in problems if p))
        return None
    return fds


def _make(nbytes: int, count: int) -> list:
    """Rank 0's part of ``_open_together``: ``[paths, None, fds]``, or ``[None, why, []]`` (none left behind). Each
    file is held with a shared ``flock`` while it has a name, which tells ``_sweep`` that its maker lives."""
    _sweep()
    paths, fds = [], []
    try:
        for _ in range(count):
            paths.append(str(_SHM / f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"))
            fds.append(os.open(paths[-1], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
            fcntl.flock(fds[-1], fcntl.LOCK_SH)
            os.posix_fallocate(fds[-1], 0, nbytes)  # (a file only truncated to size would fault at its first write)
    except OSError as e:
        for path in paths:
            Path(path).unlink(missing_ok=True)
        for fd in fds:
            os.close(fd)
        if e.errno != errno.ENOSPC:
            return [None, f"sync: cannot make the weight slots in {_SHM}: {e}", []]
        free = shutil.disk_usage(_SHM).free + nbytes * (len(paths) - 1)
        return [None, f"sync: the {count} weight slots need {count * nbytes / 1e6:,.0f} MB of shared memory, and "
                      f"{_SHM} has {free / 1e6:,.0f} MB free: give this machine (or container) more shared memory "
                      "(docker run --shm-size=...), or lower sync.slots", []]
    return [paths, None, fds]


def _sweep() -> None:
    """Remove slot files of this user that nobody holds: a process killed (SIGKILL) between making a file and
    removing its name could not remove it. A file's maker holds a shared ``flock`` on it, so one that can be
    locked exclusively is stale; one made in the last seconds is left alone (its lock may be on its way)."""
    for path in _SHM.glob(f"{_PREFIX}*"):
        try:
            if path.stat().st_uid != os.getuid() or time.time() - path.stat().st_mtime < 10:
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                path.unlink()
            finally:
                os.close(fd)
        except OSError:  # held (its maker lives), or gone meanwhile
            continue


def _mapped(fd: int, nbytes: int) -> torch.Tensor:
    """The bytes of the open file ``fd``, mapped shared (a write is seen by every process that maps it)."""
    storage = torch.UntypedStorage.from_file(f"/proc/self/fd/{fd}", shared=True, nbytes=nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage)
