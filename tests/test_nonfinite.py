"""NaN and inf never train on silently: from the env (stop, or replace and count), in a loss or a
gradient (stop, or skip the step and count it), and never into a checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from rltrain import build, checkpoint
from rltrain.errors import CollectorError, EnvError, NonFiniteError
from tests.conftest import make_config
from tests.test_outputs import read_jsonl

NONFINITE_ENV = ("env.id=tests.toy_envs:NonFinite-v0", "trainer.stop_at_return=null", "hooks.eval.episodes=2")


@pytest.mark.parametrize("key", ["observation", "reward"])
@pytest.mark.parametrize("collector", ["local", "lockstep"])
def test_a_nonfinite_observation_or_reward_stops_the_run_naming_the_env_step_and_key(key, collector, tmp_path):
    cfg = make_config(*NONFINITE_ENV, f"+env.kwargs.key={key}", "+env.kwargs.every=30", f"collector={collector}",
                      "trainer.total_frames=4096")
    error = CollectorError if collector == "lockstep" else EnvError
    message = (rf"env tests.toy_envs:NonFinite-v0 \(env 0 of \d+\) returned a non-finite {key} \(.*nan.*\) from "
               r"step\(\) at its step 30; fix the env, or set env.nonfinite=replace")
    with pytest.raises(error, match=message):
        build(cfg, run_dir=tmp_path).fit()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"].startswith(f"failed: {error.__name__}: ") and f"non-finite {key}" in summary["status"]
    assert summary["updates"] == 0  # step 30 of 32 per batch: the first batch never reached the learner
    assert checkpoint.listing(tmp_path) == []


def test_a_nonfinite_observation_from_reset_is_named_too():
    from rltrain.envs import GymnasiumBatchedEnv

    env = GymnasiumBatchedEnv("tests.toy_envs:NonFinite-v0", num_envs=3,
                              kwargs={"key": "reset_observation", "value": "-inf"})
    with pytest.raises(EnvError, match=r"\(env 0 of 3\) returned a non-finite observation \(\[-inf, 0.0, 0.0, 0.0\]\) "
                                       r"from reset\(\) at its step 0"):
        env.reset()
    replacing = GymnasiumBatchedEnv("tests.toy_envs:NonFinite-v0", num_envs=3, kwargs={"key": "reset_observation"},
                                    nonfinite="replace")
    assert replacing.reset().tolist() == [[0.0] * 4] * 3 and replacing.replaced.all()


def test_replace_sets_nonfinite_values_to_zero_and_counts_the_frames(tmp_path):
    cfg = make_config(*NONFINITE_ENV, "+env.kwargs.key=reward", "+env.kwargs.value=inf", "+env.kwargs.every=50",
                      "env.nonfinite=replace", "trainer.total_frames=4096", "hooks.log.every.seconds=0.001")
    summary = build(cfg, run_dir=tmp_path).fit()
    assert summary["status"] == "completed"
    # 16 envs x 256 steps each; every env's step 50, 100, ..., 250 had an infinite reward.
    assert summary["nonfinite"] == {"env_frames": 16 * 5, "skipped_steps": 0}
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert sum(r.get("nonfinite/env_frames", 0) for r in rows) == 80
    assert all(r["loss/value"] is not None for r in rows if "loss/value" in r)  # finite: JSON null otherwise
    assert summary["eval_return"] == 1000 - 20  # eval episodes of 1000 steps: every 50th reward became 0


def test_a_nonfinite_loss_stops_the_run_with_finite_weights_and_no_checkpoint(tmp_path):
    # Rewards of 1e30 are finite, but their squared value error is not, in float32.
    cfg = make_config(*NONFINITE_ENV, "+env.kwargs.every=0", "+env.kwargs.reward=1e30", "trainer.total_frames=4096")
    trainer = build(cfg, run_dir=tmp_path)
    initial = {k: v.clone() for k, v in trainer.algo.policy.state_dict().items()}
    with pytest.raises(NonFiniteError, match=r"a loss or its gradient was NaN or infinite \(the ppo loss in 20 "
                                             r"steps\); those steps were skipped, so the weights are still finite"):
        trainer.fit()
    assert all(torch.equal(initial[k], v) for k, v in trainer.algo.policy.state_dict().items())
    assert json.loads((tmp_path / "summary.json").read_text())["status"].startswith("failed: NonFiniteError: ")
    assert checkpoint.listing(tmp_path) == []


@pytest.mark.parametrize("algo", ["ppo", "sac"])
def test_skip_skips_and_counts_the_steps_whose_loss_is_not_finite(algo, tmp_path):
    extra = ("algo=sac", "+env.kwargs.continuous=true", "algo.warmup_frames=64", "algo.batch_size=32",
             "collector.frames_per_batch=64", "algo.network.hidden_sizes=[32,32]", "algo.critic_hidden_sizes=[32,32]",
             "trainer.total_frames=256") if algo == "sac" else ("trainer.total_frames=2048",)
    cfg = make_config(*NONFINITE_ENV, "+env.kwargs.every=0", "+env.kwargs.reward=1e30", *extra, "algo.nonfinite=skip",
                      "hooks.log.every.seconds=0.001")
    trainer = build(cfg, run_dir=tmp_path)
    summary = trainer.fit()
    assert summary["status"] == "completed"
    skipped = summary["nonfinite"]["skipped_steps"]
    if algo == "ppo":  # every step: 4 updates x 10 epochs x 2 minibatches
        assert skipped == 4 * 10 * 2
    else:  # every critic step (its targets overflow): 4 batches x 64 frames x utd 1; the actor's go on
        assert skipped == 256
    assert sum(r.get("nonfinite/skipped_steps", 0) for r in read_jsonl(tmp_path / "metrics.jsonl")) == skipped
    assert all(torch.isfinite(p).all() for p in trainer.algo.policy.parameters())
    saved = checkpoint.load(checkpoint.listing(tmp_path)[-1])
    assert saved["trainer"]["nonfinite"]["skipped_steps"] == skipped


def test_a_stop_during_an_update_with_skipped_steps_still_checkpoints(tmp_path):
    # The interrupted update holds the skipped steps' infinite losses; the weights are finite.
    cfg = make_config(*NONFINITE_ENV, "+env.kwargs.every=0", "+env.kwargs.reward=1e30", "algo.nonfinite=skip",
                      "algo.epochs=250", "trainer.total_frames=4096",
                      "+hooks.kill._target_=tests.hooks_for_tests.SignalDuringUpdate", "+hooks.kill.at_batch=1")
    summary = build(cfg, run_dir=tmp_path).fit()
    assert summary["status"] == "interrupted"
    saved = checkpoint.load(checkpoint.listing(tmp_path)[-1])
    assert saved["trainer"]["progress"]["mid_update_frames"] == 512 and saved["algo"]["pending"] is not None


def test_a_checkpoint_is_never_written_with_nonfinite_weights(tmp_path):
    cfg = make_config("trainer.total_frames=1024", "trainer.stop_at_return=null")
    trainer = build(cfg, run_dir=tmp_path)
    trainer.fit()
    hook = trainer.hooks["checkpoint"]
    good = checkpoint.listing(tmp_path)[-1]
    with torch.no_grad():
        trainer.algo.policy.actor[0].weight[0, 0] = float("nan")  # as a buggy algo could leave them
    trainer.state.progress.frames += 512
    with pytest.raises(NonFiniteError, match=r"not writing a checkpoint: algo.policy.actor.0.weight hold NaN"):
        hook.save(trainer.state)
    assert checkpoint.listing(tmp_path) == [good]
    checkpoint.load(good)  # still readable
