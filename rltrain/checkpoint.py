"""Checkpoints: what goes in one and how a run comes back from it (``capture`` and ``Restore``,
side by side), and how the files are written and found.

A checkpoint is one ``torch.save`` file, ``<run_dir>/checkpoints/frames_<N>.pt``, holding plain
tensors and Python values (it loads with ``weights_only=True``), under the keys named below
(``*_KEY``), in format ``FORMAT``. A sharded learner's (``strategy=fsdp``) is a directory,
``frames_<N>.dcp``: every rank writes its shards of the algorithm's trained modules and their optimizers
there with torch.distributed.checkpoint (``rltrain.sharded_checkpoint``), and rank 0 the rest, the same keys
as a file's, in ``state.pt``. Either is written under a temporary name and renamed: complete or absent.

- ``trainer``: the ``TrainState``'s records (progress, episodes, sync, evals, nonfinite), the
  pending metric window and the phase timings, each under its field name;
- ``hooks``: each hook's own ``state_dict()``, under the hook's name;
- ``algo``: networks, optimizers, lr position, temperature, obs statistics, replay buffer, and the
  rest of an update that a stop request interrupted between two gradient steps;
- ``published``: the weights the collectors act with (older than the learner's with sync.every > 1),
  None where the sync scheme keeps no copy;
- ``collector``: the envs mid-episode (``collector=local``, and each lock-step worker's envs and
  generator; None: async workers' envs start fresh episodes);
- ``loggers``: e.g. the wandb run id, so a resumed run continues the same wandb run;
- ``rng``: Python, numpy and torch (CPU and CUDA) generator states;
- ``config``: the resolved config that wrote it (``resume=auto`` matches on it);
- ``ranks``: with a data-parallel learner (``strategy=ddp``), the ``collector``, ``rng`` and the algo's
  ``RANK_STATE`` keys (under ``algo``: a replay buffer) of ranks 1, 2, ... in order (rank 0's are the keys
  above; the rest of the state is the same on every rank);
- ``sharded``: the names of the algo's trained parts (``Algo.trained_parts``) that a sharded checkpoint holds
  beside ``state.pt``, and that ``algo`` then leaves out (None: a one-file checkpoint).

A checkpoint of an older format is upgraded as it is loaded, one ``MIGRATIONS`` step per format
(the file itself is left as it is). Files are written to a temporary name and renamed, so a crash
mid-write leaves the previous checkpoint intact; a state whose weights hold NaN or inf is never
written (``check_finite``).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import random
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.distributed.checkpoint.api import CheckpointException

from rltrain import sharded_checkpoint
from rltrain.algos.finite import nonfinite_weights
from rltrain.errors import CheckpointError, CollectorError, NonFiniteError, RunError
from rltrain.sync.base import assign, named_weights

if TYPE_CHECKING:
    from rltrain.hooks.base import Hook
    from rltrain.loggers import Logger
    from rltrain.protocols import Algo, Collector
    from rltrain.state import TrainState
    from rltrain.strategies import Strategy
    from rltrain.sync import WeightSender, WeightSyncScheme
    from rltrain.trainer import Trainer

log = logging.getLogger("rltrain")

FORMAT = 3  # bumped with each change to what a checkpoint holds, with a step in MIGRATIONS
FORMAT_KEY = "format"
FRAMES_KEY = "frames"
ALGO_CLASS_KEY = "algo_class"
TRAINER_KEY = "trainer"
HOOKS_KEY = "hooks"
ALGO_KEY = "algo"
PUBLISHED_KEY = "published"
COLLECTOR_KEY = "collector"
LOGGERS_KEY = "loggers"
RNG_KEY = "rng"
CONFIG_KEY = "config"
RANKS_KEY = "ranks"
SHARDED_KEY = "sharded"
PER_RANK = (COLLECTOR_KEY, RNG_KEY, ALGO_KEY)  # what differs between the ranks of a data-parallel learner

DIRNAME = "checkpoints"
CONFIG_FILE = "config.json"  # the writing run's config, next to its checkpoints (for resume=auto)
STATE_FILE = "state.pt"  # in a sharded checkpoint's directory: all but the trained parts
SHARDED_SUFFIX = ".dcp"
_NAME = re.compile(r"^frames_(\d+)\.(pt|dcp)$")


def capture(state: TrainState, hooks: Mapping[str, Hook], algo: Algo, collector_state: dict | None,
            sender: WeightSender, loggers: Sequence[Logger], config: dict,
            replay_buffer: bool = True, ranks: list[dict] | None = None,
            algo_state: dict | None = None, sharded: list[str] | None = None) -> dict[str, Any]:
    """Everything a run needs to go on as if it had never stopped (the keys listed above), the collector's
    state as ``collector.state_dict()`` gave it (None: left out; a resumed run's envs start fresh episodes),
    the other ranks' ``PER_RANK`` parts (``rank_part``) of a data-parallel learner, and the algo's state where
    the caller has it already (a sharded learner's: all but its trained parts, named by ``sharded``, which
    ``save_sharded`` writes)."""
    if algo_state is None:
        algo_state = algo.state_dict(replay_buffer=replay_buffer)
    published = sender.published()
    # Weights and optimizer state: the replay buffer holds what the envs returned (checked as it
    # arrives), and an interrupted update may hold the NaN losses of steps algo.nonfinite=skip skipped.
    check_finite({k: v for k, v in algo_state.items() if k not in ("replay_buffer", "pending")}, ALGO_KEY)
    check_finite(published, PUBLISHED_KEY)
    return {
        FORMAT_KEY: FORMAT,
        FRAMES_KEY: state.frames,
        ALGO_CLASS_KEY: type(algo).__name__,
        TRAINER_KEY: state.state_dict(),
        HOOKS_KEY: {name: hook.state_dict() for name, hook in hooks.items()},
        ALGO_KEY: algo_state,
        PUBLISHED_KEY: published,
        COLLECTOR_KEY: collector_state,
        LOGGERS_KEY: {_class_path(type(lg)): lg.state_dict() for lg in loggers},
        RNG_KEY: rng_state(),
        CONFIG_KEY: config,
        RANKS_KEY: ranks,
        SHARDED_KEY: sharded,
    }


def rank_part(algo: Algo, replay_buffer: bool = True) -> dict[str, Any]:
    """This rank's ``PER_RANK`` part of a checkpoint, but for the collector, which the caller adds."""
    keys = getattr(algo, "RANK_STATE", ())
    state = algo.state_dict(replay_buffer=replay_buffer) if keys else {}
    return {RNG_KEY: rng_state(), ALGO_KEY: {k: state[k] for k in keys if k in state}}


class Restore:
    """A checkpoint being resumed from, handing each part of the run its saved state as ``build``
    makes it (``Restore.none()`` for a fresh run: every part keeps its fresh state)."""

    def __init__(self, saved: dict[str, Any] | None, path: Path | None = None, rank: int = 0):
        self.saved, self.path, self.rank = saved, path, rank

    def _part(self, key: str) -> Any:
        """This rank's ``key`` (one of ``PER_RANK``); None where the checkpoint has none for it (written by
        fewer ranks)."""
        if self.rank == 0:
            return self.saved[key]
        ranks = self.saved.get(RANKS_KEY) or []
        return ranks[self.rank - 1].get(key) if self.rank <= len(ranks) else None

    @classmethod
    def none(cls) -> Restore:
        return cls(None)

    @property
    def frames(self) -> int:
        return self.saved[FRAMES_KEY] if self.saved else 0

    @property
    def version(self) -> int:
        return self.saved[TRAINER_KEY]["sync"]["version"] if self.saved else 0

    def algo(self, algo: Algo, config: dict, sharded: bool = False) -> None:
        """Load the algo's state after checking it fits (same algorithm, same tensor shapes). From a sharded
        checkpoint, its trained parts come from their shards (``sharded``: this learner's ranks read them
        together)."""
        if not self.saved:
            return
        saved, path = self.saved, self.path
        if saved[ALGO_CLASS_KEY] != type(algo).__name__:
            algo_option = saved[CONFIG_KEY]["algo"]["_target_"].rsplit(".", 1)[-1].lower()
            raise CheckpointError(f"{path} holds a {saved[ALGO_CLASS_KEY]} run; this config builds "
                                  f"{type(algo).__name__}. Resume with algo={algo_option}, or start a new run")
        state = {**saved[ALGO_KEY], **(self._part(ALGO_KEY) or {})}  # another rank's own keys over rank 0's
        if saved[SHARDED_KEY]:
            trained = algo.trained_parts()
            if lacking := sorted(set(trained) - set(saved[SHARDED_KEY])):
                raise CheckpointError(f"{path} holds no {', '.join(lacking)} (the run that wrote it had none: e.g. no "
                                      "KL reference with algo.kl_coef=0); resume with the config that wrote it, or "
                                      "start a new run")
            sharded_checkpoint.read(path, sharded_checkpoint.parts_of(trained), sharded)
            check_compatible(state, algo.state_dict(parts=False), ALGO_KEY)
        else:
            check_compatible(state, algo.state_dict(), ALGO_KEY)
        algo.load_state_dict(state)
        changes = config_changes(saved[CONFIG_KEY], config)
        log.info("resuming from %s (%d frames)%s", path, saved[FRAMES_KEY],
                 "; changed: " + ", ".join(changes) if changes else "")

    def sender(self, scheme: WeightSyncScheme, policy: torch.nn.Module) -> WeightSender:
        """The scheme's sender, publishing as the saved version the weights the collectors acted with
        when the checkpoint was taken (with sync.every > 1 or sync=none, not the learner's latest)."""
        published = self.saved[PUBLISHED_KEY] if self.saved else None
        if published is None:
            return scheme.sender(policy, version=self.version)
        weights = named_weights(policy)
        check_compatible(published, weights, PUBLISHED_KEY)
        with torch.no_grad():
            live = {name: tensor.clone() for name, tensor in weights.items()}
            for name, tensor in weights.items():
                assign(tensor, published[name])
            sender = scheme.sender(policy, version=self.version)  # copies what it publishes
            for name, tensor in weights.items():  # the learner's own weights again
                tensor.copy_(live[name])
        return sender

    def collector(self, collector: Collector) -> None:
        """The envs mid-episode, where they were; fresh episodes if that state is missing or does not load."""
        if not self.saved:
            return
        saved = self._part(COLLECTOR_KEY)
        if saved is None and getattr(collector, "JOB_STATE", False):  # the same on every rank: rank 0's
            saved = self.saved[COLLECTOR_KEY]
        if saved is None:
            log.info("resume: the collector's envs start fresh episodes (their state was not saved)")
            return
        try:
            collector.load_state_dict(saved)
        except (CollectorError, OSError):  # a worker died or stopped answering: not a matter of fresh episodes
            raise
        except Exception as e:  # noqa: BLE001  (env.num_envs changed, an env package upgraded, ...)
            log.warning("resume: the collector's envs start fresh episodes (their saved state does not load: "
                        "%s: %s)", type(e).__name__, e)

    def logger(self, cls: type) -> dict | None:
        """What a logger of class ``cls`` gets as ``resume``: its saved state and the checkpoint's
        frame count (rows past it were written after the checkpoint and are dropped); None if fresh."""
        if not self.saved:
            return None
        # A logger the saved run did not have (logger=wandb added on resume) starts fresh.
        return {**self.saved[LOGGERS_KEY].get(_class_path(cls), {}), "frames": self.saved[FRAMES_KEY]}

    def trainer(self, trainer: Trainer) -> None:
        """The run's figures, metric window and timings, each hook's own state, then the random
        generators (last: building draws from them). A hook the saved run did not have starts fresh."""
        if not self.saved:
            return
        trainer.state.load_state_dict(self.saved[TRAINER_KEY])
        saved_hooks = self.saved[HOOKS_KEY]
        for name, hook in trainer.hooks.items():
            if name in saved_hooks:
                hook.load_state_dict(saved_hooks[name])
        if (rng := self._part(RNG_KEY)) is not None:  # else a rank the checkpoint did not have: as seeded
            set_rng_state(rng)


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def path_for(run_dir: Path, frames: int, sharded: bool = False) -> Path:
    return Path(run_dir) / DIRNAME / f"frames_{frames:012d}{SHARDED_SUFFIX if sharded else '.pt'}"


def save_sharded(path: Path, parts: dict[str, sharded_checkpoint.Part], rest: Callable[[], dict] | None,
                 strategy: Strategy) -> None:
    """A sharded learner's checkpoint, the directory ``path``: every rank writes its shards of ``parts``, and
    rank 0 the rest of the checkpoint (``rest()``, a ``capture``; None on the other ranks) as ``STATE_FILE``,
    all in a temporary directory renamed once everything is on disk. Weights or a state holding NaN or inf
    are refused on every rank alike, before anything is written."""
    tmp = path.with_name(path.name + ".tmp")
    whole, error, problem = None, None, None
    if strategy.is_main:
        for stale in path.parent.glob(f"frames_*{SHARDED_SUFFIX}.*"):  # writes or deletes cut short
            shutil.rmtree(stale, ignore_errors=True)
        try:
            whole = rest()
        except Exception as e:  # noqa: BLE001  (told to every rank below, then raised here)
            error, problem = e, f"{type(e).__name__}: {e}"
    if problem is None and (bad := [f"{name}.{w}" for name, part in parts.items() for w in
                                    nonfinite_weights(part.module)]):
        problem = f"NonFiniteError: NaN or inf in the weights {', '.join(bad[:3])}: the checkpoint is not written"
    # (the ranks agree before anyone writes, and no rank writes before the stale directories are gone)
    problems = [(rank, p) for rank, p in enumerate(strategy.gather(problem)) if p]
    if error is not None:
        raise error
    if problems:
        rank, said = problems[0]
        kind = NonFiniteError if said.startswith("NonFiniteError") else RunError
        raise kind(f"checkpoint {path.name} not written: rank {rank}: {said}")
    try:
        sharded_checkpoint.write(tmp, parts)
        if strategy.is_main:
            save(tmp / STATE_FILE, whole)
            aside = path.with_name(path.name + ".old")
            if path.exists():  # the same frames written again (a run that a signal stopped right after a checkpoint)
                os.replace(path, aside)
            os.replace(tmp, path)
            _sync_dir(path.parent)
            shutil.rmtree(aside, ignore_errors=True)
    except BaseException as e:
        if strategy.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        full = _disk_full(e)  # (DCP's CheckpointException, on every rank, holds each failed rank's error)
        if full is None:
            raise
        raise _no_space(path, full) from e


def size(path: Path) -> int:
    """A checkpoint's bytes on disk (a sharded one's: all its files)."""
    return sum(f.stat().st_size for f in path.iterdir()) if path.is_dir() else path.stat().st_size


def save(path: Path, checkpoint: dict[str, Any]) -> None:
    """Write atomically: to ``<name>.tmp`` first, synced to disk, then renamed over ``path``. A full disk
    is a RunError that says so (torch's own words are "unexpected pos N vs M"), with the space left and
    the previous checkpoint, which the failed write leaves intact."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        full = _disk_full(e)
        if full is None:
            raise
        raise _no_space(path, full) from e
    _sync_dir(path.parent)


def _no_space(path: Path, full: OSError) -> RunError:
    """The error a checkpoint write that met a full disk (``full``) raises: the space left, and the checkpoint
    to resume from, which the failed write replaced no part of."""
    free = shutil.disk_usage(path.parent).free
    kept = listing(_run_dir_of(path))
    previous = (f"the previous checkpoint {kept[-1].name} is intact (resume={path.parent.parent} continues from "
                "it)" if kept else "no earlier checkpoint of this run was written")
    return RunError(f"{os.strerror(full.errno).lower()} for checkpoint {path}: {free / 1e6:,.1f} MB free on its "
                    f"filesystem, and the checkpoint needs more; {previous}. Free some space there")


def _sync_dir(folder: Path) -> None:
    """A rename in ``folder`` made durable: it survives a power cut."""
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _disk_full(e: BaseException | None) -> OSError | None:
    """The OSError "no space left on device" (or over quota) behind ``e``: itself, the error torch's writer
    met and replaced with its own, or one a rank met in a sharded write (``torch.distributed.checkpoint``'s
    exception holds every failed rank's)."""
    chain: list[BaseException] = []
    while e is not None and e not in chain:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return e
        chain.append(e)
        for failure, _ in (e.failures.values() if isinstance(e, CheckpointException) else ()):
            if (full := _disk_full(failure)) is not None:
                return full
        e = e.__cause__ or e.__context__
    return None


def write_config(run_dir: Path, config: dict) -> None:
    path = Path(run_dir) / DIRNAME / CONFIG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=1, sort_keys=True))


def listing(run_dir: Path) -> list[Path]:
    """The run's checkpoints, oldest (fewest frames) first."""
    folder = Path(run_dir) / DIRNAME
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.iterdir() if _NAME.match(p.name)), key=_frames)


def prune(run_dir: Path, keep_last: int) -> None:
    for old in listing(run_dir)[:-keep_last]:
        if old.is_dir():  # renamed first: a delete cut short leaves no checkpoint that looks whole
            gone = old.with_name(old.name + ".del")
            os.replace(old, gone)
            shutil.rmtree(gone, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def _run_dir_of(path: Path) -> Path:
    """The run dir of a checkpoint's path, or of a file inside a sharded checkpoint."""
    return path.parent.parent if path.parent.name == DIRNAME else path.parent.parent.parent


def find(resume: str | None, config: dict, runs_root: Path) -> Path | None:
    """The checkpoint file ``resume`` designates: None (start fresh), ``auto`` (the newest
    checkpoint of a run under ``runs_root`` with the same config, or None), a run dir, a
    checkpoints dir, or a checkpoint file."""
    if resume is None:
        return None
    if resume == "auto":
        return _find_same_config(config, runs_root)
    path = Path(resume).expanduser()
    if path.is_file() and path.parent.suffix == SHARDED_SUFFIX and _NAME.match(path.parent.name):
        return path.parent  # a file inside a sharded checkpoint: the checkpoint
    if path.is_file() or (path.is_dir() and _NAME.match(path.name)):
        return path
    if not path.exists():
        raise CheckpointError(f"resume={resume}: no such file or directory; give a run dir (outputs/DATE/TIME), "
                              "a checkpoint file, or resume=auto")
    run_dir = path.parent if path.name == DIRNAME else path
    found = listing(run_dir)
    if not found and (run_dir / DIRNAME / CONFIG_FILE).is_file():
        raise CheckpointError(f"resume={resume}: {run_dir} stopped before its first checkpoint ({run_dir / DIRNAME} "
                              f"holds no frames_*.pt or .dcp, only the {CONFIG_FILE} a run writes as it starts), so "
                              "there is nothing to resume: start it again without resume=. hooks.checkpoint.every sets "
                              "how often checkpoints are written (e.g. hooks.checkpoint.every.seconds=60)")
    if not found:
        raise CheckpointError(f"resume={resume}: {run_dir} holds no checkpoints (looked for "
                              f"{run_dir / DIRNAME}/frames_*.pt or .dcp); was hooks.checkpoint disabled in that run?")
    return found[-1]


_SEARCH_DEPTH = 5  # run dirs up to outputs/multirun/DATE/TIME/N


def _find_same_config(config: dict, runs_root: Path) -> Path | None:
    wanted = _comparable(config)
    newest: tuple[float, Path] | None = None
    candidates = [f for depth in range(_SEARCH_DEPTH)
                  for f in Path(runs_root).glob("*/" * depth + f"{DIRNAME}/{CONFIG_FILE}")]
    for config_file in candidates:
        try:
            if _comparable(json.loads(config_file.read_text())) != wanted:
                continue
        except (OSError, ValueError) as e:
            log.warning("resume=auto: skipping %s, which cannot be read (%s: %s); its run is not a candidate",
                        config_file, type(e).__name__, e)
            continue
        found = listing(config_file.parent.parent)
        if found and (newest is None or found[-1].stat().st_mtime > newest[0]):
            newest = (found[-1].stat().st_mtime, found[-1])
    if newest is None:
        log.info("resume=auto: no earlier run of this config under %s; starting fresh", runs_root)
        return None
    return newest[1]


def _comparable(config: dict) -> dict:
    return {k: v for k, v in config.items() if k != "resume"}


def load(path: Path) -> dict[str, Any]:
    """Read a checkpoint (tensors to the CPU; a sharded one's ``STATE_FILE``: its parts load into the algo);
    a clear CheckpointError if it is not a readable one."""
    file = path / STATE_FILE if path.is_dir() else path
    try:
        checkpoint = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001  (truncated, corrupt, or not a torch file at all)
        older = [p.name for p in listing(path.parent.parent) if _frames(p) < _frames(path)]
        hint = f"; older checkpoints beside it: {', '.join(older)} (resume=<that file>)" if older else ""
        raise CheckpointError(f"{path} is not a readable checkpoint: {_damage(file, e)}{hint}") from None
    if not isinstance(checkpoint, dict) or not isinstance(fmt := checkpoint.get(FORMAT_KEY), int) or fmt < 1:
        raise CheckpointError(f"{path} is not an rltrain checkpoint (format {FORMAT})")
    if fmt > FORMAT:
        raise CheckpointError(f"{path} was written by a newer rltrain (checkpoint format {fmt}; this one reads "
                              f"formats up to {FORMAT}): upgrade rltrain to resume from it")
    if fmt < FORMAT:
        log.info("%s is in checkpoint format %d; upgrading it to format %d as it loads (the file is left as it is)",
                 path, fmt, FORMAT)
    return _upgrade(checkpoint)


def _upgrade(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint`` in format ``FORMAT``: each older format is brought one step forward by its
    ``MIGRATIONS`` entry."""
    while checkpoint[FORMAT_KEY] < FORMAT:
        checkpoint = {**MIGRATIONS[checkpoint[FORMAT_KEY]](checkpoint), FORMAT_KEY: checkpoint[FORMAT_KEY] + 1}
    return checkpoint


# Format 1's flat "trainer" keys (rltrain up to 2026-12-03): where format 2 keeps each, and its value
# in the files written before that key existed.
_FORMAT_1_TRAINER: dict[str, dict[str, tuple[str, Any]]] = {  # record: {format 1's key: (format 2's, default)}
    "progress": {"frames": ("frames", 0), "batches": ("batches", 0), "updates": ("updates", 0),
                 "solved_at_frames": ("solved_at_frames", None), "mid_update_frames": ("mid_update_frames", 0)},
    "episodes": {"episodes": ("count", 0), "recent_returns": ("recent_returns", []),
                 "recent_lengths": ("recent_lengths", [])},
    "sync": {"version": ("version", 0), "pushes": ("pushes", 0), "lag_sum": ("lag_sum", 0.0), "lag_max": ("lag_max", 0),
             "dropped_batches": ("dropped_batches", 0), "dropped_frames": ("dropped_frames", 0)},
    "evals": {"eval_return": ("last_return", None), "eval_return_sum": ("return_sum", 0.0),
              "evaluations": ("count", 0)},
    "nonfinite": {"nonfinite_frames": ("env_frames", 0), "skipped_steps": ("skipped_steps", 0)},
}


def _from_format_1(saved: dict[str, Any]) -> dict[str, Any]:
    """Format 1 -> 2: the trainer's flat counters go into their records, hooks get a (still empty)
    place of their own, and the parts that format 1 gained over its life are filled in for the files
    written before them (the published weights, the loggers' state, the window's latest values).
    An algo of the files written before it counted NaN/inf steps or saved a stopped update gets None
    for those (counting starts at the resume; no update pending)."""
    flat = saved[TRAINER_KEY]
    trainer: dict[str, Any] = {record: {name: flat.get(old, before) for old, (name, before) in keys.items()}
                               for record, keys in _FORMAT_1_TRAINER.items()}
    trainer["window"] = {"latest": {}, **flat["window"]}
    trainer["timer"] = flat["timer"]
    algo = {"nonfinite": None, "pending": None, **saved[ALGO_KEY]}
    return {**saved, TRAINER_KEY: trainer, HOOKS_KEY: {}, ALGO_KEY: algo, PUBLISHED_KEY: saved.get(PUBLISHED_KEY),
            LOGGERS_KEY: saved.get(LOGGERS_KEY, {})}


def _from_format_2(saved: dict[str, Any]) -> dict[str, Any]:
    """Format 2 -> 3: sharded checkpoints came; every file of format 2 is one whole checkpoint."""
    return {**saved, SHARDED_KEY: None}


# Format N -> N + 1, one function each: the only place that knows older formats.
MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {1: _from_format_1, 2: _from_format_2}


def _damage(path: Path, e: Exception) -> str:
    """What is wrong with a file that does not load, in words (torch's own messages suggest retrying
    with weights_only=False, which would not help a damaged file and would run what a foreign one holds)."""
    if isinstance(e, OSError):
        return f"{type(e).__name__}: {e.strerror or e}"
    if path.stat().st_size == 0:
        return "the file is empty"
    if isinstance(e, pickle.UnpicklingError):
        return ("the file is corrupt: its contents are not the tensors and plain values rltrain writes (damaged, or "
                "written by another program)")
    if "zip archive" in str(e) or isinstance(e, EOFError):
        return "the file is corrupt: it is cut short or damaged (not a complete torch.save archive)"
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no detail'}"


def set_aside_newer(run_dir: Path, resumed: Path) -> None:
    """Resuming from an older checkpoint starts a new branch: checkpoints past it go to
    ``checkpoints/abandoned/`` so that nothing (keep_last, resume) mistakes them for this branch's."""
    newer = [p for p in listing(run_dir) if _frames(p) > _frames(resumed)]
    if not newer:
        return
    aside = Path(run_dir) / DIRNAME / "abandoned" / datetime.now().strftime("%Y-%m-%d_%H-%M-%S-%f")
    aside.mkdir(parents=True)
    for p in newer:
        p.replace(aside / p.name)
    log.warning("resumed from %s: the newer checkpoints %s were moved to %s", resumed.name,
                ", ".join(p.name for p in newer), aside)


def _frames(path: Path) -> int:
    m = _NAME.match(path.name)
    return int(m.group(1)) if m else -1


def check_finite(state: Any, where: str) -> None:
    """Raise NonFiniteError naming the tensors in ``state`` that hold a NaN or an infinity: a
    checkpoint must never hold weights that a resumed run would train on."""
    bad: list[str] = []
    _find_nonfinite(state, where, bad)
    if bad:
        raise NonFiniteError(f"not writing a checkpoint: {', '.join(bad[:6])}{' and more' if len(bad) > 6 else ''} "
                             "hold NaN or infinite values; the previous checkpoint is kept")


def _find_nonfinite(value: Any, where: str, bad: list[str]) -> None:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and not torch.isfinite(value).all():
            bad.append(where)
    elif isinstance(value, dict):
        for key, item in value.items():
            _find_nonfinite(item, f"{where}.{key}", bad)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _find_nonfinite(item, f"{where}.{i}", bad)


def check_compatible(saved: Any, current: Any, where: str) -> None:
    """Raise CheckpointError naming every tensor whose presence or shape differs between a
    checkpoint's state and the freshly built one (a checkpoint from another config)."""
    problems: list[str] = []
    _compare(saved, current, where, problems)
    problems.sort()
    if problems:
        shown = "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6 else "")
        raise CheckpointError(f"the checkpoint does not fit this config ({shown}). Resume with the config "
                              "that wrote it (its .hydra/config.yaml), or start a new run")


def _compare(saved: Any, current: Any, where: str, problems: list[str]) -> None:
    if isinstance(current, torch.Tensor):
        if not isinstance(saved, torch.Tensor):
            problems.append(f"{where}: not a tensor in the checkpoint")
        elif saved.shape != current.shape:
            problems.append(f"{where}: checkpoint {list(saved.shape)}, this config {list(current.shape)}")
    elif isinstance(current, dict):
        if not isinstance(saved, dict):
            if saved is not None or _holds_tensors(current):  # None: a part saved with nothing to restore
                problems.append(f"{where}: missing in the checkpoint")
            return
        if not current:  # e.g. a fresh optimizer's state: filled by loading, nothing to compare
            return
        for key in current.keys() - saved.keys():
            if _holds_tensors(current[key]):
                problems.append(f"{where}.{key}: missing in the checkpoint")
        for key in saved.keys() - current.keys():
            if _holds_tensors(saved[key]):
                problems.append(f"{where}.{key}: in the checkpoint, not in this config")
        for key in current.keys() & saved.keys():
            _compare(saved[key], current[key], f"{where}.{key}", problems)


def _holds_tensors(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, dict) and any(_holds_tensors(v) for v in value.values())


def config_changes(saved: dict, current: dict) -> list[str]:
    """``key: old -> new`` for every config value that differs (e.g. a longer trainer.total_frames)."""
    old, new = _flatten(_comparable(saved)), _flatten(_comparable(current))
    return [f"{k}: {old.get(k, '<absent>')} -> {new.get(k, '<absent>')}"
            for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)]


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            out |= _flatten(v, f"{prefix}{k}.")
        return out
    return {prefix[:-1]: node}


def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy(), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
