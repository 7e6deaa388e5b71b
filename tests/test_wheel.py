"""The wheel as a user gets it: built from this checkout, installed with its declared dependencies
into a fresh virtualenv, run from a dir that is not the repo (configs and Hydra plugins included)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import zipfile
from pathlib import Path

import pytest

from tests.conftest import CONFIGS, ROOT

# Building the wheel (~5 s), a fresh venv with torch and the declared dependencies (~25 s with pip's cache
# warm), then a few short runs. Each step has its own time limit; the whole module one of its own.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

TORCH = "torch==2.13.0"  # the CPU build kept on our machines; pip's default torch is a large CUDA build


def run(*cmd, cwd: Path, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(map(str, cmd))} exited {result.returncode}:\n{result.stderr[-3000:]}"
    return result


class Installed:
    """A fresh venv with the wheel installed, and an empty dir outside the repo to run it in."""

    def __init__(self, root: Path):
        self.wheel = self._build(root / "dist")
        self.venv = root / "venv"
        run(sys.executable, "-m", "venv", self.venv, cwd=root, timeout=120)
        self.python = self.venv / "bin" / "python"
        # --no-compile: no .pyc for every installed module (imports compile what they use), which makes
        # the install and the removal of the venv several times quicker.
        run(self.python, "-m", "pip", "install", "--quiet", "--no-compile", self.wheel, TORCH, cwd=root, timeout=900)
        self.home = root / "work"
        self.home.mkdir()
        # Nothing of the repo or of the test's own venv: only what the wheel brought.
        self.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        self.env |= {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}

    @staticmethod
    def _build(dist: Path) -> Path:
        run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", ROOT, "-w", dist, cwd=dist.parent,
            timeout=300)
        [wheel] = dist.glob("rltrain-*.whl")
        return wheel

    def rltrain(self, *args: str) -> subprocess.CompletedProcess:
        """``rltrain ARGS``: the console script the wheel installs, run in the work dir."""
        return self._in_work_dir(self.venv / "bin" / "rltrain", *args)

    def python_m_rltrain(self, *args: str) -> subprocess.CompletedProcess:
        return self._in_work_dir(self.python, "-m", "rltrain", *args)

    def _in_work_dir(self, *cmd) -> subprocess.CompletedProcess:
        return subprocess.run([str(c) for c in cmd], cwd=self.home, env=self.env, capture_output=True, text=True,
                              timeout=300)


@pytest.fixture(scope="module")
def installed():
    root = Path(tempfile.mkdtemp(prefix="rltrain-wheel-"))  # not pytest's tmp dirs, which keep the last runs
    try:
        yield Installed(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)  # the venv is over 1 GB


def test_the_wheel_ships_the_configs_and_the_hydra_plugins(installed):
    names = set(zipfile.ZipFile(installed.wheel).namelist())
    configs = {f"rltrain/configs/{p.relative_to(CONFIGS).as_posix()}" for p in CONFIGS.rglob("*.yaml")}
    assert configs and configs <= names, sorted(configs - names)
    assert "hydra_plugins/rltrain_sweeper.py" in names
    assert not any(name.startswith("tests/") for name in names)
    where = run(installed.python, "-c", "import rltrain; print(rltrain.__file__)", cwd=installed.home, timeout=60,
                env=installed.env)
    assert Path(where.stdout.strip()).is_relative_to(installed.venv)  # the installed copy, not the checkout


def test_the_installed_wheel_trains(installed):
    result = installed.python_m_rltrain("trainer.total_frames=2048", "hydra.run.dir=outputs/first")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((installed.home / "outputs/first/summary.json").read_text())
    assert summary["status"] == "completed" and summary["frames"] == 2048


def test_a_recipe_runs_from_the_wheel(installed):
    result = installed.python_m_rltrain("+recipe=ppo_pendulum", "trainer.total_frames=2048",
                                        "hydra.run.dir=outputs/recipe")
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = installed.home / "outputs/recipe"
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    config = (run_dir / ".hydra/config.yaml").read_text()
    assert "id: Pendulum-v1" in config and "lr: 0.003" in config  # the recipe's env and tuned values


def test_a_config_of_your_own_starts_from_rltrains(installed):
    # A primary config in a dir of yours: --config-dir adds it to the search path, where rltrain's own
    # configs (pkg://rltrain.configs) stay, so `- config` and the groups' options are found.
    mine = installed.home / "my_configs"
    mine.mkdir()
    (mine / "short_pendulum.yaml").write_text(textwrap.dedent("""\
        # PPO on Pendulum for 2048 frames: rltrain's config with a few changes.
        defaults:
          - config
          - override env: pendulum
          - _self_

        trainer:
          total_frames: 2048
          stop_at_return: null
        algo:
          lr: 1.0e-3
        """))
    result = installed.rltrain("--config-dir", "my_configs", "--config-name", "short_pendulum",
                               "hydra.run.dir=outputs/mine")
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = installed.home / "outputs/mine"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["frames"] == 2048
    config = (run_dir / ".hydra/config.yaml").read_text()
    assert "id: Pendulum-v1" in config and "lr: 0.001" in config


def test_a_sweep_from_the_wheel_checks_every_job_before_the_first(installed):
    # rltrain's sweeper is a Hydra plugin (hydra_plugins/): found in the installed wheel.
    result = installed.python_m_rltrain("-m", "algo.gamma=0.9,1.5", "hydra.sweep.dir=outputs/sweep")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "config error in sweep job 1 (algo.gamma=1.5): algo.gamma must be a number in (0, 1]" in result.stderr
    assert not (installed.home / "outputs/sweep").exists()
