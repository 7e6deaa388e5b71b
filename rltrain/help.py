"""``python -m rltrain --help``: the composed config, each key with the one-line comment that documents it.

A key's comment is the one beside it in the YAML it comes from (``config.yaml``, a recipe, or the
chosen option of a group), or else the one on its line of the ``_target_`` class's signature
(where every PPO and SAC hyperparameter is documented, once). Hydra's help template calls
``config_help`` through the ``rltrain.config_help`` resolver, with the composed config as root.
"""

from __future__ import annotations

import importlib.resources
import inspect
import re
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

_KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_][\w.-]*):(?P<rest>.*)$")
_COMMENT_ONLY = re.compile(r"^(?P<indent> *)#\s?(?P<text>.*)$")
_PARAM = re.compile(r"^\s+(?P<name>\w+)\s*:[^#]*,\s*#\s*(?P<text>.+)$")
_SIGNATURE_END = re.compile(r"^\s*\)(\s*->[^:]*)?:\s*(#.*)?$")
_COLUMN = 44  # where comments start, so that they read as one column


def config_help(*, _root_: DictConfig) -> str:
    """The task config (no ``hydra``) as YAML lines with comments; ``$`` escaped for Hydra's template."""
    runtime = _root_.hydra.runtime
    sources = [(s.schema, s.path) for s in runtime.config_sources if s.schema in ("file", "pkg")]
    task = OmegaConf.to_container(_root_, resolve=False)
    task.pop("hydra", None)
    chosen = [(group, option) for group, choice in runtime.choices.items() if not group.startswith("hydra")
              and choice is not None for option in _options(choice)]
    # Groups whose options each add a key of their own (logger=[console,csv]) are not among the choices.
    chosen += [(group, option) for group, node in task.items() if isinstance(node, dict) for option in node]
    comments: dict[str, str] = {}
    for group, option in chosen:
        comments |= {f"{group.replace('/', '.')}.{k}": v
                     for k, v in yaml_comments(_read(sources, f"{group}/{option}.yaml")).items()}
    for name in dict.fromkeys(("config", _root_.hydra.job.config_name)):  # a recipe starts from config.yaml
        comments |= yaml_comments(_read(sources, f"{name}.yaml"))
    lines: list[str] = []
    _render(task, "", comments, lines)
    return "\n".join(lines).replace("$", "$$")


def yaml_comments(text: str) -> dict[str, str]:
    """``dotted.key -> comment`` for every key of a YAML mapping with a ``# comment`` on its line
    (continued by comment-only lines indented past the key, as in config.yaml's ``resume``)."""
    out: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    last: tuple[str, int] | None = None  # the key whose comment may continue, and its indent
    for line in text.splitlines():
        if (m := _COMMENT_ONLY.match(line)) and last and len(m["indent"]) > last[1]:
            out[last[0]] += " " + m["text"].strip()
            continue
        last = None
        if not (m := _KEY.match(line)):
            continue
        indent = len(m["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, m["key"]))
        if (comment := _comment(m["rest"])) is not None:
            key = ".".join(k for _, k in stack)
            out[key], last = comment, (key, indent)
    return out


def signature_comments(target: str) -> dict[str, str]:
    """``parameter -> comment`` from the ``# comment`` on each line of ``target``'s signature (a class's __init__)."""
    try:
        from hydra.utils import get_object  # not get_class: it logs an error line for a function target

        found = get_object(target)
        source = inspect.getsource(found.__init__ if inspect.isclass(found) else found)
    except Exception:  # noqa: BLE001  (not importable, no source: no comments, not an error)
        return {}
    lines = source.splitlines()
    end = next((i for i, line in enumerate(lines) if _SIGNATURE_END.match(line)), len(lines))
    return {m["name"]: m["text"].strip() for line in lines[:end] if (m := _PARAM.match(line))}


def _comment(rest: str) -> str | None:
    """The text after the first ``#`` outside quotes (YAML needs a space before it)."""
    quote = None
    for i, ch in enumerate(rest):
        if ch in "'\"" and quote in (None, ch):
            quote = None if quote else ch
        elif ch == "#" and quote is None and (i == 0 or rest[i - 1] in " \t"):
            return rest[i + 1:].strip()
    return None


def _options(choice: Any) -> list[str]:
    if isinstance(choice, (list, ListConfig)):
        return [str(c) for c in choice]
    text = str(choice)
    return [c.strip() for c in text.strip("[]").split(",")] if text.startswith("[") else [text]


def _read(sources: list[tuple[str, str]], relative: str) -> str:
    """The text of ``relative`` in the first config source that has it ('' if none does)."""
    for schema, path in sources:
        try:
            if schema == "file":
                file = Path(path) / relative
                if file.is_file():
                    return file.read_text()
            else:
                file = importlib.resources.files(path.replace("/", ".")).joinpath(relative)
                if file.is_file():
                    return file.read_text()
        except (OSError, ModuleNotFoundError):
            continue
    return ""


def _render(node: dict, prefix: str, comments: dict[str, str], lines: list[str], depth: int = 0) -> None:
    documented = signature_comments(node["_target_"]) if isinstance(node.get("_target_"), str) else {}
    for key, value in node.items():
        path = f"{prefix}{key}"
        comment = comments.get(path) or documented.get(str(key))
        text = "  " * depth + f"{key}:"
        if isinstance(value, dict) and value:
            lines.append(_with_comment(text, comment))
            _render(value, f"{path}.", comments, lines, depth + 1)
        else:
            lines.append(_with_comment(f"{text} {_scalar(value)}", comment))


def _scalar(value: Any) -> str:
    if isinstance(value, str) and "${" in value:
        return f'"{value}"'
    return yaml.safe_dump(value, default_flow_style=True, width=1 << 16).strip().removesuffix("...").strip()


def _with_comment(text: str, comment: str | None) -> str:
    return f"{text:<{_COLUMN}} # {comment}" if comment else text
