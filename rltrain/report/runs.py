"""Finding run dirs under the paths a report is given, and reading each: its configuration (from
``.hydra/``) and its results (``summary.json``, or the rows of ``metrics.jsonl`` while it runs).

A file that cannot be read (empty, cut short by a crash, garbage, a permission error) is read as if it were
absent and named in a warning of the ``rltrain.report`` logger, one line each: one bad run must not hide the
other runs of a sweep."""

from __future__ import annotations

import glob
import json
import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

# A run dir's subdirs that hold no run of their own (resumes/ holds a resumed run's later .hydra files).
SKIPPED_DIRS = {"checkpoints", "wandb", "videos", "resumes", "ranks"}
LOCK_FILE = "run.lock"  # rltrain.run_dir.LOCK_FILE; importing that module would load torch (seconds)

log = logging.getLogger("rltrain.report")


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
    status: str  # completed, interrupted, failed, running, or "no summary" (none written, or one unreadable)
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
    for here, subdirs, files in os.walk(path, onerror=_cannot_list):
        if "metrics.jsonl" in files or "summary.json" in files:
            found.append(Path(here))
            subdirs.clear()  # run dirs do not nest
        else:
            subdirs[:] = sorted(d for d in subdirs if d not in SKIPPED_DIRS and not d.startswith("."))
    return found


def _cannot_list(error: OSError) -> None:
    log.warning("%s: cannot be listed (%s); the runs in it, if any, are left out", error.filename, error.strerror)


def _load_run(run_dir: Path) -> Run:
    # A resumed run's latest invocation is what it finished under (it may have raised total_frames).
    hydra_dir = max([*run_dir.glob("resumes/*/.hydra")], default=run_dir / ".hydra")
    config = _read(hydra_dir / "config.yaml", yaml.safe_load, dict)
    if config is None:  # a run built from the Python API, or one whose config.yaml cannot be read: the same config
        config = _read(run_dir / "checkpoints" / "config.json", json.loads, dict)
    hydra = _read(hydra_dir / "hydra.yaml", yaml.safe_load, dict)
    run = Run(dir=run_dir, config=_flatten(config or {}),
              config_name=str(_mapping(hydra, "hydra", "job").get("config_name", "")),
              overrides=[str(o) for o in _read(hydra_dir / "overrides.yaml", yaml.safe_load, list) or []],
              choices={str(k): str(v) for k, v in _mapping(hydra, "hydra", "runtime", "choices").items()
                       if not str(k).startswith("hydra/")},
              status="running")
    summary = _read(run_dir / "summary.json", json.loads, dict)
    running = summary is None and _alive(run_dir / LOCK_FILE)
    rows = _read_metrics(run_dir / "metrics.jsonl", running)
    for curve, key in [("eval", "eval/return"), ("train", "train/episode_return")]:
        points = {row["frames"]: row[key] for row in rows if row.get(key) is not None}  # the last row of a frame wins
        run.curves[curve] = (list(points), list(points.values()))
    if summary is not None:
        run.status, _, reason = str(summary.get("status", "completed")).partition(": ")  # "failed: <reason>"
        run.reason = reason or None
        run.frames, run.fps, run.wall_time_s = summary.get("frames"), summary.get("fps"), summary.get("wall_time_s")
        run.eval_return, run.train_return = summary.get("eval_return"), summary.get("train_return")
        solved = summary.get("solved")
        run.solved, run.frames_to_solve = None if solved is None else bool(solved), summary.get("frames_to_solve")
        return run
    run.status = "running" if running else "no summary"
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


def _read(path: Path, parse: Callable[[str], Any], kind: type) -> Any:
    """What ``path`` holds, parsed, where that is a ``kind``. None where the file is absent, and also where it cannot
    be read or parsed or holds something else: then with a warning that names it."""
    try:
        text = path.read_text(errors="replace")  # a stray byte fails the parse below, not the whole report
    except FileNotFoundError:
        return None
    except OSError as e:  # no permission, a dir where the file should be
        return _unreadable(path, e.strerror)
    try:
        content = parse(text)
    except (ValueError, yaml.YAMLError) as e:  # json.JSONDecodeError is a ValueError
        # YAML's errors say what is wrong in `problem`; their str() adds the text around it, over several lines.
        why = getattr(e, "problem", None) or str(e).splitlines()[0]
        return _unreadable(path, "empty" if not text.strip() else why)
    if not isinstance(content, kind):
        return _unreadable(path, "empty" if content is None else f"a {type(content).__name__}, not a {kind.__name__}")
    return content


def _unreadable(path: Path, why: str) -> None:
    log.warning("%s: unreadable (%s); the run is reported without it", path, why)


def _read_metrics(path: Path, running: bool) -> list[dict]:
    """The rows of a metrics.jsonl. A line that is none (cut short by a crash, garbage) is skipped and named, but
    for the last line of a ``running`` run, which it may be writing now."""
    text = _read(path, str, str) or ""
    lines = text.splitlines()
    rows: list[dict] = []
    skipped = []  # the numbers of the lines that are no row: cut short by a crash mid-write, or garbage
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if not isinstance(row, dict) or not isinstance(row.get("frames"), (int, float)):
            if line.strip():
                skipped.append(number)
            continue
        # A run resumed from a checkpoint older than its last log rows logs those frames again: the new rows win.
        while rows and rows[-1]["frames"] > row["frames"]:
            rows.pop()
        rows.append(row)
    if running and skipped and skipped[-1] == len(lines) and not text.endswith("\n"):
        skipped.pop()
    if skipped:
        listed = ", ".join(map(str, skipped[:5])) + (f" and {len(skipped) - 5} more" if len(skipped) > 5 else "")
        log.warning("%s: line%s %s skipped (not a JSON row: cut short by a crash?)", path, "s" * (len(skipped) > 1),
                    listed)
    return rows


def _alive(lock: Path) -> bool:
    """Whether the run that holds ``lock`` lives. We never flock it ourselves: for that moment a dead
    run's dir would look taken to a run resuming it."""
    owner = _read(lock, lambda text: json.loads(text or "{}"), dict)  # empty: just locked, its pid not yet written
    if owner is None:
        return False  # the run has ended (it removes its lock), or its lock is unreadable
    if "pid" not in owner or owner.get("host") != socket.gethostname():
        return True  # still starting (it writes its pid right after locking), or on a host we cannot look at
    try:
        os.kill(int(owner["pid"]), 0)
    except (ProcessLookupError, ValueError, TypeError, OverflowError):
        return False  # killed without a chance to write summary.json (SIGKILL, out of memory), or no process id
    except PermissionError:  # alive, another user's
        pass
    return True


def _mapping(tree: dict | None, *keys: str) -> dict:
    """``tree[key][key]...`` where that is a mapping, else {} (a hydra.yaml cut short by a crash can still parse)."""
    for key in keys:
        tree = tree.get(key) if isinstance(tree, dict) else None
    return tree if isinstance(tree, dict) else {}


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        elif not f"{prefix}{key}".startswith("hydra."):
            flat[f"{prefix}{key}"] = value
    return flat
