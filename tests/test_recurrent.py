"""Recurrent PPO (``algo.network.recurrent=lstm|gru``): a policy with memory acts from each env's state, the
collectors store the state each action came from, and the update trains on sequences that start from it."""

from __future__ import annotations

import pytest
import torch

import tests.toy_envs  # noqa: F401  (registers CueMemory-v0, MaskedChoice-v0)
from rltrain import build, checkpoint
from rltrain.algos import PPO, ActorCritic
from rltrain.algos.recurrent import Sequences
from rltrain.collectors.local import LocalCollector
from rltrain.envs import make_envs
from rltrain.errors import CheckpointError, ConfigError
from rltrain.sync.in_place import InPlaceSync
from tests.conftest import make_config
from tests.test_distributed import summary_of, torchrun
from tests.test_outputs import read_jsonl
from tests.test_run_management import learning_rows, signal_at

# The cue is shown at the first of 5 steps and asked for at the last: +1 for naming it, -1 if not.
CUE = ("env.id=tests.toy_envs:CueMemory-v0", "algo.network.recurrent_size=32", "seed=0", "hooks.eval.episodes=100",
       "~hooks.log.every", "+hooks.log.every={batches: 2}")


def collect(kind: str, length: int | None, steps: int = 24) -> tuple[PPO, object]:
    """A recurrent PPO learner and one batch of ``steps`` x 8 frames its own policy collected on CueMemory."""
    torch.manual_seed(0)
    make_env = lambda **kw: make_envs("tests.toy_envs:CueMemory-v0", num_envs=8, seed=0, **kw)  # noqa: E731
    spec = make_env().spec
    policy = ActorCritic(spec, hidden_sizes=[16], recurrent=kind, recurrent_size=8)
    collector = LocalCollector(make_env, lambda: policy, InPlaceSync().receiver, frames_per_batch=steps * 8)
    batch = next(iter(collector))
    collector.close()
    return PPO(policy, total_frames=10_000, sequence_length=length, compile=False, cuda_graph=False), batch


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("length", [None, 5, 7])  # the whole batch; windows that cut episodes; with padding
def test_the_update_scores_each_action_from_the_state_the_actor_was_in(kind, length):
    ppo, batch = collect(kind, length)
    assert batch["done"].any() and batch["recurrent_state"].shape == (24, 8, ppo.policy.state_size)
    # The state the actor stored where an episode starts is zero; elsewhere it carries the episode.
    starts = torch.ones_like(batch["done"])  # (the first batch: every env starts)
    starts[1:] = batch["done"][:-1]
    assert (batch["recurrent_state"][starts] == 0).all() and (batch["recurrent_state"][~starts] != 0).all()

    pending = ppo._prepare(batch)
    log_prob, _, value = ppo.policy.evaluate(pending.obs, pending.action, pending.state, pending.starts)
    # Unrolled from each window's stored first state, with resets inside: the log-probs the actor had.
    torch.testing.assert_close(log_prob[pending.valid], pending.old_log_prob[pending.valid], rtol=0, atol=1e-5)
    torch.testing.assert_close(value[pending.valid], pending.old_value[pending.valid], rtol=0, atol=1e-5)
    seq = Sequences(24, 8, length or 24)
    assert pending.valid.sum() == 24 * 8 and pending.valid.shape == (seq.length, seq.count)


def test_padding_counts_in_no_loss_and_no_statistic():
    ppo, batch = collect("lstm", 7)  # 24 steps in windows of 7: 3 padded steps per env
    pending = ppo._prepare(batch)
    garbage = pending.valid.logical_not()
    for name in ("advantages", "returns", "old_value", "old_log_prob"):
        getattr(pending, name)[garbage] = 1e6  # what padding holds must not matter
    pending.action[garbage] = 1
    idx = torch.arange(pending.size)
    loss, parts, ratio, _ = ppo._loss(*pending.minibatch(idx))
    assert torch.isfinite(loss) and parts.abs().max() < 100 and ratio.numel() == 24 * 8
    torch.testing.assert_close(ratio, torch.ones_like(ratio), rtol=0, atol=1e-4)  # the same weights acted


def test_a_feed_forward_policy_stays_at_chance_where_a_recurrent_one_remembers_the_cue(tmp_path):
    # Measured (seed 0): lstm and gru answer every question by 4,096 frames; feed-forward, greedy, 0.02 over 100
    # episodes (chance: 0), its training return wandering between -0.4 and 0.4.
    returns = {}
    for network in ("lstm", "gru", "null"):
        summary = build(make_config(*CUE, f"algo.network.recurrent={network}", "trainer.total_frames=16384"),
                        run_dir=tmp_path / network).fit()
        returns[network] = summary["eval_return"]
    assert returns["lstm"] == returns["gru"] == 1.0  # greedy, acting from the state it carries through each episode
    assert abs(returns["null"]) < 0.4, returns


@pytest.mark.parametrize("collector", ["lockstep", "async"])
def test_workers_keep_their_envs_memory_across_weight_pushes_and_learn(tmp_path, collector):
    summary = build(make_config(*CUE, "algo.network.recurrent=lstm", f"collector={collector}", "collector.workers=2",
                                "collector.envs_per_worker=4", "trainer.total_frames=16384"),
                    run_dir=tmp_path / "run").fit()
    assert summary["eval_return"] == 1.0 and summary["train_return"] >= 0.8


@pytest.mark.parametrize("collector", ["local", "lockstep"])
def test_a_recurrent_run_stopped_mid_episode_resumes_exactly(tmp_path, collector):
    workers = ("collector=lockstep", "collector.workers=2", "collector.envs_per_worker=4") if collector == "lockstep" \
        else ()
    run = (*CUE, "algo.network.recurrent=gru", "algo.sequence_length=6", *workers, "trainer.total_frames=6144",
           "~hooks.log.every", "+hooks.log.every={frames: 1024}")
    build(make_config(*run), run_dir=tmp_path / "full").fit()
    stopped = build(make_config(*run, *signal_at(2600)), run_dir=tmp_path / "split").fit()
    assert stopped["status"] == "interrupted"
    saved = checkpoint.load(checkpoint.listing(tmp_path / "split")[-1])["collector"]
    memory = [saved["recurrent_state"]] if collector == "local" else [w["rollout"]["recurrent_state"]
                                                                      for w in saved["workers"]]
    assert all(m.abs().sum() > 0 for m in memory)  # envs mid-episode: their memory is in the checkpoint
    build(make_config(*run, f"resume={tmp_path / 'split'}")).fit()
    assert learning_rows(tmp_path / "split") == learning_rows(tmp_path / "full")


def test_masks_and_memory_together_train_to_the_optimum_without_an_invalid_action(tmp_path):
    run = ("env.id=tests.toy_envs:MaskedChoice-v0", "algo.network.recurrent=lstm", "algo.network.recurrent_size=32",
           "algo.sequence_length=8", "trainer.total_frames=8192", "seed=0", "~hooks.log.every",
           "+hooks.log.every={batches: 1}")
    summary = build(make_config(*run), run_dir=tmp_path / "run").fit()
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "train/episode_return" in r]
    assert summary["status"] == "completed" and rows[0]["train/episode_return"] < 6
    assert summary["eval_return"] == 8 and summary["train_return"] >= 7.5


def test_a_recurrent_network_refuses_compile_and_a_checkpoint_without_memory(tmp_path):
    with pytest.raises(ConfigError, match=r"algo.compile=true .* recurrent"):
        build(make_config(*CUE, "algo.network.recurrent=lstm", "algo.compile=true"), run_dir=tmp_path / "c")
    build(make_config(*CUE, "trainer.total_frames=1024"), run_dir=tmp_path / "ff").fit()
    with pytest.raises(CheckpointError, match=r"algo.policy.core.rnn.weight_hh_l0: missing in the checkpoint"):
        build(make_config(*CUE, "algo.network.recurrent=lstm", f"resume={tmp_path / 'ff'}")).fit()


def test_acting_without_a_state_is_refused_with_the_method_to_call():
    policy = ActorCritic(make_envs("tests.toy_envs:CueMemory-v0", num_envs=1).spec, recurrent="lstm")
    with pytest.raises(TypeError, match="act_in_state"):
        policy.act(torch.zeros(1, 3))
    action, _, state = policy.act_in_state(torch.zeros(1, 3), policy.initial_state(1))
    assert action.shape == (1,) and state.shape == (1, 256) and torch.isfinite(state).all()


@pytest.mark.parametrize(("mode", "env", "best"),
                         [("lockstep", "CueMemory-v0", 1.0), ("async", "MaskedChoice-v0", 8.0)])
def test_collector_ranks_of_a_torchrun_job_carry_memory_and_masks(tmp_path, mode, env, best):
    # lockstep: each rank steps its envs itself, and CueMemory needs the memory; async: each rank's two worker
    # processes step MaskedChoice, which raises on an invalid action, with a recurrent policy too.
    workers = ("collector.workers_per_rank=2",) if mode == "async" else ()
    result = torchrun("collector=distributed", "sync=distributed", f"collector.mode={mode}", *workers,
                      "collector.envs_per_rank=4", "collector.frames_per_batch=256", "algo.network.recurrent=lstm",
                      "algo.network.recurrent_size=32", f"env.id=tests.toy_envs:{env}", "trainer.total_frames=16384",
                      "seed=0", "hooks.eval.episodes=20", cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = summary_of(tmp_path)
    assert summary["status"] == "completed" and summary["eval_return"] == best, summary
