"""A hook the start-up benchmark plugs into a run (``+hooks.first_batch._target_=...``): it writes
the wall-clock time at which the first batch reached the trainer, then does nothing."""

from __future__ import annotations

import time
from pathlib import Path

from rltrain.hooks import Hook


class FirstBatch(Hook):
    def __init__(self, path: str, every=None):
        super().__init__(every)
        self.path, self.done = Path(path), False

    def on_batch(self, state, batch) -> None:
        if not self.done:
            self.path.write_text(repr(time.time()))
            self.done = True
