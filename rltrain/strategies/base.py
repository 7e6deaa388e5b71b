"""The learner's strategy: the interface an algorithm's update and the trainer use to run the same
code on one process or on many, and ``Single``, the one-process learner (``strategy=single``).

Everything an algorithm needs across learner ranks goes through here: the module whose backward
pass averages gradients (``wrap``), statistics over the global batch (``moments``, ``mean``) and
plain values exchanged between ranks (``gather``, ``broadcast``). With one process each is the
plain local computation, so ``strategy=single`` computes exactly what rltrain computed before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class Strategy:
    """One learner process. A data-parallel subclass runs one learner per rank of a torchrun job,
    each on its share of the global batch (``SPLITS``: the shares of a collector's keys).

    Capabilities: ``PARALLEL``, whether the learner spans several processes (the config check then
    asks for torchrun and for a collector and algorithm that can be split, ``DATA_PARALLEL``);
    ``SHARDED``, whether each rank holds only a shard of the weights (every forward pass, state dict and
    weight push is then a collective of all ranks: the algorithm must say it ``SHARDS``, and the hooks that
    run the learner's model run on every rank)."""

    PARALLEL = False
    SHARDED = False
    rank, size = 0, 1

    @property
    def is_main(self) -> bool:
        """The rank that owns the run dir, the loggers and the checkpoint files (rank 0)."""
        return self.rank == 0

    def device(self, requested: torch.device) -> torch.device:
        """This rank's learner device, given the configured one (``device``)."""
        return requested

    def wrap(self, module: nn.Module, method: str = "forward") -> Callable:
        """``module.method`` as the update calls it; data-parallel: through a wrapper whose backward pass
        averages the gradients of ``module``'s parameters over the ranks."""
        return module if method == "forward" else getattr(module, method)  # (forward: through its hooks)

    def frozen(self, module: nn.Module) -> nn.Module:
        """A module the update only runs forward (a frozen reference), held as the learner's weights are."""
        return module

    def weights(self, module: nn.Module) -> dict:
        """``module``'s state dict, whole (what a checkpoint holds); sharded: on rank 0, empty on the others
        (every rank takes part)."""
        return module.state_dict()

    def shard_weights(self, module: nn.Module, weights: dict) -> dict:
        """``weights`` (a ``weights`` result, written by any number of ranks) as ``module.load_state_dict`` on
        this rank takes it (sharded: this rank's shards)."""
        return weights

    def shard_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> dict:
        """``state`` (one process's ``optimizer.state_dict()``) as ``optimizer.load_state_dict`` here takes it."""
        return state

    def whole(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as one tensor (sharded: a sharded or replicated result, such as a gradient norm, gathered)."""
        return x

    def accumulating(self, wrapped: Callable) -> contextlib.AbstractContextManager:
        """Around backward passes whose gradients only accumulate (every micro-batch of a step but the
        last): data-parallel, they skip averaging, which the last one then does for them all."""
        return contextlib.nullcontext()

    def moments(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Mean, (biased) variance and count of ``x`` over its first dimension, on every rank's ``x`` together."""
        return x.mean(0), x.var(0, unbiased=False), x.shape[0]

    def normalize(self, x: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
        """``x`` standardized by the mean and (unbiased) std of every rank's ``x`` together."""
        return (x - x.mean()) / (x.std() + eps)

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        """The mean over ranks of a statistic each rank measured on an equal share."""
        return x

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (plain picklable values, no tensors), in rank order, on every rank."""
        return [obj]

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (a tensor of the same shape on every rank) summed over the ranks."""
        return x

    def max(self, values: list) -> list:
        """Each of ``values`` (numbers, the same count on every rank): its largest over the ranks (integers
        stay integers)."""
        return values

    def gather_to_main(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` (picklable, tensors too), in rank order, on rank 0 (None on the others)."""
        return [obj]

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` (picklable, tensors too), on every rank."""
        return obj

    def note(self, doing: str) -> None:
        """Tell the other ranks what this rank is doing now (``failure`` names a rank that stopped answering by
        what it last said it was doing)."""

    def failure(self, error: BaseException, during: str) -> Exception | None:
        """``error`` told as the failure of another rank (which one, during what), if that is what it is."""
        return None

    def close(self) -> None:
        """Release what the strategy made (its process group)."""


class Single(Strategy):
    """``strategy=single``: the learner is this one process (the default)."""
