"""File loggers: ``metrics.jsonl`` (always written) and ``metrics.csv`` (``logger=csv``)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

from rltrain.loggers.base import Logger


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
        if resume is not None and self.path.exists():
            kept = [line for line in self.path.read_text().splitlines(keepends=True)
                    if line.strip() and json.loads(line)["frames"] <= resume["frames"]]
            _replace_text(self.path, "".join(kept))
        self._file = self.path.open("a")

    def log(self, row: dict[str, float], step: int) -> None:
        self._file.write(json.dumps(json_safe(row)) + "\n")
        self._file.flush()

    def close(self, summary: dict[str, Any] | None = None) -> None:
        self._file.close()


class CsvLogger(Logger):
    """A CSV table of the log rows; when a new metric appears (e.g. the first eval), the file is
    rewritten with the wider header so every row keeps its columns."""

    def __init__(self, run_dir: str | Path, filename: str = "metrics.csv", resume: dict | None = None):
        self.path = Path(run_dir) / filename
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._rows: list[dict[str, float]] = []
        self._columns: list[str] = []
        if resume is not None and self.path.exists():
            with self.path.open(newline="") as f:
                reader = csv.DictReader(f)
                self._columns = list(reader.fieldnames or [])
                self._rows = [{k: float(v) for k, v in row.items() if v != ""} for row in reader
                              if float(row["frames"]) <= resume["frames"]]
            self._write(self._rows, "w", header=True)

    def log(self, row: dict[str, float], step: int) -> None:
        self._rows.append(row)
        new = [k for k in row if k not in self._columns]
        if new or not self.path.exists():
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
