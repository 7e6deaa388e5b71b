"""What every category shares: summary statistics, interleaved timing, tables and the peers.

A category module has ``NAME``, ``TITLE`` and ``run(ctx) -> list[Table]``. Rows compare libraries
measured in the same run: function-level cases alternate rounds between the libraries
(``interleave``), whole programs alternate whole processes. Ratios are always "how many times
better rltrain is" (peer / rltrain for times, rltrain / peer for rates), so > 1 means rltrain wins.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OURS = "rltrain"


@dataclasses.dataclass
class Stat:
    """A measured quantity: the median and the 10th-90th percentile spread of its samples."""

    samples: list[float]
    unit: str = "ms"
    higher_is_better: bool = False

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    def percentile(self, q: float) -> float:
        s = sorted(self.samples)
        k = (len(s) - 1) * q
        lo, hi = math.floor(k), math.ceil(k)
        return s[lo] + (s[hi] - s[lo]) * (k - lo)

    def format(self) -> str:
        if len(self.samples) == 1:
            return fmt(self.median)
        return f"{fmt(self.median)} [{fmt(self.percentile(0.1))}-{fmt(self.percentile(0.9))}]"

    def to_json(self) -> dict:
        return {"median": self.median, "p10": self.percentile(0.1), "p90": self.percentile(0.9),
                "n": len(self.samples), "unit": self.unit}


def fmt(x: float) -> str:
    """3 significant digits, thousands separated: 0.0123, 1.23, 123, 12,345."""
    if x != x or x in (float("inf"), float("-inf")):
        return str(x)
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    if abs(x) >= 100:
        return f"{x:.0f}"
    return f"{x:.3g}"


def ratio(ours: Stat, peer: Stat) -> float:
    """How many times better rltrain is than the peer on this row (> 1: rltrain wins)."""
    if ours.higher_is_better:
        return ours.median / peer.median
    return peer.median / ours.median


@dataclasses.dataclass(frozen=True)
class Goal:
    """One checkable part of a row's target: ``column``'s figure at least ``at_least`` and/or at most
    ``at_most``. The figure is the column's ratio as the table prints it, or with ``median=True``
    the column's own median (in its unit: "<= 2 ms"). ``Row.target`` keeps the words a reader sees;
    the goals are how a full run tells whether the row met them."""

    column: str
    at_least: float | None = None
    at_most: float | None = None
    median: bool = False

    def holds(self, value: float) -> bool:
        return (self.at_least is None or value >= self.at_least) and (self.at_most is None or value <= self.at_most)


MISSED = "MISSED"


@dataclasses.dataclass
class Row:
    label: str
    cells: dict[str, Stat | None]  # column -> measurement (None: not measured, see the table's notes)
    target: str = ""
    extra: dict = dataclasses.field(default_factory=dict)  # more figures for this row (printed after it)
    goals: tuple[Goal, ...] = ()  # the target's checkable parts (words such as "same values" are not)


@dataclasses.dataclass
class Table:
    """One table of a category: rows of the same measurement for several columns (libraries or variants).
    ``ratio_to`` names the column every other column is compared with (rltrain's)."""

    title: str
    columns: list[str]
    rows: list[Row] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    ratio_to: str | None = OURS
    ratio_header: str = "x vs {peer}"
    # "wins": how many times better ratio_to is than each other column (> 1: it wins);
    # "over": each other column's median over ratio_to's (a floor or a baseline: "{peer} / floor")
    ratio_mode: str = "wins"

    def ratio(self, row: Row, column: str) -> float | None:
        base, other = row.cells.get(self.ratio_to), row.cells.get(column)
        if not base or not other:
            return None
        return other.median / base.median if self.ratio_mode == "over" else ratio(base, other)

    def figure(self, row: Row, goal: Goal) -> float | None:
        """The figure ``goal`` bounds on ``row``; None where it was not measured."""
        if goal.median:
            cell = row.cells.get(goal.column)
            value = cell.median if cell else None
        else:
            value = self.ratio(row, goal.column)
        return None if value is None or math.isnan(value) else value

    def missed(self, row: Row) -> list[Goal]:
        """``row``'s goals whose figure was measured and is out of bounds."""
        return [g for g in row.goals if (v := self.figure(row, g)) is not None and not g.holds(v)]

    def met(self, row: Row) -> bool | None:
        """False if a goal was missed, True if every goal was measured and met, None otherwise
        (no goals, or a column left empty)."""
        if self.missed(row):
            return False
        return True if row.goals and all(self.figure(row, g) is not None for g in row.goals) else None

    def target_cell(self, row: Row, judge: bool) -> str:
        """The row's target, ending in MISSED where a figure misses it (a reader scanning the column,
        or grepping a log, sees it without redoing the comparison); with several goals, it names
        the figures that missed."""
        missed = self.missed(row) if judge else []
        if not missed:
            return row.target
        if len(row.goals) == 1:
            return f"{row.target}  {MISSED}"
        names = [g.column if g.median else self.ratio_header.format(peer=g.column) for g in missed]
        return f"{row.target}  {MISSED}: {', '.join(names)}"

    def render(self, judge: bool = True) -> str:
        """The table as text; ``judge=False`` (a quick run: few rounds, small sizes) prints the
        targets without marking the rows that miss them."""
        peers = [c for c in self.columns if self.ratio_to and c != self.ratio_to]
        header = ["case", *self.columns, *[self.ratio_header.format(peer=p) for p in peers], "target"]
        lines = []
        for row in self.rows:
            cells = [row.label] + [row.cells[c].format() if row.cells.get(c) else "–" for c in self.columns]
            for p in peers:
                r = self.ratio(row, p)
                cells.append("–" if r is None else f"{r:.2f}")
            cells.append(self.target_cell(row, judge))
            lines.append(cells)
        widths = [max(len(str(x)) for x in col) for col in zip(header, *lines)]
        out = [f"\n{self.title}", "  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
        out += ["  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip() for cells in lines]
        for row in self.rows:
            if row.extra:
                out.append(f"  {row.label}: " + ", ".join(f"{k} {v}" for k, v in row.extra.items()))
        out += [f"  note: {n}" for n in self.notes]
        return "\n".join(out)

    def to_json(self, judge: bool = True) -> dict:
        return {"title": self.title, "columns": self.columns, "notes": self.notes,
                "ratio_to": self.ratio_to, "ratio_mode": self.ratio_mode,
                "rows": [{"case": r.label, "target": r.target, "met": self.met(r) if judge else None, "extra": r.extra,
                          "cells": {c: s.to_json() if s else None for c, s in r.cells.items()},
                          "ratios": {c: self.ratio(r, c) for c in self.columns
                                     if self.ratio_to and c != self.ratio_to and self.ratio(r, c) is not None}}
                         for r in self.rows]}


def time_calls(step: Callable[[], object], reps: int, per_call: int = 1) -> list[float]:
    """Seconds per call of ``step``, ``reps`` samples (each the mean of ``per_call`` calls)."""
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(per_call):
            step()
        samples.append((time.perf_counter() - t0) / per_call)
    return samples


@dataclasses.dataclass
class Peer:
    """Another library measured beside rltrain: importable in this interpreter, or in ``python``."""

    name: str
    module: str
    python: str | None  # None: importable here (its cases run in this process)
    missing: str | None = None  # why it cannot be measured (then its column stays empty)


PEER_MODULES = {"torchrl": "torchrl", "sb3": "stable_baselines3", "sb3_contrib": "sb3_contrib", "trl": "trl"}
INSTALL_HINT = {
    "torchrl": "pip install -e '.[bench]' (torchrl pins tensordict<0.15), or a venv of its own: --peer-python PATH",
    "sb3": "pip install -e '.[bench]', or --peer-python PATH with stable-baselines3 installed",
    "sb3_contrib": "pip install -e '.[bench]', or --peer-python PATH with sb3-contrib installed",
    # trl pulls its own versions of transformers/accelerate/datasets: a venv of its own keeps rltrain's intact
    "trl": "pip install trl, or a venv of its own (python -m venv --system-site-packages V && V/bin/pip install trl): "
           "--trl-python V/bin/python",
}


def find_peer(name: str, peer_python: str | None) -> Peer:
    if name not in PEER_MODULES:
        raise SystemExit(f"--compare: unknown peer {name!r} (choose from {', '.join(PEER_MODULES)})")
    module = PEER_MODULES[name]
    if importlib.util.find_spec(module) is not None:
        return Peer(name, module, None)
    if peer_python:
        probe = subprocess.run([peer_python, "-c", f"import {module}"], capture_output=True, text=True)
        if probe.returncode == 0:
            return Peer(name, module, peer_python)
        return Peer(name, module, peer_python, f"not importable by {peer_python}: "
                    f"{probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else 'import failed'}")
    return Peer(name, module, None, f"not installed here; {INSTALL_HINT[name]}")
