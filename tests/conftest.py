"""Shared fixtures: compose configs exactly as the CLI does, with each run in a temp dir."""

from __future__ import annotations

import importlib.util
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


# Learning checks assert a return reached within a number of frames (seeded), never within seconds, so their
# time limits only catch a hang: many times what they take on the project's 2-core box with other jobs on it.
# The slowest learning tests take 1.5-2.5 min there at load 3-7 (+recipe=sac_pendulum: solved at 4.8k frames,
# about 55 frames/s; the whole 20k-frame budget at that speed would be about 7 min).
LEARNING_RUN_TIMEOUT_S = 1200  # one learning run in a subprocess: run_cli(..., timeout=LEARNING_RUN_TIMEOUT_S)
# pytest-timeout for a whole learning test (pyproject's `timeout`, 600 s, is for the rest of the suite); room for
# two runs (a test may resume one), so a run's own timeout fires first and names its command.
learning_check = pytest.mark.timeout(2 * LEARNING_RUN_TIMEOUT_S + 300)
# Learning runs take one torch thread, the default (threads=1): on a shared, busy 2-core box two threads wait on
# each other (+recipe=sac_pendulum at load 3-6: 51-53 frames/s with threads=1, 6-8 with threads=2, 2026-12-03).
# A recipe that sets threads=2 is run with this override.
ONE_THREAD = "threads=1"


def run_cli(*args: str, cwd: Path, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m rltrain ARGS`` in ``cwd`` (where its outputs/ dir lands). A run still going after
    ``timeout`` seconds is killed and the test fails naming the command, with the end of what it printed."""
    # The checkout first, then whatever the caller's PYTHONPATH holds (the device machine's packages: .site).
    paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), **(env or {})}
    try:
        return subprocess.run([sys.executable, "-m", "rltrain", *args], cwd=cwd, env=full_env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out, err = (x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr))
        pytest.fail(f"`python -m rltrain {' '.join(args)}` still running after {timeout:g} s (a hang?), killed. "
                    f"The end of its stdout:\n{out[-2000:]}\nThe end of its stderr:\n{err[-2000:]}", pytrace=False)


@pytest.fixture
def cfg_factory():
    return make_config


def without_package(monkeypatch, name: str) -> None:
    """Make ``importlib.util.find_spec`` answer None for package ``name``, as if it were not installed."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == name else real(n, *a))
