"""Weight slots that every rank of a sharded learner on one machine maps: pushes that gather nothing.

Each rank of ``strategy=fsdp`` holds a shard of every weight (FSDP2 cuts dim 0 into one run of rows per rank).
Made whole the usual way, a push all-gathers each weight over the process group, so that every rank ends with
a whole copy of it (gloo on loopback moves the bytes through sockets). Where all the learner's ranks share one
machine, ``shared_slots`` gives them the same shared-memory slots instead: each rank copies its own rows into
place, a barrier says the slot is whole, and every rank's engine reads that one copy. A push then costs each
rank a copy of its shard, not a gather of the whole.

The slots live in one file of /dev/shm that the first rank creates and removes once every rank has opened it
(the kernel frees the memory with the last mapping); one left by a process killed in between is removed the
next time slots are made. A slot handed to another process (an engine's) travels
as its open file. Where the ranks span machines, or /dev/shm is missing, the slots are each rank's own and
a push gathers as before (``FlatBuffer.copy_from``).
"""

from __future__ import annotations

import os
import socket
import uuid
import weakref
from multiprocessing import reduction
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rltrain.sync.base import FlatBuffer

_SHM = Path("/dev/shm")
_PREFIX = "rltrain-slots-"


def shared_slots(weights: dict[str, torch.Tensor], count: int, pinned: bool) -> list[FlatBuffer]:
    """``count`` shared-memory slots for ``weights`` (a learner's, by name): shared by the ranks of a sharded
    learner that all run on this machine (every one of them calls this, together), else this process's own."""
    layout = {name: (tuple(t.shape), t.dtype) for name, t in weights.items()}
    group = _one_machine_group(weights)
    if group is None:
        return [FlatBuffer(layout, shared=True, pinned=pinned) for _ in range(count)]
    return [NodeBuffer(layout, group, pinned) for _ in range(count)]


def _one_machine_group(weights: dict[str, torch.Tensor]) -> dist.ProcessGroup | None:
    """The process group that the sharded ``weights`` (DTensors) are split over, if all its ranks run on this
    machine; None for a learner that is not sharded, or spans machines."""
    sharded = [t for t in weights.values() if isinstance(t, DTensor)]
    if not sharded or sharded[0].device_mesh.ndim != 1:
        return None
    group = sharded[0].device_mesh.get_group()
    machines = [None] * dist.get_world_size(group)
    dist.all_gather_object(machines, (socket.gethostname(), _boot_id(), _SHM.is_dir()), group=group)
    return group if len(set(machines)) == 1 and machines[0][2] else None


def _boot_id() -> str:
    """What tells this machine from another of the same host name (containers): its kernel's boot id."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


class NodeBuffer(FlatBuffer):
    """A ``FlatBuffer`` that every rank of ``group`` (one machine's) maps: ``copy_from`` writes this rank's rows
    of each sharded weight, and returns once every rank has written its own."""

    def __init__(self, layout: dict, group: dist.ProcessGroup, pinned: bool = False):
        self.group, self._rank = group, dist.get_rank(group)
        self._fd = _open_together(FlatBuffer.nbytes(layout), group)
        weakref.finalize(self, os.close, self._fd)
        buffer = _mapped(self._fd, FlatBuffer.nbytes(layout))
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
    the last ranks' shorter or empty); None for any other placement."""
    if len(tensor.placements) != 1 or not tensor.placements[0].is_shard(0):
        return None
    rows, ranks = tensor.shape[0], tensor.device_mesh.size()
    per_rank = -(-rows // ranks)
    start = min(tensor.device_mesh.get_local_rank() * per_rank, rows)
    local = tensor.to_local()
    return (start, local) if local.shape[0] == min(per_rank, rows - start) else None


def _open_together(nbytes: int, group: dist.ProcessGroup) -> int:
    """An open shared-memory file of ``nbytes``, the same on every rank of ``group`` (all call it): rank 0 makes
    it in /dev/shm, every rank opens it, and rank 0 removes its name."""
    path = [None]
    if dist.get_rank(group) == 0:
        _sweep()
        path[0] = str(_SHM / f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
        fd = os.open(path[0], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, nbytes)
    dist.broadcast_object_list(path, group=group, group_src=0)
    if dist.get_rank(group) != 0:
        fd = os.open(path[0], os.O_RDWR)
    dist.barrier(group=group)
    if dist.get_rank(group) == 0:
        os.unlink(path[0])  # every rank holds it open: the memory stays until the last descriptor and mapping go
    return fd


def _sweep() -> None:
    """Remove the slot files of processes that are gone: killed (SIGKILL) in the moment between making a file
    and removing its name, they could not remove it."""
    for path in _SHM.glob(f"{_PREFIX}*"):
        try:
            os.kill(int(path.name.removeprefix(_PREFIX).split("-")[0]), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
        except (ValueError, PermissionError):  # not a name of ours, or another user's live process
            continue


def _mapped(fd: int, nbytes: int) -> torch.Tensor:
    """The bytes of the open file ``fd``, mapped shared (a write is seen by every process that maps it)."""
    storage = torch.UntypedStorage.from_file(f"/proc/self/fd/{fd}", shared=True, nbytes=nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage)
