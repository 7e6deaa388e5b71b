"""sb3-contrib's RecurrentPPO or MaskablePPO on one of rltrain's test envs, with the PPO settings rltrain's
defaults use (16 envs, 32 steps each a batch, 10 epochs of 256-sample minibatches, lr 3e-3 annealed linearly,
gamma 0.98, lambda 0.8, 64x64 layers), stopping at the same rule as rltrain (mean of the last 10 training
episodes, or --window of them, >= --threshold). Prints one JSON line.

Run by the end_to_end category as a whole process; alone:
    python benchmarks/programs/sb3_contrib_solve.py --algo recurrent --env CueMemory-v0 --threshold 0.8 --seed 0
"""

import argparse
import sys
import time
from pathlib import Path

t_start = time.perf_counter()

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: tests.toy_envs registers the envs

from sb3_contrib import MaskablePPO, RecurrentPPO  # noqa: E402
from stable_baselines3.common.env_util import make_vec_env  # noqa: E402
from stop_at_return import learn_until_solved  # noqa: E402  (this folder is on sys.path: run as a script)

import tests.toy_envs  # noqa: E402, F401


def linear(start: float):
    return lambda progress_remaining: progress_remaining * start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--algo", choices=["recurrent", "maskable"], required=True)
    parser.add_argument("--env", required=True)
    parser.add_argument("--threshold", type=float, required=True)
    parser.add_argument("--window", type=int, default=10, help="training episodes the stop rule averages")
    parser.add_argument("--delay", type=int, default=None, help="CueMemory-v0: steps between the cue and the question")
    parser.add_argument("--recurrent-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--total", type=int, default=200_000)
    args = parser.parse_args()
    env = make_vec_env(args.env, n_envs=16, seed=args.seed,
                       env_kwargs={"delay": args.delay} if args.delay is not None else None)
    settings = dict(n_steps=32, batch_size=256, n_epochs=10, learning_rate=linear(3e-3), gamma=0.98, gae_lambda=0.8,
                    clip_range=0.2, ent_coef=0.0, max_grad_norm=0.5, seed=args.seed, device="cpu", verbose=0)
    if args.algo == "recurrent":  # its MlpLstmPolicy: the LSTM, then 64x64 layers (its default net_arch)
        model = RecurrentPPO("MlpLstmPolicy", env, policy_kwargs={"lstm_hidden_size": args.recurrent_size},
                             **settings)
    else:  # masks from the env's action_masks() method
        model = MaskablePPO("MlpPolicy", env, **settings)
    learn_until_solved(model, args.total, args.threshold, t_start, args.window)


if __name__ == "__main__":
    main()
