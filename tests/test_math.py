"""The hand-written distributions and statistics agree with torch/numpy references."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.wrappers import NormalizeReward
from torch.distributions import Categorical, Normal

from rltrain.algos import ActorCritic
from rltrain.algos.advantages import gae
from rltrain.algos.normalization import ObsNormalizer, ReturnNormalizer
from rltrain.envs import GymnasiumBatchedEnv


def test_gaussian_log_prob_and_entropy_match_torch_distributions():
    spec = GymnasiumBatchedEnv("Pendulum-v1", num_envs=1).spec
    policy = ActorCritic(spec, init_log_std=-0.3)
    obs = torch.randn(64, 3)
    action, log_prob = policy.act(obs)
    mean = policy.actor(obs)
    reference = Normal(mean, policy.head.log_std.exp())
    torch.testing.assert_close(log_prob, reference.log_prob(action).sum(-1))
    new_log_prob, entropy, _ = policy.evaluate(obs, action)
    torch.testing.assert_close(new_log_prob, log_prob)
    torch.testing.assert_close(entropy, reference.entropy().sum(-1))


def test_categorical_sampling_log_prob_and_entropy_match_torch_distributions():
    spec = GymnasiumBatchedEnv("CartPole-v1", num_envs=1).spec
    policy = ActorCritic(spec)
    with torch.no_grad():
        policy.actor[-1].bias.copy_(torch.tensor([0.0, 1.0]))  # P(action 1) = e / (1 + e) = 0.731
    obs = torch.zeros(20000, 4)
    action, log_prob = policy.act(obs)
    reference = Categorical(logits=policy.actor(obs))
    torch.testing.assert_close(log_prob, reference.log_prob(action))
    assert abs(action.float().mean().item() - 0.7311) < 0.02  # Gumbel-max samples the categorical
    _, entropy, _ = policy.evaluate(obs[:5], action[:5])
    torch.testing.assert_close(entropy, reference.entropy()[:5])


def test_obs_normalizer_matches_the_statistics_of_everything_seen():
    norm = ObsNormalizer((3,))
    rng = np.random.default_rng(0)
    chunks = [rng.normal(5.0, 3.0, size=(n, 3)).astype(np.float32) for n in (7, 100, 1, 33)]
    for chunk in chunks:
        norm.update(torch.from_numpy(chunk))
    everything = np.concatenate(chunks)
    np.testing.assert_allclose(norm.mean.numpy(), everything.mean(0), rtol=1e-5)
    np.testing.assert_allclose(norm.var.numpy(), everything.var(0), rtol=1e-4)
    assert norm.count.item() == len(everything)


def test_return_normalizer_scales_rewards_as_gymnasiums_normalize_reward():
    # A stream with no episode end, one step per batch: gymnasium's wrapper and the learner-side
    # normalizer see the same discounted returns and divide by the same running std.
    class Rewards(gym.Env):  # plays back a list of rewards, never ending
        observation_space = action_space = gym.spaces.Box(-1, 1, (1,))

        def __init__(self, rewards):
            self.rewards, self.t = rewards, 0

        def step(self, action):
            self.t += 1
            return np.zeros(1), float(self.rewards[self.t - 1]), False, False, {}

    rewards = np.random.default_rng(0).normal(3.0, 2.0, size=300)
    theirs = NormalizeReward(Rewards(rewards), gamma=0.99)
    ours = ReturnNormalizer(gamma=0.99, clip=None)
    for r in rewards:
        expected = theirs.step(np.zeros(1))[1]
        got = ours(torch.tensor([[r]], dtype=torch.float32), torch.zeros(1, 1, dtype=torch.bool))
        np.testing.assert_allclose(got.numpy()[0], expected, rtol=1e-5)


def test_return_normalizer_restarts_returns_at_episode_ends_and_clips():
    norm = ReturnNormalizer(gamma=0.5, clip=2.0)
    reward = torch.ones(4, 2)
    done = torch.tensor([[False, False], [True, False], [False, False], [False, False]])
    norm(reward, done)
    # Column 0 ended after step 1: its return restarted (1, 1.5 | 1, 1.5); column 1 never ended.
    assert norm.state_dict()["carry"].tolist() == [1.5, 1.875]
    assert norm.count == pytest.approx(8 + 1e-4)
    huge = norm(torch.full((1, 2), 1e6), torch.zeros(1, 2, dtype=torch.bool))
    assert huge.tolist() == [[2.0, 2.0]]  # clipped to +-clip after scaling
    restored = ReturnNormalizer(gamma=0.5, clip=2.0)
    restored.load_state_dict(norm.state_dict())
    assert restored.scale == norm.scale
    assert restored.state_dict()["carry"].tolist() == norm.state_dict()["carry"].tolist()


def gae_by_the_book(reward, value, next_value, terminated, done, gamma, gae_lambda):
    """The recursion as Schulman et al. write it, one step at a time, backwards."""
    not_terminated, not_done = (~terminated).to(value.dtype), (~done).to(value.dtype)
    delta = reward + gamma * next_value * not_terminated - value
    advantages, running = torch.empty_like(value), torch.zeros_like(value[0])
    for t in range(value.shape[0] - 1, -1, -1):
        running = delta[t] + gamma * gae_lambda * not_done[t] * running
        advantages[t] = running
    return advantages


@pytest.mark.parametrize("steps,envs", [(1, 1), (2, 3), (7, 2), (512, 1), (512, 32), (1000, 5)])
def test_gae_scan_gives_the_recursions_advantages(steps, envs):
    g = torch.Generator().manual_seed(steps * envs)
    reward, value, next_value = (torch.randn(steps, envs, generator=g, dtype=torch.float64) for _ in range(3))
    done = torch.rand(steps, envs, generator=g) < 0.1
    terminated = done & (torch.rand(steps, envs, generator=g) < 0.5)  # the rest of the dones are truncations
    expected = gae_by_the_book(reward, value, next_value, terminated, done, 0.99, 0.95)
    got = gae(reward, value, next_value, terminated, done, 0.99, 0.95)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    got32 = gae(reward.float(), value.float(), next_value.float(), terminated, done, 0.99, 0.95)
    torch.testing.assert_close(got32, expected.float(), rtol=1e-5, atol=1e-5)
