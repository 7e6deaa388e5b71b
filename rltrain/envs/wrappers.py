"""Gymnasium wrappers of rltrain's own, for ``env.wrappers`` (``{wrapper: rltrain.envs.wrappers.NAME, ...}``)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np


class KeepIndices(gym.ObservationWrapper):
    """Only the entries ``indices`` of a flat Box observation: a partially observed version of an env, as RL-Zoo's
    CartPoleNoVel (CartPole with only the cart's position and the pole's angle: ``indices: [0, 2]``)."""

    def __init__(self, env: gym.Env, indices: list[int]):
        super().__init__(env)
        space = env.observation_space
        if not isinstance(space, gym.spaces.Box) or len(space.shape) != 1:
            raise ValueError(f"KeepIndices takes a flat Box observation, not {space}")
        if not indices or any(not 0 <= i < space.shape[0] for i in indices):
            raise ValueError(f"indices {list(indices)} must be entries of the observation's {space.shape[0]}")
        self._indices = np.asarray(indices)
        self.observation_space = gym.spaces.Box(space.low[self._indices], space.high[self._indices],
                                                dtype=space.dtype)

    def observation(self, observation):
        return observation[self._indices]
