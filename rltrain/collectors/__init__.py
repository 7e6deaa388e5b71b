"""Collectors: run envs with a policy copy fed by weight sync, and yield TensorDict batches."""

from rltrain.collectors.local import LocalCollector

__all__ = ["LocalCollector"]
