"""Learner-side data structures: the replay buffer."""

from rltrain.data.replay import ReplayBuffer

__all__ = ["ReplayBuffer"]
