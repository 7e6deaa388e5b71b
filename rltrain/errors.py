"""Errors rltrain raises on purpose: bad configuration, and failures of parts of a run."""


class ConfigError(ValueError):
    """A config value that cannot work. The message names the key, its value and the fix."""


class SyncError(RuntimeError):
    """Weights could not be moved between learner and collector (layout mismatch, timeout)."""


class CollectorError(RuntimeError):
    """A collector worker raised, died or stopped answering; the message says which and why."""


class CheckpointError(ValueError):
    """A checkpoint to resume from is missing, unreadable, or from a config it does not fit."""
