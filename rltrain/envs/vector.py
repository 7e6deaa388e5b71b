"""``env.backend=vector`` and ``envpool``: an env's vectorized implementation, stepped as one.

gymnasium registers one for some ids (``vector_entry_point``: CartPole's numpy ``CartPoleVectorEnv``,
ale-py's C++-threaded ``AtariVectorEnv`` for every ``ALE/`` game). rltrain needs each ended episode
reset in the step that ended it, with the true final observation beside the reset one
(gymnasium's ``SAME_STEP`` autoreset): Atari's vector env does that when asked, and for CartPole,
whose vector env only resets on the step after, ``CartPoleSameStep`` below does it. Other vector
envs that reset only on the next step are refused: their batches would hold one frame per
episode that is no transition at all.

EnvPool (``env.backend=envpool``, the ``envpool`` extra) steps Atari, MuJoCo and classic-control
envs in C++ threads; it also resets on the next step, but it can step a subset of its envs, so
``EnvPoolBatchedEnv`` resets the ended ones at once with a step of those alone.

Checkpoints hold the vector env's state where it pickles (CartPole); Atari's emulators and
EnvPool do not pickle, so a resumed run starts them on fresh episodes (the collector warns).
"""

from __future__ import annotations

import importlib
import inspect
import pickle
from typing import Annotated

import gymnasium as gym
import numpy as np
from gymnasium.envs.classic_control.cartpole import CartPoleVectorEnv
from gymnasium.vector import AutoresetMode

from rltrain.envs.batched import NONFINITE_RULE, BatchedEnv, GymnasiumBatchedEnv, resolve_env_spec, spec_from_spaces
from rltrain.envs.spaces import map_obs
from rltrain.errors import ConfigError
from rltrain.rules import OneOf, PositiveInt

BACKENDS = ("gymnasium", "vector", "envpool")
BACKEND = OneOf(BACKENDS)  # env.backend


class CartPoleSameStep(CartPoleVectorEnv):
    """gymnasium's CartPoleVectorEnv with each ended episode reset in the same step: the final
    observations go to ``info["final_obs"]`` (where ``info["_final_obs"]``), as gymnasium's
    SAME_STEP vector envs report them. The dynamics and the reset distribution are CartPole's own."""

    metadata = {**CartPoleVectorEnv.metadata, "autoreset_mode": AutoresetMode.SAME_STEP}

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        done = terminated | truncated
        self.prev_done[:] = False  # reset below, not in the next step
        if done.any():
            info = {**info, "final_obs": obs.copy(), "_final_obs": done}
            self.state[:, done] = self.np_random.uniform(low=self.low, high=self.high, size=(4, int(done.sum())))
            self.steps[done] = 0
            obs = self.state.T.astype(np.float32)
        return obs, reward, terminated, truncated, info


# Vector envs that reset only on the next step, and the same-step version rltrain uses instead.
SAME_STEP_VERSIONS = {"gymnasium.envs.classic_control.cartpole:CartPoleVectorEnv": CartPoleSameStep}


def vector_env_class(env_id: str, entry) -> tuple[type, dict]:
    """The vector env class for ``env_id`` (whose gymnasium spec has ``vector_entry_point`` entry)
    and the arguments that make it reset in the same step, or a ConfigError saying why this id has
    none rltrain can use."""
    if entry is None:
        raise ConfigError(f"env.id={env_id!r} has no vectorized implementation in gymnasium (no vector_entry_point); "
                          "use env.backend=gymnasium (a loop over single envs), or collector=lockstep / async to "
                          "step them in worker processes")
    if not isinstance(entry, str):
        return entry, {}
    if entry in SAME_STEP_VERSIONS:
        return SAME_STEP_VERSIONS[entry], {}
    module, _, name = entry.partition(":")
    cls = getattr(importlib.import_module(module), name)
    if "autoreset_mode" in inspect.signature(cls).parameters:
        return cls, {"autoreset_mode": AutoresetMode.SAME_STEP}
    raise ConfigError(f"env.id={env_id!r}: its vector env ({entry}) resets ended episodes only on the next step, "
                      "which rltrain's batches cannot hold (each frame must be a transition); use "
                      "env.backend=gymnasium")


class VectorBatchedEnv(BatchedEnv):
    """``num_envs`` envs of one gymnasium vector env, stepped by one call (see ``BatchedEnv`` for
    what steps return). ``kwargs`` go to the vector env's constructor (for Atari: frameskip,
    stack_num, noop_max, episodic_life, ... of ale-py's AtariVectorEnv)."""

    def __init__(self, env_id: str, num_envs: int = 1, kwargs: dict | None = None, seed: int = 0,
                 reward_threshold: float | None = None, render_mode: str | None = None, nonfinite: str = "error",
                 wrappers: list[dict] | None = None):
        if wrappers:
            raise ConfigError("env.wrappers wrap single gymnasium envs, which env.backend=vector does not make; "
                              "give the vector env's own options in env.kwargs, or use env.backend=gymnasium")
        gym_spec = resolve_env_spec(env_id)
        cls, same_step = vector_env_class(env_id, gym_spec.vector_entry_point)
        kwargs = {**(kwargs or {}), **same_step, **({"render_mode": render_mode} if render_mode else {})}
        params = inspect.signature(cls).parameters
        if "max_episode_steps" in params and gym_spec.max_episode_steps and "max_episode_steps" not in kwargs:
            kwargs["max_episode_steps"] = gym_spec.max_episode_steps
        if "game" in params and "game" not in kwargs:  # ale-py: ALE/Breakout-v5 is the game breakout
            kwargs["game"] = gym_spec.kwargs.get("game") or gym_spec.name.lower()
        try:
            self.vec = cls(num_envs=num_envs, **kwargs)
        except TypeError as e:
            raise ConfigError(f"env.kwargs={kwargs} rejected by {env_id}'s vector env ({cls.__name__}): {e}") from None
        threshold = gym_spec.reward_threshold
        spec = spec_from_spaces(env_id, self.vec.single_observation_space, self.vec.single_action_space, threshold)
        super().__init__(env_id, num_envs, spec, seed, reward_threshold, nonfinite)

    def reset(self) -> np.ndarray | dict[str, np.ndarray]:
        self.vec.action_space.seed(self.seed)
        return self._reset_all(lambda: self.vec.reset(seed=self.seed))

    def step(self, actions: np.ndarray) -> tuple:
        """Step every env; returns (next_obs, reward, terminated, truncated, obs), views reused
        by the next call: copy what you keep."""
        if self._clip:
            actions = np.clip(actions, self._low, self._high)
        try:
            obs, reward, terminated, truncated, info = self.vec.step(actions)
        except Exception as e:  # noqa: BLE001
            raise self._raised(None, "step", e, self.steps + 1) from e
        done = self._record(obs, reward, terminated, truncated)
        resets = bool(done.any())
        if resets:  # where an episode ended, next_obs is its final observation
            final = info["final_obs"]
            map_obs(lambda out, f: out.__setitem__(done, np.asarray(f)[done]), self._next_obs, final)
        return self._checked_step(resets)

    def state_dict(self) -> list[bytes] | None:
        """The vector env pickled, or None where it does not pickle (emulators in C++)."""
        try:
            return [pickle.dumps(self.vec)]
        except Exception:  # noqa: BLE001
            return None

    def load_state_dict(self, blobs: list[bytes]) -> None:
        vec = pickle.loads(blobs[0])  # noqa: S301  (a checkpoint is trusted like the code that wrote it)
        if vec.num_envs != self.num_envs:
            raise ValueError(f"the saved state holds {vec.num_envs} envs, this env batch has {self.num_envs}")
        self.vec.close()
        self.vec = vec

    def close(self) -> None:
        self.vec.close()


class EnvPoolBatchedEnv(BatchedEnv):
    """``num_envs`` envs of one EnvPool task (``id``: EnvPool's task id, e.g. ``Breakout-v5``,
    ``HalfCheetah-v5``, ``CartPole-v1``; ``ALE/Breakout-v5`` is read as ``Breakout-v5``).
    ``kwargs`` go to ``envpool.make`` (for Atari: episodic_life, reward_clip, stack_num, ...)."""

    def __init__(self, env_id: str, num_envs: int = 1, kwargs: dict | None = None, seed: int = 0,
                 reward_threshold: float | None = None, render_mode: str | None = None, nonfinite: str = "error",
                 wrappers: list[dict] | None = None):
        try:
            import envpool
        except ImportError:
            raise ConfigError("env.backend=envpool needs EnvPool: pip install 'rltrain[envpool]'") from None
        if wrappers or render_mode:
            raise ConfigError("env.wrappers and rendering need single gymnasium envs, which env.backend=envpool "
                              "does not make; give EnvPool's own options in env.kwargs, or use env.backend=gymnasium")
        task = env_id.removeprefix("ALE/")
        if task not in envpool.list_all_envs():
            raise ConfigError(f"env.id={env_id!r} is not an EnvPool task (envpool.list_all_envs() lists them, e.g. "
                              "Breakout-v5, HalfCheetah-v5, CartPole-v1); or use env.backend=gymnasium")
        try:
            self.pool = envpool.make(task, env_type="gymnasium", num_envs=num_envs, seed=seed, **(kwargs or {}))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"env.kwargs={kwargs} rejected by EnvPool's {task}: {e}") from None
        threshold = gym.registry[env_id].reward_threshold if env_id in gym.registry else None  # gymnasium's "solved"
        spec = spec_from_spaces(env_id, self.pool.observation_space, self.pool.action_space, threshold)
        super().__init__(env_id, num_envs, spec, seed, reward_threshold, nonfinite)
        self._noop = np.zeros((num_envs, *spec.action.shape), dtype=spec.action.dtype)

    def reset(self) -> np.ndarray | dict[str, np.ndarray]:
        return self._reset_all(self.pool.reset)

    def step(self, actions: np.ndarray) -> tuple:
        """Step every env; returns (next_obs, reward, terminated, truncated, obs), views reused
        by the next call: copy what you keep."""
        if self._clip:
            actions = np.clip(actions, self._low, self._high)
        try:
            ended = np.flatnonzero(self._record(*self.pool.step(actions)[:4]))
            if ended.size:  # a step of the ended envs alone resets them (EnvPool ignores their actions)
                reset, *_, info = self.pool.step(self._noop[: ended.size], env_id=ended)
                rows = np.asarray(info["env_id"])
                map_obs(lambda out, new: out.__setitem__(rows, new), self._obs, reset)
        except Exception as e:  # noqa: BLE001
            raise self._raised(None, "step", e, self.steps + 1) from e
        return self._checked_step(bool(ended.size))

    def state_dict(self) -> None:
        return None  # EnvPool's C++ envs do not pickle: a resumed run starts fresh episodes

    def load_state_dict(self, blobs: list[bytes]) -> None:
        raise ValueError("EnvPool envs cannot be restored from a checkpoint")

    def close(self) -> None:
        self.pool.close()


def make_envs(id: str, num_envs: PositiveInt = 1, backend: Annotated[str, BACKEND] = "gymnasium",
              kwargs: dict | None = None, seed: int = 0, reward_threshold: float | None = None,
              render_mode: str | None = None, nonfinite: Annotated[str, NONFINITE_RULE] = "error",
              wrappers: list[dict] | None = None) -> BatchedEnv:
    """What the env configs build: ``num_envs`` envs of ``id`` on the chosen backend. (``id`` is the
    config key ``env.id``, gymnasium's own word: ``gymnasium.make(id)``; the backends call it ``env_id``.)

    backend: ``gymnasium`` (a Python loop over gymnasium envs: any env, any wrappers),
    ``vector`` (the env's own vectorized implementation, where gymnasium registers one) or
    ``envpool`` (EnvPool's C++ envs).
    """
    BACKEND.check("env.backend", backend)  # also when called from Python
    cls = {"gymnasium": GymnasiumBatchedEnv, "vector": VectorBatchedEnv, "envpool": EnvPoolBatchedEnv}[backend]
    return cls(id, num_envs, kwargs, seed, reward_threshold, render_mode, nonfinite, wrappers)
