"""PPO's action distributions over the actor's output, one per action-space kind.

Sampling, log-probabilities and entropies are written out by hand rather than through
torch.distributions: a collector calls them once per env step, where the distribution objects'
construction and argument checks would cost more than the network itself.

- ``discrete``: a categorical over ``n`` logits (Gumbel-max sampling).
- ``multi_discrete``: independent categoricals, one per entry of ``nvec`` (logits concatenated).
- ``multi_binary``: independent Bernoullis, one logit each.
- ``box``: a diagonal Gaussian with a state-independent log-std; the env clips the sample to its box.

An env whose observation says which actions are valid (``action_mask``) has its invalid actions' logits set to
the lowest float before any of this (``mask_logits``): the discrete heads then never sample or take them, and
score them at probability 0 in every log-prob and entropy.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from rltrain.envs import ActionSpec

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def mask_logits(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``logits`` with each action that ``mask`` (0/1, one per logit) rules out set to the dtype's lowest value.
    Not -inf: a probability of 0 either way, but 0 * -inf in an entropy is NaN, in the forward or the gradient."""
    return logits.masked_fill(mask == 0, torch.finfo(logits.dtype).min)


def make_head(action: ActionSpec, init_log_std: float = 0.0) -> nn.Module:
    """The distribution for ``action``'s kind; ``init_log_std`` is the Gaussian's (Box actions)."""
    if action.kind == "box":
        return GaussianHead(action, init_log_std)
    return {"discrete": CategoricalHead, "multi_discrete": MultiCategoricalHead,
            "multi_binary": BernoulliHead}[action.kind](action)


class CategoricalHead(nn.Module):
    def __init__(self, action: ActionSpec):
        super().__init__()
        self.out_dim = action.nvec[0]

    def sample(self, logits: torch.Tensor, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
        logp_all = torch.log_softmax(logits, -1)
        if deterministic:
            action = logits.argmax(-1)
        else:  # Gumbel-max: argmax(logits + Gumbel noise) is a categorical sample.
            action = (logits - torch.empty_like(logits).exponential_().log()).argmax(-1)
        return action, logp_all.gather(-1, action.unsqueeze(-1)).squeeze(-1)

    def evaluate(self, logits: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logp_all = torch.log_softmax(logits, -1)
        log_prob = logp_all.gather(-1, action.long().unsqueeze(-1)).squeeze(-1)
        return log_prob, -(logp_all.exp() * logp_all).sum(-1)


class MultiCategoricalHead(nn.Module):
    """The concatenated logits are laid out as ``[k, max(nvec)]``, the slots beyond an entry's n
    masked to -inf, so all k categoricals are sampled and scored in one batched op each."""

    def __init__(self, action: ActionSpec):
        super().__init__()
        nvec = action.nvec
        self.out_dim, width = sum(nvec), max(nvec)
        starts = [sum(nvec[:i]) for i in range(len(nvec))]
        index = torch.tensor([[s + min(j, n - 1) for j in range(width)] for s, n in zip(starts, nvec)])
        valid = torch.tensor([[j < n for j in range(width)] for n in nvec])
        self.register_buffer("index", index, persistent=False)
        self.register_buffer("valid", valid, persistent=False)

    def _log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        laid_out = logits[..., self.index].masked_fill(~self.valid, -math.inf)
        return torch.log_softmax(laid_out, -1)  # [..., k, width]

    def sample(self, logits: torch.Tensor, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
        logp_all = self._log_probs(logits)
        if deterministic:
            action = logp_all.argmax(-1)
        else:
            action = (logp_all - torch.empty_like(logp_all).exponential_().log()).argmax(-1)
        return action, logp_all.gather(-1, action.unsqueeze(-1)).squeeze(-1).sum(-1)

    def evaluate(self, logits: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logp_all = self._log_probs(logits)
        log_prob = logp_all.gather(-1, action.long().unsqueeze(-1)).squeeze(-1).sum(-1)
        # p log p with the padding slots at 0 (masked before the product: 0 * -inf would be NaN, in the
        # forward and in the gradient).
        plogp = logp_all.exp() * logp_all.masked_fill(~self.valid, 0.0)
        return log_prob, -plogp.sum((-2, -1))


class BernoulliHead(nn.Module):
    """log p(a) = a * l - softplus(l) for logit l and a in {0, 1}."""

    def __init__(self, action: ActionSpec):
        super().__init__()
        self.out_dim = action.shape[0]

    def sample(self, logits: torch.Tensor, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if deterministic:
            action = (logits > 0).to(torch.int8)
        else:
            action = (torch.rand_like(logits) < torch.sigmoid(logits)).to(torch.int8)
        return action, (action * logits - nn.functional.softplus(logits)).sum(-1)

    def evaluate(self, logits: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        log_prob = (action.to(logits.dtype) * logits - nn.functional.softplus(logits)).sum(-1)
        entropy = (nn.functional.softplus(logits) - logits * torch.sigmoid(logits)).sum(-1)
        return log_prob, entropy


class GaussianHead(nn.Module):
    def __init__(self, action: ActionSpec, init_log_std: float = 0.0):
        super().__init__()
        self.out_dim = math.prod(action.shape)
        self.action_shape = action.shape
        self.log_std = nn.Parameter(torch.full((self.out_dim,), float(init_log_std)))

    def sample(self, mean: torch.Tensor, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
        action = mean if deterministic else mean + self.log_std.exp() * torch.randn_like(mean)
        return action.reshape(*mean.shape[:-1], *self.action_shape), self._log_prob(mean, action)

    def evaluate(self, mean: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        entropy = (self.log_std + 0.5 + LOG_SQRT_2PI).sum().expand(mean.shape[:-1])
        return self._log_prob(mean, action.reshape(mean.shape)), entropy

    def _log_prob(self, mean: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        z = (action - mean) * torch.exp(-self.log_std)
        return (-0.5 * z.square() - self.log_std - LOG_SQRT_2PI).sum(-1)
