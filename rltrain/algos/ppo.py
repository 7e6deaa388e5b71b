"""Proximal Policy Optimization with the clipped surrogate objective (Schulman et al. 2017).

Read top to bottom: hyperparameters, then ``update``: values and GAE advantages for the whole
batch (``_prepare``), then ``epochs`` passes of shuffled minibatches, each one gradient step on the
clipped policy loss, the (optionally clipped) value loss and the entropy bonus (``_loss``). A stop
request between two minibatches keeps the rest of the update (``PendingEpochs``) in ``state_dict``,
so a resumed run finishes it.

A network with memory (``algo.network.recurrent``) trains on sequences instead of single samples: each env's
steps in windows of ``sequence_length`` (``rltrain.algos.recurrent.Sequences``), each window unrolled from the
state its first step acted from, reset at the episode starts inside it; minibatches are whole windows, and the
padding after a batch's last step counts in no loss or statistic.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated

import torch
from torch import nn

from rltrain.algos import optimizers
from rltrain.algos.advantages import gae
from rltrain.algos.finite import NonFinite, NonFiniteGuard
from rltrain.algos.networks import ActorCritic
from rltrain.algos.normalization import ReturnNormalizer
from rltrain.algos.pending import Pending
from rltrain.algos.recurrent import Sequences, state_size
from rltrain.algos.update_step import Switch, UpdateStep, compile_enabled, cuda_graph_enabled, plain
from rltrain.device import to_learner
from rltrain.errors import ConfigError
from rltrain.rules import (
    Flag,
    Fraction,
    Integer,
    NonNegativeNumber,
    Number,
    PositiveFraction,
    PositiveInt,
    PositiveNumber,
    PositiveNumberOrNull,
)
from rltrain.strategies import Single, Strategy

if TYPE_CHECKING:
    from tensordict import TensorDict

# What the learner reads of a batch (the rest stays on the host, for the trainer's accounting).
_LEARNER_KEYS = ["observation", "action", "log_prob", "reward", "terminated", "done", ("next", "observation")]


@dataclass
class PendingEpochs(Pending):
    """The update under way: the batch as the epochs read it (flattened to samples, with its
    advantages and returns), how far the epochs got, and what they measured so far."""

    obs: torch.Tensor | TensorDict
    action: torch.Tensor
    old_log_prob: torch.Tensor
    old_value: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    # Where a stop request interrupted the epochs (``update`` sets them as it returns): the epoch,
    # its shuffle of the samples (None: not drawn yet) and the first of its minibatches not taken.
    epoch: int = 0
    perm: torch.Tensor | None = None
    next: int = 0
    losses: list[torch.Tensor] = field(default_factory=list)  # each step's (policy, value, entropy) loss
    diagnostics: list[torch.Tensor] = field(default_factory=list)  # each epoch's (approx KL, clip fraction)
    # A network with memory: the fields above are laid out as sequences, [length, sequences, ...]; these say where
    # each starts from ([sequences, state_size]), where an episode starts inside it and which steps are frames.
    state: torch.Tensor | None = None
    starts: torch.Tensor | None = None
    valid: torch.Tensor | None = None

    @property
    def size(self) -> int:
        """What the epochs shuffle and split into minibatches: samples, or sequences for a network with memory."""
        return self.obs.shape[0] if self.valid is None else self.valid.shape[1]

    def minibatch(self, idx: torch.Tensor) -> tuple:
        """The samples (or sequences) ``idx``, as ``PPO._loss`` takes them."""
        if self.valid is None:
            return (plain(self.obs[idx]), self.action[idx], self.old_log_prob[idx], self.advantages[idx],
                    self.returns[idx], self.old_value[idx])
        return (plain(self.obs[:, idx]), self.action[:, idx], self.old_log_prob[:, idx], self.advantages[:, idx],
                self.returns[:, idx], self.old_value[:, idx], self.state[idx], self.starts[:, idx], self.valid[:, idx])

    def frames(self, x):
        """``x`` (a field above) as one row per frame: without a sequence layout's padding."""
        return x if self.valid is None else x[self.valid]


class PPO:
    """The learner side of PPO: owns the policy's optimizer and turns batches into updates."""

    ACTION_SPACES = ("discrete", "box", "multi_discrete", "multi_binary")
    OBSERVATIONS = ("vector", "discrete", "multi_discrete", "image")
    DATA_PARALLEL = ("minibatch_size",)  # with strategy=ddp: global sizes, each rank takes its share
    RANK_STATE = ("reward_norm",)  # differs between the ranks (each env column's discounted return so far)

    @classmethod
    def check_config(cls, values: dict, config: dict) -> None:
        """A minibatch is drawn from one collector batch (rltrain.rules: the config check asks this)."""
        minibatch, batch = values["minibatch_size"], config["collector"].get("frames_per_batch")
        if batch is not None and minibatch > batch:
            raise ConfigError(f"algo.minibatch_size ({minibatch}) is larger than the batch "
                              f"(collector.frames_per_batch={batch}); use at most {batch}")
        recurrent = (config["algo"].get("network") or {}).get("recurrent")
        for key in ("compile", "cuda_graph"):
            if recurrent and values.get(key) is True:
                raise ConfigError(f"algo.{key}=true does not take a recurrent network (algo.network.recurrent="
                                  f"{recurrent}: its update unrolls sequences with a loop over their episode starts); "
                                  f"use algo.{key}=auto (off for it) or false")

    def __init__(
        self,
        policy: ActorCritic,
        total_frames: int,
        device: torch.device | str = "cpu",
        strategy: Strategy = Single(),
        lr: PositiveNumber = 3e-3,  # Adam learning rate (the start value when annealed)
        anneal_lr: Flag = True,  # decay the lr linearly to 0 over trainer.total_frames
        gamma: PositiveFraction = 0.98,  # discount factor
        gae_lambda: Fraction = 0.8,  # GAE lambda: 0 = one-step TD, 1 = Monte Carlo returns
        epochs: PositiveInt = 10,  # passes over each collected batch
        minibatch_size: PositiveInt = 256,  # samples per gradient step (the batch is collector.frames_per_batch)
        clip_coef: PositiveNumber = 0.2,  # epsilon of the clipped ratio objective
        clip_vloss: Flag = False,  # also clip the value update to +-clip_coef around the old values
        vf_coef: NonNegativeNumber = 0.5,  # weight of the value loss
        ent_coef: NonNegativeNumber = 0.0,  # weight of the entropy bonus
        max_grad_norm: PositiveNumber = 0.5,  # global gradient-norm clip
        norm_adv: Flag = True,  # normalize advantages per minibatch
        # a network with memory trains on windows of this many steps of each env (backpropagation through time
        # truncated there), each from the state its first step acted in; null: each env's whole batch
        sequence_length: Annotated[int | None, Integer(1, null="each env's steps of the whole batch")] = None,
        target_kl: PositiveNumberOrNull = None,  # stop the epochs early once the approximate KL exceeds this
        adam_eps: PositiveNumber = 1e-5,  # Adam epsilon
        nonfinite: NonFinite = "error",  # a NaN/inf loss or gradient: error stops the run; skip skips that step
        sign_reward: Flag = False,  # set from env.sign_reward: learn from sign(reward) (Atari's reward clipping)
        normalize_reward: Flag = False,  # set from env.normalize_reward: rewards / std of the discounted return
        clip_reward: Annotated[float | None, Number(above=0, null="no clip")] = 10.0,  # env.clip_reward: +-this bound
        compile: Switch = "auto",  # torch.compile each minibatch step; auto: on a CUDA learner only
        cuda_graph: Switch = "auto",  # replay each minibatch step as one CUDA graph; auto: on a CUDA learner
    ):
        self.policy = policy
        self.device = torch.device(device)
        self.total_frames = total_frames
        self.lr, self.anneal_lr = lr, anneal_lr
        self.gamma, self.gae_lambda = gamma, gae_lambda
        # A data-parallel learner steps on its share of each minibatch; the gradients are averaged over the ranks.
        self.strategy = strategy
        self.epochs, self.minibatch_size = epochs, minibatch_size // strategy.size
        self._evaluate = strategy.wrap(policy, "evaluate")
        self.clip_coef, self.clip_vloss = clip_coef, clip_vloss
        self.vf_coef, self.ent_coef = vf_coef, ent_coef
        self.max_grad_norm, self.norm_adv, self.target_kl = max_grad_norm, norm_adv, target_kl
        self.recurrent, self.sequence_length = state_size(policy) > 0, sequence_length
        # Not with data-parallel ranks yet: their step exchanges statistics mid-way (the config check says so);
        # nor for a network with memory, whose unroll loops over the episode starts in its sequences.
        compiled = compile_enabled(compile, self.device) and not strategy.PARALLEL and not self.recurrent
        graphed = cuda_graph_enabled(cuda_graph, self.device) and not strategy.PARALLEL and not self.recurrent
        self._params = list(policy.parameters())
        self.optimizer = optimizers.adam(self._params, lr, self.device, graphed,
                                         lr_tensor=anneal_lr and (compiled or graphed), eps=adam_eps)
        self.guard = NonFiniteGuard({"ppo": self.optimizer}, nonfinite, self.device)
        self._run = UpdateStep(self._minibatch_step, "PPO's minibatch step", compiled, graphed, self.minibatch_size)
        # On the learner, so every env (in-process, in workers, on other ranks) is scaled alike.
        self.reward_norm = ReturnNormalizer(gamma, clip_reward, moments=strategy.moments) if normalize_reward else None
        self.sign_reward = sign_reward
        self.frames = 0
        self._pending: PendingEpochs | None = None  # the update under way, until it ends

    def state_dict(self, replay_buffer: bool = True) -> dict:
        """Everything a resumed run needs: weights (obs statistics included), optimizer, lr position,
        and the rest of an update that a stop request interrupted (PPO keeps no replay buffer)."""
        return {"policy": self.policy.state_dict(), "optimizer": self.optimizer.state_dict(), "frames": self.frames,
                "nonfinite": self.guard.state_dict(),
                "pending": self._pending.state_dict() if self._pending is not None else None,
                "reward_norm": self.reward_norm.state_dict() if self.reward_norm else None}

    def load_state_dict(self, state: dict) -> None:
        self.policy.load_state_dict(state["policy"])
        optimizers.load_adam(self.optimizer, state["optimizer"])
        self.frames = state["frames"]
        self.guard.load_state_dict(state["nonfinite"])
        self._pending = PendingEpochs.from_state_dict(state["pending"], self.device)
        if self.reward_norm is not None and state.get("reward_norm") is not None:
            self.reward_norm.load_state_dict(state["reward_norm"])

    def update(self, batch: TensorDict | None, should_stop: Callable[[], bool] = lambda: False) -> dict | None:
        """One PPO update on a ``[T, N]`` batch from a collector; returns loss and diagnostic metrics.

        Returns None if ``should_stop()`` turned true between two minibatch steps; ``update(None)``
        (after a resume from ``state_dict``) then finishes that update exactly where it stopped.
        """
        if batch is not None:
            self._pending = self._prepare(batch)
        p = self._pending  # a resumed update goes on from its epoch, shuffle and minibatch
        minibatch_size = self.minibatch_size if p.valid is None else max(1, self.minibatch_size // p.valid.shape[0])
        for epoch in range(p.epoch, self.epochs):
            if p.perm is None:
                p.perm = torch.randperm(p.size, device=self.device)
            minibatches = p.perm.split(minibatch_size)
            for k in range(p.next, len(minibatches)):
                if should_stop():
                    p.epoch, p.next = epoch, k
                    return None
                parts, ratio, log_ratio = self._step(p, minibatches[k])
                p.losses.append(parts)

            # Diagnostics on the epoch's last minibatch (per minibatch they would cost ~5% of the update).
            with torch.no_grad():
                approx_kl = ((ratio - 1) - log_ratio).mean()  # the low-variance k3 estimator
                clip_fraction = ((ratio - 1).abs() > self.clip_coef).float().mean()
            p.diagnostics.append(torch.stack([approx_kl, clip_fraction]))
            p.perm, p.next = None, 0
            if self.target_kl is not None and self.strategy.mean(approx_kl).item() > self.target_kl:
                break
        self._pending = None

        # Fold this batch into the observation statistics only now, so the epochs above used the
        # same normalization the collector acted with; the next push carries the new statistics.
        self.policy.encoder.update(p.frames(p.obs), self.strategy.moments)

        mean = torch.stack(p.losses).mean(0).tolist() + torch.stack(p.diagnostics).mean(0).tolist()
        returns, old_value = p.frames(p.returns), p.frames(p.old_value)
        moments = self.strategy.moments
        explained_var = 1 - moments(returns - old_value)[1] / moments(returns)[1].clamp_min(1e-8)
        metrics = {
            "loss/policy": mean[0],
            "loss/value": mean[1],
            "loss/entropy": mean[2],
            "ppo/approx_kl": mean[3],
            "ppo/clip_fraction": mean[4],
            "ppo/epochs": float(len(p.diagnostics)),  # the epochs run: fewer than algo.epochs once target_kl stops them
            "ppo/explained_variance": explained_var.item(),
            "ppo/lr": float(self.optimizer.param_groups[0]["lr"]),
        }
        if self.reward_norm is not None:
            metrics["ppo/reward_scale"] = self.reward_norm.scale
        if skipped := self.guard.report():
            metrics["nonfinite/skipped_steps"] = skipped
        return metrics

    def _prepare(self, batch: TensorDict) -> PendingEpochs:
        """The lr schedule's step, values and GAE advantages for the whole batch, flattened."""
        if self.anneal_lr:
            optimizers.set_lr(self.optimizer, self.lr * max(1.0 - self.frames / self.total_frames, 0.0))
        self.frames += batch.numel()

        # Rewards are transformed on the host, where the return normalizer's recursion over time is cheap.
        keys = [*_LEARNER_KEYS, "recurrent_state"] if self.recurrent else _LEARNER_KEYS
        batch = batch.select(*keys)
        if self.sign_reward:
            batch["reward"] = batch["reward"].sign()
        if self.reward_norm is not None:
            batch["reward"] = self.reward_norm(batch["reward"], batch["done"])
        policy, batch = self.policy, to_learner(batch, keys, self.device)

        # Advantages with the current critic for the whole batch, bootstrapping from ("next", "observation").
        obs, action, reward = batch["observation"], batch["action"], batch["reward"]
        with torch.no_grad():
            if self.recurrent:
                value, next_value = self._values_in_state(batch)
            else:
                value = policy.value(obs)
                next_value = policy.value(batch["next", "observation"])
            advantages = gae(reward, value, next_value, batch["terminated"], batch["done"], self.gamma, self.gae_lambda)
            returns = advantages + value
        if self.recurrent:
            seq = Sequences(*reward.shape, self.sequence_length or reward.shape[0])
            return PendingEpochs(*map(seq.lay_out, (obs, action, batch["log_prob"], value, advantages, returns)),
                                 state=seq.first_states(batch["recurrent_state"]), starts=seq.starts(batch["done"]),
                                 valid=seq.valid(self.device))
        obs, action = obs.flatten(0, 1), action.flatten(0, 1)
        return PendingEpochs(obs, action, batch["log_prob"].flatten(), value.flatten(), advantages.flatten(),
                             returns.flatten())

    def _values_in_state(self, batch: TensorDict) -> tuple[torch.Tensor, torch.Tensor]:
        """A network with memory: each frame's value from the state its action was chosen in, and its next
        observation's from the state that step led to (before any reset: the episode's own, where it was cut
        short), both one step of the core for the whole batch at once."""
        shape = batch["reward"].shape
        value, after = self.policy.value_in_state(batch["observation"].flatten(0, 1),
                                                  batch["recurrent_state"].flatten(0, 1))
        next_value, _ = self.policy.value_in_state(batch["next", "observation"].flatten(0, 1), after)
        return value.view(shape), next_value.view(shape)

    def _loss(self, obs, action: torch.Tensor, old_log_prob: torch.Tensor, adv: torch.Tensor, returns: torch.Tensor,
              old_value: torch.Tensor, *memory: torch.Tensor,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """PPO's loss on a minibatch: (loss, its three parts detached, ratio, log ratio). ``memory``: for a network
        with memory, the sequences' first states, episode starts and valid steps (``PendingEpochs.minibatch``);
        every term is then taken over the valid steps only."""
        if memory:
            state, starts, valid = memory
            log_prob, entropy, new_value = (x[valid] for x in self._evaluate(obs, action, state, starts))
            old_log_prob, adv, returns, old_value = old_log_prob[valid], adv[valid], returns[valid], old_value[valid]
        else:
            log_prob, entropy, new_value = self._evaluate(obs, action)
        log_ratio = log_prob - old_log_prob
        ratio = log_ratio.exp()
        if self.norm_adv and adv.numel() > 1:
            adv = self.strategy.normalize(adv)

        # Clipped surrogate: the pessimistic bound of the unclipped and clipped objectives.
        clipped_ratio = ratio.clamp(1 - self.clip_coef, 1 + self.clip_coef)
        policy_loss = torch.max(-adv * ratio, -adv * clipped_ratio).mean()

        value_error = (new_value - returns).square()
        if self.clip_vloss:
            v_clipped = old_value + (new_value - old_value).clamp(-self.clip_coef, self.clip_coef)
            value_error = torch.max(value_error, (v_clipped - returns).square())
        value_loss = 0.5 * value_error.mean()
        entropy_loss = entropy.mean()

        loss = policy_loss - self.ent_coef * entropy_loss + self.vf_coef * value_loss
        return loss, torch.stack([policy_loss, value_loss, entropy_loss]).detach(), ratio, log_ratio

    def _step(self, p: PendingEpochs, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One gradient step on the minibatch ``idx`` of the update ``p``: (the loss's parts, ratio, log ratio)."""
        return self._run(*p.minibatch(idx))

    def _minibatch_step(self, *minibatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One gradient step on a minibatch: (the loss's parts, ratio, log ratio). Compiled and
        replayed as a CUDA graph when so configured (``UpdateStep``): tensors in, tensors out."""
        loss, parts, ratio, log_ratio = self._loss(*minibatch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(self._params, self.max_grad_norm, foreach=True)
        self.guard.check("ppo", loss, grad_norm=grad_norm)  # a NaN/inf step is skipped
        self.optimizer.step()
        return parts, ratio, log_ratio
