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

    The recursion ``A[t] = delta[t] + gamma * lambda * (1 - done[t]) * A[t + 1]`` is solved by a
    doubling scan over time (Hillis-Steele): ceil(log2 T) rounds of whole-batch ops instead of T
    steps of tiny ones, so a 512-step rollout costs 9 rounds, on any device. Only products of the
    coefficients (each <= 1) are formed: nothing is divided, nothing overflows.
    """
    steps = value.shape[0]
    # After the round with offset s: A[t] = acc[t] + coef[t] * A[t + 2s], A beyond the batch = 0.
    acc = torch.addcmul(reward - value, next_value, (~terminated).to(value.dtype), value=gamma)
    coef = (~done).to(value.dtype).mul_(gamma * gae_lambda)
    acc_next, coef_next = torch.empty_like(acc), torch.empty_like(coef)
    s = 1
    while s < steps:
        torch.addcmul(acc[:-s], coef[:-s], acc[s:], out=acc_next[:-s])
        acc_next[-s:] = acc[-s:]  # their A[t + s] lies beyond the batch
        if 2 * s < steps:  # the last round's coefficients would not be read
            torch.mul(coef[:-s], coef[s:], out=coef_next[:-s])
            coef, coef_next = coef_next, coef
        acc, acc_next = acc_next, acc
        s *= 2
    return acc
