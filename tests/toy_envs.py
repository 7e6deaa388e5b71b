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
    """CartPole-shaped env that misbehaves at its ``at_step``-th step: raise, os._exit, or hang
    (with ``rank``, only in that rank of a torchrun job)."""

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
