"""stable-baselines3 DQN on CartPole-v1 with RL-Zoo's tuned hyperparameters (lr 2.3e-3, batch 64, buffer 100k,
1k frames of warm-up, 128 gradient steps per 256 frames, a target copied every 10 steps, epsilon 1 -> 0.04 over
the first 8k frames (16% of RL-Zoo's 50k, whatever ``--total`` is), 256x256 layers). With ``--threshold`` it stops
at the same rule as rltrain (mean of the last 10 training episodes >= it); without, it runs ``--total`` frames and
scores 10 deterministic episodes at the end, as rltrain's final evaluation does. Prints one JSON line.

Run by the end_to_end category as a whole process; alone: python benchmarks/programs/sb3_dqn_cartpole.py --seed 0
"""

import argparse
import json
import time

t_start = time.perf_counter()
EXPLORATION_FRAMES = 8_000

from stable_baselines3 import DQN  # noqa: E402
from stable_baselines3.common.evaluation import evaluate_policy  # noqa: E402
from stop_at_return import learn_until_solved  # noqa: E402  (this folder is on sys.path: run as a script)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--total", type=int, default=50_000)
    parser.add_argument("--threshold", type=float, default=None)
    args = parser.parse_args()
    model = DQN("MlpPolicy", "CartPole-v1", learning_rate=2.3e-3, batch_size=64, buffer_size=100_000,
                learning_starts=1000, gamma=0.99, target_update_interval=10, train_freq=256, gradient_steps=128,
                exploration_fraction=EXPLORATION_FRAMES / args.total, exploration_final_eps=0.04,
                policy_kwargs=dict(net_arch=[256, 256]),
                seed=args.seed, device="cpu", verbose=0)
    if args.threshold is not None:
        learn_until_solved(model, args.total, args.threshold, t_start)
        return
    t_learn = time.perf_counter()
    model.learn(args.total)
    learn_s = time.perf_counter() - t_learn
    eval_return, _ = evaluate_policy(model, model.get_env(), n_eval_episodes=10, deterministic=True)
    print(json.dumps({"frames_to_solve": None, "learn_s": learn_s, "eval_return": float(eval_return)}))


if __name__ == "__main__":
    main()
