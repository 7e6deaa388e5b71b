"""Observation and action spaces beyond flat vectors: images, Dicts, MultiDiscrete, MultiBinary,
and the clear refusal of the rest."""

from __future__ import annotations

import functools

import gymnasium as gym
import numpy as np
import pytest
import torch
from torch.distributions import Bernoulli, Categorical

import tests.toy_envs  # noqa: F401  (registers the toy envs)
from rltrain import build
from rltrain.algos import ActorCritic
from rltrain.algos.encoders import ObsEncoder
from rltrain.collectors import LocalCollector, LockstepCollector
from rltrain.envs import GymnasiumBatchedEnv
from rltrain.envs.spaces import action_spec, observation_spec
from rltrain.errors import ConfigError
from rltrain.sync import SharedMemSync
from tests.conftest import learning_check, make_config

CATCH, CORRIDOR, DIGITS = "tests.toy_envs:Catch-v0", "tests.toy_envs:GoalCorridor-v0", "tests.toy_envs:MatchDigits-v0"
SMALL_CNN = ["algo.network.cnn.channels=[16]", "algo.network.cnn.kernels=[3]", "algo.network.cnn.strides=[1]",
             "algo.network.cnn.features=64"]


@pytest.mark.parametrize("space,match", [
    (gym.spaces.Text(5), "Text observation space"),
    (gym.spaces.Tuple([gym.spaces.Discrete(2), gym.spaces.Discrete(3)]), "Tuple observation space"),
    (gym.spaces.Dict({"inner": gym.spaces.Dict({"x": gym.spaces.Discrete(2)})}), "key 'inner' is a Dict"),
    (gym.spaces.Sequence(gym.spaces.Discrete(2)), "Sequence observation space"),
])
def test_unsupported_observation_spaces_are_refused_naming_the_space(space, match):
    with pytest.raises(ConfigError, match=match) as e:
        observation_spec("Odd-v0", space)
    assert "rltrain supports" in str(e.value)


@pytest.mark.parametrize("space,match", [
    (gym.spaces.Text(5), "Text action space"),
    (gym.spaces.Discrete(3, start=1), "starting at 1"),
    (gym.spaces.Box(-np.inf, np.inf, (2,)), "infinite bounds"),
    (gym.spaces.Tuple([gym.spaces.Discrete(2)]), "Tuple action space"),
])
def test_unsupported_action_spaces_are_refused_naming_the_space(space, match):
    with pytest.raises(ConfigError, match=match):
        action_spec("Odd-v0", space)


def test_each_leaf_keeps_its_own_dtype():
    space = gym.spaces.Dict({"pixels": gym.spaces.Box(0, 255, (8, 8, 3), np.uint8),
                             "joints": gym.spaces.Box(-1, 1, (5,), np.float64),
                             "mode": gym.spaces.Discrete(4), "switches": gym.spaces.MultiBinary(3)})
    spec = observation_spec("Robot-v0", space)
    assert {k: (leaf.kind, leaf.dtype) for k, leaf in spec.items()} == {
        "pixels": ("image", "uint8"), "joints": ("vector", "float32"), "mode": ("discrete", "int64"),
        "switches": ("vector", "int8")}


def test_image_batches_stay_uint8_from_the_env_to_the_batch():
    make_policy = functools.partial(ActorCritic, GymnasiumBatchedEnv(CATCH).spec,
                                    cnn={"channels": [4], "kernels": [3], "strides": [1]})
    scheme = SharedMemSync()
    scheme.sender(make_policy())
    collector = LocalCollector(functools.partial(GymnasiumBatchedEnv, CATCH, num_envs=4), make_policy, scheme.receiver,
                               frames_per_batch=32)
    try:
        batch = next(iter(collector))
    finally:
        collector.close()
    assert batch["observation"].dtype == torch.uint8 and batch["observation"].shape == (8, 4, 10, 10, 1)
    assert batch["next", "observation"].dtype == torch.uint8
    assert set(batch["observation"].unique().tolist()) == {0, 255}  # ball and paddle: pixels as the env drew them


def test_dict_observations_nest_below_observation_through_worker_processes():
    spec = GymnasiumBatchedEnv(CORRIDOR).spec
    scheme = SharedMemSync()
    policy = ActorCritic(spec)
    scheme.sender(policy)
    collector = LockstepCollector(make_env=functools.partial(GymnasiumBatchedEnv, CORRIDOR),
                                  make_policy=functools.partial(ActorCritic, spec), make_receiver=scheme.receiver,
                                  env_spec=spec, frames_per_batch=64, workers=2, envs_per_worker=4)
    try:
        batch = next(iter(collector))
    finally:
        collector.close()
    assert set(batch["observation"].keys()) == {"position", "goal"}
    assert batch["observation", "goal"].dtype == torch.int64 and batch["observation", "goal"].shape == (8, 8)
    assert batch["next", "observation", "position"].shape == (8, 8, 1)
    # Where an episode goes on, the next step's observation is this step's next observation.
    ongoing = ~batch["done"][:-1]
    assert torch.equal(batch["observation", "goal"][1:][ongoing], batch["next", "observation", "goal"][:-1][ongoing])
    log_prob, _, _ = policy.evaluate(batch["observation"], batch["action"])
    assert log_prob.shape == (8, 8)


@pytest.mark.parametrize("layout", ["hw", "chw"])
def test_the_cnn_reads_every_image_layout_alike(layout):
    hwc_env, other_env = tests.toy_envs.CatchEnv(layout="hwc"), tests.toy_envs.CatchEnv(layout=layout)
    cnn = {"channels": [8], "kernels": [3], "strides": [1], "features": 16}
    hwc = ObsEncoder(observation_spec("c", hwc_env.observation_space), cnn=cnn)
    other = ObsEncoder(observation_spec("c", other_env.observation_space), cnn=cnn)
    other.load_state_dict(hwc.state_dict())
    hwc_obs, _ = hwc_env.reset(seed=3)
    other_obs, _ = other_env.reset(seed=3)
    batch = lambda o: torch.from_numpy(np.stack([o, o]))  # noqa: E731
    torch.testing.assert_close(hwc(batch(hwc_obs)), other(batch(other_obs)))


def test_an_image_too_small_for_the_cnn_names_the_key_to_change(tmp_path):
    with pytest.raises(ConfigError, match=r"too small for algo.network.cnn .*algo.network.cnn.channels=\[16\]"):
        build(make_config(f"env.id={CATCH}", "env.num_envs=2"), run_dir=tmp_path)


def test_sac_refuses_images_and_discrete_actions_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match="algo=SAC reads vector, discrete, multi_discrete observations, but"):
        build(make_config("algo=sac", "env=pendulum", f"env.id={CATCH}", "+env.kwargs.continuous=true"),
              run_dir=tmp_path)
    with pytest.raises(ConfigError, match="algo=SAC supports box action spaces, but .* multi_discrete one"):
        build(make_config("algo=sac", "env=pendulum", f"env.id={DIGITS}"), run_dir=tmp_path)
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_multi_discrete_log_probs_and_entropy_match_torch_distributions():
    spec = GymnasiumBatchedEnv(DIGITS).spec  # overridden below: unequal sizes exercise the padding
    spec = type(spec)(spec.id, spec.observation, action_spec("d", gym.spaces.MultiDiscrete([2, 5, 3])), None)
    policy = ActorCritic(spec)
    torch.manual_seed(0)
    with torch.no_grad():
        policy.actor[-1].weight.normal_()
    obs = torch.rand(6, 3)
    logits = policy.actor(obs)
    parts = [Categorical(logits=chunk) for chunk in logits.split([2, 5, 3], -1)]
    action = torch.stack([p.sample() for p in parts], -1)
    log_prob, entropy, _ = policy.evaluate(obs, action)
    torch.testing.assert_close(log_prob, sum(p.log_prob(a) for p, a in zip(parts, action.unbind(-1))))
    torch.testing.assert_close(entropy, sum(p.entropy() for p in parts))
    sampled, sampled_log_prob = policy.act(obs)
    assert sampled.shape == (6, 3) and (sampled < torch.tensor([2, 5, 3])).all()
    torch.testing.assert_close(sampled_log_prob, policy.evaluate(obs, sampled)[0])
    entropy.sum().backward()  # padding slots give no NaN gradient
    assert all(torch.isfinite(p.grad).all() for p in policy.parameters() if p.grad is not None)


def test_multi_binary_log_probs_and_entropy_match_torch_distributions():
    env = GymnasiumBatchedEnv(DIGITS, kwargs={"binary": True})
    policy = ActorCritic(env.spec)
    with torch.no_grad():
        policy.actor[-1].weight.normal_()
    obs = torch.rand(5, 3)
    reference = Bernoulli(logits=policy.actor(obs))
    action, log_prob = policy.act(obs)
    assert action.dtype == torch.int8 and action.shape == (5, 3)
    new_log_prob, entropy, _ = policy.evaluate(obs, action)
    torch.testing.assert_close(log_prob, reference.log_prob(action.float()).sum(-1))
    torch.testing.assert_close(new_log_prob, log_prob)
    torch.testing.assert_close(entropy, reference.entropy().sum(-1))
    env.close()


# Learning checks: seeded, each against what a random policy scores.

@learning_check
def test_ppo_learns_catch_from_pixels(tmp_path):
    summary = build(make_config(f"env.id={CATCH}", "env.num_envs=8", "collector.frames_per_batch=256",
                                "algo.lr=1e-3", "algo.minibatch_size=64", "algo.epochs=4", "algo.gamma=0.9",
                                "algo.network.hidden_sizes=[64]", "trainer.total_frames=16384",
                                "trainer.stop_at_return=null", *SMALL_CNN), run_dir=tmp_path).fit()
    assert summary["eval_return"] >= 0.6  # random: about -0.6; tracking the ball: 1


@learning_check
def test_ppo_learns_a_dict_observation_env(tmp_path):
    summary = build(make_config(f"env.id={CORRIDOR}", "env.num_envs=8", "collector.frames_per_batch=256",
                                "algo.lr=1e-3", "algo.minibatch_size=64", "algo.gamma=0.95",
                                "trainer.total_frames=20480", "trainer.stop_at_return=null"), run_dir=tmp_path).fit()
    assert summary["eval_return"] >= 0.6  # random: about 0.1; straight to the goal: about 0.9


@learning_check
@pytest.mark.parametrize("binary", [False, True])
def test_ppo_learns_multi_discrete_and_multi_binary_actions(binary, tmp_path):
    summary = build(make_config(f"env.id={DIGITS}", f"+env.kwargs.binary={binary}", "env.num_envs=8",
                                "collector.frames_per_batch=256", "algo.lr=1e-3", "algo.minibatch_size=64",
                                "trainer.total_frames=20480", "trainer.stop_at_return=null"), run_dir=tmp_path).fit()
    assert summary["eval_return"] >= 9.0  # random: 10/3 (digits of 3) or 5 (bits); all matched: 10


def test_a_dict_observation_run_resumes_exactly(tmp_path):
    run = (f"env.id={CORRIDOR}", "env.num_envs=4", "collector.frames_per_batch=128", "algo.minibatch_size=64",
           "algo.anneal_lr=false",
           "trainer.stop_at_return=null", "seed=5", "hooks.eval.episodes=4")
    full = build(make_config(*run, "trainer.total_frames=2048"), run_dir=tmp_path / "full").fit()
    build(make_config(*run, "trainer.total_frames=1024"), run_dir=tmp_path / "split").fit()
    resumed = build(make_config(*run, "trainer.total_frames=2048", f"resume={tmp_path / 'split'}")).fit()
    for key in ("frames", "updates", "episodes", "train_return", "eval_return"):
        assert resumed[key] == full[key], key
