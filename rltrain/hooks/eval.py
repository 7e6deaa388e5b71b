"""Evaluates the learner's policy deterministically (mean action / argmax) on separate envs."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch
from torch import nn

from rltrain.envs import BatchedEnv
from rltrain.hooks.base import Hook


class EvalHook(Hook):
    """Runs ``episodes`` episodes on its schedule (if ``every`` is set) and at the end of the run.

    Logs ``eval/return`` and ``eval/episode_length``; the final mean becomes ``eval_return`` in
    summary.json.
    """

    phase = "eval"

    def __init__(
        self,
        policy: nn.Module,
        make_env: Callable[..., BatchedEnv],
        device: torch.device | str = "cpu",
        episodes: int = 10,
        every: Mapping[str, float] | None = None,
        at_end: bool = True,
        max_steps: int = 100_000,
    ):
        super().__init__(every)
        self.enabled = every is not None
        self.policy, self.make_env, self.device = policy, make_env, torch.device(device)
        self.episodes, self.at_end, self.max_steps = episodes, at_end, max_steps
        self._env: BatchedEnv | None = None

    def on_update(self, state) -> None:
        if self.enabled:
            self.evaluate(state)

    def on_end(self, state) -> None:
        if self.at_end:
            self.evaluate(state)

    def evaluate(self, state) -> float:
        """One episode per eval env, deterministic actions; returns the mean episode return."""
        if self._env is None:
            self._env = self.make_env(num_envs=self.episodes)
        env = self._env
        returns = np.zeros(env.num_envs)
        lengths = np.zeros(env.num_envs, dtype=np.int64)
        running = np.ones(env.num_envs, dtype=bool)
        obs = env.reset()
        was_training = self.policy.training
        self.policy.eval()
        with torch.inference_mode():
            for _ in range(self.max_steps):
                action, _ = self.policy.act(torch.from_numpy(obs).to(self.device), deterministic=True)
                _, reward, terminated, truncated, obs = env.step(action.cpu().numpy())
                returns += reward * running
                lengths += running
                running &= ~(terminated | truncated)
                if not running.any():
                    break
        self.policy.train(was_training)
        state.eval_return = float(returns.mean())
        state.window.add({"eval/return": state.eval_return, "eval/episode_length": float(lengths.mean())})
        return state.eval_return

    def close(self, state, summary) -> None:
        if self._env is not None:
            self._env.close()
