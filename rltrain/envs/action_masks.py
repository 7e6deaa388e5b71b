"""Which actions are valid, in the two conventions envs use: a Dict observation's ``action_mask`` key (PettingZoo's
and Gymnasium's), and an ``action_masks()`` method (sb3-contrib's ``MaskablePPO``), whose masks ``MaskInObservation``
moves into the observation, so that both reach the policy the same way, from worker processes and collector ranks
too. And the one check a mask gets at every step: it must leave the env some action.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np

from rltrain.envs.spaces import MASK_KEY
from rltrain.errors import EnvError

METHOD = "action_masks"  # sb3-contrib's convention: env.action_masks() -> one bool per action (MultiDiscrete: flat)


def masks_method(env: gym.Env):
    """The env's ``action_masks`` method (on the env or any wrapper of it), or None."""
    try:
        method = env.get_wrapper_attr(METHOD)
    except AttributeError:
        return None
    return method if callable(method) else None


class MaskInObservation(gym.ObservationWrapper):
    """An env with an ``action_masks()`` method, its mask read after every reset and step into the observation's
    ``action_mask`` key: a Dict observation gains the key; any other becomes ``{"observation": ..., "action_mask":
    ...}``. rltrain applies it by itself to an env that has the method (``make_gym_env``)."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self._masks = masks_method(env)
        # One per action (MultiDiscrete: each entry's values one after another); the shape check of spaces.py then
        # refuses an action space that takes no mask.
        actions = env.action_space
        size = int(np.sum(actions.nvec)) if isinstance(actions, gym.spaces.MultiDiscrete) else \
            int(getattr(actions, "n", np.prod(actions.shape or (1,))))
        mask_space = gym.spaces.Box(0, 1, shape=(size,), dtype=np.int8)
        inner = env.observation_space
        if isinstance(inner, gym.spaces.Dict):
            if MASK_KEY in inner.spaces:
                raise ValueError(f"the env has both an {METHOD}() method and an observation key {MASK_KEY!r}: "
                                 "keep one")
            self.observation_space = gym.spaces.Dict({**inner.spaces, MASK_KEY: mask_space})
        else:
            self.observation_space = gym.spaces.Dict({"observation": inner, MASK_KEY: mask_space})
        self._dict = isinstance(inner, gym.spaces.Dict)

    def observation(self, observation):
        mask = np.asarray(self._masks(), dtype=np.int8)
        return {**observation, MASK_KEY: mask} if self._dict else {"observation": observation, MASK_KEY: mask}


def refuse_empty(mask: np.ndarray, nvec: tuple[int, ...], env_id: str, episode_steps: np.ndarray) -> None:
    """An EnvError naming the envs (and the step of their episode) whose ``mask`` (``[envs, sum(nvec)]``) leaves
    some entry of the action no valid value: there is nothing the policy could send."""
    allowed = np.split(mask != 0, np.cumsum(nvec)[:-1], axis=-1)
    stuck = np.flatnonzero(np.stack([part.any(-1) for part in allowed], -1).all(-1) == 0)
    if stuck.size:
        where = ", ".join(f"env {i} at step {int(episode_steps[i])} of its episode" for i in stuck[:4])
        raise EnvError(f"env.id={env_id!r} gave an {MASK_KEY!r} that allows no action ({where}"
                       f"{', ...' if stuck.size > 4 else ''}; for MultiDiscrete, some entry had no valid value): "
                       "every observation the policy acts on must allow at least one action")
