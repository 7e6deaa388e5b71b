"""Invalid-action masking: an env's Dict observation says which actions are valid (``action_mask``, PettingZoo's
and Gymnasium's convention); the policy never samples, takes or scores an invalid one, and bad masks are refused."""

from __future__ import annotations

import re

import gymnasium as gym
import numpy as np
import pytest
import torch

import tests.toy_envs  # noqa: F401  (registers MaskedChoice-v0, UnmaskedChoice-v0)
from rltrain import build
from rltrain.algos.networks import ActorCritic
from rltrain.envs import make_envs
from rltrain.envs.batched import spec_from_spaces
from rltrain.errors import CollectorError, ConfigError, EnvError
from tests.conftest import make_config
from tests.test_outputs import read_jsonl


def spec(action: gym.Space, mask: gym.Space):
    observation = gym.spaces.Dict({"x": gym.spaces.Box(-1.0, 1.0, (3,), np.float32), "action_mask": mask})
    return spec_from_spaces("Game-v0", observation, action, None)


def policy(action: gym.Space, n: int) -> ActorCritic:
    torch.manual_seed(0)
    net = ActorCritic(spec(action, gym.spaces.Box(0, 1, (n,), np.int8)), hidden_sizes=[16])
    with torch.no_grad():  # logits far from uniform, so a mask that did nothing would show
        net.actor[-1].weight.normal_(0, 3.0)
    return net


def observations(masks: list[list[int]]) -> dict:
    return {"x": torch.randn(len(masks), 3), "action_mask": torch.tensor(masks, dtype=torch.int8)}


def test_masked_actions_are_never_sampled_nor_taken_and_score_zero_probability():
    net = policy(gym.spaces.Discrete(4), 4)
    obs = observations([[1, 0, 1, 0], [0, 0, 0, 1], [0, 1, 1, 1]] * 500)
    action, log_prob = net.act(obs)
    assert obs["action_mask"].gather(1, action.unsqueeze(1)).all()  # 1,500 draws, none invalid
    greedy, _ = net.act(obs, deterministic=True)
    assert obs["action_mask"].gather(1, greedy.unsqueeze(1)).all()
    assert (action[1::3] == 3).all() and (log_prob[1::3] == 0).all()  # one valid action: certain
    # the learner's scores are those of the valid actions' own softmax, entropy included, and finite gradients
    new_log_prob, entropy, _ = net.evaluate(obs, action)
    logits = net.actor(net.encoder(obs)).detach().masked_fill(obs["action_mask"] == 0, -torch.inf)
    expected = torch.distributions.Categorical(logits=logits)
    torch.testing.assert_close(new_log_prob, expected.log_prob(action))
    torch.testing.assert_close(log_prob, new_log_prob)
    torch.testing.assert_close(entropy, expected.entropy())
    (new_log_prob.sum() + entropy.sum()).backward()
    assert all(torch.isfinite(p.grad).all() for p in net.parameters() if p.grad is not None)


def test_a_multi_discrete_mask_holds_each_entry_s_values_one_after_another():
    net = policy(gym.spaces.MultiDiscrete([3, 2]), 5)
    obs = observations([[0, 1, 1, 1, 0], [1, 0, 0, 0, 1]] * 500)
    action, _ = net.act(obs)
    assert (action[0::2, 0] != 0).all() and (action[0::2, 1] == 0).all()
    assert (action[1::2, 0] == 0).all() and (action[1::2, 1] == 1).all()


@pytest.mark.parametrize("action, mask, says", [
    (gym.spaces.Discrete(4), gym.spaces.Box(0, 1, (5,), np.int8),
     "its observation's 'action_mask' is a vector of shape (5,); for its discrete action space (nvec [4]) it must "
     "be a 0/1 vector of shape (4,), one per action"),
    (gym.spaces.MultiDiscrete([3, 2]), gym.spaces.MultiBinary(3),
     "must be a 0/1 vector of shape (5,), one per action, each entry's values one after another"),
    (gym.spaces.Box(-1.0, 1.0, (2,), np.float32), gym.spaces.Box(0, 1, (2,), np.int8),
     "would mask a box action space, which takes no mask"),
])
def test_a_mask_that_does_not_fit_the_action_space_is_refused_in_one_line(action, mask, says):
    with pytest.raises(ConfigError, match=re.escape(says)) as err:
        spec(action, mask)
    assert "\n" not in str(err.value) and "Game-v0" in str(err.value)


@pytest.mark.parametrize("collector", ["local", "lockstep"])
def test_a_mask_that_allows_no_action_names_the_env_and_the_step(tmp_path, collector):
    workers = ("collector=lockstep", "collector.workers=2", "collector.envs_per_worker=2") if collector == "lockstep" \
        else ("env.num_envs=4",)
    trainer = build(make_config("env.id=tests.toy_envs:EmptyMask-v0", *workers, "collector.frames_per_batch=64",
                                "algo.minibatch_size=64", "trainer.total_frames=4096"), run_dir=tmp_path / "run")
    # (in a worker: the CollectorError that names the worker, with the env's error)
    error = EnvError if collector == "local" else CollectorError
    with pytest.raises(error, match=r"env.id='tests.toy_envs:EmptyMask-v0' gave an 'action_mask' that allows no "
                                    r"action \(env 0 at step 3 of its episode, env 1 at step 3"):
        trainer.fit()


@pytest.mark.parametrize("collector", ["local", "lockstep", "async"])
def test_an_env_that_raises_on_an_invalid_action_trains_to_its_optimum_without_a_raise(tmp_path, collector):
    # MaskedChoice-v0: reward 1 for the valid action of the highest index; a uniform choice among the valid
    # ones scores about 4.6 of the best 8 an episode. Measured: the optimum, 8, by 12,288 frames (seed 0)
    workers = () if collector == "local" else ("sync=shared_mem",)  # (local: the default, in-process weights)
    summary = build(make_config("env.id=tests.toy_envs:MaskedChoice-v0", f"collector={collector}", *workers,
                                "trainer.total_frames=16384", "seed=0", "~hooks.log.every",
                                "+hooks.log.every={batches: 1}"), run_dir=tmp_path / "run").fit()
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "train/episode_return" in r]
    assert summary["status"] == "completed"  # a single invalid action would have failed the run
    assert rows[0]["train/episode_return"] < 6, rows[0]
    # sampled: the async collector acts a batch behind the learner, so one in ten episodes may still miss a
    # point (7.9 in one CI run); greedy: the optimum
    assert summary["train_return"] >= 7.5 and summary["eval_return"] == 8


def test_masks_from_an_action_masks_method_reach_the_policy_in_worker_processes(tmp_path):
    # sb3-contrib's convention: the env has an action_masks() method; rltrain moves its masks into the observation
    summary = build(make_config("env.id=tests.toy_envs:MaskMethodChoice-v0", "collector=lockstep",
                                "sync=shared_mem", "trainer.total_frames=16384", "seed=0"),
                    run_dir=tmp_path / "run").fit()
    assert summary["status"] == "completed" and summary["eval_return"] == 8  # the env raises on an invalid action
    env = make_envs("tests.toy_envs:MaskMethodChoice-v0")
    assert env.spec.masked and set(env.spec.observation) == {"observation", "action_mask"}


def test_without_a_mask_the_same_policy_meets_the_env_s_error(tmp_path):
    # the game's mask under another key: the policy sees it as a feature, nothing keeps it from invalid actions
    trainer = build(make_config("env.id=tests.toy_envs:UnmaskedChoice-v0", "trainer.total_frames=4096", "seed=0"),
                    run_dir=tmp_path / "run")
    with pytest.raises(EnvError, match=r"UnmaskedChoice-v0 \(env \d+ of 16\) raised in step\(\) .*invalid action"):
        trainer.fit()
