"""The hand-written distributions and statistics agree with torch/numpy references."""

from __future__ import annotations

import numpy as np
import torch
from torch.distributions import Categorical, Normal

from rltrain.algos import ActorCritic
from rltrain.envs import BatchedEnv, ObsNormalizer


def test_gaussian_log_prob_and_entropy_match_torch_distributions():
    spec = BatchedEnv("Pendulum-v1", num_envs=1).spec
    policy = ActorCritic(spec, init_log_std=-0.3)
    obs = torch.randn(64, 3)
    action, log_prob = policy.act(obs)
    mean = policy.actor(obs)
    reference = Normal(mean, policy.log_std.exp())
    torch.testing.assert_close(log_prob, reference.log_prob(action).sum(-1))
    new_log_prob, entropy, _ = policy.evaluate(obs, action)
    torch.testing.assert_close(new_log_prob, log_prob)
    torch.testing.assert_close(entropy, reference.entropy().sum(-1))


def test_categorical_sampling_log_prob_and_entropy_match_torch_distributions():
    spec = BatchedEnv("CartPole-v1", num_envs=1).spec
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
