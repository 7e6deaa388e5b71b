"""stable-baselines3 SAC on HalfCheetah-v5 with RL-Zoo's settings (256x256 networks, batch 256, lr 3e-4,
10k random frames, one gradient step per frame, alpha autotuned), one CPU thread. Scores 10
deterministic episodes at the end and the mean return of its last 10 training episodes; prints
one JSON line. Run by the learning category as a whole process.
"""

import argparse
import json
import time

import gymnasium as gym
import numpy as np
import torch
from stable_baselines3 import SAC
from stable_baselines3.common.evaluation import evaluate_policy


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--frames", type=int, default=100_000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = SAC("MlpPolicy", "HalfCheetah-v5", learning_starts=10_000, batch_size=256, learning_rate=3e-4,
                train_freq=1, gradient_steps=1, seed=args.seed, device="cpu", verbose=0,
                policy_kwargs={"net_arch": [256, 256]})
    t0 = time.perf_counter()
    model.learn(args.frames)
    learn_s = time.perf_counter() - t0
    train_return = float(np.mean([e["r"] for e in list(model.ep_info_buffer)[-10:]]))
    eval_return, _ = evaluate_policy(model, gym.make("HalfCheetah-v5"), n_eval_episodes=10, deterministic=True)
    print(json.dumps({"eval_return": float(eval_return), "train_return": train_return, "learn_s": learn_s}))


if __name__ == "__main__":
    main()
