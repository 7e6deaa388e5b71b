"""``collector=local``: steps a batched env in the trainer's process with its own policy copy.

The copy is fed only through the weight-sync receiver, at the start of each batch, exactly as a
worker process would be: the learner's optimizer never touches the weights that act.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from tensordict import TensorDict
from torch import nn

from rltrain.envs import BatchedEnv
from rltrain.sync import WeightReceiver


class LocalCollector:
    """Yields ``[T, N]`` TensorDict batches of ``frames_per_batch = T * N`` frames, forever.

    Keys: ``observation``, ``action``, ``log_prob``, ``reward``, ``terminated``, ``truncated``,
    ``done``, ``("next", "observation")`` (the true final observation where an episode ended),
    ``episode_return`` / ``episode_length`` (running totals, final where ``done``), and
    ``policy_version`` (the weights version that chose the action).
    """

    def __init__(self, env: BatchedEnv, policy: nn.Module, receiver: WeightReceiver, frames_per_batch: int):
        if frames_per_batch % env.num_envs:
            raise ValueError(f"frames_per_batch ({frames_per_batch}) must be a multiple of num_envs ({env.num_envs})")
        self.env, self.policy, self.receiver = env, policy, receiver
        self.frames_per_batch = frames_per_batch
        self.steps_per_batch = frames_per_batch // env.num_envs
        self.receiver.connect(policy)

    def __iter__(self) -> Iterator[TensorDict]:
        env, policy, spec = self.env, self.policy, self.env.spec
        T, N = self.steps_per_batch, env.num_envs
        obs = env.reset().copy()
        ep_return = np.zeros(N, dtype=np.float32)
        ep_length = np.zeros(N, dtype=np.int64)
        action_dtype = np.int64 if spec.discrete else np.float32
        while True:
            self.receiver.poll()  # the only moment new weights may arrive: between batches
            version = self.receiver.version
            b_obs = np.empty((T, N, *spec.obs_shape), dtype=np.float32)
            b_next_obs = np.empty_like(b_obs)
            b_action = np.empty((T, N, *spec.action_shape), dtype=action_dtype)
            b_log_prob = np.empty((T, N), dtype=np.float32)
            b_reward = np.empty((T, N), dtype=np.float32)
            b_terminated = np.empty((T, N), dtype=bool)
            b_truncated = np.empty((T, N), dtype=bool)
            b_ep_return = np.empty((T, N), dtype=np.float32)
            b_ep_length = np.empty((T, N), dtype=np.int64)
            with torch.inference_mode():
                for t in range(T):
                    b_obs[t] = obs
                    action, log_prob = policy.act(torch.from_numpy(b_obs[t]))
                    b_action[t] = action.numpy()
                    b_log_prob[t] = log_prob.numpy()
                    next_obs, reward, terminated, truncated, obs = env.step(b_action[t])
                    b_next_obs[t], b_reward[t] = next_obs, reward
                    b_terminated[t], b_truncated[t] = terminated, truncated
                    ep_return += reward
                    ep_length += 1
                    b_ep_return[t], b_ep_length[t] = ep_return, ep_length
                    done = terminated | truncated
                    ep_return[done] = 0.0
                    ep_length[done] = 0
            yield TensorDict(
                {
                    "observation": torch.from_numpy(b_obs),
                    "action": torch.from_numpy(b_action),
                    "log_prob": torch.from_numpy(b_log_prob),
                    "reward": torch.from_numpy(b_reward),
                    "terminated": torch.from_numpy(b_terminated),
                    "truncated": torch.from_numpy(b_truncated),
                    "done": torch.from_numpy(b_terminated | b_truncated),
                    "episode_return": torch.from_numpy(b_ep_return),
                    "episode_length": torch.from_numpy(b_ep_length),
                    "policy_version": torch.full((T, N), version, dtype=torch.int64),
                    "next": {"observation": torch.from_numpy(b_next_obs)},
                },
                batch_size=[T, N],
            )

    def close(self) -> None:
        self.receiver.close()
        self.env.close()
