"""Which dir a run owns, decided in one place, and what becomes of the dir Hydra made for it.

- ``place(resume, config, run_dir)``: the one decision, for every way a run starts:

  ============================  =======================================  ==============================
  the run                       the dir it owns                          Hydra's dir for this invocation
  ============================  =======================================  ==============================
  fresh                         the one given, else Hydra's, else a new  is the run dir
                                ``outputs/DATE/TIME``
  ``resume=PATH`` / ``auto``    the checkpoint's own run dir (a file     its log moves into the run dir,
  (a checkpoint in a run dir)   copied elsewhere: as a fresh run)        its ``.hydra`` files go to
                                                                         ``resumes/<time>/``; then removed
  a sweep's job                 as above, each job its own               ``hydra.sweep.dir/<job number>``
  a torchrun job                rank 0 decides and tells the other ranks (``factory.serve_rank``); they
                                log to ``ranks/<rank>.log`` there (``log_file``); Hydra's is rank 0's
  ============================  =======================================  ==============================

  ``Placement.claim`` then locks the dir (refusing one a live run holds, or where another run
  already trained), and ``record_invocation``/``abandon_hydra_dir`` carry out Hydra's part.
- ``claim_unique(path)``: the first of ``PATH``, ``PATH_1``, ``PATH_2``, ... that did not exist,
  created with one ``mkdir`` (atomic), so runs started in the same second get dirs of their own.
  The CLI's default ``hydra.run.dir`` and ``hydra.sweep.dir`` go through it (``unique_dir``).
- ``RunDirLock.acquire(run_dir)``: an exclusive ``flock`` on ``<run_dir>/run.lock``, which records
  the owner's pid, host and start time. The kernel drops the lock when its process dies (even by
  SIGKILL), so a dead run's lock is taken over, never obeyed forever; a live run's is refused.
  ``lock_held(run_dir)`` asks whether a live process holds it, without taking it.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import logging
import os
import shutil
import socket
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from rltrain import checkpoint, process_groups
from rltrain.errors import RunDirError

LOCK_FILE = "run.lock"
HYDRA_FILES = ".hydra"  # Hydra's own record of a run (config, overrides), written once the run dir is ours
RESUMES = "resumes"  # a resumed run's later invocations: resumes/<time>/.hydra
_HYDRA_DIR = "hydra_dir"  # rank 0 -> other ranks: the run dir Hydra made
# What a run that trained leaves in its dir; a fresh run never starts in a dir that holds one of
# them (a summary.json alone is a run that failed to start: a fresh run may take its place).
RUN_FILES = ("metrics.jsonl", "checkpoints")


@dataclass(frozen=True)
class Placement:
    """Where a run lives (``place`` decides): ``path``, the dir it owns; ``checkpoint``, the file it
    resumes from (None: fresh); ``in_place``, whether that file is in ``path`` (the run continues
    there); ``hydra_dir``, the dir Hydra made for this invocation (None outside Hydra)."""

    path: Path
    checkpoint: Path | None = None
    in_place: bool = False
    hydra_dir: Path | None = None

    def claim(self) -> RunDirLock:
        """Lock ``path`` for this run; a dir a live run holds is refused (RunDirError), and so is one
        where another run already trained, unless this run continues it."""
        lock = RunDirLock.acquire(self.path)
        if not self.in_place and (taken := earlier_run_in(self.path)):
            lock.release()
            how = (f"continue it with resume={self.path}" if checkpoint.listing(self.path) else
                   "it has no checkpoint to resume from: remove the dir")
            raise RunDirError(f"{self.path} already holds a run ({', '.join(taken)}); {how}, or give this run "
                              "another hydra.run.dir")
        return lock


def place(resume: str | None, config: dict, run_dir: str | Path | None = None) -> Placement:
    """The dir a run owns (the table in this module's docstring): the run dir of the checkpoint that
    ``resume`` designates (``checkpoint.find``: a path, or ``auto``, the newest run of the same
    ``config`` under the runs' root), else ``run_dir``, else Hydra's output dir, else a new
    ``outputs/DATE/TIME``. Raises CheckpointError for a ``resume`` that designates nothing."""
    hydra_dir = hydra_output_dir()
    found = checkpoint.find(resume, config, _runs_root(run_dir or hydra_dir))
    own = run_dir_of(found) if found else None
    if own is not None:
        return Placement(own, found, in_place=True, hydra_dir=hydra_dir)
    if run_dir is None:
        run_dir = hydra_dir or claim_unique(Path("outputs") / datetime.now().strftime("%Y-%m-%d/%H-%M-%S"))
    return Placement(Path(run_dir), found, in_place=False, hydra_dir=hydra_dir)


def hydra_output_dir() -> Path | None:
    """The dir Hydra made for this invocation, or None outside a Hydra app."""
    return Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else None


def run_dir_of(checkpoint_file: Path) -> Path | None:
    """The run dir a checkpoint file belongs to (``<run_dir>/checkpoints/<file>``); None for a file
    elsewhere (a copied checkpoint starts a new run dir)."""
    path = checkpoint_file.resolve()
    return path.parent.parent if path.parent.name == checkpoint.DIRNAME else None


def _runs_root(run_dir: str | Path | None) -> Path:
    """Where resume=auto looks for earlier runs: the top dir of the run dirs below the working dir
    (``outputs/``), else the run dir's parent (its siblings)."""
    if run_dir is None:
        return Path("outputs").resolve()
    cwd, absolute = Path.cwd().resolve(), Path(run_dir).resolve()
    if cwd in absolute.parents and absolute.parent != cwd:
        return cwd / absolute.relative_to(cwd).parts[0]
    return absolute.parent


def record_invocation(cfg: DictConfig, run_dir: Path) -> None:
    """Once the run owns ``run_dir``: Hydra's files of this invocation go there (``.hydra/``, or
    ``resumes/<time>/.hydra/`` when the run continues a dir other than the one Hydra made, whose log
    then follows into the run dir and which is removed)."""
    hydra_dir = hydra_output_dir()
    if hydra_dir is None:
        return
    elsewhere = run_dir.resolve() != hydra_dir.resolve()
    try:  # bookkeeping only: if it fails, the run itself goes on
        _save_hydra_files(cfg, run_dir / RESUMES / datetime.now().strftime("%Y-%m-%d_%H-%M-%S-%f")
                          if elsewhere else run_dir)
        if elsewhere:
            _follow_into(run_dir, hydra_dir)
    except OSError as e:
        logging.getLogger("rltrain").warning("could not record this invocation's Hydra files or log in %s: %s",
                                             run_dir, e)


def abandon_hydra_dir() -> None:
    """A run refused before it owned a dir logs nothing into Hydra's (it may be another run's dir),
    and Hydra's is removed if this invocation made it for nothing."""
    hydra_dir = hydra_output_dir()
    if hydra_dir is None:
        return
    for handler in _log_files(hydra_dir):
        logging.getLogger().removeHandler(handler)
        handler.close()
    _discard_if_unused(hydra_dir)


def _save_hydra_files(cfg: DictConfig, where: Path) -> None:
    """What Hydra would write to ``.hydra/`` (config.yaml, hydra.yaml, overrides.yaml), written
    only now that the run dir is this run's (config.yaml sets hydra.output_subdir: null)."""
    folder = where / HYDRA_FILES
    folder.mkdir(parents=True, exist_ok=True)
    hydra_cfg = HydraConfig.instance().cfg
    (folder / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    (folder / "hydra.yaml").write_text(OmegaConf.to_yaml(hydra_cfg))
    (folder / "overrides.yaml").write_text(OmegaConf.to_yaml(hydra_cfg.hydra.overrides.task))


def _follow_into(run_dir: Path, hydra_dir: Path) -> None:
    """The log file goes on in the run dir (with what this invocation logged so far), and the dir
    Hydra made for this invocation is removed."""
    for handler in _log_files(hydra_dir):
        handler.close()
        old_log = Path(handler.baseFilename)
        handler.baseFilename = str(run_dir.resolve() / old_log.name)  # reopened in append mode
        with open(handler.baseFilename, "a") as f:
            f.write(old_log.read_text() if old_log.exists() else "")
    _discard_if_unused(hydra_dir)


def _log_files(folder: Path) -> list[logging.FileHandler]:
    return [h for h in logging.getLogger().handlers
            if isinstance(h, logging.FileHandler) and Path(h.baseFilename).parent == folder.resolve()]


def _discard_if_unused(folder: Path) -> None:
    """Remove ``folder`` if it holds nothing but log files, and its parents below the working dir
    that it leaves empty."""
    if not folder.is_dir() or any(p.suffix != ".log" for p in folder.iterdir()):
        return
    shutil.rmtree(folder)
    cwd, parent = Path.cwd().resolve(), folder.resolve().parent
    while parent != cwd and cwd in parent.parents and not any(parent.iterdir()):
        parent.rmdir()
        parent = parent.parent


def claim_unique(path: str | Path) -> Path:
    """Create and return ``path``, or ``path_1``, ``path_2``, ... if taken (by any process)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for n in itertools.count():
        candidate = path if n == 0 else path.with_name(f"{path.name}_{n}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        return candidate
    raise AssertionError("unreachable")


def unique_dir(path: str) -> str:
    """The ``rltrain.unique_dir`` resolver of the default run and sweep dirs (cached by OmegaConf,
    so every read of one config gets the dir it claimed). In a torchrun job rank 0 claims it and
    every other rank takes rank 0's (their clocks, and so ``${now:...}``, may differ)."""
    world = process_groups.current()
    if world is None:
        return str(claim_unique(path))
    if world.rank == 0:
        claimed = str(claim_unique(path).resolve())
        world.store.set(_HYDRA_DIR, claimed)
        return claimed
    return process_groups.wait_for_key(world.store, _HYDRA_DIR, 120.0).decode()


def log_file(path: str) -> str:
    """The ``rltrain.log_file`` resolver of Hydra's log file: ``path`` on rank 0 (or outside a
    torchrun job); the other ranks log to ``ranks/<rank>.log`` in the run dir once they know it."""
    world = process_groups.current()
    return path if world is None or world.rank == 0 else os.devnull


def earlier_run_in(run_dir: Path) -> list[str]:
    """The files of another run in ``run_dir`` (for a fresh run, that dir is taken)."""
    return [name for name in RUN_FILES if (Path(run_dir) / name).exists()]


class RunDirLock:
    """Held by the one live run of a run dir; ``release`` removes the lock file."""

    def __init__(self, fd: int, path: Path):
        self._fd: int | None = fd
        self.path = path

    @classmethod
    def acquire(cls, run_dir: str | Path) -> RunDirLock:
        """Lock ``run_dir`` (created if needed), or raise RunDirError naming the live owner."""
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / LOCK_FILE
        # A listener (rltrain.sync.listen) probes a dir's lock with a shared flock of microseconds:
        # a lock held that briefly is waited for; a live run holds its lock for its whole life.
        patience = time.monotonic() + 0.1
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() < patience:
                    os.close(fd)
                    time.sleep(0.01)
                    continue
                owner = _describe_owner(fd)
                os.close(fd)
                raise RunDirError(
                    f"{run_dir} is in use by a live run ({owner}); a run dir belongs to one run at a time. "
                    "Wait for it to finish or stop it, or give this run another hydra.run.dir") from None
            # The owner we waited on may have released (and unlinked) the file between our open and
            # our flock: then the lock we hold is on a file nobody else sees. Try again on the new one.
            try:
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        since = datetime.now().isoformat(timespec="seconds")
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "since": since}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(owner) + "\n").encode(), 0)
        return cls(fd, path)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)  # while still locked: nobody can have locked it meanwhile
        os.close(self._fd)
        self._fd = None


def lock_held(run_dir: Path) -> bool:
    """Whether a live process holds the run dir's lock (an flock the kernel drops when its holder
    dies). Probed with a shared lock, dropped at once; a live run's is never free, so the probe only
    meets a run starting in a dir whose run is over, for a few microseconds (``acquire`` waits that out)."""
    try:
        fd = os.open(Path(run_dir) / LOCK_FILE, os.O_RDONLY)
    except FileNotFoundError:  # released (RunDirLock.release removes it), or never taken
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:  # held (or a file system that cannot tell: then the waits' timeouts still end them)
        return True
    finally:
        os.close(fd)
    return False


def _describe_owner(fd: int) -> str:
    try:
        owner = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        owner = {}
    if "pid" not in owner:
        return "its owner has not written its pid yet"
    return f"pid {owner['pid']} on {owner.get('host', '?')}, since {owner.get('since', '?')}"
