"""A vLLM server serves one run's weights at a time (two runs would push theirs into one model): who
claims a server (``holder``: a process, its run dir, where its pid means it), and the record the server's
worker extension keeps of the run that holds it (``ClaimLedger``). The learner's side of a claim is
``rltrain.llm.vllm.server.ServerClaim``.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import uuid
from datetime import datetime

LEASE_S = 60.0  # a holder the server cannot see live (another host or container) keeps it while it renews within this
RENEW_S = 10.0  # how often such a holder renews its claim
def holder(pid: int | None = None, run_dir: str | os.PathLike | None = None) -> dict:
    """Who claims a server: the process ``pid`` of this machine (None: this one), where its pid means it
    (this boot's pid namespace, where a server that shares it checks that it lives), its run dir (None: the
    one it holds open, if one), its command, since when; and a token of its own."""
    pid = os.getpid() if pid is None else pid
    run_dir = str(run_dir) if run_dir is not None else _run_dir(pid)
    return {"token": uuid.uuid4().hex, "pid": pid, "started": _started(pid), "where": _pid_space(),
            "host": socket.gethostname(), "run_dir": run_dir, "command": _command(pid),
            "since": datetime.now().isoformat(timespec="seconds"), "lease_s": LEASE_S}


def describe(holder: dict) -> str:
    """The run a claim names, for a message: its run dir (or command), pid, host and since when."""
    run = f"run dir {holder['run_dir']}" if holder.get("run_dir") else f"`{holder.get('command')}`"
    seen = "" if sees(holder) else (f"; from another machine or container, its claim lapses "
                                     f"{holder['lease_s']:g} s after it last renewed it")
    return f"{run}, pid {holder['pid']} on {holder['host']}, since {holder['since']}{seen}"


def in_use(url: str, holder: dict) -> str:
    return (f"engine.url={url} is in use by another run ({describe(holder)}); a vLLM server serves one "
            "run's weights at a time (no setting overrides it: two runs would push theirs into one model). Wait "
            "for that run to end or stop it, or start a second server for this run on another --port")


class ClaimLedger:
    """The worker extension's record of the run that holds its server, if any. A holder this process can
    see live (``sees``) holds it while its process lives (a pid reused since is another process: its
    start time differs); one elsewhere, while it renews its claim within its lease. vLLM runs the
    extension's RPCs one at a time: a claim is atomic."""

    def __init__(self, clock=time.monotonic):
        self._clock, self._held, self._renewed = clock, None, 0.0

    def holder(self) -> dict | None:
        """The live holder (None: the server is free); a dead or lapsed one is forgotten."""
        held = self._held
        if held is not None and not (_alive(held) if sees(held) else
                                     self._clock() - self._renewed <= held["lease_s"]):
            self._held = None
        return self._held

    def claim(self, holder: dict) -> dict | None:
        """Take the server for ``holder`` (or renew its claim); the live holder in the way, if another."""
        held = self.holder()
        if held is not None and held["token"] != holder["token"]:
            return public(held)
        self._held, self._renewed = holder, self._clock()
        return None

    def holds(self, token: str) -> bool:
        held = self.holder()
        return held is not None and held["token"] == token

    def release(self, token: str) -> None:
        if self.holds(token):
            self._held = None


def public(holder: dict | None) -> dict | None:
    """A holder as others are told of it: without the token that renews and releases its claim."""
    return None if holder is None else {k: v for k, v in holder.items() if k != "token"}


def sees(holder: dict) -> bool:
    """Whether this process can tell if ``holder``'s process lives: its pid means the same here."""
    return holder.get("where") is not None and holder["where"] == _pid_space() and holder.get("started") is not None


def _alive(holder: dict) -> bool:
    return _started(holder["pid"]) == holder["started"]


def _pid_space() -> str | None:
    """This boot's id and this process's pid namespace (None off Linux): where a pid names one process."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{f.read().strip()} {os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return None


def _started(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot); None if there is none, or only its zombie (a
    killed learner that its parent, a sweep's launcher say, has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return None if fields[0] == "Z" else int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _run_dir(pid: int) -> str | None:
    """The run dir process ``pid`` holds (the lock ``rltrain.run_dir`` keeps open while a run lasts), if one."""
    from rltrain.run_dir import LOCK_FILE

    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    held = set()
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.endswith(f"/{LOCK_FILE}"):
            held.add(os.path.dirname(target))
    return held.pop() if len(held) == 1 else None


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")[:-1]
    except OSError:
        argv = sys.argv if pid == os.getpid() else []
    argv = argv or ["?"]  # (empty while a process just started execs its program, or is a zombie)
    argv[0] = os.path.basename(argv[0])
    command = " ".join(argv)
    return command if len(command) <= 200 else command[:197] + "..."


