"""The logger interface: a row of metrics per log step, and the run summary at the end."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class Logger:
    """Receives one dict of metrics per log step (the keys of docs/outputs.md:
    ``frames``, ``loss/...``).

    A logger that takes a ``resume`` argument gets, in a resumed run, its checkpointed
    ``state_dict()`` plus ``frames`` (where the checkpoint was taken): rows past it were written
    after the checkpoint and are dropped, so the record continues without gap or duplicate.
    """

    # The packages it imports once it starts, each with the command that installs it: validate checks
    # they are there before anything starts (a logger imports them late, so that its module imports without).
    REQUIRES: Mapping[str, str] = {}

    def log(self, row: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run hands back as ``resume`` (e.g. the wandb run id); saved in checkpoints."""
        return {}

    def close(self, summary: dict[str, Any] | None = None) -> None:
        """Flush and release; ``summary`` is what summary.json holds."""
