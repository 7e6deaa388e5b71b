"""A hook the GRPO benchmark (benchmarks/llm.py) plugs into a ``python -m rltrain algo=grpo`` run
(``+hooks.clock._target_=benchmarks.step_clock.StepClock +hooks.clock.path=FILE``), the counterpart
of the per-step callback in benchmarks/trl_grpo.py.

Fired after every update, and last (it is added after the config's hooks), it records the wall
seconds of each training step: from the previous step's end (the first: from the start of the run's
hooks) to this one's, so a step holds the generation of its batch, the scoring, the update and every
hook. It also records each batch's mean reward and the first step whose last-``window`` mean reaches
``threshold`` (the run then stops, unless ``stop`` is false), and writes all of it as JSON when the
run closes."""

from __future__ import annotations

import json
import time
from pathlib import Path

from rltrain.hooks import Hook


class StepClock(Hook):
    def __init__(self, path: str, threshold: float = 0.8, window: int = 10, stop: bool = True, every=None):
        super().__init__(every if every is not None else {"updates": 1})
        self.path, self.threshold, self.window, self.stop = Path(path), threshold, window, stop
        self.start = self.last = None
        self.seconds: list[float] = []
        self.rewards: list[float] = []
        self.reached = None  # {"step", "wall_s"}

    def on_start(self, state) -> None:
        self.start = self.last = time.perf_counter()

    def on_batch(self, state, batch) -> None:
        self.rewards.append(float(batch["reward"].float().mean()))

    def on_update(self, state) -> None:
        now = time.perf_counter()
        self.seconds.append(now - self.last)
        self.last = now
        recent = self.rewards[-self.window:]
        if self.reached is None and len(recent) == self.window and sum(recent) / self.window >= self.threshold:
            self.reached = {"step": len(self.rewards), "wall_s": now - self.start}
            if self.stop:
                state.should_stop = True

    def close(self, state, summary) -> None:
        self.path.write_text(json.dumps({
            "step_seconds": self.seconds, "step_rewards": self.rewards,
            "threshold_step": self.reached and self.reached["step"],
            "threshold_wall_s": self.reached and self.reached["wall_s"]}))
