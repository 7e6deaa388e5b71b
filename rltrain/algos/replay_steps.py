"""When an off-policy learner (SAC, DQN) takes its gradient steps: ``utd`` per collected frame once ``warmup_frames``
are in (a fraction carried to the next batch), and the update under way, which a stop request between two gradient
steps leaves pending in the checkpoint, with the replay buffer, so that the resumed run finishes it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rltrain.algos.pending import Pending
from rltrain.data import ReplayBuffer


@dataclass
class PendingSteps(Pending):
    """The update under way: the gradient steps a batch is owed, and the metrics of those taken so far."""

    steps: int
    metrics: list[torch.Tensor] = field(default_factory=list)  # one stacked row per step taken


class GradientSteps:
    """The frames collected (the whole job's), the gradient steps they are owed, and the replay buffer they sample
    (this rank's, one of ``ranks`` equal ones), which a checkpoint holds with them."""

    def __init__(self, buffer: ReplayBuffer, utd: float, warmup_frames: int, ranks: int = 1):
        self.buffer, self.utd, self.warmup_frames, self.ranks = buffer, utd, warmup_frames, ranks
        self.refill = min(warmup_frames, buffer.capacity * ranks)  # what the buffers hold before learning (re)starts
        self.frames = 0
        self.owed = 0.0  # fractional gradient steps carried between batches
        self.pending: PendingSteps | None = None  # the update under way, until it ends

    @property
    def warming_up(self) -> bool:
        return self.frames < self.warmup_frames

    def collected(self, frames: int) -> None:
        """Count a batch of ``frames`` (this rank's, already in its buffer); the update it starts is owed none in the
        warm-up, nor while the buffers hold fewer than ``warmup_frames`` (or their capacity: a run resumed without
        them refills them first), else ``utd`` per frame."""
        self.frames += frames * self.ranks
        steps = 0
        if not self.warming_up and len(self.buffer) * self.ranks >= self.refill:
            self.owed += self.utd * frames * self.ranks
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

    def state_dict(self, replay_buffer: bool) -> dict:
        """The counters and, with ``replay_buffer``, the buffer and the update under way (its steps sample the
        buffer: without it, a resumed run cannot take them)."""
        state = {"frames": self.frames, "owed_steps": self.owed,
                 "pending": self.pending.state_dict() if self.pending is not None and replay_buffer else None}
        if replay_buffer:
            state["replay_buffer"] = self.buffer.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``; without a saved buffer, learning goes on from an empty one once it refills."""
        self.frames, self.owed = state["frames"], state["owed_steps"]
        self.pending = PendingSteps.from_state_dict(state["pending"], self.buffer.device)
        if "replay_buffer" in state:
            self.buffer.load_state_dict(state["replay_buffer"])


def mean_metrics(metrics: list[torch.Tensor]) -> list[float] | None:
    """The mean over the gradient steps of each metric (None for no step)."""
    return torch.stack(metrics).mean(0).tolist() if metrics else None
