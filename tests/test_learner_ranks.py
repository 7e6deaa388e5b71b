"""A learner on every rank of a torchrun job (strategy=ddp): real gloo groups on loopback, real torchrun
jobs of 2 processes, each rank collecting and learning on its share of every batch."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from rltrain import checkpoint, strategies
from rltrain.collectors.generation import GenerationCollector
from rltrain.llm.engine import TransformersEngine
from rltrain.llm.model import LanguageModel
from rltrain.llm.rewards import Rewards
from rltrain.llm.tasks import ReverseDigits
from rltrain.llm.tiny import write_tiny_model
from rltrain.strategies import Single
from tests.conftest import ROOT, run_cli
from tests.test_distributed import (
    free_port,
    newest_run_dir,
    rank_pid,
    resume_to_the_end,
    rows_so_far,
    run_dirs,
    stop_like_a_scheduler,
    torchrun,
    wait_for_frames,
)
from tests.test_grpo import ONE_TOKEN
from tests.test_run_management import PPO_RUN, SAC_RUN, learning_rows, signal_at

DDP = ("strategy=ddp",)


def test_two_ddp_ranks_make_the_update_of_one_process_on_the_same_global_batch(tmp_path):
    # tests/ranks_for_tests.py: one PPO update (4 epochs, advantage, observation and return normalization,
    # the approximate KL early stop) on a fixed batch of 8 env columns; each rank takes 4 of them.
    one, two = (_update_on(tmp_path / f"{n}.pt", n) for n in (1, 2))
    # Not bitwise: each rank sums its half of the samples, and DDP averages the two halves' gradients, so
    # float32 sums are taken in another order (one rounding, ~6e-8, after 4 epochs of Adam steps).
    for name, weight in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], weight, rtol=0, atol=1e-6, msg=name)
    assert two["metrics"].keys() == one["metrics"].keys()
    assert one["metrics"]["ppo/epochs"] == two["metrics"]["ppo/epochs"] == 3  # the job's KL stopped both alike
    for key, value in one["metrics"].items():
        assert two["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_two_ddp_ranks_make_grpos_update_of_one_process_on_the_same_groups(tmp_path):
    # tests/ranks_for_tests.py: GRPO's update (2 epochs, TIS, a KL penalty, micro-batches whose gradients
    # accumulate) on 8 groups of the tiny model's completions; each rank takes 4 groups.
    model_dir = write_tiny_model(tmp_path / "tiny")
    one, two = (_update_on(tmp_path / f"{n}.pt", n, "grpo", str(model_dir)) for n in (1, 2))
    # Not bitwise: float32 sums in another order (~1e-8 in the gradients), which Adam's g / sqrt(v) magnifies
    # in weights that barely moved (2.8e-6 after the two steps, at lr 3e-3).
    for name, weight in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], weight, rtol=0, atol=2e-5, msg=name)
    # every metric the job's (a token mean over every rank's tokens, the rewards' std over every completion, the
    # flat groups and the TIS ratios counted over all), but the throughputs of different machines' processes
    assert two["metrics"].keys() == one["metrics"].keys()
    assert one["metrics"]["reward/std"] > 0 and one["metrics"]["grpo/clip_fraction"] > 0  # something to compare
    for key, value in one["metrics"].items():
        if not key.startswith("perf/"):
            assert two["metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-7), key


def _update_on(out, ranks: int, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] if ranks > 1 else []
    done = subprocess.run([sys.executable, *launch, "-m", "tests.ranks_for_tests", str(out), *args], env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    return torch.load(out)


class _Rank(Single):
    """Rank ``rank`` of ``size`` as a data-parallel strategy tells a collector which share is its (no group)."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size


class _Recording(TransformersEngine):
    """The tiny model's engine, keeping the prompts and seed of each batch it is asked for."""

    def __init__(self, *args):
        super().__init__(*args)
        self.asked = []

    def submit(self, prompts, group_size, sampling, seed=None):
        self.asked.append((prompts, seed))
        super().submit(prompts, group_size, sampling, seed)


def _reverse_digits(model: LanguageModel, strategy, frames_per_batch: int) -> GenerationCollector:
    """A collector of the task reverse_digits (seed 0) for rank ``strategy.rank``, recording what it asks for."""
    return GenerationCollector(ReverseDigits(seed=0), _Recording(model.load(), model.tokenizer()), model,
                               Rewards(ReverseDigits.REWARDS), seed=5, frames_per_batch=frames_per_batch, group_size=4,
                               max_new_tokens=1, strategy=strategy)


def test_each_ddp_rank_generates_its_share_of_the_prompts_one_process_would_with_seeds_of_its_own(tmp_path):
    model = LanguageModel(str(write_tiny_model(tmp_path / "tiny")))
    collector = functools.partial(_reverse_digits, model)

    one, ranks = collector(Single(), 32), [collector(_Rank(r, 2), 16) for r in (0, 1)]  # 8 prompts: 4 a rank
    for c in (one, *ranks):
        assert [tuple(c.collect().shape) for _ in range(3)] == [(8 if c is one else 4, 4)] * 3  # whole groups
    for b in range(3):  # rank 0 the first half of the job's prompts, rank 1 the second: never the same one
        assert [p for c in ranks for p in c.engine.asked[b][0]] == one.engine.asked[b][0]
    seeds = [c.engine.asked[b][1] for c in ranks for b in range(3)]
    assert len(set(seeds)) == len(seeds)  # each rank's draws its own
    assert [c.state_dict()["task"] for c in ranks] == [one.state_dict()["task"]] * 2  # the job's position


def test_a_one_process_grpo_checkpoint_resumes_on_two_ranks_with_the_prompts_it_would_take_next(tmp_path):
    model = LanguageModel(str(write_tiny_model(tmp_path / "tiny")))
    collector = functools.partial(_reverse_digits, model)

    one = collector(Single(), 32)
    one.collect()
    saved = one.state_dict()
    ahead = one.collect()  # as if generated ahead (engine=vllm, collector.max_lag=1) when the checkpoint was taken
    with_ahead = {**one.state_dict(), "ready": ahead}
    one.collect()
    for state, batch in ((saved, 1), (with_ahead, 1)):  # the batch ahead is generated again, split over the ranks
        ranks = [collector(_Rank(r, 2), 16) for r in (0, 1)]
        for rank in ranks:  # rank 1 has no part of a 1-process checkpoint: it takes rank 0's (the job's)
            checkpoint.Restore({checkpoint.COLLECTOR_KEY: state, checkpoint.RANKS_KEY: []}, rank=rank.rank).collector(
                rank)
            rank.collect()
        assert [p for c in ranks for p in c.engine.asked[0][0]] == one.engine.asked[batch][0]


def test_grpo_on_two_ddp_ranks_learns_the_single_token_task_as_one_process_does(tmp_path):
    # tests/test_grpo.py's run on one process: rewards from chance to above 0.8 (sampled), 0.9 (greedy eval)
    result = torchrun(*DDP, *ONE_TOKEN, cwd=tmp_path, nproc=2, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    [run_dir] = run_dirs(tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert summary["status"] == "completed" and summary["frames"] == 19200 and summary["updates"] == 150
    assert rows[0]["reward/mean"] < 0.2, rows[0]
    assert rows[-1]["reward/mean"] > 0.8 and summary["train_return"] > 0.8, rows[-1]
    assert summary["eval_return"] > 0.9 and rows[-1]["eval/reward/correct"] > 0.9
    assert (run_dir / "model" / "config.json").is_file()  # rank 0's, once


def stopped_and_resumed(tmp_path: Path, run: tuple[str, ...], stop_at: int,
                        on_stop: Callable[[Path], None] = lambda split: None) -> Path:
    """A 2-rank job of ``run``: whole (outputs/full), and stopped by SIGTERM at ``stop_at`` frames (outputs/split,
    given to ``on_stop``), then resumed; every row the resumed run adds to it must equal the whole run's."""
    full = torchrun(*run, "hydra.run.dir=outputs/full", cwd=tmp_path, nproc=2)
    assert full.returncode == 0, full.stderr
    torchrun(*run, *signal_at(stop_at), "hydra.run.dir=outputs/split", cwd=tmp_path, nproc=2)
    split = tmp_path / "outputs/split"
    assert json.loads((split / "summary.json").read_text())["status"] == "interrupted"
    on_stop(split)
    resumed = torchrun(*run, f"resume={split}", "hydra.run.dir=outputs/resume", cwd=tmp_path, nproc=2)
    assert resumed.returncode == 0, resumed.stderr
    assert learning_rows(split) == learning_rows(tmp_path / "outputs/full")
    return split


def test_a_grpo_ddp_run_stopped_and_resumed_matches_an_uninterrupted_one(tmp_path):
    run = ("algo=grpo", "collector.max_new_tokens=1", "trainer.total_frames=2560", "seed=2", "~hooks.log.every",
           "+hooks.log.every={batches:2}")
    # the task's position, each rank's sampling seeds, the weights pushed to each rank's engine and Adam come back
    split = stopped_and_resumed(tmp_path, (*DDP, *run), 1280)
    assert [r["reward/mean"] for r in learning_rows(split)][-1] > 0


def test_episodes_of_several_turns_on_two_ddp_ranks_stop_and_resume_as_an_uninterrupted_run(tmp_path):
    # each rank plays its share of the guessing game's episodes (their turns differ from rank to rank); the
    # episode metrics are the job's (reduced across the ranks)
    run = ("algo=grpo", "env=guess", "collector.max_new_tokens=2", "trainer.total_frames=1536", "seed=3",
           "~hooks.log.every", "+hooks.log.every={batches:2}")
    split = stopped_and_resumed(tmp_path, (*DDP, *run), 768)
    rows = learning_rows(split)
    assert rows[-1]["frames"] == 1536 and 1 < rows[-1]["episode/turns"] <= 4


def test_ppo_on_two_ddp_ranks_solves_cartpole_and_rank_0_alone_writes_the_run(tmp_path):
    result = torchrun(*DDP, "hooks.eval.episodes=2", cwd=tmp_path, nproc=2)
    assert result.returncode == 0, result.stdout + result.stderr
    [run_dir] = run_dirs(tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["solved"], summary
    assert summary["frames_to_solve"] <= 100_000 and summary["eval_return"] >= 400
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["frames"] for r in rows] == sorted({r["frames"] for r in rows})  # one writer: no row twice
    assert rows[-1]["frames"] == summary["frames"]
    # rank 1 logs to its own file; the terminal has rank 0's story once
    assert "learner rank 1 of 2" in (run_dir / "ranks" / "1.log").read_text()
    assert (result.stdout + result.stderr).count("done: status completed") == 1
    [last] = checkpoint.listing(run_dir)
    saved = checkpoint.load(last)
    assert len(saved[checkpoint.RANKS_KEY]) == 1 and saved[checkpoint.RANKS_KEY][0][checkpoint.COLLECTOR_KEY]


def test_a_ddp_run_stopped_by_sigterm_and_resumed_matches_an_uninterrupted_one(tmp_path):
    # SIGTERM reaches rank 0 alone (the kill hook runs there): the ranks agree to stop after the same step.
    full = torchrun(*DDP, *PPO_RUN, "hydra.run.dir=outputs/full", cwd=tmp_path, nproc=2)
    assert full.returncode == 0, full.stderr
    stopped = torchrun(*DDP, *PPO_RUN, *signal_at(5000), "hydra.run.dir=outputs/split", cwd=tmp_path, nproc=2)
    split = tmp_path / "outputs/split"
    summary = json.loads((split / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["frames"] == 5120, stopped.stderr
    resumed = torchrun(*DDP, *PPO_RUN, f"resume={split}", "hydra.run.dir=outputs/resume", cwd=tmp_path, nproc=2)
    assert resumed.returncode == 0, resumed.stderr
    final = json.loads((split / "summary.json").read_text())
    reference = json.loads((tmp_path / "outputs/full/summary.json").read_text())
    assert final["status"] == "completed" and final["frames"] == reference["frames"] == 12288
    # every log row, losses included, as if the run had never stopped: both ranks' envs and generators came back
    assert learning_rows(split) == learning_rows(tmp_path / "outputs/full")
    assert final["eval_return"] == reference["eval_return"]


def test_strategy_ddp_outside_torchrun_says_how_to_launch_it(tmp_path):
    result = run_cli(*DDP, cwd=tmp_path, timeout=120)
    assert result.returncode == 2
    assert "launch with: torchrun --standalone --nproc-per-node=2 -m rltrain strategy=ddp" in result.stderr


@pytest.mark.parametrize("args, says", [
    (("env.num_envs=15", "collector.frames_per_batch=510"), "env.num_envs=15 does not split over the 2 ranks"),
    (("algo.minibatch_size=255",), "algo.minibatch_size=255 does not split over the 2 ranks"),
    (("collector=distributed", "sync=distributed"), "every rank learns and collects its own share"),
    (("collector=async",), "collector=async cannot be split over the ranks of strategy=ddp"),
    (("algo=grpo", "collector.frames_per_batch=24", "collector.group_size=8"),
     "collector.frames_per_batch=24 does not split into whole collector.group_size=8 groups over the 2 ranks"),
    (("algo=grpo", "engine=vllm_server", "engine.url=http://127.0.0.1:9"),
     "engine=vllm_server does not run on the ranks of strategy=ddp yet"),
    (("algo=grpo", "engine=vllm", "sync=vllm_transfer"),
     "sync=vllm_transfer does not run on the ranks of strategy=ddp"),
    (("algo._target_=tests.parts_for_tests.OneProcessPPO",),
     "algo._target_=tests.parts_for_tests.OneProcessPPO does not learn on the data-parallel ranks of strategy=ddp"),
])
def test_what_cannot_run_on_ddp_ranks_is_refused_in_one_line(args, says, tmp_path):
    result = torchrun(*DDP, *args, cwd=tmp_path, nproc=2, timeout=120)
    assert result.returncode != 0 and says in result.stderr, result.stderr[-3000:]
    assert not run_dirs(tmp_path)


def learner_job(args: tuple[str, ...], cwd, rank_args: dict | None = None,
                strategy: tuple[str, ...] = DDP) -> list[subprocess.Popen]:
    """A 2-rank learner job as torchrun starts it, without its agent (which would stop the other rank itself);
    ``rank_args``: a rank's own arguments, after ``args``."""
    port = free_port()
    return [subprocess.Popen([sys.executable, "-m", "rltrain", *strategy, *args, *(rank_args or {}).get(rank, ())],
                             cwd=cwd, stderr=subprocess.PIPE,
                             stdout=subprocess.DEVNULL, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT), "RANK": str(rank), "LOCAL_RANK": str(rank),
                                  "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
            for rank in range(2)]


def test_ranks_started_with_different_configs_name_the_key(tmp_path):
    procs = learner_job(("seed=0",), tmp_path, rank_args={1: ("seed=1",)})
    try:
        errors = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for p, err in zip(procs, errors):
        assert p.returncode == 2, err
        assert "the ranks were started with different configs: rank 1 has seed: 0 -> 1" in err


@pytest.mark.parametrize("strategy, run, frames", [
    (DDP, ("trainer.total_frames=10000000", "trainer.stop_at_return=null"), 4096),
    # sharded: rank 0 is inside a collective of every forward pass (each layer's gather) when rank 1 goes
    (("strategy=fsdp", "engine=learner"), ("algo=grpo", "trainer.total_frames=10000000"), 256),
])
def test_a_learner_rank_that_dies_fails_the_others_at_once_naming_it(strategy, run, frames, tmp_path):
    procs = learner_job(run, tmp_path, strategy=strategy)
    try:
        wait_for_frames(newest_run_dir(tmp_path), frames)
        procs[1].kill()
        err = procs[0].communicate(timeout=60)[1]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert procs[0].returncode == 1
    assert f"learner rank 1 (pid {procs[1].pid}) of this job died during" in err, err[-3000:]
    [run_dir] = run_dirs(tmp_path)
    assert json.loads((run_dir / "summary.json").read_text())["status"].startswith("failed: LearnerRankError")


def test_a_learner_rank_that_hangs_fails_the_job_within_the_timeout_naming_it_and_what_it_began(tmp_path):
    procs = learner_job(("env.id=tests.toy_envs:Faulty-v0", "+env.kwargs.fault=hang", "+env.kwargs.at_step=300",
                         "+env.kwargs.rank=1", "strategy.timeout_s=20", "trainer.stop_at_return=null"), tmp_path)
    try:
        err = procs[0].communicate(timeout=120)[1]  # rank 1 hangs in its env: it is the test's to stop
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert procs[0].returncode == 1
    named = (r"learner rank 1 did not answer within strategy.timeout_s=20 during .* on rank 0: rank 1 "
             rf"\(pid {procs[1].pid} on .*\) began collecting its share of a batch in step \d+ \d+s ago")
    assert re.search(named, err), err[-3000:]


def test_a_timeout_names_the_rank_that_is_elsewhere_not_one_waiting_in_the_same_agreement():
    # 3 ranks: rank 0 timed out in an agreement; rank 1 waits in that same agreement (it got there first, so its
    # note is older than rank 0's wait); rank 2 began collecting and never came. Only rank 2 is named.
    ddp = strategies.DDP.__new__(strategies.DDP)  # (its naming alone: no process group)
    ddp.rank, ddp.size, ddp.timeout_s, ddp.members = 0, 3, 5.0, [(socket.gethostname(), os.getpid())] * 3
    ddp._notes = torch.distributed.HashStore()
    now = time.time()
    ddp._notes.set("1", f"{now - 8:.3f} an agreement of the ranks on the step in step 4")
    ddp._notes.set("2", f"{now - 9:.3f} collecting its share of a batch in step 4")
    ddp.note("an agreement of the ranks on the step in step 4")
    error = ddp.failure(RuntimeError("[gloo] Timed out waiting 5000ms for send operation to complete"),
                        "an agreement of the ranks on the step")
    assert str(error).startswith("learner rank 2 did not answer within strategy.timeout_s=5 during an agreement of "
                                 f"the ranks on the step on rank 0: rank 2 (pid {os.getpid()} on "), str(error)
    assert "began collecting its share of a batch in step 4 9s ago" in str(error) and "rank 1" not in str(error)


def test_a_ddp_checkpoint_resumes_on_one_process_and_back_on_two_ranks(tmp_path):
    run = ("trainer.stop_at_return=null", "hydra.run.dir=outputs/run")
    two = torchrun(*DDP, *run, "trainer.total_frames=4096", cwd=tmp_path, nproc=2)
    assert two.returncode == 0, two.stderr
    one = run_cli(*run, "resume=outputs/run", "trainer.total_frames=8192", cwd=tmp_path)
    assert one.returncode == 0, one.stderr
    # weights, optimizer and figures go on; the envs were split otherwise: they start fresh episodes
    assert "resumed at 4,096 frames" in one.stdout + one.stderr and "start fresh episodes" in one.stdout + one.stderr
    again = torchrun(*DDP, *run, "resume=outputs/run", "trainer.total_frames=12288", cwd=tmp_path, nproc=2)
    assert again.returncode == 0, again.stderr
    summary = json.loads((tmp_path / "outputs/run/summary.json").read_text())
    assert summary["status"] == "completed" and summary["frames"] == 12288 and summary["updates"] == 24


def test_sac_on_two_ddp_ranks_resumes_exactly_with_every_ranks_replay_buffer(tmp_path):
    # each rank samples its share of every minibatch from the buffer of the frames it collected itself
    def rank_1_kept_its_own(split: Path) -> None:
        [saved] = checkpoint.listing(split)
        rank_1 = checkpoint.load(saved)[checkpoint.RANKS_KEY][0][checkpoint.ALGO_KEY]["replay_buffer"]
        assert rank_1["size"] == 200  # half of the 400 frames: rank 1's own

    stopped_and_resumed(tmp_path, (*DDP, *SAC_RUN), 400, rank_1_kept_its_own)


def test_a_ddp_job_restarted_by_torchrun_then_stopped_by_sigterm_resumes_to_the_end(tmp_path):
    # The SLURM path for learner ranks: a rank killed, torchrun (--max-restarts) restarts the job, which resumes
    # from its last checkpoint (resume=auto); then SIGTERM to torchrun and to every rank (srun signals them all)
    # checkpoints and stops; a new job with resume=auto finishes the run. metrics.jsonl stays one story.
    run = (*DDP, "resume=auto", "trainer.total_frames=131072", "trainer.stop_at_return=null",
           "hooks.progress.bar=false", "~hooks.checkpoint.every", "+hooks.checkpoint.every={frames: 4096}",
           "~hooks.log.every", "+hooks.log.every={frames: 1024}")
    job = torchrun(*run, cwd=tmp_path, nproc=2, popen=True, extra=("--max-restarts=1",))
    try:
        run_dir = newest_run_dir(tmp_path)
        wait_for_frames(run_dir, 6144)
        first = rank_pid(run_dir, 1)
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while (pid := newest_pid(run_dir, 1)) == first and time.monotonic() < deadline:
            time.sleep(0.2)  # the restarted job's rank 1 names its own pid in the same log
        assert pid != first, "torchrun did not restart the job"
        restarted_at = max(row["frames"] for row in rows_so_far(run_dir / "metrics.jsonl"))
        wait_for_frames(run_dir, restarted_at + 4096)
        ranks = [json.loads((run_dir / "run.lock").read_text())["pid"], pid]
    except BaseException:
        os.killpg(job.pid, signal.SIGKILL)
        raise
    out = stop_like_a_scheduler(job, run_dir, ranks)
    assert "rltrain: learner rank 1 stopped by SIGTERM; rank 0 says whether and where it checkpointed" in out
    assert json.loads((run_dir / "summary.json").read_text())["frames"] < 131072
    resume_to_the_end(run, tmp_path, run_dir, 131072, 1024, nproc=2)


def newest_pid(run_dir: Path, rank: int) -> int:
    """The pid the newest process of learner rank ``rank`` logged (a restarted job's ranks log where the last did)."""
    return int(re.findall(r"learner rank \d+ of \d+, pid (\d+)", (run_dir / "ranks" / f"{rank}.log").read_text())[-1])


def test_dqn_on_two_ddp_ranks_resumes_exactly_with_each_ranks_buffer_and_exploration_rates(tmp_path):
    # per_env: each rank's envs keep their rungs of the ladder (env k of the job), through the stop as well
    run = (*DDP, "algo=dqn", "algo.exploration=per_env", "env.num_envs=4", "collector.frames_per_batch=64",
           "algo.warmup_frames=128", "algo.batch_size=32", "algo.n_step=3", "algo.target_update_interval=4",
           "trainer.total_frames=768", "trainer.stop_at_return=null", "seed=3", "~hooks.log.every",
           "+hooks.log.every={frames:64}")

    def each_rank_kept_its_own(split: Path) -> None:
        [saved] = checkpoint.listing(split)
        state = checkpoint.load(saved)
        rank_1 = state[checkpoint.RANKS_KEY][0]
        assert rank_1[checkpoint.ALGO_KEY]["replay_buffer"]["size"] == 192  # half of the 384 frames: its own
        # the job's 4 envs split over the ranks as one process holds them (env k seeded seed + k, seed=3): rank 0
        # steps envs 0-1 and rank 1 envs 2-3, each at that env's rung of the exploration ladder
        assert state[checkpoint.COLLECTOR_KEY]["env_indices"].tolist() == [3, 4]
        assert rank_1[checkpoint.COLLECTOR_KEY]["env_indices"].tolist() == [5, 6]

    stopped_and_resumed(tmp_path, run, 384, each_rank_kept_its_own)
