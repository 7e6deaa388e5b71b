"""The hook interface and its schedule.

A hook is a small class whose methods are named after the moment they run, each given the
``TrainState``. ``on_update`` runs when the hook's schedule is due: ``every: {frames|batches|
updates|seconds: N}`` in the config, after every update when ``every`` is left out, and never when
it is null (then the hook acts only at its other moments). With ``at_end``, ``on_update`` also runs
once more when the run finishes normally (the final evaluation, log row, checkpoint); such a hook
due at the very last update runs only then, once, after the hooks before it (the final log row
holds the final evaluation).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Annotated, Any

from rltrain.errors import ConfigError
from rltrain.rules import Flag, Integer, Number, Rule

if TYPE_CHECKING:
    from tensordict import TensorDict

    from rltrain.state import TrainState

SCHEDULE_UNITS = ("frames", "batches", "updates", "seconds")
EVERY_UPDATE = MappingProxyType({"updates": 1})  # read-only: a safe default argument


class ScheduleRule(Rule):
    """A hook's ``every``: null, or one of ``{frames|batches|updates|seconds: N}`` with N > 0 (an
    integer, but for seconds). The config check and ``Schedule`` both ask this one rule."""

    allowed = f"null or one of {{{'|'.join(SCHEDULE_UNITS)}: N}}"

    def check(self, key: str, value: Any) -> None:
        if value is None:
            return
        if not isinstance(value, Mapping) or len(value) != 1 or next(iter(value)) not in SCHEDULE_UNITS:
            raise ConfigError(f"{key} must be {self.allowed} (got {value!r})")
        unit, n = next(iter(value.items()))
        (Number(above=0) if unit == "seconds" else Integer(1)).check(f"{key}.{unit}", n)


# The type of every hook's ``every`` parameter (a subclass that leaves it unannotated keeps the rule).
Every = Annotated[Mapping[str, float] | None, ScheduleRule()]


class Schedule:
    """Due once per ``n`` frames, batches, updates or seconds (crossing each multiple once); never if
    ``every`` is None."""

    def __init__(self, every: Mapping[str, float] | None):
        ScheduleRule().check("every", every)
        self.unit, self.n = next(iter(every.items())) if every is not None else (None, None)
        self._last_mark = 0
        self._last_time = time.monotonic()

    def catch_up(self, state: TrainState) -> None:
        """Count the multiples already behind ``state`` as done (a resumed run starts mid-way)."""
        self._last_time = time.monotonic()
        if self.unit not in (None, "seconds"):
            self._last_mark = int(state.count_at_last_update(self.unit) // self.n)

    def due(self, state: TrainState) -> bool:
        if self.unit is None:
            return False
        if self.unit == "seconds":
            now = time.monotonic()
            if now - self._last_time >= self.n:
                self._last_time = now
                return True
            return False
        mark = int(getattr(state, self.unit) // self.n)
        if mark > self._last_mark:
            self._last_mark = mark
            return True
        return False


class Hook:
    """Base class for hooks; override the moments you need. ``phase`` names the timer bucket."""

    phase = "hooks"
    # With a data-parallel learner (strategy=ddp), whether the hook runs on every rank (it feeds the rank's own
    # collector, or each rank has a part in what it does) or on rank 0 only (logging, evaluating, saving).
    ALL_RANKS = False
    # Whether it runs the learner's model (evaluating or saving it): a sharded learner's (strategy=fsdp) forward
    # passes and state dicts are collectives of all ranks, so there it runs on every rank (rank 0 records).
    RUNS_LEARNER = False

    def __init__(self, every: Every = EVERY_UPDATE, at_end: Flag = False):
        self.schedule = Schedule(every)
        self.at_end = at_end

    def on_start(self, state: TrainState) -> None:
        """Once, before the first batch is collected."""

    def on_batch(self, state: TrainState, batch: TensorDict) -> None:
        """After each batch arrives, before the update."""

    def on_update(self, state: TrainState) -> None:
        """After an update, when the schedule is due (and at the end, with ``at_end``)."""

    def on_end(self, state: TrainState) -> None:
        """Once, after the last update of a run that finished normally: ``on_update`` if ``at_end``."""
        if self.at_end:
            self.on_update(state)

    def on_interrupt(self, state: TrainState) -> None:
        """Once, after the last update of a run stopped by SIGINT or SIGTERM (instead of ``on_end``;
        after it, for a hook before the evaluation when the stop ends the final evaluation)."""

    def on_failure(self, state: TrainState, error: Exception) -> None:
        """Once, when the run fails outside the learner (a collector, an engine, a reward, an evaluation,
        a weight push, another hook), its state whole: a hook that keeps the learner's work keeps it now."""

    def close(self, state: TrainState, summary: dict[str, Any]) -> None:
        """Always, after summary.json is written (also after Ctrl-C or an error): release resources."""

    def state_dict(self) -> dict[str, Any]:
        """What this hook keeps across a resume (plain values and tensors), saved in checkpoints under
        the hook's name; a hook that keeps nothing returns {}."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s result, before ``on_start`` of a resumed run."""
