"""sync=distributed and collector=distributed: real gloo groups on loopback, real torchrun jobs
(``--standalone``: a free port), real process deaths; every test bounded in time."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from rltrain import build
from rltrain.checkpoint import listing as checkpoint_listing
from rltrain.collectors import DistributedCollector
from rltrain.errors import ConfigError
from tests.conftest import ROOT, make_config, run_cli

FAST = ["hooks.eval.episodes=2"]  # the default 200k frames, stopping once solved


def torchrun(*args: str, cwd: Path, nproc: int = 3, extra: tuple[str, ...] = (), popen: bool = False,
             timeout: float = 240):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *extra,
           "-m", "rltrain", *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if popen:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def run_dirs(cwd: Path) -> list[Path]:
    return sorted(p.parent for p in (cwd / "outputs").glob("*/*/summary.json"))


def summary_of(cwd: Path) -> dict:
    (run_dir,) = run_dirs(cwd)
    return json.loads((run_dir / "summary.json").read_text())


def rank_pid(run_dir: Path, rank: int, timeout: float = 60) -> int:
    log, deadline = run_dir / "ranks" / f"{rank}.log", time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = log.exists() and re.search(r"pid (\d+)", log.read_text())
        if m:
            return int(m.group(1))
        time.sleep(0.1)
    raise AssertionError(f"{log} never named its pid")


def wait_for_frames(run_dir: Path, frames: int, timeout: float = 120) -> None:
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.exists() and any(row.get("frames", 0) >= frames for row in rows_so_far(metrics)):
            return
        time.sleep(0.1)
    raise AssertionError(f"{metrics} never reached {frames} frames")


def rows_so_far(metrics: Path) -> list[dict]:
    """The rows of a metrics.jsonl being written (a torn last line is skipped)."""
    rows = []
    for line in metrics.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows


def newest_run_dir(cwd: Path, timeout: float = 60) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dirs = sorted((cwd / "outputs").glob("*/*/ranks"))
        if dirs:
            return dirs[-1].parent
        time.sleep(0.1)
    raise AssertionError("no run dir with ranks/ appeared")


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


# -- sync=distributed with the worker-process collectors of one machine


@pytest.mark.parametrize("collector", ["lockstep", "async"])
def test_sync_distributed_with_worker_processes_solves_cartpole(collector, tmp_path):
    trainer = build(make_config(f"collector={collector}", "sync=distributed", *FAST), run_dir=tmp_path)
    summary = trainer.fit()
    assert summary["solved"], summary["train_return"]
    assert summary["sync"]["pushes"] == summary["sync"]["version"] > 10
    if collector == "lockstep":  # a batch commanded after a push acts with it: no lag at all
        assert summary["sync"]["max_lag"] == 0


def test_a_users_own_default_group_is_left_alone(tmp_path):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        world = dist.group.WORLD
        build(make_config("collector=lockstep", "sync=distributed", "trainer.total_frames=2048"),
              run_dir=tmp_path).fit()
        assert dist.is_initialized() and dist.group.WORLD is world
        t = torch.ones(3)
        dist.all_reduce(t)  # the user's group still works
        assert t.tolist() == [1.0, 1.0, 1.0]
    finally:
        dist.destroy_process_group()


README_LISTENER = re.compile(r"<!-- listener example -->\s*```python\n(.*?)```", re.S)  # in docs/scaling-out.md


@pytest.mark.parametrize("launch", ["workers", "torchrun"])
def test_the_readme_listener_receives_the_pushes(launch, tmp_path):
    code = README_LISTENER.search((ROOT / "docs" / "scaling-out.md").read_text()).group(1)
    run_dir = tmp_path / "run"
    args = ["sync=distributed", "sync.listeners=1", "trainer.total_frames=40000", "trainer.stop_at_return=null",
            f"hydra.run.dir={run_dir}"]
    if launch == "workers":
        run = subprocess.Popen([sys.executable, "-m", "rltrain", "collector=lockstep", *args], cwd=tmp_path,
                               env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    else:
        run = torchrun("collector=distributed", *args, cwd=tmp_path, popen=True)
    try:
        listener = subprocess.run([sys.executable, "-c", code.replace("RUN_DIR", str(run_dir))], cwd=tmp_path,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                                  timeout=120)
        out, _ = run.communicate(timeout=120)
    finally:
        run.kill()
    assert listener.returncode == 0, listener.stderr
    versions = [int(v) for v in re.findall(r"acting with weights version (\d+)", listener.stdout)]
    # Under torchrun the listener also gets the initial version 0 (the ranks' first broadcast).
    assert len(versions) >= 3 and versions == sorted(versions) and versions[-1] >= 3, listener.stdout
    assert run.returncode == 0, out[-3000:]


# -- collector=distributed under torchrun


def test_three_rank_job_solves_cartpole_and_only_rank_0_writes(tmp_path):
    result = torchrun("collector=distributed", "sync=distributed", *FAST, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (run_dir,) = run_dirs(tmp_path)
    assert [p.name for p in (tmp_path / "outputs").glob("*/*")] == [run_dir.name]  # one run dir, rank 0's
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["solved"], summary
    assert summary["sync"]["version"] == summary["sync"]["pushes"] > 5 and summary["sync"]["max_lag"] == 0
    assert sorted(p.name for p in (run_dir / "ranks").iterdir()) == ["1.log", "2.log"]
    assert "collector rank 1 of 3" in (run_dir / "ranks" / "1.log").read_text()


def test_async_ranks_with_their_own_workers_solve_cartpole(tmp_path):
    result = torchrun("collector=distributed", "sync=distributed", "collector.mode=async",
                      "collector.workers_per_rank=2", *FAST, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = summary_of(tmp_path)
    assert summary["solved"], summary
    assert summary["sync"]["max_lag"] <= 2 and summary["sync"]["dropped_share"] < 0.1


def test_sac_on_pendulum_runs_with_distributed_collectors(tmp_path):
    result = torchrun("algo=sac", "env=pendulum", "collector=distributed", "sync=distributed",
                      "collector.frames_per_batch=64", "collector.envs_per_rank=4", "trainer.total_frames=2000",
                      "algo.warmup_frames=1000", "algo.batch_size=64", "hooks.eval.episodes=1", cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = summary_of(tmp_path)
    assert summary["status"] == "completed" and summary["frames"] >= 2000 and summary["updates"] > 10
    assert summary["sync"]["version"] == summary["sync"]["pushes"] > 0


def test_dict_observations_travel_from_collector_ranks_with_their_keys(tmp_path):
    result = torchrun("env.id=tests.toy_envs:GoalCorridor-v0", "collector=distributed", "sync=distributed",
                      "collector.frames_per_batch=128", "collector.envs_per_rank=4", "algo.minibatch_size=64",
                      "trainer.total_frames=8192",
                      "trainer.stop_at_return=null", "hooks.eval.episodes=4", cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = summary_of(tmp_path)
    assert summary["status"] == "completed" and summary["frames"] >= 8192
    assert summary["eval_return"] >= 0.5  # random: about 0.1; only both keys, read right, say where to go


def test_without_pushes_the_ranks_stay_at_the_untrained_return(tmp_path):
    result = torchrun("collector=distributed", "sync=distributed", "sync.every=null", "trainer.total_frames=30000",
                      cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = summary_of(tmp_path)
    assert summary["sync"]["version"] == 0 and not summary["solved"]
    assert summary["train_return"] < 60  # a random CartPole policy: about 22


# -- faults: a clear error naming the rank, within the timeout, and nothing left behind


def test_a_rank_that_raises_shows_its_traceback_in_the_learner(tmp_path):
    before = shm_entries()
    result = torchrun("collector=distributed", "sync=distributed", "env.id=tests.toy_envs:Faulty-v0",
                      "+env.kwargs.fault=raise", "+env.kwargs.at_step=300", "+env.kwargs.rank=2",
                      "trainer.stop_at_return=null", cwd=tmp_path, timeout=120)
    assert result.returncode != 0
    summary = summary_of(tmp_path)
    assert summary["status"].startswith("failed: CollectorError: collector rank 2"), summary["status"]
    assert "env exploded at step 300" in summary["status"]
    (run_dir,) = run_dirs(tmp_path)
    log = (run_dir / "cli.log").read_text()
    assert "collector rank 2:" in log and "Traceback" in log and "toy_envs.py" in log
    assert shm_entries() <= before


def test_a_rank_that_fails_while_starting_is_named_at_once(tmp_path):
    result = torchrun("collector=distributed", "sync=distributed", "env.id=tests.toy_envs:Faulty-v0",
                      "+env.kwargs.fault=raise_on_reset", "+env.kwargs.rank=2", "collector.timeout_s=300",
                      cwd=tmp_path, timeout=240)
    assert result.returncode != 0
    status = summary_of(tmp_path)["status"]
    # Seen while the learner waits for the ranks to join (not after collector.timeout_s: the test's timeout).
    assert status.startswith("failed: CollectorError: collector rank 2 failed while starting: EnvError: env "
                             "tests.toy_envs:Faulty-v0 (env 0 of 8) raised in reset()"), status


def test_a_killed_rank_fails_the_learner_naming_it(tmp_path):
    job = torchrun("collector=distributed", "sync=distributed", "trainer.total_frames=10000000",
                   "trainer.stop_at_return=null", cwd=tmp_path, popen=True)
    try:
        run_dir = newest_run_dir(tmp_path)
        wait_for_frames(run_dir, 5000)
        os.kill(rank_pid(run_dir, 1), signal.SIGKILL)
        killed_at = time.monotonic()
        job.wait(timeout=60)
    finally:
        os.killpg(job.pid, signal.SIGKILL) if job.poll() is None else None
    assert time.monotonic() - killed_at < 60 and job.returncode != 0
    status = json.loads((run_dir / "summary.json").read_text())["status"]
    if status == "interrupted":
        # torchrun saw the dead rank first and sent the learner SIGTERM, which asks for a checkpoint: the
        # learner stops as asked, and its log names the rank that died (or, when the stop came first, the
        # rank whose envs the checkpoint could not hold because it is gone).
        log = (run_dir / "cli.log").read_text()
        assert re.search(r"collector rank 1 .*(died|\(gone\))", log), log[-3000:]
    else:
        assert re.search(r"collector rank 1 .*died", status), status


def test_a_stuck_rank_fails_the_learner_within_the_timeout(tmp_path):
    started = time.monotonic()
    result = torchrun("collector=distributed", "sync=distributed", "env.id=tests.toy_envs:Faulty-v0",
                      "+env.kwargs.fault=hang", "+env.kwargs.at_step=300", "+env.kwargs.rank=1",
                      "collector.timeout_s=4", "trainer.stop_at_return=null", cwd=tmp_path, timeout=120)
    assert result.returncode != 0 and time.monotonic() - started < 100
    status = summary_of(tmp_path)["status"]
    assert "collector rank 1" in status and "within 4s (collector.timeout_s)" in status, status


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_ranks_exit_when_the_learner_dies(tmp_path):
    # Launched as torchrun would, but without its agent (which would stop the ranks itself).
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "rltrain", "collector=distributed", "sync=distributed",
                               "trainer.total_frames=10000000", "trainer.stop_at_return=null"], cwd=tmp_path,
                              env={**os.environ, "PYTHONPATH": str(ROOT), "RANK": str(r), "WORLD_SIZE": "3",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for r in range(3)]
    try:
        run_dir = newest_run_dir(tmp_path)
        wait_for_frames(run_dir, 3000)
        procs[0].kill()
        for p in procs[1:]:
            p.wait(timeout=30)  # at once: their connection to the learner closed
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert all(p.returncode is not None for p in procs)


def test_torchrun_restarts_a_killed_rank_and_the_run_resumes(tmp_path):
    job = torchrun("collector=distributed", "sync=distributed", "resume=auto", "trainer.total_frames=40000",
                   "trainer.stop_at_return=null", "~hooks.checkpoint.every", "+hooks.checkpoint.every={frames: 4096}",
                   "~hooks.log.every", "+hooks.log.every={frames: 2048}", cwd=tmp_path, popen=True,
                   extra=("--max-restarts=2",))
    try:
        run_dir = newest_run_dir(tmp_path)
        wait_for_frames(run_dir, 12000)
        os.kill(rank_pid(run_dir, 2), signal.SIGKILL)
        out, _ = job.communicate(timeout=180)
    finally:
        os.killpg(job.pid, signal.SIGKILL) if job.poll() is None else None
    assert job.returncode == 0, out[-4000:]
    assert run_dirs(tmp_path) == [run_dir]  # the restarted job continued in the same dir
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["frames"] >= 40000
    frames = [json.loads(line)["frames"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert frames == sorted(set(frames)), f"metrics.jsonl repeats or goes back: {frames}"
    assert set(range(2048, 40000, 2048)) <= set(frames), f"a gap in metrics.jsonl: {frames}"
    assert "restart" in out.lower() or (run_dir / "resumes").exists()


PREEMPTIBLE = ("collector=distributed", "sync=distributed", "resume=auto", "trainer.total_frames=102400",
               "trainer.stop_at_return=null", "hooks.progress.bar=false", "~hooks.log.every",
               "+hooks.log.every={frames: 2048}")


def logged_frames(run_dir: Path) -> list[int]:
    return [json.loads(line)["frames"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def stop_like_a_scheduler(job: subprocess.Popen, run_dir: Path, pids: list[int]) -> str:
    """SIGTERM to torchrun, and to each of ``pids`` (under srun, SLURM signals every process of the job too): the job
    checkpoints and stops. What it printed."""
    try:
        job.send_signal(signal.SIGTERM)
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        out, _ = job.communicate(timeout=120)
    finally:
        os.killpg(job.pid, signal.SIGKILL) if job.poll() is None else None
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted", out[-3000:]
    assert "rltrain: stopped by SIGTERM; checkpoint frames_" in out, out[-3000:]
    assert (run_dir / "checkpoints" / f"frames_{summary['frames']:012d}.pt").exists()
    return out


def resume_to_the_end(args: tuple[str, ...], cwd: Path, run_dir: Path, frames: int, log_every: int, nproc: int = 3):
    """A new job of ``args`` (resume=auto) finishes the run in ``run_dir``: no row of metrics.jsonl twice or missing."""
    resumed = torchrun(*args, cwd=cwd, nproc=nproc, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert run_dirs(cwd) == [run_dir]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["frames"] == frames
    logged = logged_frames(run_dir)
    assert logged == sorted(set(logged)) and logged[-1] == frames, logged
    assert set(range(log_every, frames, log_every)) <= set(logged), f"a gap in metrics.jsonl: {logged}"


@pytest.mark.parametrize("signalled", ["torchrun", "every process"])
def test_sigterm_to_torchrun_checkpoints_and_resume_auto_continues_the_run(signalled, tmp_path):
    # The SLURM preemption path: torchrun forwards SIGTERM to every rank at once; under srun, SLURM
    # also signals every process itself, so each rank gets it twice.
    job = torchrun(*PREEMPTIBLE, cwd=tmp_path, popen=True)
    try:
        run_dir = newest_run_dir(tmp_path)
        wait_for_frames(run_dir, 8192)
        ranks = [json.loads((run_dir / "run.lock").read_text())["pid"], rank_pid(run_dir, 1), rank_pid(run_dir, 2)]
    except BaseException:
        os.killpg(job.pid, signal.SIGKILL)
        raise
    out = stop_like_a_scheduler(job, run_dir, ranks if signalled == "every process" else [])
    assert "collector rank 1 stopped by SIGTERM" in out and "collector rank 2 stopped by SIGTERM" in out
    resume_to_the_end(PREEMPTIBLE, tmp_path, run_dir, 102400, 2048)


@contextlib.contextmanager
def job_by_hand(args: tuple[str, ...], cwd: Path):
    """A 3-process job as torchrun starts it, without its agent (which would signal every rank); only
    the learner's output is kept. Every process is gone afterwards."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "rltrain", *args], cwd=cwd,
                              env={**os.environ, "PYTHONPATH": str(ROOT), "RANK": str(r), "WORLD_SIZE": "3",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
                              stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL, stderr=subprocess.STDOUT,
                              text=True)
             for r in range(3)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


def learner_output(procs: list[subprocess.Popen], timeout: float) -> str:
    out, _ = procs[0].communicate(timeout=timeout)
    for p in procs[1:]:
        p.wait(timeout=60)
    return out


def test_a_stop_signal_checkpoints_even_when_a_rank_is_already_gone(tmp_path):
    with job_by_hand(PREEMPTIBLE, tmp_path) as procs:
        run_dir = newest_run_dir(tmp_path)
        wait_for_frames(run_dir, 8192)
        rank_1 = rank_pid(run_dir, 1)
        os.kill(rank_1, signal.SIGSTOP)  # the learner now waits on rank 1 (in a collect, a push or its checkpoint)
        time.sleep(1)
        procs[0].send_signal(signal.SIGTERM)
        time.sleep(1)
        os.kill(rank_1, signal.SIGKILL)  # gone before it could answer
        out = learner_output(procs, 120)
    assert procs[0].returncode == 128 + signal.SIGTERM, out[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"
    assert "start fresh episodes on resume" in (run_dir / "cli.log").read_text()
    assert checkpoint_listing(run_dir), "no checkpoint written"

    with job_by_hand(PREEMPTIBLE, tmp_path) as procs:
        out = learner_output(procs, 300)
    assert procs[0].returncode == 0, out[-3000:]
    assert "the envs of collector rank(s) 1 start fresh episodes" in out
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    frames = logged_frames(run_dir)
    assert frames == sorted(set(frames)) and frames[-1] == 102400, frames


# -- bad input: refused before anything starts


def test_sync_distributed_needs_collectors_in_other_processes(tmp_path):
    with pytest.raises(ConfigError, match="runs in the learner's process"):
        build(make_config("collector=local", "sync=distributed"), run_dir=tmp_path)


def test_collector_distributed_outside_torchrun_is_refused(tmp_path):
    result = run_cli("collector=distributed", "sync=distributed", cwd=tmp_path, timeout=60)
    assert result.returncode == 2 and "launch with torchrun --nproc-per-node=3" in result.stderr


def test_torchrun_with_a_one_machine_collector_is_refused(tmp_path):
    result = torchrun("collector=lockstep", "sync=distributed", cwd=tmp_path, nproc=2, timeout=120)
    assert result.returncode != 0
    # torchrun stops the other rank as soon as one fails, so how many ranks print it is a race
    assert "use collector=distributed" in result.stdout + result.stderr


@pytest.mark.parametrize("rank", [0, 1])
def test_a_one_machine_collector_is_refused_on_each_rank_by_itself(tmp_path, rank):
    # each rank refuses on its own, without waiting for the other ranks' checks (torchrun stops a job's other
    # ranks once one fails, so that cannot be seen in a torchrun job); for rank 1 this test plays rank 0's part:
    # it hosts the job's store and publishes the run dir
    port = free_port()
    if rank == 1:
        store = torch.distributed.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)
        run_dir = tmp_path / "outputs" / "run"
        run_dir.mkdir(parents=True)
        torch.distributed.PrefixStore("rltrain/job/0/", store).set("hydra_dir", str(run_dir))
    result = run_cli("collector=lockstep", "sync=distributed", cwd=tmp_path, timeout=60,
                     env={"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    assert result.returncode == 2 and f"this is rank {rank} of a torchrun job" in result.stderr
    assert "use collector=distributed" in result.stderr


def test_collector_distributed_needs_sync_distributed(tmp_path):
    result = torchrun("collector=distributed", "sync=shared_mem", cwd=tmp_path, nproc=2, timeout=120)
    assert result.returncode != 0 and "use sync=distributed" in result.stdout + result.stderr


def test_collector_mode_picks_the_class_with_its_own_batch_rule():
    world = SimpleNamespace(size=3)  # what check_job reads of a torchrun job: rank 0 learns, two ranks collect
    assert DistributedCollector.rank_frames({"mode": "lockstep", "frames_per_batch": 512}, 2) == 256  # a share
    assert DistributedCollector.rank_frames({"mode": "async", "frames_per_batch": 512}, 2) == 512  # a whole batch
    with pytest.raises(ConfigError, match=re.escape("multiple of collector ranks x collector.envs_per_rank (2 x 8); "
                                                    "e.g. collector.frames_per_batch=96")):
        DistributedCollector.check_job(world, {"mode": "lockstep", "frames_per_batch": 100, "envs_per_rank": 8})
    with pytest.raises(ConfigError, match=re.escape("multiple of collector.envs_per_rank (8); "
                                                    "e.g. collector.frames_per_batch=96")):
        DistributedCollector.check_job(world, {"mode": "async", "frames_per_batch": 100, "envs_per_rank": 8})
    with pytest.raises(ConfigError, match=re.escape("collector.envs_per_rank (8) must be a multiple of "
                                                    "collector.workers_per_rank (3)")):
        DistributedCollector.check_job(world, {"mode": "async", "frames_per_batch": 96, "workers_per_rank": 3})
    with pytest.raises(ConfigError, match="collector.mode must be lockstep or async \\(got 'sync'\\)"):
        DistributedCollector.check_job(world, {"mode": "sync", "frames_per_batch": 512})


def test_an_unreachable_rendezvous_is_named(tmp_path):
    result = run_cli("collector=distributed", "sync=distributed", cwd=tmp_path, timeout=60,
                     env={"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                          "RLTRAIN_CONNECT_TIMEOUT_S": "2"})
    assert result.returncode == 2
    assert "cannot reach rltrain's store at 127.0.0.1" in result.stderr and "MASTER_ADDR/MASTER_PORT" in result.stderr
