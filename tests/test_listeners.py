"""Processes of your own receiving a sync=distributed run's weights (``rltrain.sync.listen``): at a
run that is over, at one that ends while they wait, and with a module that does not fit. Real runs
and listeners, each a process of its own, on loopback (the run's store takes a port the kernel
picks); every wait bounded, and every process stopped at the end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import ROOT

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
# A run with one listener; one push per batch of 512 frames. sync.timeout_s is set by each test.
LISTENED = ("collector=lockstep", "sync=distributed", "sync.listeners=1", "trainer.stop_at_return=null",
            "hooks.progress.bar=false")

# The listener of docs/scaling-out.md, saying where it is: before listen(), once connected, each version, how it ended.
LISTENER = """
import sys, time
import gymnasium as gym
from rltrain.algos import ActorCritic
from rltrain.envs.batched import spec_from_env
from rltrain.sync import listen

policy = ActorCritic(spec_from_env("CartPole-v1", gym.make("CartPole-v1")))
print("listening", flush=True)
receiver = listen(sys.argv[1], timeout_s=240.0)  # the run may still be starting on a busy box
receiver.connect(policy)
print("connected", flush=True)
while not receiver.ended:
    if receiver.poll():
        print("version", receiver.version, flush=True)
    time.sleep(0.01)
print("ended at version", receiver.version, flush=True)
"""

# A listener whose network is not the run's (CartPole's ActorCritic): two plain linear layers.
WRONG_LISTENER = """
import sys
from torch import nn
from rltrain.sync import listen

listen(sys.argv[1], timeout_s=240.0).connect(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)))
"""

# A learner driven from Python, as in a notebook: its process (and the store and group it holds)
# lives on after fit(). It trains once the test has seen the listener connect; with FAIL_AT=N, its
# push of weights version N fails before anything is sent (a network gone mid-push, say).
NOTEBOOK_LEARNER = """
import os, sys, time
from pathlib import Path
from rltrain import build
from rltrain.sync.distributed import _DistributedSender
from tests.conftest import make_config

publish = _DistributedSender._publish_unguarded

def failing(self, version, copy):
    if version == int(os.environ.get("FAIL_AT", "0")):
        raise RuntimeError(f"the network went away in the push of version {version}")
    return publish(self, version, copy)

_DistributedSender._publish_unguarded = failing
run_dir = Path(sys.argv[1])
trainer = build(make_config(*sys.argv[2:]), run_dir=run_dir)
while not (run_dir / "go").exists():
    time.sleep(0.05)
try:
    trainer.fit()
except Exception as e:
    print("fit failed:", e, flush=True)
print("fit returned", flush=True)
time.sleep(600)
"""


def start(args: list[str], cwd: Path, merge: bool = False, env: dict | None = None) -> subprocess.Popen:
    """A process of its own session (so that it and its workers can be stopped together); ``merge``:
    its stderr goes to its stdout (a run's log lines, which nobody may read until it ends)."""
    return subprocess.Popen([sys.executable, *args], cwd=cwd, env={**ENV, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge else subprocess.PIPE, text=True,
                            start_new_session=True)


@contextmanager
def run_and_listener(args: list[str], run_dir: Path, heard: str, env: dict | None = None):
    """The run ``args`` start and a listener at its dir, once the listener printed ``heard``; both
    stopped (with whatever of their sessions is left) afterwards."""
    run, waiting = start(args, run_dir.parent, merge=True, env=env), None
    try:
        wait_for_file(run_dir / "sync.json")
        waiting = start(["-c", LISTENER, str(run_dir)], run_dir.parent)
        wait_for_line(waiting, heard)
        yield run, waiting
    finally:
        stop(run)
        stop(waiting)


def stop(proc: subprocess.Popen | None) -> None:
    """Kill ``proc`` and whatever of its session is left (a run's workers)."""
    if proc is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def listener(code: str, run_dir: Path, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, str(run_dir)], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def wait_for_line(proc: subprocess.Popen, line: str, timeout: float = 90) -> None:
    """Read ``proc``'s stdout up to a line starting with ``line``, for at most ``timeout`` seconds."""
    found = threading.Event()

    def read():
        for got in proc.stdout:
            if got.startswith(line):
                found.set()
                return

    threading.Thread(target=read, daemon=True).start()
    assert found.wait(timeout), f"{line!r} was not printed within {timeout}s (exit code {proc.poll()})"


def wait_for_file(path: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout}s"
        time.sleep(0.1)


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def status_of(run_dir: Path) -> str:
    return json.loads((run_dir / "summary.json").read_text())["status"]


# -- a listener at a run that is over says so in one line, at once


def test_a_listener_at_a_failed_run_says_it_ended(tmp_path):
    # Nobody listens: the run waits 1 s for its listener at the first push, fails, and leaves sync.json.
    run_dir = tmp_path / "run"
    run = subprocess.run([sys.executable, "-m", "rltrain", *LISTENED, "sync.timeout_s=1",
                          f"hydra.run.dir={run_dir}"], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 1 and (run_dir / "sync.json").exists(), run.stderr[-3000:]
    status = status_of(run_dir)
    assert status.startswith("failed: SyncError"), status

    result = listener(LISTENER, run_dir, tmp_path)
    assert result.returncode == 1 and "connected" not in result.stdout
    assert last_line(result.stderr) == (
        f"rltrain.errors.SyncError: sync=distributed: the run at {run_dir} has ended with status {status!r}, so "
        "there is nothing to listen to: start the run first (listen() waits for it), or point listen() at a live "
        "run's dir")
    assert "frame #" not in result.stderr and "c10d" not in result.stderr  # none of torch's retries


def test_a_listener_at_a_killed_run_says_it_ended(tmp_path):
    # SIGKILL: no summary.json, and run.lock stays behind, but nobody holds it any more.
    run_dir = tmp_path / "run"
    run = start(["-m", "rltrain", *LISTENED, "sync.timeout_s=120", f"hydra.run.dir={run_dir}"], tmp_path, merge=True)
    try:
        wait_for_file(run_dir / "sync.json")
    finally:
        stop(run)
    assert (run_dir / "run.lock").exists() and not (run_dir / "summary.json").exists()

    result = listener(LISTENER, run_dir, tmp_path)
    assert result.returncode == 1 and "connected" not in result.stdout
    assert last_line(result.stderr).endswith(
        f"the run at {run_dir} has ended with status 'unknown: its process is gone without writing summary.json "
        "(killed?)', so there is nothing to listen to: start the run first (listen() waits for it), or point "
        "listen() at a live run's dir")
    assert "frame #" not in result.stderr and "c10d" not in result.stderr


def test_a_listener_at_a_run_without_listeners_says_it_ended(tmp_path):
    run_dir = tmp_path / "run"
    run = subprocess.run([sys.executable, "-m", "rltrain", "trainer.total_frames=1024", "hooks.progress.bar=false",
                          f"hydra.run.dir={run_dir}"], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and status_of(run_dir) == "completed", run.stderr[-3000:]

    result = listener(LISTENER, run_dir, tmp_path)  # listen() would otherwise wait its 60 s for sync.json
    assert result.returncode == 1
    assert last_line(result.stderr).endswith(
        f"the run at {run_dir} has ended with status 'completed' (it wrote no sync.json: it ended before its weights "
        "sync started, or it was not started with sync=distributed sync.listeners>=1), so there is nothing to "
        "listen to: start the run first (listen() waits for it), or point listen() at a live run's dir")


def test_a_listener_waiting_for_a_run_that_fails_to_start_says_so(tmp_path):
    # The listener comes first; the run fails while its workers start (their envs cannot reset).
    run_dir = tmp_path / "run"
    waiting = start(["-c", LISTENER, str(run_dir)], tmp_path)
    try:
        wait_for_line(waiting, "listening")
        run = subprocess.run([sys.executable, "-m", "rltrain", *LISTENED, "env.id=tests.toy_envs:Faulty-v0",
                              "+env.kwargs.fault=raise_on_reset", f"hydra.run.dir={run_dir}"], cwd=tmp_path,
                             env=ENV, capture_output=True, text=True, timeout=120)
        assert run.returncode == 1, run.stderr[-3000:]
        _, err = waiting.communicate(timeout=30)
    finally:
        stop(waiting)
    assert waiting.returncode == 1
    assert f"the run at {run_dir} has ended with status 'failed: CollectorError: " in last_line(err), err[-3000:]
    assert "env could not connect to its simulator" in last_line(err)


# -- a listener hears of a run that ended while it listened, however it ended


def test_a_listener_whose_run_is_killed_mid_way_says_so_and_exits(tmp_path):
    run_dir = tmp_path / "run"
    learner = ["-m", "rltrain", *LISTENED, "sync.timeout_s=120", "trainer.total_frames=10000000",
               f"hydra.run.dir={run_dir}"]
    with run_and_listener(learner, run_dir, "version") as (run, waiting):
        stop(run)
        _, err = waiting.communicate(timeout=60)
    assert waiting.returncode == 1, err[-3000:]  # not aborted (134) by a group torn down as it exits
    assert last_line(err) == (
        f"rltrain.errors.SyncError: sync=distributed: the run at {run_dir} has ended with status 'unknown: its "
        "process is gone without writing summary.json (killed?)': no more weights will come"), err[-3000:]
    assert "frame #" not in err and "terminate called" not in err


@pytest.mark.parametrize("end", ["completed", "failed"])
def test_a_listener_hears_a_run_end_while_its_learner_lives_on(end, tmp_path):
    # The learner's process lives on, as in a notebook, and never says goodbye to the listener:
    # completed: nothing was pushed (sync.every=null), so it has no group to say it on; the listener waits
    # for the group to form. failed: its third push failed, and a broken push sends nothing more; the
    # listener, holding version 2, waits for the next push.
    run_dir = tmp_path / "run"
    how = ["sync.every=null"] if end == "completed" else []
    args = ["-c", NOTEBOOK_LEARNER, str(run_dir), *LISTENED, "sync.timeout_s=120", "trainer.total_frames=4096", *how]
    with run_and_listener(args, run_dir, "connected", env={"FAIL_AT": "3" if end == "failed" else "0"}) as (
            learner, waiting):
        (run_dir / "go").touch()
        wait_for_line(learner, "fit returned")
        out, err = waiting.communicate(timeout=60)  # it would otherwise wait days for the next push
    if end == "completed":  # nothing more will come: the listener has simply ended
        assert waiting.returncode == 0, err[-3000:]
        assert "ended at version -1" in out
    else:
        assert waiting.returncode == 1
        assert last_line(err) == (
            f"rltrain.errors.SyncError: sync=distributed: the run at {run_dir} has ended with status 'failed: "
            "RuntimeError: the network went away in the push of version 3': no more weights will come"), err[-3000:]


# -- a listener whose module does not fit: the run fails at once, naming it


def test_a_listener_with_another_network_fails_the_run_naming_it(tmp_path):
    run_dir = tmp_path / "run"
    # Large: without the listener's report, the run would wait this long for it, outlasting the timeouts below.
    run = start(["-m", "rltrain", *LISTENED, "sync.timeout_s=120", "trainer.total_frames=100000",
                 f"hydra.run.dir={run_dir}"], tmp_path, merge=True)
    wrong = None
    try:
        wrong = start(["-c", WRONG_LISTENER, str(run_dir)], tmp_path)
        _, wrong_err = wrong.communicate(timeout=90)
        run_out, _ = run.communicate(timeout=90)
    finally:
        stop(run)
        stop(wrong)
    assert wrong.returncode == 1
    assert last_line(wrong_err).startswith(
        f"rltrain.errors.SyncError: sync=distributed: listener 0's module does not fit the run at {run_dir}: "
        "weight snapshot does not match"), wrong_err[-3000:]
    assert "not in the learner's snapshot: 0.weight" in wrong_err and "the run fails too" in wrong_err

    assert run.returncode == 1, run_out[-3000:]
    status = status_of(run_dir)
    assert status.startswith(f"failed: SyncError: sync=distributed: listener 0 (pid {wrong.pid} on "), status
    assert "was rejected and left: weight snapshot does not match" in status
    assert "missing in the collector's policy: actor.0.weight" in status
    assert "not in the learner's snapshot: 0.weight" in status
    assert f"SyncError: sync=distributed: listener 0 (pid {wrong.pid} on " in run_out  # the terminal says it too
