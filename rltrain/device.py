"""The learner's device: what ``device=auto`` means, and how a collector's batch gets there.

Collectors always act on the CPU; only the learner (networks, optimizers, GAE, the replay buffer)
lives on ``device``. A batch crosses once per batch, only the keys the algo reads, through
page-locked memory and without blocking the host, so the copy overlaps whatever the GPU is doing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

if TYPE_CHECKING:
    from tensordict import TensorDict

DEVICES = ("cpu", "cuda", "auto")  # or cuda:N


def resolve_device(device: str | torch.device) -> torch.device:
    """``auto``: the first CUDA device if torch sees one, else the CPU."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def placed_like(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``whole`` on ``like``'s device, as its dtype; where ``like`` is a sharded learner's weight (a DTensor),
    this rank's shard of ``whole``, cut without communication (every rank holds ``whole``)."""
    whole = whole.to(like.device, like.dtype)
    if not isinstance(like, DTensor):
        return whole
    return distribute_tensor(whole, like.device_mesh, like.placements, src_data_rank=None)


def to_learner(batch: TensorDict, keys: Iterable, device: torch.device) -> TensorDict:
    """``batch``'s ``keys`` on ``device``. To a GPU they go from page-locked copies (torch's caching
    host allocator keeps each until its copy is done) with ``non_blocking``: the host does not wait."""
    batch = batch.select(*keys)
    if device.type == "cpu":
        return batch
    return batch.pin_memory().to(device, non_blocking=True)
