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
