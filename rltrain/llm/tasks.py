"""Verifiable tasks: prompts with a reference answer that a reward function checks.

A task is an endless, seeded stream of rows ``{"prompt": str, "answer": str}`` (every key but the
prompt reaches the reward functions), with a train and an eval split that never share a row's seed,
and a position a checkpoint saves (``state_dict``), so a resumed run goes on with the rows it would
have seen. Built in:

- ``Arithmetic``: ``a+b=``, ``a-b=``, ``a*b=`` with operands of ``digits`` digits;
- ``ReverseDigits``: ``reverse 4821:`` -> ``1284``, of ``length`` digits (``sort: true``: sort them).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator
from typing import Annotated

from rltrain.rules import Flag, Integer, OneOf, PositiveInt, Satisfies

SPLITS = ("train", "eval")
SPLIT = OneOf(SPLITS)
AT_LEAST_ONE = Integer(1)
OPERATORS = "+-*"
OPS = Satisfies(lambda v: isinstance(v, str) and v != "" and all(op in OPERATORS for op in v),
                f"one or more of {OPERATORS!r}")


class Task:
    """A stream of rows from ``row(rng)``, row ``i`` of ``split`` drawn from its own seed (so the
    stream can restart at any position). Subclasses implement ``row``."""

    def __init__(self, seed: int = 0, split: Annotated[str, SPLIT] = "train"):
        SPLIT.check("env.split", split)
        self.seed, self.split, self.position = seed, split, 0

    def row(self, rng: random.Random) -> dict[str, str]:
        raise NotImplementedError

    def eval_split(self) -> Task:
        """The same task's eval rows (the same settings, seeds the train rows never use)."""
        twin = copy.copy(self)
        twin.split, twin.position = "eval", 0
        return twin

    def take(self, n: int) -> list[dict[str, str]]:
        """The next ``n`` rows; the position moves past them."""
        rows = [self._row_at(self.position + i) for i in range(n)]
        self.position += n
        return rows

    def __iter__(self) -> Iterator[dict[str, str]]:
        while True:
            yield from self.take(1)

    def _row_at(self, index: int) -> dict[str, str]:
        return self.row(random.Random(f"{self.seed}/{self.split}/{index}"))  # the same on every Python

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


class Arithmetic(Task):
    """``a<op>b=`` with ``digits``-digit operands; the answer is the exact integer result."""

    def __init__(self, digits: PositiveInt = 1, ops: Annotated[str, OPS] = "+", seed: int = 0, split: str = "train"):
        super().__init__(seed, split)
        AT_LEAST_ONE.check("env.digits", digits)
        OPS.check("env.ops", ops)
        self.digits, self.ops = digits, ops

    def row(self, rng: random.Random) -> dict[str, str]:
        a, b = (rng.randrange(10 ** self.digits) for _ in range(2))
        op = rng.choice(self.ops)
        result = {"+": a + b, "-": a - b, "*": a * b}[op]
        return {"prompt": f"{a}{op}{b}=", "answer": str(result)}


class ReverseDigits(Task):
    """``reverse 4821:`` -> ``1284`` (or, with ``sort``, ``sort 4821:`` -> ``1248``)."""

    def __init__(self, length: PositiveInt = 3, sort: Flag = False, seed: int = 0, split: str = "train"):
        super().__init__(seed, split)
        AT_LEAST_ONE.check("env.length", length)
        self.length, self.sort = length, sort

    def row(self, rng: random.Random) -> dict[str, str]:
        digits = "".join(rng.choice("0123456789") for _ in range(self.length))
        answer = "".join(sorted(digits)) if self.sort else digits[::-1]
        return {"prompt": f"{'sort' if self.sort else 'reverse'} {digits}:", "answer": answer}
