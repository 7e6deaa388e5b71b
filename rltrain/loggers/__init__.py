"""Loggers: where the metric rows of each log step go (console, files, wandb)."""

from rltrain.loggers.base import Logger
from rltrain.loggers.console import ConsoleLogger
from rltrain.loggers.files import CsvLogger, JsonlLogger

__all__ = ["ConsoleLogger", "CsvLogger", "JsonlLogger", "Logger"]
