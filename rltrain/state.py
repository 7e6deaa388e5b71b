"""What every hook sees: ``TrainState`` (the run dir, the run's figures in small records that save
themselves, the last update's metrics) and the metric window that becomes the next log row. A
module of its own, so that hooks and the trainer both import it and neither imports the other.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Mapping
from dataclasses import InitVar, dataclass, field, fields
from pathlib import Path
from typing import Any

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
        self._latest = dict(state["latest"])


class Record:
    """A group of the run's figures (a dataclass) that saves itself: its checkpoint state is every
    field it has, so a new field is saved and restored with no list to keep. A checkpoint written
    before the field existed is upgraded by a migration step in ``rltrain.checkpoint``."""

    def state_dict(self) -> dict[str, Any]:
        return {f.name: list(value) if isinstance(value := getattr(self, f.name), deque) else value
                for f in fields(self)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if missing := [f.name for f in fields(self) if f.name not in state]:
            raise KeyError(f"the saved {type(self).__name__} lacks {', '.join(missing)}: a checkpoint format "
                           "without them needs a migration step (rltrain.checkpoint.MIGRATIONS)")
        for f in fields(self):
            if isinstance(current := getattr(self, f.name), deque):  # keeps its maxlen
                current.clear()
                current.extend(state[f.name])
            else:
                setattr(self, f.name, state[f.name])


@dataclass
class Progress(Record):
    """How far the run is. ``frames``, ``batches`` and ``updates`` are what schedules count."""

    frames: int = 0
    batches: int = 0
    updates: int = 0
    solved_at_frames: int | None = None
    # > 0: a stop request interrupted the update on a batch of this many frames, between two gradient
    # steps; the algo's state holds the rest of that update, and its hooks have not fired yet.
    mid_update_frames: int = 0


@dataclass
class Episodes(Record):
    """Finished training episodes: how many, and the returns and lengths of the last ``window``."""

    window: InitVar[int] = 10
    count: int = 0
    recent_returns: deque = field(init=False)
    recent_lengths: deque = field(init=False)

    def __post_init__(self, window: int):
        self.recent_returns = deque(maxlen=window)
        self.recent_lengths = deque(maxlen=window)

    def add(self, returns: list[float], lengths: list[int]) -> None:
        self.recent_returns.extend(returns)
        self.recent_lengths.extend(lengths)
        self.count += len(returns)

    @property
    def mean_return(self) -> float | None:
        """Mean return of the last ``window`` episodes (summary.json's ``train_return``)."""
        return sum(self.recent_returns) / len(self.recent_returns) if self.recent_returns else None

    @property
    def mean_length(self) -> float | None:
        return sum(self.recent_lengths) / len(self.recent_lengths) if self.recent_lengths else None


@dataclass
class SyncFigures(Record):
    """Weight pushes, and how old the weights were that collected each batch."""

    version: int = 0  # the learner's latest pushed policy version
    pushes: int = 0
    lag_sum: float = 0.0  # each trained-on batch's mean lag, summed (over progress.batches: the run's mean)
    lag_max: int = 0
    dropped_batches: int = 0  # batches over the collector's max_lag, not trained on
    dropped_frames: int = 0  # their frames (not counted in progress.frames)


@dataclass
class EvalFigures(Record):
    """The evaluations of the run (the eval hook's results)."""

    last_return: float | None = None  # the latest evaluation's mean return (summary.json's eval_return)
    return_sum: float = 0.0  # summed over every evaluation, for mean_return
    count: int = 0

    def add(self, mean_return: float) -> None:
        self.last_return = mean_return
        self.return_sum += mean_return
        self.count += 1

    @property
    def mean_return(self) -> float | None:
        """The mean of every evaluation of the run: the area under its eval curve per evaluation."""
        return self.return_sum / self.count if self.count else None


@dataclass
class NonfiniteCounts(Record):
    """NaN/inf kept out of training (summary.json's ``nonfinite``)."""

    env_frames: int = 0  # env.nonfinite=replace: frames whose NaN/inf observation or reward became 0
    skipped_steps: int = 0  # algo.nonfinite=skip: gradient steps skipped for a NaN/inf loss or gradient


@dataclass
class TrainState:
    """What every hook sees: the run dir, the run's figures, the last update's metrics, the metric
    window and the phase timer. A checkpoint saves every field that saves itself (the records, the
    window, the timer); a hook's own state is the hook's (``Hook.state_dict``)."""

    run_dir: Path
    total_frames: int
    return_window: InitVar[int] = 10
    progress: Progress = field(default_factory=Progress)
    episodes: Episodes = field(init=False)
    sync: SyncFigures = field(default_factory=SyncFigures)
    evals: EvalFigures = field(default_factory=EvalFigures)
    nonfinite: NonfiniteCounts = field(default_factory=NonfiniteCounts)
    metrics: dict[str, float] = field(default_factory=dict)  # the last update's metrics (the next one replaces them)
    window: MetricWindow = field(default_factory=MetricWindow)
    timer: PhaseTimer = field(default_factory=PhaseTimer)
    should_stop: bool = False  # a hook may set this to end the run after the current update
    stop_signal: int | None = None  # SIGINT or SIGTERM asked the run to stop after the current step

    def __post_init__(self, return_window: int):
        self.episodes = Episodes(return_window)

    def _saved(self) -> dict[str, Record | MetricWindow | PhaseTimer]:
        return {f.name: value for f in fields(self)
                if isinstance(value := getattr(self, f.name), (Record, MetricWindow, PhaseTimer))}

    def state_dict(self) -> dict[str, dict]:
        """Each part that saves itself, under its field name."""
        return {name: part.state_dict() for name, part in self._saved().items()}

    def load_state_dict(self, state: Mapping[str, dict]) -> None:
        for name, part in self._saved().items():
            part.load_state_dict(state[name])

    # The counts schedules count in (``every: {frames|batches|updates: N}``), read most by hooks.
    @property
    def frames(self) -> int:
        return self.progress.frames

    @property
    def batches(self) -> int:
        return self.progress.batches

    @property
    def updates(self) -> int:
        return self.progress.updates

    def count_at_last_update(self, unit: str) -> int:
        """``frames``, ``batches`` or ``updates`` as they were when the update hooks last fired."""
        count = getattr(self.progress, unit)
        # An interrupted update's batch is counted; its hooks are still owed.
        if mid_update := self.progress.mid_update_frames:
            count -= {"frames": mid_update, "batches": 1}.get(unit, 0)
        return count

    @property
    def dropped_share(self) -> float:
        """The share of collected frames dropped for being over max_lag."""
        collected = self.progress.frames + self.sync.dropped_frames
        return self.sync.dropped_frames / collected if collected else 0.0
