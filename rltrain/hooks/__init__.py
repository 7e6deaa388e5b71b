"""Hooks: small classes the trainer calls at its events, on a schedule that is data in the config."""

from rltrain.hooks.base import Hook, Schedule
from rltrain.hooks.checkpoint import CheckpointHook
from rltrain.hooks.eval import EvalHook, Evaluation
from rltrain.hooks.generation_eval import GenerationEvalHook
from rltrain.hooks.log import LogHook
from rltrain.hooks.progress import ProgressHook
from rltrain.hooks.save_pretrained import SavePretrainedHook
from rltrain.hooks.timing import TimingHook
from rltrain.hooks.weight_push import WeightPushHook

__all__ = ["CheckpointHook", "EvalHook", "Evaluation", "GenerationEvalHook", "Hook", "LogHook", "ProgressHook",
           "SavePretrainedHook", "Schedule", "TimingHook", "WeightPushHook"]
