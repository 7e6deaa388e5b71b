"""Turns the per-frame tensors a collector filled into the TensorDict batch the learner sees."""

from __future__ import annotations

import torch
from tensordict import TensorDict


def as_batch(frames: dict[str, torch.Tensor]) -> TensorDict:
    """A ``[T, N]`` TensorDict with the keys the README's "How it fits together" lists;
    ``done = terminated | truncated``."""
    data = {k: v for k, v in frames.items() if k != "next_observation"}
    data["done"] = frames["terminated"] | frames["truncated"]
    data["next"] = {"observation": frames["next_observation"]}
    return TensorDict(data, batch_size=frames["reward"].shape)
