"""An update that a stop request interrupted between two gradient steps: its data and progress
travel in the algo's ``state_dict`` (read back on the CPU), and move to the learner's device again."""

from __future__ import annotations

from typing import Any

import torch


def to_device(pending: Any, device: torch.device) -> Any:
    """``pending`` (dicts, lists and tensors) with every tensor on ``device``."""
    if isinstance(pending, torch.Tensor):
        return pending.to(device)
    if isinstance(pending, dict):
        return {k: to_device(v, device) for k, v in pending.items()}
    if isinstance(pending, list):
        return [to_device(v, device) for v in pending]
    return pending
