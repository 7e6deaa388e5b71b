"""Verifiable tasks: prompts with a reference answer that a reward function checks.

A task is an endless, seeded stream of rows ``{"prompt": str, "answer": str}`` (every key but the
prompt reaches the reward functions), with a train and an eval split that never share a row's seed,
and a position a checkpoint saves (``state_dict``), so a resumed run goes on with the rows it would
have seen. Built in:

- ``Arithmetic``: ``a+b=``, ``a-b=``, ``a*b=`` with operands of ``digits`` digits;
- ``ReverseDigits``: ``reverse 4821:`` -> ``1284``, of ``length`` digits (``sort: true``: sort them);
- ``Dataset``: the rows of a JSON Lines or Parquet file, or of a Hugging Face dataset.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from rltrain.errors import ConfigError
from rltrain.llm.rewards import correct_answer
from rltrain.rules import Flag, Integer, OneOf, PositiveInt, Satisfies

SPLITS = ("train", "eval")
SPLIT = OneOf(SPLITS)
AT_LEAST_ONE = Integer(1)
OPERATORS = "+-*"
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")  # a Dataset's files; any other path is a datasets name
OPS = Satisfies(lambda v: isinstance(v, str) and v != "" and all(op in OPERATORS for op in v),
                f"one or more of {OPERATORS!r}")


@dataclass(frozen=True)
class TaskSpec:
    """What the trainer and the log line need of a task: its name, and the mean reward that counts
    as solved (``trainer.stop_at_return=auto``; None: never stop early)."""

    id: str
    reward_threshold: float | None = None


class Task:
    """A stream of rows from ``row(rng)``, row ``i`` of ``split`` drawn from its own seed (so the
    stream can restart at any position). Subclasses implement ``row``. ``REWARDS``: the reward
    functions a run uses when ``env.rewards`` names none."""

    REWARDS: dict[str, Callable[..., float]] = {"correct": correct_answer}

    def __init__(self, seed: int = 0, split: Annotated[str, SPLIT] = "train"):
        SPLIT.check("env.split", split)
        self.seed, self.split, self.position = seed, split, 0

    def row(self, rng: random.Random) -> dict[str, str]:
        raise NotImplementedError

    @property
    def spec(self) -> TaskSpec:
        return TaskSpec(type(self).__name__)

    def rows_to_check(self) -> dict[str, list[dict]]:
        """Rows that stand for every row of each split (the config check measures their prompts against
        the model's context and their columns against the reward functions): the first 256 of an
        endless split; a dataset's every row."""
        return {split: self._twin(split).take(256) for split in SPLITS}

    def describe(self, split: str) -> str:
        """``split``'s rows, as an error message names them."""
        return f"the {split} split of env={type(self).__name__}"

    def split_size(self) -> int | None:
        """How many distinct rows this split holds; None: endless (every row is drawn from a seed of its own)."""
        return None

    def _twin(self, split: str) -> Task:
        twin = copy.copy(self)
        twin.split, twin.position = split, 0
        return twin

    def eval_split(self) -> Task:
        """The same task's eval rows (the same settings, seeds the train rows never use)."""
        return self._twin("eval")

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

    def __init__(self, length: PositiveInt = 1, sort: Flag = False, seed: int = 0, split: str = "train"):
        super().__init__(seed, split)
        AT_LEAST_ONE.check("env.length", length)
        self.length, self.sort = length, sort

    def row(self, rng: random.Random) -> dict[str, str]:
        digits = "".join(rng.choice("0123456789") for _ in range(self.length))
        answer = "".join(sorted(digits)) if self.sort else digits[::-1]
        return {"prompt": f"{'sort' if self.sort else 'reverse'} {digits}:", "answer": answer}


class Dataset(Task):
    """Rows of a file, JSON Lines (``.jsonl``, one object per line) or Parquet (``.parquet``, with
    pyarrow), or of a Hugging Face ``datasets`` dataset: any other ``path``, a hub name or a local dir
    of data files (``subset``: its configuration; ``train_split``). ``prompt_key`` names the prompt's
    column; every other column reaches the reward functions. The eval split is ``eval_path``'s rows (a
    file, or a dataset's ``eval_split``), else the dataset's ``eval_split``, else the last
    ``eval_share`` of the rows (after a fixed shuffle: the same for every seed); train rows come in a
    new order every pass over them, seeded by ``seed``."""

    def __init__(self, path: str, prompt_key: str = "prompt", eval_path: str | None = None,
                 eval_share: Annotated[float, Satisfies(lambda v: 0 < v < 1, "a number in (0, 1)")] = 0.1,
                 subset: str | None = None, train_split: str = "train", eval_split: str | None = None,
                 seed: int = 0, split: str = "train"):
        super().__init__(seed, split)
        rows = _read_rows(path, prompt_key, subset, train_split)
        if eval_path is not None or eval_split is not None:
            evals = _read_rows(eval_path or path, prompt_key, subset, eval_split or train_split)
            train = rows
        else:
            # The same eval rows whatever the run's seed (the eval hook's task has a seed of its own).
            order = random.Random("split").sample(range(len(rows)), len(rows))
            cut = len(rows) - max(1, round(eval_share * len(rows)))
            if cut < 1:
                raise ConfigError(f"env.path={path} holds {len(rows)} row(s): too few to keep an eval split; "
                                  "give env.eval_path")
            train, evals = [rows[i] for i in order[:cut]], [rows[i] for i in order[cut:]]
        self.rows = {"train": train, "eval": evals}
        eval_from = (f"env.eval_path={eval_path}" if eval_path is not None else
                     f"env.path={path}'s {eval_split} split" if eval_split is not None else
                     f"the last env.eval_share={eval_share} of env.path={path}")
        self._sources = {"train": f"env.path={path}", "eval": eval_from}
        self._order: tuple[int, list[int]] | None = None  # the train rows' order in the current pass
    def rows_to_check(self) -> dict[str, list[dict]]:
        return dict(self.rows)

    def describe(self, split: str) -> str:
        return f"the {split} split ({self._sources[split]})"

    def split_size(self) -> int:
        return len(self.rows[self.split])

    def _row_at(self, index: int) -> dict[str, str]:
        rows = self.rows[self.split]
        epoch, i = divmod(index, len(rows))
        if self.split == "eval":
            return rows[i]  # the eval rows in their order, every time
        if self._order is None or self._order[0] != epoch:
            self._order = epoch, random.Random(f"{self.seed}/train/{epoch}").sample(range(len(rows)), len(rows))
        return rows[self._order[1][i]]


def _read_rows(path: str, prompt_key: str, subset: str | None = None, split: str = "train") -> list[dict]:
    """The rows of the file or dataset ``path``, each with its prompt under ``prompt``; a ConfigError
    naming the file (and the line) for a file that cannot be read, a row without the prompt column,
    or no rows at all."""
    file = Path(path).expanduser()
    if file.suffix in FILE_SUFFIXES and not file.is_file():
        raise ConfigError(f"env.path={path}: no such file; give a .jsonl, .json or .parquet file of rows with a "
                          f"{prompt_key!r} column (or a Hugging Face dataset's name)")
    raw = _file_rows(file, path) if file.is_file() else _dataset_rows(path, subset, split)
    rows = []
    for n, row in enumerate(raw, 1):
        if not isinstance(row, dict):
            raise ConfigError(f"env.path={path}, row {n} is a JSON {_JSON_TYPES.get(type(row), type(row).__name__)}, "
                              f"not an object of columns: a file holds one JSON object per line (JSON Lines) or one "
                              f"JSON array of objects, each with a {prompt_key!r} column")
        if prompt_key not in row:
            raise ConfigError(f"env.path={path}, row {n}: no {prompt_key!r} text (its keys: {', '.join(row)}); set "
                              "env.prompt_key to the prompt's column")
        if not isinstance(row[prompt_key], str):
            value, kind = row[prompt_key], type(row[prompt_key]).__name__
            what = "null" if value is None else f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} ({value!r:.40})"
            raise ConfigError(f"env.path={path}, row {n}: the {prompt_key!r} column is {what}, not text; write each "
                              f"prompt as a string (e.g. {json.dumps(str(value))})")
        rows.append({**{k: v for k, v in row.items() if k != prompt_key}, "prompt": row[prompt_key]})
    if not rows:
        raise ConfigError(f"env.path={path} holds no rows")
    return rows


def _dataset_rows(name: str, subset: str | None, split: str) -> list[dict]:
    """The rows of split ``split`` of the Hugging Face dataset ``name`` (a hub name, or a local dir of
    data files), through ``datasets.load_dataset``."""
    if importlib.util.find_spec("datasets") is None:
        raise ConfigError(f"env.path={name} is no file; to read it as a Hugging Face dataset, install datasets: "
                          "pip install 'rltrain[datasets]' (or give a .jsonl or .parquet file)")
    import datasets

    try:
        return datasets.load_dataset(name, subset, split=split).to_list()
    except Exception as e:  # noqa: BLE001  (no such dataset, split or subset; no network: many kinds)
        raise ConfigError(f"env.path={name} is no file, and datasets cannot load it as a dataset (env.subset="
                          f"{subset}, split {split}): {type(e).__name__}: {e}") from None


_JSON_TYPES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def _file_rows(file: Path, path: str) -> list:
    """The rows of a JSON Lines, JSON or Parquet file, as they are written: a .jsonl or .json file holds
    one object per line, or one JSON array of them (``json.dump``'s form, which datasets' json loader
    reads too)."""
    if file.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ConfigError(f"env.path={path} is a Parquet file, which needs pyarrow: pip install pyarrow") from None
        raw = pq.read_table(file).to_pylist()
    elif file.suffix in FILE_SUFFIXES:
        text = file.read_text()
        if text.lstrip().startswith("["):
            try:
                return json.loads(text)
            except ValueError as e:
                raise ConfigError(f"env.path={path}: starts as a JSON array but is not valid JSON ({e})") from None
        raw = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                raw.append(json.loads(line))
            except ValueError as e:
                raise ConfigError(f"env.path={path}, line {n}: not a JSON object ({e}); a {file.suffix} file holds "
                                  "one JSON object per line (JSON Lines) or one JSON array of objects") from None
    else:
        raise ConfigError(f"env.path={path}: rltrain reads .jsonl and .parquet files "
                          f"(got {file.suffix or 'no suffix'})")
    return raw
