"""Gymnasium environments batched in-process and described as TensorDict-ready specs."""

from rltrain.envs.batched import BatchedEnv, EnvSpec, resolve_env_spec
from rltrain.envs.normalization import ObsNormalizer, ReturnNormalizer

__all__ = ["BatchedEnv", "EnvSpec", "ObsNormalizer", "ReturnNormalizer", "resolve_env_spec"]
