"""How rltrain's processes take a stop request (SIGINT from Ctrl-C, SIGTERM from a scheduler):
at once while a run starts, after the step under way once it runs (a second Ctrl-C: at once).

A scheduler or torchrun signals every process of a job together; the process that saves the run
(the learner) decides when the others stop, so those that serve it defer the signal too.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Seen:
    """The signal that stopped a process at once (Ctrl-C's if no handler saw one)."""

    signum: signal.Signals = signal.SIGINT


@contextmanager
def at_once() -> Iterator[Seen]:
    """SIGTERM stops at once, as Ctrl-C does (KeyboardInterrupt), so that whatever was started is
    closed again; the signal is recorded in the yielded ``Seen``."""
    seen = Seen()

    def handle(signum, frame):
        seen.signum = signal.Signals(signum)
        raise KeyboardInterrupt

    with _handled_by(handle):
        yield seen


@contextmanager
def after_step(on_request: Callable[[signal.Signals], None]) -> Iterator[None]:
    """Every stop signal calls ``on_request(signum)`` (the caller stops at its next boundary). A
    second Ctrl-C (SIGINT) stops at once, through the handler that was there before (the CLI's:
    KeyboardInterrupt, exit code 130). A repeated SIGTERM does not: under ``srun torchrun`` every
    process gets one from SLURM and one forwarded by torchrun, and a scheduler that will not wait
    sends SIGKILL."""
    requested: list[int] = []
    previous: dict = {}

    def handle(signum, frame):
        again = signum == signal.SIGINT and bool(requested)  # Ctrl-C after any stop request
        requested.append(signum)
        on_request(signal.Signals(signum))
        if again:
            before = previous.get(signum)
            if callable(before):
                before(signum, frame)
            raise KeyboardInterrupt

    with _handled_by(handle) as before:
        previous.update(before)
        yield


@contextmanager
def _handled_by(handle: Callable) -> Iterator[dict]:
    """``handle`` for both stop signals, yielding the handlers it replaced (put back at the end). The
    signals are blocked while handlers change, so that none lands between the two and is lost to
    the wrong handler, or leaves one behind."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread takes signals
        yield {}
        return
    with _blocked():
        previous = {s: signal.signal(s, handle) for s in STOP_SIGNALS}
    try:
        yield previous
    finally:
        with _blocked():
            for s, handler in previous.items():
                signal.signal(s, handler if handler is not None else signal.SIG_DFL)


@contextmanager
def _blocked() -> Iterator[None]:
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)  # a signal that came meanwhile is handled now


class StopRequested(Exception):
    """Raised by a part that cut its work short (an evaluation) because a stop was requested: the
    run stops there, as it does between two batches."""
