"""``logger=console``: one readable line per log step through Python logging (Hydra also files it)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from rltrain.loggers.base import Logger

log = logging.getLogger("rltrain")


class ConsoleLogger(Logger):
    """Prints frames, returns, fps and the main losses; ``keys`` adds more columns by metric name."""

    def __init__(self, keys: Sequence[str] = ()):
        self.keys = list(keys or ())

    def log(self, row: dict[str, float], step: int) -> None:
        parts = [f"frames {int(row['frames']):>9,}"]
        for key, label in [("train/episode_return", "return"), ("eval/return", "eval"), ("perf/fps", "fps")]:
            if key in row:
                parts.append(f"{label} {row[key]:>8.1f}")
        losses = [f"{k[5:]} {v:.3g}" for k, v in row.items() if k.startswith("loss/")]
        extra = [f"{k} {row[k]:.4g}" for k in self.keys if k in row]
        log.info(" | ".join(parts + losses + extra))
