"""Running observation normalization whose statistics are module buffers.

Being buffers, the statistics travel with every weight snapshot the learner pushes, so
collectors normalize exactly as the learner does.
"""

from __future__ import annotations

import torch
from torch import nn


class ObsNormalizer(nn.Module):
    """(obs - mean) / std with running statistics (parallel Welford update), clipped to +-clip."""

    def __init__(self, shape: tuple[int, ...], enabled: bool = True, clip: float = 10.0, eps: float = 1e-8):
        super().__init__()
        self.enabled = enabled
        self.clip = clip
        self.eps = eps
        self.register_buffer("mean", torch.zeros(shape))
        self.register_buffer("var", torch.ones(shape))
        self.register_buffer("count", torch.tensor(0.0))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return obs
        return ((obs - self.mean) / torch.sqrt(self.var + self.eps)).clamp(-self.clip, self.clip)

    @torch.no_grad()
    def update(self, obs: torch.Tensor) -> None:
        """Fold a batch of observations (any leading shape) into the running statistics."""
        if not self.enabled:
            return
        obs = obs.reshape(-1, *self.mean.shape).to(self.mean.dtype)
        n = obs.shape[0]
        batch_mean = obs.mean(0)
        batch_var = obs.var(0, unbiased=False)
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * n / total
        m2 = self.var * self.count + batch_var * n + delta.square() * self.count * n / total
        self.var.copy_(m2 / total)
        self.count.copy_(total)
