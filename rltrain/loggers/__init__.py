"""Loggers: where the metric rows of each log step go (console, files, wandb, tensorboard)."""

from rltrain.loggers.base import Logger
from rltrain.loggers.console import ConsoleLogger
from rltrain.loggers.files import CsvLogger, JsonlLogger
from rltrain.loggers.tensorboard import TensorboardLogger

__all__ = ["ConsoleLogger", "CsvLogger", "JsonlLogger", "Logger", "TensorboardLogger"]
