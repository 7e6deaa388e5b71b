"""``logger=tensorboard``: TensorBoard event files in the run dir, so ``tensorboard --logdir outputs``
shows every run: a scalar per metric at step = frames, the config as text, the summary's numbers.

A resumed run appends a new event file that starts with a purge at the checkpoint's frame count:
TensorBoard drops what the stopped session wrote after its checkpoint, so no step appears twice.
"""

from __future__ import annotations

import numbers
from pathlib import Path
from typing import Any

import yaml

from rltrain.loggers.base import Logger


class TensorboardLogger(Logger):
    """Writes ``<run_dir>/<subdir>/events.out.tfevents.*`` (``subdir``: where in the run dir the event
    files go) through torch's SummaryWriter."""

    REQUIRES = {"tensorboard": "pip install 'rltrain[tensorboard]'"}

    def __init__(self, run_dir: str | Path, config: dict | None = None, subdir: str = "tensorboard",
                 resume: dict | None = None):
        self.log_dir = Path(run_dir) / subdir
        self._config = config
        self._resume_frames = None if resume is None else resume["frames"]
        self._writer = None  # opened at the first row: a run that fails to start writes nothing

    def log(self, row: dict[str, float], step: int) -> None:
        writer = self._open()
        for key, value in row.items():
            if key != "frames" and _is_number(value):
                writer.add_scalar(key, value, global_step=step)
        writer.flush()  # every row is on disk at once: a live `tensorboard` shows it, a crash keeps it

    def close(self, summary: dict[str, Any] | None = None) -> None:
        if self._writer is None:  # nothing logged in this session (e.g. resuming a finished run): add nothing
            return
        if summary is not None:
            for key, value in _flatten(summary, "summary/"):
                self._writer.add_scalar(key, float(value), global_step=summary["frames"])
            self._writer.add_text("summary", _as_code(yaml.safe_dump(summary, sort_keys=False)),
                                  global_step=summary["frames"])
        self._writer.close()

    def _open(self):
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            # A resumed run continues from its checkpoint: the purge hides steps after it (rows that the
            # stopped session wrote past the checkpoint), as metrics.jsonl drops them.
            purge_step = None if self._resume_frames is None else self._resume_frames + 1
            self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge_step)
            if self._resume_frames is None and self._config is not None:  # once per run, at its start
                self._writer.add_text("config", _as_code(yaml.safe_dump(self._config, sort_keys=False)),
                                      global_step=0)
        return self._writer


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _flatten(node: dict[str, Any], prefix: str):
    """``(prefix/key/subkey, number)`` for every number in a nested dict; ``solved`` counts as 0 or 1."""
    for key, value in node.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}/")
        elif isinstance(value, numbers.Real):
            yield f"{prefix}{key}", value


def _as_code(text: str) -> str:
    """Indented four spaces: TensorBoard renders text as Markdown, where that keeps YAML as written."""
    return "\n".join("    " + line for line in text.splitlines())
