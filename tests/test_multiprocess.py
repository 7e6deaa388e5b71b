"""Multi-process collectors with real worker processes (spawn): weights, versions, faults, cleanup."""

from __future__ import annotations

import functools
import gc
import json
import multiprocessing as mp
import os
import re
import signal
import time
from multiprocessing import resource_tracker
from pathlib import Path

import pytest
import torch

from rltrain.collectors import AsyncCollector, LockstepCollector
from rltrain.envs import GymnasiumBatchedEnv
from rltrain.errors import CollectorError
from rltrain.sync import NoSync, PipeSync, SharedMemSync
from tests.policies_for_tests import MarkerPolicy

SCHEMES = {"shared_mem": SharedMemSync, "pipe": PipeSync}


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm"))


@pytest.fixture
def no_leftovers(monkeypatch):
    """Fails the test if it leaves a child process, or a /dev/shm entry it created, behind.

    Named semaphores are attributed through multiprocessing's resource tracker (other processes,
    e.g. a second test run, may be creating their own at the same time)."""
    created = []
    register = resource_tracker.register

    def recording_register(name, rtype):
        created.append(name)
        register(name, rtype)

    monkeypatch.setattr(resource_tracker, "register", recording_register)
    before = shm_entries()
    yield
    deadline = time.monotonic() + 10
    while mp.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not mp.active_children(), f"child processes left: {mp.active_children()}"
    gc.collect()  # the sync lock's named semaphore lives as long as the scheme object
    ours = {f"sem.{name.lstrip('/')}" for name in created}
    assert not ours & shm_entries(), "named semaphores left in /dev/shm"
    assert not {e for e in shm_entries() - before if e.startswith("torch_")}, "torch shared memory left in /dev/shm"


def start(scheme, mode="lockstep", env_id="CartPole-v1", workers=2, envs_per_worker=2, frames_per_batch=None,
          policy_size=1, timeout_s=20.0, learner=None, **env_kwargs):
    spec = GymnasiumBatchedEnv("CartPole-v1", num_envs=1).spec
    learner = learner if learner is not None else MarkerPolicy(spec)
    sender = scheme.sender(learner)
    frames = frames_per_batch or (workers * envs_per_worker * 8 if mode == "lockstep" else envs_per_worker * 8)
    collector = {"lockstep": LockstepCollector, "async": AsyncCollector}[mode](
        make_env=functools.partial(GymnasiumBatchedEnv, env_id, kwargs=env_kwargs or None),
        make_policy=functools.partial(MarkerPolicy, spec, size=policy_size),
        make_receiver=scheme.receiver, env_spec=spec, frames_per_batch=frames, workers=workers,
        envs_per_worker=envs_per_worker, timeout_s=timeout_s)
    return learner, sender, collector


@pytest.mark.parametrize("scheme_name", SCHEMES)
def test_every_worker_acts_with_the_pushed_parameters_and_buffers(scheme_name, no_leftovers):
    learner, sender, collector = start(SCHEMES[scheme_name](), workers=3)
    with collector:
        batches = iter(collector)
        first = next(batches)
        assert first.batch_size == torch.Size([8, 6])  # 8 steps x (3 workers x 2 envs)
        assert first["log_prob"].unique().tolist() == [0.0] and first["policy_version"].unique().tolist() == [0]
        learner.mark(1.0)
        assert sender.push() == 1
        second = next(batches)
        assert second["policy_version"].unique().tolist() == [1]
        assert second["log_prob"].unique().tolist() == [11.0]  # w (parameter) and b (buffer) both arrived
        with torch.no_grad():
            learner.w.fill_(5.0)  # an optimizer step in place, not pushed: must not reach any worker
        third = next(batches)
        assert third["log_prob"].unique().tolist() == [11.0]
        assert third["policy_version"].unique().tolist() == [1]


def test_sync_none_workers_keep_the_learners_initial_weights(no_leftovers):
    spec = GymnasiumBatchedEnv("CartPole-v1", num_envs=1).spec
    learner = MarkerPolicy(spec)
    learner.mark(3.0)
    learner, sender, collector = start(NoSync(), learner=learner)
    with collector:
        batches = iter(collector)
        assert next(batches)["log_prob"].unique().tolist() == [33.0]
        learner.mark(4.0)
        assert sender.push() == 0
        assert next(batches)["log_prob"].unique().tolist() == [33.0]


@pytest.mark.parametrize("scheme_name", SCHEMES)
def test_async_workers_never_act_with_a_mix_of_two_versions(scheme_name, no_leftovers):
    learner, sender, collector = start(SCHEMES[scheme_name](), mode="async", envs_per_worker=1,
                                       frames_per_batch=64)
    with collector:
        versions_seen = set()
        batches = iter(collector)
        for version in range(1, 40):
            batch = next(batches)
            torch.testing.assert_close(batch["log_prob"], 11.0 * batch["policy_version"].float())
            versions_seen |= set(batch["policy_version"].unique().tolist())
            learner.mark(float(version))
            sender.push()
        assert len(versions_seen) > 10  # workers picked up new versions while collecting


def test_a_worker_exception_comes_back_as_one_paragraph_with_its_traceback_beside_it(no_leftovers):
    _, _, collector = start(SharedMemSync(), env_id="tests.toy_envs:Faulty-v0", fault="raise", at_step=3)
    with collector:
        with pytest.raises(CollectorError) as err:
            for _ in collector:
                pass
        assert re.fullmatch(r"collector worker \d \(pid \d+\) failed: EnvError: env tests.toy_envs:Faulty-v0 "
                            r"\(env \d of 2\) raised in step\(\) at its step 3: RuntimeError: env exploded at step 3",
                            str(err.value))
        assert "Traceback" in err.value.details and "env exploded at step 3" in err.value.details


def test_a_worker_that_exits_is_named_with_its_exit_code(no_leftovers):
    _, _, collector = start(SharedMemSync(), env_id="tests.toy_envs:Faulty-v0", fault="exit", at_step=3)
    with collector:
        with pytest.raises(CollectorError, match=r"collector worker \d \(pid \d+\) died \(exit code 3\)"):
            for _ in collector:
                pass


def test_a_killed_worker_fails_the_learner_within_seconds(no_leftovers):
    _, _, collector = start(SharedMemSync(), timeout_s=60.0)
    with collector:
        batches = iter(collector)
        next(batches)
        os.kill(collector.pool.pids[1], signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(CollectorError, match=r"collector worker 1 \(pid \d+\) died \(killed by SIGKILL\)"):
            for _ in range(1000):
                next(batches)
        assert time.monotonic() - started < 30.0  # noticed through the sentinel, not the 60 s timeout


def test_a_pipe_push_to_a_dead_worker_fails_at_once_naming_it(no_leftovers):
    learner, sender, collector = start(PipeSync(), timeout_s=60.0)
    try:
        with collector:
            next(iter(collector))
            os.kill(collector.pool.pids[1], signal.SIGKILL)
            collector.pool._children[1].process.join(timeout=10)
            from rltrain.errors import SyncError

            started = time.monotonic()
            with pytest.raises(SyncError, match="could not reach receiver 1"):
                for _ in range(100):  # the dead worker's pipe fills, then the next write fails
                    learner.mark(1.0)
                    sender.push()
            assert time.monotonic() - started < 30.0  # not the 60 s sync timeout
    finally:
        sender.close()


def test_a_stuck_worker_times_out_with_a_clear_message(no_leftovers):
    _, _, collector = start(SharedMemSync(), env_id="tests.toy_envs:Faulty-v0", fault="hang", at_step=3,
                            timeout_s=5.0)
    with collector:
        with pytest.raises(CollectorError, match=r"no 'batch' message from collector worker\(s\) \[0, 1\] within 5.0s"):
            for _ in collector:
                pass


def test_a_weight_layout_mismatch_fails_at_connect(no_leftovers):
    with pytest.raises(CollectorError, match=r"does not match the collector's policy: .*w: learner \(1,\)"):
        start(SharedMemSync(), policy_size=2)


def test_batches_come_back_through_shared_memory_buffers(no_leftovers):
    _, _, collector = start(SharedMemSync())
    with collector:
        for worker_buffers in collector.pool.buffers:
            for frames in worker_buffers:
                assert all(t.is_shared() for t in frames.values())
        batch = next(iter(collector))
        assert not batch["observation"].is_shared()  # the learner gets its own copy


# --- through build() and the CLI -------------------------------------------------------------

from rltrain import build  # noqa: E402
from tests.conftest import ROOT, make_config  # noqa: E402

COLLECTORS = ["local", "lockstep", "async"]


# local + pipe is rejected by build (test_local_collector_with_pipe_sync_is_rejected_with_the_reason).
COMBINATIONS = [(c, s) for c in COLLECTORS for s in [*SCHEMES, "none"] if (c, s) != ("local", "pipe")]


@pytest.mark.parametrize(("collector", "sync"), COMBINATIONS)
def test_every_collector_and_sync_combination_trains(collector, sync, tmp_path, no_leftovers):
    cfg = make_config(f"collector={collector}", f"sync={sync}", "trainer.total_frames=1024",
                      "trainer.stop_at_return=null", "hooks.eval.episodes=2")
    summary = build(cfg, run_dir=tmp_path).fit()
    assert summary["status"] == "completed" and summary["frames"] >= 1024
    assert summary["sync"]["pushes"] == (0 if sync == "none" else summary["updates"])


def test_a_worker_failure_is_the_runs_status_in_summary_json(tmp_path, no_leftovers):
    cfg = make_config("collector=lockstep", "env.id=tests.toy_envs:Faulty-v0", "+env.kwargs.fault=raise",
                      "+env.kwargs.at_step=40", "trainer.stop_at_return=null")
    with pytest.raises(CollectorError, match="env exploded at step 40"):
        build(cfg, run_dir=tmp_path).fit()
    status = json.loads((tmp_path / "summary.json").read_text())["status"]
    assert re.fullmatch(r"failed: CollectorError: collector worker \d \(pid \d+\) failed: EnvError: env "
                        r"tests.toy_envs:Faulty-v0 \(env \d of 8\) raised in step\(\) at its step 40: "
                        r"RuntimeError: env exploded at step 40", status)  # one paragraph, not a traceback


def test_a_slow_learner_holds_async_workers_back_instead_of_dropping_their_batches(tmp_path, no_leftovers):
    # Without backpressure, 20 of 52 batches (38%) were collected and then dropped as over max_lag here.
    cfg = make_config("collector=async", "collector.max_lag=2", "trainer.total_frames=8192",
                      "trainer.stop_at_return=null", "hooks.eval.episodes=1",
                      "+hooks.slow._target_=tests.hooks_for_tests.SlowLearner", "+hooks.slow.delay_s=0.05")
    summary = build(cfg, run_dir=tmp_path).fit()
    assert summary["frames"] == 8192 and summary["sync"]["max_lag"] <= 2
    assert summary["sync"]["dropped_batches"] <= 1  # the exception (two workers may race for one place)
    assert summary["sync"]["dropped_share"] == pytest.approx(
        summary["sync"]["dropped_frames"] / (summary["frames"] + summary["sync"]["dropped_frames"]))


def test_async_workers_with_max_lag_0_collect_only_what_the_learner_can_use(tmp_path, no_leftovers):
    # Before backpressure: 124 of 156 batches (79%) dropped here.
    cfg = make_config("collector=async", "collector.max_lag=0", "trainer.total_frames=4096",
                      "trainer.stop_at_return=null", "hooks.eval.episodes=1")
    summary = build(cfg, run_dir=tmp_path).fit()
    assert summary["frames"] == 4096 and summary["sync"]["max_lag"] == 0
    assert summary["sync"]["dropped_batches"] <= 2  # both workers may start the very first batches at once


def session_processes(sid: int) -> list[int]:
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # field 6 of /proc/PID/stat: the session id
            pids.append(int(stat.parent.name))
    return pids


@pytest.mark.parametrize("collector", ["lockstep", "async"])
def test_ctrl_c_stops_workers_and_leaves_nothing_behind(collector, tmp_path):
    import json
    import subprocess
    import sys

    shm_before = shm_entries()
    proc = subprocess.Popen(
        [sys.executable, "-m", "rltrain", f"collector={collector}", "trainer.total_frames=100000000",
         "trainer.stop_at_return=null", "hooks.log.every.seconds=0.2", "hydra.run.dir=run"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 60
    while not (metrics.exists() and metrics.stat().st_size > 0) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(session_processes(proc.pid)) >= 3  # the trainer and its two workers
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole process group
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["frames"] > 0
    assert (tmp_path / "run" / "checkpoints" / f"frames_{summary['frames']:012d}.pt").is_file()
    deadline = time.monotonic() + 10
    while session_processes(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert session_processes(proc.pid) == []
    assert shm_entries() - shm_before == set()


def test_pipe_sync_delivers_a_network_larger_than_the_pipe_buffer(tmp_path, no_leftovers):
    cfg = make_config("collector=lockstep", "sync=pipe", "algo.network.hidden_sizes=[1024,1024]",
                      "trainer.total_frames=1024", "collector.frames_per_batch=256", "trainer.stop_at_return=null",
                      "hooks.eval.episodes=1")
    summary = build(cfg, run_dir=tmp_path).fit()
    assert summary["status"] == "completed" and summary["sync"]["pushes"] == 4


def test_local_collector_with_pipe_sync_is_rejected_with_the_reason(tmp_path):
    from rltrain.errors import ConfigError

    with pytest.raises(ConfigError, match="sync=pipe sends weights to worker processes"):
        build(make_config("collector=local", "sync=pipe"), run_dir=tmp_path)
