"""Finding run dirs under the paths a report is given, and reading each: its configuration (from
``.hydra/``) and its results (``summary.json``, or the rows of ``metrics.jsonl`` while it runs)."""

from __future__ import annotations

import glob
import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

# A run dir's subdirs that hold no run of their own (resumes/ holds a resumed run's later .hydra files).
SKIPPED_DIRS = {"checkpoints", "wandb", "videos", "resumes", "ranks"}
LOCK_FILE = "run.lock"  # rltrain.run_dir.LOCK_FILE; importing that module would load torch (seconds)


class NoRunsError(ValueError):
    """A path the report was given holds no run dir (nothing with metrics.jsonl or summary.json)."""


@dataclass
class Run:
    """One run dir as the report sees it: its configuration and its results (partial while it runs)."""

    dir: Path
    config: dict[str, Any]  # the resolved config, flattened to dotted keys
    config_name: str  # hydra.job.config_name: the primary config (a recipe's name)
    overrides: list[str]  # the task overrides of its latest invocation
    choices: dict[str, str]  # the config group choices (algo: ppo, env: cartpole, ...)
    status: str  # completed, interrupted, failed, running, or "no summary" (it died without writing one)
    reason: str | None = None  # why it failed
    frames: int | None = None
    eval_return: float | None = None
    train_return: float | None = None
    fps: float | None = None
    wall_time_s: float | None = None
    solved: bool | None = None  # None: the run had no target return (trainer.stop_at_return null)
    frames_to_solve: int | None = None
    curves: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)  # "eval"/"train": frames, returns

    @property
    def seed(self) -> Any:
        return self.config.get("seed")


def load_runs(paths: list[str | Path]) -> list[Run]:
    """The runs under ``paths`` (run dirs, dirs holding them at any depth, or glob patterns), each once.
    Raises NoRunsError naming the first path that holds none."""
    found: dict[Path, Run] = {}
    for path in paths:
        matches = expand(str(path))
        if not any(os.path.exists(match) for match in matches):
            raise NoRunsError(f"{path} does not exist" if not glob.has_magic(str(path)) else f"nothing matches {path}")
        dirs = [run_dir for match in matches for run_dir in _run_dirs(Path(match))]
        if not dirs:
            raise NoRunsError(f"no run dir under {path} (a run dir holds metrics.jsonl or summary.json)")
        for run_dir in dirs:
            if run_dir.resolve() not in found:
                found[run_dir.resolve()] = _load_run(run_dir)
    return list(found.values())


def expand(path: str) -> list[str]:
    """``path``, or what it matches if it is a glob pattern (quoted ones reach us unexpanded by the shell)."""
    if os.path.exists(path) or not glob.has_magic(path):
        return [path]
    return sorted(glob.glob(path, recursive=True))


def _run_dirs(path: Path) -> list[Path]:
    found = []
    for here, subdirs, files in os.walk(path):
        if "metrics.jsonl" in files or "summary.json" in files:
            found.append(Path(here))
            subdirs.clear()  # run dirs do not nest
        else:
            subdirs[:] = sorted(d for d in subdirs if d not in SKIPPED_DIRS and not d.startswith("."))
    return found


def _load_run(run_dir: Path) -> Run:
    # A resumed run's latest invocation is what it finished under (it may have raised total_frames).
    hydra_dir = max([*run_dir.glob("resumes/*/.hydra")], default=run_dir / ".hydra")
    config = _read_yaml(hydra_dir / "config.yaml")
    if config is None and (run_dir / "checkpoints" / "config.json").is_file():  # a run built from the Python API
        config = json.loads((run_dir / "checkpoints" / "config.json").read_text())
    hydra = (_read_yaml(hydra_dir / "hydra.yaml") or {}).get("hydra", {})
    run = Run(dir=run_dir, config=_flatten(config or {}), config_name=str(hydra.get("job", {}).get("config_name", "")),
              overrides=[str(o) for o in _read_yaml(hydra_dir / "overrides.yaml") or []],
              choices={k: str(v) for k, v in hydra.get("runtime", {}).get("choices", {}).items()
                       if not k.startswith("hydra/")},
              status="running")
    rows = _read_metrics(run_dir / "metrics.jsonl")
    for curve, key in [("eval", "eval/return"), ("train", "train/episode_return")]:
        points = {row["frames"]: row[key] for row in rows if row.get(key) is not None}  # the last row of a frame wins
        run.curves[curve] = (list(points), list(points.values()))
    summary_file = run_dir / "summary.json"
    if summary_file.is_file():
        summary = json.loads(summary_file.read_text())
        run.status, _, reason = str(summary.get("status", "completed")).partition(": ")  # "failed: <reason>"
        run.reason = reason or None
        run.frames, run.fps, run.wall_time_s = summary.get("frames"), summary.get("fps"), summary.get("wall_time_s")
        run.eval_return, run.train_return = summary.get("eval_return"), summary.get("train_return")
        solved = summary.get("solved")
        run.solved, run.frames_to_solve = None if solved is None else bool(solved), summary.get("frames_to_solve")
        return run
    run.status = "running" if _alive(run_dir / LOCK_FILE) else "no summary"
    # Not solved so far (a run that solves stops and writes its summary), where it has a target at all.
    run.solved = None if run.config.get("trainer.stop_at_return", "auto") is None else False
    if rows:
        run.frames = rows[-1]["frames"]
        run.eval_return = run.curves["eval"][1][-1] if run.curves["eval"][1] else None
        run.train_return = run.curves["train"][1][-1] if run.curves["train"][1] else None
        # The time/<phase> rows add up to the wall time so far (but for the untimed rest, which is small).
        run.wall_time_s = sum(v for row in rows for k, v in row.items() if k.startswith("time/") and k.count("/") == 1)
        run.fps = run.frames / run.wall_time_s if run.frames and run.wall_time_s else None
    return run


def _read_metrics(path: Path) -> list[dict]:
    rows: list[dict] = []
    if not path.is_file():
        return rows
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # the half-written last line of a live run
        if not isinstance(row, dict) or not isinstance(row.get("frames"), (int, float)):
            continue
        # A run resumed from a checkpoint older than its last log rows logs those frames again: the new rows win.
        while rows and rows[-1]["frames"] > row["frames"]:
            rows.pop()
        rows.append(row)
    return rows


def _alive(lock: Path) -> bool:
    """Whether the run that holds ``lock`` lives. We never flock it ourselves: for that moment a dead
    run's dir would look taken to a run resuming it."""
    try:
        owner = json.loads(lock.read_text() or "{}")
    except (OSError, ValueError):
        return False
    if "pid" not in owner or owner.get("host") != socket.gethostname():
        return True  # still starting (it writes its pid right after locking), or on a host we cannot look at
    try:
        os.kill(int(owner["pid"]), 0)
    except ProcessLookupError:
        return False  # killed without a chance to write summary.json (SIGKILL, out of memory)
    except PermissionError:  # alive, another user's
        pass
    return True


def _read_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text()) if path.is_file() else None


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        elif not f"{prefix}{key}".startswith("hydra."):
            flat[f"{prefix}{key}"] = value
    return flat
