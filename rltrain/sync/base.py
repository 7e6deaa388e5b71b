"""The weight-sync interface every scheme implements, and the flat buffer of named tensors they share.

The learner's ``WeightSender`` publishes versioned snapshots of the policy (parameters and
buffers); each collector's ``WeightReceiver`` makes the newest one its policy's weights at a
boundary the collector chooses. Receivers are created on the learner and pickled into collector
worker processes, so they hold only tensors, locks and pipes (no tensordict, no Hydra) until
``connect`` binds them to the worker's policy.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from abc import ABC, abstractmethod
from contextlib import contextmanager
from typing import Annotated

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from rltrain.device import placed_like
from rltrain.errors import SyncError
from rltrain.rules import Integer

log = logging.getLogger("rltrain")

_ALIGN = 64  # bytes; every tensor in a flat snapshot starts on a cache line
_PARALLEL_COPY_BYTES = 4 << 20
_WAIT_S, _POLL_S = 60.0, 0.005  # WeightReceiver.wait_for's default bound, and how often it looks meanwhile

# sync.every of every scheme: batches between pushes (WeightPushHook reads it); null never pushes.
PushEvery = Annotated[int | None, Integer(1, null="never push")]


class WeightSender(ABC):
    """Learner side: ``push`` publishes the policy's current weights as version ``version + 1``."""

    version: int = 0

    @abstractmethod
    def push(self) -> int:
        """Snapshot the learner's policy and publish it; returns the new version."""

    def published(self) -> dict[str, torch.Tensor] | None:
        """A copy of the weights collectors currently act with (for checkpoints), or None if this
        scheme keeps no copy of them (then they are the learner's weights as of the last push)."""
        return None

    def start(self) -> None:
        """Called by build once the run dir holds ``contact()`` and before the collector starts:
        a sender whose receivers build their own policy copies (collector ranks) publishes the
        initial weights here."""

    def contact(self) -> dict | None:
        """How a process of the user's own can receive the pushes (build writes it to
        ``sync.json`` in the run dir; ``rltrain.sync.listen`` reads it), or None if it cannot."""
        return None

    def close(self) -> None:
        """Release what the sender holds."""


class WeightReceiver(ABC):
    """Collector side: gives a local policy the newest published snapshot."""

    version: int = 0
    waitable = None  # a handle a waiting worker also waits on, so that a push never waits for its poll

    @abstractmethod
    def connect(self, policy: nn.Module) -> None:
        """Bind to the collector's policy, check its layout against the snapshot's, apply the newest one."""

    @abstractmethod
    def poll(self) -> bool:
        """Apply the newest snapshot if it is newer than ``version``; return whether weights changed."""

    def wait_for(self, version: int, timeout_s: float | None = None) -> int:
        """Apply weights ``version`` or newer, waiting up to ``timeout_s`` (None: the scheme's own
        bound, ``sync.timeout_s``, else 60 s) for them to arrive; return the version applied. A
        lock-step collector rank calls it before each batch (so that a seeded run repeats exactly).
        Raises SyncError naming the version once the wait is over. This default polls; a scheme
        whose pushes arrive on a thread of its own wakes up on them instead."""
        timeout_s = _WAIT_S if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            self.poll()
            if self.version >= version:
                return self.version
            if time.monotonic() > deadline:
                raise SyncError(f"weights version {version} did not arrive within {timeout_s:g}s (now at version "
                                f"{self.version})")
            time.sleep(_POLL_S)

    def wait_ended(self, timeout_s: float) -> None:
        """Wait, up to ``timeout_s``, until the learner's last word (after its sender's ``close``)
        has arrived, so that closing the receiver cuts nothing off; a collector rank calls it when
        the learner says close. Nothing to wait for by default: only a scheme that receives on a
        thread of its own has something still on its way."""

    def after_spawn(self) -> None:
        """Called in the learner once a worker process holding this receiver has started."""

    def close(self) -> None:
        """Release what the receiver holds."""


class WeightSyncScheme(ABC):
    """A way of moving weights from one learner to its collectors.

    Capabilities (checked by build): ``PUSHES``, whether pushes move new weights at all;
    ``CROSS_PROCESS_ONLY``, whether its receivers must live in other processes than the learner;
    ``REACHES_OTHER_RANKS``, whether they may be other ranks of a torchrun job (other machines);
    ``DELIVERS``, how the weights reach what acts with them, which a generation engine must take
    (``rltrain.llm.engine.Engine.WEIGHTS``): ``module`` (a receiver binds to a torch module of its
    process: every collector's policy copy), ``snapshot`` (an engine loads the newest published snapshot
    itself, at its own boundary) or ``push`` (the learner drives each push into the engine, through the
    engine's ``transfer_client()``, which build connects the sender to); ``NOT_ON_LEARNER_RANKS``, why the
    ranks of a data-parallel learner (``strategy=ddp|fsdp``) may not each push through a scheme of their own,
    and what to use instead ("" where they may).
    """

    PUSHES = True
    NOT_ON_LEARNER_RANKS = ""
    CROSS_PROCESS_ONLY = False
    REACHES_OTHER_RANKS = False  # whether its receivers may be other ranks of a torchrun job, on other machines
    DELIVERS = "module"
    every: int | None = None  # batches between pushes (``sync.every``; WeightPushHook reads it), None: never

    def __init__(self, every: PushEvery = 1):
        """``every``: the scheme's ``sync.every`` (a subclass's ``every`` keeps this rule)."""
        self.every = every

    @abstractmethod
    def sender(self, policy: nn.Module, version: int = 0) -> WeightSender:
        """Create the learner's sender for ``policy``; call once, before any receiver. The
        policy's current weights are published as ``version`` (a resumed run's last version)."""

    @abstractmethod
    def receiver(self) -> WeightReceiver:
        """Create a receiver for one collector (or collector worker); picklable."""


def layout_of(policy: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {name: (tuple(t.shape), t.dtype) for name, t in named_weights(policy).items()}


def named_weights(policy: nn.Module) -> dict[str, torch.Tensor]:
    """The policy's parameters and buffers by dotted name (obs-normalizer statistics included)."""
    weights = {name: p.detach() for name, p in policy.named_parameters()}
    weights.update({name: b for name, b in policy.named_buffers()})
    return weights


def assign(tensor: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy ``whole`` into ``tensor``: a weight of the policy, or a sharded learner's (a DTensor: its shard of
    ``whole``, which every rank holds)."""
    tensor.copy_(placed_like(whole, tensor))


def _gather_into(out: torch.Tensor, shard: DTensor) -> None:
    """``shard`` (a sharded learner's weight) gathered whole into ``out``; every rank calls it, in the same order.
    Where the ranks hold equal runs of its rows (FSDP2's dim-0 shards of a dim the ranks divide) and ``out`` is
    on the shard's device, the ranks' rows land in ``out`` directly, in one collective; else DTensor's own gather."""
    (placement,) = shard.placements if len(shard.placements) == 1 else (None,)
    local = shard.to_local()
    if (placement is not None and placement.is_shard(0) and shard.shape[0] % shard.device_mesh.size() == 0
            and out.device == local.device):
        dist.all_gather_into_tensor(out, local.contiguous(), group=shard.device_mesh.get_group())
    else:
        out.copy_(shard.full_tensor())


def on_gpu(policy: nn.Module) -> bool:
    """Whether the policy's weights live on a GPU (a CUDA learner)."""
    return any(t.is_cuda for t in named_weights(policy).values())


class FlatBuffer:
    """One contiguous CPU buffer of named tensors, with a view per name: a snapshot of every weight
    tensor (each sync scheme's), or the frames of a batch (a collector rank's).

    One storage means one shared-memory segment (one file descriptor) per snapshot, whatever
    the number of tensors, and pickles as that single segment; it travels as one message.

    ``pinned``: the buffer is page-locked, for a GPU learner that copies into it at every push
    (pinned memory, or shared memory registered with CUDA). ``copy_from`` then gathers the GPU's
    weights into one block on the GPU, copies that block to the host at full bandwidth in one
    transfer, and waits for it once.
    """

    def __init__(self, layout: dict[str, tuple[tuple[int, ...], torch.dtype]], shared: bool, pinned: bool = False,
                 buffer: torch.Tensor | None = None):
        """``buffer``: bytes to lay the tensors out in (``nbytes(layout)`` of them, shared with other processes
        already), instead of a buffer of its own."""
        self.layout = layout
        self._offsets, total = _offsets(layout)
        if buffer is None:
            buffer = torch.zeros(total, dtype=torch.uint8)
            if shared:
                buffer.share_memory_()
            elif pinned:
                buffer = buffer.pin_memory()
        if shared and pinned:
            _register_with_cuda(buffer)
        self.buffer = buffer
        self.views = _views(self.buffer, layout, self._offsets)
        self._gather: dict[str, torch.Tensor] | None = None  # views of the GPU block (a GPU learner's)
        self._gather_buffer: torch.Tensor | None = None

    @staticmethod
    def nbytes(layout: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> int:
        """The size of the buffer that holds ``layout``."""
        return _offsets(layout)[1]

    def offset(self, name: str) -> int:
        """Where ``name``'s bytes start in ``buffer``."""
        return self._offsets[name]

    def file(self) -> tuple[int, int]:
        """The shared-memory file that holds the buffer, as a descriptor of this process, and its size (for
        another process of this machine to map it)."""
        return self.buffer.untyped_storage()._share_fd_cpu_()

    @classmethod
    def like(cls, policy: nn.Module, shared: bool, pinned: bool = False) -> FlatBuffer:
        return cls(layout_of(policy), shared, pinned)

    def buckets(self, nbytes: int) -> list[tuple[list[str], torch.Tensor]]:
        """The buffer cut into consecutive runs of whole weights of at least ``nbytes`` each (the
        last may be smaller): each run's names and the slice of the buffer that holds them."""
        out, names, start = [], [], 0
        for name, offset in self._offsets.items():
            if names and offset - start >= nbytes:
                out.append((names, self.buffer[start:offset]))
                names, start = [], offset
            names.append(name)
        out.append((names, self.buffer[start:]))
        return out

    def __getstate__(self):
        return {"layout": self.layout, "buffer": self.buffer, "_offsets": self._offsets}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.views = _views(self.buffer, self.layout, self._offsets)
        self._gather, self._gather_buffer = None, None

    def copy_from(self, weights: dict[str, torch.Tensor], names: list[str] | None = None) -> None:
        names = list(self.views) if names is None else names
        sources = [weights[n] for n in names]
        if any(isinstance(t, DTensor) for t in sources):  # a sharded learner's: every rank gathers, in this order,
            for name, t in zip(names, sources):          # one tensor at a time (its collectives done before a send)
                if isinstance(t, DTensor):
                    _gather_into(self.views[name], t)
                else:
                    self.views[name].copy_(t)
            return
        if sources and sources[0].is_cuda:
            self._copy_from_gpu(names, sources)
            return
        with _all_cores(self.buffer.numel()):
            torch._foreach_copy_([self.views[n] for n in names], sources)

    def _copy_from_gpu(self, names: list[str], sources: list[torch.Tensor]) -> None:
        """A GPU learner's weights to the host, with one synchronization: gathered on the GPU into one
        block (one fused copy), then that block in one transfer (pageable memory takes per-tensor ones)."""
        device = sources[0].device
        stream = torch.cuda.current_stream(device)
        if not self.buffer.is_pinned():
            torch._foreach_copy_([self.views[n] for n in names], sources, non_blocking=True)
            stream.synchronize()
            return
        if self._gather is None:
            self._gather_buffer = torch.empty_like(self.buffer, device=device)
            self._gather = _views(self._gather_buffer, self.layout, self._offsets)
        torch._foreach_copy_([self._gather[n] for n in names], sources)
        self.buffer.copy_(self._gather_buffer, non_blocking=True)
        stream.synchronize()

    def copy_into(self, weights: dict[str, torch.Tensor]) -> None:
        names = list(self.views)
        with torch.no_grad():
            torch._foreach_copy_([weights[n] for n in names], [self.views[n] for n in names])

    def check_matches(self, policy: nn.Module) -> None:
        """Raise SyncError naming every weight whose presence, shape or dtype differs."""
        actual = {name: (tuple(t.shape), t.dtype) for name, t in named_weights(policy).items()}
        problems = [f"missing in the collector's policy: {n}" for n in self.layout if n not in actual]
        problems += [f"not in the learner's snapshot: {n}" for n in actual if n not in self.layout]
        for name in self.layout.keys() & actual.keys():
            (es, ed), (as_, ad) = self.layout[name], actual[name]
            if es != as_ or ed != ad:
                problems.append(f"{name}: learner {es} {ed}, collector {as_} {ad}")
        if problems:
            raise SyncError("weight snapshot does not match the collector's policy: " + "; ".join(sorted(problems)))


def _offsets(layout: dict) -> tuple[dict[str, int], int]:
    """Where each weight of ``layout`` starts in a flat buffer (each on a cache line), and the buffer's size."""
    offsets, total = {}, 0
    for name, (shape, dtype) in layout.items():
        offsets[name] = total
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        total += -(-nbytes // _ALIGN) * _ALIGN
    return offsets, max(total, _ALIGN)


def _views(buffer: torch.Tensor, layout: dict, offsets: dict[str, int]) -> dict[str, torch.Tensor]:
    """A typed, shaped view of ``buffer`` per weight, at its offset."""
    views = {}
    for name, (shape, dtype) in layout.items():
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        views[name] = buffer[offsets[name]: offsets[name] + nbytes].view(dtype).view(shape)
    return views


def _register_with_cuda(buffer: torch.Tensor) -> None:
    """Page-lock a shared-memory buffer for CUDA (cudaHostRegister), so that device-to-host copies
    into it run at full bandwidth; unregistered when the buffer is freed. Where CUDA refuses, the
    copies still work, through pageable memory, at a fraction of the speed."""
    cudart = torch.cuda.cudart()
    try:
        torch.cuda.check_error(cudart.cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0))
    except (RuntimeError, torch.cuda.CudaError) as e:
        log.warning("could not page-lock the shared weight slots for CUDA (%s): pushes copy through pageable "
                    "memory, several times slower", e)
        return
    weakref.finalize(buffer, cudart.cudaHostUnregister, buffer.data_ptr())


@contextmanager
def _all_cores(nbytes: int):
    """Copies of large snapshots use every core (the trainer runs torch single-threaded): a push
    happens while the learner waits, and copy bandwidth scales with cores."""
    threads = torch.get_num_threads()
    if nbytes < _PARALLEL_COPY_BYTES or threads >= (os.cpu_count() or 1):
        yield
        return
    torch.set_num_threads(os.cpu_count())
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def bind_weights(policy: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Make ``tensors`` the policy's parameters and buffers without copying (an inference-only policy).
    A parameter shared by several modules (a language model's output layer tied to its embedding:
    ``named_weights`` names it once) is rebound in every module that holds it. A policy on another
    device than ``tensors`` (a language model's engine on the GPU, the snapshot in host memory)
    gets them copied into its own weights instead."""
    current = named_weights(policy)
    if any(current[name].device != tensor.device for name, tensor in tensors.items()):
        with torch.no_grad():
            torch._foreach_copy_([current[name] for name in tensors], list(tensors.values()))
        return
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in policy.modules():
        for attr, param in module._parameters.items():
            if param is not None:
                holders.setdefault(id(param), []).append((module, attr))
    for name, tensor in tensors.items():
        module_name, _, attr = name.rpartition(".")
        module = policy.get_submodule(module_name)
        if attr in module._parameters:
            param = nn.Parameter(tensor, requires_grad=False)
            for holder, held_as in holders.get(id(module._parameters[attr]), [(module, attr)]):
                holder._parameters[held_as] = param
        else:
            module._buffers[attr] = tensor
