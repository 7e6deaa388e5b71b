"""``collector=local``: steps a batched env in the trainer's process with its own policy copy.

The copy is fed only through the weight-sync receiver, at the start of each batch, exactly as a
worker process would be: the learner's optimizer never touches the weights that act.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from tensordict import TensorDict
from torch import nn

from rltrain.algos.recurrent import state_size
from rltrain.collectors.batch import as_batch, batch_steps
from rltrain.collectors.rollout import Rollout, allocate_frames
from rltrain.envs.batched import BatchedEnv
from rltrain.protocols import Collector
from rltrain.rules import PositiveInt
from rltrain.sync.base import WeightReceiver


class LocalCollector(Collector):
    """Yields ``[T, N]`` TensorDict batches of ``frames_per_batch = T * env.num_envs`` frames, forever.

    Keys: ``observation``, ``action``, ``log_prob``, ``reward``, ``terminated``, ``truncated``,
    ``done``, ``("next", "observation")`` (the true final observation where an episode ended),
    ``episode_return`` / ``episode_length`` (running totals, final where ``done``), and
    ``policy_version`` (the weights version that chose the action); with a policy that has memory,
    ``recurrent_state`` (the state each action was chosen from).
    """

    BATCH_ENVS = ("env.num_envs",)  # the envs one batch spans: frames_per_batch must be a multiple
    IN_LEARNER_PROCESS = True
    RANK_SPLIT = ("env.num_envs",)  # strategy=ddp: each rank steps its share of the envs

    def __init__(
        self,
        make_env: Callable[..., BatchedEnv],
        make_policy: Callable[[], nn.Module],
        make_receiver: Callable[[], WeightReceiver],
        frames_per_batch: PositiveInt,
    ):
        self.env = make_env()
        try:
            self._steps = batch_steps(frames_per_batch, self.env.num_envs, " x ".join(self.BATCH_ENVS))
            self.frames_per_batch = frames_per_batch
            self.policy = make_policy()
            self.receiver = make_receiver()
            self.receiver.connect(self.policy)
        except BaseException:
            self.env.close()
            raise
        self._rollout = Rollout(self.env, self.policy, self.receiver)
        self._state_size = state_size(self.policy)

    def __iter__(self) -> Iterator[TensorDict]:
        while True:
            frames = allocate_frames(self.env.spec, self._steps, self.env.num_envs, state_size=self._state_size)
            self._rollout.collect({k: v.numpy() for k, v in frames.items()})
            yield as_batch(frames)

    def state_dict(self) -> dict | None:
        """The envs mid-episode (None for envs whose state cannot be saved; they restart on resume)."""
        return self._rollout.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._rollout.load_state_dict(state)

    def close(self) -> None:
        self.receiver.close()
        self.env.close()
