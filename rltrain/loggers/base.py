"""The logger interface: a row of metrics per log step, and the run summary at the end."""

from __future__ import annotations

from typing import Any


class Logger:
    """Receives one dict of metrics per log step (keys per DESIGN.md: ``frames``, ``loss/...``)."""

    def log(self, row: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def close(self, summary: dict[str, Any] | None = None) -> None:
        """Flush and release; ``summary`` is what summary.json holds."""
