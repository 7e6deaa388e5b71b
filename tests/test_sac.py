"""SAC and its replay buffer: storage semantics, target and temperature updates, learning."""

from __future__ import annotations

import json

import pytest
import torch
from tensordict import TensorDict

from rltrain import build
from rltrain.algos import SAC, SquashedGaussianActor
from rltrain.data import ReplayBuffer
from rltrain.envs import GymnasiumBatchedEnv
from rltrain.errors import ConfigError
from tests.conftest import LEARNING_RUN_TIMEOUT_S, ONE_THREAD, learning_check, make_config, run_cli


def frames(start: int, n: int) -> TensorDict:
    ids = torch.arange(start, start + n)
    return TensorDict({"id": ids, "obs": ids.float().unsqueeze(-1).expand(n, 3).clone(),
                       "flag": ids % 2 == 0, "next": {"obs": torch.zeros(n, 3, dtype=torch.float64)}},
                      batch_size=[n])


def test_replay_buffer_wraps_around_and_keeps_the_newest_frames():
    buffer = ReplayBuffer(capacity=10)
    buffer.extend(frames(0, 7))
    assert len(buffer) == 7
    buffer.extend(frames(7, 6))  # 13 frames into 10 slots: 0, 1, 2 are overwritten
    assert len(buffer) == 10
    assert buffer.storage["id"].tolist() == [10, 11, 12, 3, 4, 5, 6, 7, 8, 9]  # a ring: 10-12 took slots 0-2
    buffer.extend(frames(100, 25).reshape(5, 5))  # more than capacity at once, any batch shape
    assert sorted(buffer.storage["id"].tolist()) == list(range(115, 125))


def test_replay_buffer_samples_only_filled_slots_and_keeps_dtypes_and_shapes():
    buffer = ReplayBuffer(capacity=1000)
    buffer.extend(frames(0, 5))
    sample = buffer.sample(4000)
    assert set(sample["id"].tolist()) == {0, 1, 2, 3, 4}  # never an empty slot
    assert sample["obs"].shape == (4000, 3) and sample["obs"].dtype == torch.float32
    assert sample["flag"].dtype == torch.bool and sample["next", "obs"].dtype == torch.float64
    assert torch.equal(sample["obs"][:, 0], sample["id"].float())
    assert buffer.storage.batch_size == torch.Size([1000])  # preallocated once: capacity x frame


@pytest.mark.parametrize("capacity_after", [10, 4, 20])
def test_replay_buffer_state_restores_the_same_slots_or_the_newest_frames(capacity_after):
    buffer = ReplayBuffer(capacity=10)
    buffer.extend(frames(0, 13))  # wrapped: the cursor is at slot 3
    state = buffer.state_dict()
    assert state["frames"]["id"].numel() == 10
    restored = ReplayBuffer(capacity=capacity_after)
    restored.load_state_dict(state)
    if capacity_after == 10:  # same capacity: same slots and cursor, so the same samples follow
        assert torch.equal(restored.storage["id"], buffer.storage["id"]) and restored.cursor == buffer.cursor
        gen_a, gen_b = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
        assert torch.equal(restored.sample(64, gen_a)["id"], buffer.sample(64, gen_b)["id"])
    else:
        assert sorted(restored.storage["id"][: len(restored)].tolist()) == list(range(13 - min(10, capacity_after), 13))
    oldest = 13 - min(10, capacity_after)
    restored.extend(frames(50, 1))
    assert 50 in restored.storage["id"].tolist()
    # A full buffer overwrites its oldest frame; a bigger one still has room.
    assert (oldest in restored.storage["id"].tolist()) == (capacity_after > 10)


def test_a_partly_filled_buffer_saves_only_its_frames():
    buffer = ReplayBuffer(capacity=100_000)
    buffer.extend(frames(0, 5))
    state = buffer.state_dict()
    assert state["frames"]["obs"].untyped_storage().nbytes() == 5 * 3 * 4  # not the 100k-slot storage
    empty = ReplayBuffer(capacity=100)
    empty.load_state_dict(ReplayBuffer(capacity=100).state_dict())
    assert len(empty) == 0


def pendulum_sac(**kwargs) -> SAC:
    spec = GymnasiumBatchedEnv("Pendulum-v1", num_envs=1).spec
    sac = SAC(SquashedGaussianActor(spec, hidden_sizes=[32, 32]), total_frames=10_000, warmup_frames=0,
              batch_size=32, critic_hidden_sizes=[32, 32], **kwargs)
    n = 64
    sac.buffer.extend(TensorDict({
        "observation": torch.randn(n, 3), "action": torch.rand(n, 1) * 4 - 2, "reward": torch.randn(n),
        "terminated": torch.zeros(n, dtype=torch.bool), "next": {"observation": torch.randn(n, 3)}}, batch_size=[n]))
    return sac


def test_target_critics_move_exactly_tau_towards_the_online_critics():
    sac = pendulum_sac(tau=0.1)
    with torch.no_grad():
        for p in sac.q_target.parameters():
            p.add_(torch.randn_like(p))  # make targets differ from the online critics
    before = [p.clone() for p in sac.q_target.parameters()]
    sac._step()
    for old, target, online in zip(before, sac.q_target.parameters(), sac.q.parameters()):
        torch.testing.assert_close(target, old + 0.1 * (online - old))


def test_alpha_decreases_while_entropy_is_above_target_and_rises_below():
    sac = pendulum_sac(target_entropy=-50.0)  # far below the policy's entropy
    alpha0 = sac.log_alpha.exp().item()
    for _ in range(5):
        sac._step()
    assert sac.log_alpha.exp().item() < alpha0
    sac = pendulum_sac(target_entropy=50.0)  # far above
    for _ in range(5):
        sac._step()
    assert sac.log_alpha.exp().item() > alpha0


def test_sac_rejects_discrete_action_envs_before_building(tmp_path):
    with pytest.raises(ConfigError, match="algo=SAC supports box action spaces, but env.id='CartPole-v1'"):
        build(make_config("algo=sac", "env=cartpole"), run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_sac_with_sync_none_is_rejected_since_warmup_ends_through_a_push(tmp_path):
    with pytest.raises(ConfigError, match="algo=sac with sync=none"):
        build(make_config("algo=sac", "env=pendulum", "sync=none"), run_dir=tmp_path)


@pytest.mark.parametrize(("collector", "sync"), [("local", "shared_mem"), ("lockstep", "shared_mem"),
                                                 ("lockstep", "pipe"), ("async", "shared_mem"), ("async", "pipe")])
def test_sac_runs_with_every_collector_and_sync_scheme(collector, sync, tmp_path):
    cfg = make_config("algo=sac", "env=pendulum", f"collector={collector}", f"sync={sync}",
                      "trainer.total_frames=1024", "algo.warmup_frames=256", "algo.utd=0.25",
                      "hooks.eval.episodes=1")
    summary = build(cfg, run_dir=tmp_path).fit()
    assert summary["status"] == "completed"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any("loss/critic" in row for row in rows)  # learning started after the warm-up


def test_warmup_acts_uniformly_and_the_first_push_after_it_switches_collectors_to_the_policy(tmp_path):
    cfg = make_config("algo=sac", "env=pendulum", "trainer.total_frames=2048", "algo.warmup_frames=1024",
                      "algo.utd=0.05", "collector.frames_per_batch=256")
    trainer = build(cfg, run_dir=tmp_path)
    assert bool(trainer.collector.policy.uniform)
    trainer.fit()
    assert not bool(trainer.algo.policy.uniform) and not bool(trainer.collector.policy.uniform)


@pytest.mark.slow
@learning_check
def test_the_sac_pendulum_recipe_solves_pendulum_within_20k_frames(tmp_path):
    # One thread, not the recipe's two: two threads wait on each other on a busy 2-core box (tests/conftest.py).
    result = run_cli("+recipe=sac_pendulum", ONE_THREAD, "hydra.run.dir=run", cwd=tmp_path,
                     timeout=LEARNING_RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["solved"] is True and summary["train_return"] >= -200
    assert summary["frames_to_solve"] <= 20_000


@pytest.mark.slow
@learning_check
def test_sac_on_pendulum_with_the_default_configs_stops_once_solved(tmp_path):
    # python -m rltrain algo=sac env=pendulum
    summary = build(make_config("algo=sac", "env=pendulum"), run_dir=tmp_path).fit()
    assert summary["solved"] is True and summary["train_return"] >= -200
    assert summary["frames_to_solve"] <= 20_000
