"""Batched envs: truncation keeps the true final observation, and bootstrapping uses it."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import tests.toy_envs  # noqa: F401  (registers Counting-v0)
from rltrain.algos import ActorCritic
from rltrain.algos.advantages import gae
from rltrain.collectors import LocalCollector
from rltrain.envs import GymnasiumBatchedEnv
from rltrain.sync import SharedMemSync
from tests.conftest import ROOT


def collect_one_batch(env_id: str, num_envs: int, frames: int):
    env = GymnasiumBatchedEnv(env_id, num_envs=num_envs, seed=0)
    policy = ActorCritic(env.spec)
    scheme = SharedMemSync()
    scheme.sender(policy)
    collector = LocalCollector(lambda: env, lambda: policy, scheme.receiver, frames_per_batch=frames)
    return next(iter(collector))


def test_truncation_keeps_the_final_observation_and_resets_after():
    batch = collect_one_batch("tests.toy_envs:Counting-v0", num_envs=2, frames=24)  # 12 steps per env
    obs, next_obs = batch["observation"][:, 0, 0], batch["next", "observation"][:, 0, 0]
    assert obs.tolist() == [0, 1, 2, 3, 4] * 2 + [0, 1]
    assert next_obs.tolist() == [1, 2, 3, 4, 5] * 2 + [1, 2]  # 5 = the final obs, not the reset 0
    assert batch["truncated"][:, 0].tolist() == [False] * 4 + [True] + [False] * 4 + [True, False, False]
    assert not batch["terminated"].any()
    assert batch["done"].equal(batch["truncated"])
    assert batch["episode_return"][4, 0].item() == 5.0 and batch["episode_length"][4, 0].item() == 5


def test_truncated_step_bootstraps_from_the_final_observation_value():
    batch = collect_one_batch("tests.toy_envs:Counting-v0", num_envs=1, frames=10)
    value_of = lambda obs: 10.0 * obs[..., 0]  # noqa: E731  a critic that reads the counter
    gamma = 0.9
    adv = gae(batch["reward"], value_of(batch["observation"]), value_of(batch["next", "observation"]),
              batch["terminated"], batch["done"], gamma=gamma, gae_lambda=0.0)
    # Step 4 truncates at obs 5: target = r + gamma * V(5) = 1 + 0.9 * 50; V(4) = 40.
    assert torch.isclose(adv[4, 0], torch.tensor(1 + gamma * 50.0 - 40.0))
    # Had it bootstrapped from the reset observation (0), the advantage would be 1 - 40.
    assert not torch.isclose(adv[4, 0], torch.tensor(1.0 - 40.0))


def test_termination_does_not_bootstrap():
    reward = torch.ones(3, 1)
    value = torch.full((3, 1), 2.0)
    next_value = torch.full((3, 1), 5.0)
    terminated = torch.tensor([[False], [True], [False]])
    adv = gae(reward, value, next_value, terminated, terminated.clone(), gamma=0.5, gae_lambda=1.0)
    assert adv[1, 0].item() == 1.0 - 2.0  # no gamma * V(next) after a terminal step
    assert adv[0, 0].item() == (1 + 0.5 * 5 - 2) + 0.5 * (1.0 - 2.0)  # recursion continues within the episode


def test_continuous_actions_reach_the_env_clipped_to_its_box_but_are_stored_raw():
    env = GymnasiumBatchedEnv("tests.toy_envs:RecordAction-v0", num_envs=2, seed=0)
    policy = ActorCritic(env.spec, init_log_std=2.0)  # wide Gaussian: many samples beyond +-1
    scheme = SharedMemSync()
    scheme.sender(policy)
    batch = next(iter(LocalCollector(lambda: env, lambda: policy, scheme.receiver, frames_per_batch=64)))
    assert batch["action"].shape == (32, 2, 2)
    assert batch["action"].abs().max() > 1.0  # stored as sampled: the log-prob is of this action
    received = torch.tensor(np.stack(env.envs[0].unwrapped.received))
    assert received.shape == (32, 2) and received.abs().max() <= 1.0
    assert torch.equal(received, batch["action"][:, 0].clamp(-1.0, 1.0))
    assert torch.isfinite(batch["log_prob"]).all()


def test_env_kwargs_reach_gymnasium_make(tmp_path):
    from rltrain import build
    from tests.conftest import make_config

    cfg = make_config("+env.kwargs.max_episode_steps=20", "trainer.total_frames=1024", "trainer.stop_at_return=null")
    trainer = build(cfg, run_dir=tmp_path)
    trainer.fit()
    assert max(trainer.state.episodes.recent_lengths) <= 20


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1", "HalfCheetah-v5"])
def test_saved_envs_continue_mid_episode_exactly(env_id):
    env = GymnasiumBatchedEnv(env_id, num_envs=2, seed=4)
    env.reset()
    actions = [np.stack([env.envs[0].action_space.sample() for _ in range(2)]) for _ in range(60)]
    for a in actions[:30]:
        env.step(a)
    state = env.state_dict()
    restored = GymnasiumBatchedEnv(env_id, num_envs=2, seed=99)  # other seed, never reset: all state comes from `state`
    restored.load_state_dict(state)
    for a in actions[30:]:  # the same trajectories, terminations and resets included
        expected = [x.copy() for x in env.step(a)]
        got = restored.step(a)
        for e, g in zip(expected, got):
            np.testing.assert_array_equal(e, g)
    env.close()
    restored.close()


@pytest.mark.parametrize(("args", "noise"), [
    (("env=halfcheetah", "collector=lockstep", "collector.workers=2", "collector.envs_per_worker=1",
      "collector.frames_per_batch=1024", "trainer.total_frames=1024"), "settotalmass"),
    (("trainer.total_frames=1024", "hooks.eval.video=true", "hooks.eval.episodes=1"), "XDG_RUNTIME_DIR"),
])
def test_upstream_noise_that_tells_a_user_nothing_is_not_printed(args, noise, tmp_path):
    # MuJoCo's deprecation of an attribute gymnasium's models use (also logged to MUJOCO_LOG.TXT in
    # the working dir), in the trainer and its workers; SDL looking for a display to render offscreen.
    env = {k: v for k, v in os.environ.items() if k not in ("SDL_VIDEODRIVER", "XDG_RUNTIME_DIR", "DISPLAY")}
    result = subprocess.run([sys.executable, "-m", "rltrain", *args, "hooks.progress.bar=false"], cwd=tmp_path,
                            env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert noise not in result.stdout + result.stderr
    assert not (tmp_path / "MUJOCO_LOG.TXT").exists()


def test_keep_indices_observes_only_the_entries_asked_for_and_names_a_bad_index():
    from rltrain.envs import make_envs
    from rltrain.errors import ConfigError

    keep = [{"wrapper": "rltrain.envs.wrappers.KeepIndices", "indices": [0, 2]}]
    full, partial = make_envs("CartPole-v1", seed=3), make_envs("CartPole-v1", seed=3, wrappers=keep)
    assert partial.spec.obs_shape == (2,)
    np.testing.assert_array_equal(partial.reset(), full.reset()[:, [0, 2]])  # position and angle, no velocities
    with pytest.raises(ConfigError, match=r"env.wrappers\[0\] \(rltrain.envs.wrappers.KeepIndices\) failed on "
                                          r"CartPole-v1: ValueError: indices \[0, 4\] must be entries"):
        make_envs("CartPole-v1", wrappers=[{**keep[0], "indices": [0, 4]}])
