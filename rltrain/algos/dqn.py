"""DQN (Mnih et al. 2015) with its common improvements as keys: double Q-learning (van Hasselt et al. 2016), a
dueling head (``algo.network.dueling``), n-step returns, a target network updated by a hard copy every N gradient
steps or by Polyak averaging, and epsilon-greedy exploration by one schedule or Ape-X's per-env rates.

Read top to bottom: hyperparameters; ``update`` turns a collector batch into n-step transitions, stores them in the
replay buffer SAC uses and, after ``warmup_frames``, runs ``utd`` gradient steps per collected frame. Each gradient
step: the (double) Q target from the target network, the Huber loss, a clipped Adam step; every
``target_update_interval`` steps the target moves ``tau`` of the way to the online network (1.0: a copy). The
exploration rates live in the policy's buffers, so they reach collectors with the weights (``QNetwork``).

n-step returns are summed inside each collector batch: a transition fewer than n steps before its batch's end (or
its episode's) takes the steps there are and bootstraps with gamma to that power (``dqn/n_step`` logs the mean), so
``collector.frames_per_batch / env.num_envs`` well above ``n_step`` keeps most of them whole.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated

import torch
from torch import nn

from rltrain.algos import optimizers
from rltrain.algos.finite import NonFinite, NonFiniteGuard
from rltrain.algos.networks import QNetwork
from rltrain.algos.replay_steps import GradientSteps, mean_metrics
from rltrain.algos.update_step import Switch, UpdateStep, compile_enabled, cuda_graph_enabled, plain
from rltrain.data import ReplayBuffer
from rltrain.data.replay import check_capacity
from rltrain.device import to_learner
from rltrain.errors import ConfigError
from rltrain.rules import Flag, Fraction, NonNegativeInt, OneOf, PositiveFraction, PositiveInt, PositiveNumber
from rltrain.strategies import Single, Strategy

if TYPE_CHECKING:
    from tensordict import TensorDict

_BATCH_KEYS = ["observation", "action", "reward", "terminated", "truncated", ("next", "observation")]
Exploration = Annotated[str, OneOf(("schedule", "per_env"), "schedule (one epsilon, decayed) or per_env (Ape-X)")]


class DQN:
    """The learner side of DQN: the online Q-network (the policy), its target copy, Adam, the replay buffer."""

    ACTION_SPACES = ("discrete",)
    OBSERVATIONS = ("vector", "discrete", "multi_discrete", "image")
    NEEDS_PUSHES = ("the exploration rate and the end of the warm-up reach collectors through weight pushes, so they "
                    "would act at random for the whole run")
    DATA_PARALLEL = ("batch_size", "buffer_size")  # strategy=ddp: as SAC (its own buffer, its share of a minibatch)
    RANK_STATE = ("replay_buffer",)

    @classmethod
    def check_config(cls, values: dict, config: dict) -> None:
        """The replay buffer holds a gradient step's frames and a collector batch; the schedule's ends are in order."""
        check_capacity(values, config)
        if values["epsilon_end"] > values["epsilon_start"]:
            raise ConfigError(f"algo.epsilon_end ({values['epsilon_end']}) is above algo.epsilon_start "
                              f"({values['epsilon_start']}): the schedule decays from start to end; swap them")

    def __init__(
        self,
        policy: QNetwork,
        total_frames: int,
        device: torch.device | str = "cpu",
        strategy: Strategy = Single(),
        lr: PositiveNumber = 1e-4,  # Adam's learning rate
        gamma: PositiveFraction = 0.99,  # discount factor
        batch_size: PositiveInt = 32,  # transitions per gradient step
        utd: PositiveNumber = 0.25,  # gradient steps per collected frame (SB3's train_freq 4, gradient_steps 1)
        warmup_frames: NonNegativeInt = 1000,  # frames of uniformly random actions before learning starts
        buffer_size: PositiveInt = 1_000_000,  # replay capacity in transitions
        double: Flag = True,  # double Q-learning: the online network picks the next action, the target values it
        n_step: PositiveInt = 1,  # steps of reward summed before bootstrapping (within a collector batch)
        target_update_interval: PositiveInt = 1000,  # gradient steps between target updates
        tau: PositiveFraction = 1.0,  # each target update: target += tau * (online - target); 1.0 is a copy
        exploration: Exploration = "schedule",  # schedule | per_env (Ape-X: each env its own fixed epsilon)
        epsilon_start: Fraction = 1.0,  # schedule: epsilon at the start, decayed linearly ...
        epsilon_end: Fraction = 0.05,  # ... to this
        exploration_fraction: Fraction = 0.1,  # ... over this fraction of trainer.total_frames
        per_env_epsilon: Fraction = 0.4,  # per_env: env k explores with per_env_epsilon ** (1 + per_env_alpha * u_k),
        per_env_alpha: PositiveNumber = 7.0,  # u_k spread evenly over [0, 1) (Ape-X's 0.4 and 7)
        max_grad_norm: PositiveNumber = 10.0,  # global gradient-norm clip
        sign_reward: Flag = False,  # set from env.sign_reward: learn from sign(reward) (Atari's reward clipping)
        nonfinite: NonFinite = "error",  # a NaN/inf loss or gradient: error stops the run; skip skips that step
        compile: Switch = "auto",  # torch.compile each gradient step; auto: on a CUDA learner only
        cuda_graph: Switch = "auto",  # replay each gradient step as one CUDA graph; auto: on a CUDA learner
    ):
        self.policy, self.device, self.total_frames = policy, torch.device(device), total_frames
        self.strategy = strategy
        batch_size, buffer_size = batch_size // strategy.size, buffer_size // strategy.size
        self.gamma, self.batch_size = gamma, batch_size
        self.double, self.n_step, self.max_grad_norm, self.sign_reward = double, n_step, max_grad_norm, sign_reward
        self.target_update_interval, self.tau = target_update_interval, tau
        self.epsilon_start, self.epsilon_end = epsilon_start, epsilon_end
        self.decay_frames = exploration_fraction * total_frames
        self.per_env = exploration == "per_env"
        if self.per_env:
            policy.ladder.copy_(torch.tensor([per_env_epsilon, per_env_alpha]))
        self.target = copy.deepcopy(policy).requires_grad_(False)
        # What a target update moves: every float tensor of the state (weights and observation statistics).
        online, target = policy.state_dict(keep_vars=True), self.target.state_dict(keep_vars=True)
        floats = [key for key, value in target.items() if value.is_floating_point()]
        self._online_tensors = [online[key].detach() for key in floats]
        self._target_tensors = [target[key].detach() for key in floats]
        self._online = strategy.wrap(policy, "forward")  # the loss's gradients averaged over the ranks
        graphed = cuda_graph_enabled(cuda_graph, self.device) and not strategy.PARALLEL
        compiled = compile_enabled(compile, self.device) and not strategy.PARALLEL
        self.optimizer = optimizers.adam(policy.parameters(), lr, self.device, graphed)
        self.guard = NonFiniteGuard({"q": self.optimizer}, nonfinite, self.device)
        self._params = list(policy.parameters())
        self.buffer = ReplayBuffer(buffer_size, self.device)
        self._run = UpdateStep(self._gradient_step, "DQN's gradient step", compiled, graphed, batch_size)
        self.steps = GradientSteps(self.buffer, utd, warmup_frames, strategy.size)
        self.updates = 0  # gradient steps taken (the target's clock)
        self._mean_n = 0.0  # the steps summed per transition of the last batch stored
        self._set_epsilon()

    def state_dict(self, replay_buffer: bool = True) -> dict:
        """Online and target networks (the policy's buffers hold the exploration rates), Adam, counters and
        (optionally) the replay buffer."""
        state = {
            "policy": self.policy.state_dict(),
            "target": self.target.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "updates": self.updates,
            "mean_n": self._mean_n,
            "nonfinite": self.guard.state_dict(),
            **self.steps.state_dict(replay_buffer),  # counters, and the buffer with the steps still owed
        }
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``; without a saved buffer, learning goes on from an empty one."""
        self.policy.load_state_dict(state["policy"])
        self.target.load_state_dict(state["target"])
        optimizers.load_adam(self.optimizer, state["optimizer"])
        self.steps.load_state_dict(state)
        self.updates, self._mean_n = state["updates"], state["mean_n"]
        self.guard.load_state_dict(state["nonfinite"])

    def update(self, batch: TensorDict | None, should_stop: Callable[[], bool] = lambda: False) -> dict | None:
        """Store ``batch``'s n-step transitions, then run the gradient steps it is owed; returns the mean metrics.

        Returns None if ``should_stop()`` turned true between two gradient steps; ``update(None)`` (after a resume
        from ``state_dict``) then runs the steps still owed.
        """
        if batch is not None:
            self._store(batch)
        taken = self.steps.take(self._step, should_stop)
        if taken is None:
            return None
        metrics = {"dqn/buffer_frames": len(self.buffer), "dqn/epsilon": float(self.policy.epsilon),
                   "dqn/n_step": self._mean_n}
        if mean := mean_metrics(taken):
            metrics |= {"loss/q": mean[0], "dqn/q": mean[1]}
        if skipped := self.guard.report():
            metrics["nonfinite/skipped_steps"] = skipped
        return metrics

    def _store(self, batch: TensorDict) -> None:
        """Add ``batch``'s transitions to the replay buffer and count the gradient steps it is owed (none in
        warm-up). The exploration rate the next push carries follows the frames collected."""
        batch = to_learner(batch, _BATCH_KEYS, self.device)
        if self.sign_reward:
            batch["reward"] = batch["reward"].sign()
        transitions = n_step_transitions(batch, self.n_step, self.gamma)
        self._mean_n = float(transitions["steps"].float().mean())
        self.buffer.extend(transitions.exclude("steps"))
        self.steps.collected(batch.numel())
        self.policy.encoder.update(batch["observation"], self.strategy.moments)
        self._set_epsilon()

    def _set_epsilon(self) -> None:
        """The policy's ``epsilon`` for the frames so far: 1 in the warm-up; then the schedule's linear decay, or 0
        with per-env rates (each env's own rung of the ladder, ``QNetwork.exploration``)."""
        if self.steps.warming_up:
            epsilon = 1.0
        elif self.per_env:
            epsilon = 0.0
        else:
            done = min(1.0, self.steps.frames / self.decay_frames) if self.decay_frames else 1.0
            epsilon = self.epsilon_start + done * (self.epsilon_end - self.epsilon_start)
        self.policy.epsilon.fill_(epsilon)

    def _step(self) -> torch.Tensor:
        """One gradient step on a fresh minibatch, then the target's update when it is due; its metrics."""
        b = self.buffer.sample(self.batch_size)
        metrics = self._run(plain(b["observation"]), b["action"].long(), b["reward"], b["discount"],
                            plain(b["next", "observation"]))
        self.updates += 1
        if self.updates % self.target_update_interval == 0:
            self._update_target()
        return metrics

    @torch.no_grad()
    def _update_target(self) -> None:
        """The target network (parameters and statistics) a fraction ``tau`` of the way to the online one."""
        if self.tau == 1.0:
            torch._foreach_copy_(self._target_tensors, self._online_tensors)
        else:
            torch._foreach_lerp_(self._target_tensors, self._online_tensors, self.tau)

    def _gradient_step(self, obs, action: torch.Tensor, reward: torch.Tensor, discount: torch.Tensor,
                       next_obs) -> torch.Tensor:
        """One Adam step on the Huber loss between Q(obs, action) and the n-step target; returns (loss, mean Q).
        Compiled and replayed as a CUDA graph when so configured (``UpdateStep``)."""
        with torch.no_grad():
            next_q = self.target(next_obs)
            if self.double:  # the online network chooses, the target network values
                next_action = self.policy(next_obs).argmax(-1, keepdim=True)
            else:
                next_action = next_q.argmax(-1, keepdim=True)
            target = reward + discount * next_q.gather(-1, next_action).squeeze(-1)
        q = self._online(obs).gather(-1, action.unsqueeze(-1)).squeeze(-1)
        loss = nn.functional.smooth_l1_loss(q, target)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(self._params, self.max_grad_norm, foreach=True)
        self.guard.check("q", loss, grad_norm=grad_norm)  # a NaN/inf step is skipped
        self.optimizer.step()
        return torch.stack([loss.detach(), q.detach().mean()])


def n_step_transitions(batch: TensorDict, n: int, gamma: float) -> TensorDict:
    """A ``[T, N]`` batch of frames as ``[T, N]`` transitions of up to ``n`` steps each: the discounted sum of the
    rewards from each frame on, until its episode ends or the batch does; the observation after the last of those
    steps; ``discount``, gamma to the number of steps, or 0 where the episode terminated (a truncated one
    bootstraps from its true final observation); and ``steps``, how many were summed."""
    reward, terminated = batch["reward"], batch["terminated"]
    done = terminated | batch["truncated"]
    steps_in_batch = reward.shape[0]
    t = torch.arange(steps_in_batch, device=reward.device).unsqueeze(1).expand(reward.shape)
    total = torch.zeros_like(reward)
    scale = torch.ones_like(reward)  # gamma ** k for the k-th step
    last = t.clone()
    ended = torch.zeros_like(done)  # the episode ended at an earlier step
    ended_terminal = torch.zeros_like(done)
    for k in range(n):
        index = t + k
        live = ~ended & (index < steps_in_batch)
        index = index.clamp(max=steps_in_batch - 1)
        total = total + torch.where(live, scale * reward.gather(0, index), 0.0)
        last = torch.where(live, index, last)
        scale = torch.where(live, scale * gamma, scale)
        step_done = done.gather(0, index)
        ended_terminal |= live & terminated.gather(0, index)
        ended |= live & step_done
    columns = torch.arange(reward.shape[1], device=reward.device).expand(reward.shape)
    steps = last - t + 1
    next_obs = batch["next", "observation"] if n == 1 else batch["next", "observation"][last, columns]
    # a TensorDict, made as the batch's own type: worker processes import this module and never load tensordict
    return type(batch)({"observation": batch["observation"], "action": batch["action"], "reward": total,
                       "discount": torch.where(ended_terminal, 0.0, scale), "next": {"observation": next_obs},
                       "steps": steps}, batch_size=reward.shape)

