"""The Hydra app behind ``python -m rltrain [overrides]`` (see --help)."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
from datetime import datetime
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from rltrain import checkpoint
from rltrain.factory import build
from rltrain.errors import CheckpointError, ConfigError

@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def run(cfg: DictConfig) -> float | None:
    """Train one run; returns the final evaluation return (what an optimizing sweeper maximizes)."""
    try:
        _check_sweep_resume(cfg)
        trainer = build(cfg)
    except (ConfigError, CheckpointError) as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        _discard_run_dir()
        what = "config error" if isinstance(e, ConfigError) else "cannot resume"
        print(f"rltrain: {what}: {e}", file=sys.stderr)
        sys.exit(2)
    run_dir = trainer.state.run_dir
    try:
        if HydraConfig.initialized() and run_dir.resolve() != Path(HydraConfig.get().runtime.output_dir).resolve():
            try:
                _move_into_resumed_run(run_dir)
            except OSError as e:  # bookkeeping only: the run itself can go on
                logging.getLogger("rltrain").warning("could not move this invocation's Hydra files into %s: %s",
                                                     run_dir, e)
        summary = trainer.fit()
    except KeyboardInterrupt:
        signum = trainer.state.stop_signal or signal.SIGINT
        print(f"rltrain: stopped at once by {signal.Signals(signum).name}; summary written to "
              f"{run_dir / 'summary.json'}", file=sys.stderr)
        sys.exit(128 + signum)
    if summary["status"] == "interrupted":
        signum = trainer.state.stop_signal or signal.SIGINT
        last = checkpoint.path_for(run_dir, summary["frames"])
        saved = [p for p in checkpoint.listing(run_dir) if p.name == last.name]
        where = (f"checkpoint {saved[0].name} and summary.json in {run_dir}. Continue with: python -m rltrain "
                 f"resume={run_dir} (plus the same overrides)") if saved else (
                 f"summary.json in {run_dir}; no checkpoint (hooks.checkpoint is off), so it cannot be resumed")
        print(f"rltrain: stopped by {signal.Signals(signum).name}; {where}", file=sys.stderr)
        sys.exit(128 + signum)
    return summary["eval_return"]


def _check_sweep_resume(cfg: DictConfig) -> None:
    resume = cfg.get("resume")
    if resume not in (None, "auto") and HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        raise ConfigError(f"resume={resume} continues one run, but this is a sweep (-m); use resume=auto, "
                          "which continues each job's own run (the newest run with the same config)")


def _move_into_resumed_run(run_dir: Path) -> None:
    """A resumed run continues in its old dir: keep this invocation's Hydra files there under
    ``resumes/<time>/``, send the log file there, and remove the dir Hydra made for it."""
    hydra_dir = Path(HydraConfig.get().runtime.output_dir)
    target = run_dir / "resumes" / datetime.now().strftime("%Y-%m-%d_%H-%M-%S-%f")
    target.mkdir(parents=True, exist_ok=True)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent == hydra_dir.resolve():
            handler.close()
            old_log = Path(handler.baseFilename)
            handler.baseFilename = str(run_dir.resolve() / old_log.name)  # reopened in append mode
            with open(handler.baseFilename, "a") as f:
                f.write(old_log.read_text() if old_log.exists() else "")
    if (hydra_dir / ".hydra").is_dir():
        shutil.move(str(hydra_dir / ".hydra"), str(target / ".hydra"))
    _discard_run_dir()


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
