"""Where a function-level case runs: in this process, or in a worker process of another Python
(a peer installed in its own venv). Both answer the same three calls, so a category alternates
rounds between libraries without caring where each lives.

A case is ``"module:function"`` plus keyword arguments; the function builds everything and
returns the zero-argument step that is timed (what the step returns is the case's output, e.g.
advantages to compare between libraries). The worker (``python -m benchmarks.runner``) speaks
one JSON object per line on stdin/stdout and imports nothing but the case's module.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import subprocess
import sys
import tempfile
import time
import traceback

from benchmarks.core import ROOT, time_calls

REPLY_TIMEOUT_S = 600  # the longest a case's setup or one round may take


def build(ref: str, kwargs: dict):
    module, function = ref.split(":")
    return getattr(importlib.import_module(module), function)(**kwargs)


def as_json(value):
    """A case's output as plain lists (tensors and arrays included)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [as_json(v) for v in value]
    return value


class LocalRunner:
    """Runs cases in this process. ``setup`` returns a handle for the step it built."""

    where = "this process"

    def __init__(self, threads: int | None = None):
        if threads is not None:
            import torch

            torch.set_num_threads(threads)
        self.steps: dict[int, object] = {}

    def setup(self, ref: str, **kwargs) -> int:
        handle = len(self.steps)
        self.steps[handle] = build(ref, kwargs)
        return handle

    def time(self, handle: int, reps: int, per_call: int = 1) -> list[float]:
        return time_calls(self.steps[handle], reps, per_call)

    def output(self, handle: int):
        return as_json(self.steps[handle]())

    def rate(self, handle: int, seconds: float) -> float:
        """Calls of a step that returns how many frames it produced, for ``seconds``: frames per second."""
        step, frames = self.steps[handle], 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            frames += step()
        return frames / (time.perf_counter() - t0)

    def drop(self, handle: int) -> None:
        step = self.steps.pop(handle, None)
        if hasattr(step, "close"):  # a case that started processes stops them
            step.close()

    def close(self) -> None:
        for handle in list(self.steps):
            self.drop(handle)


class ProcessRunner:
    """Runs cases in a worker process of ``python`` (another venv), one request at a time."""

    def __init__(self, python: str, threads: int):
        self.where = python
        env = {**os.environ, "PYTHONPATH": str(ROOT), "BENCH_THREADS": str(threads)}
        self.stderr = tempfile.TemporaryFile("w+")  # a file, not a pipe: what libraries print cannot fill it
        self.proc = subprocess.Popen([python, "-m", "benchmarks.runner"], cwd=ROOT, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr)
        self._call({"op": "ping"})

    def _call(self, request: dict):
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while True:
            ready, _, _ = select.select([self.proc.stdout], [], [], 1.0)
            if ready:
                line = self.proc.stdout.readline()
                if line:
                    break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                self.stderr.seek(0)
                raise RuntimeError(f"the worker of {self.where} {'died' if self.proc.poll() else 'timed out'}: "
                                   f"{self.stderr.read()[-2000:]}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"in {self.where}: {reply['error']}")
        return reply["result"]

    def setup(self, ref: str, **kwargs) -> int:
        return self._call({"op": "setup", "ref": ref, "kwargs": kwargs})

    def time(self, handle: int, reps: int, per_call: int = 1) -> list[float]:
        return self._call({"op": "time", "handle": handle, "reps": reps, "per_call": per_call})

    def output(self, handle: int):
        return self._call({"op": "output", "handle": handle})

    def rate(self, handle: int, seconds: float) -> float:
        return self._call({"op": "rate", "handle": handle, "seconds": seconds})

    def drop(self, handle: int) -> None:
        self._call({"op": "drop", "handle": handle})

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.stderr.close()


def worker() -> None:
    """The worker's loop: one request per line, one reply per line."""
    replies, sys.stdout = sys.stdout, sys.stderr  # what a library prints must not mix with the replies
    local = LocalRunner(int(os.environ.get("BENCH_THREADS", "1")))
    for line in sys.stdin:
        request = json.loads(line)
        try:
            op = request.pop("op")
            if op == "ping":
                result = "pong"
            elif op == "setup":
                result = local.setup(request["ref"], **request["kwargs"])
            else:
                result = getattr(local, op)(**request)
            reply = {"result": result}
        except Exception:  # noqa: BLE001  the parent reports it beside the case
            reply = {"error": traceback.format_exc(limit=4)}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    worker()
