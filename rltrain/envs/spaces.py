"""What rltrain supports of gymnasium's spaces, described as plain values that pickle into workers.

An observation is one ``Leaf`` (a Box, Discrete, MultiDiscrete or MultiBinary space) or a flat
Dict of them; an action is one ``ActionSpec`` (Discrete, Box, MultiDiscrete or MultiBinary). Each
leaf keeps its own dtype end to end: uint8 images stay uint8 in frames, batches, shared memory
and replay buffers (4x less memory than float32), and are scaled on the learner's side.

Everything else (Text, Graph, Sequence, Tuple, a Dict inside a Dict) is refused by
``observation_spec`` / ``action_spec`` with a ConfigError that names the space and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch

from rltrain.errors import ConfigError

OBS_KEY = "observation"  # the batch key; a Dict observation's keys nest below it
MASK_KEY = "action_mask"  # a Dict observation's key saying which actions are valid (PettingZoo's, Gymnasium's)


@dataclass(frozen=True)
class Leaf:
    """One array of an observation.

    kind: ``vector`` (a float Box, or MultiBinary 0/1 values), ``image`` (a uint8 or bool Box of
    2 or 3 dims: [H, W], [C, H, W] or [H, W, C]), ``discrete`` (an index, one-hot encoded by the
    network; ``n`` values) or ``multi_discrete`` (one index per entry of ``nvec``).
    """

    shape: tuple[int, ...]
    dtype: str  # numpy dtype name, as stored
    kind: str
    nvec: tuple[int, ...] = ()  # discrete: (n,); multi_discrete: each entry's number of values

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


Observation = Leaf | dict[str, Leaf]


@dataclass(frozen=True)
class ActionSpec:
    """kind: ``discrete`` (one of ``nvec[0]``), ``box`` (floats within ``low``/``high``),
    ``multi_discrete`` (one of ``nvec[i]`` per entry) or ``multi_binary`` (0/1 per entry)."""

    kind: str
    shape: tuple[int, ...]  # () for discrete
    dtype: str
    nvec: tuple[int, ...] = ()
    low: np.ndarray | None = None  # Box bounds
    high: np.ndarray | None = None


OBSERVATION_SPACES = "Box, Discrete, MultiDiscrete, MultiBinary, or a Dict of those"
ACTION_SPACES = "Discrete, Box, MultiDiscrete and MultiBinary"



@dataclass(frozen=True)
class EnvSpec:
    """What the policy and the buffers need to know about an env's spaces."""

    id: str
    observation: Observation  # one Leaf, or a dict of them (a Dict space)
    action: ActionSpec
    reward_threshold: float | None  # gymnasium's "solved" return, if the env declares one

    @property
    def discrete(self) -> bool:
        return self.action.kind == "discrete"

    @property
    def num_actions(self) -> int | None:
        """Set for Discrete action spaces, None otherwise."""
        return self.action.nvec[0] if self.discrete else None

    @property
    def action_shape(self) -> tuple[int, ...]:
        return self.action.shape

    @property
    def action_low(self) -> np.ndarray | None:
        return self.action.low

    @property
    def action_high(self) -> np.ndarray | None:
        return self.action.high

    @property
    def masked(self) -> bool:
        """Whether the observation says which actions are valid (a Dict with an ``action_mask`` key)."""
        return isinstance(self.observation, dict) and MASK_KEY in self.observation

    @property
    def obs_shape(self) -> tuple[int, ...]:
        """The observation's shape (a single-array observation only)."""
        if not isinstance(self.observation, Leaf):
            raise TypeError(f"{self.id} has a Dict observation ({sorted(self.observation)}): it has no single shape")
        return self.observation.shape

def observation_spec(env_id: str, space: gym.Space) -> Observation:
    if isinstance(space, gym.spaces.Dict):
        leaves = {}
        for key, sub in space.spaces.items():
            if isinstance(sub, (gym.spaces.Dict, gym.spaces.Tuple)):
                raise ConfigError(f"env.id={env_id!r} has a Dict observation whose key {key!r} is a "
                                  f"{type(sub).__name__} space; rltrain supports a flat Dict of Box, Discrete, "
                                  "MultiDiscrete and MultiBinary spaces (flatten the nested part with a wrapper, "
                                  "e.g. gymnasium.wrappers.FlattenObservation on the inner env)")
            if "." in key or "/" in key:
                raise ConfigError(f"env.id={env_id!r}: Dict observation key {key!r} holds '.' or '/'; rename it")
            leaves[key] = _leaf(env_id, sub, f"observation key {key!r}")
        if not leaves:
            raise ConfigError(f"env.id={env_id!r} has an empty Dict observation space")
        return leaves
    return _leaf(env_id, space, "observation")


def _leaf(env_id: str, space: gym.Space, what: str) -> Leaf:
    if isinstance(space, gym.spaces.Box):
        dtype = np.dtype(space.dtype)
        if dtype in (np.uint8, np.bool_) and len(space.shape) in (2, 3):
            return Leaf(tuple(space.shape), dtype.name, "image")
        if dtype.kind in "fiub":
            stored = "float32" if dtype.kind == "f" or dtype.itemsize > 4 else dtype.name
            return Leaf(tuple(space.shape), stored, "vector")
    if isinstance(space, gym.spaces.Discrete):
        return Leaf((), "int64", "discrete", (int(space.n),))
    if isinstance(space, gym.spaces.MultiDiscrete) and space.nvec.ndim == 1:
        return Leaf(tuple(space.shape), "int64", "multi_discrete", tuple(int(n) for n in space.nvec))
    if isinstance(space, gym.spaces.MultiBinary):
        return Leaf(tuple(int(d) for d in space.shape), "int8", "vector")
    raise ConfigError(f"env.id={env_id!r} has a {type(space).__name__} {what} space ({space}); rltrain supports "
                      f"{OBSERVATION_SPACES} observations (wrap the env to convert it, e.g. with "
                      "gymnasium.wrappers.FlattenObservation)")


def action_spec(env_id: str, space: gym.Space) -> ActionSpec:
    if isinstance(space, gym.spaces.Discrete):
        if int(space.start) != 0:
            raise ConfigError(f"env.id={env_id!r} has a Discrete action space starting at {space.start}; rltrain "
                              "supports Discrete(n) from 0 (wrap the env to shift its actions)")
        return ActionSpec("discrete", (), "int64", (int(space.n),))
    if isinstance(space, gym.spaces.Box) and np.dtype(space.dtype).kind == "f":
        if not (np.isfinite(space.low).all() and np.isfinite(space.high).all()):
            raise ConfigError(f"env.id={env_id!r} has a Box action space with infinite bounds ({space}); the policy "
                              "clips (PPO) or squashes (SAC) actions into the box: give it finite bounds "
                              "(e.g. gymnasium.wrappers.ClipAction over a bounded space)")
        return ActionSpec("box", tuple(space.shape), "float32", (), space.low.astype(np.float32),
                          space.high.astype(np.float32))
    if isinstance(space, gym.spaces.MultiDiscrete) and space.nvec.ndim == 1:
        if np.any(space.start != 0):
            raise ConfigError(f"env.id={env_id!r} has a MultiDiscrete action space with start {space.start}; "
                              "rltrain supports starts of 0 (wrap the env to shift its actions)")
        return ActionSpec("multi_discrete", tuple(space.shape), "int64", tuple(int(n) for n in space.nvec))
    if isinstance(space, gym.spaces.MultiBinary) and np.ndim(space.n) == 0:
        return ActionSpec("multi_binary", (int(space.n),), "int8")
    raise ConfigError(f"env.id={env_id!r} has a {type(space).__name__} action space ({space}); rltrain supports "
                      f"{ACTION_SPACES} actions (1-D for the multi ones)")


def check_action_mask(env_id: str, observation: Observation, action: ActionSpec) -> None:
    """A ConfigError where a Dict observation's ``action_mask`` cannot mask the action space: a space that takes
    no mask (Box, MultiBinary), or a shape other than one 0/1 per action (for MultiDiscrete, each entry's
    values one after another: ``sum(nvec)``)."""
    mask = observation.get(MASK_KEY) if isinstance(observation, dict) else None
    if mask is None:
        return
    if action.kind not in ("discrete", "multi_discrete"):
        raise ConfigError(f"env.id={env_id!r}: its observation's {MASK_KEY!r} would mask a {action.kind} action "
                          "space, which takes no mask (masks are for Discrete and MultiDiscrete actions); rename "
                          "the key if it is not a mask")
    want = (sum(action.nvec),)
    if mask.shape != want or mask.kind != "vector":
        layout = "" if action.kind == "discrete" else ", each entry's values one after another"
        raise ConfigError(f"env.id={env_id!r}: its observation's {MASK_KEY!r} is a {mask.kind} of shape "
                          f"{mask.shape}; for its {action.kind.replace('_', '')} action space "
                          f"(nvec {list(action.nvec)}) it must be a 0/1 vector of shape {want}, one per action{layout}")


def flat_leaves(observation: Observation, prefix: str = OBS_KEY) -> dict[str, Leaf]:
    """``{"observation": leaf}``, or ``{"observation.<key>": leaf}`` for each key of a Dict."""
    if isinstance(observation, Leaf):
        return {prefix: observation}
    return {f"{prefix}.{key}": leaf for key, leaf in observation.items()}


def nest(flat: Mapping[str, object], prefix: str = OBS_KEY) -> object:
    """Inverse of ``flat_leaves`` for values: the one value, or a dict by the Dict's keys."""
    if prefix in flat:
        return flat[prefix]
    start = len(prefix) + 1
    return {name[start:]: value for name, value in flat.items() if name.startswith(prefix + ".")}


def zeros(observation: Observation, batch: tuple[int, ...]) -> np.ndarray | dict[str, np.ndarray]:
    """A batch of observations of zeros (numpy), one array per leaf."""
    if isinstance(observation, Leaf):
        return np.zeros((*batch, *observation.shape), dtype=observation.dtype)
    return {key: np.zeros((*batch, *leaf.shape), dtype=leaf.dtype) for key, leaf in observation.items()}


def map_obs(fn, *obs):
    """``fn`` applied leaf by leaf to one or more observations of the same structure."""
    if isinstance(obs[0], dict):
        return {key: fn(*(o[key] for o in obs)) for key in obs[0]}
    return fn(*obs)


def to_torch(obs, device: torch.device | str | None = None):
    """numpy observation(s) as tensors (sharing memory on CPU), on ``device`` if given."""
    if device is None:
        return map_obs(torch.from_numpy, obs)
    return map_obs(lambda o: torch.from_numpy(o).to(device), obs)
