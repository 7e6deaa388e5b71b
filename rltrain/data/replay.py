"""A preallocated, circular replay buffer of frames, stored as one TensorDict on the learner's device.

Memory is ``capacity x frame size`` and nothing more: storage is allocated once, on the first
``extend``, with the keys, shapes and dtypes of the frames it is given. Its state is the storage
plus two counters, which is what a checkpoint needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rltrain.errors import ConfigError

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
        frames, start, end = frames.to(self.device), self.cursor, self.cursor + n
        if end <= self.capacity:  # contiguous slots: copies, not a scatter
            self.storage[start:end] = frames
        else:  # wraps around the end of the ring
            self.storage[start:] = frames[: self.capacity - start]
            self.storage[: end - self.capacity] = frames[self.capacity - start:]
        self.cursor = end % self.capacity
        self.size = min(self.size + n, self.capacity)

    def state_dict(self) -> dict:
        """The filled frames and the cursor; a checkpoint's share of the buffer. A full buffer is
        handed over as is; a partly filled one as a copy of its filled part (torch.save writes a
        view's whole storage)."""
        if self.storage is None or self.size == 0:
            return {"frames": None, "size": 0, "cursor": 0}
        frames = self.storage if self.size == self.capacity else self.storage[: self.size].clone()
        return {"frames": frames.to_dict(), "size": self.size, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        """Refill from ``state_dict()``; with a different capacity the newest frames are kept."""
        from tensordict import TensorDict

        self.storage, self.cursor, self.size = None, 0, 0
        if state["frames"] is None:
            return
        size = state["size"]
        frames = TensorDict(state["frames"], batch_size=[size])
        if size == self.capacity:  # the same slots, so sampling continues exactly
            self.extend(frames)
            self.cursor = state["cursor"] % self.capacity
            return
        oldest_first = (torch.arange(size) + state["cursor"]) % size
        self.extend(frames[oldest_first])

    def sample(self, batch_size: int, generator: torch.Generator | None = None) -> TensorDict:
        """``batch_size`` frames drawn uniformly, with replacement, from the filled slots."""
        if self.size == 0:
            raise RuntimeError("sample() from an empty replay buffer")
        idx = torch.randint(self.size, (batch_size,), device=self.device, generator=generator)
        return self.storage[idx]


def check_capacity(values: dict, config: dict) -> None:
    """An algo's ``buffer_size`` (``values``, its keys) holds a gradient step's frames and a collector batch, or
    ConfigError (the config check of the algos that replay: SAC, DQN)."""
    buffer_size = values["buffer_size"]
    for key, need, what in [("algo.batch_size", values["batch_size"], "the frames of one gradient step"),
                            ("collector.frames_per_batch", config["collector"].get("frames_per_batch"),
                             "one collector batch")]:
        if need is not None and buffer_size < need:
            raise ConfigError(f"algo.buffer_size ({buffer_size}) is smaller than {key} ({need}): the replay "
                              f"buffer cannot hold {what}; use algo.buffer_size={need} or more")
