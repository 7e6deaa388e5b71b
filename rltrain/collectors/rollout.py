"""The stepping loop every collector runs: a policy acting in a BatchedEnv (any backend), writing frames into
preallocated arrays. Used in-process by LocalCollector and inside each worker process.

Only numpy, torch and the env here: worker processes import this without tensordict or Hydra.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from rltrain.algos.recurrent import Memory
from rltrain.envs.action_masks import refuse_empty
from rltrain.envs.batched import BatchedEnv
from rltrain.envs.spaces import MASK_KEY, EnvSpec, flat_leaves, map_obs, nest, to_torch
from rltrain.sync.base import WeightReceiver

log = logging.getLogger("rltrain")

def frame_layout(spec: EnvSpec, steps: int, num_envs: int,
                 state_size: int = 0) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Shape and dtype of every per-frame array of a ``[steps, num_envs]`` batch, by frame key.

    ``next_observation`` becomes ("next", "observation") in the batch; a Dict observation has one
    array per key, ``observation.<key>`` (see ``rltrain.envs.spaces.flat_leaves``). A policy with memory
    (``state_size`` floats per env) adds ``recurrent_state``: the state each action was chosen from.
    """
    tn = (steps, num_envs)
    leaves = {**flat_leaves(spec.observation, "observation"), **flat_leaves(spec.observation, "next_observation")}
    memory = {"recurrent_state": ((*tn, state_size), np.dtype(np.float32))} if state_size else {}
    return {**memory,
        **{key: ((*tn, *leaf.shape), np.dtype(leaf.dtype)) for key, leaf in leaves.items()},
        "action": ((*tn, *spec.action.shape), np.dtype(spec.action.dtype)),
        "log_prob": (tn, np.float32),
        "reward": (tn, np.float32),
        "terminated": (tn, np.bool_),
        "truncated": (tn, np.bool_),
        "episode_return": (tn, np.float32),
        "episode_length": (tn, np.int64),
        "policy_version": (tn, np.int64),
        "nonfinite": (tn, np.bool_),  # env.nonfinite=replace: this step's NaN/inf observation or reward became 0
    }


def allocate_frames(spec: EnvSpec, steps: int, num_envs: int, shared: bool = False,
                    state_size: int = 0) -> dict[str, torch.Tensor]:
    """Tensors for one batch (in shared memory if ``shared``: worker processes write into them)."""
    out = {}
    for key, (shape, dtype) in frame_layout(spec, steps, num_envs, state_size).items():
        t = torch.from_numpy(np.zeros(shape, dtype=dtype))
        out[key] = t.share_memory_() if shared else t
    return out


class Rollout:
    """Steps ``env`` with ``policy``; episode returns and the env state carry over between batches.

    ``poll_each_step``: look for new weights before every step (async workers) instead of only
    before each batch (lock-step collectors). Every frame records the version that acted. A policy with memory
    carries each env's state across steps, batches and weight pushes, zeroed where an episode ends.
    """

    def __init__(self, env: BatchedEnv, policy: nn.Module, receiver: WeightReceiver, poll_each_step: bool = False):
        self.env, self.receiver = env, receiver
        self.poll_each_step = poll_each_step
        self.memory = Memory(policy, env.num_envs, first_env=env.seed)  # (env k of a job is seeded seed + k)
        self._obs = map_obs(np.copy, env.reset())
        self._ep_return = np.zeros(env.num_envs, dtype=np.float32)
        self._ep_length = np.zeros(env.num_envs, dtype=np.int64)
        self._warned_unsaveable = False

    def collect(self, out: dict[str, np.ndarray]) -> None:
        """Fill ``out`` (arrays shaped as ``frame_layout``) with ``len(out["reward"])`` steps."""
        env, memory, receiver = self.env, self.memory, self.receiver
        obs, ep_return, ep_length = self._obs, self._ep_return, self._ep_length
        o_obs, o_next = nest(out, "observation"), nest(out, "next_observation")
        o_act, o_logp = out["action"], out["log_prob"]
        o_rew, o_term, o_trunc = out["reward"], out["terminated"], out["truncated"]
        o_ret, o_len, o_ver = out["episode_return"], out["episode_length"], out["policy_version"]
        o_nonfinite = out["nonfinite"] if env.nonfinite == "replace" else None  # else never set
        o_state = out.get("recurrent_state")  # a policy with memory: the state each step acts from
        store = _store_keys if isinstance(o_obs, dict) else _store
        masked, nvec = env.spec.masked, env.spec.action.nvec
        receiver.poll()  # new weights, if any, only at this boundary (or between steps, below)
        with torch.inference_mode():
            for t in range(o_rew.shape[0]):
                if self.poll_each_step and t:
                    receiver.poll()
                o_ver[t] = receiver.version
                obs_t = store(o_obs, t, obs)
                if masked:
                    refuse_empty(obs_t[MASK_KEY], nvec, env.id, ep_length)
                if o_state is not None:
                    o_state[t] = memory.state.numpy()
                action, log_prob = memory.act(to_torch(obs_t))
                o_act[t] = action.numpy()
                o_logp[t] = log_prob.numpy()
                next_obs, reward, terminated, truncated, obs = env.step(o_act[t])
                store(o_next, t, next_obs)
                o_rew[t] = reward
                o_term[t], o_trunc[t] = terminated, truncated
                if o_nonfinite is not None:
                    o_nonfinite[t] = env.replaced
                ep_return += reward
                ep_length += 1
                o_ret[t], o_len[t] = ep_return, ep_length
                done = terminated | truncated
                memory.forget(done)
                ep_return[done] = 0.0
                ep_length[done] = 0
        self._obs = map_obs(np.copy, obs)  # the env reuses its arrays

    def state_dict(self) -> dict | None:
        """Where every env is mid-episode, or None if the env's state cannot be captured."""
        envs = self.env.state_dict()
        if envs is None:
            if not self._warned_unsaveable:
                self._warned_unsaveable = True
                log.warning("the state of %s envs cannot be saved (not picklable): a resumed run starts "
                            "them on fresh episodes", self.env.id)
            return None
        memory = {} if self.memory.state is None else {"recurrent_state": self.memory.state.clone()}
        if self.memory.envs is not None:  # the envs' indices as the run began: a resumed run's seeds start later
            memory["env_indices"] = self.memory.envs.clone()
        return {"envs": envs, "obs": map_obs(lambda o: torch.from_numpy(o.copy()), self._obs), **memory,
                "episode_return": torch.from_numpy(self._ep_return.copy()),
                "episode_length": torch.from_numpy(self._ep_length.copy())}

    def load_state_dict(self, state: dict) -> None:
        self.env.load_state_dict(state["envs"])
        self._obs = map_obs(lambda o: o.numpy().copy(), state["obs"])
        self._ep_return = state["episode_return"].numpy().copy()
        self._ep_length = state["episode_length"].numpy().copy()
        if self.memory.state is not None:
            self.memory.state = _memory_of(state, self.memory.state.shape, self.env.id)
        if self.memory.envs is not None and "env_indices" in state:  # (DQN's per-env exploration rates)
            self.memory.envs = state["env_indices"].clone()


def _memory_of(state: dict, shape: torch.Size, env_id: str) -> torch.Tensor:
    """The envs' policy memory a checkpoint holds, or ValueError where it holds none that fits."""
    memory = state.get("recurrent_state")
    if memory is None or memory.shape != shape:
        raise ValueError(f"the checkpoint's {env_id} envs hold no policy memory of shape {tuple(shape)} (got "
                         f"{None if memory is None else tuple(memory.shape)}): it was saved by a network with another "
                         "algo.network.recurrent or recurrent_size")
    return memory.clone()


def _store(out: np.ndarray, t: int, obs: np.ndarray) -> np.ndarray:
    """Write ``obs`` into step ``t`` of ``out``; return that step's row (what the policy reads)."""
    out[t] = obs
    return out[t]


def _store_keys(out: dict[str, np.ndarray], t: int, obs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    for key, values in out.items():
        values[t] = obs[key]
    return {key: values[t] for key, values in out.items()}
