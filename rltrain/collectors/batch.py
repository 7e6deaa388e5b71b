"""Turns the per-frame tensors a collector filled into the TensorDict batch the learner sees, and
how many steps of its envs one batch is."""

from __future__ import annotations

from typing import Annotated

import torch
from tensordict import TensorDict

from rltrain.envs.spaces import nest
from rltrain.errors import ConfigError
from rltrain.rules import Integer

# A collector's max_lag: the trainer drops a batch with frames more than this many versions old (null: keeps all).
MaxLag = Annotated[int | None, Integer(0, null="")]


def batch_steps(frames_per_batch: int, envs: int, what: str, how_many: str | None = None) -> int:
    """The env steps of one batch of ``frames_per_batch`` frames over ``envs`` envs, which must divide
    it (``what`` says where ``envs`` comes from: ``env.num_envs``; ``how_many``, its value in those
    terms, ``2 x 8``: by default ``envs``). The config check (a collector's ``BATCH_ENVS``) and every
    collector's constructor ask this one rule."""
    if frames_per_batch % envs:
        raise ConfigError(f"collector.frames_per_batch ({frames_per_batch}) must be a multiple of {what} "
                          f"({how_many or envs}); "
                          f"e.g. collector.frames_per_batch={max(1, frames_per_batch // envs) * envs}")
    return frames_per_batch // envs


def as_batch(frames: dict[str, torch.Tensor]) -> TensorDict:
    """A ``[T, N]`` TensorDict with the keys docs/architecture.md lists (Batches);
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
