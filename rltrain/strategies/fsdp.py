"""``strategy=fsdp``: one learner on every rank of a torchrun job, its weights, gradients and optimizer
state sharded over the ranks by torch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

A language model is sharded one decoder layer at a time (the classes its ``_no_split_modules`` names),
then the root (the embeddings and the head): a forward pass gathers one layer's weights at a time and
frees them after it, and the backward pass reduce-scatters each layer's gradients, so that a rank holds
its shard of everything and one layer whole at a time. The data-parallel rest is ``strategy=ddp``'s: each
rank collects its share of the batch, and the global statistics go through the same collectives.

What reads whole weights gathers them, on every rank at once, in the same order: the model's state dict
for ``save_model`` (``weights``: whole on rank 0, empty on the others), a weight push (each tensor gathered as
the push copies it), the gradient norm (``whole``). A checkpoint gathers nothing: every rank writes its own
shards (``rltrain.sharded_checkpoint``).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from rltrain.device import placed_like
from rltrain.errors import ConfigError
from rltrain.rules import Flag, PositiveNumber
from rltrain.strategies.ddp import DDP

_WHOLE_ON_RANK_0 = StateDictOptions(full_state_dict=True, cpu_offload=True)
_FROM_RANK_0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def shard_units(module: nn.Module) -> list[nn.Module]:
    """The submodules sharded one by one before the root: a transformers model's decoder layers (the classes
    its ``_no_split_modules`` names, which must stay whole), in order; none for any other module."""
    base = module.get_base_model() if hasattr(module, "get_base_model") else module  # under LoRA's peft model
    names = set(getattr(base, "_no_split_modules", None) or ())
    return [m for m in module.modules() if m is not module and type(m).__name__ in names]


class FSDP(DDP):
    """Sharded data-parallel learners, one per rank of the torchrun job (``algo=grpo``: see the config check)."""

    SHARDED = True

    @classmethod
    def check_config(cls, values: dict, config: dict) -> None:
        """As ``strategy=ddp``, and ``cpu_offload`` only for a learner on a GPU."""
        super().check_config(values, config)
        if values.get("cpu_offload") and not (config.get("device") in ("cuda", "auto") and torch.cuda.is_available()):
            raise ConfigError("strategy.cpu_offload=true keeps a GPU learner's shards and Adam's state in host memory, "
                              "and this learner runs on the CPU already (device=cpu, or no GPU here); leave "
                              "strategy.cpu_offload=false")

    def __init__(self, timeout_s: PositiveNumber = 600.0,  # bound of every wait on the other ranks (a collective)
                 cpu_offload: Flag = False,  # a GPU learner's shards, gradients and Adam's state in host memory
                 reshard_after_forward: Flag = True):  # free each layer's gathered weights after its forward pass
        super().__init__(timeout_s)
        self.cpu_offload, self.reshard_after_forward = cpu_offload, reshard_after_forward
        self._device = torch.device("cpu")  # where a module built on the meta device gets its shards

    def device(self, requested: torch.device) -> torch.device:
        self._device = device = super().device(requested)
        if device.type == "cpu":
            _return_freed_blocks()
        return device

    def wrap(self, module: nn.Module, method: str = "forward") -> Callable:
        """Shard ``module`` in place (its parameters become this rank's shards, as DTensors: an optimizer is made
        after this) and return it: its own forward pass gathers and frees the weights, layer by layer."""
        if method != "forward":
            raise ValueError(f"strategy=fsdp shards a module called through its forward pass, not {method}")
        self._shard(module)
        return module

    def frozen(self, module: nn.Module) -> nn.Module:
        self._shard(module)
        return module

    def _shard(self, module: nn.Module) -> None:
        """Shard ``module``, then load rank 0's weights into every rank's shards: the other ranks may hold its
        shapes alone (built on the meta device, no weights read: ``LanguageModel.load(meta=True)``)."""
        if id(module) in self._wrapped:
            raise ValueError(f"{type(module).__name__} is sharded already: shard each module once")
        self._wrapped.add(id(module))
        whole = module.state_dict() if self.is_main else {}
        options = {"reshard_after_forward": self.reshard_after_forward}
        if self.cpu_offload:
            options["offload_policy"] = CPUOffloadPolicy()
        for unit in shard_units(module):
            fully_shard(unit, **options)
        fully_shard(module, **options)
        if any(t.is_meta for t in (*module.parameters(), *module.buffers())):
            module.to_empty(device=self._device)
        set_model_state_dict(module, whole, options=_FROM_RANK_0)
        for buffer in module.buffers():  # (those no state dict holds: a rotary embedding's frequencies)
            dist.broadcast(buffer, src=0)
        if hasattr(module, "get_base_model"):  # peft's generate calls the wrapped model's, around the root's forward:
            register_fsdp_forward_method(module, "generate")  # the root's weights (embeddings) gathered around it

    def accumulating(self, wrapped: Callable):
        # Every backward pass reduce-scatters its gradients, which accumulate as shards: no rank ever holds a
        # whole gradient (skipping the reduction would keep each layer's whole gradient until the last pass).
        return contextlib.nullcontext()

    def weights(self, module: nn.Module) -> dict:
        return get_model_state_dict(module, options=_WHOLE_ON_RANK_0)

    def shard_weights(self, module: nn.Module, weights: dict) -> dict:
        own = module.state_dict()
        return {name: placed_like(tensor, own[name]) if name in own else tensor for name, tensor in weights.items()}

    def shard_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> dict:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        own = {i: {k: placed_like(v, params[i]) if isinstance(v, torch.Tensor) and v.dim() else v for k, v in s.items()}
               for i, s in state["state"].items()}
        return {**state, "state": own}

    def whole(self, x: torch.Tensor) -> torch.Tensor:
        return x.full_tensor() if isinstance(x, DTensor) else x


def _return_freed_blocks() -> None:
    """A CPU learner's allocations of 64 KiB and more from their own mappings, given back to the system when
    freed. Each forward and backward pass gathers a layer's weights whole and frees them after it; glibc's malloc
    would keep that memory in its heap (its threshold for mapping grows with the blocks it has seen freed), and a
    rank's resident memory would grow to what one process holds (measured in benchmarks/learner_ranks.py).
    Where the C library is not glibc, nothing changes."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 64 << 10)
    except (OSError, AttributeError):
        return
