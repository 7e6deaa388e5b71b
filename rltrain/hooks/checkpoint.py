"""Writes checkpoints on a schedule, at the end of a run, and when a signal stops it."""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from rltrain import checkpoint
from rltrain.errors import ConfigError
from rltrain.hooks.base import Hook
from rltrain.loggers import Logger
from rltrain.sync import WeightSender

log = logging.getLogger("rltrain")


class CheckpointHook(Hook):
    """Saves everything a run needs to continue as if never stopped (see ``rltrain.checkpoint``).

    ``every``: e.g. ``{seconds: 600}`` or ``{frames: 100000}``; ``keep_last``: older files are
    deleted once a new one is safely written; ``replay_buffer``: include the replay buffer
    (off-policy algos), large but needed for an exact continuation.
    """

    def __init__(
        self,
        algo,
        collector,
        loggers: Sequence[Logger],
        sender: WeightSender,
        run_dir: str | Path,
        config: dict,
        every: Mapping[str, float] | None = None,
        keep_last: int = 2,
        replay_buffer: bool = True,
        at_end: bool = True,
    ):
        super().__init__(every)
        for method in ("state_dict", "load_state_dict"):
            if not callable(getattr(algo, method, None)):
                raise ConfigError(f"hooks.checkpoint: the algo ({type(algo).__name__}) has no {method}(), so its "
                                  "state cannot be saved; add state_dict/load_state_dict, or drop the hook with "
                                  "'~hooks.checkpoint'")
        self.enabled = every is not None
        self.algo, self.collector, self.loggers, self.sender = algo, collector, list(loggers), sender
        self.run_dir, self.config = Path(run_dir), config
        self.keep_last, self.replay_buffer, self.at_end = keep_last, replay_buffer, at_end

    def on_start(self, state) -> None:
        checkpoint.write_config(self.run_dir, self.config)

    def on_update(self, state) -> None:
        if self.enabled:
            self.save(state)

    def on_end(self, state) -> None:
        if self.at_end:
            self.save(state)

    def on_interrupt(self, state) -> None:
        self.save(state)

    def save(self, state) -> Path:
        t0 = time.perf_counter()
        path = checkpoint.path_for(self.run_dir, state.frames)
        algo_kwargs = {"replay_buffer": self.replay_buffer} if _takes_replay_buffer(self.algo) else {}
        algo_state, published = self.algo.state_dict(**algo_kwargs), self.sender.published()
        # Weights only: the replay buffer holds what the envs returned, which rltrain checks as it arrives.
        checkpoint.check_finite({k: v for k, v in algo_state.items() if k != "replay_buffer"}, "algo")
        checkpoint.check_finite(published, "published")
        checkpoint.save(path, {
            "format": checkpoint.FORMAT,
            "frames": state.frames,
            "algo_class": type(self.algo).__name__,
            "trainer": state.state_dict(),
            "algo": algo_state,
            "published": published,  # what collectors act with (older with sync.every > 1)
            "collector": self.collector.state_dict() if hasattr(self.collector, "state_dict") else None,
            "loggers": {_class_path(lg): lg.state_dict() for lg in self.loggers if hasattr(lg, "state_dict")},
            "rng": checkpoint.rng_state(),
            "config": self.config,
        })
        checkpoint.prune(self.run_dir, self.keep_last)
        log.info("checkpoint %s (%.1f MB, %.2f s)", path, path.stat().st_size / 1e6, time.perf_counter() - t0)
        return path


def _takes_replay_buffer(algo) -> bool:
    return "replay_buffer" in inspect.signature(algo.state_dict).parameters


def _class_path(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"
