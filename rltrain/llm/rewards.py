"""Reward functions of verifiable tasks: ``(prompt, completion, **row) -> float``, where ``row`` is
every other key of the task's row (``answer``, a dataset's columns).

Built in: ``correct_answer`` (the extracted answer equals the reference: 1, else 0),
``digits_in_place`` (partial credit: the share of the answer's characters in place),
``follows_format`` (the completion is an answer and nothing else, ended where it should be) and
``length_penalty`` (minus the share of ``max_chars`` the completion uses beyond the answer).
``Rewards`` weighs several (a user's own by ``_target_`` among them), reports each one's value, and
names the function and the prompt when one raises or returns something that is not a finite number.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import numbers
import re
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from rltrain.errors import ConfigError, RunError
from rltrain.rules import Number

_NUMBER = re.compile(r"-?\d+")


def extract_answer(completion: str) -> str | None:
    """The answer a completion gives: its first integer (``-12``, ``0042``), or None."""
    m = _NUMBER.search(completion)
    return m.group(0) if m else None


def correct_answer(prompt: str, completion: str, answer: str, **row) -> float:
    """1.0 when the completion's first integer equals the reference answer (as integers), else 0.0."""
    given = extract_answer(completion)
    return float(given is not None and int(given) == int(answer))


def digits_in_place(prompt: str, completion: str, answer: str, **row) -> float:
    """Partial credit: the share of the answer's characters that the completion has at the same
    place (``1284`` against ``1248``: 0.5), so that a multi-token answer rewards every right token."""
    given = completion.strip()[:len(answer)]
    return sum(a == b for a, b in zip(given, answer)) / len(answer)


def follows_format(prompt: str, completion: str, **row) -> float:
    """1.0 when the completion is one integer and nothing else (surrounding spaces allowed), else 0.0."""
    return float(_NUMBER.fullmatch(completion.strip()) is not None)


def length_penalty(prompt: str, completion: str, max_chars: int = 16, **row) -> float:
    """Minus the share of ``max_chars`` that the completion spends beyond its first integer, in [-1, 0]."""
    given = extract_answer(completion) or ""
    extra = max(0, len(completion.strip()) - len(given))
    return -min(1.0, extra / max_chars)


class Rewards:
    """Several reward functions with their weights: ``total`` is the weighted sum, and ``each``
    every function's own value (logged as ``reward/<name>``).

    A function's configured arguments (``functools.partial`` keywords: the other keys of its
    ``env.rewards`` node) must be parameters it names, and win over the row: a column of the same name
    is refused by ``check_rows``, as is a row that lacks a column a function reads. Each call may take
    ``timeout_s`` seconds (in the main thread; None: no bound), so a reward that hangs fails the run
    rather than holding it, and a stop request, forever."""

    TIMEOUT_S = 30.0  # env.reward_timeout_s where a task's config has none

    def __init__(self, functions: Mapping[str, Callable], weights: Mapping[str, float] | None = None,
                 timeout_s: float | None = TIMEOUT_S, required: bool = True):
        """``required``: at least one function (a language environment's own rewards may stand alone)."""
        weights = dict(weights or {})
        if not functions and required:
            raise ConfigError("env.rewards is empty; name at least one reward function")
        for name, fn in functions.items():
            if not callable(fn):
                raise ConfigError(f"env.rewards.{name} is not callable ({fn!r}); give a function "
                                  "(prompt, completion, **row) -> float, by _target_ or name")
        if unknown := sorted(set(weights) - set(functions)):
            raise ConfigError(f"env.reward_weights names {', '.join(unknown)}, which env.rewards does not have "
                              f"(it has {', '.join(functions)})")
        REWARD_TIMEOUT.check("env.reward_timeout_s", timeout_s)
        self.functions = dict(functions)
        self.weights = {name: float(weights.get(name, 1.0)) for name in functions}
        self.timeout_s = timeout_s
        self._arguments = {name: Arguments.of(name, fn) for name, fn in functions.items()}

    def check_rows(self, rows: Iterable[Mapping], where: str) -> None:
        """Refuse, before anything starts, rows the functions cannot be called with: a row without a
        column a function reads, or with a column named like a configured argument. ``where`` names the
        rows in the message (``the eval split of env.path=...``)."""
        for n, row in enumerate(rows, 1):
            for args in self._arguments.values():
                args.check_row(row, n, where)

    def __call__(self, prompt: str, completion: str, row: Mapping) -> tuple[float, dict[str, float]]:
        """The weighted total and each function's value for one completion of ``prompt``."""
        each = {}
        for name, fn in self.functions.items():
            extra = {k: v for k, v in row.items() if k != "prompt" and k not in self._arguments[name].configured}
            try:
                with time_limit(self.timeout_s):
                    value = fn(prompt, completion, **extra)
            except RewardTimeout:
                raise RunError(f"reward function {name} took longer than env.reward_timeout_s={self.timeout_s} s on "
                               f"the prompt {prompt!r} and the completion {completion!r}; raise "
                               "env.reward_timeout_s if it is only slow") from None
            except Exception as e:  # noqa: BLE001  (a user's function: name it, and the prompt)
                raise RunError(f"reward function {name} raised {type(e).__name__}: {e} on the prompt "
                               f"{prompt!r} and the completion {completion!r}") from e
            number = as_reward(value)
            if number is None:
                raise RunError(f"reward function {name} returned {value!r} on the prompt {prompt!r}; a reward is "
                               "a finite real number")
            each[name] = number
        return sum(self.weights[name] * v for name, v in each.items()), each


REWARD_TIMEOUT = Number(above=0, null="no bound")  # env.reward_timeout_s


def as_reward(value) -> float | None:
    """``value`` as a reward: any finite real number (int, float, bool, numpy's and torch's number types, a
    one-element array or tensor); None for anything else."""
    if getattr(value, "ndim", None) == 0 or (getattr(value, "shape", None) == (1,) and hasattr(value, "item")):
        value = value.item()  # numpy scalars, 0-d arrays and tensors
    if not isinstance(value, numbers.Real):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class Arguments:
    """What a reward function takes beyond ``(prompt, completion)``: the arguments the config gives it
    (``configured``) and the row columns it must have (``reads``: named parameters without a default)."""

    name: str
    configured: frozenset[str]
    reads: frozenset[str]

    @classmethod
    def of(cls, name: str, fn: Callable) -> Arguments:
        target, configured = (fn.func, dict(fn.keywords)) if isinstance(fn, functools.partial) else (fn, {})
        try:
            params = list(inspect.signature(target).parameters.values())
        except (TypeError, ValueError):  # a builtin without a signature: nothing to check
            return cls(name, frozenset(configured), frozenset())
        # After prompt and completion (given by position, whatever their kind), what a keyword can reach.
        row_params = [p for p in params[2:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if unknown := sorted(set(configured) - {p.name for p in row_params}):
            takes = ", ".join(p.name for p in row_params) or "none beyond (prompt, completion, **row)"
            raise ConfigError(f"env.rewards.{name}.{unknown[0]}: {getattr(target, '__name__', target)} takes no "
                              f"argument {unknown[0]!r} (its arguments: {takes}); a misspelling would leave the "
                              "default in use. Remove it or name one of those")
        reads = {p.name for p in row_params if p.default is p.empty and p.name not in configured}
        return cls(name, frozenset(configured), frozenset(reads))

    def check_row(self, row: Mapping, n: int, where: str) -> None:
        if missing := sorted(self.reads - set(row)):
            raise ConfigError(f"env.rewards.{self.name} reads the column {missing[0]!r}, which row {n} of {where} "
                              f"lacks (its columns: {', '.join(k for k in row if k != 'prompt') or 'none'}); add "
                              "it to those rows, or give the function a default for it")
        if both := sorted(self.configured & set(row)):
            raise ConfigError(f"env.rewards.{self.name}.{both[0]} is configured, and {where} has a column "
                              f"{both[0]!r} too (row {n}): the function would get one of them silently; rename "
                              "the column, or remove the configured argument")


class RewardTimeout(BaseException):
    """A reward function ran past ``env.reward_timeout_s`` (a BaseException: a function's own ``except
    Exception`` must not turn it into a reward)."""


@contextlib.contextmanager
def time_limit(seconds: float | None):
    """Raise RewardTimeout in the block once ``seconds`` have passed (SIGALRM; in the main thread only,
    elsewhere no bound). A timer already set (pytest-timeout's, say) is put back as it was, minus the
    time spent here."""
    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    armed = True

    def expired(signum, frame):
        if armed:  # not once the block is over: an alarm due just then is dropped
            raise RewardTimeout

    handler = signal.signal(signal.SIGALRM, expired)
    outer, interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    started = time.monotonic()
    try:
        yield
    finally:
        try:
            armed = False
            signal.setitimer(signal.ITIMER_REAL, 0)
        finally:  # the outer handler and timer back, whatever happened (its remaining time, at least a tick)
            signal.signal(signal.SIGALRM, handler)
            if outer:
                signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - started), 1e-3), interval)
