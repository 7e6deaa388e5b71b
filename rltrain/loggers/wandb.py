"""``logger=wandb``: a real Weights & Biases run holding the config, the metrics and the summary.

``mode: auto`` runs online only when credentials exist (WANDB_API_KEY or a stored login) and
offline otherwise, so a run never stops to ask for a login. WANDB_MODE, if set, wins.
"""

from __future__ import annotations

import netrc
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rltrain.loggers.base import Logger

MODES = ("auto", "online", "offline", "disabled")


def resolve_mode(mode: str) -> str:
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if mode != "auto":
        return mode
    return "online" if _has_credentials() else "offline"


def _has_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


class WandbLogger(Logger):
    REQUIRES = {"wandb": "pip install wandb"}

    def __init__(
        self,
        run_dir: str | Path,
        config: dict | None = None,
        project: str = "rltrain",
        entity: str | None = None,
        name: str | None = None,
        group: str | None = None,
        tags: Sequence[str] = (),
        mode: str = "auto",
        resume: dict | None = None,
    ):
        import wandb

        self._wandb = wandb
        run_id = (resume or {}).get("run_id")
        self.run = wandb.init(
            id=run_id,
            resume="allow" if run_id else None,
            project=project,
            entity=entity,
            name=name,
            group=group,
            tags=list(tags or ()),
            config=config,
            dir=str(run_dir),
            mode=resolve_mode(mode),
            settings=wandb.Settings(init_timeout=60, console="off", silent=True),
        )
        self.run.define_metric("*", step_metric="frames")

    def log(self, row: dict[str, float], step: int) -> None:
        self.run.log(row)

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run.id}

    def close(self, summary: dict[str, Any] | None = None) -> None:
        if summary is not None:
            for key, value in summary.items():
                self.run.summary[key] = value
            rows = [[phase, seconds, seconds / max(summary["wall_time_s"], 1e-9)]
                    for phase, seconds in summary["time"].items()]
            self.run.log({"timing": self._wandb.Table(columns=["phase", "seconds", "share"], data=rows),
                         "frames": summary["frames"]})
        failed = summary is not None and str(summary.get("status", "")).startswith("failed")
        self.run.finish(exit_code=1 if failed else 0)
