"""rltrain: declarative, config-driven reinforcement-learning training for PyTorch."""

from __future__ import annotations

from typing import TYPE_CHECKING

# Importing rltrain as a library changes nothing in torch: lazy_dynamo is installed only where
# rltrain owns the process (rltrain.cli, collector worker processes, collector ranks via the CLI).

if TYPE_CHECKING:
    from rltrain.factory import build
    from rltrain.state import TrainState
    from rltrain.trainer import Trainer

__all__ = ["TrainState", "Trainer", "build"]


def __getattr__(name: str):
    # Lazy, so that spawned collector workers importing rltrain.envs or rltrain.algos.networks
    # do not pay for Hydra and tensordict (about a second of start-up each).
    if name == "build":
        from rltrain.factory import build

        return build
    if name == "Trainer":
        from rltrain.trainer import Trainer

        return Trainer
    if name == "TrainState":
        from rltrain.state import TrainState

        return TrainState
    raise AttributeError(f"module 'rltrain' has no attribute {name!r}")
