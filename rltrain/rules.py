"""What a part accepts, stated once, beside the parameter it constrains: markers in ``typing.Annotated``
on a constructor's parameters (``frames_per_batch: PositiveInt``), read by the config check.

The config check (``rltrain.validate``) walks every ``_target_`` node of the config and asks its class:

1. each parameter's rule, from the annotations of ``__init__`` (or of the function, for a factory
   function such as ``rltrain.envs.make_envs``). A subclass keeps its bases' rules for parameters
   of the same name (the ``every`` of a ``Hook`` subclass is checked as a schedule) unless its own
   ``__init__`` states another;
2. then its combination rules, if the class has a classmethod ``check_config(values, config)``:
   ``values`` are the node's keys over the constructor's defaults, ``config`` the whole config,
   resolved, as plain values (for a rule that reads another part's key); it raises ConfigError.

A class of your own (``algo._target_``, ``collector._target_``, ``hooks.x._target_``, ...) declares
its rules the same way and gets the same one-line errors before anything starts::

    from typing import Annotated
    from rltrain.algos import PPO
    from rltrain.errors import ConfigError
    from rltrain.rules import InRange, NonNegativeNumber

    class KLPenaltyPPO(PPO):  # PPO's parameters keep PPO's rules
        def __init__(self, *args, kl_coef: NonNegativeNumber = 0.0,
                     kl_decay: Annotated[float, InRange(0, 1)] = 1.0, **kwargs): ...

        @classmethod
        def check_config(cls, values: dict, config: dict) -> None:
            super().check_config(values, config)
            if values["kl_decay"] < 1 and values["kl_coef"] == 0:
                raise ConfigError("algo.kl_decay < 1 decays a penalty of 0; set algo.kl_coef > 0 too")

    python -m rltrain algo._target_=my_pkg.KLPenaltyPPO +algo.kl_coef=-1
    -> rltrain: config error: algo.kl_coef must be a number >= 0 (got -1)

The markers: ``Integer(n)``, ``Number(above=x)`` / ``Number(at_least=x)``, ``InRange(lo, hi)``,
``OneOf(choices)``, ``Boolean()``, ``IntegerList()``, ``Satisfies(test, "what is allowed")``
(``null=`` lets null through), and the shorthands below (``PositiveInt``, ``Flag``, ...).

A constructor that must also refuse a value when it is built outside a config (from Python) calls
the same rule: ``SLOTS.check("sync.slots", slots)``, not a second copy of it.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Collection
from typing import Annotated, Any

from rltrain.errors import ConfigError


class Rule:
    """What one config value may be; ``allowed`` says it in words, after "KEY must be"."""

    allowed = ""

    def accepts(self, value: Any) -> bool:
        raise NotImplementedError

    def check(self, key: str, value: Any) -> None:
        """ConfigError ``KEY must be <allowed> (got VALUE)`` unless the rule accepts ``value``."""
        try:
            ok = self.accepts(value)
        except TypeError:
            ok = False
        if not ok:
            hint = ""
            if isinstance(value, float) and value.is_integer() and "integer" in self.allowed:
                hint = f"; write {int(value)} (YAML and the command line read 1e9 as a float)"
            raise ConfigError(f"{key} must be {self.allowed} (got {value!r}){hint}")


def _or_null(allowed: str, null: str | None) -> str:
    """``null`` None: null is refused; "": "... or null"; a note: "..., or null (note)"."""
    if null is None:
        return allowed
    return f"{allowed} or null" if not null else f"{allowed}, or null ({null})"


def finite_number(v: Any) -> bool:
    """A finite int or float (not a bool): inf and nan pass no rule that asks for a number."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


class Integer(Rule):
    """An integer >= ``at_least`` (and null, when ``null`` is given: "" or what null means)."""

    def __init__(self, at_least: int, null: str | None = None, note: str = ""):
        self.at_least, self.null = at_least, null
        self.allowed = _or_null(f"an integer >= {at_least}{f' ({note})' if note else ''}", null)

    def accepts(self, value: Any) -> bool:
        if value is None:
            return self.null is not None
        return isinstance(value, int) and not isinstance(value, bool) and value >= self.at_least


class Number(Rule):
    """A finite number > ``above`` or >= ``at_least`` (and null, when ``null`` is given)."""

    def __init__(self, above: float | None = None, at_least: float | None = None, null: str | None = None):
        self.above, self.at_least, self.null = above, at_least, null
        bound = f"> {above}" if above is not None else f">= {at_least}"
        self.allowed = _or_null(f"a number {bound}", null)

    def accepts(self, value: Any) -> bool:
        if value is None:
            return self.null is not None
        return finite_number(value) and (value > self.above if self.above is not None else value >= self.at_least)


class InRange(Rule):
    """A finite number in [low, high] (``low_open``: (low, high])."""

    def __init__(self, low: float, high: float, low_open: bool = False):
        self.low, self.high, self.low_open = low, high, low_open
        self.allowed = f"a number in {'(' if low_open else '['}{low}, {high}]"

    def accepts(self, value: Any) -> bool:
        above_low = self.low < value if self.low_open else self.low <= value
        return finite_number(value) and above_low and value <= self.high


def _word(value: Any) -> str:
    """A value as the config writes it: true, false, null."""
    return {True: "true", False: "false", None: "null"}[value] if value is None or isinstance(value, bool) \
        else str(value)


class OneOf(Rule):
    """One of ``choices``; ``allowed`` words them when the default ("a or b", "one of a, b, c") says too little."""

    def __init__(self, choices: Collection, allowed: str | None = None):
        self.choices = tuple(choices)
        words = [_word(c) for c in self.choices]
        self.allowed = allowed or (" or ".join(words) if len(words) <= 2 else f"one of {', '.join(words)}")

    def accepts(self, value: Any) -> bool:
        return value in self.choices


class Boolean(Rule):
    allowed = "true or false"

    def accepts(self, value: Any) -> bool:
        return isinstance(value, bool)


class IntegerList(Rule):
    """A list of integers >= ``at_least`` (``non_empty``: at least one)."""

    def __init__(self, at_least: int = 1, non_empty: bool = False, note: str = ""):
        self.at_least, self.non_empty = at_least, non_empty
        self.allowed = (f"a {'non-empty ' if non_empty else ''}list of integers >= {at_least}"
                        f"{f' ({note})' if note else ''}")

    def accepts(self, value: Any) -> bool:
        return (isinstance(value, (list, tuple)) and (len(value) > 0 or not self.non_empty)
                and all(Integer(self.at_least).accepts(v) for v in value))


class Satisfies(Rule):
    """Any other rule: ``test(value)`` says whether ``value`` is allowed, ``allowed`` says what is."""

    def __init__(self, test: Callable[[Any], bool], allowed: str):
        self.test, self.allowed = test, allowed

    def accepts(self, value: Any) -> bool:
        return bool(self.test(value))


# The rules many parameters share, as types to annotate them with.
PositiveInt = Annotated[int, Integer(1)]
NonNegativeInt = Annotated[int, Integer(0)]
PositiveNumber = Annotated[float, Number(above=0)]
PositiveNumberOrNull = Annotated[float | None, Number(above=0, null="")]
NonNegativeNumber = Annotated[float, Number(at_least=0)]
Fraction = Annotated[float, InRange(0, 1)]
PositiveFraction = Annotated[float, InRange(0, 1, low_open=True)]
Flag = Annotated[bool, Boolean()]


def parameter_rules(target: Callable) -> dict[str, Rule]:
    """Each parameter's rule, from the annotations of ``target`` (a function, or a class's
    ``__init__`` and those of its bases: the nearest one that states a rule for a parameter wins)."""
    rules: dict[str, Rule] = {}
    for fn in _constructors(target):
        for name, hint in _hints(fn).items():
            for rule in (m for m in getattr(hint, "__metadata__", ()) if isinstance(m, Rule)):
                rules[name] = rule
    return rules


def parameter_defaults(target: Callable) -> dict[str, Any]:
    """Each parameter's default, from ``target`` as ``parameter_rules`` reads it (a subclass that
    passes ``**kwargs`` up to its base has the base's defaults)."""
    defaults = {}
    for fn in _constructors(target):
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            continue
        defaults.update({p.name: p.default for p in params if p.default is not inspect.Parameter.empty})
    return defaults


def _constructors(target: Callable) -> list[Callable]:
    """``target`` itself, or a class's ``__init__`` (or ``__new__``, for a class that constructs
    another: ``collector=distributed``) and its bases', the furthest base first."""
    if not isinstance(target, type):
        return [inspect.unwrap(target)]
    return [inspect.unwrap(vars(c)[name]) for c in reversed(target.__mro__) if c is not object
            for name in ("__new__", "__init__") if name in vars(c)]


def _hints(fn: Callable) -> dict[str, Any]:
    """``fn``'s parameter annotations, evaluated one by one: a name only imported for type
    checkers (``if TYPE_CHECKING``) costs that parameter its annotation, not the others theirs."""
    hints = {}
    for name, annotation in getattr(fn, "__annotations__", {}).items():
        try:
            hints[name] = eval(annotation, getattr(fn, "__globals__", {})) if isinstance(annotation, str) \
                else annotation
        except (NameError, TypeError, AttributeError):
            continue
    return hints
