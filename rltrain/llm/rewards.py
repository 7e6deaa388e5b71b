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

import math
import re
from collections.abc import Callable, Mapping

from rltrain.errors import ConfigError, RunError

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
    every function's own value (logged as ``reward/<name>``)."""

    def __init__(self, functions: Mapping[str, Callable], weights: Mapping[str, float] | None = None):
        weights = dict(weights or {})
        if not functions:
            raise ConfigError("env.rewards is empty; name at least one reward function")
        for name, fn in functions.items():
            if not callable(fn):
                raise ConfigError(f"env.rewards.{name} is not callable ({fn!r}); give a function "
                                  "(prompt, completion, **row) -> float, by _target_ or name")
        if unknown := sorted(set(weights) - set(functions)):
            raise ConfigError(f"env.reward_weights names {', '.join(unknown)}, which env.rewards does not have "
                              f"(it has {', '.join(functions)})")
        self.functions = dict(functions)
        self.weights = {name: float(weights.get(name, 1.0)) for name in functions}

    def __call__(self, prompt: str, completion: str, row: Mapping) -> tuple[float, dict[str, float]]:
        """The weighted total and each function's value for one completion of ``prompt``."""
        each = {}
        extra = {k: v for k, v in row.items() if k != "prompt"}
        for name, fn in self.functions.items():
            try:
                value = fn(prompt, completion, **extra)
            except Exception as e:  # noqa: BLE001  (a user's function: name it, and the prompt)
                raise RunError(f"reward function {name} raised {type(e).__name__}: {e} on the prompt "
                               f"{prompt!r} and the completion {completion!r}") from e
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise RunError(f"reward function {name} returned {value!r} on the prompt {prompt!r}; a reward is "
                               "a finite number")
            each[name] = float(value)
        return sum(self.weights[name] * v for name, v in each.items()), each
