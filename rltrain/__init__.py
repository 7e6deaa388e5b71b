"""rltrain: declarative, config-driven reinforcement-learning training for PyTorch."""

from rltrain.build import build
from rltrain.trainer import Trainer, TrainState

__all__ = ["TrainState", "Trainer", "build"]
