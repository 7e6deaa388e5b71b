"""Learning checks: seeded runs that must reach a return, not merely run."""

from __future__ import annotations

import json

from rltrain import build
from tests.conftest import LEARNING_RUN_TIMEOUT_S, ONE_THREAD, learning_check, make_config, run_cli

# They assert returns within frames, never within seconds: the time limits only catch a hang (tests/conftest.py).
# The runs in this process take the config's threads=1.
pytestmark = learning_check


def train(tmp_path, *overrides):
    return build(make_config(*overrides), run_dir=tmp_path).fit()


def test_ppo_solves_cartpole_with_the_default_config(tmp_path):
    summary = train(tmp_path)  # exactly `python -m rltrain`
    assert summary["solved"] is True
    assert summary["train_return"] >= 475
    assert summary["frames_to_solve"] <= 100_000
    assert summary["eval_return"] >= 400


def test_without_weight_pushes_the_collector_never_improves(tmp_path):
    summary = train(tmp_path, "sync=none", "trainer.total_frames=30000")
    assert summary["sync"]["pushes"] == 0
    assert summary["solved"] is False
    assert summary["train_return"] < 60  # a random CartPole policy lasts ~22 steps
    assert summary["eval_return"] > 100  # ...while the learner itself did learn


def test_the_pendulum_recipe_learns_continuous_control(tmp_path):
    result = run_cli("+recipe=ppo_pendulum", ONE_THREAD, "hydra.run.dir=run", cwd=tmp_path,
                     timeout=LEARNING_RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["frames"] >= 100_000
    # A random policy scores about -1200; swinging up and holding reaches about -200.
    assert summary["train_return"] >= -500
    assert summary["eval_return"] >= -500


def test_ppo_learns_acrobot(tmp_path):
    summary = train(tmp_path, "env=acrobot", "trainer.total_frames=100000")
    assert summary["train_return"] >= -150  # random: -500 (never swings up within the time limit)


def test_ppo_solves_cartpole_with_worker_processes_and_shared_memory_sync(tmp_path):
    summary = train(tmp_path, "collector=lockstep", "sync=shared_mem")
    assert summary["solved"] is True and summary["train_return"] >= 475
    assert summary["sync"]["max_lag"] == 0  # lock-step: every batch acts with the newest weights


def test_ppo_solves_cartpole_with_worker_processes_and_pipe_sync(tmp_path):
    summary = train(tmp_path, "collector=lockstep", "sync=pipe")
    assert summary["solved"] is True and summary["train_return"] >= 475


def test_ppo_solves_cartpole_with_async_workers_and_bounded_lag(tmp_path):
    summary = train(tmp_path, "collector=async", "sync=shared_mem", "collector.max_lag=2")
    assert summary["solved"] is True and summary["train_return"] >= 475
    assert summary["sync"]["max_lag"] <= 2
    assert summary["sync"]["mean_lag"] > 0  # workers really ran ahead of the learner


def test_without_pushes_worker_processes_never_improve(tmp_path):
    summary = train(tmp_path, "collector=lockstep", "sync=none", "trainer.total_frames=30000")
    assert summary["sync"]["pushes"] == 0 and summary["solved"] is False
    assert summary["train_return"] < 60
    assert summary["eval_return"] > 100
