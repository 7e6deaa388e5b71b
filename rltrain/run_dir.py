"""Who owns a run dir: one live run at a time, and default dirs that two runs never share.

- ``claim_unique(path)``: the first of ``PATH``, ``PATH_1``, ``PATH_2``, ... that did not exist,
  created with one ``mkdir`` (atomic), so runs started in the same second get dirs of their own.
  The CLI's default ``hydra.run.dir`` and ``hydra.sweep.dir`` go through it (``unique_dir``).
- ``RunDirLock.acquire(run_dir)``: an exclusive ``flock`` on ``<run_dir>/run.lock``, which records
  the owner's pid, host and start time. The kernel drops the lock when its process dies (even by
  SIGKILL), so a dead run's lock is taken over, never obeyed forever; a live run's is refused.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import socket
import time
from datetime import datetime
from pathlib import Path

from rltrain import distributed
from rltrain.errors import RunDirError

LOCK_FILE = "run.lock"
_HYDRA_DIR = "hydra_dir"  # rank 0 -> other ranks: the run dir Hydra made
# What a run that trained leaves in its dir; a fresh run never starts in a dir that holds one of
# them (a summary.json alone is a run that failed to start: a fresh run may take its place).
RUN_FILES = ("metrics.jsonl", "checkpoints")


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
    world = distributed.current()
    if world is None:
        return str(claim_unique(path))
    if world.rank == 0:
        claimed = str(claim_unique(path).resolve())
        world.store.set(_HYDRA_DIR, claimed)
        return claimed
    return distributed.wait_for_key(world.store, _HYDRA_DIR, 120.0).decode()


def log_file(path: str) -> str:
    """The ``rltrain.log_file`` resolver of Hydra's log file: ``path`` on rank 0 (or outside a
    torchrun job); the other ranks log to ``ranks/<rank>.log`` in the run dir once they know it."""
    world = distributed.current()
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


def _describe_owner(fd: int) -> str:
    try:
        owner = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        owner = {}
    if "pid" not in owner:
        return "its owner has not written its pid yet"
    return f"pid {owner['pid']} on {owner.get('host', '?')}, since {owner.get('since', '?')}"
