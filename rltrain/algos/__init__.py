"""Learning algorithms: each owns its optimizer(s) and turns collector batches into updates."""

from rltrain.algos.grpo import GRPO
from rltrain.algos.networks import ActorCritic, SquashedGaussianActor, TwinQ
from rltrain.algos.ppo import PPO
from rltrain.algos.sac import SAC

__all__ = ["GRPO", "PPO", "SAC", "ActorCritic", "SquashedGaussianActor", "TwinQ"]
