"""stable-baselines3 SAC on Pendulum-v1 (lr 1e-3, batch 256, one gradient step per env step),
stopping at the same rule as rltrain (mean of the last 10 training episodes >= -200).
Prints one JSON line. Run by sac_pendulum_solve.py as a whole process.
"""

import argparse
import json
import time

from stable_baselines3 import SAC
from stable_baselines3.common.callbacks import BaseCallback


class StopAtReturn(BaseCallback):
    def __init__(self, threshold: float, window: int = 10):
        super().__init__()
        self.threshold, self.window, self.solved_at = threshold, window, None

    def _on_step(self) -> bool:
        episodes = list(self.model.ep_info_buffer)[-self.window:]
        if len(episodes) == self.window and sum(e["r"] for e in episodes) / self.window >= self.threshold:
            self.solved_at = self.num_timesteps
            return False
        return True


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
