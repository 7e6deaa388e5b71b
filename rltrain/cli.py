"""The Hydra app behind ``python -m rltrain [overrides]`` (see --help)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from rltrain.factory import build
from rltrain.errors import ConfigError

# In a source checkout the Hydra tree is ../configs; an installed wheel carries it inside the package.
_PACKAGED = Path(__file__).parent / "configs"
CONFIG_DIR = str(_PACKAGED if _PACKAGED.is_dir() else Path(__file__).parent.parent / "configs")


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def run(cfg: DictConfig) -> float | None:
    """Train one run; returns the final evaluation return (what an optimizing sweeper maximizes)."""
    try:
        trainer = build(cfg)
    except ConfigError as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        _discard_run_dir()
        print(f"rltrain: config error: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        summary = trainer.fit()
    except KeyboardInterrupt:
        print(f"rltrain: interrupted; summary written to {trainer.state.run_dir / 'summary.json'}", file=sys.stderr)
        sys.exit(130)
    return summary["eval_return"]


def _discard_run_dir() -> None:
    """Remove the run dir Hydra made before our validation ran, if it holds only Hydra's own files."""
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if not run_dir.is_dir() or any(p.name != ".hydra" and p.suffix != ".log" for p in run_dir.iterdir()):
        return
    shutil.rmtree(run_dir)
    cwd, parent = Path.cwd().resolve(), run_dir.resolve().parent
    while parent != cwd and cwd in parent.parents and not any(parent.iterdir()):
        parent.rmdir()
        parent = parent.parent


def main() -> None:
    run()
