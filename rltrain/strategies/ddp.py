"""``strategy=ddp``: one learner on every rank of a torchrun job, torch's ``DistributedDataParallel``
averaging the gradients of each backward pass over the ranks.

Each rank collects its share of the global batch (``collector.frames_per_batch`` and the envs are split
over the ranks), computes the loss on it and steps its own optimizer; since the averaged gradients are
the same everywhere, so are the weights. What must be global (advantage normalization, observation and
return statistics, the approximate KL that stops the epochs) is computed over every rank's data through
``moments``, ``normalize`` and ``mean``.

The group is torch's default one: made here (gloo on the CPU, NCCL for CUDA tensors) when nothing made
it yet, from the job's store under the key prefix of this restart of the job, and destroyed on ``close``;
one a user's script made already is used and left alone. Every collective is bounded by ``timeout_s``: a
rank that dies fails the others at once (its sockets close), one that hangs fails them after the timeout,
named by what it last began (``note``: each rank tells the job's store as it begins each phase).
"""

from __future__ import annotations

import datetime
import io
import itertools
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from rltrain import process_groups
from rltrain.algos.normalization import merge_moments
from rltrain.errors import ConfigError, LearnerRankError
from rltrain.rules import PositiveNumber
from rltrain.strategies.base import Strategy

TORCHRUN = "torchrun --standalone --nproc-per-node=2 -m rltrain"  # the launch line errors suggest


_EXITING_S = 3.0  # how long a killed rank of this machine may take to show as dead, once its sockets closed
_NOTES_S = 10.0  # how long a note, or a look at the other ranks' notes, waits for the job's store at most
_GROUPS = itertools.count()  # the groups this process made: each its own keys (a sweep builds one run after another)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this machine runs (a zombie, dead but not yet reaped by torchrun, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (not Linux): signal 0 asks whether it exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def _to_bytes(obj: Any) -> bytes:
    """``obj`` as torch.save writes it (torch's own pickling of tensors inside ``all_gather_object`` does not
    load back on the CPU: the legacy storage path fails), for the object collectives."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False, map_location="cpu")


class _Method(nn.Module):
    """``module.method`` as a module's forward, so that DDP (which hooks ``forward``) can wrap it."""

    def __init__(self, module: nn.Module, method: str):
        super().__init__()
        self.module, self.method = module, method

    def forward(self, *args, **kwargs):
        call = self.module if self.method == "forward" else getattr(self.module, self.method)
        return call(*args, **kwargs)


class DDP(Strategy):
    """Data-parallel learners, one per rank of the torchrun job, with replicated weights."""

    PARALLEL = True

    @classmethod
    def check_config(cls, values: dict, config: dict) -> None:
        """A data-parallel learner needs the ranks torchrun starts (rltrain.rules: the config check asks this)."""
        if process_groups.current() is None:
            raise ConfigError(f"strategy={cls.__name__.lower()} runs one learner on each process of a torchrun job, "
                              f"and this process is not in one; launch with: {TORCHRUN} "
                              f"strategy={cls.__name__.lower()} (or strategy=single for one process)")

    def __init__(self, timeout_s: PositiveNumber = 600.0):  # bound of every wait on the other ranks (a collective)
        self.timeout_s = timeout_s
        self._owns_group = not dist.is_initialized()
        world = process_groups.current()
        if world is None and self._owns_group:
            self.check_config({}, {})  # (raises: this process is in no torchrun job)
        # what each rank last said it began (``note``), in the job's store; this rank's own last words
        self._notes = None if world is None else dist.PrefixStore("doing/", world.address.connect(_NOTES_S))
        self._last_note = ""
        if self._owns_group:
            backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
            # Not env://: torchrun's agent keeps one store for every restart of a job (--max-restarts), and a
            # group made from env:// reads the addresses the last attempt's ranks left in it, so a restarted
            # job's ranks would wait on processes that are gone. The job's store under this attempt's prefix
            # (the World's) holds none of them; a client of its own bounds the ranks' rendezvous by timeout_s.
            store = dist.PrefixStore(f"learners/{next(_GROUPS)}/", world.address.connect(timeout_s))
            dist.init_process_group(backend, store=store, rank=world.rank, world_size=world.size,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self._wrapped: set[int] = set()
        self.members = self.gather((socket.gethostname(), os.getpid()))  # to name a rank that is gone

    def device(self, requested: torch.device) -> torch.device:
        """This rank's learner device: its own GPU (``LOCAL_RANK``) where the learner is on CUDA."""
        if requested.type != "cuda":
            return requested
        device = torch.device("cuda", self.local_rank)
        torch.cuda.set_device(device)
        return device

    def wrap(self, module: nn.Module, method: str = "forward") -> Callable:
        if id(module) in self._wrapped:  # two wrappers would each average the same gradients
            raise ValueError(f"{type(module).__name__} is wrapped already: wrap each module once")
        self._wrapped.add(id(module))
        first = next(module.parameters())
        ids = [first.device.index] if first.device.type == "cuda" else None
        # Buffers (observation statistics) are equal at the start (synced once) and kept equal by the update
        # itself (``moments``), not broadcast before every forward pass.
        return DistributedDataParallel(_Method(module, method), device_ids=ids, forward_sync_buffers=False)

    def accumulating(self, wrapped: Callable):
        return wrapped.no_sync()

    def moments(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        mean, var = x.mean(0), x.var(0, unbiased=False)
        local = torch.stack([mean, var, torch.full_like(mean, x.shape[0])])  # one collective for all three
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local.contiguous())
        mean, var, count = parts[0][0], parts[0][1], int(parts[0][2].reshape(-1)[0])
        for part in parts[1:]:
            mean, var, count = merge_moments(mean, var, count, part[0], part[1], int(part[2].reshape(-1)[0]))
        return mean, var, count

    def normalize(self, x: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
        mean, var, count = self.moments(x.reshape(-1, 1))
        std = (var * count / max(count - 1, 1)).sqrt()  # unbiased, as torch.std
        return (x - mean) / (std + eps)

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        return self.sum(x) / self.size

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        total = x.detach().clone()
        dist.all_reduce(total)
        return total

    def gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj)  # plain values: pickled as they are (a few times faster than torch.save)
        return out

    def max(self, values: list) -> list:
        integers = all(isinstance(v, int) for v in values)
        top = torch.tensor(values, dtype=torch.int64 if integers else torch.float64)  # on the CPU: gloo, always
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        return top.tolist()

    def gather_to_main(self, obj: Any) -> list[Any] | None:
        out: list[Any] | None = [None] * self.size if self.is_main else None
        dist.gather_object(_to_bytes(obj), out, dst=0)
        return [_from_bytes(b) for b in out] if out is not None else None

    def broadcast(self, obj: Any) -> Any:
        box = [_to_bytes(obj)]
        dist.broadcast_object_list(box, src=0)
        return _from_bytes(box[0])

    def note(self, doing: str) -> None:
        self._last_note = doing
        if self._notes is not None:
            try:
                self._notes.set(str(self.rank), f"{time.time():.3f} {doing}")
            except RuntimeError:  # the store went away: the next collective says what failed
                self._notes = None

    def _last_notes(self) -> dict[int, tuple[float, str]]:
        """Each other rank's last ``note``: seconds since (by the clocks of two machines: at least 0), and what
        it began then. A rank that never said is left out."""
        notes = {}
        for rank in range(self.size):
            if rank == self.rank or self._notes is None:
                continue
            try:
                if self._notes.check([str(rank)]):
                    at, doing = self._notes.get(str(rank)).decode().split(" ", 1)
                    notes[rank] = (max(time.time() - float(at), 0.0), doing)
            except ValueError:  # not a note of this code's
                continue
            except RuntimeError:  # the store is gone too: nothing more to name
                break
        return notes

    def failure(self, error: BaseException, during: str) -> Exception | None:
        """A collective that failed because another rank is gone (its sockets closed: named where it ran on this
        machine) or silent for ``timeout_s``."""
        text = str(error)
        if not isinstance(error, (RuntimeError, dist.DistError)):
            return None
        host = socket.gethostname()
        local = [r for r, (h, _) in enumerate(self.members) if r != self.rank and h == host]
        gone = [r for r in local if not _alive(self.members[r][1])]
        # A killed process's sockets close while it exits, before /proc shows it dead: a peer that went away
        # is looked for among this machine's ranks for a moment before it is said to be another machine's.
        deadline = time.monotonic() + _EXITING_S
        while not gone and local and process_groups.is_peer_gone(error) and time.monotonic() < deadline:
            time.sleep(0.05)
            gone = [r for r in local if not _alive(self.members[r][1])]
        first = text.splitlines()[0] if text else type(error).__name__
        if gone:
            names = ", ".join(f"rank {r} (pid {self.members[r][1]})" for r in gone)
            return LearnerRankError(f"learner {names} of this job died during {during} on rank {self.rank}; its "
                                    f"log is ranks/{gone[0]}.log in the run dir ({first})")
        if process_groups.is_peer_gone(error):
            return LearnerRankError(f"a learner rank on another machine left the job during {during} on rank "
                                    f"{self.rank} ({first}); see the ranks/<rank>.log files in the run dir")
        if "timeout" in text.lower() or "timed out" in text.lower():
            # A rank whose last note is this rank's own (the same agreement of the same step) waits beside it; of
            # the others, those that began what they were doing at least as long ago as this rank waited for them.
            apart = {r: note for r, note in self._last_notes().items() if note[1] != self._last_note}
            stuck = [r for r, (ago, _) in apart.items() if ago >= self.timeout_s] or list(apart)
            told = "; ".join(f"rank {r} (pid {self.members[r][1]} on {self.members[r][0]}) began {apart[r][1]} "
                             f"{apart[r][0]:.0f}s ago" for r in stuck)
            who = (f"learner rank{'s' if len(stuck) > 1 else ''} {', '.join(map(str, stuck))}" if stuck
                   else "the other learner ranks")
            return LearnerRankError(f"{who} did not answer within strategy.timeout_s={self.timeout_s:g} during "
                                    f"{during} on rank {self.rank}{f': {told}' if told else ''} (stuck there, or it "
                                    f"takes that long: raise strategy.timeout_s then); see "
                                    f"ranks/{stuck[0] if len(stuck) == 1 else '<rank>'}.log in the run dir ({first})")
        return None

    def close(self) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False
