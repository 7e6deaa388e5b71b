"""Hooks: small classes the trainer calls at its events, on a schedule that is data in the config."""

from rltrain.hooks.base import Hook, Schedule
from rltrain.hooks.eval import EvalHook
from rltrain.hooks.log import LogHook
from rltrain.hooks.weight_push import WeightPushHook

__all__ = ["EvalHook", "Hook", "LogHook", "Schedule", "WeightPushHook"]
