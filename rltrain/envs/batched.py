"""N gymnasium envs stepped in lock-step in one process, returning numpy arrays.

Each env resets itself the moment its episode ends, and the step that ended it still reports
the true final observation, so a truncated episode can bootstrap from where it really stopped.
``BatchedEnv`` holds what every backend shares (buffers, NaN/inf checks, error messages);
``GymnasiumBatchedEnv`` is the Python loop over gymnasium envs (``env.backend=gymnasium``), and
``rltrain.envs.vector`` the simulators' own vectorized implementations.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import sys

import gymnasium as gym
import numpy as np

import rltrain.envs.env_state as env_state
from rltrain.envs.action_masks import MaskInObservation, masks_method
from rltrain.envs.spaces import EnvSpec, action_spec, check_action_mask, map_obs, observation_spec, zeros
from rltrain.errors import ConfigError, EnvError
from rltrain.rules import OneOf

NONFINITE = ("error", "replace")  # what a NaN/inf observation or reward does: fail the run, or become 0
NONFINITE_RULE = OneOf(NONFINITE)  # env.nonfinite


def resolve_env_spec(env_id: str) -> gym.envs.registration.EnvSpec:
    """Look up a gymnasium id (also ``module:Name-v0``, importing the module) or raise ConfigError.
    ``ALE/...`` ids import ale-py, which registers the Atari games."""
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
    elif env_id.startswith("ALE/") and env_id not in gym.registry:
        try:
            import ale_py
        except ImportError:
            raise ConfigError(f"env.id={env_id!r} is an Atari game, which needs ale-py: pip install 'rltrain[atari]'"
                              ) from None
        gym.register_envs(ale_py)
    try:
        return gym.spec(name)
    except gym.error.Error as e:
        raise ConfigError(
            f"env.id={env_id!r} is not a registered gymnasium environment ({e}). "
            "Use any id from gymnasium.pprint_registry(), or 'my_module:MyEnv-v0' for your own"
        ) from None


def make_gym_env(env_id: str, kwargs: dict | None = None, wrappers: list[dict] | None = None) -> gym.Env:
    """Create one gymnasium env with ``wrappers`` applied in order, turning a missing optional
    dependency or a wrapper that does not fit into a ConfigError. An env with an ``action_masks()`` method
    (sb3-contrib's convention) gets its masks in its observation (``rltrain.envs.action_masks``)."""
    _quiet_upstream_noise(resolve_env_spec(env_id), (kwargs or {}).get("render_mode"))
    try:
        # The passive checker costs ~30% of a CartPole step and only warns; users can wrap their own.
        env = gym.make(env_id, disable_env_checker=True, **(kwargs or {}))
    except gym.error.DependencyNotInstalled as e:
        raise ConfigError(
            f"env.id={env_id!r} needs an optional package: {e}. "
            "For MuJoCo envs: pip install 'rltrain[mujoco]'; for Atari: pip install 'rltrain[atari]'"
        ) from None
    for i, item in enumerate(wrappers or []):
        wrapper, args = resolve_wrapper(item, i)
        try:
            env = wrapper(env, **args)
        except Exception as e:  # noqa: BLE001  (a wrapper refuses an env or its arguments in many ways)
            env.close()
            raise ConfigError(f"env.wrappers[{i}] ({item['wrapper']}) failed on {env_id}: {type(e).__name__}: {e}"
                              ) from None
    if masks_method(env) is not None and not _wrapped_in(env, MaskInObservation):  # sb3-contrib's convention
        env = MaskInObservation(env)
    return env


def _wrapped_in(env: gym.Env, wrapper: type) -> bool:
    while isinstance(env, gym.Wrapper):
        if isinstance(env, wrapper):
            return True
        env = env.env
    return False


def _quiet_upstream_noise(spec: gym.envs.registration.EnvSpec, render_mode: str | None) -> None:
    """Silence what the libraries under an env print that tells a user nothing, and only that:
    pygame rendering frames offscreen (eval videos) looks for a display (SDL prints "XDG_RUNTIME_DIR is
    invalid" on a server), and gymnasium's MuJoCo models use an attribute MuJoCo deprecates (one
    "settotalmass is deprecated" line per env, also appended to MUJOCO_LOG.TXT in the working dir)."""
    if render_mode == "rgb_array":
        os.environ.setdefault("SDL_VIDEODRIVER", "dummy")  # a user's own choice stays
    if str(spec.entry_point).startswith("gymnasium.envs.mujoco"):
        import mujoco

        if mujoco.get_mju_user_warning() is None:  # MuJoCo's default: print, and log to MUJOCO_LOG.TXT
            mujoco.set_mju_user_warning(_mujoco_warning)


def _mujoco_warning(message: str) -> None:
    if "'settotalmass' is deprecated" not in message:
        print(f"WARNING: {message}", file=sys.stderr)


def resolve_wrapper(item: dict, i: int) -> tuple[type, dict]:
    """``{"wrapper": NAME, **arguments}`` -> (the wrapper class, its arguments). NAME is a class of
    ``gymnasium.wrappers`` (``FrameStackObservation``) or a dotted path (``my_module.MyWrapper``)."""
    where = f"env.wrappers[{i}]"
    if not isinstance(item, dict) or not isinstance(item.get("wrapper"), str):
        raise ConfigError(f"{where} must be a mapping with a 'wrapper' key naming the wrapper, and its arguments "
                          f"beside it, e.g. {{wrapper: FrameStackObservation, stack_size: 4}} (got {item!r})")
    name = item["wrapper"]
    module, _, attr = name.rpartition(".")
    try:
        wrapper = getattr(importlib.import_module(module or "gymnasium.wrappers"), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{where}: wrapper {name!r} not found ({e}); give a class of gymnasium.wrappers "
                          "(e.g. AtariPreprocessing) or a dotted path (my_module.MyWrapper)") from None
    return wrapper, {k: v for k, v in item.items() if k != "wrapper"}


def spec_from_env(env_id: str, env: gym.Env) -> EnvSpec:
    """The env's spaces as rltrain describes them; a ConfigError for a space it does not support."""
    return spec_from_spaces(env_id, env.observation_space, env.action_space, _threshold(env))


def spec_from_spaces(env_id: str, observation: gym.Space, action: gym.Space, reward_threshold: float | None) -> EnvSpec:
    spec = EnvSpec(env_id, observation_spec(env_id, observation), action_spec(env_id, action), reward_threshold)
    check_action_mask(env_id, spec.observation, spec.action)
    return spec


def _threshold(env: gym.Env) -> float | None:
    return None if env.spec is None else env.spec.reward_threshold


def _setter(buffer: np.ndarray | dict[str, np.ndarray]):
    """``set(i, obs)`` writing one env's observation into row i of ``buffer`` (each key's array)."""
    if isinstance(buffer, np.ndarray):
        return buffer.__setitem__

    def set_keys(i: int, obs: dict) -> None:
        for key, values in buffer.items():
            values[i] = obs[key]

    return set_keys


def _float_leaves(buffer: np.ndarray | dict[str, np.ndarray]) -> list[tuple[str, np.ndarray]]:
    arrays = {"observation": buffer} if isinstance(buffer, np.ndarray) else {
        f"observation[{key!r}]": values for key, values in buffer.items()}
    return [(name, values) for name, values in arrays.items() if values.dtype.kind == "f"]


def _misfit(obs, buffer: np.ndarray | dict[str, np.ndarray]) -> str:
    """How one env's observation differs from a row of ``buffer`` (what its observation space holds)."""
    if isinstance(buffer, dict):
        if not isinstance(obs, dict) or set(obs) != set(buffer):
            got = f"keys {sorted(obs)}" if isinstance(obs, dict) else f"a {type(obs).__name__}"
            return f"an observation with {got} where its Dict space has keys {sorted(buffer)}"
        return "; ".join(f"[{key!r}]: {_misfit(obs[key], values)}" for key, values in buffer.items()
                         if np.shape(obs[key]) != values.shape[1:]) or "an observation its space cannot hold"
    try:
        shape = np.shape(obs)
    except ValueError:  # a ragged sequence
        shape = "ragged"
    return f"an observation of shape {shape} where its observation space has shape {buffer.shape[1:]}"


class BatchedEnv:
    """What every backend shares: ``num_envs`` envs of one spec stepped together, and the checks
    on what they return.

    Observations come back as arrays of shape ``[num_envs, *leaf.shape]`` in each leaf's dtype
    (float32 for float Boxes, uint8 images as uint8), or a dict of them for a Dict space. ``step``
    returns ``next_obs`` (the observation each env reached, the true final one where an episode
    ended) and ``obs`` (what the policy sees next: the reset observation where an episode ended).
    An env that raises, or returns a NaN or infinite observation or reward, fails with an EnvError
    naming it, its step and the key (or, with ``nonfinite="replace"``, such values become 0 and the
    envs they came from are flagged in ``replaced``).
    """

    def __init__(self, env_id: str, num_envs: int, spec: EnvSpec, seed: int, reward_threshold: float | None,
                 nonfinite: str):
        NONFINITE_RULE.check("env.nonfinite", nonfinite)
        self.id, self.num_envs, self.nonfinite, self.seed = env_id, num_envs, nonfinite, seed
        self.steps = 0  # steps taken by every env of this batch (what error messages count in)
        self.spec = spec
        if reward_threshold is not None:  # ours, for envs where gymnasium declares none
            self.spec = dataclasses.replace(self.spec, reward_threshold=reward_threshold)
        self._obs = zeros(self.spec.observation, (num_envs,))
        self._next_obs = zeros(self.spec.observation, (num_envs,))
        # The leaves that can hold NaN/inf (float ones), as (name, array) pairs of each buffer.
        self._float_obs, self._float_next = _float_leaves(self._obs), _float_leaves(self._next_obs)
        self._reward = np.zeros(num_envs, dtype=np.float32)
        self._terminated = np.zeros(num_envs, dtype=bool)
        self._truncated = np.zeros(num_envs, dtype=bool)
        self.replaced = np.zeros(num_envs, dtype=bool)  # envs whose last step had NaN/inf values set to 0
        self._clip = self.spec.action.kind == "box"
        if self._clip:
            self._low, self._high = self.spec.action_low, self.spec.action_high

    def _write(self, out: np.ndarray | dict[str, np.ndarray], obs) -> None:
        """Copy a whole batch of observations (an array, or a dict of them) into ``out``."""
        map_obs(lambda values, new: np.copyto(values, new, casting="unsafe"), out, obs)

    def _reset_all(self, reset) -> np.ndarray | dict[str, np.ndarray]:
        """``reset()`` of a whole vectorized batch, its observations stored and checked."""
        try:
            obs, _ = reset()
        except Exception as e:  # noqa: BLE001  (whatever the env raises: name the env and the call)
            raise self._raised(None, "reset", e, self.steps) from e
        self._write(self._obs, obs)
        return self._checked_reset()

    def _record(self, obs, reward, terminated, truncated) -> np.ndarray:
        """A whole batch's step results into the buffers (``obs`` as both the next and the new
        observation: the backend then fixes the rows whose episode ended); returns those rows' mask."""
        self._reward[:] = reward
        self._terminated[:] = terminated
        self._truncated[:] = truncated
        self._write(self._next_obs, obs)
        self._write(self._obs, obs)
        return self._terminated | self._truncated

    def _checked_reset(self) -> np.ndarray | dict[str, np.ndarray]:
        self.replaced[:] = False
        for name, values in self._float_obs:
            if not np.isfinite(values).all():
                self._nonfinite(name, values, "reset")
        return self._obs

    def _checked_step(self, resets: bool) -> tuple:
        """The step's results, once checked for NaN/inf (``resets``: some env was reset in it)."""
        self.steps += 1
        if self.nonfinite == "replace":
            self.replaced[:] = False
        # One cheap test per step: a sum is NaN or inf if any term is (or if it overflows: then the
        # slow path finds nothing to fix). Only the slow path looks for which env and key.
        total = self._reward.sum() + sum(v.sum() for _, v in self._float_next)
        if resets:
            total += sum(v.sum() for _, v in self._float_obs)
        if not math.isfinite(total):
            self._nonfinite("reward", self._reward, "step")
            for name, values in self._float_next:
                self._nonfinite(name, values, "step")
            ongoing = ~(self._terminated | self._truncated)
            for (name, obs), (_, next_obs) in zip(self._float_obs, self._float_next):
                obs[ongoing] = next_obs[ongoing]  # what the policy sees next, where no episode ended
                self._nonfinite(name, obs, "reset")
        return self._next_obs, self._reward, self._terminated, self._truncated, self._obs

    def _raised(self, i: int | None, method: str, error: Exception, step: int) -> EnvError:
        which = f"env {i} of {self.num_envs}" if i is not None else f"{self.num_envs} envs, vectorized"
        return EnvError(f"env {self.id} ({which}) raised in {method}() at its step {step}: "
                        f"{type(error).__name__}: {error}")

    def _returned(self, i: int, method: str, step: int, what: str) -> EnvError:
        return EnvError(f"env {self.id} (env {i} of {self.num_envs}) returned {what} from {method}() at its step "
                        f"{step}; fix the env (or a wrapper of env.wrappers) so that what it returns fits its spaces")

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


class GymnasiumBatchedEnv(BatchedEnv):
    """``env.backend=gymnasium``: ``num_envs`` copies of one gymnasium env, stepped in a Python loop,
    each reset the moment its episode ends (see ``BatchedEnv`` for what steps return)."""

    def __init__(self, env_id: str, num_envs: int = 1, kwargs: dict | None = None, seed: int = 0,
                 reward_threshold: float | None = None, render_mode: str | None = None, nonfinite: str = "error",
                 wrappers: list[dict] | None = None):
        NONFINITE_RULE.check("env.nonfinite", nonfinite)
        kwargs = {**(kwargs or {}), **({"render_mode": render_mode} if render_mode else {})}
        self.envs = [make_gym_env(env_id, kwargs, wrappers) for _ in range(num_envs)]
        super().__init__(env_id, num_envs, spec_from_env(env_id, self.envs[0]), seed, reward_threshold, nonfinite)
        self._set_obs, self._set_next = _setter(self._obs), _setter(self._next_obs)

    def reset(self) -> np.ndarray | dict[str, np.ndarray]:
        for i, env in enumerate(self.envs):
            try:
                o, _ = env.reset(seed=self.seed + i)
            except Exception as e:  # noqa: BLE001  (whatever the env raises: name the env and the call)
                raise self._raised(i, "reset", e, self.steps) from e
            self._put(self._set_obs, i, o, "reset", self.steps)
            env.action_space.seed(self.seed + i)
        return self._checked_reset()

    def step(self, actions: np.ndarray) -> tuple:
        """Step every env; returns (next_obs, reward, terminated, truncated, obs), views reused
        by the next call: copy what you keep."""
        if self._clip:
            # The policy's Gaussian is unbounded; the env gets the action clipped to its box.
            actions = np.clip(actions, self._low, self._high)
        set_obs, set_next = self._set_obs, self._set_next
        resets = False
        for i, env in enumerate(self.envs):
            try:
                o, r, term, trunc, _ = env.step(actions[i])
            except Exception as e:  # noqa: BLE001
                raise self._raised(i, "step", e, self.steps + 1) from e
            self._put(set_next, i, o, "step", self.steps + 1)
            try:
                self._reward[i] = r
            except (TypeError, ValueError):
                raise self._returned(i, "step", self.steps + 1, f"a reward of {r!r}, not a number") from None
            self._terminated[i] = term
            self._truncated[i] = trunc
            if term or trunc:
                resets = True
                try:
                    o, _ = env.reset()
                except Exception as e:  # noqa: BLE001
                    raise self._raised(i, "reset", e, self.steps + 1) from e
            self._put(set_obs, i, o, "reset", self.steps + 1)
        return self._checked_step(resets)

    def _put(self, set_row, i: int, obs, method: str, step: int) -> None:
        """Write env ``i``'s observation, or say how it does not fit the observation space."""
        try:
            set_row(i, obs)
        except (TypeError, ValueError, KeyError, IndexError):
            raise self._returned(i, method, step, _misfit(obs, self._obs)) from None

    def state_dict(self) -> list[bytes] | None:
        """Every env's full state (see ``env_state``), or None if one of them cannot be captured."""
        blobs = [env_state.capture(env) for env in self.envs]
        return None if any(b is None for b in blobs) else blobs

    def load_state_dict(self, blobs: list[bytes]) -> None:
        """Replace the envs with the saved ones, mid-episode where they were (no reset)."""
        if len(blobs) != self.num_envs:
            raise ValueError(f"the saved state holds {len(blobs)} envs, this GymnasiumBatchedEnv has {self.num_envs}")
        envs = [env_state.restore(b) for b in blobs]
        self.close()
        self.envs = envs

    def close(self) -> None:
        for env in self.envs:
            env.close()
