"""Learning algorithms: each owns its optimizer(s) and turns collector batches into updates."""

from rltrain.algos.dqn import DQN
from rltrain.algos.grpo import GRPO
from rltrain.algos.networks import ActorCritic, QNetwork, SquashedGaussianActor, TwinQ
from rltrain.algos.ppo import PPO
from rltrain.algos.sac import SAC

__all__ = ["DQN", "GRPO", "PPO", "SAC", "ActorCritic", "QNetwork", "SquashedGaussianActor", "TwinQ"]
