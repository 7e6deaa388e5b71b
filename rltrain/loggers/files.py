"""File loggers: ``metrics.jsonl`` (always written) and ``metrics.csv`` (``logger=csv``)."""

from __future__ import annotations

import csv
import json
import logging
import math
from pathlib import Path
from typing import Any

from rltrain.loggers.base import Logger

log = logging.getLogger("rltrain")


def _replace_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def json_safe(value: Any) -> Any:
    """``value`` with non-finite floats as None: NaN and Infinity are not JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


class JsonlLogger(Logger):
    """One JSON object per log step, appended and flushed at once (safe to tail during a run)."""

    def __init__(self, run_dir: str | Path, filename: str = "metrics.jsonl", resume: dict | None = None):
        self.path = Path(run_dir) / filename
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._resume_frames = None if resume is None else resume["frames"]
        self._file = None  # opened at the first row: a run that fails to start changes nothing

    def log(self, row: dict[str, float], step: int) -> None:
        if self._file is None:
            if self._resume_frames is not None and self.path.exists():
                _replace_text(self.path, "".join(_rows_up_to(self.path, self._resume_frames)))
            self._file = self.path.open("a")
        self._file.write(json.dumps(json_safe(row)) + "\n")
        self._file.flush()

    def close(self, summary: dict[str, Any] | None = None) -> None:
        if self._file is not None:
            self._file.close()


def _rows_up_to(path: Path, frames: int) -> list[str]:
    """The lines of a metrics.jsonl up to ``frames``; a line that is no row (torn by a crash
    mid-write, damaged bytes) is dropped, with a warning."""
    kept, dropped = [], 0
    for line in path.read_text(errors="replace").splitlines(keepends=True):
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if not isinstance(row, dict) or not isinstance(row.get("frames", 0), (int, float)):
            dropped += bool(line.strip())
            continue
        if row.get("frames", 0) <= frames:
            kept.append(line if line.endswith("\n") else line + "\n")
    if dropped:
        log.warning("resume: %d line(s) of %s that are no JSON row (cut short by a crash?) were dropped", dropped, path)
    return kept


class CsvLogger(Logger):
    """A CSV table of the log rows; when a new metric appears (e.g. the first eval), the file is
    rewritten with the wider header so every row keeps its columns."""

    def __init__(self, run_dir: str | Path, filename: str = "metrics.csv", resume: dict | None = None):
        self.path = Path(run_dir) / filename
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._rows: list[dict[str, float | str]] = []  # earlier rows, as read back, are strings
        self._columns: list[str] = []
        self._rewrite = False
        if resume is not None and self.path.exists():  # kept in memory; the file is rewritten at the next row
            with self.path.open(newline="") as f:
                reader = csv.DictReader(f)
                self._columns = list(reader.fieldnames or [])
                for row in reader:  # kept as written; only frames is read
                    try:
                        frames = float(row.get("frames") or "nan")
                    except ValueError:  # a row torn by a crash mid-write
                        continue
                    if frames <= resume["frames"]:
                        self._rows.append({k: v for k, v in row.items() if k and v not in ("", None)})
            self._rewrite = True

    def log(self, row: dict[str, float], step: int) -> None:
        self._rows.append(row)
        new = [k for k in row if k not in self._columns]
        if new or self._rewrite or not self.path.exists():
            self._rewrite = False
            self._columns += new
            self._write(self._rows, "w", header=True)
        else:
            self._write([row], "a", header=False)

    def _write(self, rows: list[dict[str, float]], mode: str, header: bool) -> None:
        with self.path.open(mode, newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self._columns)
            if header:
                writer.writeheader()
            writer.writerows(rows)
