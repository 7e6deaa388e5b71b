"""GRPO's arithmetic, apart from any model: group-relative advantages and the clipped token-level
surrogate, aggregated as DAPO, the original GRPO or Dr. GRPO do, with an optional KL penalty to a
frozen reference (the k3 estimator) and truncated importance sampling from the sampler to the learner.

Aggregation divides by figures of the whole batch (``Normalizer``), so that a batch cut into
micro-batches, each loss added to the gradient in turn (gradient accumulation), gives the gradient
of the whole batch's loss, whatever the cut; padded positions (``mask`` 0) never count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AGGREGATIONS = ("token_mean", "sequence_mean", "constant")


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True,
                     eps: float = 1e-4) -> tuple[torch.Tensor, int]:
    """Each completion's reward minus its group's mean (``group_size`` consecutive completions of one
    prompt), divided by the group's standard deviation when ``scale`` (GRPO; Dr. GRPO does not);
    and the number of groups whose rewards have no spread (their advantages are 0: they teach nothing)."""
    groups = rewards.view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    spread = groups.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(centred[:, :1])
    flat = (spread == 0).squeeze(1)
    if scale:
        centred = centred / (spread + eps)
    return centred.masked_fill(flat.unsqueeze(1), 0.0).reshape(-1), int(flat.sum())


@dataclass(frozen=True)
class Normalizer:
    """What a loss of one batch is divided by, counted over the whole batch (not the micro-batch):
    its completion tokens, its completions, and ``max_tokens`` (Dr. GRPO's constant, the longest a
    completion may be)."""

    tokens: int
    sequences: int
    max_tokens: int

    @classmethod
    def of(cls, mask: torch.Tensor, max_tokens: int) -> Normalizer:
        return cls(tokens=max(1, int(mask.sum())), sequences=mask.shape[0], max_tokens=max_tokens)


def token_losses(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, clip_low: float,
                 clip_high: float, ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0,
                 is_weight: torch.Tensor | None = None) -> torch.Tensor:
    """The per-token loss ``[B, T]``: minus the clipped surrogate of the ratio between the learner's and
    the old probability of each token (clipped to ``[1 - clip_low, 1 + clip_high]``), times ``is_weight``
    when given (``tis_weights``: the tokens were drawn by another policy than the old one), plus
    ``kl_coef`` times the k3 estimate of KL(learner || reference), unweighted as in TRL and verl."""
    ratio = torch.exp(logp - old_logp)
    adv = advantages.unsqueeze(1)
    loss = -torch.minimum(ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv)
    if is_weight is not None:
        loss = loss * is_weight
    if ref_logp is not None and kl_coef:
        loss = loss + kl_coef * kl_k3(logp, ref_logp)
    return loss


def tis_weights(old_logp: torch.Tensor, sampling_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling (Yao et al. 2025): each token's ``min(p_old / p_sampler, cap)``, a
    constant of the gradient. The sampler (another engine's numerics, or weights a version behind) drew
    the tokens, not the old policy the surrogate is against; the cap bounds the variance that costs."""
    return torch.exp(old_logp - sampling_logp).clamp(max=cap).detach()


def tis_diagnostics(old_logp: torch.Tensor, sampling_logp: torch.Tensor, mask: torch.Tensor,
                    cap: float) -> dict[str, float]:
    """How far the sampler is from the learner, over the tokens ``mask`` keeps (all 0 when it keeps
    none): the untruncated ratio's mean and max, the share of tokens whose ratio exceeds ``cap``, and
    the normalised effective sample size of the truncated weights, ``(sum w)^2 / (n sum w^2)``: 1 when
    every token weighs the same, near 1/n when one outweighs the rest."""
    return tis_from_sums(*tis_sums(old_logp, sampling_logp, mask, cap))


def tis_sums(old_logp: torch.Tensor, sampling_logp: torch.Tensor, mask: torch.Tensor,
             cap: float) -> tuple[torch.Tensor, float]:
    """What ``tis_diagnostics`` is made of, in sums that add up over parts of a batch (a data-parallel
    learner's ranks): the ratios' sum, the tokens, the weights' sum and sum of squares, the tokens over
    ``cap`` (float64); and the largest ratio."""
    kept = mask.bool()
    ratio = torch.where(kept, torch.exp(old_logp.double() - sampling_logp.double()), 0.0)
    weight = ratio.clamp(max=cap)
    sums = torch.stack([ratio.sum(), kept.sum().double(), weight.sum(), (weight ** 2).sum(),
                        (ratio > cap).sum().double()])
    return sums, ratio.max().item()


def tis_from_sums(sums: torch.Tensor, ratio_max: float) -> dict[str, float]:
    ratio, n, weight, weight_sq, over = sums.tolist()
    n = max(1.0, n)
    ess = weight ** 2 / max(n * weight_sq, torch.finfo(torch.float64).tiny)
    return {"ratio_mean": ratio / n, "ratio_max": ratio_max, "ess": ess, "truncated": over / n}


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per token, ``exp(ref - logp) - (ref - logp) - 1``: an unbiased, never negative estimate of
    KL(learner || reference) from the learner's own samples (Schulman's k3)."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1


def aggregate(losses: torch.Tensor, mask: torch.Tensor, how: str, norm: Normalizer) -> torch.Tensor:
    """The scalar loss of ``losses`` ``[B, T]`` over the tokens ``mask`` keeps:

    - ``token_mean`` (DAPO): every token of the batch weighs the same: sum / the batch's tokens;
    - ``sequence_mean`` (the original GRPO): each completion's token mean, averaged over the batch's
      completions (a long completion's tokens weigh less);
    - ``constant`` (Dr. GRPO): sum / (the batch's completions x ``max_tokens``): no length bias.
    """
    kept = losses * mask
    if how == "token_mean":
        return kept.sum() / norm.tokens
    if how == "sequence_mean":
        return (kept.sum(dim=1) / mask.sum(dim=1).clamp_min(1)).sum() / norm.sequences
    if how == "constant":
        return kept.sum() / (norm.sequences * norm.max_tokens)
    raise ValueError(f"aggregation must be one of {', '.join(AGGREGATIONS)} (got {how!r})")
