"""Policies whose actions reveal which weights they acted with, and one that ONNX cannot express."""

from __future__ import annotations

import torch
from torch import nn

from rltrain.algos import ActorCritic


class MarkerPolicy(nn.Module):
    """Always takes action 0 and reports ``w + b`` as its log-prob: a parameter ``w`` and a buffer ``b``.

    Set ``w = v, b = 10 v`` before pushing version v: every frame's log-prob must then be ``11 v``
    for its ``policy_version``; a mix of two versions shows up as any other number.
    """

    def __init__(self, env_spec=None, size: int = 1):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(size))
        self.register_buffer("b", torch.zeros(size))

    def act(self, obs: torch.Tensor, deterministic: bool = False):
        n = obs.shape[0]
        return torch.zeros(n, dtype=torch.int64), (self.w[0] + self.b[0]).expand(n).clone()

    def mark(self, version: float) -> None:
        with torch.no_grad():
            self.w.fill_(version)
            self.b.fill_(10 * version)


class UpdateOnlyAlgo:
    """An algo of a user's own that learns but keeps no state: it cannot be checkpointed."""

    def __init__(self, policy, total_frames, device="cpu"):
        self.policy = policy

    def update(self, batch, should_stop):
        return {}


class RunningMax(nn.Module):
    """A running maximum over the features: an operator ONNX (opset 17) has no counterpart for."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cummax(x, -1).values


class RunningMaxActorCritic(ActorCritic):
    """PPO's network with a ``RunningMax`` before the actor's layers: TorchScript can hold it, ONNX cannot."""

    def __init__(self, env_spec, **kwargs):
        super().__init__(env_spec, **kwargs)
        self.actor.insert(0, RunningMax())
