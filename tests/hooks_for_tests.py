"""User-style hooks that tests plug in from the command line (``+hooks.x._target_=...``)."""

from __future__ import annotations

import json
from pathlib import Path

from rltrain.hooks import Hook
from rltrain.hooks.base import EVERY_UPDATE


class RecordingHook(Hook):
    """Records, per event, the counters of the TrainState it was given (to a file, for CLI tests)."""

    def __init__(self, every=EVERY_UPDATE, run_dir: Path | None = None):
        super().__init__(every)
        self.run_dir = run_dir
        self.calls: list[tuple[str, int, int, int]] = []

    def _record(self, event, state):
        self.calls.append((event, state.frames, state.batches, state.updates))

    def on_start(self, state):
        self._record("start", state)

    def on_batch(self, state, batch):
        self._record("batch", state)

    def on_update(self, state):
        self._record("update", state)

    def on_end(self, state):
        self._record("end", state)

    def close(self, state, summary):
        if self.run_dir is not None:
            (Path(self.run_dir) / "recording.json").write_text(json.dumps(self.calls))


class FailingHook(Hook):
    """Raises the given exception type at the ``at_update``-th update."""

    def __init__(self, at_update: int = 2, error: str = "RuntimeError", every=EVERY_UPDATE):
        super().__init__(every)
        self.at_update, self.error = at_update, error

    def on_update(self, state):
        if state.updates >= self.at_update:
            raise {"RuntimeError": RuntimeError, "KeyboardInterrupt": KeyboardInterrupt}[self.error]("boom from a hook")


class SignalAt(Hook):
    """Sends its own process ``signal`` (a name), ``times`` times in a row, once ``frames`` frames are
    reached: what a scheduler or Ctrl-C does, at a reproducible point of the run."""

    def __init__(self, frames: int, signal: str = "SIGTERM", times: int = 1, every=EVERY_UPDATE):
        super().__init__(every)
        self.frames, self.signal, self.times, self.sent = frames, signal, times, False

    def on_update(self, state):
        import os
        import signal

        if not self.sent and state.frames >= self.frames:
            self.sent = True
            for _ in range(self.times):
                os.kill(os.getpid(), getattr(signal, self.signal))


class SignalDuringUpdate(Hook):
    """Sends its own process ``signal`` ``delay_s`` after batch ``at_batch`` arrives, that is, while
    the update on that batch is under way (as a scheduler's SIGTERM would land)."""

    def __init__(self, at_batch: int, delay_s: float = 0.3, signal: str = "SIGTERM", every=EVERY_UPDATE):
        super().__init__(every)
        self.at_batch, self.delay_s, self.signal = at_batch, delay_s, signal

    def on_batch(self, state, batch):
        import os
        import signal
        import threading

        if state.batches == self.at_batch:
            threading.Timer(self.delay_s, os.kill, (os.getpid(), getattr(signal, self.signal))).start()


class SlowLearner(Hook):
    """Sleeps ``delay_s`` after every update: a learner slowed by a busy machine or a big network."""

    def __init__(self, delay_s: float = 0.05, every=EVERY_UPDATE):
        super().__init__(every)
        self.delay_s = delay_s

    def on_update(self, state):
        import time

        time.sleep(self.delay_s)


class BestReturnHook(Hook):
    """A hook with state of its own: the best training return it has seen, kept across a resume."""

    def __init__(self, every=EVERY_UPDATE):
        super().__init__(every)
        self.best: float | None = None
        self.calls = 0

    def on_update(self, state):
        self.calls += 1
        if (mean := state.episodes.mean_return) is not None and (self.best is None or mean > self.best):
            self.best = mean

    def state_dict(self):
        return {"best": self.best, "calls": self.calls}

    def load_state_dict(self, state):
        self.best, self.calls = state["best"], state["calls"]
