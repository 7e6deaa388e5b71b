"""rltrain: declarative, config-driven reinforcement-learning training for PyTorch."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rltrain.factory import build
    from rltrain.trainer import Trainer, TrainState

__all__ = ["TrainState", "Trainer", "build"]


def __getattr__(name: str):
    # Lazy, so that spawned collector workers importing rltrain.envs or rltrain.algos.networks
    # do not pay for Hydra and tensordict (about a second of start-up each).
    if name == "build":
        from rltrain.factory import build

        return build
    if name in ("Trainer", "TrainState"):
        from rltrain import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'rltrain' has no attribute {name!r}")
