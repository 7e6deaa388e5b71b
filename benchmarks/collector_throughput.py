"""Collection speed on CartPole-v1: a raw single-process gymnasium random-action loop against
rltrain's LocalCollector acting with a 64x64 MLP policy, side by side in one run.

    python benchmarks/collector_throughput.py [--seconds 5]
"""

from __future__ import annotations

import argparse
import time

import gymnasium as gym
import torch

from rltrain.algos import ActorCritic
from rltrain.envs import BatchedEnv
from rltrain.sync import SharedMemSync


def raw_gymnasium_fps(seconds: float) -> float:
    """The usual hand-written loop: gym.make defaults, random actions, reset on episode end."""
    env = gym.make("CartPole-v1")
    env.reset(seed=0)
    env.action_space.seed(0)
    frames, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(1000):
            _, _, terminated, truncated, _ = env.step(env.action_space.sample())
            if terminated or truncated:
                env.reset()
        frames += 1000
    return frames / (time.perf_counter() - t0)


def collector_fps(num_envs: int, frames_per_batch: int, seconds: float) -> float:
    from rltrain.collectors import LocalCollector  # here, not at the top: see collector_scaling.py

    env = BatchedEnv("CartPole-v1", num_envs=num_envs, seed=0)
    policy = ActorCritic(env.spec, hidden_sizes=[64, 64])
    scheme = SharedMemSync()
    scheme.sender(policy)
    batches = iter(LocalCollector(lambda: env, lambda: policy, scheme.receiver, frames_per_batch=frames_per_batch))
    next(batches)  # warm-up
    frames, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        frames += next(batches).numel()
    return frames / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as `threads: 1` in rltrain/configs/config.yaml
    raw = raw_gymnasium_fps(args.seconds)
    rows = [("raw gymnasium loop (1 env, random actions)", raw)]
    for num_envs, batch in [(8, 256), (16, 512), (32, 1024)]:
        default = " (default)" if num_envs == 16 else ""
        rows.append((f"rltrain LocalCollector, {num_envs} envs, batch {batch}{default}",
                     collector_fps(num_envs, batch, args.seconds)))
    print(f"\nCartPole-v1 collection, 64x64 MLP policy, {args.seconds:.0f} s each, torch threads 1")
    print(f"{'':58} {'frames/s':>10} {'x raw':>7}")
    for name, fps in rows:
        print(f"{name:58} {fps:10,.0f} {fps / raw:7.2f}")
    print("\ntarget: the default LocalCollector (env=cartpole: 16 envs) >= 0.5x the raw loop")


if __name__ == "__main__":
    main()
