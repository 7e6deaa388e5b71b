"""GRPO (Shao et al. 2024) on a causal LM: each prompt's group of sampled completions scored by
verifiable rewards; advantages relative to the group; ``epochs`` passes of the clipped token-level
surrogate against the sampling log-probs, in micro-batches whose gradients accumulate into one step
per pass; an optional KL penalty to a frozen reference (``kl_coef: 0`` keeps none in memory).
The arithmetic is in ``grpo_loss``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

import torch

from rltrain.algos.grpo_loss import AGGREGATIONS, Normalizer, aggregate, group_advantages, kl_k3, token_losses
from rltrain.llm.engine import Generated
from rltrain.rules import Flag, NonNegativeNumber, OneOf, PositiveFraction, PositiveInt, PositiveNumber


@dataclass
class GroupBatch:
    """What the learner trains on: the completions, their rewards ``[B]`` and the size of each group."""

    generated: Generated
    rewards: torch.Tensor
    group_size: int


def token_logprobs(model, g: Generated, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """Each completion token's log-prob under ``model`` (rows ``rows`` of ``g``), and the entropy of the
    distribution it was drawn from, from one forward pass over prompt + completion."""
    ids = torch.cat([g.prompt_ids[rows], g.completion_ids[rows]], dim=1)
    mask = torch.cat([g.prompt_mask[rows], g.completion_mask[rows]], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    logits = logits[:, g.prompt_ids.shape[1] - 1:-1].float()
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, g.completion_ids[rows].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


class GRPO:
    """The learner of a language-model policy: ``update(batch)`` trains ``policy`` (a transformers
    causal LM) on one ``GroupBatch`` and returns its metrics."""

    def __init__(self, policy, lr: PositiveNumber = 1e-5, epochs: PositiveInt = 1, micro_batch_size: PositiveInt = 8,
                 clip_low: PositiveFraction = 0.2, clip_high: PositiveNumber = 0.28,
                 loss_aggregation: Annotated[str, OneOf(AGGREGATIONS)] = "token_mean", scale_rewards: Flag = True,
                 kl_coef: NonNegativeNumber = 0.0, max_grad_norm: PositiveNumber = 1.0,
                 max_new_tokens: PositiveInt = 16):
        self.policy = policy
        self.epochs, self.micro_batch_size = epochs, micro_batch_size
        self.clip_low, self.clip_high, self.aggregation = clip_low, clip_high, loss_aggregation
        self.scale_rewards, self.kl_coef, self.max_grad_norm = scale_rewards, kl_coef, max_grad_norm
        self.max_new_tokens = max_new_tokens
        self.reference = copy.deepcopy(policy).eval().requires_grad_(False) if kl_coef else None
        self.optimizer = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=0.0)

    def update(self, batch: GroupBatch, should_stop: Callable[[], bool] = lambda: False) -> dict[str, float]:
        g = batch.generated
        advantages, flat = group_advantages(batch.rewards.float(), batch.group_size, scale=self.scale_rewards)
        norm = Normalizer.of(g.completion_mask, self.max_new_tokens)
        mask = g.completion_mask.float()
        ref = self._reference_logprobs(g) if self.reference is not None else None
        self.policy.train()
        sums = {"loss": 0.0, "clip_fraction": 0.0, "entropy": 0.0, "kl": 0.0, "grad_norm": 0.0}
        for _ in range(self.epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for start in range(0, mask.shape[0], self.micro_batch_size):
                rows = slice(start, start + self.micro_batch_size)
                logp, entropy = token_logprobs(self.policy, g, rows)
                losses = token_losses(logp, g.logprobs[rows], advantages[rows], self.clip_low, self.clip_high,
                                      None if ref is None else ref[rows], self.kl_coef)
                loss = aggregate(losses, mask[rows], self.aggregation, norm)
                loss.backward()
                with torch.no_grad():
                    ratio = torch.exp(logp - g.logprobs[rows])
                    clipped = ((ratio < 1 - self.clip_low) | (ratio > 1 + self.clip_high)).float()
                    sums["loss"] += loss.item()
                    sums["clip_fraction"] += (clipped * mask[rows]).sum().item() / norm.tokens
                    sums["entropy"] += (entropy * mask[rows]).sum().item() / norm.tokens
                    if ref is not None:
                        sums["kl"] += (kl_k3(logp, ref[rows]) * mask[rows]).sum().item() / norm.tokens
            sums["grad_norm"] += float(torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.max_grad_norm))
            self.optimizer.step()
        self.policy.eval()
        metrics = {f"grpo/{k}": v / self.epochs for k, v in sums.items() if k != "kl" or ref is not None}
        metrics.update({"reward/mean": batch.rewards.float().mean().item(),
                        "reward/std": batch.rewards.float().std().item() if len(batch.rewards) > 1 else 0.0,
                        "grpo/flat_groups": float(flat)})
        return metrics

    @torch.no_grad()
    def _reference_logprobs(self, g: Generated) -> torch.Tensor:
        parts = [token_logprobs(self.reference, g, slice(s, s + self.micro_batch_size))[0]
                 for s in range(0, g.completion_ids.shape[0], self.micro_batch_size)]
        return torch.cat(parts)
