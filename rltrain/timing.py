"""Seconds spent per phase of the training loop, as run totals and as a window since the last read.

Phases are ``collect``, ``update``, ``sync``, ``eval``, ``log`` and ``hooks/<name>`` for every
other hook; ``hooks`` is their sum. Whatever no phase covers is ``other``, so a breakdown adds
up to the wall time.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

STANDARD_PHASES = ("collect", "update", "sync", "hooks", "eval", "log")


class PhaseTimer:
    """``with timer.phase("update"): ...`` adds the elapsed seconds to that phase.

    ``cuda_sync``: wait for queued CUDA work at both ends of a phase, so asynchronous kernels
    count towards the phase that launched them (costs a little speed; off by default).
    """

    def __init__(self, cuda_sync: bool = False):
        self.start = time.perf_counter()
        self.cuda_sync = cuda_sync
        self.totals: dict[str, float] = defaultdict(float)
        self._window: dict[str, float] = defaultdict(float)
        self.failed_in: str | None = None  # the phase an error came out of, if one did
        self.entered: Callable[[str], None] | None = None  # told each phase's name as it begins

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._sync()
        if self.entered is not None:
            self.entered(name)
        t0 = time.perf_counter()
        try:
            yield
        except BaseException:
            self.failed_in = self.failed_in or name  # the innermost phase under way (its handler runs first)
            raise
        finally:
            self._sync()
            dt = time.perf_counter() - t0
            self.totals[name] += dt
            self._window[name] += dt

    def _sync(self) -> None:
        if self.cuda_sync and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def drain_window(self) -> dict[str, float]:
        """Seconds per phase since the previous call, with ``hooks`` summing the ``hooks/<name>`` ones."""
        window, self._window = dict(self._window), defaultdict(float)
        hooks = sum(v for k, v in window.items() if k.startswith("hooks/"))
        return window | ({"hooks": hooks} if hooks else {})

    def breakdown(self) -> dict[str, float]:
        """Run totals per top-level phase (the standard ones always present), plus ``other`` so
        that they add up to the wall time."""
        totals = dict.fromkeys(STANDARD_PHASES, 0.0)
        for name, seconds in self.totals.items():
            top = name.split("/", 1)[0]
            totals[top] = totals.get(top, 0.0) + seconds
        totals["other"] = max(self.elapsed() - sum(totals.values()), 0.0)
        return {k: round(v, 4) for k, v in totals.items()}

    def hook_breakdown(self) -> dict[str, float]:
        """Run totals of the ``hooks/<name>`` phases, by hook name."""
        return {k.split("/", 1)[1]: round(v, 4) for k, v in self.totals.items() if k.startswith("hooks/")}

    def state_dict(self) -> dict:
        return {"elapsed": self.elapsed(), "totals": dict(self.totals), "window": dict(self._window)}

    def load_state_dict(self, state: dict) -> None:
        """Continue the saved totals: the wall time of a resumed run counts every session's training."""
        self.start = time.perf_counter() - state["elapsed"]
        self.totals = defaultdict(float, state["totals"])
        self._window = defaultdict(float, state["window"])


def format_table(summary: dict) -> str:
    """The end-of-run timing table: seconds and share per phase (hooks by name), frames/s, updates/s."""
    wall = summary["wall_time_s"] or 1e-9
    lines = [f"{'phase':<22}{'seconds':>10}{'share':>8}"]
    for phase, seconds in summary["time"].items():
        lines.append(f"{phase:<22}{seconds:>10.2f}{seconds / wall:>8.1%}")
        if phase == "hooks":
            for name, s in summary.get("time_hooks", {}).items():
                lines.append(f"{'  ' + name:<22}{s:>10.2f}{s / wall:>8.1%}")
    lines.append(f"{'wall time':<22}{summary['wall_time_s']:>10.2f}{1:>8.0%}")
    lines.append(f"{summary['frames']:,} frames at {summary['fps']:,.0f}/s, "
                 f"{summary['updates']:,} updates at {summary['updates'] / wall:,.1f}/s")
    return "\n".join(lines)
