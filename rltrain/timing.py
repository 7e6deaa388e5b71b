"""Seconds spent per phase of the training loop, as run totals and as a window since the last read."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager


STANDARD_PHASES = ("collect", "update", "sync", "hooks", "eval", "log")


class PhaseTimer:
    """``with timer.phase("update"): ...`` adds the elapsed seconds to that phase."""

    def __init__(self):
        self.start = time.perf_counter()
        self.totals: dict[str, float] = defaultdict(float)
        self._window: dict[str, float] = defaultdict(float)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            self.totals[name] += dt
            self._window[name] += dt

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def drain_window(self) -> dict[str, float]:
        """Seconds per phase since the previous call."""
        window, self._window = dict(self._window), defaultdict(float)
        return window

    def breakdown(self) -> dict[str, float]:
        """Run totals per phase (the standard ones always present), plus ``other`` so that they add
        up to the wall time."""
        totals = {phase: 0.0 for phase in STANDARD_PHASES} | dict(self.totals)
        totals["other"] = max(self.elapsed() - sum(totals.values()), 0.0)
        return {k: round(v, 4) for k, v in totals.items()}
