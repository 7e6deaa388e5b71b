"""Tiny gymnasium envs for tests, registered on import (``env.id=tests.toy_envs:Counting-v0``)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
from gymnasium.envs.classic_control import CartPoleEnv


class CountingEnv(gym.Env):
    """Observation = steps taken in the episode; reward 1 per step; never terminates on its own,
    so every episode ends by truncation (TimeLimit, max_episode_steps=5)."""

    observation_space = gym.spaces.Box(0.0, 1000.0, shape=(1,), dtype=np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.array([0.0], dtype=np.float32), {}

    def step(self, action):
        self.t += 1
        return np.array([float(self.t)], dtype=np.float32), 1.0, False, False, {}


gym.register("Counting-v0", entry_point=CountingEnv, max_episode_steps=5)


class RecordActionEnv(gym.Env):
    """A 2-D Box action in [-1, 1] that the env records exactly as it receives it."""

    observation_space = gym.spaces.Box(-1.0, 1.0, shape=(3,), dtype=np.float32)
    action_space = gym.spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)

    def __init__(self):
        self.received = []

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(3, dtype=np.float32), {}

    def step(self, action):
        self.received.append(np.array(action, copy=True))
        return np.zeros(3, dtype=np.float32), 0.0, False, False, {}


gym.register("RecordAction-v0", entry_point=RecordActionEnv, max_episode_steps=1000)


class FaultyEnv(gym.Env):
    """CartPole-shaped env that misbehaves at its ``at_step``-th step: raise, os._exit, hang, or return
    an observation of the wrong shape or a reward that is not a number (with ``rank``, only in that
    rank of a torchrun job)."""

    observation_space = gym.spaces.Box(-1.0, 1.0, shape=(4,), dtype=np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, fault: str = "raise", at_step: int = 5, rank: int | None = None):
        import os

        self.fault, self.at_step, self.steps = fault, at_step, 0
        if rank is not None and os.environ.get("RANK") != str(rank):
            self.fault = "none"

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if self.fault == "raise_on_reset":
            raise RuntimeError("env could not connect to its simulator")
        return np.zeros(4, dtype=np.float32), {}

    def step(self, action):
        self.steps += 1
        if self.steps == self.at_step:
            if self.fault == "raise":
                raise RuntimeError(f"env exploded at step {self.steps}")
            if self.fault == "exit":
                import os

                os._exit(3)
            if self.fault == "hang":
                import time

                time.sleep(3600)
            if self.fault == "bad_shape":
                return np.zeros(3, dtype=np.float32), 1.0, False, False, {}
            if self.fault == "bad_reward":
                return np.zeros(4, dtype=np.float32), np.ones(2), False, False, {}
        return np.zeros(4, dtype=np.float32), 1.0, False, False, {}


gym.register("Faulty-v0", entry_point=FaultyEnv, max_episode_steps=1000)


class UnpicklableCartPole(CartPoleEnv):
    """CartPole holding a lock, as envs wrapping a simulator connection do: it cannot be pickled."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        import threading

        self.lock = threading.Lock()


gym.register("UnpicklableCartPole-v0", entry_point=UnpicklableCartPole, max_episode_steps=500)


class NonFiniteEnv(gym.Env):
    """CartPole-shaped env whose ``key`` (observation or reward; reset_observation: what reset returns) is
    ``value`` (nan, inf, -inf) at every
    ``every``-th step it takes, counted across episodes; ``reward`` is the reward of the other steps
    (1e30 is finite, but no float32 loss survives it). ``continuous``: a 1-D Box action space."""

    observation_space = gym.spaces.Box(-1.0, 1.0, shape=(4,), dtype=np.float32)

    def __init__(self, key: str = "observation", value: str = "nan", every: int = 30, reward: float = 1.0,
                 continuous: bool = False):
        self.key, self.value, self.every, self.reward, self.steps = key, float(value), every, reward, 0
        self.action_space = gym.spaces.Box(-1.0, 1.0, shape=(1,)) if continuous else gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        obs = np.zeros(4, dtype=np.float32)
        if self.key == "reset_observation":
            obs[0] = self.value
        return obs, {}

    def step(self, action):
        self.steps += 1
        obs, reward = np.zeros(4, dtype=np.float32), self.reward
        if self.every and self.steps % self.every == 0:
            if self.key == "observation":
                obs[1] = self.value
            else:
                reward = self.value
        return obs, reward, False, False, {}


gym.register("NonFinite-v0", entry_point=NonFiniteEnv, max_episode_steps=1000)


class SlowStartCartPole(CartPoleEnv):
    """CartPole that takes ``delay_s`` to start in a worker process (a simulator booting)."""

    def __init__(self, delay_s: float = 10.0, **kwargs):
        super().__init__(**kwargs)
        import multiprocessing as mp
        import time

        if mp.parent_process() is not None:
            time.sleep(delay_s)


gym.register("SlowStartCartPole-v0", entry_point=SlowStartCartPole, max_episode_steps=500)


class CatchEnv(gym.Env):
    """bsuite's Catch from pixels: a ball falls one row per step from a random column of a
    ``size`` x ``size`` grid; the agent moves its paddle on the bottom row (left, stay, right).
    Reward +1 if the paddle is under the ball when it lands, -1 if not; one ball per episode.
    Observed only as a uint8 image (0 or 255, each cell ``scale`` x ``scale`` pixels) in ``layout``
    hw, chw or hwc: nothing but pixels says where ball and paddle are. A random policy scores
    about -0.6; one that tracks the ball, +1. ``continuous``: a 1-D Box action, rounded to a move."""

    def __init__(self, size: int = 5, scale: int = 2, layout: str = "hwc", continuous: bool = False):
        self.size, self.scale, self.layout = size, scale, layout
        self.action_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32) if continuous else gym.spaces.Discrete(3)
        side = size * scale
        shape = {"hw": (side, side), "chw": (1, side, side), "hwc": (side, side, 1)}[layout]
        self.observation_space = gym.spaces.Box(0, 255, shape, dtype=np.uint8)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.ball_row, self.ball_col = 0, int(self.np_random.integers(self.size))
        self.paddle = self.size // 2
        return self._image(), {}

    def step(self, action):
        move = int(np.rint(action[0])) if isinstance(self.action_space, gym.spaces.Box) else int(action) - 1
        self.paddle = int(np.clip(self.paddle + move, 0, self.size - 1))
        self.ball_row += 1
        landed = self.ball_row == self.size - 1
        reward = (1.0 if self.paddle == self.ball_col else -1.0) if landed else 0.0
        return self._image(), reward, landed, False, {}

    def _image(self) -> np.ndarray:
        grid = np.zeros((self.size, self.size), dtype=np.uint8)
        grid[self.ball_row, self.ball_col] = 255
        grid[self.size - 1, self.paddle] = 255
        image = grid.repeat(self.scale, 0).repeat(self.scale, 1)
        return {"hw": image, "chw": image[None], "hwc": image[..., None]}[self.layout]


gym.register("Catch-v0", entry_point=CatchEnv, max_episode_steps=100)


class GoalCorridorEnv(gym.Env):
    """A Dict observation: ``position`` (a Box, the agent's cell / length) and ``goal`` (a Discrete
    cell, one-hot in the network) on a corridor of ``length`` cells; actions left / right. Reward
    +1 on reaching the goal (the episode ends), -0.05 per other step, truncated after 2 x length
    steps. Only both keys together say which way to go. Random: about 0.1; going straight there:
    about 0.9."""

    action_space = gym.spaces.Discrete(2)

    def __init__(self, length: int = 8):
        self.length = length
        self.observation_space = gym.spaces.Dict({"position": gym.spaces.Box(0.0, 1.0, (1,), np.float32),
                                                  "goal": gym.spaces.Discrete(length)})

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.position, self.goal = self.np_random.choice(self.length, size=2, replace=False).tolist()
        return self._obs(), {}

    def step(self, action):
        self.position = int(np.clip(self.position + (1 if action else -1), 0, self.length - 1))
        reached = self.position == self.goal
        return self._obs(), 1.0 if reached else -0.05, reached, False, {}

    def _obs(self) -> dict:
        return {"position": np.array([self.position / self.length], dtype=np.float32), "goal": self.goal}


gym.register("GoalCorridor-v0", entry_point=GoalCorridorEnv, max_episode_steps=16)


class MatchDigitsEnv(gym.Env):
    """MultiDiscrete actions: show ``k`` target digits (each of ``n`` values, observed as floats
    in [0, 1]); the action is ``k`` digits, rewarded by the fraction matched (MultiBinary with
    ``binary=True``: k bits). New targets every step, 10 steps per episode. Random: 10 / n per
    episode; matching every digit: 10."""

    def __init__(self, k: int = 3, n: int = 3, binary: bool = False):
        self.k, self.n = k, 2 if binary else n
        self.observation_space = gym.spaces.Box(0.0, 1.0, (k,), np.float32)
        self.action_space = gym.spaces.MultiBinary(k) if binary else gym.spaces.MultiDiscrete([n] * k)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self._draw(), {}

    def step(self, action):
        reward = float(np.mean(np.asarray(action) == self.target))
        return self._draw(), reward, False, False, {}

    def _draw(self) -> np.ndarray:
        self.target = self.np_random.integers(self.n, size=self.k)
        return (self.target / max(self.n - 1, 1)).astype(np.float32)


gym.register("MatchDigits-v0", entry_point=MatchDigitsEnv, max_episode_steps=10)


class MaskedChoiceEnv(gym.Env):
    """Each step a random half of ``n`` (4) actions is valid (``action_mask`` in a Dict observation, at least one
    valid); reward 1 for the valid action of the highest index, 0 for another valid one, and an invalid action
    raises. 8 steps an episode: the best return is 8. A policy that prefers 3, then 2, then 1, then 0 among the
    valid actions (the mask's zeros masked out) has it."""

    KEY = "action_mask"

    def __init__(self, n: int = 4):
        self.n = n
        self.action_space = gym.spaces.Discrete(n)
        self.observation_space = gym.spaces.Dict({"step": gym.spaces.Box(0.0, 8.0, shape=(1,), dtype=np.float32),
                                                  self.KEY: gym.spaces.Box(0, 1, shape=(n,), dtype=np.int8)})

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._observe(), {}

    def _observe(self):
        self.mask = np.zeros(self.n, dtype=np.int8)
        while not self.mask.any():
            self.mask = (self.np_random.random(self.n) < 0.5).astype(np.int8)
        return {"step": np.array([self.t], dtype=np.float32), self.KEY: self.mask.copy()}

    def step(self, action):
        if not self.mask[int(action)]:
            raise RuntimeError(f"invalid action {int(action)} (mask {self.mask.tolist()})")
        reward = float(int(action) == int(np.flatnonzero(self.mask).max()))
        self.t += 1
        return self._observe(), reward, False, False, {}


gym.register("MaskedChoice-v0", entry_point=MaskedChoiceEnv, max_episode_steps=8)


class UnmaskedChoiceEnv(MaskedChoiceEnv):
    """The same game, its mask under a key that masks nothing (``valid``): the policy sees it, nothing enforces it."""

    KEY = "valid"


gym.register("UnmaskedChoice-v0", entry_point=UnmaskedChoiceEnv, max_episode_steps=8)


class MaskMethodChoiceEnv(MaskedChoiceEnv):
    """The same game, its mask given by an ``action_masks()`` method (sb3-contrib's convention), not observed."""

    def __init__(self, n: int = 4):
        super().__init__(n)
        self.observation_space = self.observation_space["step"]

    def _observe(self):
        return super()._observe()["step"]

    def action_masks(self) -> np.ndarray:
        return self.mask.astype(bool)


gym.register("MaskMethodChoice-v0", entry_point=MaskMethodChoiceEnv, max_episode_steps=8)


class EmptyMaskEnv(MaskedChoiceEnv):
    """The same game, but its mask allows nothing at the 3rd step of every episode."""

    def _observe(self):
        obs = super()._observe()
        if self.t == 3:
            obs[self.KEY][:] = 0
        return obs


gym.register("EmptyMask-v0", entry_point=EmptyMaskEnv, max_episode_steps=8)


class CueMemoryEnv(gym.Env):
    """A cue shown once, asked for at the end: the first observation shows one of 2 cues (one-hot), the next
    ``delay`` are blank, and the last one asks (its third entry is 1); the answer to the question scores +1 if it
    names the cue, -1 if not, and ends the episode. Every other step scores 0, whatever the action. A policy
    without memory sees the same blank question either way: its best is chance, a mean return of 0; one that
    remembers the cue scores 1."""

    observation_space = gym.spaces.Box(0.0, 1.0, shape=(3,), dtype=np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, delay: int = 4):
        self.delay = delay

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t, self.cue = 0, int(self.np_random.integers(2))
        return np.eye(3, dtype=np.float32)[self.cue], {}

    def step(self, action):
        self.t += 1
        if self.t <= self.delay:
            obs = np.zeros(3, dtype=np.float32)
            if self.t == self.delay:
                obs[2] = 1.0  # the question: the next action is the answer
            return obs, 0.0, False, False, {}
        return np.zeros(3, dtype=np.float32), 1.0 if int(action) == self.cue else -1.0, True, False, {}


gym.register("CueMemory-v0", entry_point=CueMemoryEnv, max_episode_steps=100)



class ConnectFourEnv(gym.Env):
    """Connect Four (6 rows, 7 columns) against a random player, who answers each move; the agent moves first.
    Observation: the 42 cells, row by row from the top (1 the agent's, -1 the other's, 0 empty); action: a column,
    which must have room (a full one raises), as ``action_masks()`` says. +1 for a win, -1 for a loss, 0 for a
    draw."""

    ROWS, COLS = 6, 7
    observation_space = gym.spaces.Box(-1.0, 1.0, shape=(42,), dtype=np.float32)
    action_space = gym.spaces.Discrete(7)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.board = np.zeros((self.ROWS, self.COLS), dtype=np.float32)
        return self.board.flatten(), {}

    def action_masks(self) -> np.ndarray:
        return self.board[0] == 0

    def _drop(self, column: int, player: float) -> bool:
        """Drop ``player``'s piece in ``column``; whether it makes four in a row."""
        row = int(np.flatnonzero(self.board[:, column] == 0).max())
        self.board[row, column] = player
        for dr, dc in ((0, 1), (1, 0), (1, 1), (1, -1)):
            count = 1
            for sign in (1, -1):
                r, c = row + sign * dr, column + sign * dc
                while 0 <= r < self.ROWS and 0 <= c < self.COLS and self.board[r, c] == player:
                    count, r, c = count + 1, r + sign * dr, c + sign * dc
            if count >= 4:
                return True
        return False

    def step(self, action):
        if self.board[0, int(action)] != 0:
            raise RuntimeError(f"invalid action {int(action)}: the column is full")
        if self._drop(int(action), 1.0):
            return self.board.flatten(), 1.0, True, False, {}
        if not (self.board[0] == 0).any():
            return self.board.flatten(), 0.0, True, False, {}
        if self._drop(int(self.np_random.choice(np.flatnonzero(self.board[0] == 0))), -1.0):
            return self.board.flatten(), -1.0, True, False, {}
        return self.board.flatten(), 0.0, not (self.board[0] == 0).any(), False, {}


gym.register("ConnectFour-v0", entry_point=ConnectFourEnv, max_episode_steps=21)
