"""The stop rule the SB3 programs share with rltrain's trainer.stop_at_return: the mean return of
the last 10 training episodes reaches the threshold."""

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


def learn_until_solved(model, total: int, threshold: float, t_start: float, window: int = 10) -> None:
    """``model.learn`` for up to ``total`` frames, stopping at ``threshold``; prints the one JSON line the
    end_to_end category reads (``t_start``: when the program started, before its imports)."""
    import json
    import time

    callback = StopAtReturn(threshold, window)
    t_learn = time.perf_counter()
    model.learn(total, callback=callback)
    learn_s = time.perf_counter() - t_learn
    print(json.dumps({"frames_to_solve": callback.solved_at, "frames": model.num_timesteps, "learn_s": learn_s,
                      "in_process_s": time.perf_counter() - t_start}))
