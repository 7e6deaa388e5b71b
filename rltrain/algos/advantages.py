"""Generalized Advantage Estimation (Schulman et al. 2016) over [time, env] batches."""

from __future__ import annotations

import torch


def gae(
    reward: torch.Tensor,
    value: torch.Tensor,
    next_value: torch.Tensor,
    terminated: torch.Tensor,
    done: torch.Tensor,
    gamma: float,
    gae_lambda: float,
) -> torch.Tensor:
    """Advantages for a ``[T, N]`` batch.

    ``next_value[t]`` is V of the observation reached at step t: the true final observation when
    the episode was truncated there, which is why truncation still bootstraps. Only ``terminated``
    zeroes the bootstrap; ``done`` (terminated or truncated) cuts the GAE recursion between episodes.
    """
    not_terminated = (~terminated).to(value.dtype)
    not_done = (~done).to(value.dtype)
    delta = reward + gamma * next_value * not_terminated - value
    advantages = torch.empty_like(value)
    running = torch.zeros_like(value[0])
    for t in range(value.shape[0] - 1, -1, -1):
        running = delta[t] + gamma * gae_lambda * not_done[t] * running
        advantages[t] = running
    return advantages
