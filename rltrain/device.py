"""The learner's device: what ``device=auto`` means, and how a collector's batch gets there.

Collectors always act on the CPU; only the learner (networks, optimizers, GAE, the replay buffer)
lives on ``device``. A batch crosses once per batch, only the keys the algo reads, through
page-locked memory and without blocking the host, so the copy overlaps whatever the GPU is doing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tensordict import TensorDict

DEVICES = ("cpu", "cuda", "auto")  # or cuda:N


def resolve_device(device: str | torch.device) -> torch.device:
    """``auto``: the first CUDA device if torch sees one, else the CPU."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def to_learner(batch: TensorDict, keys: Iterable, device: torch.device) -> TensorDict:
    """``batch``'s ``keys`` on ``device``. To a GPU they go from page-locked copies (torch's caching
    host allocator keeps each until its copy is done) with ``non_blocking``: the host does not wait."""
    batch = batch.select(*keys)
    if device.type == "cpu":
        return batch
    return batch.pin_memory().to(device, non_blocking=True)
