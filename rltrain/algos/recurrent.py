"""A policy's memory: an LSTM or GRU core between the observation encoder and the actor and critic layers
(``algo.network.recurrent``), and how PPO's update cuts a batch into sequences for it.

Acting, the core takes one step per env step from the state the env's last step left (zeros where an episode
starts); the collector stores, with each frame, the state the policy acted from, and the update starts each
training sequence from the stored state of its first step, resetting at every episode start inside it, so the
learner sees what the actor saw. A state travels as one float tensor per env, ``[N, state_size]``: an LSTM's
hidden and cell states side by side, a GRU's hidden state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated

import torch
from torch import nn

from rltrain.rules import OneOf

KINDS = {"lstm": nn.LSTM, "gru": nn.GRU}
Kind = Annotated[str | None, OneOf((*KINDS, None), "lstm, gru or null (no memory: a feed-forward network)")]


class RecurrentCore(nn.Module):
    """One LSTM or GRU layer of ``size`` units over ``in_dim`` features; ``state_size`` floats of state per env."""

    def __init__(self, kind: str, in_dim: int, size: int):
        super().__init__()
        self.rnn = KINDS[kind](in_dim, size)
        self.lstm, self.size = kind == "lstm", size
        self.state_size = 2 * size if self.lstm else size
        for name, param in self.rnn.named_parameters():  # as CleanRL's and sb3-contrib's recurrent agents
            if name.startswith("weight"):
                nn.init.orthogonal_(param, 1.0)
            else:
                nn.init.zeros_(param)

    def initial_state(self, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.zeros(n, self.state_size, device=device)

    def step(self, x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One step for a batch: ``x [B, in_dim]``, ``state [B, state_size]`` -> (output ``[B, size]``, next state)."""
        out, state = self.rnn(x.unsqueeze(0), self._split(state))
        return out.squeeze(0), self._join(state)

    def unroll(self, x: torch.Tensor, state: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        """Outputs ``[L, B, size]`` for sequences ``x [L, B, in_dim]`` from ``state [B, state_size]``, each row's
        state zeroed before the steps where ``starts [L, B]`` says an episode begins. Runs of steps without a
        start go through the RNN in one call (one cuDNN kernel on a GPU)."""
        cuts = [0, *(starts[1:].any(1).nonzero().flatten() + 1).tolist(), x.shape[0]]
        outs = []
        for begin, end in zip(cuts[:-1], cuts[1:]):
            if begin:
                state = state * (~starts[begin]).unsqueeze(-1).to(state.dtype)
            out, carried = self.rnn(x[begin:end], self._split(state))
            state = self._join(carried)
            outs.append(out)
        return torch.cat(outs)

    def _split(self, state: torch.Tensor):
        state = state.unsqueeze(0).contiguous()  # [1 layer, B, ...]
        return tuple(state.chunk(2, -1)) if self.lstm else state

    def _join(self, state) -> torch.Tensor:
        return torch.cat(state, -1).squeeze(0) if self.lstm else state.squeeze(0)


@dataclass
class Sequences:
    """How a ``[T, N]`` batch is laid out as training sequences of ``length`` steps: ``K = ceil(T / length)`` windows
    per env column, the last padded at its end, as ``[length, K * N]`` tensors (window-major)."""

    steps: int
    envs: int
    length: int

    @property
    def windows(self) -> int:
        return math.ceil(self.steps / self.length)

    @property
    def count(self) -> int:
        return self.windows * self.envs

    def lay_out(self, x):
        """A ``[T, N, ...]`` tensor (or Dict observation's TensorDict) as ``[length, K * N, ...]``, zero padded."""
        if pad := self.windows * self.length - self.steps:
            x = torch.cat([x, torch.zeros_like(x[:1]).expand(pad, *x.shape[1:])])
        return x.reshape(self.windows, self.length, *x.shape[1:]).transpose(0, 1).flatten(1, 2)

    def valid(self, device) -> torch.Tensor:
        """``[length, K * N]``: True where a step holds a frame, False on padding."""
        return self.lay_out(torch.ones(self.steps, self.envs, dtype=torch.bool, device=device))

    def first_states(self, states: torch.Tensor) -> torch.Tensor:
        """``[K * N, state_size]``: the stored state of each window's first step (``states [T, N, state_size]``)."""
        return states[::self.length].flatten(0, 1)

    def starts(self, done: torch.Tensor) -> torch.Tensor:
        """``[length, K * N]``: where an episode starts inside a window (after a ``done`` step); a window's first step
        starts from its stored state, which the actor already reset."""
        starts = torch.zeros_like(done)
        starts[1:] = done[:-1]
        starts[::self.length] = False
        return self.lay_out(starts)



class Memory:
    """What a policy remembers of ``n`` envs while it acts in them: ``act`` as the policy's own, carrying each env's
    state from step to step for a network with memory (``state_size > 0``; any other policy acts as it is). A policy
    that acts per env (``ACTS_PER_ENV``: DQN's per-env exploration) is told each row's env index, ``first_env`` on."""

    def __init__(self, policy: nn.Module, n: int, first_env: int = 0):
        self.policy = policy
        self.state = policy.initial_state(n) if state_size(policy) else None
        self.envs = torch.arange(first_env, first_env + n) if getattr(policy, "ACTS_PER_ENV", False) else None

    def act(self, obs, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        if self.envs is not None:
            return self.policy.act(obs, deterministic=deterministic, envs=self.envs)
        if self.state is None:
            return self.policy.act(obs, deterministic=deterministic)
        action, log_prob, self.state = self.policy.act_in_state(obs, self.state, deterministic)
        return action, log_prob

    def forget(self, ended) -> None:
        """Zero the state of the envs where ``ended`` (a bool array, one per env): their next step starts an episode."""
        if self.state is not None and ended.any():
            self.state[torch.as_tensor(ended, device=self.state.device)] = 0.0


def state_size(policy: nn.Module) -> int:
    """Floats of memory per env that ``policy`` carries while it acts (0: none; any policy without ``state_size``)."""
    return getattr(policy, "state_size", 0)
