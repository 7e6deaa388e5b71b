"""Faults outside the config, through the CLI: one clear paragraph on the terminal (the traceback in
cli.log), a summary.json that says why, nothing half-made, and nothing left in /dev/shm."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from rltrain import checkpoint
from tests.conftest import run_cli
from tests.test_multiprocess import session_processes, shm_entries
from tests.test_run_dirs import start_cli, stop, wait_for

FAULTY = ("env.id=tests.toy_envs:Faulty-v0", "trainer.stop_at_return=null", "hooks.eval.episodes=1",
          "hydra.run.dir=run")


def assert_failed(returncode: int, stderr: str, when: str, error: str, run_dir: Path, kept: bool = True) -> dict:
    """Exit code 1 and one paragraph on the terminal (``rltrain: the run failed <when>: <error>``; with
    ``kept``, the learner's checkpoint as it failed and how to resume it), the full traceback in cli.log,
    and summary.json's status saying the same; returns the summary."""
    assert returncode == 1, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 2 + kept, stderr
    assert re.fullmatch(rf"rltrain: the run failed {when}: {error}", lines[0]), lines[0]
    if kept:
        where = re.escape(str(run_dir.resolve()))
        assert re.fullmatch(rf"The learner was kept: checkpoint frames_\d+\.pt in {where}\. Continue with: python -m "
                            rf"rltrain resume={where} \(plus the same overrides\), once the cause is fixed\.",
                            lines[1]), lines[1]
        assert checkpoint.listing(run_dir)
    assert lines[-1] == (f"The full traceback is in {run_dir.resolve() / 'cli.log'} "
                         "(HYDRA_FULL_ERROR=1 prints it here).")
    assert "Traceback (most recent call last)" in (run_dir / "cli.log").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert re.fullmatch(f"failed: {error}", summary["status"]), summary["status"]
    return summary


@pytest.mark.parametrize("collector", ["local", "lockstep"])
def test_an_env_that_raises_fails_the_run_in_one_paragraph(collector, tmp_path):
    result = run_cli(*FAULTY, "+env.kwargs.fault=raise", "+env.kwargs.at_step=40", f"collector={collector}",
                     cwd=tmp_path)
    env_error = (r"EnvError: env tests.toy_envs:Faulty-v0 \(env \d+ of \d+\) raised in step\(\) at its step 40: "
                 r"RuntimeError: env exploded at step 40")
    where = r"CollectorError: collector worker \d \(pid \d+\) failed: " if collector == "lockstep" else ""
    assert_failed(result.returncode, result.stderr, "after 512 frames", where + env_error, tmp_path / "run")
    log = (tmp_path / "run" / "cli.log").read_text()
    assert 'raise RuntimeError(f"env exploded at step {self.steps}")' in log  # the env's own line


@pytest.mark.parametrize(("fault", "what"), [
    ("bad_shape", r"an observation of shape \(3,\) where its observation space has shape \(4,\)"),
    ("bad_reward", r"a reward of array\(\[1., 1.\]\), not a number"),
])
def test_an_env_that_returns_the_wrong_thing_is_told_what_was_wrong(fault, what, tmp_path):
    result = run_cli(*FAULTY, f"+env.kwargs.fault={fault}", "+env.kwargs.at_step=40", cwd=tmp_path)
    env_error = (rf"EnvError: env tests.toy_envs:Faulty-v0 \(env \d+ of \d+\) returned {what} from step\(\) at its "
                 r"step 40; fix the env \(or a wrapper of env.wrappers\) so that what it returns fits its spaces")
    assert_failed(result.returncode, result.stderr, "after 512 frames", env_error, tmp_path / "run")


def test_a_killed_worker_is_named_with_its_signal_and_the_likely_cause(tmp_path):
    proc = start_cli("collector=lockstep", "trainer.total_frames=100000000", "trainer.stop_at_return=null",
                     "hooks.log.every.seconds=0.2", "hydra.run.dir=run", cwd=tmp_path)
    try:
        wait_for(lambda: (tmp_path / "run" / "metrics.jsonl").exists())
        worker = next(pid for pid in session_processes(proc.pid) if _is_worker_of(pid, proc.pid))
        os.kill(worker, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        stop(proc, signal.SIGKILL)
    assert_failed(proc.returncode, err, r"after [\d,]+ frames",
                  rf"CollectorError: collector worker \d \(pid {worker}\) died \(killed by SIGKILL\) while stepping "
                  r"CartPole-v1; SIGKILL often comes from the out-of-memory killer \(see dmesg\)", tmp_path / "run")


def _is_worker_of(pid: int, parent: int) -> bool:
    """A process multiprocessing spawned for ``parent`` (a collector worker)."""
    try:
        ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return ppid == parent and b"spawn_main" in cmdline


def test_a_stuck_worker_says_which_key_to_raise(tmp_path):
    result = run_cli(*FAULTY, "+env.kwargs.fault=hang", "+env.kwargs.at_step=40", "collector=lockstep",
                     "collector.timeout_s=5", cwd=tmp_path)  # 5 s: the workers start within it too
    assert_failed(result.returncode, result.stderr, "after 512 frames",
                  r"CollectorError: no 'batch' message from collector worker\(s\) \[0, 1\] within 5(\.0)?s "
                  r"\(collector.timeout_s\); they are alive but stuck \(pids \d+, \d+; a tests.toy_envs:Faulty-v0 "
                  r"step or reset that never returns\?\). If the env is just slow, raise collector.timeout_s",
                  tmp_path / "run")


@pytest.mark.parametrize("collector", ["local", "lockstep"])
def test_an_env_that_fails_to_reset_at_start_up_leaves_a_summary_that_says_why(collector, tmp_path):
    result = run_cli(*FAULTY, "+env.kwargs.fault=raise_on_reset", f"collector={collector}", cwd=tmp_path)
    env_error = (r"EnvError: env tests.toy_envs:Faulty-v0 \(env 0 of \d+\) raised in reset\(\) at its step 0: "
                 r"RuntimeError: env could not connect to its simulator")
    where = (r"CollectorError: collector worker \d \(pid \d+\) failed while starting: "
             if collector == "lockstep" else "")
    run_dir = tmp_path / "run"
    summary = assert_failed(result.returncode, result.stderr, "while starting", where + env_error, run_dir, kept=False)
    assert summary["frames"] == 0
    assert not (run_dir / "run.lock").exists()
    assert not (run_dir / "checkpoints").exists()  # nothing for resume=auto to pick up
    fixed = run_cli(*FAULTY, "+env.kwargs.fault=none", "trainer.total_frames=512", f"collector={collector}",
                    cwd=tmp_path)  # the same command, once the env is fixed, may take the dir over
    assert fixed.returncode == 0, fixed.stderr


def test_sigterm_while_workers_start_stops_at_once_and_cleans_up(tmp_path):
    shm_before = shm_entries()
    proc = start_cli("collector=lockstep", "env.id=tests.toy_envs:SlowStartCartPole-v0", "hydra.run.dir=run",
                     cwd=tmp_path)
    try:
        wait_for(lambda: len(session_processes(proc.pid)) >= 3)  # the workers are starting (and sleeping)
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGTERM)  # as a scheduler does: the whole process group
        _, err = proc.communicate(timeout=30)
    finally:
        stop(proc, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.strip() == "rltrain: stopped by SIGTERM while starting; nothing was trained"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["frames"] == 0
    wait_for(lambda: not session_processes(proc.pid), timeout=15)
    assert shm_entries() - shm_before == set()


@pytest.mark.parametrize("collector", ["local", "lockstep"])
def test_a_sigkilled_process_group_leaves_nothing_in_dev_shm(collector, tmp_path):
    shm_before = shm_entries()
    proc = start_cli(f"collector={collector}", "trainer.total_frames=100000000", "trainer.stop_at_return=null",
                     "hooks.log.every.seconds=0.2", "hydra.run.dir=run", cwd=tmp_path)
    wait_for(lambda: (tmp_path / "run" / "metrics.jsonl").exists())
    stop(proc, signal.SIGKILL)
    wait_for(lambda: not session_processes(proc.pid), timeout=15)
    assert shm_entries() - shm_before == set()
