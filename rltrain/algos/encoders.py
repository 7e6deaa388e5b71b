"""Observations to flat float features: the part of a network that depends on the observation space.

One part per observation leaf (see ``rltrain.envs.spaces``), concatenated for a Dict observation:
- vectors: cast to float, optionally normalized by running statistics, flattened;
- discrete / multi-discrete indices: one-hot;
- images (uint8 or bool, [H, W], [C, H, W] or [H, W, C]): a CNN, by default the Nature-DQN one
  (Mnih et al. 2015: 32-64-64 channels, 8-4-3 kernels, 4-2-1 strides, then 512 features). uint8
  pixels are stored and sent as uint8 and scaled to [0, 1] here, on the learner's side.

Only images have parameters: with vector observations the encoder is a fixed function, and each
network that reads it keeps its own layers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType

import torch
from torch import nn

from rltrain.algos.normalization import Moments, ObsNormalizer, local_moments
from rltrain.envs import Leaf
from rltrain.envs.spaces import Observation
from rltrain.errors import ConfigError

# The Nature-DQN CNN (read-only: it is the default of every network that takes a ``cnn``).
NATURE_CNN = MappingProxyType({"channels": (32, 64, 64), "kernels": (8, 4, 3), "strides": (4, 2, 1), "features": 512})


class ObsEncoder(nn.Module):
    """``forward(obs)`` -> ``[*batch, out_dim]`` features; ``obs`` is a tensor, or a mapping of
    tensors (a dict or a TensorDict) for a Dict observation."""

    def __init__(self, observation: Observation, normalize: bool = False, cnn: Mapping | None = None):
        super().__init__()
        self.single = isinstance(observation, Leaf)
        leaves = {"observation": observation} if self.single else dict(observation)
        self.parts = nn.ModuleDict({key: _part(key, leaf, normalize, {**NATURE_CNN, **(cnn or {})})
                                    for key, leaf in leaves.items()})
        self.out_dim = sum(part.out_dim for part in self.parts.values())
        self._keys = list(leaves)
        self._first_dims = len(leaves[self._keys[0]].shape)
        self.has_parameters = any(True for _ in self.parameters())  # a CNN; vectors only need buffers

    def forward(self, obs) -> torch.Tensor:
        if self.single:
            return self.parts["observation"].forward(obs)
        return torch.cat([self.parts[key].forward(obs[key]) for key in self._keys], -1)

    @torch.no_grad()
    def update(self, obs, moments: Moments = local_moments) -> None:
        """Fold a batch of observations into the running statistics of normalized vector parts
        (``moments``: how the batch is measured; ``ObsNormalizer.update``)."""
        for key, part in self.parts.items():
            if isinstance(part, VectorPart):
                part.norm.update(obs if self.single else obs[key], moments)

    def batch_shape(self, obs) -> torch.Size:
        """The batch dims of ``obs`` (those before each leaf's own shape)."""
        first = obs if self.single else obs[self._keys[0]]
        return first.shape[: first.dim() - self._first_dims]


def _part(key: str, leaf: Leaf, normalize: bool, cnn: dict) -> nn.Module:
    if leaf.kind == "image":
        return ImagePart(key, leaf, **cnn)
    if leaf.kind in ("discrete", "multi_discrete"):
        return OneHotPart(leaf)
    return VectorPart(leaf, normalize)


class VectorPart(nn.Module):
    kind = "vector"

    def __init__(self, leaf: Leaf, normalize: bool):
        super().__init__()
        self.norm = ObsNormalizer(leaf.shape, enabled=normalize)
        self.dims = len(leaf.shape)
        self.out_dim = max(leaf.numel, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm.forward(x if x.dtype == torch.float32 else x.float())
        return x.unsqueeze(-1) if self.dims == 0 else x.flatten(-self.dims) if self.dims > 1 else x


class OneHotPart(nn.Module):
    """Indices as one-hot vectors: n for a Discrete leaf, sum(nvec) for a MultiDiscrete one."""

    kind = "discrete"

    def __init__(self, leaf: Leaf):
        super().__init__()
        self.out_dim = sum(leaf.nvec)
        self.multi = leaf.kind == "multi_discrete"
        offsets = torch.tensor([0, *leaf.nvec[:-1]]).cumsum(0) if self.multi else torch.zeros(())
        self.register_buffer("offsets", offsets.long(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hot = nn.functional.one_hot(x.long() + self.offsets, self.out_dim).float()
        return hot.sum(-2) if self.multi else hot


class ImagePart(nn.Module):
    """A CNN over one image leaf: ReLU convs, flattened, then a ReLU linear layer of ``features``."""

    kind = "image"

    def __init__(self, key: str, leaf: Leaf, channels: list[int], kernels: list[int], strides: list[int],
                 features: int):
        super().__init__()
        where = "algo.network.cnn"
        if not len(channels) == len(kernels) == len(strides) or not channels:
            raise ConfigError(f"{where}: channels, kernels and strides need one entry per conv layer, and at least "
                              f"one (got {len(channels)}, {len(kernels)} and {len(strides)})")
        shape = leaf.shape
        if len(shape) == 2:
            self.layout, (c, h, w) = "hw", (1, *shape)
        elif min(shape) == shape[0]:
            self.layout, (c, h, w) = "chw", shape
        else:
            self.layout, (h, w, c) = "hwc", shape
        self.scale = 1 / 255 if leaf.dtype == "uint8" else 1.0
        layers: list[nn.Module] = []
        for out, k, s in zip(channels, kernels, strides):
            if h < k or w < k:
                raise ConfigError(
                    f"the {key!r} image ({' x '.join(map(str, shape))}, read as {c} channels of {h} x {w}) is too "
                    f"small for {where} (kernels {list(kernels)}, strides {list(strides)}): a {k} x {k} kernel meets "
                    f"{h} x {w}. For small images set smaller convs, e.g. {where}.channels=[16] "
                    f"{where}.kernels=[3] {where}.strides=[1] (MinAtar's network)")
            layers += [orthogonal(nn.Conv2d(c, out, k, s)), nn.ReLU()]
            c, h, w = out, (h - k) // s + 1, (w - k) // s + 1
        layers += [nn.Flatten(), orthogonal(nn.Linear(c * h * w, features)), nn.ReLU()]
        self.net = nn.Sequential(*layers)
        self.out_dim = features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = x.shape[: x.dim() - (2 if self.layout == "hw" else 3)]
        x = x.reshape(-1, *x.shape[len(batch):]).float()
        if self.scale != 1.0:
            x = x.mul_(self.scale)
        if self.layout == "hw":
            x = x.unsqueeze(1)
        elif self.layout == "hwc":
            x = x.permute(0, 3, 1, 2)
        return self.net(x).reshape(*batch, self.out_dim)


def orthogonal(layer: nn.Module, gain: float = math.sqrt(2)) -> nn.Module:
    """Orthogonal weights of ``gain``, zero biases (the init of PPO's and DQN's reference agents)."""
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer
