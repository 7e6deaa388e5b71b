"""Errors rltrain raises on purpose: bad configuration, and failures of parts of a run.

Each message is one paragraph a user can act on (what failed, where, the fix if there is one);
a traceback from another process travels beside it in ``details``, for the log file.
"""

from __future__ import annotations

import traceback


class ConfigError(ValueError):
    """A config value that cannot work. The message names the key, its value and the fix."""


class CheckpointError(ValueError):
    """A checkpoint to resume from is missing, unreadable, or from a config it does not fit."""


class RunDirError(RuntimeError):
    """The run dir belongs to another run: a live one holds its lock, or a finished one is in it."""


class RunError(RuntimeError):
    """A part of a running training failed; ``details`` holds a traceback from another process."""

    def __init__(self, message: str, details: str | None = None):
        super().__init__(message)
        self.details = details


class SyncError(RunError):
    """Weights could not be moved between learner and collector (layout mismatch, timeout)."""


class CollectorError(RunError):
    """A collector worker raised, died or stopped answering; the message says which and why."""


class LearnerRankError(RunError):
    """A rank of a data-parallel learner (``strategy=ddp``) died or stopped answering; the message says which."""


class EnvError(RunError):
    """An env's ``reset`` or ``step`` raised, or returned a non-finite observation or reward."""


class NonFiniteError(RunError):
    """A loss, gradient or weight became NaN or infinite."""


def send_failure(conn, who: str, error: BaseException) -> None:
    """Tell the learner, over a process's pipe ``conn``, that ``error`` ended the process ``who``:
    ``("error", "Type: message", traceback)``; nothing if the learner's end is gone."""
    try:
        conn.send(("error", f"{type(error).__name__}: {error}", f"{who}:\n{traceback.format_exc()}"))
    except OSError:
        pass
