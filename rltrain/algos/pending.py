"""An update that a stop request interrupted between two gradient steps, as a record (PPO's ``PendingEpochs``,
the ``PendingSteps`` of SAC and DQN in ``replay_steps.py``) that a checkpoint holds as a dict of plain values."""

from __future__ import annotations

from dataclasses import fields
from typing import Any, TypeVar

import torch
from tensordict import TensorDictBase

P = TypeVar("P", bound="Pending")


class Pending:
    """The base of an algo's pending-update dataclass: saved as ``{field name: value}`` (tensors,
    lists of them, numbers), and read back (on the CPU) onto the learner's device."""

    def state_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_state_dict(cls: type[P], state: dict[str, Any] | None, device: torch.device) -> P | None:
        """The record ``state_dict`` saved (None for none), its tensors on ``device``."""
        return None if state is None else cls(**{k: _to_device(v, device) for k, v in state.items()})


def _to_device(value: Any, device: torch.device) -> Any:
    """``value`` (a tensor, a Dict observation's TensorDict, a list of them, or a plain number) on ``device``."""
    if isinstance(value, (torch.Tensor, TensorDictBase)):
        return value.to(device)
    if isinstance(value, list):
        return [_to_device(v, device) for v in value]
    return value
