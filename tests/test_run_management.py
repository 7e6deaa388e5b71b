"""Run management: checkpoints and exact resume, stop signals, timing, progress, eval videos, wandb resume."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

from rltrain import build, checkpoint
from rltrain.errors import CheckpointError, ConfigError
from tests.conftest import make_config, run_cli
from tests.test_outputs import read_jsonl, read_wandb_records

# Keys that measure the machine, not the learning: they differ between any two runs.
_TIMED = ("time/", "perf/", "sync/push_ms")
PPO_RUN = ("trainer.total_frames=12288", "trainer.stop_at_return=null", "seed=3",
           "~hooks.log.every", "+hooks.log.every={frames:2048}")
SAC_RUN = ("algo=sac", "env=pendulum", "env.num_envs=4", "collector.frames_per_batch=4", "algo.warmup_frames=200",
           "algo.batch_size=64", "trainer.total_frames=800", "trainer.stop_at_return=null", "seed=3",
           "~hooks.log.every", "+hooks.log.every={frames:100}")


def signal_at(frames: int, sig: str = "SIGTERM", times: int = 1) -> tuple[str, ...]:
    return ("+hooks.kill._target_=tests.hooks_for_tests.SignalAt", f"+hooks.kill.frames={frames}",
            f"+hooks.kill.signal={sig}", f"+hooks.kill.times={times}")


def learning_rows(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith(_TIMED)} for row in read_jsonl(run_dir / "metrics.jsonl")]


def test_a_run_stopped_by_sigterm_and_resumed_matches_an_uninterrupted_one(tmp_path):
    full = run_cli(*PPO_RUN, "hydra.run.dir=outputs/full", cwd=tmp_path)
    assert full.returncode == 0, full.stderr
    stopped = run_cli(*PPO_RUN, *signal_at(5000), "hydra.run.dir=outputs/split", cwd=tmp_path)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
    split = tmp_path / "outputs/split"
    assert "stopped by SIGTERM" in stopped.stderr and f"resume={split}" in stopped.stderr
    summary = json.loads((split / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["frames"] == 5120  # the step under way was finished
    assert [p.name for p in checkpoint.listing(split)] == ["frames_000000005120.pt"]

    resumed = run_cli(*PPO_RUN, "resume=outputs/split", "hydra.run.dir=outputs/resume", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert not (tmp_path / "outputs/resume").exists()  # the run continued in its own dir
    assert (split / "resumes").is_dir() and "resumed at 5,120 frames" in (split / "cli.log").read_text()
    final = json.loads((split / "summary.json").read_text())
    reference = json.loads((tmp_path / "outputs/full/summary.json").read_text())
    assert final["status"] == "completed" and final["frames"] == reference["frames"] == 12288
    assert final["updates"] == reference["updates"] and final["episodes"] == reference["episodes"]
    # Every log row, losses included, as if the run had never stopped: no gap, no duplicate.
    assert learning_rows(split) == learning_rows(tmp_path / "outputs/full")
    assert final["eval_return"] == reference["eval_return"]


def test_sac_resumes_exactly_with_its_replay_buffer(tmp_path):
    reference = build(make_config(*SAC_RUN), run_dir=tmp_path / "full").fit()
    stopped = build(make_config(*SAC_RUN, *signal_at(400)), run_dir=tmp_path / "split").fit()
    assert stopped["status"] == "interrupted" and stopped["frames"] == 400
    saved = checkpoint.load(checkpoint.listing(tmp_path / "split")[-1])
    assert saved["algo"]["replay_buffer"]["size"] == 400  # past the warm-up: learning had started
    final = build(make_config(*SAC_RUN, f"resume={tmp_path / 'split'}"), run_dir=tmp_path / "unused").fit()
    assert not (tmp_path / "unused").exists()  # it continued in the checkpoint's run dir
    assert final["frames"] == reference["frames"] == 800
    assert learning_rows(tmp_path / "split") == learning_rows(tmp_path / "full")


@pytest.mark.parametrize("sync", ["shared_mem", "pipe", "none"])
def test_resume_is_exact_when_collectors_act_with_older_weights(tmp_path, sync):
    """sync.every=3 (stopped between pushes) and sync=none: collectors act with weights older than
    the learner's; the checkpoint keeps those, so the resumed run acts as the uninterrupted one."""
    run = (*PPO_RUN, f"sync={sync}", "sync.every=3" if sync != "none" else "trainer.total_frames=6144")
    if sync == "pipe":  # pipes reach worker processes only
        run += ("collector=lockstep", "collector.workers=2", "collector.envs_per_worker=4")
    reference = build(make_config(*run), run_dir=tmp_path / "full").fit()
    stopped = build(make_config(*run, *signal_at(5000 if sync == "shared_mem" else 2500)),
                    run_dir=tmp_path / "split").fit()
    assert stopped["frames"] in (5120, 2560) and stopped["updates"] % 3 != 0  # not right after a push
    final = build(make_config(*run, f"resume={tmp_path / 'split'}")).fit()
    assert learning_rows(tmp_path / "split") == learning_rows(tmp_path / "full")
    assert final["sync"] == reference["sync"]  # pushes and versions counted across the sessions


def test_lock_step_workers_resume_exactly_and_async_ones_on_fresh_episodes(tmp_path, caplog):
    caplog.set_level("INFO", logger="rltrain")
    run = (*PPO_RUN, "collector=lockstep", "collector.workers=2", "collector.envs_per_worker=4")
    build(make_config(*run), run_dir=tmp_path / "full").fit()
    build(make_config(*run, *signal_at(5000)), run_dir=tmp_path / "split").fit()
    saved = checkpoint.load(checkpoint.listing(tmp_path / "split")[-1])
    assert len(saved["collector"]["workers"]) == 2  # each worker's envs and generator
    build(make_config(*run, f"resume={tmp_path / 'split'}")).fit()
    assert learning_rows(tmp_path / "split") == learning_rows(tmp_path / "full")

    run = (*PPO_RUN, "collector=async")
    build(make_config(*run, *signal_at(5000)), run_dir=tmp_path / "async").fit()
    assert checkpoint.load(checkpoint.listing(tmp_path / "async")[-1])["collector"] is None
    summary = build(make_config(*run, f"resume={tmp_path / 'async'}")).fit()
    assert summary["status"] == "completed" and summary["frames"] >= 12288
    assert "envs start fresh episodes" in caplog.text


def test_reward_normalization_statistics_are_one_set_for_all_workers_and_resume_exactly(tmp_path):
    run = (*PPO_RUN, "env=pendulum", "env.normalize_reward=true", "collector=lockstep", "collector.workers=2",
           "collector.envs_per_worker=4")
    build(make_config(*run), run_dir=tmp_path / "full").fit()
    build(make_config(*run, *signal_at(5000)), run_dir=tmp_path / "split").fit()
    saved = checkpoint.load(checkpoint.listing(tmp_path / "split")[-1])["algo"]["reward_norm"]
    assert saved["count"] == pytest.approx(5120, abs=1e-3)  # every frame of both workers, in one set
    assert saved["carry"].shape == (8,)  # each env's discounted return so far
    build(make_config(*run, f"resume={tmp_path / 'split'}")).fit()
    rows = learning_rows(tmp_path / "split")
    assert rows == learning_rows(tmp_path / "full")
    scales = [row.get("ppo/reward_scale") for row in rows if "loss/policy" in row]
    assert None not in scales and len(set(scales)) > 1  # logged with every update's metrics, and it adapts


LONG_UPDATES = {  # updates of ~2,000 gradient steps each: a stop request lands in the middle of one
    "sac": ("algo=sac", "env=pendulum", "env.num_envs=4", "collector.frames_per_batch=200", "algo.warmup_frames=200",
            "algo.utd=10", "algo.batch_size=32", "algo.network.hidden_sizes=[32,32]",
            "algo.critic_hidden_sizes=[32,32]", "trainer.total_frames=600", "trainer.stop_at_return=null", "seed=3",
            "~hooks.log.every", "+hooks.log.every={frames:200}"),
    "ppo": ("algo.epochs=250", "algo.minibatch_size=64", "trainer.total_frames=1536", "trainer.stop_at_return=null",
            "seed=3", "~hooks.log.every", "+hooks.log.every={frames:512}"),
}


@pytest.mark.parametrize("algo", LONG_UPDATES)
def test_a_stop_request_ends_a_long_update_between_gradient_steps_and_resumes_exactly(algo, tmp_path):
    run, batch = LONG_UPDATES[algo], {"sac": 200, "ppo": 512}[algo]
    reference = build(make_config(*run), run_dir=tmp_path / "full").fit()
    stop_mid_update = ("+hooks.kill._target_=tests.hooks_for_tests.SignalDuringUpdate", "+hooks.kill.at_batch=2")
    stopped = build(make_config(*run, *stop_mid_update), run_dir=tmp_path / "split").fit()
    assert stopped["status"] == "interrupted"
    assert stopped["frames"] == 2 * batch and stopped["updates"] == 1  # the second update did not finish...
    saved = checkpoint.load(checkpoint.listing(tmp_path / "split")[-1])
    assert saved["trainer"]["progress"]["mid_update_frames"] == batch
    pending = saved["algo"]["pending"]
    if algo == "sac":  # ...and stopped long before its end: most of its gradient steps are still owed
        assert len(pending["metrics"]) < pending["steps"] / 2 and pending["steps"] == 2000
    else:
        assert pending["epoch"] < 250 / 2

    final = build(make_config(*run, f"resume={tmp_path / 'split'}")).fit()
    assert final["status"] == "completed"
    assert (final["frames"], final["updates"]) == (reference["frames"], reference["updates"])
    assert learning_rows(tmp_path / "split") == learning_rows(tmp_path / "full")


def test_a_sac_run_stopped_mid_update_without_its_buffer_resumes_and_completes(tmp_path):
    run = (*LONG_UPDATES["sac"], "hooks.checkpoint.replay_buffer=false")
    stopped = build(make_config(*run, "+hooks.kill._target_=tests.hooks_for_tests.SignalDuringUpdate",
                                "+hooks.kill.at_batch=2"), run_dir=tmp_path).fit()
    assert stopped["status"] == "interrupted"
    assert checkpoint.load(checkpoint.listing(tmp_path)[-1])["algo"]["pending"] is None  # no buffer: no steps owed
    final = build(make_config(*run, f"resume={tmp_path}")).fit()
    assert final["status"] == "completed" and final["frames"] == 600


# Checkpoints written by rltrain in format 1, and the overrides of the runs that wrote them
# (tests/data/checkpoint_v1/README.md): file, overrides, the frames it holds.
FORMAT_1 = Path(__file__).parent / "data" / "checkpoint_v1"
FORMAT_1_RUNS = {
    "ppo": ("ppo_cartpole_2048.pt", ("trainer.stop_at_return=null", "seed=3", "hooks.eval.episodes=2"), 2048),
    "sac": ("sac_pendulum_400.pt", ("algo=sac", "env=pendulum", "env.num_envs=4", "collector.frames_per_batch=4",
                                    "algo.warmup_frames=200", "algo.batch_size=64", "algo.network.hidden_sizes=[32,32]",
                                    "algo.critic_hidden_sizes=[32,32]", "trainer.stop_at_return=null", "seed=3",
                                    "hooks.eval.episodes=2"), 400),
}


@pytest.mark.parametrize("algo", FORMAT_1_RUNS)
def test_a_format_1_checkpoint_is_upgraded_step_by_step_and_its_run_resumes(algo, tmp_path, monkeypatch):
    name, run, frames = FORMAT_1_RUNS[algo]
    old = torch.load(FORMAT_1 / name, weights_only=True)
    assert old["format"] == 1 and checkpoint.FORMAT == 3
    steps = []
    for fmt, migrate in list(checkpoint.MIGRATIONS.items()):
        monkeypatch.setitem(checkpoint.MIGRATIONS, fmt, lambda saved, f=fmt, m=migrate: steps.append(f) or m(saved))
    saved = checkpoint.load(FORMAT_1 / name)
    assert steps == [1, 2] and saved["format"] == 3 and saved["sharded"] is None  # one file, whole
    flat = old["trainer"]
    assert saved["trainer"]["progress"] == {"frames": frames, "batches": flat["batches"], "updates": flat["updates"],
                                            "solved_at_frames": None, "mid_update_frames": 0}
    assert saved["trainer"]["evals"] == {"last_return": flat["eval_return"], "return_sum": flat["eval_return"],
                                         "count": 1}
    assert saved["hooks"] == {}

    loose = tmp_path / name  # a checkpoint file outside a run dir: the resumed run gets a new one
    loose.write_bytes((FORMAT_1 / name).read_bytes())
    trainer = build(make_config(*run, f"trainer.total_frames={frames * 3 // 2}", f"resume={loose}"),
                    run_dir=tmp_path / "run")
    state = trainer.state
    assert (state.frames, state.updates, state.episodes.count) == (frames, flat["updates"], flat["episodes"])
    assert list(state.episodes.recent_returns) == flat["recent_returns"]
    assert (state.sync.version, state.sync.pushes) == (flat["version"], flat["pushes"])
    assert (state.evals.last_return, state.evals.count) == (flat["eval_return"], 1)
    weights = trainer.algo.policy.state_dict()
    assert weights.keys() == old["algo"]["policy"].keys()
    assert all(torch.equal(weights[k], old["algo"]["policy"][k]) for k in weights)

    summary = trainer.fit()
    assert summary["status"] == "completed" and summary["frames"] == frames * 3 // 2
    assert summary["updates"] > flat["updates"] and summary["evaluations"] == 2
    assert summary["sync"]["pushes"] == summary["updates"]  # counted on from the saved pushes
    assert torch.load(checkpoint.listing(tmp_path / "run")[-1], weights_only=True)["format"] == checkpoint.FORMAT
    assert (FORMAT_1 / name).read_bytes() == loose.read_bytes()  # upgraded as loaded, the file left as it was


def test_a_format_1_checkpoint_of_an_older_rltrain_without_the_nonfinite_counts_resumes(tmp_path):
    saved = torch.load(FORMAT_1 / "ppo_cartpole_2048.pt", weights_only=True)
    del saved["algo"]["nonfinite"], saved["algo"]["pending"], saved["trainer"]["mid_update_frames"]
    del saved["published"], saved["loggers"], saved["trainer"]["window"]["latest"]
    checkpoint.save(tmp_path / "older.pt", saved)
    _, run, _ = FORMAT_1_RUNS["ppo"]
    summary = build(make_config(*run, "trainer.total_frames=3072", f"resume={tmp_path / 'older.pt'}"),
                    run_dir=tmp_path / "run").fit()
    assert summary["status"] == "completed" and summary["nonfinite"]["skipped_steps"] == 0


def test_a_checkpoint_of_a_newer_rltrain_is_refused_by_its_format(tmp_path):
    path = checkpoint.path_for(tmp_path, 100)
    newer = checkpoint.FORMAT + 1
    checkpoint.save(path, {"format": newer, "frames": 100})
    with pytest.raises(CheckpointError, match=rf"written by a newer rltrain \(checkpoint format {newer};"):
        checkpoint.load(path)


def test_a_hook_keeps_its_own_state_across_a_resume(tmp_path):
    run = ("trainer.stop_at_return=null", "+hooks.best._target_=tests.hooks_for_tests.BestReturnHook")
    first = build(make_config(*run, "trainer.total_frames=2048"), run_dir=tmp_path)
    first.fit()
    saved = checkpoint.load(checkpoint.listing(tmp_path)[-1])
    assert saved["hooks"]["best"] == {"best": first.hooks["best"].best, "calls": 4}
    assert saved["hooks"]["eval"] == {"evaluated_at": 2048} and saved["hooks"]["log"] == {}
    resumed = build(make_config(*run, "trainer.total_frames=4096", f"resume={tmp_path}"))
    assert resumed.hooks["best"].calls == 4 and resumed.hooks["best"].best == first.hooks["best"].best
    resumed.fit()
    assert resumed.hooks["best"].calls == 8  # one per update of the whole run


def test_resuming_an_older_checkpoint_sets_the_newer_ones_aside(tmp_path):
    run = ("trainer.total_frames=6144", "trainer.stop_at_return=null",
           "~hooks.checkpoint.every", "+hooks.checkpoint.every={frames:2048}", "hooks.checkpoint.keep_last=5")
    build(make_config(*run), run_dir=tmp_path).fit()
    older = checkpoint.path_for(tmp_path, 2048)
    build(make_config(*run, f"resume={older}")).fit()
    assert [p.name for p in checkpoint.listing(tmp_path)] == [
        "frames_000000002048.pt", "frames_000000004096.pt", "frames_000000006144.pt"]  # this branch's
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "abandoned").glob("*/*")) == [
        "frames_000000004096.pt", "frames_000000006144.pt"]  # under the time it was set aside


def test_a_checkpoint_file_outside_a_run_starts_a_new_run_dir_from_it(finished_run, tmp_path):
    loose = tmp_path / "shared" / "model.pt"
    loose.parent.mkdir()
    loose.write_bytes(checkpoint.listing(finished_run)[-1].read_bytes())
    trainer = build(make_config("trainer.total_frames=3072", f"resume={loose}"), run_dir=tmp_path / "new")
    assert trainer.state.run_dir == tmp_path / "new" and trainer.state.frames == 2048
    assert trainer.fit()["frames"] == 3072
    assert sorted(p.name for p in (tmp_path / "shared").iterdir()) == ["model.pt"]  # untouched
    assert (tmp_path / "new" / "summary.json").is_file()


def test_envs_that_cannot_be_saved_restart_their_episodes_on_resume(tmp_path, caplog):
    caplog.set_level("INFO", logger="rltrain")
    run = ("env.id=tests.toy_envs:UnpicklableCartPole-v0", "trainer.total_frames=4096", "trainer.stop_at_return=null")
    build(make_config(*run, *signal_at(2000)), run_dir=tmp_path).fit()
    assert "cannot be saved (not picklable)" in caplog.text
    assert checkpoint.load(checkpoint.listing(tmp_path)[-1])["collector"] is None
    summary = build(make_config(*run, f"resume={tmp_path}")).fit()
    assert summary["status"] == "completed" and summary["frames"] == 4096
    assert "start fresh episodes" in caplog.text


def test_metrics_csv_continues_like_metrics_jsonl(tmp_path):
    import csv

    build(make_config(*PPO_RUN, "logger=csv", *signal_at(5000)), run_dir=tmp_path).fit()
    with (tmp_path / "metrics.csv").open("a") as f:  # a row the stopped run wrote after its checkpoint
        f.write("6144" + ",1" * (len((tmp_path / "metrics.csv").read_text().splitlines()[0].split(",")) - 1) + "\n")
    build(make_config(*PPO_RUN, "logger=csv", f"resume={tmp_path}")).fit()
    with (tmp_path / "metrics.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["frames"]) for r in rows] == [row["frames"] for row in read_jsonl(tmp_path / "metrics.jsonl")]
    assert [float(r["loss/policy"]) for r in rows if r["loss/policy"]] == pytest.approx(
        [row["loss/policy"] for row in read_jsonl(tmp_path / "metrics.jsonl") if "loss/policy" in row])


def test_a_signal_during_the_last_step_completes_the_run_without_an_evaluation(tmp_path):
    summary = build(make_config(*PPO_RUN, *signal_at(12288), "hooks.eval.at_end=false"), run_dir=tmp_path).fit()
    assert summary["status"] == "completed" and summary["frames"] == 12288


def test_a_signal_during_the_final_evaluation_ends_it_and_resume_evaluates(tmp_path):
    # The signal comes in the last update, so the final evaluation (1000 Pendulum episodes of 200
    # steps: seconds) starts with a stop request pending and must end at its first step.
    run = ("env=pendulum", "collector.frames_per_batch=2048", "trainer.total_frames=4096",
           "trainer.stop_at_return=null", "hooks.eval.episodes=1000", "hydra.run.dir=outputs/run")
    signal_in_eval = signal_at(4096)
    stopped = run_cli(*run, *signal_in_eval, cwd=tmp_path)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
    run_dir = tmp_path / "outputs/run"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["frames"] == 4096 and summary["eval_return"] is None
    assert "stopped during the final evaluation" in (run_dir / "cli.log").read_text()
    assert [p.name for p in checkpoint.listing(run_dir)] == ["frames_000000004096.pt"]

    resumed = run_cli(*run, "resume=outputs/run", "hooks.eval.episodes=3", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    final = json.loads((run_dir / "summary.json").read_text())
    assert final["status"] == "completed" and final["frames"] == 4096 and final["eval_return"] is not None
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["frames"] for r in rows][-1:] == [4096] and rows[-1]["eval/return"] == final["eval_return"]
    assert [r["frames"] for r in rows].count(4096) == 1


def test_torn_or_damaged_metrics_lines_do_not_stop_a_resume(tmp_path):
    build(make_config(*PPO_RUN, *signal_at(5000)), run_dir=tmp_path).fit()
    with (tmp_path / "metrics.jsonl").open("ab") as f:
        f.write(b'\xff\xfe damaged bytes\n[1, 2]\n')  # lines that are no rows
        f.write(b'{"frames": 99999, "upda')  # a crash mid-write, after the checkpoint
    build(make_config(*PPO_RUN, f"resume={tmp_path}")).fit()
    frames = [row["frames"] for row in read_jsonl(tmp_path / "metrics.jsonl")]
    assert frames == [2048, 4096, 6144, 8192, 10240, 12288]  # one final row


def test_resuming_a_finished_run_changes_nothing(finished_run, tmp_path, caplog):
    import shutil

    caplog.set_level("INFO", logger="rltrain")
    run_dir = shutil.copytree(finished_run, tmp_path / "run")
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    summary = build(make_config("trainer.total_frames=2048", f"resume={run_dir}")).fit()
    assert "nothing to do: this run already reached its 2,048 frames" in caplog.text
    assert summary == json.loads((run_dir / "summary.json").read_text())
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


def test_a_sweep_cannot_resume_one_path(tmp_path):
    proc = run_cli("-m", "seed=0,1", "resume=outputs/x", cwd=tmp_path)
    assert proc.returncode == 2
    assert "this is a sweep (-m); use resume=auto" in proc.stderr


def test_a_second_signal_stops_at_once_without_a_checkpoint(tmp_path):
    proc = run_cli(*PPO_RUN, *signal_at(5000, "SIGINT", times=2), "hydra.run.dir=outputs/run", cwd=tmp_path)
    assert proc.returncode == 130, proc.stderr
    assert "stopped at once" in proc.stderr
    summary = json.loads((tmp_path / "outputs/run/summary.json").read_text())
    assert summary["status"] == "interrupted"
    assert checkpoint.listing(tmp_path / "outputs/run") == []


def test_a_repeated_sigterm_is_the_same_request_and_still_checkpoints(tmp_path):
    # Under srun torchrun every process gets SIGTERM from SLURM and again from torchrun.
    proc = run_cli(*PPO_RUN, *signal_at(5000, "SIGTERM", times=2), "hydra.run.dir=outputs/run", cwd=tmp_path)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    summary = json.loads((tmp_path / "outputs/run/summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["frames"] == 5120
    assert [p.name for p in checkpoint.listing(tmp_path / "outputs/run")] == ["frames_000000005120.pt"]


def test_checkpoints_follow_their_schedule_and_keep_the_last_n(tmp_path):
    cfg = make_config("trainer.total_frames=8192", "trainer.stop_at_return=null",
                      "~hooks.checkpoint.every", "+hooks.checkpoint.every={frames:2048}",
                      "hooks.checkpoint.keep_last=2")
    build(cfg, run_dir=tmp_path).fit()
    assert [p.name for p in checkpoint.listing(tmp_path)] == ["frames_000000006144.pt", "frames_000000008192.pt"]
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))
    saved = checkpoint.load(checkpoint.listing(tmp_path)[-1])
    assert saved["trainer"]["progress"]["frames"] == 8192 and saved["algo_class"] == "PPO"
    assert saved["config"]["trainer"]["total_frames"] == 8192


def test_a_crash_while_writing_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    good = checkpoint.path_for(tmp_path, 100)
    checkpoint.save(good, {"format": checkpoint.FORMAT, "weights": torch.ones(3)})

    def dies_mid_write(obj, f):
        f.write(b"PK\x03\x04 half a zip file")
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.torch, "save", dies_mid_write)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(checkpoint.path_for(tmp_path, 200), {"format": checkpoint.FORMAT})
    assert checkpoint.listing(tmp_path) == [good]  # neither the new name nor a .tmp is left
    assert list((tmp_path / "checkpoints").iterdir()) == [good]
    assert torch.equal(checkpoint.load(good)["weights"], torch.ones(3))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("finished")
    build(make_config("trainer.total_frames=2048"), run_dir=run_dir).fit()
    return run_dir


def test_a_finished_run_can_be_extended(finished_run, tmp_path):
    import shutil

    run_dir = shutil.copytree(finished_run, tmp_path / "run")
    first = [row["frames"] for row in read_jsonl(run_dir / "metrics.jsonl")]
    summary = build(make_config("trainer.total_frames=4096", f"resume={run_dir}")).fit()
    assert summary["frames"] == 4096 and summary["status"] == "completed"
    frames = [row["frames"] for row in read_jsonl(run_dir / "metrics.jsonl")]
    assert frames[:len(first)] == first and min(frames[len(first):]) > 2048 and frames[-1] == 4096


@pytest.mark.parametrize("case, message", [
    ("missing", "no such file or directory"),
    ("no_checkpoints", "holds no checkpoints"),
    ("corrupt", "is not a readable checkpoint: the file is corrupt: it is cut short or damaged"),
    ("garbage", "is not a readable checkpoint: the file is corrupt: its contents are not the tensors"),
    ("other_shapes", "does not fit this config"),
])
def test_bad_resume_targets_fail_clearly_and_change_nothing(finished_run, tmp_path, case, message):
    import shutil

    run_dir = shutil.copytree(finished_run, tmp_path / "run")
    overrides = []
    if case == "missing":
        target = tmp_path / "nope"
    elif case == "no_checkpoints":
        shutil.rmtree(run_dir / "checkpoints")
        target = run_dir
    elif case == "corrupt":
        ckpt = checkpoint.listing(run_dir)[-1]
        ckpt.write_bytes(ckpt.read_bytes()[:1000])
        target = ckpt
    elif case == "garbage":  # a pickle, but not of tensors and plain values
        ckpt = checkpoint.listing(run_dir)[-1]
        torch.save({"when": __import__("datetime").datetime(2026, 1, 1)}, ckpt)
        target = ckpt
    else:
        overrides = ["algo.network.hidden_sizes=[32,32]"]
        target = run_dir
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    with pytest.raises(CheckpointError, match=message) as refused:
        build(make_config(f"resume={target}", *overrides), run_dir=tmp_path / "new")
    assert "weights_only" not in str(refused.value)  # not torch's advice to unpickle anything
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before
    assert not (tmp_path / "new").exists()


def test_a_checkpoint_of_another_algo_is_refused_by_name(finished_run):
    with pytest.raises(CheckpointError, match="holds a PPO run; this config builds SAC. Resume with algo=ppo"):
        build(make_config("algo=sac", "env=pendulum", f"resume={finished_run}"))


def test_cli_resume_errors_exit_2_and_leave_no_run_dir(tmp_path):
    proc = run_cli("resume=outputs/nope", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("rltrain: cannot resume: resume=outputs/nope")
    assert not (tmp_path / "outputs").exists()


def test_resume_auto_picks_the_latest_run_of_the_same_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    same = ("trainer.total_frames=2048", "seed=5")
    build(make_config(*same), run_dir="outputs/a").fit()
    build(make_config("trainer.total_frames=2048", "seed=6"), run_dir="outputs/b").fit()  # another config
    resumed = build(make_config(*same, "resume=auto"), run_dir="outputs/c")
    assert resumed.state.run_dir == Path("outputs/a").resolve() and resumed.state.frames == 2048
    assert resumed.fit()["status"] == "completed" and not Path("outputs/c").exists()
    fresh = build(make_config("trainer.total_frames=1024", "seed=7", "resume=auto"), run_dir="outputs/d")
    assert fresh.state.run_dir == Path("outputs/d") and fresh.state.frames == 0  # nothing to resume: a new run
    fresh.fit()


def test_timing_rows_add_up_to_the_run_totals_and_the_table_is_printed(tmp_path):
    proc = run_cli("trainer.total_frames=8192", "trainer.stop_at_return=null", "hooks.log.every.seconds=0.2",
                   "hydra.run.dir=outputs/run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    run_dir = tmp_path / "outputs/run"
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = read_jsonl(run_dir / "metrics.jsonl")
    # Each row holds its own window, none twice; only what follows the last row (writing it, the
    # final checkpoint) is in the totals alone.
    for phase in ("collect", "update", "sync", "eval", "log"):
        logged = sum(row.get(f"time/{phase}", 0.0) for row in rows)
        assert logged == pytest.approx(summary["time"][phase], rel=0.02, abs=2e-3), phase
    assert sum(summary["time"].values()) == pytest.approx(summary["wall_time_s"], rel=0.05)
    assert {"timing", "checkpoint", "progress"} <= summary["time_hooks"].keys()
    assert summary["time"]["hooks"] == pytest.approx(sum(summary["time_hooks"].values()), abs=1e-3)
    log = (run_dir / "cli.log").read_text()
    assert "time per phase:" in log and "updates at" in log


def test_progress_prints_plain_lines_without_a_terminal(tmp_path):
    cfg = make_config("trainer.total_frames=4096", "trainer.stop_at_return=null",
                      "~hooks.progress.every", "+hooks.progress.every={batches:2}")
    trainer = build(cfg, run_dir=tmp_path)
    lines = []
    trainer.hooks["progress"].line = _spy(trainer.hooks["progress"].line, lines)
    trainer.fit()
    assert len(lines) == 4 and lines[-1].startswith("progress 4,096/4,096 frames (100.0%)")
    assert "fps | return" in lines[0] and "ETA" in lines[0]


def test_progress_bar_draws_on_request(tmp_path, capsys):
    build(make_config("trainer.total_frames=2048", "hooks.progress.bar=true"), run_dir=tmp_path).fit()
    err = capsys.readouterr().err
    assert "frame/s" in err and "return" in err, err[-500:]


def _spy(method, calls):
    def wrapper(*args, **kwargs):
        out = method(*args, **kwargs)
        calls.append(out)
        return out
    return wrapper


def test_eval_records_a_video_of_the_deterministic_policy(tmp_path):
    cfg = make_config("trainer.total_frames=1024", "hooks.eval.video=true", "hooks.eval.episodes=2")
    build(cfg, run_dir=tmp_path).fit()
    videos = list((tmp_path / "videos").glob("*.mp4"))
    assert [v.name for v in videos] == ["eval-frames_000000001024-episode-0.mp4"]
    assert videos[0].stat().st_size > 1000


def test_eval_video_without_moviepy_is_a_clear_config_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "moviepy" else real(name, *a))
    with pytest.raises(ConfigError, match=r"hooks.eval.video=true .* needs moviepy: pip install 'rltrain\[video\]'"):
        build(make_config("hooks.eval.video=true"))


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path):
    run = ("logger=[console,wandb]", *PPO_RUN[:3])
    build(make_config(*run, *signal_at(3000)), run_dir=tmp_path / "run").fit()
    build(make_config(*run, f"resume={tmp_path / 'run'}")).fit()
    runs = sorted((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2
    ids = {record.run.run_id for r in runs for record in read_wandb_records(next(r.glob("*.wandb")))
           if record.WhichOneof("record_type") == "run"}
    assert len(ids) == 1  # one wandb run, continued
    history = []
    for record in read_wandb_records(next(runs[-1].glob("*.wandb"))):
        if record.WhichOneof("record_type") == "history":
            history.append({i.key or ".".join(i.nested_key): i.value_json for i in record.history.item})
    assert any(key.startswith("timing.") for row in history for key in row)  # the table, as a wandb Table
    assert max(json.loads(row["frames"]) for row in history if "frames" in row) == 12288
