"""Sweeps through Hydra's own plugins: the Optuna preset, parallel and cluster launchers, and a
sweep in which one job fails."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rltrain import cli
from tests.conftest import ROOT, run_cli

SHORT = ["trainer.total_frames=2048", "hooks.eval.episodes=2", "hooks.progress.bar=false"]


def job_dirs(tmp_path: Path) -> list[Path]:
    (sweep,) = (tmp_path / "outputs" / "multirun").glob("*/*")
    return sorted((p for p in sweep.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_a_tiny_optuna_study_maximizes_the_mean_eval_return_and_writes_its_best_trial(tmp_path):
    # python -m rltrain -m sweep=ppo_cartpole_optuna, 3 trials on a small budget.
    result = run_cli("-m", "sweep=ppo_cartpole_optuna", "hydra.sweeper.n_trials=3", "trainer.total_frames=6144",
                     "hooks.eval.every.frames=2048", "hooks.eval.episodes=3",
                     "hooks.log.every.seconds=0.001", cwd=tmp_path, timeout=300)  # a row per evaluation
    assert result.returncode == 0, result.stderr
    trials = job_dirs(tmp_path)
    assert len(trials) == 3
    scores = []
    for trial in trials:
        s = summary(trial)
        assert s["status"] == "completed" and s["evaluations"] == 3  # at 2048, 4096 and 6144 frames
        rows = [json.loads(line) for line in (trial / "metrics.jsonl").read_text().splitlines()]
        evals = {row["frames"]: row["eval/return"] for row in rows if row.get("eval/return") is not None}
        assert s["mean_eval_return"] == pytest.approx(sum(evals.values()) / len(evals))
        scores.append(s["mean_eval_return"])
    results = yaml.safe_load((trials[0].parent / "optimization_results.yaml").read_text())
    assert results["name"] == "optuna"
    assert results["best_value"] == pytest.approx(max(scores))
    best = trials[scores.index(max(scores))]
    overrides = yaml.safe_load((best / ".hydra" / "overrides.yaml").read_text())
    assert set(results["best_params"]) == {"algo.lr", "algo.gamma", "algo.gae_lambda", "algo.epochs",
                                           "algo.minibatch_size", "algo.clip_coef", "algo.ent_coef"}
    for key, value in results["best_params"].items():
        assert f"{key}={value}" in overrides
    # What Hydra and Optuna tell about the study stays; alembic's set-up lines (optuna imports it) do not.
    assert "setup plugin" not in result.stdout + result.stderr
    for line in ("[HYDRA] Study name: ppo_cartpole", "[HYDRA] Storage: None", "[HYDRA] Sampler: TPESampler",
                 "[HYDRA] Directions: ['maximize']", "[HYDRA] \t#2 : algo.lr=", "[HYDRA] Best value: "):
        assert line in result.stdout
    assert "A new study created in memory with name: ppo_cartpole" in result.stderr


# A study whose first trial fails: a learning rate that makes every loss NaN, which the trainer stops
# on (NonFiniteError). With the sampler's seed 6, trial 0 draws algo.lr=1e30 and trial 1 algo.lr=1e-3.
FAILING_FIRST_TRIAL = ["-m", "sweep=ppo_cartpole_optuna", "hydra.sweeper.n_trials=2", "hydra.sweeper.sampler.seed=6",
                       "algo.lr=choice(1e30,1e-3)", "trainer.total_frames=2000", "hooks.eval.every=null"]


def test_an_optuna_study_goes_on_past_a_failed_trial_and_names_it_in_one_line(tmp_path):
    result = run_cli(*FAILING_FIRST_TRIAL, cwd=tmp_path)
    failed, completed = job_dirs(tmp_path)
    assert yaml.safe_load((failed / ".hydra" / "overrides.yaml").read_text())[0] == "algo.lr=1e+30", \
        "the sampler no longer draws 1e30 first with seed 6: choose another seed"
    assert re.match(r"failed: NonFiniteError: update 1 \(after \d+ frames\): a loss or its gradient was NaN",
                    summary(failed)["status"]), summary(failed)["status"]
    assert summary(completed)["status"] == "completed"
    results = yaml.safe_load((failed.parent / "optimization_results.yaml").read_text())
    assert results["best_value"] == pytest.approx(summary(completed)["mean_eval_return"])
    assert results["best_params"]["algo.lr"] == 0.001
    # As a failed job of any sweep: one line at the end and exit 1, the traceback only in its cli.log.
    assert result.returncode == 1
    assert "Traceback" not in result.stdout + result.stderr
    assert "Traceback" in (failed / "cli.log").read_text()
    summary_lines = result.stderr[result.stderr.index("rltrain: 1 of the Optuna study's 2 trials failed"):].splitlines()
    assert summary_lines[0] == ("rltrain: 1 of the Optuna study's 2 trials failed (the study ran to its end; its best "
                                f"trial is in {failed.parent / 'optimization_results.yaml'}):")
    assert summary_lines[1].startswith("  job 0 (algo.lr=1e+30 ")
    assert re.search(r": NonFiniteError: update 1 \(after \d+ frames\): a loss or its gradient was NaN or infinite",
                     summary_lines[1]), summary_lines[1]
    assert summary_lines[1].endswith(f"; its summary.json and cli.log are in {failed}")
    assert len(summary_lines) == 2


def test_an_optuna_study_that_too_many_trials_fail_ends_with_its_summary(tmp_path):
    # max_failure_rate applies to each batch of n_jobs trials: with n_jobs=1, 0.25 ends the study at its
    # first failed trial.
    result = run_cli(*FAILING_FIRST_TRIAL, "hydra.sweeper.max_failure_rate=0.25", cwd=tmp_path)
    assert result.returncode == 1
    (failed,) = job_dirs(tmp_path)
    assert not (failed.parent / "optimization_results.yaml").exists()
    assert "Traceback" not in result.stdout + result.stderr
    assert " times out of " not in result.stdout  # hydra-optuna-sweeper's line with every failure in it
    summary_lines = result.stderr[result.stderr.index("rltrain: the Optuna study stopped"):].splitlines()
    assert summary_lines[0] == ("rltrain: the Optuna study stopped after 1 trial, 1 failed: in its last batch of 1 "
                                "(hydra.sweeper.n_jobs) more than hydra.sweeper.max_failure_rate=0.25 failed (with "
                                "1.0 a study goes on past failed trials):")
    assert summary_lines[1].startswith("  job 0 (algo.lr=1e+30 ")
    assert summary_lines[1].endswith(f"; its summary.json and cli.log are in {failed}")


def test_an_optuna_study_checks_its_first_trial_config_before_it_starts(tmp_path):
    result = run_cli("-m", "sweep=ppo_cartpole_optuna", "hydra.sweeper.n_trials=2", "algo.gamma=1.5", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1].startswith("rltrain: config error in sweep job 0 (algo.lr=")
    assert result.stderr.splitlines()[-1].endswith(
        " algo.gamma=1.5): algo.gamma must be a number in (0, 1] (got 1.5). No job was started")
    assert "Traceback" not in result.stderr
    assert not list((tmp_path / "outputs" / "multirun").glob("*/*/0"))


def test_an_optuna_study_kept_in_a_database_continues_where_it_stopped(tmp_path):
    study = ["-m", "sweep=ppo_cartpole_optuna", "hydra.sweeper.n_trials=2", "hydra.sweeper.storage=sqlite:///study.db",
             "trainer.total_frames=1024", "hooks.eval.every=null", *SHORT[1:]]
    first = run_cli(*study, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    second = run_cli(*study, cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    assert "Using an existing study with name 'ppo_cartpole'" in second.stdout + second.stderr
    import optuna

    trials = optuna.load_study(study_name="ppo_cartpole", storage=f"sqlite:///{tmp_path / 'study.db'}").trials
    assert [t.state.name for t in trials] == ["COMPLETE"] * 4


def test_joblib_runs_the_jobs_in_parallel_each_in_its_own_run_dir(tmp_path):
    result = run_cli("-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "seed=0,1", *SHORT, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    jobs = job_dirs(tmp_path)
    assert [summary(j)["status"] for j in jobs] == ["completed", "completed"]
    assert [yaml.safe_load((j / ".hydra" / "config.yaml").read_text())["seed"] for j in jobs] == [0, 1]
    launcher = yaml.safe_load((jobs[0].parent / "multirun.yaml").read_text())["hydra"]["launcher"]
    assert launcher["_target_"].endswith("JoblibLauncher") and launcher["n_jobs"] == 2


def test_submitit_local_runs_each_job_as_a_submitit_job(tmp_path):
    result = run_cli("-m", "hydra/launcher=submitit_local", "seed=0,1", *SHORT, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr
    jobs = job_dirs(tmp_path)
    assert [summary(j)["status"] for j in jobs] == ["completed", "completed"]
    assert list((jobs[0].parent / ".submitit").rglob("*_result.pkl")), "submitit ran them"


def test_a_job_that_fails_lets_the_others_finish_and_leaves_no_process_behind(tmp_path):
    # Job 0's env raises at its 30th step inside a worker process; job 1's never does.
    args = ["-m", "collector=lockstep", "collector.workers=2", "env.id=tests.toy_envs:Faulty-v0",
            "+env.kwargs.at_step=30,1000000000", "trainer.stop_at_return=null", *SHORT]
    proc = subprocess.Popen([sys.executable, "-m", "rltrain", *args], cwd=tmp_path, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1
    failed, finished = job_dirs(tmp_path)
    assert summary(finished)["status"] == "completed"
    assert summary(failed)["status"].startswith("failed: CollectorError: collector worker ")
    assert "EnvError: env tests.toy_envs:Faulty-v0 (env 0 of 8) raised in step() at its step 30" in \
        summary(failed)["status"]
    assert ("rltrain: 1 of 2 sweep jobs failed (the others ran to their end):\n  job 0 (+env.kwargs.at_step=30): "
            "CollectorError: collector worker ") in stderr
    assert f"its summary.json and cli.log are in {failed}" in stderr
    assert "Error executing job with overrides" not in stderr  # what Hydra prints when a failed job's value is read
    deadline = time.monotonic() + 10
    while True:  # every process of the sweep's session is gone (workers included)
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "a process of the sweep outlived it"
        time.sleep(0.1)


@pytest.mark.parametrize(("plugin", "package"), [("hydra/launcher=joblib", "hydra-joblib-launcher"),
                                                  ("hydra/sweeper=optuna", "hydra-optuna-sweeper"),
                                                  ("hydra/launcher=submitit_slurm", "hydra-submitit-launcher")])
def test_a_missing_hydra_plugin_names_the_pip_install(plugin, package, monkeypatch, capsys):
    real_find_spec = cli.importlib.util.find_spec
    hidden = f"hydra_plugins.{package.replace('-', '_')}"
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: None if name == hidden else real_find_spec(name))
    with pytest.raises(SystemExit) as exit_:
        cli.check_command_line(["-m", plugin, "seed=0,1"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == (f"rltrain: {plugin} needs the Hydra plugin {package}, which is not "
                                               f"installed: pip install {package} (or pip install 'rltrain[sweep]')")
