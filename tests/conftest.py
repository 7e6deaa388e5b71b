"""Shared fixtures: compose configs exactly as the CLI does, with each run in a temp dir."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "rltrain" / "configs"


def make_config(*overrides: str):
    """The composed config for ``python -m rltrain OVERRIDES``."""
    with initialize_config_module("rltrain.configs", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def run_cli(*args: str, cwd: Path, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m rltrain ARGS`` in ``cwd`` (where its outputs/ dir lands)."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "rltrain", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def cfg_factory():
    return make_config
