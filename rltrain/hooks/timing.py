"""Folds the phase timer into the log rows (``time/<phase>``) and prints the end-of-run table."""

from __future__ import annotations

import logging

from rltrain.hooks.base import EVERY_UPDATE, Every, Hook
from rltrain.rules import Flag
from rltrain.state import TrainState
from rltrain.timing import format_table

log = logging.getLogger("rltrain")


class TimingHook(Hook):
    """Every ``every`` (each update by default), adds the seconds each phase took since its last
    call to the metric window as ``time/<phase>``; the log row sums what fell into its window.

    ``cuda_sync``: synchronize CUDA at phase boundaries, so GPU work is charged to the phase that
    queued it rather than to whichever phase next waits for it.
    """

    phase = "hooks"

    def __init__(self, every: Every = EVERY_UPDATE, cuda_sync: Flag = False, table: Flag = True, at_end: Flag = True):
        super().__init__(every, at_end)
        self.cuda_sync, self.table = cuda_sync, table

    def on_start(self, state: TrainState) -> None:
        state.timer.cuda_sync = self.cuda_sync

    def on_update(self, state: TrainState) -> None:
        state.window.accumulate({f"time/{phase}": round(s, 6) for phase, s in state.timer.drain_window().items()})

    def on_interrupt(self, state: TrainState) -> None:
        self.on_update(state)

    def close(self, state: TrainState, summary) -> None:
        if self.table:
            log.info("time per phase:\n%s", format_table(summary))
