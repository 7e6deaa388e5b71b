"""Evaluates the learner's policy on separate envs: deterministically (mean action / argmax), or
sampling its actions (``deterministic: false``, for games where the argmax can stall, e.g. Atari)."""

from __future__ import annotations

import functools
import logging
import signal
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from rltrain.algos.recurrent import Memory
from rltrain.envs import BatchedEnv
from rltrain.envs.action_masks import refuse_empty
from rltrain.envs.spaces import MASK_KEY, to_torch
from rltrain.hooks.base import Every, Hook
from rltrain.rules import Flag, PositiveInt
from rltrain.state import TrainState
from rltrain.stop_signals import StopRequested

log = logging.getLogger("rltrain")


class Evaluation(Hook):
    """What every evaluation hook shares: ``evaluate(state)`` on the schedule and at the end, never
    twice at one frame count (a scheduled one, then at_end's), and its result recorded the same way
    (``record``), which checkpoints keep (``evaluated_at``)."""

    phase = "eval"

    def __init__(self, every: Every = None, at_end: Flag = True):
        super().__init__(every, at_end)
        self._evaluated_at: int | None = None  # frames of the latest evaluation

    def on_update(self, state: TrainState) -> None:
        if self._evaluated_at != state.frames:
            self.evaluate(state)

    def evaluate(self, state: TrainState) -> float:
        """Evaluate the learner's policy, ``record`` the result and return its mean return."""
        raise NotImplementedError

    def record(self, state: TrainState, mean_return: float, metrics: dict[str, float]) -> float:
        """The evaluation's mean return (summary.json's ``eval_return``) and its other ``eval/`` metrics,
        as the latest values, not a mean over the log row: the last row and summary.json agree."""
        self._evaluated_at = state.frames
        state.evals.add(mean_return)
        state.window.set({"eval/return": mean_return, **metrics})
        return mean_return

    def state_dict(self) -> dict:
        return {"evaluated_at": self._evaluated_at}

    def load_state_dict(self, state: dict) -> None:
        self._evaluated_at = state["evaluated_at"]


class EvalHook(Evaluation):
    """Runs ``episodes`` episodes on its schedule (``every``; null: never) and at the end of the run (``at_end``).

    Logs ``eval/return`` and ``eval/episode_length``; the final mean becomes ``eval_return`` in
    summary.json. ``video``: also record one deterministic episode per evaluation to
    ``<run_dir>/videos/eval-frames_<N>-episode-0.mp4`` with gymnasium's RecordVideo (needs
    moviepy and the env's renderer: ``pip install 'rltrain[video]'``).
    """

    def __init__(
        self,
        policy: nn.Module,
        make_env: Callable[..., BatchedEnv],
        device: torch.device | str = "cpu",
        episodes: PositiveInt = 10,
        every: Every = None,
        at_end: Flag = True,
        max_steps: PositiveInt = 100_000,
        video: Flag = False,
        run_dir: str | Path = ".",
        deterministic: Flag = True,
    ):
        super().__init__(every, at_end)
        self.policy, self.make_env, self.device = policy, make_env, torch.device(device)
        self.episodes, self.max_steps = episodes, max_steps
        self.video, self.video_dir = video, Path(run_dir) / "videos"
        self.deterministic = deterministic
        self._env: BatchedEnv | None = None

    def evaluate(self, state: TrainState) -> float:
        """One episode per eval env; returns the mean episode return. A stop request (SIGINT,
        SIGTERM) ends it within one env step: StopRequested, nothing recorded."""
        if self._env is None:
            self._env = self.make_env(num_envs=self.episodes)
        stop = functools.partial(raise_if_stopping, state)
        returns, lengths = self._run_episodes(self._env, stop)
        if self.video:  # before anything is recorded: a stop request may end it too
            self._record(state.frames, stop)
        return self.record(state, float(returns.mean()), {"eval/episode_length": float(lengths.mean())})

    def _run_episodes(self, env: BatchedEnv, stop: Callable[[], None]) -> tuple[np.ndarray, np.ndarray]:
        """One episode in each of ``env``'s envs: (returns, lengths); ``stop()`` before each step
        raises to end it early."""
        returns = np.zeros(env.num_envs)
        lengths = np.zeros(env.num_envs, dtype=np.int64)
        running = np.ones(env.num_envs, dtype=bool)
        obs = env.reset()
        memory = Memory(self.policy, env.num_envs)  # a policy with memory acts from its state (one episode per env)
        was_training = self.policy.training
        self.policy.eval()
        try:
            with torch.inference_mode():
                for _ in range(self.max_steps):
                    stop()
                    if env.spec.masked:
                        refuse_empty(obs[MASK_KEY], env.spec.action.nvec, env.id, lengths)
                    action, _ = memory.act(to_torch(obs, self.device), deterministic=self.deterministic)
                    _, reward, terminated, truncated, obs = env.step(action.cpu().numpy())
                    returns += reward * running
                    lengths += running
                    running &= ~(terminated | truncated)
                    if not running.any():
                        break
        finally:
            self.policy.train(was_training)
        return returns, lengths

    def _record(self, frames: int, stop: Callable[[], None]) -> None:
        from gymnasium.wrappers import RecordVideo

        env = self.make_env(num_envs=1, render_mode="rgb_array")
        with warnings.catch_warnings():  # "overwriting existing videos": each file has its own name
            warnings.simplefilter("ignore")
            env.envs[0] = RecordVideo(env.envs[0], str(self.video_dir), episode_trigger=lambda episode: episode == 0,
                                      name_prefix=f"eval-frames_{frames:012d}", disable_logger=True)
        try:
            self._run_episodes(env, stop)
        finally:
            env.close()  # writes the file
        log.info("eval video: %s", next(self.video_dir.glob(f"eval-frames_{frames:012d}*"), self.video_dir))

    def close(self, state: TrainState, summary) -> None:
        if self._env is not None:
            self._env.close()


def raise_if_stopping(state: TrainState) -> None:
    """An evaluation's check between two of its steps: StopRequested once SIGINT or SIGTERM asked the
    run to stop (every evaluation hook asks it)."""
    if state.stop_signal is not None:
        raise StopRequested(f"evaluation stopped by {signal.Signals(state.stop_signal).name}")
