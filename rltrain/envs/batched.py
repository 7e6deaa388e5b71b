"""N gymnasium envs stepped in lock-step in one process, returning numpy arrays.

Each env resets itself the moment its episode ends, and the step that ended it still reports
the true final observation, so a truncated episode can bootstrap from where it really stopped.
An env that raises, or returns a NaN or infinite observation or reward, fails with an EnvError
naming it, its step and the key (or, with ``nonfinite="replace"``, such values become 0 and the
envs they came from are flagged in ``replaced``).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from dataclasses import dataclass

import gymnasium as gym
import numpy as np

import rltrain.envs.env_state as env_state
from rltrain.errors import ConfigError, EnvError

NONFINITE = ("error", "replace")  # what a NaN/inf observation or reward does: fail the run, or become 0


@dataclass(frozen=True)
class EnvSpec:
    """What the policy and the buffers need to know about an env's spaces."""

    id: str
    obs_shape: tuple[int, ...]
    action_shape: tuple[int, ...]  # () for discrete actions
    num_actions: int | None  # set for Discrete action spaces, None for Box
    action_low: np.ndarray | None  # Box bounds (None for Discrete)
    action_high: np.ndarray | None
    reward_threshold: float | None  # gymnasium's "solved" return, if the env declares one

    @property
    def discrete(self) -> bool:
        return self.num_actions is not None


def resolve_env_spec(env_id: str) -> gym.envs.registration.EnvSpec:
    """Look up a gymnasium id (also ``module:Name-v0``, importing the module) or raise ConfigError."""
    name = env_id
    if ":" in env_id:
        module, name = env_id.split(":", 1)
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ConfigError(
                f"env.id={env_id!r}: could not import module {module!r} ({e}); "
                "the part before ':' must be an importable module that registers the env"
            ) from None
    try:
        return gym.spec(name)
    except gym.error.Error as e:
        raise ConfigError(
            f"env.id={env_id!r} is not a registered gymnasium environment ({e}). "
            "Use any id from gymnasium.pprint_registry(), or 'my_module:MyEnv-v0' for your own"
        ) from None


def make_gym_env(env_id: str, kwargs: dict | None = None) -> gym.Env:
    """Create one gymnasium env, turning a missing optional dependency into a ConfigError."""
    resolve_env_spec(env_id)
    try:
        # The passive checker costs ~30% of a CartPole step and only warns; users can wrap their own.
        return gym.make(env_id, disable_env_checker=True, **(kwargs or {}))
    except gym.error.DependencyNotInstalled as e:
        raise ConfigError(
            f"env.id={env_id!r} needs an optional package: {e}. "
            "For MuJoCo envs: pip install 'rltrain[mujoco]'"
        ) from None


def spec_from_env(env_id: str, env: gym.Env) -> EnvSpec:
    obs, act = env.observation_space, env.action_space
    if not isinstance(obs, gym.spaces.Box):
        raise ConfigError(
            f"env.id={env_id!r} has a {type(obs).__name__} observation space; rltrain supports Box "
            "observations (wrap the env, e.g. with gymnasium.wrappers.FlattenObservation)"
        )
    if isinstance(act, gym.spaces.Discrete):
        return EnvSpec(env_id, obs.shape, (), int(act.n), None, None, _threshold(env))
    if isinstance(act, gym.spaces.Box):
        return EnvSpec(env_id, obs.shape, act.shape, None, act.low.astype(np.float32),
                       act.high.astype(np.float32), _threshold(env))
    raise ConfigError(
        f"env.id={env_id!r} has a {type(act).__name__} action space; rltrain supports Discrete and Box"
    )


def _threshold(env: gym.Env) -> float | None:
    return None if env.spec is None else env.spec.reward_threshold


class BatchedEnv:
    """``num_envs`` copies of one gymnasium env, stepped together.

    Observations come back as float32 arrays of shape ``[num_envs, *obs_shape]``. ``step`` returns
    ``next_obs`` (the observation each env reached, the true final one where an episode ended)
    and ``obs`` (what the policy sees next: the reset observation where an episode ended).
    """

    def __init__(self, id: str, num_envs: int = 1, kwargs: dict | None = None, seed: int = 0,
                 reward_threshold: float | None = None, render_mode: str | None = None, nonfinite: str = "error"):
        if nonfinite not in NONFINITE:
            raise ValueError(f"nonfinite must be one of {NONFINITE} (got {nonfinite!r})")
        self.id = id
        self.num_envs = num_envs
        self.nonfinite = nonfinite
        self.steps = 0  # steps taken by every env of this batch (what error messages count in)
        kwargs = {**(kwargs or {}), **({"render_mode": render_mode} if render_mode else {})}
        self.envs = [make_gym_env(id, kwargs) for _ in range(num_envs)]
        self.spec = spec_from_env(id, self.envs[0])
        if reward_threshold is not None:  # ours, for envs where gymnasium declares none
            self.spec = dataclasses.replace(self.spec, reward_threshold=reward_threshold)
        self.seed = seed
        self._obs = np.zeros((num_envs, *self.spec.obs_shape), dtype=np.float32)
        self._next_obs = np.zeros_like(self._obs)
        self._reward = np.zeros(num_envs, dtype=np.float32)
        self._terminated = np.zeros(num_envs, dtype=bool)
        self._truncated = np.zeros(num_envs, dtype=bool)
        self.replaced = np.zeros(num_envs, dtype=bool)  # envs whose last step had NaN/inf values set to 0
        if not self.spec.discrete:
            self._low, self._high = self.spec.action_low, self.spec.action_high

    def reset(self) -> np.ndarray:
        for i, env in enumerate(self.envs):
            try:
                self._obs[i], _ = env.reset(seed=self.seed + i)
            except Exception as e:  # noqa: BLE001  (whatever the env raises: name the env and the call)
                raise self._raised(i, "reset", e, self.steps) from e
            env.action_space.seed(self.seed + i)
        self.replaced[:] = False
        if not np.isfinite(self._obs).all():
            self._nonfinite("observation", self._obs, "reset")
        return self._obs

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, ...]:
        """Step every env; returns (next_obs, reward, terminated, truncated, obs), views reused
        by the next call: copy what you keep."""
        if not self.spec.discrete:
            # The policy's Gaussian is unbounded; the env gets the action clipped to its box.
            actions = np.clip(actions, self._low, self._high)
        obs, next_obs = self._obs, self._next_obs
        resets = False
        for i, env in enumerate(self.envs):
            try:
                o, r, term, trunc, _ = env.step(actions[i])
                next_obs[i] = o
                self._reward[i] = r
            except Exception as e:  # noqa: BLE001
                raise self._raised(i, "step", e, self.steps + 1) from e
            self._terminated[i] = term
            self._truncated[i] = trunc
            if term or trunc:
                resets = True
                try:
                    o, _ = env.reset()
                except Exception as e:  # noqa: BLE001
                    raise self._raised(i, "reset", e, self.steps + 1) from e
            obs[i] = o
        self.steps += 1
        if self.nonfinite == "replace":
            self.replaced[:] = False
        # One cheap test per step: a sum is NaN or inf if any term is (or if it overflows: then the
        # slow path finds nothing to fix). Only the slow path looks for which env and key.
        if not math.isfinite(self._reward.sum() + next_obs.sum() + (obs.sum() if resets else 0.0)):
            self._nonfinite("reward", self._reward, "step")
            self._nonfinite("observation", next_obs, "step")
            ongoing = ~(self._terminated | self._truncated)
            obs[ongoing] = next_obs[ongoing]  # what the policy sees next, where no episode ended
            self._nonfinite("observation", obs, "reset")
        return next_obs, self._reward, self._terminated, self._truncated, obs

    def _raised(self, i: int, method: str, error: Exception, step: int) -> EnvError:
        return EnvError(f"env {self.id} (env {i} of {self.num_envs}) raised in {method}() at its step {step}: "
                        f"{type(error).__name__}: {error}")

    def _nonfinite(self, key: str, values: np.ndarray, method: str) -> None:
        """Fail naming the first env whose ``key`` is NaN/inf, or (replace) set those values to 0."""
        bad = ~np.isfinite(values.reshape(self.num_envs, -1)).all(1)
        if not bad.any():
            return
        if self.nonfinite == "error":
            i = int(bad.argmax())
            raise EnvError(f"env {self.id} (env {i} of {self.num_envs}) returned a non-finite {key} "
                           f"({values[i].tolist()}) from {method}() at its step {self.steps}; fix the env, or set "
                           "env.nonfinite=replace to replace such values by 0 and count them "
                           "(nonfinite/env_frames)")
        np.nan_to_num(values, copy=False, nan=0.0, posinf=0.0, neginf=0.0)
        self.replaced |= bad

    def state_dict(self) -> list[bytes] | None:
        """Every env's full state (see ``env_state``), or None if one of them cannot be captured."""
        blobs = [env_state.capture(env) for env in self.envs]
        return None if any(b is None for b in blobs) else blobs

    def load_state_dict(self, blobs: list[bytes]) -> None:
        """Replace the envs with the saved ones, mid-episode where they were (no reset)."""
        if len(blobs) != self.num_envs:
            raise ValueError(f"the saved state holds {len(blobs)} envs, this BatchedEnv has {self.num_envs}")
        envs = [env_state.restore(b) for b in blobs]
        self.close()
        self.envs = envs

    def close(self) -> None:
        for env in self.envs:
            env.close()
