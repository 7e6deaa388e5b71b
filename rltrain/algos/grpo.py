"""GRPO (Shao et al. 2024) on a causal LM: each prompt's group of sampled completions scored by
verifiable rewards; advantages relative to the group; ``epochs`` passes of the clipped token-level
surrogate, in micro-batches whose gradients accumulate into one step per pass; an optional KL penalty
to a frozen reference (``kl_coef: 0`` keeps none in memory).

The sampler is not quite the learner (another engine's numerics, weights a version behind), so by
default the surrogate is against the learner's own log-probs before the update, each token weighted by
truncated importance sampling from the sampler (``tis_cap``, Yao et al. 2025); ``tis_cap: null`` takes
the ratio against the sampling log-probs instead. The arithmetic is in ``grpo_loss``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import time
from collections.abc import Callable
from typing import Annotated

import torch
from tensordict import TensorDict

from rltrain.algos import optimizers
from rltrain.algos.finite import NonFinite, NonFiniteGuard, nonfinite_weights
from rltrain.algos.grpo_loss import (
    AGGREGATIONS,
    Normalizer,
    aggregate,
    group_advantages,
    kl_k3,
    tis_from_sums,
    tis_sums,
    tis_weights,
    token_losses,
)
from rltrain.errors import ConfigError, NonFiniteError
from rltrain.llm.prompt_cache import cache_name, positions, prompt_pass, whole_groups
from rltrain.rules import (
    Flag,
    Fraction,
    NonNegativeNumber,
    Number,
    OneOf,
    PositiveFraction,
    PositiveInt,
    PositiveNumber,
)
from rltrain.strategies import Single, Strategy

SCHEDULES = ("constant", "linear", "cosine")
# A cap below 1 would scale down even the tokens the sampler and the learner agree on: a smaller lr.
TisCap = Annotated[float | None, Number(at_least=1, null="the ratio against the sampling log-probs, no weight")]


def token_logprobs(model, batch: TensorDict, group_size: int = 1, temperature: float = 1.0,
                   forward: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each completion token's log-prob under ``model`` at the sampling ``temperature`` (the rows of
    ``batch``, flat), and the entropy of that distribution.

    Rows come in groups of ``group_size`` completions of one prompt: each prompt then goes through the
    model once, and its keys and values (with their gradients) serve every completion of its group,
    instead of once per completion (the same figures, for a fraction of the prompt's cost). Rows that
    are not whole groups of one prompt go through whole, prompt and completion together. ``forward``
    calls the model (a data-parallel learner's wrapper: its backward pass averages the gradients)."""
    forward = forward or model
    if whole_groups(batch["prompt_ids"], group_size):
        logits = _logits_sharing_prompts(model, batch, group_size, forward)
    else:
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        logits = forward(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
        logits = logits[:, batch["prompt_ids"].shape[1] - 1:-1]
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = logp_all.gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def _logits_sharing_prompts(model, batch: TensorDict, group_size: int, forward: Callable) -> torch.Tensor:
    """The logits that predict each completion token ``[rows, T, vocab]``: one pass over each group's
    prompt, whose cache (repeated for every completion of the group) the completions then attend to."""
    prompt_mask, completions = batch["prompt_mask"], batch["completion_ids"]
    prompt, cache = prompt_pass(model, batch["prompt_ids"], prompt_mask, group_size, forward)
    first = prompt.logits[:, -1:].repeat_interleave(group_size, dim=0)  # predicts each completion's first token
    if completions.shape[1] == 1:
        return first
    mask = torch.cat([prompt_mask, batch["completion_mask"]], dim=1)[:, :-1]
    start = prompt_mask.shape[1]
    rest = forward(input_ids=completions[:, :-1], attention_mask=mask, position_ids=positions(mask)[:, start:],
                 use_cache=True, **{cache_name(model): cache}).logits
    return torch.cat([first, rest], dim=1)


class GRPO:
    """The learner of a language-model policy: ``update(batch)`` trains ``policy`` (a transformers
    causal LM) on one ``[prompts, group_size]`` batch (``collector=generation``'s) and returns its metrics."""

    ACTION_SPACES = ("tokens",)
    OBSERVATIONS = ("text",)
    # Keys GRPO had while the collector's sampling settings were copied into it: it reads them from each batch.
    MOVED_KEYS = {"temperature": "is now collector.temperature (GRPO reads the temperature each batch was sampled at)",
                  "max_new_tokens": "is now collector.max_new_tokens (GRPO reads it from each batch)"}
    # With strategy=ddp each rank updates on its share of the prompts (whole groups: the collector's); no size of
    # its own is global (micro_batch_size is what one forward pass holds, on each rank).
    DATA_PARALLEL = ()
    SHARDS = True  # strategy=fsdp: the model sharded over the ranks, one decoder layer at a time
    NEEDS_PUSHES = ("GRPO's ratios (or tis_cap's weights) compare the learner with the weights that sampled; "
                    "without pushes the engine keeps its first weights and they drift until every token is clipped "
                    "or truncated")

    @classmethod
    def check_config(cls, values: dict, config: dict) -> None:
        """Groups that can teach something (rltrain.rules: the config check asks this): advantages are
        relative to the group, so a group of one completion, or of greedy ones (all alike), has none."""
        collector = config.get("collector") or {}
        if collector.get("group_size") == 1:
            why = ("has no std to divide its advantage by, and " if values["scale_rewards"] else "")
            raise ConfigError(f"collector.group_size=1 with algo=grpo: a group of one completion {why}has no spread "
                              "to learn from (its advantage is always 0); use collector.group_size=2 or more")
        if collector.get("greedy"):
            raise ConfigError("collector.greedy=true with algo=grpo: every completion of a group would be the same, "
                              "and its advantage 0; set collector.greedy=false (the eval hook completes greedily)")

    def __init__(
        self,
        policy,
        total_frames: int,
        device: torch.device | str = "cpu",
        lr: PositiveNumber = 1e-3,  # AdamW learning rate (the peak of the schedule)
        lr_schedule: Annotated[str, OneOf(SCHEDULES)] = "constant",  # constant | linear | cosine (to 0 at the end)
        warmup: Fraction = 0.0,  # share of trainer.total_frames over which the lr rises linearly from 0
        weight_decay: NonNegativeNumber = 0.0,  # AdamW weight decay
        epochs: PositiveInt = 1,  # passes over each batch (one optimizer step each)
        micro_batch_size: PositiveInt = 64,  # completions per forward/backward pass (gradients accumulate)
        clip_low: PositiveFraction = 0.2,  # the ratio is clipped below at 1 - clip_low
        clip_high: PositiveNumber = 0.28,  # and above at 1 + clip_high (DAPO's clip-higher: > clip_low)
        # each token's surrogate times min(p_learner / p_sampler, tis_cap), its ratio then against the learner's
        # log-probs before the update (truncated importance sampling); null: the ratio against the sampler's, no weight
        tis_cap: TisCap = 2.0,  # the cap (>= 1) on the importance weight from the sampler to the learner, or null
        # token_mean (DAPO's) | sequence_mean (the original GRPO's) | constant (Dr. GRPO's: / batch x max_new_tokens)
        loss_aggregation: Annotated[str, OneOf(AGGREGATIONS)] = "token_mean",  # token_mean | sequence_mean | constant
        scale_rewards: Flag = True,  # divide each group's centred rewards by its std (Dr. GRPO: false)
        mask_truncated: Flag = False,  # completions cut at max_new_tokens teach nothing (DAPO's overlong filter)
        kl_coef: NonNegativeNumber = 0.0,  # weight of the k3 KL to a frozen copy of the initial model; 0 keeps none
        max_grad_norm: PositiveNumber = 1.0,  # global gradient-norm clip
        nonfinite: NonFinite = "error",  # a NaN/inf loss or gradient: error stops the run; skip skips that step
        strategy: Strategy = Single(),
    ):
        self.policy, self.device, self.total_frames = policy, torch.device(device), total_frames
        self.strategy = strategy
        self.lr, self.lr_schedule, self.warmup = lr, lr_schedule, warmup
        self.epochs, self.micro_batch_size = epochs, micro_batch_size
        self.clip_low, self.clip_high, self.aggregation = clip_low, clip_high, loss_aggregation
        self.tis_cap = tis_cap
        self.scale_rewards, self.mask_truncated = scale_rewards, mask_truncated
        self.kl_coef, self.max_grad_norm = kl_coef, max_grad_norm
        # The KL's reference: the initial model, frozen. A model with LoRA adapters has it already (the
        # adapters turned off: no copy); any other is copied once.
        self._adapters_off = policy.disable_adapter if kl_coef and hasattr(policy, "disable_adapter") else None
        self.reference = (strategy.frozen(copy.deepcopy(policy).eval().requires_grad_(False))
                          if kl_coef and self._adapters_off is None else None)
        # Data-parallel: its backward pass averages the ranks' gradients; sharded: the parameters become this
        # rank's shards, so they are taken (and the optimizer made) after.
        self._forward = strategy.wrap(policy)
        self._params = [p for p in policy.parameters() if p.requires_grad]  # LoRA: the adapters only
        # Fused: it skips a step the guard flags, and computes each step in float32 whatever the weights' dtype
        # (its moments stay in that dtype; the unfused AdamW turns float16 weights into NaN at the first step:
        # its eps underflows to 0).
        self.optimizer = torch.optim.AdamW(self._params, lr=lr, weight_decay=weight_decay, fused=True)
        self.guard = NonFiniteGuard({"grpo": self.optimizer}, nonfinite, self.device)
        self.frames = 0  # completions trained on: the schedule's position

    def update(self, batch: TensorDict, should_stop: Callable[[], bool] = lambda: False) -> dict[str, float]:
        """One update on ``batch``; a stop request waits for its end (an update is a few optimizer steps)."""
        group_size = batch.shape[1]
        started = time.perf_counter()
        self._set_lr()
        self.frames += batch.numel() * self.strategy.size  # the whole job's completions: the schedule is global
        flat = batch.reshape(-1).to(self.device)
        # the tokens that carry loss: the model's own (an episode of several turns holds the environment's too)
        mask = flat["loss_mask" if "loss_mask" in flat.keys() else "completion_mask"].float()
        if self.mask_truncated:
            mask = mask * (~flat["truncated"]).float().unsqueeze(1)
        tokens, nonfinite = mask.sum(), (~torch.isfinite(flat["log_prob"])).any().float()
        if self.strategy.size > 1:  # one collective for both: every rank then fails alike, or none does
            tokens, nonfinite = self.strategy.sum(torch.stack([tokens, nonfinite]))
            tokens = tokens / self.strategy.size  # the ranks' gradients are averaged: the mean tokens of a rank
        if nonfinite:
            where = " (on one of the learner ranks)" if self.strategy.size > 1 else ""
            raise NonFiniteError(f"the engine's log-probs of this batch{where} (weights version "
                                 f"{int(flat['policy_version'].min())}) hold NaN or infinity: its forward pass "
                                 "overflowed (model.dtype=float16 does; use float32) or its weights are "
                                 "not finite; lower algo.lr if the weights grew")
        # How the batch was sampled, as it says: the policy is the model's distribution at this temperature
        # (the sampling log-probs are), and max_new_tokens is Dr. GRPO's constant normaliser.
        temperature, max_new_tokens = float(flat["temperature"].max()), int(flat["max_new_tokens"].max())
        rewards = flat["reward"]
        advantages, flat_groups = group_advantages(rewards, group_size, scale=self.scale_rewards)
        norm = Normalizer.of(mask, max_new_tokens)
        if self.strategy.size > 1:
            norm = dataclasses.replace(norm, tokens=float(tokens) or 1.0)
        ref = self._reference_logprobs(flat, group_size, temperature) if self.kl_coef else None
        self.policy.train()
        # With a cap: the learner's log-probs before this update's step. The first pass's are those (its
        # micro-batches only accumulate gradients, the one step comes after them), kept for later passes.
        old = None if self.tis_cap is None else torch.zeros_like(mask)
        sums = {"loss": 0.0, "clip_fraction": 0.0, "entropy": 0.0, "kl": 0.0, "grad_norm": 0.0, "ratio_max": 0.0}
        starts = range(0, flat.shape[0], self.micro_batch_size)
        for epoch in range(self.epochs):
            self.optimizer.zero_grad(set_to_none=True)
            epoch_loss = torch.zeros((), device=self.device)
            for start in starts:
                rows = slice(start, start + self.micro_batch_size)
                part, kept = flat[rows], mask[rows]
                last = start == starts[-1]  # data-parallel: the gradients are averaged once, after the last
                with contextlib.nullcontext() if last else self.strategy.accumulating(self._forward):
                    logp, entropy = token_logprobs(self.policy, part, self._group_rows(group_size), temperature,
                                                   self._forward)
                old_logp, weight = part["log_prob"], None
                if old is not None:
                    if epoch == 0:
                        old[rows] = logp.detach()
                    old_logp, weight = old[rows], tis_weights(old[rows], part["log_prob"], self.tis_cap)
                losses = token_losses(logp, old_logp, advantages[rows], self.clip_low, self.clip_high,
                                      None if ref is None else ref[rows], self.kl_coef, weight)
                loss = aggregate(losses, kept, self.aggregation, norm)
                with contextlib.nullcontext() if last else self.strategy.accumulating(self._forward):
                    loss.backward()
                epoch_loss += loss.detach()
                with torch.no_grad():
                    ratio = torch.exp(logp - old_logp)
                    clipped = ((ratio < 1 - self.clip_low) | (ratio > 1 + self.clip_high)).float()
                    sums["loss"] += loss.item()
                    sums["clip_fraction"] += (clipped * kept).sum().item() / norm.tokens
                    sums["entropy"] += (entropy * kept).sum().item() / norm.tokens
                    sums["ratio_max"] = max(sums["ratio_max"], (ratio * kept).max().item())
                    if ref is not None:
                        sums["kl"] += (kl_k3(logp, ref[rows]) * kept).sum().item() / norm.tokens
            grad_norm = self.strategy.whole(torch.nn.utils.clip_grad_norm_(self._params, self.max_grad_norm))
            self.guard.check("grpo", epoch_loss, grad_norm=grad_norm)  # a NaN/inf one: the step is skipped
            sums["grad_norm"] += float(grad_norm)
            self.optimizer.step()
        self.policy.eval()
        skipped = self.guard.report()  # raises for skipped steps, unless nonfinite=skip
        bad = nonfinite_weights(self.policy)  # finite loss and gradients, yet a step made them NaN/inf
        if self.strategy.SHARDED:  # each rank checked its shards: every rank fails alike, or none does
            bad = sorted({name for names in self.strategy.gather(bad) for name in names})
        if bad:
            raise NonFiniteError(f"the optimizer step made {len(bad)} weight tensor(s) NaN or infinite ({bad[0]}"
                                 f"{f' and {len(bad) - 1} more' if len(bad) > 1 else ''}), with a finite loss "
                                 f"and gradients; nothing with them is checkpointed. Weights of dtype "
                                 f"{self._params[0].dtype} may be too narrow for this step: use model.dtype=float32 "
                                 "for full fine-tuning (bfloat16 suits LoRA), or a lower algo.lr")
        seconds = time.perf_counter() - started
        metrics = {f"grpo/{k}": v / (1 if k == "ratio_max" else self.epochs) for k, v in sums.items()
                   if k != "kl" or ref is not None}
        metrics.update(batch_metrics(batch))
        metrics.update({"grpo/flat_groups": float(flat_groups), "grpo/lr": self.optimizer.param_groups[0]["lr"],
                        "perf/trained_tokens_per_s": self.epochs * float(flat["completion_mask"].sum()) / seconds})
        tis = None if old is None else tis_sums(old, flat["log_prob"], mask, self.tis_cap)
        if self.strategy.size > 1:
            metrics, tis = self._whole_job(metrics, batch, tis)
        if tis is not None:
            metrics.update({f"grpo/tis/{k}": v for k, v in tis_from_sums(*tis).items()})
        if skipped:
            metrics["nonfinite/skipped_steps"] = skipped
        return metrics

    def _whole_job(self, metrics: dict, batch: TensorDict, tis: tuple | None) -> tuple[dict, tuple | None]:
        """Data-parallel: the metrics that a mean over the ranks' (the trainer's) would not make the whole job's,
        made so here: counts and rates summed, maxima the largest, the rewards' std and the TIS diagnostics over
        every rank's completions. The rest are means over equal shares already (or the same on every rank)."""
        summed = SUMMED_OVER_RANKS  # every key on every rank (0 where a rank has none): one collective's shape
        local = torch.tensor([metrics.get(k, 0.0) for k in summed], dtype=torch.float64)
        total = self.strategy.sum(local if tis is None else torch.cat([local, tis[0].cpu()]))
        metrics.update((k, v) for k, v in zip(summed, total[:len(summed)].tolist()) if k in metrics)
        top = self.strategy.max([metrics["grpo/ratio_max"], -math.inf if tis is None else tis[1]])
        metrics["grpo/ratio_max"] = top[0]
        rewards = reward_columns(batch)
        mean, var, count = self.strategy.moments(torch.stack(list(rewards.values()), dim=1).double())
        std = (var * count / max(count - 1, 1)).sqrt()  # unbiased, as batch_metrics' torch.std
        metrics.update({f"{name}/std": float(s) for name, s in zip(rewards, std)})
        return metrics, None if tis is None else (total[len(summed):], top[1])

    def _group_rows(self, group_size: int) -> int:
        """The group size a micro-batch shares prompts by: the groups', where micro-batches hold whole groups."""
        return group_size if self.micro_batch_size % group_size == 0 else 1

    def _set_lr(self) -> None:
        """The lr at this point of the run: a linear warmup over ``warmup`` of the frames, then
        ``lr_schedule`` down to 0 at ``total_frames``."""
        done = min(self.frames / self.total_frames, 1.0)
        if self.warmup and done < self.warmup:
            factor = done / self.warmup
        else:
            rest = (done - self.warmup) / (1 - self.warmup) if self.warmup < 1 else 1.0
            factor = {"constant": 1.0, "linear": 1.0 - rest, "cosine": 0.5 * (1 + math.cos(math.pi * rest))}[
                self.lr_schedule]
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr * factor

    @torch.no_grad()
    def _reference_logprobs(self, flat: TensorDict, group_size: int, temperature: float) -> torch.Tensor:
        group_size = self._group_rows(group_size)
        model = self.reference if self.reference is not None else self.policy
        with self._adapters_off() if self._adapters_off is not None else contextlib.nullcontext():
            parts = [token_logprobs(model, flat[s:s + self.micro_batch_size], group_size, temperature)[0]
                     for s in range(0, flat.shape[0], self.micro_batch_size)]
        return torch.cat(parts)

    def trained_parts(self) -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer | None]]:
        """The modules a sharded checkpoint holds rank by rank, each with its optimizer: the policy, and the
        frozen reference (if any)."""
        parts = {"policy": (self.policy, self.optimizer)}
        if self.reference is not None:
            parts["reference"] = (self.reference, None)
        return parts

    def state_dict(self, replay_buffer: bool = True, parts: bool = True) -> dict:
        """The weights, the optimizer, the schedule's position, the frozen reference (if any) and the
        count of skipped steps; ``parts=False``: all but ``trained_parts`` (a sharded checkpoint's rest, whose
        shards ``rltrain.sharded_checkpoint`` writes). A sharded learner's parts are as this rank holds them (its
        shards, as DTensors, which know their whole shapes: nothing is gathered)."""
        state = {"frames": self.frames, "nonfinite": self.guard.state_dict()}
        if parts:
            state.update(policy=self.policy.state_dict(), optimizer=self.optimizer.state_dict(),
                         reference=self.reference.state_dict() if self.reference is not None else None)
        return state

    def load_state_dict(self, state: dict) -> None:
        """``state_dict()``'s result; one with ``parts=False`` leaves the trained parts as they are (loaded from
        their shards)."""
        if "policy" in state:
            self.policy.load_state_dict(self.strategy.shard_weights(self.policy, state["policy"]))
            # stays fused, as the guard needs
            optimizers.load_adam(self.optimizer,
                                 self.strategy.shard_optimizer_state(self.optimizer, state["optimizer"]))
            if self.reference is not None and state["reference"] is not None:
                self.reference.load_state_dict(self.strategy.shard_weights(self.reference, state["reference"]))
        self.frames = state["frames"]
        self.guard.load_state_dict(state.get("nonfinite"))  # None in a checkpoint written before the guard


# Metrics of a data-parallel learner that add up over its ranks (the trainer averages the rest).
SUMMED_OVER_RANKS = ("grpo/flat_groups", "perf/trained_tokens_per_s", "perf/generated_tokens_per_s")


def reward_columns(batch: TensorDict) -> dict[str, torch.Tensor]:
    """Each completion's reward, flat: the weighted total (``reward``) and each function's (``reward/NAME``)."""
    named = {"reward": batch["reward"], **{f"reward/{k}": v for k, v in batch["rewards"].items()}}
    return {name: values.float().reshape(-1) for name, values in named.items()}


def batch_metrics(batch: TensorDict) -> dict[str, float]:
    """What a batch of completions says: each reward's mean and std (the total's, and each
    function's), completion length (the model's tokens), the share cut at max_new_tokens (or, for episodes of
    several turns, by a limit), tokens generated per second; and for episodes, the turns, tokens per turn, tool
    calls and tool errors per episode."""
    metrics = {}
    for name, values in reward_columns(batch).items():
        metrics[f"{name}/mean"] = values.mean().item()
        metrics[f"{name}/std"] = values.std().item() if values.numel() > 1 else 0.0
    tokens = float(batch["loss_mask" if "loss_mask" in batch.keys() else "completion_mask"].sum())  # the model's
    metrics["completion/length"] = tokens / batch.numel()
    metrics["completion/truncated"] = batch["truncated"].float().mean().item()
    if "turns" in batch.keys():  # episodes of several turns (a language environment's)
        turns = batch["turns"].float()
        metrics["episode/turns"] = turns.mean().item()
        metrics["episode/tokens_per_turn"] = tokens / max(float(turns.sum()), 1.0)
        for name in ("tool_calls", "tool_errors"):
            metrics[f"episode/{name}"] = batch[name].float().mean().item()
    generate_s = float(batch["generate_s"].sum())
    if generate_s > 0:
        metrics["perf/generated_tokens_per_s"] = tokens / generate_s
    return metrics
