"""A live progress bar on interactive terminals; plain periodic lines elsewhere (CI, log files)."""

from __future__ import annotations

import logging
import sys
import time
from contextlib import ExitStack
from datetime import timedelta
from types import MappingProxyType
from typing import Annotated

from rltrain.hooks.base import Every, Hook
from rltrain.rules import OneOf
from rltrain.state import TrainState

log = logging.getLogger("rltrain")


class ProgressHook(Hook):
    """Frames / total, fps, the latest training and eval returns, the share of frames dropped as too
    old (collector=async, when any), and the time left.

    ``bar``: ``auto`` draws a tqdm bar when stderr is a terminal (log lines scroll above it);
    ``false`` always prints plain lines, one per ``every`` (``true`` forces the bar).
    """

    def __init__(self, every: Every = MappingProxyType({"seconds": 30}),
                 bar: Annotated[bool | str, OneOf((True, False, "auto"), "auto, true or false")] = "auto"):
        super().__init__(every)
        self.bar_mode = bar
        self._bar = None
        self._stack = ExitStack()
        self._start_frames, self._start_time = 0, time.perf_counter()

    def on_start(self, state: TrainState) -> None:
        self._start_frames, self._start_time = state.frames, time.perf_counter()
        if self.bar_mode is True or (self.bar_mode == "auto" and sys.stderr.isatty()):
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._bar = self._stack.enter_context(tqdm(
                total=state.total_frames, initial=state.frames, unit="frame", unit_scale=True,
                dynamic_ncols=True, file=sys.stderr, smoothing=0.05, leave=True))
            self._stack.enter_context(logging_redirect_tqdm())

    def on_batch(self, state: TrainState, batch) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(self._returns(state), refresh=False)
            self._bar.update(state.frames - self._bar.n)

    def on_update(self, state: TrainState) -> None:
        if self._bar is None:
            log.info(self.line(state))

    def line(self, state: TrainState) -> str:
        elapsed = time.perf_counter() - self._start_time
        fps = (state.frames - self._start_frames) / elapsed if elapsed > 0 else 0.0
        left = max(state.total_frames - state.frames, 0)
        eta = str(timedelta(seconds=round(left / fps))) if fps > 0 else "?"
        return (f"progress {state.frames:,}/{state.total_frames:,} frames ({state.frames / state.total_frames:.1%})"
                f" | {fps:,.0f} fps | {self._returns(state)} | ETA {eta}")

    @staticmethod
    def _returns(state: TrainState) -> str:
        train = "-" if (mean := state.episodes.mean_return) is None else f"{mean:.1f}"
        evaluation = "-" if (last := state.evals.last_return) is None else f"{last:.1f}"
        dropped = f" | dropped {state.dropped_share:.1%}" if state.sync.dropped_frames else ""
        return f"return {train} | eval {evaluation}{dropped}"

    def close(self, state: TrainState, summary) -> None:
        self._stack.close()
        self._bar = None
