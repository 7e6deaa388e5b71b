"""Gymnasium environments batched in-process (a loop, or the simulator's own vector env) and
described as TensorDict-ready specs."""

from rltrain.envs.batched import BatchedEnv, GymnasiumBatchedEnv, resolve_env_spec
from rltrain.envs.spaces import ActionSpec, EnvSpec, Leaf
from rltrain.envs.vector import VectorBatchedEnv, make_envs

__all__ = ["ActionSpec", "BatchedEnv", "EnvSpec", "GymnasiumBatchedEnv", "Leaf", "VectorBatchedEnv", "make_envs",
           "resolve_env_spec"]
