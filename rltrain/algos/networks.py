"""Network pieces shared by the algorithms: the MLP builder, the PPO actor-critic, SAC's actor and twin critics,
DQN's Q-network."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated

import torch
from torch import nn

from rltrain.algos.encoders import NATURE_CNN, ObsEncoder, orthogonal
from rltrain.algos.heads import LOG_SQRT_2PI, make_head, mask_logits
from rltrain.algos.recurrent import Kind as RecurrentKind
from rltrain.algos.recurrent import RecurrentCore
from rltrain.envs import EnvSpec
from rltrain.envs.spaces import MASK_KEY
from rltrain.rules import Flag, IntegerList, OneOf, PositiveInt

ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "elu": nn.ELU, "gelu": nn.GELU, "silu": nn.SiLU}
Activation = Annotated[str, OneOf(ACTIVATIONS)]
HiddenSizes = Annotated[list[int], IntegerList(note="[] for a single linear layer over the features")]
NON_EMPTY = IntegerList(non_empty=True)  # a trunk that ends in a hidden layer (SAC's actor and critics)
NonEmptyHiddenSizes = Annotated[list[int], NON_EMPTY]


def mlp(in_dim: int, hidden_sizes: list[int], out_dim: int, activation: str, out_gain: float = 1.0) -> nn.Sequential:
    """Linear layers with orthogonal init (gain sqrt(2) inside, ``out_gain`` on the last layer)."""
    layers: list[nn.Module] = []
    sizes = [in_dim, *hidden_sizes]
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [orthogonal(nn.Linear(a, b), math.sqrt(2)), ACTIVATIONS[activation]()]
    layers.append(orthogonal(nn.Linear(sizes[-1], out_dim), out_gain))
    return nn.Sequential(*layers)


def run_layers(seq: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """``seq(x)`` through each layer's ``forward``: the same ops, without nn.Module's call machinery
    (hooks, which rltrain's networks never use). At a collector's batch of 16 observations a
    64x64 actor's forward takes 25 us this way against 35 us called as a module."""
    for layer in seq:
        x = layer.forward(x)
    return x


class ActorCritic(nn.Module):
    """PPO's policy and value networks: an observation encoder, then separate actor and critic MLPs.

    The encoder (``rltrain.algos.encoders``) turns any supported observation into features: with
    vector observations it only normalizes (optionally) and flattens; with images its CNN is
    shared by actor and critic, as in the Nature-DQN / CleanRL Atari agents. The actor's output
    parametrizes the action space's distribution (``rltrain.algos.heads``). Where the observation says which
    actions are valid (a Dict with an ``action_mask`` key), the actor's invalid logits are masked in acting,
    greedy or sampled, and in scoring (log-probs, entropy, so PPO's ratio); the mask is an input feature too.
    With ``recurrent`` (lstm, gru), an LSTM or GRU layer shared by actor and critic sits between the encoder and
    their layers (``rltrain.algos.recurrent``); such a network acts through ``act_in_state``.
    """

    def __init__(
        self,
        env_spec: EnvSpec,
        hidden_sizes: HiddenSizes = (64, 64),
        activation: Activation = "tanh",
        normalize_obs: Flag = False,
        init_log_std: float = 0.0,
        cnn: Mapping = NATURE_CNN,  # image observations: channels, kernels, strides, features (encoders.py)
        recurrent: RecurrentKind = None,  # lstm | gru: a memory between the encoder and the layers above
        recurrent_size: PositiveInt = 128,  # the LSTM's or GRU's units
    ):
        super().__init__()
        self.encoder = ObsEncoder(env_spec.observation, normalize=normalize_obs, cnn=cnn)
        self.head = make_head(env_spec.action, init_log_std)
        self.core = RecurrentCore(recurrent, self.encoder.out_dim, recurrent_size) if recurrent else None
        self.state_size = self.core.state_size if self.core else 0  # floats of memory per env (0: none)
        features = self.core.size if self.core else self.encoder.out_dim
        self.actor = mlp(features, list(hidden_sizes), self.head.out_dim, activation, out_gain=0.01)
        self.critic = mlp(features, list(hidden_sizes), 1, activation, out_gain=1.0)
        self.masked = env_spec.masked

    def value(self, obs) -> torch.Tensor:
        return run_layers(self.critic, self.encoder.forward(obs)).squeeze(-1)

    def act(self, obs, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample an action (or take the mode) and return it with its log-probability."""
        if self.core is not None:
            raise TypeError("a network with memory (recurrent) acts with act_in_state(obs, state)")
        return self._sample(obs, self.encoder.forward(obs), deterministic)

    def initial_state(self, n: int) -> torch.Tensor:
        """``[n, state_size]``: the memory of ``n`` envs at the start of their episodes (zeros)."""
        return self.core.initial_state(n, next(self.parameters()).device)

    def act_in_state(self, obs, state: torch.Tensor,
                     deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``act`` for a network with memory: from each env's ``state`` (``[N, state_size]``, zeros where an episode
        starts); returns the action, its log-probability and the state the next step starts from."""
        features, state = self.core.step(self.encoder.forward(obs), state)
        return (*self._sample(obs, features, deterministic), state)

    def value_in_state(self, obs, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The state value of ``obs`` seen from ``state``, and the state after that step."""
        features, state = self.core.step(self.encoder.forward(obs), state)
        return run_layers(self.critic, features).squeeze(-1), state

    def evaluate(self, obs, action: torch.Tensor, state: torch.Tensor | None = None,
                 starts: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """Log-probability of ``action``, the policy's entropy and the state value, for the update. With memory:
        ``obs`` and ``action`` are sequences ``[L, B, ...]`` that start from ``state`` (``[B, state_size]``) and
        reset where ``starts`` (``[L, B]``) is true; the results are ``[L, B]``."""
        features = self.encoder.forward(obs)
        if self.core is not None:
            features = self.core.unroll(features, state, starts)
        logits = run_layers(self.actor, features)
        if self.masked:
            logits = mask_logits(logits, obs[MASK_KEY])
        log_prob, entropy = self.head.evaluate(logits, action)
        return log_prob, entropy, run_layers(self.critic, features).squeeze(-1)

    def _sample(self, obs, features: torch.Tensor, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
        logits = run_layers(self.actor, features)
        if self.masked:  # (a mask that allows nothing is refused where the env gave it: Rollout, the eval hook)
            logits = mask_logits(logits, obs[MASK_KEY])
        return self.head.sample(logits, deterministic)


class SquashedGaussianActor(nn.Module):
    """SAC's policy: a Gaussian squashed by tanh and scaled to the env's action box.

    ``act`` is what collectors call (no gradients); ``sample`` is the reparameterized draw the
    learner differentiates through. While the ``uniform`` buffer is set (SAC's warm-up), ``act``
    draws uniformly from the box: the flag is a buffer, so it reaches collectors with the weights.
    """

    LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0

    def __init__(self, env_spec: EnvSpec, hidden_sizes: NonEmptyHiddenSizes = (256, 256),
                 activation: Activation = "relu", normalize_obs: Flag = False):
        super().__init__()
        if env_spec.action.kind != "box":
            raise ValueError("SquashedGaussianActor needs a Box action space")
        NON_EMPTY.check("algo.network.hidden_sizes", hidden_sizes)  # its trunk ends in a hidden layer
        act_dim = math.prod(env_spec.action_shape)
        self.action_shape = env_spec.action_shape
        # Parameter-free (no images: validate refuses them for SAC), so the critics read the same features.
        self.encoder = ObsEncoder(env_spec.observation, normalize=normalize_obs)
        if self.encoder.has_parameters:
            raise ValueError("SquashedGaussianActor takes vector, discrete and Dict-of-those observations, not images")
        self.trunk = mlp(self.encoder.out_dim, list(hidden_sizes)[:-1], list(hidden_sizes)[-1], activation)
        self.trunk.append(ACTIVATIONS[activation]())
        self.head = nn.Linear(list(hidden_sizes)[-1], 2 * act_dim)
        low, high = torch.as_tensor(env_spec.action_low), torch.as_tensor(env_spec.action_high)
        self.register_buffer("action_scale", ((high - low) / 2).flatten())
        self.register_buffer("action_bias", ((high + low) / 2).flatten())
        self.register_buffer("uniform", torch.tensor(True))

    def mean_log_std(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean, log_std = self.head.forward(run_layers(self.trunk, self.encoder.forward(obs))).chunk(2, -1)
        log_std = self.LOG_STD_MIN + 0.5 * (self.LOG_STD_MAX - self.LOG_STD_MIN) * (torch.tanh(log_std) + 1)
        return mean, log_std

    def sample(self, obs: torch.Tensor, deterministic: bool = False,
               noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A reparameterized action (env scale) and its log-probability, tanh change of variables included.
        ``noise``: the standard normal draw to use (default: a fresh one)."""
        mean, log_std = self.mean_log_std(obs)
        if noise is None and not deterministic:
            noise = torch.randn_like(mean)
        u = mean if deterministic else mean + log_std.exp() * noise
        squashed = torch.tanh(u)
        z = (u - mean) * torch.exp(-log_std)
        log_prob = (-0.5 * z.square() - log_std - LOG_SQRT_2PI).sum(-1)
        # d tanh(u)/du = 1 - tanh(u)^2, written stably: 2 (log 2 - u - softplus(-2u)).
        log_prob = log_prob - (2 * (math.log(2) - u - nn.functional.softplus(-2 * u))).sum(-1)
        log_prob = log_prob - torch.log(self.action_scale).sum()
        action = squashed * self.action_scale + self.action_bias
        return action.reshape(*action.shape[:-1], *self.action_shape), log_prob

    def act(self, obs: torch.Tensor, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        if not deterministic and self.uniform:  # (a GPU learner's evaluation reads no flag from the device)
            u = torch.rand(*self.encoder.batch_shape(obs), self.action_scale.numel())
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


# Ape-X's exploration ladder (Horgan et al. 2018): actor i of N explores with epsilon base ** (1 + alpha * i / (N - 1)).
# rltrain puts the env seeded s (seed + k for env k of the job) at rung frac(s * golden ratio) instead of k / (N - 1):
# the N consecutive seeds of one job then cover the ladder evenly without knowing N, on any collector and any rank.
GOLDEN = (math.sqrt(5) - 1) / 2


class QNetwork(nn.Module):
    """DQN's policy: an observation encoder (the Nature CNN for images), then an MLP giving every action's Q-value;
    with ``dueling``, a state-value and an advantage stream, Q = V + A - mean(A) (Wang et al. 2016).

    Acting is epsilon-greedy. The exploration rates are buffers, so they reach collectors with the weights:
    ``epsilon`` (the learner's schedule) and, for Ape-X's per-env rates, ``ladder`` = (base, alpha): env k explores
    with ``max(epsilon, base ** (1 + alpha * frac(k * 0.618...)))``; base 0 turns the ladder off. Where the
    observation says which actions are valid (``action_mask``), greedy and random actions are both valid ones.
    """

    ACTS_PER_ENV = True  # act() takes each row's env index (``envs``): the Ape-X ladder's rung

    def __init__(self, env_spec: EnvSpec, hidden_sizes: HiddenSizes = (64, 64), activation: Activation = "relu",
                 normalize_obs: Flag = False, cnn: Mapping = NATURE_CNN, dueling: Flag = False):
        super().__init__()
        if env_spec.action.kind != "discrete":
            raise ValueError("QNetwork needs a Discrete action space")
        self.encoder = ObsEncoder(env_spec.observation, normalize=normalize_obs, cnn=cnn)
        self.n = env_spec.action.nvec[0]
        self.dueling = dueling
        if dueling:
            self.value = mlp(self.encoder.out_dim, list(hidden_sizes), 1, activation)
        self.q = mlp(self.encoder.out_dim, list(hidden_sizes), self.n, activation)  # (dueling: the advantages)
        self.masked = env_spec.masked
        self.register_buffer("epsilon", torch.tensor(1.0))
        self.register_buffer("ladder", torch.zeros(2))

    def forward(self, obs) -> torch.Tensor:
        """``[*batch, n]``: every action's Q-value; an invalid action's is the dtype's lowest."""
        features = self.encoder.forward(obs)
        q = run_layers(self.q, features)
        if self.dueling:
            q = run_layers(self.value, features) + q - q.mean(-1, keepdim=True)
        return mask_logits(q, obs[MASK_KEY]) if self.masked else q

    def exploration(self, envs: torch.Tensor) -> torch.Tensor:
        """Each env's chance of a random action: the schedule's ``epsilon``, or its rung of the ladder if higher."""
        base, alpha = self.ladder.tolist()
        if base <= 0:
            return self.epsilon.expand(envs.shape)
        rung = torch.frac(envs.double() * GOLDEN).float()
        return torch.maximum(self.epsilon, base ** (1 + alpha * rung))

    def act(self, obs, deterministic: bool = False,
            envs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The greedy action, or (unless ``deterministic``) with each env's exploration rate a uniformly random valid
        one; and its log-probability under that epsilon-greedy distribution. ``envs``: the rows' env indices
        (default: the row numbers)."""
        q = self.forward(obs)
        greedy = q.argmax(-1)
        if deterministic:
            return greedy, torch.zeros_like(greedy, dtype=q.dtype)
        valid = (obs[MASK_KEY] != 0) if self.masked else torch.ones_like(q, dtype=torch.bool)
        # A uniform draw among the valid actions: Gumbel-max over equal logits, -inf where invalid.
        noise = torch.empty_like(q).exponential_().log().neg().masked_fill(~valid, -math.inf)
        random_action = noise.argmax(-1)
        rows = torch.arange(greedy.numel()) if envs is None else envs
        epsilon = self.exploration(rows.to(q.device)).reshape(greedy.shape)  # (an eval on a GPU learner: there)
        explore = torch.rand(greedy.shape, device=q.device) < epsilon
        action = torch.where(explore, random_action, greedy)
        n_valid = valid.sum(-1)
        prob = epsilon / n_valid + (1 - epsilon) * (action == greedy)
        return action, prob.log()
