"""When an off-policy learner (SAC, DQN) takes its gradient steps: ``utd`` per collected frame once ``warmup_frames``
are in (a fraction carried to the next batch), and the update under way, which a stop request between two gradient
steps leaves pending in the checkpoint so that the resumed run finishes it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rltrain.algos.pending import Pending


@dataclass
class PendingSteps(Pending):
    """The update under way: the gradient steps a batch is owed, and the metrics of those taken so far."""

    steps: int
    metrics: list[torch.Tensor] = field(default_factory=list)  # one stacked row per step taken


class GradientSteps:
    """The frames collected (the whole job's) and the gradient steps they are owed."""

    def __init__(self, utd: float, warmup_frames: int, device: torch.device, capacity: int):
        self.utd, self.warmup_frames, self.device = utd, warmup_frames, device
        self.refill = min(warmup_frames, capacity)  # what a replay buffer holds before learning (re)starts
        self.frames = 0
        self.owed = 0.0  # fractional gradient steps carried between batches
        self.pending: PendingSteps | None = None  # the update under way, until it ends

    @property
    def warming_up(self) -> bool:
        return self.frames < self.warmup_frames

    def collected(self, frames: int, buffered: int) -> None:
        """Count a batch of ``frames``; the update it starts is owed none in the warm-up, nor while the replay buffer
        holds fewer than ``warmup_frames`` (or its ``capacity``: ``buffered`` and it are the whole job's; a run
        resumed without its buffer refills it first), else ``utd`` per frame."""
        self.frames += frames
        steps = 0
        if not self.warming_up and buffered >= self.refill:
            self.owed += self.utd * frames
            steps, self.owed = int(self.owed), self.owed - int(self.owed)
        self.pending = PendingSteps(steps)

    def take(self, step: Callable[[], torch.Tensor], should_stop: Callable[[], bool]) -> list[torch.Tensor] | None:
        """Run the steps still owed (``step()`` returns one step's metrics); their metrics, or None if
        ``should_stop()`` turned true between two (they stay pending)."""
        p = self.pending or PendingSteps(0)  # resumed mid-update, but without the replay buffer
        for _ in range(len(p.metrics), p.steps):
            if should_stop():
                return None
            p.metrics.append(step())
        self.pending = None
        return p.metrics

    def state_dict(self, pending: bool) -> dict:
        """The counters, and (``pending``: only with the replay buffer its steps sample) the update under way."""
        return {"frames": self.frames, "owed_steps": self.owed,
                "pending": self.pending.state_dict() if self.pending is not None and pending else None}

    def load_state_dict(self, state: dict) -> None:
        self.frames, self.owed = state["frames"], state["owed_steps"]
        self.pending = PendingSteps.from_state_dict(state["pending"], self.device)


def mean_metrics(metrics: list[torch.Tensor]) -> list[float] | None:
    """The mean over the gradient steps of each metric (None for no step)."""
    return torch.stack(metrics).mean(0).tolist() if metrics else None
