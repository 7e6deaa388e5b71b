"""Learning algorithms: each owns its optimizer(s) and turns collector batches into updates."""

from rltrain.algos.networks import ActorCritic
from rltrain.algos.ppo import PPO

__all__ = ["PPO", "ActorCritic"]
