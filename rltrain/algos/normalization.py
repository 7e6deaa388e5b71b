"""Running observation normalization whose statistics are module buffers.

Being buffers, the statistics travel with every weight snapshot the learner pushes, so
collectors normalize exactly as the learner does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

Moment = float | torch.Tensor  # a statistic: a Python float or a tensor of them
# (mean, biased variance, count) of a tensor over its first dimension: ``local_moments``, or a
# data-parallel learner's over every rank's tensor together (``rltrain.strategies``).
Moments = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, int]]


def local_moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    return x.mean(0), x.var(0, unbiased=False), x.shape[0]


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
    def update(self, obs: torch.Tensor, moments: Moments = local_moments) -> None:
        """Fold a batch of observations (any leading shape) into the running statistics; ``moments``
        measures the batch (a data-parallel learner's: every rank's batch together)."""
        if not self.enabled:
            return
        obs = obs.reshape(-1, *self.mean.shape).to(self.mean.dtype)
        mean, var, count = merge_moments(self.mean, self.var, self.count, *moments(obs))
        self.mean.copy_(mean)
        self.var.copy_(var)
        self.count.copy_(count)


def merge_moments(mean: Moment, var: Moment, count: Moment, batch_mean: Moment, batch_var: Moment,
                  n: int) -> tuple[Moment, Moment, Moment]:
    """(mean, var, count) of everything seen, given those of the past and of a new batch of ``n``
    (the parallel Welford update); works on floats and tensors alike."""
    total = count + n
    delta = batch_mean - mean
    m2 = var * count + batch_var * n + delta * delta * count * n / total
    return mean + delta * n / total, m2 / total, total


class ReturnNormalizer:
    """Rewards divided by the running std of the discounted return, then clipped to +-clip: the
    return-based scaling of gymnasium's ``NormalizeReward`` (and SB3's ``VecNormalize``).

    It runs on the learner, over ``[T, N]`` batches: one set of statistics for every env, whether
    the envs run in-process, in worker processes or on other ranks, and it goes into checkpoints
    (``state_dict``). Each env column's discounted return carries over from one batch to the next
    and restarts when its episode ends (gymnasium's restarts on termination only). With async
    collectors, batches of different workers share their columns' carry: the statistics stay
    one set for all envs, and a carry decays within ~1/(1 - gamma) steps of a batch's start.
    """

    def __init__(self, gamma: float, clip: float | None = 10.0, eps: float = 1e-8, moments: Moments = local_moments):
        self.gamma, self.clip, self.eps, self.moments = gamma, clip, eps, moments
        # As gymnasium's RunningMeanStd starts: a prior of variance 1 with a tiny weight.
        self.mean, self.var, self.count = 0.0, 1.0, 1e-4
        self._carry: torch.Tensor | None = None  # each env column's discounted return so far

    @property
    def scale(self) -> float:
        """What rewards are divided by (the std of the discounted return)."""
        return (self.var + self.eps) ** 0.5

    @torch.no_grad()
    def __call__(self, reward: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
        """Fold the batch's discounted returns into the statistics; return its rewards scaled."""
        if self._carry is None or self._carry.shape != reward.shape[1:]:
            self._carry = torch.zeros(reward.shape[1:], dtype=torch.float64)
        running = self._carry.to(reward.device)
        not_done = (~done).to(running.dtype)
        returns = torch.empty(reward.shape, dtype=running.dtype, device=reward.device)
        for t in range(reward.shape[0]):
            running = running * self.gamma + reward[t]
            returns[t] = running
            running = running * not_done[t]
        self._carry = running.cpu()
        self._fold(returns.flatten())
        scaled = reward / self.scale
        return scaled if self.clip is None else scaled.clamp(-self.clip, self.clip)

    def _fold(self, returns: torch.Tensor) -> None:
        mean, var, n = self.moments(returns)
        self.mean, self.var, self.count = merge_moments(self.mean, self.var, self.count, mean.item(), var.item(), n)

    def state_dict(self) -> dict:
        return {"mean": self.mean, "var": self.var, "count": self.count, "carry": self._carry}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.var, self.count, self._carry = state["mean"], state["var"], state["count"], state["carry"]
