"""Tiny function-level cases for the benchmark runner's tests (run in this process or a worker)."""


def sleeper(ms: float):
    import time

    return lambda: time.sleep(ms / 1e3)


def broken():
    raise ValueError("this case cannot be built")


def counter():
    calls = []
    return lambda: calls.append(1) or len(calls)
