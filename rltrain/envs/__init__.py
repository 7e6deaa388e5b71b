"""Gymnasium environments batched in-process (a loop, or the simulator's own vector env) and
described as TensorDict-ready specs."""

from rltrain.envs.batched import BatchedEnv, EnvBatch, EnvSpec, resolve_env_spec
from rltrain.envs.normalization import ObsNormalizer, ReturnNormalizer
from rltrain.envs.spaces import ActionSpec, Leaf
from rltrain.envs.vector import VectorBatchedEnv, make_envs

__all__ = ["ActionSpec", "BatchedEnv", "EnvBatch", "EnvSpec", "Leaf", "ObsNormalizer", "ReturnNormalizer",
           "VectorBatchedEnv", "make_envs", "resolve_env_spec"]
