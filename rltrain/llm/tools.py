"""Tools a language model calls during an episode (``rltrain.llm.environments.ToolEnv``): plain Python functions,
named by their import path in the config, run in a process of their own with a timeout.

**The call syntax** (``env.format=tagged``), for a model without a chat template of its own (the tiny model): the text
``<tool>NAME(ARGUMENTS)</tool>``, anywhere in the model's turn, once or several times. ``ARGUMENTS`` is split
on commas into the tool's parameters, in order (the last one takes the rest of the text, commas and all:
``<tool>calculator(2*(3+4))</tool>``, ``<tool>lookup(k37)</tool>``), each stripped of spaces; the tool gets
strings. A call that does not parse, names no tool of the env, or has too few arguments is not an error of
the run: its observation says what was wrong, and the model sees it (``parse_calls``). With a chat template
that lists tools (``env.format=template``), the model calls them in the template's own format, a JSON object
between ``<tool_call>`` tags, or alone as its whole turn (Llama 3.1's: ``parse_template_calls``), and the
template renders the results.

**Running them.** ``ToolRunner`` calls the tools in a child process: a tool that raises gives its error as the
observation (or fails the run naming the tool and the call, ``on_error: fail``), and one that runs past its
``timeout_s`` is cut: its process is killed and a fresh one takes the next call. Nothing a tool does can
hang the run or touch the learner's memory.

Built in: ``calculator`` (arithmetic on numbers, safely parsed) and ``lookup`` (a key-value store of made-up
values, the same in every run: its answers cannot be known without calling it).
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import json
import operator
import re
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from rltrain.child_process import ChildProcess, close_all, die_with_parent, next_request
from rltrain.errors import ConfigError, RunError, send_failure

CALL = re.compile(r"<tool>(.*?)</tool>", re.DOTALL)
_START_S = 120.0  # how long a tool process may take to start (to import the tools)
_NAMED = re.compile(r"^\s*([A-Za-z][A-Za-z0-9_]*)\s*\((.*)\)\s*$", re.DOTALL)


class ToolError(RunError):
    """A tool raised and ``on_error: fail`` says the run stops."""


@dataclass(frozen=True)
class Call:
    """One call the model wrote: the tool's name and its arguments (strings, in order; or, from the chat
    template's format, (name, value) pairs); ``problem``, why it cannot be run (then the observation), or None."""

    text: str
    name: str = ""
    arguments: tuple[str, ...] = ()
    problem: str | None = None


def parse_calls(reply: str, tools: dict[str, Callable]) -> list[Call]:
    """The calls in the model's ``reply``, in order, each checked against ``tools`` (by name)."""
    calls = []
    for match in CALL.finditer(reply):
        text = match.group(0)
        named = _NAMED.match(match.group(1))
        if named is None:
            calls.append(Call(text, problem="a call is written <tool>NAME(ARGUMENTS)</tool>"))
            continue
        name, rest = named.groups()
        if name not in tools:
            calls.append(Call(text, name, problem=f"no tool {name!r}; the tools are {', '.join(sorted(tools))}"))
            continue
        wanted = positional_count(tools[name])
        arguments = tuple(a.strip() for a in rest.split(",", max(wanted - 1, 0))) if wanted and rest.strip() else ()
        if len(arguments) < wanted:
            calls.append(Call(text, name, arguments,
                              problem=f"{name} takes {wanted} argument{'s' if wanted != 1 else ''}, "
                                      f"got {len(arguments)}"))
            continue
        calls.append(Call(text, name, arguments))
    return calls


TEMPLATE_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
TEMPLATE_SYNTAX = ('a call is written <tool_call>{"name": NAME, "arguments": {PARAMETER: VALUE, ...}}</tool_call>, '
                   'or as a turn of its own, {"name": NAME, "parameters": {PARAMETER: VALUE, ...}}')
# Llama 3.1's (and 3.2's, 3.3's) templates ask for a call as the whole turn: one JSON object, no tags
BARE_CALL = re.compile(r'\s*(\{\s*"name"\s*:.*\})\s*', re.DOTALL)


def parse_template_calls(reply: str, tools: dict[str, Callable]) -> list[Call]:
    """The calls in ``reply`` written in the chat templates' formats: a JSON object with the tool's ``name`` and
    its ``arguments`` (an object: the tool's parameters by name) between ``<tool_call>`` tags (Qwen's, Hermes'), or
    a turn that is one such object alone, its arguments under ``parameters`` (Llama 3.1's). Each checked against
    ``tools``; a call that cannot run says why, as ``parse_calls``'s do."""
    found = [(match.group(0), match.group(1)) for match in TEMPLATE_CALL.finditer(reply)]
    if not found and (bare := BARE_CALL.fullmatch(reply)):
        found = [(reply.strip(), bare.group(1))]
    return [_template_call(text, payload, tools) for text, payload in found]


def _template_call(text: str, payload: str, tools: dict[str, Callable]) -> Call:
    try:
        call = json.loads(payload)
    except json.JSONDecodeError:
        call = None
    arguments = call.get("arguments", call.get("parameters", {})) if isinstance(call, dict) else None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
        return Call(text, problem=TEMPLATE_SYNTAX)
    name = call["name"]
    if name not in tools:
        return Call(text, name, problem=f"no tool {name!r}; the tools are {', '.join(sorted(tools))}")
    try:
        inspect.signature(tools[name]).bind(**arguments)
    except TypeError as e:
        return Call(text, name, problem=f"{name}: {e}")
    return Call(text, name, tuple(arguments.items()))


def positional_count(tool: Callable) -> int:
    """How many arguments a call passes ``tool``: its parameters without a default (at least the first one)."""
    params = [p for p in inspect.signature(tool).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in params if p.default is p.empty]
    return max(len(required), min(len(params), 1))


def load_tools(paths: list[str], key: str = "env.tools") -> dict[str, Callable]:
    """The tools ``paths`` names (``module.function``), by function name; a ConfigError naming ``key`` for one
    that does not import or is not callable."""
    if not isinstance(paths, (list, tuple)) or not paths:
        raise ConfigError(f"{key} must list at least one tool, as module.function (e.g. rltrain.llm.tools.lookup)")
    tools = {}
    for path in paths:
        module_name, _, name = str(path).rpartition(".")
        try:
            tool = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError, ValueError) as e:
            raise ConfigError(f"{key}: {path!r} does not import ({type(e).__name__}: {e}); name a function as "
                              "module.function, importable where the run starts") from None
        if not callable(tool):
            raise ConfigError(f"{key}: {path!r} is a {type(tool).__name__}, not a function the model can call")
        if name in tools:
            raise ConfigError(f"{key}: two tools are named {name!r}; the model calls them by name")
        tools[name] = tool
    return tools


class ToolRunner:
    """Runs tool calls in a child process of its own, each bounded by ``timeout_s``. ``on_error``: ``observe``
    (a tool's exception is the observation the model sees) or ``fail`` (a ToolError naming the tool and the
    call). A call past its timeout is an observation either way ("timed out"), and the child is replaced."""

    def __init__(self, paths: list[str], timeout_s: float = 10.0, on_error: str = "observe"):
        self.paths, self.timeout_s, self.on_error = list(paths), timeout_s, on_error
        self.tools = load_tools(self.paths)
        self._child: ChildProcess | None = None

    def run(self, call: Call) -> tuple[str, bool]:
        """The observation of ``call``, and whether it was an error (a parse problem, a raise, a timeout)."""
        if call.problem is not None:
            return f"error: {call.problem}", True
        if self._child is None:
            self._child = ChildProcess(_serve, (self.paths,), "the tool process", task="running tools")
            try:
                self._child.wait_for("ready", _START_S)  # (its start is not the call's time)
            except BaseException:
                self.close()
                raise
        try:
            self._child.send(("call", call.name, call.arguments), doing=f"running {call.text}")
            answer = self._child.wait_for("result", self.timeout_s)
        except RunError as e:
            timed_out = self._child.process.is_alive()  # past its timeout (else the call killed the process)
            self.close()
            if timed_out:
                return f"error: {call.name} did not answer within {self.timeout_s:g}s", True
            if self.on_error == "fail":
                raise ToolError(f"tool {call.name} ended its process on the call {call.text}: {e}") from None
            return f"error: {call.name} ended its process ({e})", True
        self._child.doing = "waiting"
        _, ok, text = answer
        if ok:
            return text, False
        if self.on_error == "fail":
            raise ToolError(f"tool {call.name} raised on the call {call.text}: {text} (env.on_tool_error=observe "
                            "shows the model the error instead)")
        return f"error: {text}", True

    def close(self) -> None:
        """Stop the tool process (a later call starts another)."""
        if self._child is not None:
            child, self._child = self._child, None
            close_all([child], timeout_s=0 if child.doing != "waiting" else 5)


def _serve(conn, paths: list[str]) -> None:
    """The tool process: each ``("call", name, arguments)`` answered ``("result", ok, text)``."""
    die_with_parent()
    try:
        tools = load_tools(paths)
    except Exception as e:  # noqa: BLE001  (told to the learner, which raises it)
        send_failure(conn, "the tool process", e)
        return
    conn.send(("ready",))
    while (request := next_request(conn)) is not None:
        _, name, arguments = request
        try:
            if arguments and isinstance(arguments[0], tuple):  # by name (the chat template's format)
                conn.send(("result", True, str(tools[name](**dict(arguments)))))
            else:
                conn.send(("result", True, str(tools[name](*arguments))))
        except BaseException as e:  # noqa: BLE001  (the model's call failed, sys.exit too: it sees why)
            frames = traceback.extract_tb(e.__traceback__)
            where = f" (line {frames[-1].lineno})" if frames else ""
            conn.send(("result", False, f"{type(e).__name__}: {e}{where}"))


# Built-in tools.

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


def calculator(expression: str) -> str:
    """The value of an arithmetic expression (numbers, + - * / // % **, parentheses); integers stay exact.

    Args:
        expression: the expression, e.g. 2*(3+4)
    """
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _OPERATORS[type(node.op)](left, right)
        raise ValueError(f"not arithmetic: {ast.unparse(node)}")

    result = value(ast.parse(expression.strip(), mode="eval").body)
    return str(int(result)) if isinstance(result, float) and result.is_integer() else str(result)


def lookup(key: str) -> str:
    """The value stored under a key in a made-up store (two digits, the same in every run).

    Args:
        key: the key, e.g. k37
    """
    return lookup_value(key)


def lookup_value(key: str) -> str:
    digest = hashlib.sha256(f"rltrain-lookup:{key.strip()}".encode()).digest()
    return f"{digest[0] % 100:02d}"
