"""Soft Actor-Critic (Haarnoja et al. 2018) with automatic entropy tuning, for Box action spaces.

Read top to bottom: hyperparameters; ``update`` stores a collector batch in the replay buffer and,
after ``warmup_frames``, runs ``utd`` gradient steps per collected frame. Each ``_gradient_step``:
the twin-Q target with the entropy term, the critics' loss, the actor's loss (min of the twin Qs),
the temperature's loss, then the Polyak target update. Bootstrapping stops only on termination,
not truncation (``("next", "observation")`` is the true final observation). A stop request between
two gradient steps keeps the steps still owed (``PendingSteps``) in ``state_dict``, so a resumed run
finishes them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from rltrain.algos import optimizers
from rltrain.algos.finite import NonFinite, NonFiniteGuard
from rltrain.algos.networks import NonEmptyHiddenSizes, SquashedGaussianActor, TwinQ
from rltrain.algos.replay_steps import GradientSteps, mean_metrics
from rltrain.algos.update_step import Switch, UpdateStep, compile_enabled, cuda_graph_enabled, plain
from rltrain.data import ReplayBuffer
from rltrain.data.replay import check_capacity
from rltrain.device import to_learner
from rltrain.rules import Flag, NonNegativeInt, PositiveFraction, PositiveInt, PositiveNumber
from rltrain.strategies import Single, Strategy

if TYPE_CHECKING:
    from tensordict import TensorDict

_STORED_KEYS = ["observation", "action", "reward", "terminated", ("next", "observation")]


class SAC:
    """The learner side of SAC: actor, twin critics with targets, temperature, replay buffer."""

    ACTION_SPACES = ("box",)
    OBSERVATIONS = ("vector", "discrete", "multi_discrete")  # no images: its critics read the actor's features
    NEEDS_PUSHES = ("the end of the warm-up reaches collectors through a weight push, so they would act uniformly "
                    "at random for the whole run")
    # strategy=ddp: global sizes each rank takes its share of (its own replay buffer, its share of each minibatch),
    # and what differs between the ranks in a checkpoint (each rank's buffer holds the frames it collected)
    DATA_PARALLEL = ("batch_size", "buffer_size")
    RANK_STATE = ("replay_buffer",)

    @classmethod
    def check_config(cls, values: dict, config: dict) -> None:
        """The replay buffer holds a gradient step's frames and a collector batch (the config check asks this)."""
        check_capacity(values, config)

    def __init__(
        self,
        policy: SquashedGaussianActor,
        total_frames: int,
        device: torch.device | str = "cpu",
        strategy: Strategy = Single(),
        lr: PositiveNumber = 1e-3,  # actor and temperature learning rate (Adam)
        critic_lr: PositiveNumber = 1e-3,  # critics' learning rate (Adam)
        gamma: PositiveFraction = 0.99,  # discount factor
        tau: PositiveFraction = 0.005,  # Polyak step of the target critics: target += tau * (online - target)
        batch_size: PositiveInt = 256,  # transitions per gradient step
        utd: PositiveNumber = 1.0,  # gradient steps per collected frame (update-to-data ratio)
        warmup_frames: NonNegativeInt = 1000,  # frames of uniform random actions before learning starts
        buffer_size: PositiveInt = 1_000_000,  # replay capacity in frames
        critic_hidden_sizes: NonEmptyHiddenSizes = (256, 256),  # hidden layers of each Q-network
        alpha: PositiveNumber = 1.0,  # initial entropy temperature
        autotune: Flag = True,  # learn alpha so the policy's entropy tracks target_entropy
        target_entropy: float | None = None,  # null: -action_dim
        nonfinite: NonFinite = "error",  # a NaN/inf loss or gradient: error stops the run; skip skips that step
        compile: Switch = "auto",  # torch.compile each gradient step; auto: on a CUDA learner only
        cuda_graph: Switch = "auto",  # replay each gradient step as one CUDA graph; auto: on a CUDA learner
    ):
        self.policy, self.device, self.total_frames = policy, torch.device(device), total_frames
        # A data-parallel learner steps on its share of each minibatch, sampled from its own buffer; the
        # gradients are averaged over the ranks.
        self.strategy = strategy
        batch_size, buffer_size = batch_size // strategy.size, buffer_size // strategy.size
        self.gamma, self.tau, self.batch_size, self.autotune = gamma, tau, batch_size, autotune
        obs_dim = policy.encoder.out_dim
        act_dim = policy.action_scale.numel()
        self.q = TwinQ(obs_dim, act_dim, list(critic_hidden_sizes)).to(self.device)
        self.q_target = copy.deepcopy(self.q).requires_grad_(False)
        self.target_entropy = -float(act_dim) if target_entropy is None else target_entropy
        self.log_alpha = torch.tensor(float(alpha), device=self.device).log().requires_grad_(autotune)
        self._critics = strategy.wrap(self.q)  # the critics' loss: its gradients averaged over the ranks
        self._actor = strategy.wrap(policy, "sample")  # the actor's loss: likewise
        # Not with data-parallel ranks yet: their step exchanges statistics mid-way (the config check says so).
        graphed = cuda_graph_enabled(cuda_graph, self.device) and not strategy.PARALLEL
        compiled = compile_enabled(compile, self.device) and not strategy.PARALLEL
        self.actor_optimizer = optimizers.adam(policy.parameters(), lr, self.device, graphed)
        self.critic_optimizer = optimizers.adam(self.q.parameters(), critic_lr, self.device, graphed)
        self.alpha_optimizer = optimizers.adam([self.log_alpha], lr, self.device, graphed) if autotune else None
        by_loss = {"critic": self.critic_optimizer, "actor": self.actor_optimizer}
        self.guard = NonFiniteGuard(by_loss | ({"alpha": self.alpha_optimizer} if autotune else {}),
                                    nonfinite, self.device)
        self._critic_params, self._actor_params = list(self.q.parameters()), list(policy.parameters())
        self.buffer = ReplayBuffer(buffer_size, self.device)
        self._run = UpdateStep(self._gradient_step, "SAC's gradient step", compiled, graphed, batch_size)
        self.steps = GradientSteps(self.buffer, utd, warmup_frames, strategy.size)

    def state_dict(self, replay_buffer: bool = True) -> dict:
        """Networks, targets, optimizers, temperature, counters and (optionally) the replay buffer."""
        state = {
            "policy": self.policy.state_dict(),
            "q": self.q.state_dict(),
            "q_target": self.q_target.state_dict(),
            "log_alpha": self.log_alpha.detach().clone(),
            "actor_optimizer": self.actor_optimizer.state_dict(),
            "critic_optimizer": self.critic_optimizer.state_dict(),
            "nonfinite": self.guard.state_dict(),
            **self.steps.state_dict(replay_buffer),  # counters, and the buffer with the steps still owed
        }
        if self.alpha_optimizer is not None:
            state["alpha_optimizer"] = self.alpha_optimizer.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``; without a saved buffer, learning goes on from an empty one."""
        self.policy.load_state_dict(state["policy"])
        self.q.load_state_dict(state["q"])
        self.q_target.load_state_dict(state["q_target"])
        with torch.no_grad():
            self.log_alpha.copy_(state["log_alpha"])
        optimizers.load_adam(self.actor_optimizer, state["actor_optimizer"])
        optimizers.load_adam(self.critic_optimizer, state["critic_optimizer"])
        if self.alpha_optimizer is not None and "alpha_optimizer" in state:
            optimizers.load_adam(self.alpha_optimizer, state["alpha_optimizer"])
        self.steps.load_state_dict(state)
        self.guard.load_state_dict(state["nonfinite"])

    def update(self, batch: TensorDict | None, should_stop: Callable[[], bool] = lambda: False) -> dict | None:
        """Store ``batch``, then run the gradient steps it is owed; returns the steps' mean metrics.

        Returns None if ``should_stop()`` turned true between two gradient steps; ``update(None)``
        (after a resume from ``state_dict``) then runs the steps still owed.
        """
        if batch is not None:
            self._store(batch)
        taken = self.steps.take(self._step, should_stop)
        if taken is None:
            return None
        metrics = {"sac/buffer_frames": len(self.buffer)}
        if mean := mean_metrics(taken):
            metrics |= {"loss/critic": mean[0], "loss/actor": mean[1], "loss/alpha": mean[2], "sac/alpha": mean[3],
                        "sac/q": mean[4], "sac/entropy": mean[5]}
        if skipped := self.guard.report():
            metrics["nonfinite/skipped_steps"] = skipped
        return metrics

    def _store(self, batch: TensorDict) -> None:
        """Add ``batch`` to the replay buffer and count the gradient steps it is owed (none in warm-up)."""
        batch = to_learner(batch, _STORED_KEYS, self.device)
        self.buffer.extend(batch)
        self.steps.collected(batch.numel())
        self.policy.encoder.update(batch["observation"], self.strategy.moments)
        if self.policy.uniform and not self.steps.warming_up:
            self.policy.uniform.fill_(False)  # collectors stop acting uniformly with the next push

    def _step(self) -> torch.Tensor:
        """One gradient step on a fresh minibatch; its metrics."""
        return self._run(*self._sample())

    def _sample(self) -> tuple:
        """A minibatch from the replay buffer and the policy's Gaussian noise for it: the inputs of
        ``_gradient_step``, drawn outside it (a compiled step computes exactly the eager one's numbers)."""
        b = self.buffer.sample(self.batch_size)
        noise = torch.randn(2, self.batch_size, self.policy.action_scale.numel(), device=self.device)
        return (plain(b["observation"]), b["action"].flatten(1), b["reward"], b["terminated"],
                plain(b["next", "observation"]), noise)

    def _gradient_step(self, obs, action: torch.Tensor, reward: torch.Tensor, terminated: torch.Tensor, next_obs,
                       noise: torch.Tensor) -> torch.Tensor:
        """One gradient step of critics, actor and temperature, and the targets' Polyak step; returns
        its metrics. Compiled and replayed as a CUDA graph when so configured (``UpdateStep``)."""
        policy, q, q_target = self.policy, self.q, self.q_target
        critic_obs, critic_next_obs = policy.encoder(obs), policy.encoder(next_obs)
        alpha = self.log_alpha.exp().detach()

        # Critics: soft Bellman target from the target twins' minimum, bootstrapping unless terminated.
        with torch.no_grad():
            next_action, next_log_prob = policy.sample(next_obs, noise=noise[0])
            next_q = q_target(critic_next_obs, next_action.flatten(1)).min(0).values
            target = reward + self.gamma * (~terminated).float() * (next_q - alpha * next_log_prob)
        q_values = self._critics(critic_obs, action)
        critic_loss = 0.5 * (q_values - target).square().mean(1).sum()
        self.critic_optimizer.zero_grad(set_to_none=True)
        critic_loss.backward()
        self.guard.check("critic", critic_loss, self._critic_params)  # a NaN/inf step is skipped
        self.critic_optimizer.step()

        # Actor: maximize min-Q plus entropy, through the reparameterized sample. Only the actor's
        # gradients are computed: the critics' would be thrown away (a third of this backward).
        new_action, log_prob = self._actor(obs, noise=noise[1])
        q_pi = q(critic_obs, new_action.flatten(1)).min(0).values  # (the critics themselves: no gradient to average)
        actor_loss = (alpha * log_prob - q_pi).mean()
        self.actor_optimizer.zero_grad(set_to_none=True)
        actor_loss.backward(inputs=self._actor_params)
        self.guard.check("actor", actor_loss, self._actor_params)
        self.actor_optimizer.step()

        # Temperature: raise alpha when entropy is below target, lower it when above.
        alpha_loss = torch.zeros((), device=self.device)
        if self.autotune:
            entropy_gap = log_prob.detach() + self.target_entropy
            if self.strategy.PARALLEL:  # every rank's samples: the same temperature step everywhere
                entropy_gap = self.strategy.mean(entropy_gap.mean())
            alpha_loss = -(self.log_alpha * entropy_gap).mean()
            self.alpha_optimizer.zero_grad(set_to_none=True)
            alpha_loss.backward()
            self.guard.check("alpha", alpha_loss, [self.log_alpha])
            self.alpha_optimizer.step()

        # Targets move a fraction tau towards the online critics.
        with torch.no_grad():
            torch._foreach_lerp_(list(q_target.parameters()), list(q.parameters()), self.tau)
        return torch.stack([critic_loss.detach(), actor_loss.detach(), alpha_loss.detach(), alpha,
                            q_values.detach().mean(), -log_prob.detach().mean()])
