"""Writes checkpoints on a schedule, at the end of a run, and when a signal stops it."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType

from rltrain import checkpoint, sharded_checkpoint
from rltrain.hooks.base import Every, Hook
from rltrain.loggers import Logger
from rltrain.protocols import Algo, Collector
from rltrain.rules import Flag, PositiveInt
from rltrain.state import TrainState
from rltrain.strategies import Single, Strategy
from rltrain.sync import WeightSender

log = logging.getLogger("rltrain")


class CheckpointHook(Hook):
    ALL_RANKS = True  # a data-parallel learner's checkpoint holds every rank's envs; rank 0 writes it

    """Saves everything a run needs to continue as if never stopped (see ``rltrain.checkpoint``).

    ``every``: e.g. ``{seconds: 600}`` or ``{frames: 100000}`` (null: only at the end, with
    ``at_end``, and when a signal stops the run); ``keep_last``: older files are
    deleted once a new one is safely written; ``replay_buffer``: include the replay buffer
    (off-policy algos), large but needed for an exact continuation. ``hooks``: the run's hooks,
    whose own state each checkpoint saves (build passes them, this one included). ``strategy``: a
    data-parallel learner's ranks each give their envs and generators; rank 0 writes the file.
    """

    def __init__(
        self,
        algo: Algo,
        collector: Collector,
        loggers: Sequence[Logger],
        sender: WeightSender,
        run_dir: str | Path,
        config: dict,
        hooks: Mapping[str, Hook] = MappingProxyType({}),
        every: Every = MappingProxyType({"seconds": 600}),
        keep_last: PositiveInt = 2,
        replay_buffer: Flag = True,
        at_end: Flag = True,
        strategy: Strategy = Single(),
    ):
        super().__init__(every, at_end)
        self.algo, self.collector, self.loggers, self.sender = algo, collector, list(loggers), sender
        self.run_dir, self.config, self.hooks = Path(run_dir), config, hooks
        self.keep_last, self.replay_buffer = keep_last, replay_buffer
        self.strategy = strategy

    def on_start(self, state: TrainState) -> None:
        if self.strategy.is_main:
            checkpoint.write_config(self.run_dir, self.config)

    def on_update(self, state: TrainState) -> None:
        self.save(state)

    def on_interrupt(self, state: TrainState) -> None:
        self.save(state)

    def on_failure(self, state: TrainState, error: Exception) -> None:
        """The run failed outside the learner: keep what it has, unless a checkpoint of this very state is
        on disk already (written with the envs as they were then). A collector whose state cannot be had
        (a worker died with its envs) is left out, and a resumed run's envs start fresh episodes."""
        if checkpoint.path_for(self.run_dir, state.frames).exists() or self.strategy.PARALLEL:
            return  # (with several ranks: the others may be gone or waiting elsewhere; the last checkpoint stands)
        try:
            collector = self.collector.state_dict()
        except Exception as e:  # noqa: BLE001
            log.warning("the checkpoint leaves out the collector's envs (%s: %s): a resumed run starts them on "
                        "fresh episodes", type(e).__name__, e)
            collector = None
        self._write(state, collector)

    def save(self, state: TrainState) -> Path | None:
        return self._write(state, self.collector.state_dict())

    def _write(self, state: TrainState, collector_state: dict | None) -> Path | None:
        """The checkpoint of ``state`` with ``collector_state`` (None: the collector's is left out); its path
        on the rank that writes it."""
        t0 = time.perf_counter()
        ranks = None
        if self.strategy.PARALLEL:
            mine = {} if self.strategy.is_main else checkpoint.rank_part(self.algo, self.replay_buffer)
            gathered = self.strategy.gather_to_main({**mine, checkpoint.COLLECTOR_KEY: collector_state})
            ranks = gathered[1:] if self.strategy.is_main else None
        path = checkpoint.path_for(self.run_dir, state.frames, sharded=self.strategy.SHARDED)

        def capture(**sharded) -> dict:
            return checkpoint.capture(state, self.hooks, self.algo, collector_state, self.sender, self.loggers,
                                      self.config, replay_buffer=self.replay_buffer, ranks=ranks, **sharded)

        if self.strategy.SHARDED:  # every rank writes its shards of the trained modules, rank 0 the rest
            trained = self.algo.trained_parts()
            rest = dict(algo_state=self.algo.state_dict(replay_buffer=self.replay_buffer, parts=False),
                        sharded=list(trained))
            checkpoint.save_sharded(path, sharded_checkpoint.parts_of(trained),
                                    (lambda: capture(**rest)) if self.strategy.is_main else None, self.strategy)
        elif self.strategy.is_main:
            checkpoint.save(path, capture())
        if not self.strategy.is_main:
            return None
        checkpoint.prune(self.run_dir, self.keep_last)
        log.info("checkpoint %s (%.1f MB, %.2f s)", path, checkpoint.size(path) / 1e6, time.perf_counter() - t0)
        return path
