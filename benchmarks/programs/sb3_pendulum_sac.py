"""stable-baselines3 SAC on Pendulum-v1 (lr 1e-3, batch 256, one gradient step per env step),
stopping at the same rule as rltrain (mean of the last 10 training episodes >= -200).
Prints one JSON line. Run by the end_to_end category as a whole process.
"""

import argparse
import json
import time

from stable_baselines3 import SAC
from stop_at_return import StopAtReturn  # this folder is on sys.path: run as a script


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--total", type=int, default=20_000)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    model = SAC("MlpPolicy", "Pendulum-v1", learning_rate=1e-3, batch_size=256, train_freq=1, gradient_steps=1,
                seed=args.seed, device="cpu", verbose=0,
                policy_kwargs=dict(net_arch=[args.width, args.width]))
    callback = StopAtReturn(-200.0)
    t0 = time.perf_counter()
    model.learn(args.total, callback=callback)
    print(json.dumps({"frames_to_solve": callback.solved_at, "learn_s": time.perf_counter() - t0}))


if __name__ == "__main__":
    main()
