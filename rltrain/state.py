"""What every hook sees: ``TrainState`` (counters, recent results, the run dir) and the metric
window that becomes the next log row. A module of its own, so that hooks and the trainer both
import it and neither imports the other.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from rltrain.timing import PhaseTimer


class MetricWindow:
    """The metrics reported since the last ``drain``: means (losses over the updates of a log step),
    sums (seconds per phase) and latest values (an evaluation's result, which the summary repeats)."""

    def __init__(self):
        self._sums: dict[str, float] = defaultdict(float)
        self._counts: dict[str, int] = defaultdict(int)
        self._totals: dict[str, float] = defaultdict(float)
        self._latest: dict[str, float] = {}

    def add(self, metrics: Mapping[str, float]) -> None:
        """Values to average over the window (losses, returns)."""
        for k, v in metrics.items():
            self._sums[k] += v
            self._counts[k] += 1

    def accumulate(self, metrics: Mapping[str, float]) -> None:
        """Values to sum over the window (seconds per phase)."""
        for k, v in metrics.items():
            self._totals[k] += v

    def set(self, metrics: Mapping[str, float]) -> None:
        """Values of which the window reports the latest (the last evaluation's return)."""
        self._latest.update(metrics)

    def drain(self) -> dict[str, float]:
        out = {k: self._sums[k] / self._counts[k] for k in self._sums} | dict(self._totals) | self._latest
        self._sums.clear()
        self._counts.clear()
        self._totals.clear()
        self._latest = {}
        return out

    def state_dict(self) -> dict:
        return {"sums": dict(self._sums), "counts": dict(self._counts), "totals": dict(self._totals),
                "latest": dict(self._latest)}

    def load_state_dict(self, state: dict) -> None:
        self._sums = defaultdict(float, state["sums"])
        self._counts = defaultdict(int, state["counts"])
        self._totals = defaultdict(float, state["totals"])
        self._latest = dict(state.get("latest", {}))


@dataclass
class TrainState:
    """What every hook sees: counters, recent results and the run directory."""

    run_dir: Path
    total_frames: int
    return_window: int = 10
    frames: int = 0
    batches: int = 0
    updates: int = 0
    version: int = 0  # the learner's latest pushed policy version
    pushes: int = 0
    metrics: dict[str, float] = field(default_factory=dict)  # the last update's metrics
    episodes: int = 0
    recent_returns: deque = field(init=False)  # returns of the last `return_window` finished training episodes
    recent_lengths: deque = field(init=False)
    eval_return: float | None = None  # the latest evaluation's mean return
    eval_return_sum: float = 0.0  # summed over every evaluation of the run, for mean_eval_return
    evaluations: int = 0
    solved_at_frames: int | None = None
    lag_sum: float = 0.0
    lag_max: int = 0
    dropped_batches: int = 0  # batches over the collector's max_lag, not trained on
    dropped_frames: int = 0  # their frames (not counted in ``frames``)
    nonfinite_frames: int = 0  # env.nonfinite=replace: frames whose NaN/inf observation or reward became 0
    skipped_steps: int = 0  # algo.nonfinite=skip: gradient steps skipped for a NaN/inf loss or gradient
    # > 0: a stop request interrupted the update on a batch of this many frames, between two gradient
    # steps; the algo's state holds the rest of that update, and its hooks have not fired yet.
    mid_update_frames: int = 0
    window: MetricWindow = field(default_factory=MetricWindow)
    timer: PhaseTimer = field(default_factory=PhaseTimer)
    should_stop: bool = False  # a hook may set this to end the run after the current update
    stop_signal: int | None = None  # SIGINT or SIGTERM asked the run to stop after the current step

    _COUNTERS = ("frames", "batches", "updates", "version", "pushes", "episodes", "eval_return", "eval_return_sum",
                 "evaluations",
                 "solved_at_frames", "lag_sum", "lag_max", "dropped_batches", "dropped_frames", "nonfinite_frames",
                 "skipped_steps",
                 "mid_update_frames")

    def __post_init__(self):
        self.recent_returns = deque(maxlen=self.return_window)
        self.recent_lengths = deque(maxlen=self.return_window)

    def state_dict(self) -> dict:
        """Counters, the recent-episode windows, the pending metric window and the timer."""
        state = {name: getattr(self, name) for name in self._COUNTERS}
        state |= {"recent_returns": list(self.recent_returns), "recent_lengths": list(self.recent_lengths),
                  "window": self.window.state_dict(), "timer": self.timer.state_dict()}
        return state

    def load_state_dict(self, state: dict) -> None:
        for name in self._COUNTERS:  # a checkpoint of an older rltrain lacks the newer counters
            setattr(self, name, state.get(name, getattr(self, name)))
        self.recent_returns.extend(state["recent_returns"])
        self.recent_lengths.extend(state["recent_lengths"])
        self.window.load_state_dict(state["window"])
        self.timer.load_state_dict(state["timer"])

    def count_at_last_update(self, unit: str) -> int:
        """``frames``, ``batches`` or ``updates`` as they were when the update hooks last fired."""
        count = getattr(self, unit)
        if self.mid_update_frames:  # the interrupted update's batch is counted, its hooks are still owed
            count -= {"frames": self.mid_update_frames, "batches": 1}.get(unit, 0)
        return count

    @property
    def dropped_share(self) -> float:
        """The share of collected frames dropped for being over max_lag."""
        collected = self.frames + self.dropped_frames
        return self.dropped_frames / collected if collected else 0.0

    @property
    def train_return(self) -> float | None:
        """Mean return of the last ``return_window`` finished training episodes."""
        return sum(self.recent_returns) / len(self.recent_returns) if self.recent_returns else None

    @property
    def mean_eval_return(self) -> float | None:
        """The mean of every evaluation of the run: the area under its eval curve per evaluation."""
        return self.eval_return_sum / self.evaluations if self.evaluations else None

    @property
    def train_length(self) -> float | None:
        return sum(self.recent_lengths) / len(self.recent_lengths) if self.recent_lengths else None
