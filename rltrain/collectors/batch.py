"""Turns the per-frame tensors a collector filled into the TensorDict batch the learner sees."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rltrain.envs.spaces import nest


def as_batch(frames: dict[str, torch.Tensor]) -> TensorDict:
    """A ``[T, N]`` TensorDict with the keys the README's "How it fits together" lists;
    ``done = terminated | truncated``. A Dict observation's keys nest below ``observation``."""
    data = {k: v for k, v in frames.items() if not _is_obs(k)}
    data["observation"] = nest(frames, "observation")
    data["done"] = frames["terminated"] | frames["truncated"]
    data["next"] = {"observation": nest(frames, "next_observation")}
    return TensorDict(data, batch_size=frames["reward"].shape)


def batch_key(frame_key: str) -> str | tuple[str, ...]:
    """Where the frame array ``frame_key`` (see ``frame_layout``) sits in ``as_batch``'s TensorDict."""
    head, _, key = frame_key.partition(".")
    path = {"observation": ("observation",), "next_observation": ("next", "observation")}.get(head)
    if path is None:
        return frame_key
    return (*path, key) if key else (path if len(path) > 1 else path[0])


def _is_obs(frame_key: str) -> bool:
    return frame_key.partition(".")[0] in ("observation", "next_observation")
