"""Calls that may never return (a wait in a collective whose peer died), run aside on a daemon thread and
waited for with a bound, so that they cannot hold up the caller or the process's exit."""

from __future__ import annotations

import threading
from collections.abc import Callable


class Aside:
    """A call running on a daemon thread of its own: one that may never return (a wait in a collective
    whose peer died) must not hold up the process's exit."""

    def __init__(self, call: Callable, *args):
        self._outcome: list = []
        self._thread = threading.Thread(target=self._run, args=(call, *args), name="rltrain-vllm-call", daemon=True)
        self._thread.start()

    def _run(self, call, *args):
        try:
            self._outcome.append((True, call(*args)))
        except BaseException as e:  # noqa: BLE001  (raised in the caller's thread)
            self._outcome.append((False, e))

    def done(self, wait_s: float = 0.0) -> bool:
        self._thread.join(wait_s)
        return not self._thread.is_alive()

    def raise_if_failed(self) -> None:
        if self._outcome and not self._outcome[0][0]:
            raise self._outcome[0][1]

    def result(self, timeout_s: float):
        if not self.done(timeout_s):
            raise TimeoutError(f"no answer within {timeout_s:g}s")
        ok, value = self._outcome[0]
        if not ok:
            raise value
        return value
