"""Processes the learner spawns and talks to over a pipe (collector workers, the vLLM engine, the benchmarks'
engines): started, waited for with a bound, named when they raise or die, and stopped.

Messages are tuples tagged by their first item. A child that fails sends ``("error", what, traceback)``
(``rltrain.errors.send_failure``); ``("doing", what)`` tells the learner what it is doing now (for the
messages); ``("close",)`` asks it to stop. Only the standard library and ``rltrain.errors`` are imported
here: the children's own imports stay theirs.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable, Iterable
from multiprocessing.connection import wait
from typing import NoReturn

from rltrain.errors import RunError

_LOOK_S = 1.0  # a wait looks at its deadline at least this often
_WAKE_S = 0.5  # a child waiting for a request looks this often whether its parent is still there
_KILLED_S = 5.0  # how long a killed child has to be gone


class ChildProcess:
    """``target(conn, *args)`` in a new process (``method``: multiprocessing's start method), with
    ``environment`` set while it starts (None: left as it is); ``conn`` is the learner's end of its pipe.

    What goes wrong raises ``error``, naming the child as ``who`` (``the vLLM engine``, ``collector worker
    2``) with its pid and what it is ``doing`` (set by the learner, or by the child's ``doing`` messages;
    ``task`` when a child dies while doing is None). ``exit_hint``: what an exit code other than 0 or
    SIGKILL's suggests."""

    def __init__(
        self,
        target: Callable,
        args: tuple,
        who: str,
        *,
        name: str | None = None,
        method: str = "spawn",
        environment: dict[str, str | None] | None = None,
        error: type[RunError] = RunError,
        task: str | None = None,
        exit_hint: str = "",
    ):
        self.who, self.error, self.task, self.exit_hint = who, error, task, exit_hint
        self.doing: str | None = "starting"
        self.kept: dict[str, tuple] = {}  # messages set aside by a wait for another (``wait_for``'s ``keep``)
        ctx = mp.get_context(method)
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=target, args=(child, *args), name=name, daemon=True)
        try:
            # a spawned child reads some variables as it imports (OpenMP's, when torch loads), before any code of ours
            with temporary_environment(**(environment or {})):
                self.process.start()
        finally:
            child.close()

    @property
    def pid(self) -> int:
        return self.process.pid

    def send(self, msg: tuple, doing: str | None = None) -> None:
        """Send ``msg``, after which the child is ``doing`` (if given); raises ``error`` if the child is gone."""
        if doing is not None:
            self.doing = doing
        try:
            self.conn.send(msg)
        except OSError:  # the child's end is gone
            self.raise_dead()

    def wait_for(self, answer: str, timeout_s: float, timeout_key: str | None = None,
                 keep: tuple[str, ...] = ()) -> tuple:
        """The child's next ``answer`` message; raises ``error`` once it fails, dies, sends another tag
        (but one in ``keep``, set aside in ``kept``) or takes over ``timeout_s`` (the config key
        ``timeout_key``, named in the message)."""
        deadline = time.monotonic() + timeout_s
        while not (got := answers([self], answer, deadline, keep)):
            if time.monotonic() > deadline:
                key = f" ({timeout_key})" if timeout_key else ""
                fix = f": raise {timeout_key}" if timeout_key else ""
                raise self.error(f"{self.who} (pid {self.pid}) did not answer within {timeout_s:g}s while "
                                 f"{self.doing}{key}; it is alive but stuck, or slower than that{fix}")
        return got[0][1]

    def raise_dead(self) -> NoReturn:
        """Raise ``error`` naming the child as dead: its pid, its exit code or signal, what it was doing."""
        self.process.join(timeout=1.0)
        code = self.process.exitcode
        how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        hint = ("; SIGKILL often comes from the out-of-memory killer (see dmesg)" if code == -signal.SIGKILL else
                f"; {self.exit_hint}" if self.exit_hint and code not in (None, 0) else "")
        doing = self.doing or self.task
        raise self.error(f"{self.who} (pid {self.pid}) died ({how}){f' while {doing}' if doing else ''}{hint}")

    def close(self, timeout_s: float = 10.0) -> None:
        """``close_all`` of this one child."""
        close_all([self], timeout_s)


def answers(children: Iterable[ChildProcess], answer: str, deadline: float,
            keep: tuple[str, ...] = ()) -> list[tuple[ChildProcess, tuple]]:
    """The ``answer`` messages some of ``children`` sent, as (child, message), waiting up to ``deadline``
    (``time.monotonic()``'s), but at most a second, for the first; [] if none came. A child that failed,
    died or sent another tag raises its ``error``; ``("doing", what)`` sets its ``doing``, a tag in ``keep``
    is set aside in its ``kept``."""
    by_handle = {}
    for child in children:
        by_handle[child.conn] = by_handle[child.process.sentinel] = child
    got = []
    for handle in wait(list(by_handle), timeout=max(0.0, min(_LOOK_S, deadline - time.monotonic()))):
        child = by_handle[handle]
        if handle is not child.conn:
            if not child.conn.poll():  # died with nothing left to say
                child.raise_dead()
            continue
        try:
            msg = child.conn.recv()
        except (EOFError, OSError):
            child.raise_dead()
        if msg[0] == "doing":
            child.doing = msg[1]
        elif msg[0] == "error":
            doing = f" while {child.doing}" if child.doing else ""
            raise child.error(f"{child.who} (pid {child.pid}) failed{doing}: {msg[1]}", details=msg[2])
        elif msg[0] == answer:
            got.append((child, msg))
        elif msg[0] in keep:
            child.kept[msg[0]] = msg
        else:  # out of step: never take an answer for another's
            raise child.error(f"{child.who} sent {msg[0]!r} while the learner waited for {answer!r}")
    return got


def close_all(children: Iterable[ChildProcess], timeout_s: float) -> None:
    """Ask each child to stop, wait up to ``timeout_s`` for them all, then kill those still running; safe to
    call twice."""
    children = [child for child in children if not child.conn.closed]
    for child in children:
        try:
            child.conn.send(("close",))
        except OSError:
            pass
    deadline = time.monotonic() + timeout_s
    for child in children:
        child.process.join(timeout=max(0.0, deadline - time.monotonic()))
    for child in children:
        if child.process.is_alive():
            child.process.kill()
            child.process.join(timeout=_KILLED_S)
        child.conn.close()


@contextlib.contextmanager
def temporary_environment(**values: str | None):
    """``values`` in os.environ while the block runs (None: as it is), then as they were."""
    before = {key: os.environ.get(key) for key in values}
    os.environ.update({key: value for key, value in values.items() if value is not None})
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# --- the child's side -----------------------------------------------------------------------------------------------

def die_with_parent() -> None:
    """SIGKILL this process when its parent dies, even in the middle of a long call (Linux; elsewhere
    ``next_request`` notices between requests)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def next_request(conn) -> tuple | None:
    """The learner's next request on ``conn``; None on ``("close",)``, or once the learner is gone."""
    parent = mp.parent_process()
    while not conn.poll(_WAKE_S):
        if parent is not None and not parent.is_alive():
            return None
    try:
        msg = conn.recv()
    except (EOFError, OSError):
        return None
    return None if msg[0] == "close" else msg
