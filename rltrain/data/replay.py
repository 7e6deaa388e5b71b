"""A preallocated, circular replay buffer of frames, stored as one TensorDict on the learner's device.

Memory is ``capacity x frame size`` and nothing more: storage is allocated once, on the first
``extend``, with the keys, shapes and dtypes of the frames it is given. Its state is the storage
plus two counters, which is what a checkpoint needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # only methods of the TensorDicts handed in are used (workers never import this)
    from tensordict import TensorDict


class ReplayBuffer:
    """Uniform sampling over the filled part of a ring of ``capacity`` frames."""

    def __init__(self, capacity: int, device: torch.device | str = "cpu"):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 (got {capacity})")
        self.capacity, self.device = capacity, torch.device(device)
        self.storage: TensorDict | None = None
        self.cursor = 0  # where the next frame goes
        self.size = 0  # frames held (<= capacity)

    def __len__(self) -> int:
        return self.size

    def extend(self, frames: TensorDict) -> None:
        """Add frames (any batch shape; flattened); the oldest are overwritten once full."""
        frames = frames.reshape(-1)
        n = frames.shape[0]
        if self.storage is None:
            self.storage = frames[0].to(self.device).expand(self.capacity).clone()
        if n >= self.capacity:  # only the newest `capacity` frames survive
            frames, n = frames[-self.capacity:], self.capacity
        idx = (torch.arange(n) + self.cursor) % self.capacity
        self.storage[idx.to(self.device)] = frames.to(self.device)
        self.cursor = (self.cursor + n) % self.capacity
        self.size = min(self.size + n, self.capacity)

    def sample(self, batch_size: int, generator: torch.Generator | None = None) -> TensorDict:
        """``batch_size`` frames drawn uniformly, with replacement, from the filled slots."""
        if self.size == 0:
            raise RuntimeError("sample() from an empty replay buffer")
        idx = torch.randint(self.size, (batch_size,), device=self.device, generator=generator)
        return self.storage[idx]
