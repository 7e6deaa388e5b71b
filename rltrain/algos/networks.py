"""Network pieces shared by the algorithms: the MLP builder and the PPO actor-critic.

Action sampling and log-probabilities are written out by hand rather than through
torch.distributions: a collector calls them once per env step, where the distribution objects'
construction and argument checks would cost more than the network itself.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from rltrain.envs import EnvSpec, ObsNormalizer

ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "elu": nn.ELU, "gelu": nn.GELU, "silu": nn.SiLU}
_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def mlp(in_dim: int, hidden_sizes: list[int], out_dim: int, activation: str, out_gain: float = 1.0) -> nn.Sequential:
    """Linear layers with orthogonal init (gain sqrt(2) inside, ``out_gain`` on the last layer)."""
    layers: list[nn.Module] = []
    sizes = [in_dim, *hidden_sizes]
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [_orthogonal(nn.Linear(a, b), math.sqrt(2)), ACTIVATIONS[activation]()]
    layers.append(_orthogonal(nn.Linear(sizes[-1], out_dim), out_gain))
    return nn.Sequential(*layers)


def _orthogonal(layer: nn.Linear, gain: float) -> nn.Linear:
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


class ActorCritic(nn.Module):
    """Separate actor and critic MLPs over (optionally normalized) flat observations.

    Discrete actions: a categorical over logits. Box actions: a diagonal Gaussian with a
    state-independent log-std; the env clips the sampled action to its bounds.
    """

    def __init__(
        self,
        env_spec: EnvSpec,
        hidden_sizes: list[int] = (64, 64),
        activation: str = "tanh",
        normalize_obs: bool = False,
        init_log_std: float = 0.0,
    ):
        super().__init__()
        obs_dim = math.prod(env_spec.obs_shape)
        self.discrete = env_spec.discrete
        act_dim = env_spec.num_actions if self.discrete else math.prod(env_spec.action_shape)
        self.action_shape = env_spec.action_shape
        self.obs_norm = ObsNormalizer(env_spec.obs_shape, enabled=normalize_obs)
        self.actor = mlp(obs_dim, list(hidden_sizes), act_dim, activation, out_gain=0.01)
        self.critic = mlp(obs_dim, list(hidden_sizes), 1, activation, out_gain=1.0)
        if not self.discrete:
            self.log_std = nn.Parameter(torch.full((act_dim,), float(init_log_std)))

    def _features(self, obs: torch.Tensor) -> torch.Tensor:
        return self.obs_norm(obs).flatten(-len(self.obs_norm.mean.shape))

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(self._features(obs)).squeeze(-1)

    def act(self, obs: torch.Tensor, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample an action (or take the mode) and return it with its log-probability."""
        out = self.actor(self._features(obs))
        if self.discrete:
            logp_all = torch.log_softmax(out, -1)
            if deterministic:
                action = out.argmax(-1)
            else:  # Gumbel-max: argmax(logits + Gumbel noise) is a categorical sample.
                action = (out - torch.empty_like(out).exponential_().log()).argmax(-1)
            return action, logp_all.gather(-1, action.unsqueeze(-1)).squeeze(-1)
        action = out if deterministic else out + self.log_std.exp() * torch.randn_like(out)
        return action.reshape(*out.shape[:-1], *self.action_shape), self._gaussian_log_prob(out, action)

    def evaluate(self, obs: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Log-probability of ``action``, the policy's entropy and the state value, for the update."""
        features = self._features(obs)
        out = self.actor(features)
        value = self.critic(features).squeeze(-1)
        if self.discrete:
            logp_all = torch.log_softmax(out, -1)
            log_prob = logp_all.gather(-1, action.long().unsqueeze(-1)).squeeze(-1)
            entropy = -(logp_all.exp() * logp_all).sum(-1)
            return log_prob, entropy, value
        action = action.reshape(out.shape)
        entropy = (self.log_std + 0.5 + _LOG_SQRT_2PI).sum().expand(out.shape[:-1])
        return self._gaussian_log_prob(out, action), entropy, value

    def _gaussian_log_prob(self, mean: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        z = (action - mean) * torch.exp(-self.log_std)
        return (-0.5 * z.square() - self.log_std - _LOG_SQRT_2PI).sum(-1)


class SquashedGaussianActor(nn.Module):
    """SAC's policy: a Gaussian squashed by tanh and scaled to the env's action box.

    ``act`` is what collectors call (no gradients); ``sample`` is the reparameterized draw the
    learner differentiates through. While the ``uniform`` buffer is set (SAC's warm-up), ``act``
    draws uniformly from the box: the flag is a buffer, so it reaches collectors with the weights.
    """

    LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0

    def __init__(self, env_spec: EnvSpec, hidden_sizes: list[int] = (256, 256), activation: str = "relu",
                 normalize_obs: bool = False):
        super().__init__()
        if env_spec.discrete:
            raise ValueError("SquashedGaussianActor needs a Box action space")
        act_dim = math.prod(env_spec.action_shape)
        self.action_shape = env_spec.action_shape
        self.obs_norm = ObsNormalizer(env_spec.obs_shape, enabled=normalize_obs)
        self.trunk = mlp(math.prod(env_spec.obs_shape), list(hidden_sizes)[:-1], list(hidden_sizes)[-1], activation)
        self.trunk.append(ACTIVATIONS[activation]())
        self.head = nn.Linear(list(hidden_sizes)[-1], 2 * act_dim)
        low, high = torch.as_tensor(env_spec.action_low), torch.as_tensor(env_spec.action_high)
        self.register_buffer("action_scale", ((high - low) / 2).flatten())
        self.register_buffer("action_bias", ((high + low) / 2).flatten())
        self.register_buffer("uniform", torch.tensor(True))

    def _mean_log_std(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.obs_norm(obs).flatten(-len(self.obs_norm.mean.shape))
        mean, log_std = self.head(self.trunk(features)).chunk(2, -1)
        log_std = self.LOG_STD_MIN + 0.5 * (self.LOG_STD_MAX - self.LOG_STD_MIN) * (torch.tanh(log_std) + 1)
        return mean, log_std

    def sample(self, obs: torch.Tensor, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """A reparameterized action (env scale) and its log-probability, tanh change of variables included."""
        mean, log_std = self._mean_log_std(obs)
        u = mean if deterministic else mean + log_std.exp() * torch.randn_like(mean)
        squashed = torch.tanh(u)
        z = (u - mean) * torch.exp(-log_std)
        log_prob = (-0.5 * z.square() - log_std - _LOG_SQRT_2PI).sum(-1)
        # d tanh(u)/du = 1 - tanh(u)^2, written stably: 2 (log 2 - u - softplus(-2u)).
        log_prob = log_prob - (2 * (math.log(2) - u - nn.functional.softplus(-2 * u))).sum(-1)
        log_prob = log_prob - torch.log(self.action_scale).sum()
        action = squashed * self.action_scale + self.action_bias
        return action.reshape(*action.shape[:-1], *self.action_shape), log_prob

    def act(self, obs: torch.Tensor, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        if self.uniform and not deterministic:
            u = torch.rand(*obs.shape[: obs.dim() - len(self.obs_norm.mean.shape)], self.action_scale.numel())
            action = (2 * u - 1) * self.action_scale + self.action_bias
            log_prob = torch.full(action.shape[:-1], -float(torch.log(2 * self.action_scale).sum()))
            return action.reshape(*action.shape[:-1], *self.action_shape), log_prob
        return self.sample(obs, deterministic)


class TwinQ(nn.Module):
    """``n`` Q-networks over (observation, action) evaluated in one batched matmul per layer.

    Parameters are stacked along a leading critic dim, so the twin critics cost one forward and one
    backward instead of two; ``forward`` returns ``[n, batch]``.
    """

    def __init__(self, obs_dim: int, act_dim: int, hidden_sizes: list[int] = (256, 256), n: int = 2,
                 activation: str = "relu"):
        super().__init__()
        sizes = [obs_dim + act_dim, *hidden_sizes, 1]
        self.weights = nn.ParameterList()
        self.biases = nn.ParameterList()
        for a, b in zip(sizes[:-1], sizes[1:]):
            w = torch.empty(n, a, b)
            for i in range(n):  # the same init as an nn.Linear(a, b), per critic
                layer = nn.Linear(a, b)
                w[i] = layer.weight.detach().T
            self.weights.append(nn.Parameter(w))
            self.biases.append(nn.Parameter(torch.zeros(n, 1, b).uniform_(-1 / math.sqrt(a), 1 / math.sqrt(a))))
        self.activation = ACTIVATIONS[activation]()
        self.n = n

    def forward(self, obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        x = torch.cat([obs, action], -1).unsqueeze(0).expand(self.n, -1, -1)
        last = len(self.weights) - 1
        for i, (w, b) in enumerate(zip(self.weights, self.biases)):
            x = torch.baddbmm(b, x, w)
            if i < last:
                x = self.activation(x)
        return x.squeeze(-1)
