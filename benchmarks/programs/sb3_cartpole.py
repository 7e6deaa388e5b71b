"""stable-baselines3 PPO on CartPole-v1 with RL-Zoo's tuned hyperparameters, stopping at the
same rule as rltrain (mean of the last 10 training episodes >= 475). Prints one JSON line.

Run by the end_to_end category as a whole process; alone: python benchmarks/programs/sb3_cartpole.py --seed 0
"""

import argparse
import time

t_start = time.perf_counter()

from stable_baselines3 import PPO  # noqa: E402
from stable_baselines3.common.env_util import make_vec_env  # noqa: E402
from stop_at_return import learn_until_solved  # noqa: E402  (this folder is on sys.path: run as a script)


def linear(start: float):
    return lambda progress_remaining: progress_remaining * start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--total", type=int, default=200_000)
    args = parser.parse_args()
    env = make_vec_env("CartPole-v1", n_envs=8, seed=args.seed)
    model = PPO("MlpPolicy", env, n_steps=32, batch_size=256, gae_lambda=0.8, gamma=0.98, n_epochs=20,
                ent_coef=0.0, learning_rate=linear(1e-3), clip_range=linear(0.2), seed=args.seed, device="cpu",
                verbose=0)
    learn_until_solved(model, args.total, 475.0, t_start)


if __name__ == "__main__":
    main()
