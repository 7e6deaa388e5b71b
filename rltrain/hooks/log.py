"""Turns the metric window into one row per log step and hands it to every logger."""

from __future__ import annotations

import time
from collections.abc import Sequence
from types import MappingProxyType

from rltrain.hooks.base import Every, Hook
from rltrain.loggers import Logger
from rltrain.rules import Flag
from rltrain.state import TrainState


class LogHook(Hook):
    """Writes a row of ``frames``, ``updates``, the metric window (means, and the ``time/<phase>``
    seconds the timing hook folded in) and ``perf/fps`` on its schedule, and one at the end."""

    phase = "log"

    def __init__(self, loggers: Sequence[Logger], every: Every = MappingProxyType({"seconds": 2}), at_end: Flag = True):
        super().__init__(every, at_end)
        self.loggers = list(loggers)
        self._last_frames, self._last_time = 0, time.perf_counter()

    def on_start(self, state: TrainState) -> None:
        self._last_frames, self._last_time = state.frames, time.perf_counter()

    def on_update(self, state: TrainState) -> None:
        self.write_row(state)

    def write_row(self, state: TrainState) -> None:
        now = time.perf_counter()
        row: dict[str, float] = {"frames": state.frames, "updates": state.updates}
        if state.episodes.recent_returns:
            row["train/episode_return"] = state.episodes.mean_return
            row["train/episode_length"] = state.episodes.mean_length
        row.update(state.window.drain())
        elapsed = now - self._last_time
        row["perf/fps"] = round((state.frames - self._last_frames) / elapsed, 1) if elapsed > 0 else 0.0
        row["sync/version"] = state.sync.version
        self._last_frames, self._last_time = state.frames, now
        for logger in self.loggers:
            logger.log(row, step=state.frames)
