"""Runs grouped into configurations (their seeds together), labelled by what sets each apart, and the
table that compares them: mean ± sample std over seeds, as markdown, csv or json."""

from __future__ import annotations

import csv
import io
import json
import re
import statistics
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from rltrain.report.runs import Run

# Config keys that tell the seeds of one configuration apart, not configurations.
NOT_CONFIGURATION = {"seed", "resume"}
RECIPE = "recipe"  # the config group of rltrain/configs/recipe/ (python -m rltrain +recipe=NAME)
FLOAT = re.compile(r"[-+]?(\d+\.\d*|\.\d+|\d+(?=[eE]))([eE][-+]?\d+)?")  # 0.95, 1e-3; not 8, not 1_000
# More configurations than this are numbered #1..#N in the plot's legend and in the markdown table.
NUMBERED_ABOVE = 8
FORMATS = ("markdown", "csv", "json")


@dataclass
class Group:
    """The runs of one configuration (its seeds); failed runs are kept but left out of the statistics."""

    label: str
    runs: list[Run]
    settings: dict[str, Any] = field(default_factory=dict)  # the exact values of what the label names

    @property
    def counted(self) -> list[Run]:
        return [run for run in self.runs if run.status != "failed"]

    def stats(self) -> dict[str, Any]:
        """Means, and mean and sample std (ddof=1; None for one run) of the returns, over the counted runs."""
        counted = self.counted
        solve_frames = [run.frames_to_solve for run in counted if run.solved and run.frames_to_solve is not None]
        with_target = [run for run in counted if run.solved is not None]  # solved is None without a target return
        not_completed = Counter(run.status for run in self.runs if run.status != "completed")
        return {
            "label": self.label,
            "seeds": len(counted),
            "eval_return": _mean_std([run.eval_return for run in counted]),
            "train_return": _mean_std([run.train_return for run in counted]),
            "frames": _mean([run.frames for run in counted]),
            "fps": _mean([run.fps for run in counted]),
            "wall_time_s": _mean([run.wall_time_s for run in counted]),
            "solved": sum(run.solved for run in with_target) if with_target else None,  # of "with_target" runs
            "with_target": len(with_target),
            "frames_to_solve_median": statistics.median(solve_frames) if solve_frames else None,
            "status": ", ".join(f"{n} {status}" for status, n in sorted(not_completed.items())),
        }


def group(runs: list[Run]) -> list[Group]:
    """Runs grouped by configuration (the resolved config but for seed and resume), labelled by what differs."""
    by_config: dict[str, list[Run]] = {}
    for run in runs:
        config = {k: v for k, v in run.config.items() if k not in NOT_CONFIGURATION}
        by_config.setdefault(json.dumps(config, sort_keys=True, default=str), []).append(run)
    groups = [Group("", sorted(members, key=lambda run: str(run.seed))) for members in by_config.values()]
    _label(groups)
    return groups


def table(groups: list[Group], fmt: str = "markdown") -> str:
    """The table of ``groups`` as markdown (rounded for reading), csv or json (full numbers, with run dirs)."""
    rows = [g.stats() for g in groups]
    if fmt == "json":
        for row, g in zip(rows, groups):
            row["settings"] = g.settings
            row["runs"] = [_run_record(run) for run in g.runs]
        return json.dumps({"std": "sample (ddof=1) over seeds", "groups": rows}, indent=2, default=str) + "\n"
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(["configuration", "seeds", "eval_return_mean", "eval_return_std", "train_return_mean",
                         "train_return_std", "frames", "fps", "wall_time_s", "solved", "with_target",
                         "frames_to_solve_median", "status"])
        for r in rows:
            writer.writerow([r["label"], r["seeds"], r["eval_return"]["mean"], r["eval_return"]["std"],
                             r["train_return"]["mean"], r["train_return"]["std"], r["frames"], r["fps"],
                             r["wall_time_s"], r["solved"], r["with_target"], r["frames_to_solve_median"],
                             r["status"]])
        return out.getvalue()
    if fmt != "markdown":
        raise ValueError(f"fmt must be one of {', '.join(FORMATS)} (got {fmt!r})")
    header = ["configuration", "seeds", "eval return", "train return", "frames", "frames/s", "wall time", "solved",
              "frames to solve"]
    lines = [[r["label"].replace("|", "\\|"), str(r["seeds"]), _plus_minus(r["eval_return"]),
              _plus_minus(r["train_return"]), _count(r["frames"]), _count(r["fps"]), _duration(r["wall_time_s"]),
              "–" if r["solved"] is None else f"{r['solved']}/{r['with_target']}", _count(r["frames_to_solve_median"])]
             for r in rows]
    align = ["---"] + ["---:"] * (len(header) - 1)
    if len(rows) > NUMBERED_ABOVE:  # the plot's legend names them by number
        header, align = ["#", *header], ["---:", *align]
        lines = [[str(i), *line] for i, line in enumerate(lines, 1)]
    if any(r["status"] for r in rows):  # a status column only where some run did not complete
        header.append("status")
        align.append("---")
        for line, r in zip(lines, rows):
            line.append(r["status"])
    return "\n".join("| " + " | ".join(cells) + " |" for cells in [header, align, *lines]) + "\n"


def _label(groups: list[Group]) -> None:
    """Label each group by what sets it apart: the overrides and config group choices that differ among the
    runs of one primary config and recipe (the config name, then ``recipe=NAME``, lead where several were used:
    what a recipe sets is the recipe's, not the run's), else the config values that differ."""
    scopes: dict[tuple[str, str | None], list[Group]] = {}
    for g in groups:
        scopes.setdefault((g.runs[0].config_name, g.runs[0].choices.get(RECIPE)), []).append(g)
    several_names, several_recipes = len({n for n, _ in scopes}) > 1, len({r for _, r in scopes}) > 1
    for (name, recipe), scope in scopes.items():
        keys = list(dict.fromkeys(k for g in scope for k in _descriptors(g.runs[0])))  # in the order they were typed
        differing = [k for k in keys if len({_describe(g.runs[0], k) for g in scope}) > 1]
        lead = {"config": name or "config"} if several_names else {}
        if several_recipes and recipe is not None:
            lead[RECIPE] = recipe
        for g in scope:
            g.settings = {**lead, **{k: _value(g.runs[0], k) for k in differing if _describe(g.runs[0], k)}}
            described = [p for p in map(partial(_describe, g.runs[0]), differing) if p]
            parts = [f"{RECIPE}={recipe}"] * (RECIPE in lead) + described
            # The config name leads where several were used, and stands alone for a group that kept its defaults.
            g.label = " ".join([name or "config"] * ("config" in lead or not parts) + parts)
    for label in {g.label for g in groups}:
        twins = [g for g in groups if g.label == label]
        if len(twins) > 1:  # the same overrides, yet other configs (an edited recipe): name the values that differ
            keys = [k for k in twins[0].runs[0].config if k not in NOT_CONFIGURATION]
            differing = [k for k in keys if len({repr(g.runs[0].config.get(k)) for g in twins}) > 1][:3]
            for g in twins:
                g.settings.update({k: g.runs[0].config.get(k) for k in differing})
                values = [f"{k}={_short(g.runs[0].config.get(k))}" for k in differing]
                g.label = " ".join([label] * bool(label) + values)
    if len(groups) == 1 and groups[0].label == "config":  # nothing to tell apart: say what the runs are
        run = groups[0].runs[0]
        own = [k for k in dict.fromkeys(map(_override_key, run.overrides)) if k in _descriptors(run)]
        groups[0].settings = {k: _value(run, k) for k in own}
        groups[0].label = " ".join(_describe(run, k) or k for k in own) or "config"


def _descriptors(run: Run) -> dict[str, str]:
    """What the run's config group choices and overrides say, by key, as the label shows them (``recipe=NAME``
    for ``+recipe=NAME``; floats to 4 significant digits)."""
    described = {k: f"{k}={v}" for k, v in run.choices.items()}
    for override in run.overrides:
        key = _override_key(override)
        described[key] = f"{key}={run.choices[key]}" if key in run.choices else _short_override(override)
    return {k: v for k, v in described.items() if k not in NOT_CONFIGURATION and not k.startswith("hydra")}


def _describe(run: Run, key: str) -> str | None:
    # A key that another group overrode and this one did not: its value in this run's config, where it is a leaf.
    return _descriptors(run).get(key) or (f"{key}={_short(run.config[key])}" if key in run.config else None)


def _value(run: Run, key: str) -> Any:
    """The exact value behind ``key`` in a label: its value in the resolved config, else the choice or override."""
    if key in run.config:
        return run.config[key]
    if key in run.choices:
        return run.choices[key]
    typed = [o for o in run.overrides if _override_key(o) == key]
    return typed[-1].partition("=")[2] if typed and "=" in typed[-1] else None


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _short_override(override: str) -> str:
    """``algo.lr=0.0012520653814999472`` as ``algo.lr=0.001252``; anything but a plain float as it was typed."""
    key, eq, value = override.partition("=")
    return f"{key}={float(value):.4g}" if eq and FLOAT.fullmatch(value) else override


def _override_key(override: str) -> str:
    body = override.lstrip("+")
    return body if body.startswith("~") else body.partition("=")[0]


def _run_record(run: Run) -> dict[str, Any]:
    return {"dir": str(run.dir), "seed": run.seed, "status": run.status, "reason": run.reason, "frames": run.frames,
            "eval_return": run.eval_return, "train_return": run.train_return, "fps": run.fps,
            "wall_time_s": run.wall_time_s, "solved": run.solved, "frames_to_solve": run.frames_to_solve}


def _mean(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else None


def _mean_std(values: list) -> dict[str, float | None]:
    known = [v for v in values if v is not None]
    return {"mean": _mean(known), "std": statistics.stdev(known) if len(known) > 1 else None}


def _plus_minus(stat: dict[str, float | None]) -> str:
    if stat["mean"] is None:
        return "–"
    return f"{stat['mean']:.1f}" + (f" ± {stat['std']:.1f}" if stat["std"] is not None else "")


def _count(value: float | None) -> str:
    return "–" if value is None else f"{value:,.0f}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}m {secs:02d}s" if minutes < 60 else f"{minutes // 60}h {minutes % 60:02d}m"
