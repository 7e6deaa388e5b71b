"""How rltrain's processes take a stop request (SIGINT from Ctrl-C, SIGTERM from a scheduler):
at once while a run starts, after the step under way once it runs (a second signal: at once).

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
    """A first signal calls ``on_request(signum)`` (the caller stops at its next boundary); a
    second one raises KeyboardInterrupt: stop at once."""
    requested = []

    def handle(signum, frame):
        first = not requested
        requested.append(signum)
        on_request(signal.Signals(signum))
        if not first:
            raise KeyboardInterrupt

    with _handled_by(handle):
        yield


@contextmanager
def _handled_by(handle: Callable) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():  # only the main thread takes signals
        yield
        return
    previous = {s: signal.signal(s, handle) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)


class StopRequested(Exception):
    """Raised by a part that cut its work short (an evaluation) because a stop was requested: the
    run stops there, as it does between two batches."""
