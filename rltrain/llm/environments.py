"""Language environments: episodes of several turns, the multi-turn counterpart of a task.

A language environment is a task (``rltrain.llm.tasks.Task``: a resumable, seeded stream of rows, with an
eval split) whose rows open episodes. ``reset(row)`` opens one: the episode's state, and the opening messages.
After each of the model's turns, ``step(state, reply)`` answers with a ``Step``: the messages the environment
appends (a tool's result, a game's next position, a simulated user's reply), a reward for the turn, whether
the episode is over, and the episode's next state. Messages are OpenAI-style dicts (``role``, ``content``), so
a chat template can render them; the state is the environment's own (plain values: a secret, a turn count).

Your own environment is a ``_target_`` away: a ``Task`` (``row(rng)``, or a ``Dataset``) with ``reset`` and
``step`` (``LanguageEnv`` documents them; ``close()`` is optional). Its rewards are its steps' rewards, summed
over the turns, plus the run's reward functions on the final reply (``env.rewards``; ``REWARDS`` by default).
``STOP``: strings that end a model turn besides the end-of-turn token (``</tool>``).

Built in:
- ``ToolEnv``: the model calls Python functions (``rltrain.llm.tools``) by writing ``<tool>NAME(ARGUMENTS)
  </tool>``; each call's result is the next message (role ``tool``). A turn without a call is the final answer,
  which ends the episode. Its rows ask for the value stored under a key, which only the ``lookup`` tool knows.
- ``GuessNumber``: the model guesses a secret number and hears "higher" or "lower" until it is right or out of
  guesses; the reward is 1 for the right number, less a share per wrong guess.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Annotated, Any

from rltrain.errors import ConfigError
from rltrain.llm.tasks import Task
from rltrain.llm.tools import ToolRunner, lookup_value, parse_calls, parse_template_calls
from rltrain.rules import Integer, OneOf, PositiveInt, PositiveNumber

FORMAT = OneOf(("tagged", "template"), "tagged (<tool>NAME(ARGUMENTS)</tool>) or template (the chat template's own "
               "tool calls, for a model whose template lists tools)")
ON_TOOL_ERROR = OneOf(("observe", "fail"), "observe (the model sees the tool's error) or fail (the run stops)")


@dataclass
class Step:
    """What the environment answers to one of the model's turns: ``messages`` appended to the conversation
    (none when the episode ends with nothing more to say), the turn's ``reward``, whether the episode is
    ``done``, the episode's next ``state``, and ``counts`` of what happened (``tool_calls``, ``tool_errors``:
    summed into the batch's metrics)."""

    messages: list[dict] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    state: Any = None
    counts: dict[str, int] = field(default_factory=dict)


class LanguageEnv(Task):
    """The interface of a language environment (see the module's docstring)."""

    STOP: tuple[str, ...] = ()

    def reset(self, row: dict) -> tuple[Any, list[dict]]:
        """Open an episode on ``row``: its state, and the opening messages (at least one)."""
        raise NotImplementedError

    def step(self, state: Any, reply: str) -> Step:
        """The environment's answer to the model's turn ``reply`` in the episode whose state is ``state``."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the environment holds (a tool process)."""

    def template_tools(self) -> list | None:
        """The functions a chat template lists for the model (its ``tools=``), or None."""
        return None


def is_language_env(task: object) -> bool:
    """Whether ``task`` opens episodes of several turns (has ``reset`` or ``step``: ``check_interface`` then
    says whether it has both)."""
    return callable(getattr(task, "reset", None)) or callable(getattr(task, "step", None))


def check_interface(env: object, key: str = "env") -> None:
    """A ConfigError naming each method of the interface that ``env`` (a user's ``_target_``) lacks."""
    missing = [name for name in ("reset", "step") if not callable(getattr(env, name, None))
               or getattr(type(env), name, None) in (LanguageEnv.reset, LanguageEnv.step)]
    if not isinstance(env, Task) or (type(env).row is Task.row and type(env)._row_at is Task._row_at):
        missing.insert(0, "row")  # (a Dataset's rows are its file's)
    if missing:
        raise ConfigError(f"{key}: {type(env).__module__}.{type(env).__name__} has no {', '.join(missing)} "
                          f"method{'s' if len(missing) > 1 else ''}; a language environment is a task "
                          "(rltrain.llm.tasks.Task: row(rng), or a Dataset) with reset(row) and step(state, reply) "
                          "(rltrain.llm.environments.LanguageEnv)")


class ToolEnv(LanguageEnv):
    """The model calls ``tools`` (``module.function`` paths); see the module's docstring. Its rows: ``value of
    k37?``, answered by the value ``lookup(k37)`` returns, for one of ``keys`` keys. ``format``: how calls are
    written (``rltrain.llm.tools``): ``tagged``, or ``template``, the chat template's own format (the template
    lists the tools, from their signatures and docstrings, and renders their results). ``instructions``
    (tagged): a system message telling the model the syntax and the tools (their first docstring lines); off
    for a model that learns the syntax from rewards alone (the tiny one, whose context is short)."""

    def __init__(self, tools: tuple[str, ...] = ("rltrain.llm.tools.lookup",), keys: PositiveInt = 100,
                 timeout_s: PositiveNumber = 10.0, on_tool_error: Annotated[str, ON_TOOL_ERROR] = "observe",
                 instructions: bool = False, format: Annotated[str, FORMAT] = "tagged", seed: int = 0,
                 split: str = "train"):
        super().__init__(seed, split)
        ON_TOOL_ERROR.check("env.on_tool_error", on_tool_error)
        FORMAT.check("env.format", format)
        Integer(1).check("env.keys", keys)
        self.keys, self.instructions, self.format = keys, instructions, format
        self.runner = ToolRunner(list(tools), timeout_s, on_tool_error)
        # a tagged call ends the turn; a template's call is a turn of its own, ended by its end-of-turn token
        self.STOP = ("</tool>",) if format == "tagged" else ()
        self._parse = parse_calls if format == "tagged" else parse_template_calls

    def template_tools(self) -> list | None:
        return list(self.runner.tools.values()) if self.format == "template" else None

    def row(self, rng: random.Random) -> dict[str, str]:
        key = f"k{rng.randrange(self.keys)}"
        return {"prompt": f"value of {key}?", "key": key, "answer": lookup_value(key)}

    def reset(self, row: dict) -> tuple[Any, list[dict]]:
        messages = [{"role": "user", "content": row["prompt"]}]
        if self.instructions and self.format == "tagged":  # (a template lists the tools in its own words)
            messages.insert(0, {"role": "system", "content": describe_tools(self.runner.tools)})
        return None, messages

    def step(self, state: Any, reply: str) -> Step:
        calls = self._parse(reply, self.runner.tools)
        if not calls:  # the final answer
            return Step(done=True)
        messages, errors = [], 0
        for call in calls:
            text, failed = self.runner.run(call)
            errors += failed
            messages.append({"role": "tool", "name": call.name, "content": text})
        return Step(messages, counts={"tool_calls": len(calls), "tool_errors": errors})

    def close(self) -> None:
        self.runner.close()


def describe_tools(tools: dict) -> str:
    """A system message: the call syntax, and each tool with the first line of its docstring."""
    lines = ["Call a tool by writing <tool>NAME(ARGUMENTS)</tool>; its result comes back. Answer without a call."]
    for name, tool in tools.items():
        doc = (tool.__doc__ or "").strip().splitlines()
        lines.append(f"- {name}: {doc[0] if doc else ''}".rstrip(": "))
    return "\n".join(lines)


_GUESS = re.compile(r"-?\d+")


class GuessNumber(LanguageEnv):
    """Guess the secret number, from ``low`` to ``high``: each turn's first integer is the guess, answered
    ``higher`` or ``lower``. The episode ends at the right number (reward 1 less ``penalty`` per wrong guess
    before it, at least 0) or after ``max_guesses`` wrong ones (reward 0). A turn without a number is a wrong
    guess, answered ``a number?``."""

    REWARDS = {}  # the game's own

    def __init__(self, low: int = 1, high: int = 8, max_guesses: PositiveInt = 4, penalty: float = 0.25,
                 seed: int = 0, split: str = "train"):
        super().__init__(seed, split)
        if high <= low:
            raise ConfigError(f"env.high ({high}) must be above env.low ({low})")
        Integer(1).check("env.max_guesses", max_guesses)
        self.low, self.high, self.max_guesses, self.penalty = low, high, max_guesses, penalty

    def row(self, rng: random.Random) -> dict[str, str]:
        return {"prompt": f"guess {self.low}-{self.high}:", "answer": str(rng.randint(self.low, self.high))}

    def reset(self, row: dict) -> tuple[Any, list[dict]]:
        return {"secret": int(row["answer"]), "wrong": 0}, [{"role": "user", "content": row["prompt"]}]

    def step(self, state: Any, reply: str) -> Step:
        found = _GUESS.search(reply)
        if found is not None and int(found.group()) == state["secret"]:
            return Step(reward=max(0.0, 1.0 - self.penalty * state["wrong"]), done=True, state=state)
        state = {**state, "wrong": state["wrong"] + 1}
        if state["wrong"] >= self.max_guesses:
            return Step(done=True, state=state)
        hint = "a number?" if found is None else "higher" if int(found.group()) < state["secret"] else "lower"
        return Step([{"role": "user", "content": hint}], state=state)
