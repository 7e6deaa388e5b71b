"""DQN: n-step transitions, targets, exploration (one schedule, Ape-X's per-env rates in worker processes),
images, Dict observations, masks, every collector, exact resume, refusals and learning."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tensordict import TensorDict

from rltrain import build, checkpoint
from rltrain.algos import DQN, QNetwork
from rltrain.algos.dqn import n_step_transitions
from rltrain.algos.networks import GOLDEN
from rltrain.envs import GymnasiumBatchedEnv
from rltrain.errors import ConfigError
from tests.conftest import LEARNING_RUN_TIMEOUT_S, ONE_THREAD, learning_check, make_config, run_cli
from tests.test_run_management import learning_rows
from tests.test_spaces import CATCH, CORRIDOR, SMALL_CNN

QUICK = ("algo=dqn", "algo.warmup_frames=256", "algo.batch_size=32", "trainer.stop_at_return=null")


def frames(rewards: torch.Tensor, terminated: torch.Tensor, truncated: torch.Tensor) -> TensorDict:
    obs = torch.arange(rewards.numel(), dtype=torch.float32).reshape(*rewards.shape, 1)
    return TensorDict({"observation": obs, "action": torch.zeros(rewards.shape, dtype=torch.long), "reward": rewards,
                       "terminated": terminated, "truncated": truncated, "next": {"observation": obs + 100}},
                      batch_size=rewards.shape)


def test_n_step_transitions_sum_rewards_until_an_episode_or_the_batch_ends():
    rewards = torch.arange(10, dtype=torch.float32).reshape(5, 2)  # [T=5, N=2]: env 0 gets 0, 2, 4, ...
    terminated, truncated = torch.zeros(5, 2, dtype=torch.bool), torch.zeros(5, 2, dtype=torch.bool)
    terminated[2, 0] = True  # env 0's episode ends at step 2 (no bootstrap)
    truncated[3, 1] = True  # env 1's is cut at step 3 (bootstrap from its true final observation)
    out = n_step_transitions(frames(rewards, terminated, truncated), n=3, gamma=0.5)
    assert out["reward"][:, 0].tolist() == [0 + 0.5 * 2 + 0.25 * 4, 2 + 0.5 * 4, 4, 6 + 0.5 * 8, 8]
    assert out["discount"][:, 0].tolist() == [0, 0, 0, 0.25, 0.5]  # terminated inside; then the batch's end
    assert out["next", "observation"][:, 0, 0].tolist() == [104, 104, 104, 108, 108]
    assert out["reward"][:, 1].tolist() == [1 + 0.5 * 3 + 0.25 * 5, 3 + 0.5 * 5 + 0.25 * 7, 5 + 0.5 * 7, 7, 9]
    assert out["discount"][:, 1].tolist() == [0.125, 0.125, 0.25, 0.5, 0.5]
    assert out["next", "observation"][:, 1, 0].tolist() == [105, 107, 107, 107, 109]
    assert out["steps"].tolist() == [[3, 3], [2, 3], [1, 2], [2, 1], [1, 1]]
    one = n_step_transitions(frames(rewards, terminated, truncated), n=1, gamma=0.5)
    assert torch.equal(one["reward"], rewards) and one["discount"][2, 0] == 0 and one["discount"][3, 1] == 0.5


def cartpole_dqn(**kwargs) -> DQN:
    spec = GymnasiumBatchedEnv("CartPole-v1", num_envs=1).spec
    dqn = DQN(QNetwork(spec, hidden_sizes=[16]), total_frames=10_000, warmup_frames=0, **kwargs)
    n = 64
    dqn.buffer.extend(TensorDict({"observation": torch.randn(n, 4), "action": torch.randint(2, (n,)),
                                  "reward": torch.randn(n), "discount": torch.full((n,), 0.9),
                                  "next": {"observation": torch.randn(n, 4)}}, batch_size=[n]))
    return dqn


@pytest.mark.parametrize("tau", [1.0, 0.1])
def test_the_target_moves_tau_towards_the_online_network_every_interval(tau):
    dqn = cartpole_dqn(tau=tau, target_update_interval=3)
    before = [p.clone() for p in dqn.target.parameters()]
    dqn._step(), dqn._step()
    assert all(torch.equal(a, b) for a, b in zip(before, dqn.target.parameters()))  # not due yet
    online_before = [p.clone() for p in dqn.policy.parameters()]
    dqn._step()
    assert not all(torch.equal(a, b) for a, b in zip(online_before, dqn.policy.parameters()))
    for old, target, online in zip(before, dqn.target.parameters(), dqn.policy.parameters()):
        torch.testing.assert_close(target, old + tau * (online - old))


@pytest.mark.parametrize("double", [True, False])
def test_double_q_learning_lets_the_online_network_choose_the_next_action(double):
    dqn = cartpole_dqn(double=double, lr=1e-12)
    with torch.no_grad():
        for p in dqn.target.parameters():
            p.add_(torch.randn_like(p))  # online and target disagree
    b = dqn.buffer.sample(32)
    next_obs = b["next", "observation"]
    chooser = dqn.policy if double else dqn.target
    expected = b["reward"] + b["discount"] * dqn.target(next_obs).gather(
        -1, chooser(next_obs).argmax(-1, keepdim=True)).squeeze(-1)
    q = dqn.policy(b["observation"]).gather(-1, b["action"].unsqueeze(-1)).squeeze(-1)
    loss, _ = dqn._gradient_step(b["observation"], b["action"], b["reward"], b["discount"], next_obs).tolist()
    assert loss == pytest.approx(torch.nn.functional.smooth_l1_loss(q, expected.detach()).item(), rel=1e-5)


def test_the_epsilon_schedule_reaches_collectors_with_each_push(tmp_path):
    cfg = make_config(*QUICK, "trainer.total_frames=4096", "algo.exploration_fraction=0.5", "algo.epsilon_end=0.1",
                      "collector.frames_per_batch=256", "algo.warmup_frames=512", "~hooks.log.every",
                      "+hooks.log.every={batches: 1}")
    trainer = build(cfg, run_dir=tmp_path)
    trainer.fit()
    rows = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if "dqn/epsilon" in r]
    by_frames = {r["frames"]: r["dqn/epsilon"] for r in rows}
    assert by_frames[256] == 1.0  # the warm-up acts at random; the schedule counts its frames too
    assert by_frames[1024] == pytest.approx(1 - 0.9 * 1024 / 2048) and by_frames[4096] == pytest.approx(0.1)
    assert float(trainer.collector.policy.epsilon) == pytest.approx(0.1)  # the collector's copy, pushed


def epsilon_seen(log_prob: torch.Tensor, n: int = 2) -> torch.Tensor:
    """Each env column's exploration rate, read back from the log-probs of its ``[T, N]`` actions: a greedy action's
    (the most likely) is log(1 - epsilon (n - 1) / n), a random other one's log(epsilon / n)."""
    return (1 - log_prob.double().max(0).values.exp()) * n / (n - 1)


def test_per_env_exploration_gives_every_env_of_every_worker_its_own_rate(tmp_path):
    cfg = make_config(*QUICK, "algo.exploration=per_env", "algo.warmup_frames=128", "collector=lockstep",
                      "collector.workers=2", "collector.envs_per_worker=4", "collector.frames_per_batch=2048",
                      "trainer.total_frames=4096", "seed=10")
    trainer = build(cfg, run_dir=tmp_path)
    batches = iter(trainer.collector)
    trainer.algo.update(next(batches))  # the warm-up's batch, every action at random; learning starts
    trainer.hooks["weight_push"].sender.push()
    batch = next(batches)
    trainer.collector.close()
    trainer.hooks["weight_push"].sender.close()
    seen = epsilon_seen(batch["log_prob"])
    envs = torch.arange(10, 18)  # env k of the job is seeded seed + k
    expected = 0.4 ** (1 + 7 * torch.frac(envs.double() * GOLDEN))
    torch.testing.assert_close(seen, expected, rtol=1e-3, atol=0)
    assert len(set(expected.tolist())) == 8 and expected.max() > 0.3 and expected.min() < 0.005  # spread out
    # ...and each env acts at that rate: the share of its 256 actions that are not the greedy one is epsilon / 2
    not_greedy = (batch["log_prob"] < batch["log_prob"].max(0).values).double().mean(0)
    assert (not_greedy - expected / 2).abs().max() < 0.08 and not_greedy[expected.argmax()] > 0.1


def test_a_run_stopped_mid_update_resumes_exactly_with_workers_buffer_target_and_exploration(tmp_path):
    # per_env: each env's rate comes back with it (a resumed run's envs are seeded later, but act as they did)
    run = (*QUICK, "algo.exploration=per_env", "collector=lockstep", "collector.workers=2",
           "collector.envs_per_worker=2", "collector.frames_per_batch=128", "algo.utd=10", "algo.n_step=3",
           "algo.target_update_interval=50", "algo.exploration_fraction=0.5", "trainer.total_frames=768", "seed=3",
           "~hooks.log.every", "+hooks.log.every={frames:128}")
    reference = build(make_config(*run), run_dir=tmp_path / "full").fit()
    stop_mid_update = ("+hooks.kill._target_=tests.hooks_for_tests.SignalDuringUpdate", "+hooks.kill.at_batch=4")
    stopped = build(make_config(*run, *stop_mid_update), run_dir=tmp_path / "split").fit()
    assert stopped["status"] == "interrupted" and stopped["frames"] == 512
    saved = checkpoint.load(checkpoint.listing(tmp_path / "split")[-1])
    assert saved["algo"]["replay_buffer"]["size"] == 512 and 0 < len(saved["algo"]["pending"]["metrics"]) < 1280
    assert len(saved["collector"]["workers"]) == 2
    final = build(make_config(*run, f"resume={tmp_path / 'split'}")).fit()
    assert (final["frames"], final["updates"]) == (reference["frames"], reference["updates"])
    assert learning_rows(tmp_path / "split") == learning_rows(tmp_path / "full")


@pytest.mark.parametrize(("collector", "sync"), [("lockstep", "pipe"), ("async", "shared_mem"), ("async", "pipe")])
def test_dqn_runs_with_every_collector_and_sync_scheme(collector, sync, tmp_path):
    cfg = make_config(*QUICK, f"collector={collector}", f"sync={sync}", "trainer.total_frames=1024",
                      "algo.exploration=per_env", "hooks.eval.episodes=1")
    summary = build(cfg, run_dir=tmp_path).fit()
    assert summary["status"] == "completed"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any("loss/q" in row for row in rows)


def test_dqn_is_refused_for_box_actions_without_pushes_and_with_a_rising_schedule(tmp_path):
    with pytest.raises(ConfigError, match="algo=DQN supports discrete action spaces, but env.id='Pendulum-v1'"):
        build(make_config("algo=dqn", "env=pendulum"), run_dir=tmp_path / "a")
    with pytest.raises(ConfigError, match="algo=dqn with sync=none"):
        build(make_config("algo=dqn", "sync=none"), run_dir=tmp_path / "b")
    with pytest.raises(ConfigError, match=r"algo.epsilon_end \(0.5\) is above algo.epsilon_start \(0.2\)"):
        build(make_config("algo=dqn", "algo.epsilon_start=0.2", "algo.epsilon_end=0.5"), run_dir=tmp_path / "c")
    assert not any((tmp_path / d).exists() for d in "abc")


def test_a_run_resumed_without_its_buffer_refills_it_before_the_next_gradient_step():
    spec = GymnasiumBatchedEnv("CartPole-v1", num_envs=1).spec
    dqn = DQN(QNetwork(spec, hidden_sizes=[16]), total_frames=10_000, warmup_frames=256)

    def batch(n: int) -> TensorDict:
        zeros = torch.zeros(n, 1, dtype=torch.bool)
        return TensorDict({"observation": torch.randn(n, 1, 4), "action": torch.randint(2, (n, 1)),
                           "reward": torch.ones(n, 1), "terminated": zeros, "truncated": zeros,
                           "next": {"observation": torch.randn(n, 1, 4)}}, batch_size=[n, 1])

    dqn.update(batch(512))
    assert dqn.updates == 128  # past the warm-up: 0.25 a frame
    resumed = DQN(QNetwork(spec, hidden_sizes=[16]), total_frames=10_000, warmup_frames=256)
    resumed.load_state_dict(dqn.state_dict(replay_buffer=False))
    resumed.update(batch(128))
    assert resumed.updates == 128 and len(resumed.buffer) == 128  # nothing learned from 128 transitions...
    resumed.update(batch(128))
    assert resumed.updates == 128 + 32  # ...until the buffer holds the warm-up's 256 again
    assert float(resumed.policy.epsilon) == pytest.approx(1 - 0.95 * 768 / 1000)  # the schedule went on from 512


def test_a_dueling_head_is_value_plus_centred_advantages():
    spec = GymnasiumBatchedEnv("CartPole-v1", num_envs=1).spec
    net = QNetwork(spec, hidden_sizes=[8], dueling=True)
    obs = torch.randn(5, 4)
    features = net.encoder(obs)
    value, advantage = net.value(features), net.q(features)
    torch.testing.assert_close(net(obs), value + advantage - advantage.mean(-1, keepdim=True))


def test_the_atari_recipe_takes_gradient_steps_on_atari_frames_with_the_nature_cnn(tmp_path):
    summary = build(make_config("+recipe=dqn_atari", "env.num_envs=2", "collector.frames_per_batch=32",
                                "algo.warmup_frames=64", "algo.buffer_size=1000", "trainer.total_frames=128",
                                "hooks.eval.episodes=1", "hooks.eval.at_end=false", "~hooks.log.every",
                                "+hooks.log.every={batches: 1}"), run_dir=tmp_path).fit()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert summary["frames"] == 128 and any("loss/q" in row for row in rows)
    saved = checkpoint.load(checkpoint.listing(tmp_path)[-1])
    assert "replay_buffer" not in saved["algo"]  # 56 KB a transition: the recipe's checkpoints leave it out


# Learning checks: seeded, each against what a random policy scores.

@learning_check
def test_dqn_learns_catch_from_pixels_with_a_dueling_head(tmp_path):
    summary = build(make_config(*QUICK, f"env.id={CATCH}", "env.num_envs=8", "collector.frames_per_batch=64",
                                "algo.lr=5e-4", "algo.gamma=0.9", "algo.network.dueling=true", "algo.utd=0.5",
                                "algo.target_update_interval=100", "algo.exploration_fraction=0.3",
                                "algo.network.hidden_sizes=[64]", "trainer.total_frames=8192", *SMALL_CNN),
                    run_dir=tmp_path).fit()
    assert summary["eval_return"] >= 0.6  # random: about -0.6; tracking the ball: 1


@learning_check
def test_dqn_learns_a_dict_observation_env(tmp_path):
    summary = build(make_config(*QUICK, f"env.id={CORRIDOR}", "env.num_envs=8", "collector.frames_per_batch=64",
                                "algo.lr=1e-3", "algo.gamma=0.95", "algo.n_step=3", "algo.utd=0.5",
                                "algo.target_update_interval=100", "algo.exploration_fraction=0.3",
                                "trainer.total_frames=8192"), run_dir=tmp_path).fit()
    assert summary["eval_return"] >= 0.6  # random: about 0.1; straight to the goal: about 0.9


@learning_check
def test_dqn_acts_only_on_valid_actions_and_learns_a_masked_env(tmp_path):
    # MaskedChoice-v0 raises on an invalid action; the best return is 8, a uniform valid choice about 4.6
    summary = build(make_config(*QUICK, "env.id=tests.toy_envs:MaskedChoice-v0", "collector=lockstep",
                                "collector.frames_per_batch=256", "algo.lr=1e-3", "algo.utd=0.5",
                                "algo.target_update_interval=100", "algo.exploration_fraction=0.3",
                                "trainer.total_frames=8192"), run_dir=tmp_path).fit()
    assert summary["status"] == "completed" and summary["eval_return"] == 8


@pytest.mark.slow
@learning_check
def test_the_dqn_cartpole_recipe_solves_cartpole_within_50k_frames(tmp_path):
    result = run_cli("+recipe=dqn_cartpole", ONE_THREAD, "trainer.stop_at_return=475", "hydra.run.dir=run",
                     cwd=tmp_path, timeout=LEARNING_RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["solved"] is True and summary["frames_to_solve"] <= 50_000


def test_golden_ratio_rungs_cover_the_ladder_evenly_for_any_number_of_envs():
    for n in (4, 16, 256):
        rungs = sorted(torch.frac(torch.arange(n).double() * GOLDEN).tolist())
        gaps = [b - a for a, b in zip([0.0, *rungs], [*rungs, 1.0])]
        assert max(gaps) < 2.7 / n  # the three-gap theorem: no gap over about 2.6 / n
    assert math.isclose(GOLDEN, 0.6180339887, rel_tol=1e-9)
