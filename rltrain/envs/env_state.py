"""The full state of a gymnasium env as bytes, so a resumed run continues mid-episode.

Plain Python envs (classic control, most user envs) and their wrappers pickle with everything
in them: physics state, step counters, the env's random generator. MuJoCo envs pickle only
their constructor arguments (gymnasium's EzPickle), so their simulator state goes alongside:
MuJoCo's own integration state (``mj_getState``, everything the next step depends on) and the
env's generator. Other EzPickle envs (Box2D) cannot be captured: ``capture`` returns None, and
the caller resets them instead.
"""

from __future__ import annotations

import pickle

import gymnasium as gym
import numpy as np


def capture(env: gym.Env) -> bytes | None:
    """The env's state, or None if this env cannot be captured (say, it holds a lock or a socket)."""
    base = env.unwrapped
    state = {"env": env, "base_rng": None, "mujoco": None}
    try:
        if isinstance(base, gym.utils.EzPickle):
            if not _is_mujoco(base):
                return None
            import mujoco

            spec = mujoco.mjtState.mjSTATE_INTEGRATION
            physics = np.empty(mujoco.mj_stateSize(base.model, spec))
            mujoco.mj_getState(base.model, base.data, physics, spec)
            state["mujoco"] = physics
            state["base_rng"] = base.np_random.bit_generator.state
        return pickle.dumps(state)
    except Exception:  # noqa: BLE001  (pickle fails in many ways: TypeError, PicklingError, AttributeError)
        return None


def restore(blob: bytes) -> gym.Env:
    """A new env in the state ``capture`` saved."""
    state = pickle.loads(blob)  # noqa: S301  (a checkpoint is trusted like the code that wrote it)
    env = state["env"]
    if state["mujoco"] is not None:
        import mujoco

        base = env.unwrapped
        mujoco.mj_setState(base.model, base.data, state["mujoco"], mujoco.mjtState.mjSTATE_INTEGRATION)
        mujoco.mj_forward(base.model, base.data)
        base.np_random.bit_generator.state = state["base_rng"]
    return env


def _is_mujoco(env: gym.Env) -> bool:
    try:
        from gymnasium.envs.mujoco.mujoco_env import MujocoEnv
    except ImportError:  # mujoco not installed: nothing can be a MuJoCo env
        return False
    return isinstance(env, MujocoEnv)
