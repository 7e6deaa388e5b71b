"""Checks a composed config before anything is built: every problem is a ConfigError naming
the key, the value and what is allowed. Nothing here starts a process or writes a file.

Each part states its own rules (``rltrain.rules``: annotated constructor parameters, and a
``check_config`` classmethod for combinations); this walks the config's parts and asks each.
"""

from __future__ import annotations

import difflib
import heapq
import importlib
import importlib.util
import inspect
import math
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rltrain import process_groups
from rltrain.algos.update_step import compile_enabled, cuda_graph_enabled
from rltrain.collectors.batch import batch_steps
from rltrain.device import DEVICES, resolve_device
from rltrain.envs.batched import make_gym_env, resolve_env_spec, spec_from_env
from rltrain.envs.spaces import flat_leaves
from rltrain.envs.vector import make_envs
from rltrain.errors import ConfigError
from rltrain.llm.engine import Engine
from rltrain.llm.environments import check_interface, is_language_env
from rltrain.llm.rollout import Conversation
from rltrain.llm.tasks import Task
from rltrain.loggers import Logger
from rltrain.protocols import Algo, Collector, missing_members
from rltrain.rules import Integer, OneOf, Rule, Satisfies, parameter_defaults, parameter_rules
from rltrain.strategies import Single, Strategy
from rltrain.sync.base import WeightSyncScheme
from rltrain.trainer import OBJECTIVES, Trainer
from rltrain.wiring import ENV_TO_ALGO, RUNTIME_ARGS, WIRING_KEYS, env_maker, is_language_task, task_rewards

CONFIGS = Path(__file__).parent / "configs"

# The interface each part's class must have (rltrain.protocols); hooks subclass rltrain.hooks.Hook.
INTERFACES = {"algo": Algo, "collector": Collector, "logger": Logger, "engine": Engine, "strategy": Strategy}

# The top level of rltrain's config: its own keys and its config groups (config.yaml). Anything
# else there is a typo (``+trainer.total_frame=...`` adds a key nothing reads); ``hydra`` is Hydra's.
TOP_LEVEL_KEYS = ("seed", "device", "threads", "resume", "objective", "trainer", "algo", "env", "collector", "sync",
                  "logger", "hooks", "model", "engine", "strategy", "hydra")
# The top-level values belong to no part (``device``: _check_device).
TOP_LEVEL_RULES: dict[str, Rule] = {
    "seed": Integer(0),
    "objective": OneOf(OBJECTIVES, f"one of {', '.join(OBJECTIVES)} (the summary.json value a sweeper optimizes)"),
    "threads": Integer(1, null=""),
    "resume": Satisfies(lambda v: v is None or (isinstance(v, str) and v != ""),
                        "null, auto, or the path of a run dir or checkpoint file"),
}
TOKENS = "tokens"  # the action space of an algo that learns language tasks (GRPO.ACTION_SPACES)
# The parts with a _target_ (logger and hooks: one per name below them); None: may be left out.
PARTS = {"env": "env", "algo": "algo", "algo.network": None, "collector": "collector", "sync": "sync", "model": None,
         "engine": None, "strategy": None}


@dataclass
class Checked:
    """What the check made that the run uses as it is (made once per process): a language run's task."""

    task: Task | None = None


def validate(cfg: DictConfig) -> Checked:
    """Raise ConfigError for the first problem found in ``cfg``; what it made, for build()."""
    for key in sorted(OmegaConf.missing_keys(cfg)):  # ``???`` in an option: a value only the user can give
        group = key.split(".")[0]
        owner = OmegaConf.select(cfg, f"{group}._target_", default=None)
        by = f" by {_label(group, _import_target(group, owner))}" if owner else ""
        raise ConfigError(f"{key} is required{by}: give it on the command line, e.g. {key}=...")
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:
        raise ConfigError(f"the config does not resolve: {e}") from None
    _check_keys("", cfg.keys(), TOP_LEVEL_KEYS, "a top-level key of rltrain's config",
                listed=[k for k in TOP_LEVEL_KEYS if k != "hydra"])
    for key, rule in TOP_LEVEL_RULES.items():
        if key in resolved:
            rule.check(key, resolved[key])
    parts = _check_parts(cfg, RUNTIME_ARGS, WIRING_KEYS)
    algo_rules = parameter_rules(parts["algo"][0])
    for key in ENV_TO_ALGO:  # env keys the algo receives: the algo's rule for them
        rule = algo_rules.get(key)
        if rule is not None and key in cfg.env:
            rule.check(f"env.{key}", resolved["env"][key])
    _check_device(cfg.get("device", "auto"))
    _check_compile(cfg)
    for name, node in (cfg.get("logger") or {}).items():
        _check_requires(f"logger.{name}", _import_target(f"logger.{name}", node._target_))
    language = is_language_task(cfg)
    if not language and "engine" in parts:  # before the combinations: an engine's own sync choice is beside the point
        if TOKENS in capability(parts["algo"][0], Algo, "ACTION_SPACES"):  # algo=grpo chose the engine
            raise _language_algo_on_gym_env(parts["algo"][0], cfg.env.get("id"))
        raise ConfigError(f"{_label('engine', parts['engine'][0])} generates completions for a language task, and "
                          f"env.id={cfg.env.get('id')!r} is a gymnasium env; leave the engine out (~engine)")
    checked = Checked()
    if language:  # before the parts' combinations: those of an algo that cannot learn the task are beside the point
        checked.task = _check_task(cfg, parts)
    _check_cross(cfg, parts)
    for cls, values in parts.values():  # each part's own combinations of values (rltrain.rules)
        if callable(getattr(cls, "check_config", None)):
            cls.check_config(values, resolved)
    if not language:
        _check_env(cfg)
    if OmegaConf.select(cfg, "hooks.eval.video", default=False):
        _check_video(cfg)
    return checked


def check_resume_in_sweep(cfg: DictConfig) -> None:
    """A sweep's job: ``resume=PATH`` continues one run, into which every job would write."""
    resume = cfg.get("resume")
    if resume not in (None, "auto"):
        raise ConfigError(f"resume={resume} continues one run, but this is a sweep (-m); use resume=auto, "
                          "which continues each job's own run (the newest run with the same config)")


def _check_device(device) -> None:
    if device not in DEVICES and not str(device).startswith("cuda:"):
        raise ConfigError(f"device must be cpu, cuda, cuda:N or auto (got {device!r})")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={device} but torch sees no CUDA device; use device=cpu or device=auto")


def _check_compile(cfg: DictConfig) -> None:
    """``algo.compile`` and ``algo.cuda_graph`` against the learner's device, and what compiling needs
    there (inductor writes C++ on the CPU and Triton kernels on a GPU)."""
    device = resolve_device(cfg.get("device", "auto"))
    if cuda_graph_enabled(OmegaConf.select(cfg, "algo.cuda_graph", default=False), device) and device.type != "cuda":
        raise ConfigError(f"algo.cuda_graph=true needs a CUDA learner, but the device is {device}; use "
                          "algo.cuda_graph=auto (on with device=cuda only) or device=cuda")
    if not compile_enabled(OmegaConf.select(cfg, "algo.compile", default=False), device):
        return  # (auto without Triton: eager)
    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        raise ConfigError("algo.compile on a CUDA learner needs Triton, which torch's CUDA wheels bring "
                          "(pip install triton); or set algo.compile=false")
    if device.type == "cpu" and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        raise ConfigError("algo.compile=true on the CPU needs a C++ compiler (g++ or clang++) for torch.compile; "
                          "install one, or set algo.compile=false")


def _import_target(path: str, target: str):
    module_name, _, attr = target.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
        hint = " (pip install wandb)" if "wandb" in target else ""
        raise ConfigError(f"{path}._target_={target!r} cannot be imported: {e}{hint}") from None


def _check_parts(cfg: DictConfig, runtime_args: dict[str, Iterable[str]],
                 wiring_keys: dict[str, set[str]]) -> dict[str, tuple[type, dict]]:
    """Every part's class, and its values (the node's over the constructor's defaults), by path;
    a ConfigError for a part that cannot be imported, lacks its interface, has a key its class
    does not take or a value its class refuses."""
    parts = {}
    paths = [*((path, group) for path, group in PARTS.items()),
             *((f"{group}.{name}", group) for group in ("logger", "hooks") for name in (cfg.get(group) or {}))]
    for path, group in paths:
        node = OmegaConf.select(cfg, path)
        if node is None:
            if group is not None:
                raise ConfigError(f"{path} is missing; choose one with {path.split('.')[0]}=<choice>")
            continue
        if not isinstance(node, DictConfig) or "_target_" not in node:
            raise ConfigError(f"{path} must be a mapping with a _target_ (the class to build), got {node!r}")
        target = _import_target(path, node._target_)
        interface = INTERFACES.get(group or path)
        if interface is not None and isinstance(target, type) and (missing := missing_members(target, interface)):
            raise ConfigError(f"{path}._target_={node._target_} lacks {', '.join(missing)} of rltrain's "
                              f"{interface.__name__} interface; add them (see {interface.__module__}."
                              f"{interface.__name__}, which says what each does)")
        parts[path] = (target, _check_part(cfg, path, target, f"a parameter of {node._target_}",
                                           runtime_args.get(group or path, ()), wiring_keys.get(path, set())))
    if isinstance(cfg.get("trainer"), DictConfig):  # the trainer's keys are its constructor's arguments
        parts["trainer"] = (Trainer, _check_part(cfg, "trainer", Trainer,
                                                 "a key of trainer (the arguments of rltrain.Trainer)",
                                                 runtime_args["trainer"], set()))
    return parts


def _check_part(cfg: DictConfig, path: str, target, owner: str, runtime: Iterable[str], wiring: set[str]) -> dict:
    """The keys of ``path`` against ``target``'s parameters, and their values against its rules."""
    values = {k: v for k, v in OmegaConf.to_container(OmegaConf.select(cfg, path), resolve=True).items()
              if not k.startswith("_") and k not in wiring}
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        params = {}
    if params and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        allowed = [p for p in params if p not in runtime and p != "self"]
        moved = getattr(target, "MOVED_KEYS", {})  # keys the class had once: the key that replaced each
        for key in values:  # (collector.engine was a key and is now a runtime object: the move is the news)
            if key in moved and key not in allowed:
                raise ConfigError(f"{path}.{key} {moved[key]}")
        for key in values:
            if key in runtime:
                raise ConfigError(f"{path}.{key} is set by rltrain at build time; remove it from the config")
        _check_keys(f"{path}.", values, [*allowed, *wiring], owner, listed=allowed)
    rules = parameter_rules(target)
    for key, value in values.items():
        if key in rules:
            rules[key].check(f"{path}.{key}", value)
    return {**parameter_defaults(target), **values}


def _check_keys(prefix: str, keys: Iterable[str], known: Iterable[str], owner: str,
                listed: Iterable[str] | None = None) -> None:
    """A key not in ``known`` is a typo: name it, the closest known key, and the known ones."""
    known = list(known)
    for key in keys:
        if key in known:
            continue
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        hint = f"; did you mean {prefix}{close[0]}?" if close else ""
        raise ConfigError(f"{prefix}{key} is not {owner}{hint} "
                          f"(valid: {', '.join(listed if listed is not None else known)})")


def _check_cross(cfg: DictConfig, parts: dict[str, tuple[type, dict]]) -> None:
    """Combinations of parts, checked through what each class declares it needs or does (its
    capabilities: ``BATCH_ENVS``, ``IN_LEARNER_PROCESS``, ``CROSS_PROCESS_ONLY``, ``PUSHES``,
    ``NEEDS_PUSHES``; see rltrain/protocols.py), so a class of your own gets the same checks."""
    collector, sync, algo = (parts[path][0] for path in ("collector", "sync", "algo"))
    batch = parts["collector"][1].get("frames_per_batch")
    keys = capability(collector, Collector, "BATCH_ENVS")
    sizes = [_value(cfg, parts, key) for key in keys]
    if isinstance(batch, int) and keys and all(isinstance(n, int) for n in sizes):
        batch_steps(batch, math.prod(sizes), " x ".join(keys))
    if capability(sync, WeightSyncScheme, "CROSS_PROCESS_ONLY") and capability(collector, Collector,
                                                                               "IN_LEARNER_PROCESS"):
        raise ConfigError(f"{_label('sync', sync)} sends weights to worker processes, but "
                          f"{_label('collector', collector)} runs in the learner's process; use sync=shared_mem with "
                          f"it, or collector=lockstep|async with {_label('sync', sync)}")
    strategy = parts["strategy"][0] if "strategy" in parts else Single
    if capability(strategy, Strategy, "PARALLEL"):
        _check_learner_ranks(cfg, parts, strategy)
    else:
        _check_job(cfg, collector, sync)
    _check_weights(cfg, parts)
    why = capability(algo, Algo, "NEEDS_PUSHES")
    if why and not capability(sync, WeightSyncScheme, "PUSHES"):
        raise ConfigError(f"{_label('algo', algo)} with {_label('sync', sync)}: {why}; use sync=shared_mem")


def _value(cfg: DictConfig, parts: dict[str, tuple[type, dict]], key: str) -> Any:
    """The value of config key ``key``: the config's, else the default of the part's constructor."""
    path, _, name = key.rpartition(".")
    return parts[path][1].get(name) if path in parts else OmegaConf.select(cfg, key)


def _check_job(cfg: DictConfig, collector: type, sync: type) -> None:
    """A torchrun job of several processes needs a collector that runs on the other ranks, and
    such a collector needs a sync scheme that reaches them (the same check on every rank)."""
    world = process_groups.current()
    on_ranks = capability(collector, Collector, "ON_OTHER_RANKS")
    if on_ranks:
        collector.check_job(world, OmegaConf.to_container(cfg.collector, resolve=True))
        if not capability(sync, WeightSyncScheme, "REACHES_OTHER_RANKS"):
            raise ConfigError(f"{_label('collector', collector)} runs collectors on other ranks (other machines), "
                              f"which {_label('sync', sync)} cannot reach; use sync=distributed (sync.every=null "
                              "never pushes)")
    elif world is not None:
        raise ConfigError(f"this is rank {world.rank} of a torchrun job of {world.size} processes (WORLD_SIZE), but "
                          f"{_label('collector', collector)} runs on rank 0 alone; use collector=distributed "
                          "sync=distributed (rank 0 learns, the other ranks collect), strategy=ddp (every rank "
                          "learns on its share), or run without torchrun")


def _check_learner_ranks(cfg: DictConfig, parts: dict[str, tuple[type, dict]], strategy: type) -> None:
    """A learner on every rank (``strategy=ddp``): each rank collects its share of the batch itself, with
    a collector and an algorithm that can be split; the global sizes split evenly over the ranks."""
    world = process_groups.current()
    if world is None:
        return  # the strategy's own rule says how to launch it
    name, (collector, collector_values), (algo, algo_values) = _label("strategy", strategy), parts["collector"], \
        parts["algo"]
    if capability(collector, Collector, "ON_OTHER_RANKS"):
        raise ConfigError(f"{_label('collector', collector)} makes rank 0 the one learner and the other ranks "
                          f"collectors, but with {name} every rank learns and collects its own share; use "
                          "collector=local|lockstep with it (or strategy=single with collector ranks)")
    algo_keys = capability(algo, Algo, "DATA_PARALLEL")
    if algo_keys is None:
        raise ConfigError(f"{_label('algo', algo)} does not learn on the data-parallel ranks of {name}; use "
                          "strategy=single (one learner process)")
    if capability(strategy, Strategy, "SHARDED") and not capability(algo, Algo, "SHARDS"):
        raise ConfigError(f"{_label('algo', algo)} does not shard its networks over the ranks of {name}, which is for "
                          "a model too large for one device (algo=grpo's); use strategy=ddp, where every rank holds "
                          "the whole networks")
    split = capability(collector, Collector, "RANK_SPLIT")
    if split is None:
        raise ConfigError(f"{_label('collector', collector)} cannot be split over the ranks of {name}, each of "
                          "which collects its share of every batch in step with the others; use "
                          "collector=local|lockstep")
    sizes = {"collector.frames_per_batch": collector_values.get("frames_per_batch"),
             **{key: _value(cfg, parts, key) for key in split}, **{f"algo.{k}": algo_values.get(k) for k in algo_keys}}
    for key, value in sizes.items():
        if isinstance(value, int) and value % world.size:
            raise ConfigError(f"{key}={value} does not split over the {world.size} ranks of {name} (each takes "
                              f"its share); use a multiple of {world.size}, e.g. {key}={value - value % world.size}"
                              f" or {value + world.size - value % world.size}")
    whole = [key for key in capability(collector, Collector, "BATCH_ENVS") if key not in split]  # (GRPO's groups)
    frames, unit = sizes["collector.frames_per_batch"], math.prod(_value(cfg, parts, key) or 1 for key in whole)
    if whole and isinstance(frames, int) and isinstance(unit, int) and frames % (world.size * unit):
        step = world.size * unit
        raise ConfigError(f"collector.frames_per_batch={frames} does not split into whole {' x '.join(whole)}={unit} "
                          f"groups over the {world.size} ranks of {name} (each rank takes frames_per_batch / "
                          f"{world.size}, whole groups of its own); use a multiple of {step}, e.g. "
                          f"collector.frames_per_batch={max(step, frames - frames % step)}")
    engine = parts.get("engine", (None,))[0] if is_language_task(cfg) else None
    if engine is not None and not capability(engine, Engine, "LEARNER_RANKS"):
        raise ConfigError(f"{_label('engine', engine)} does not run on the ranks of {name} yet (each rank generates "
                          "its share with an engine of its own); use engine=transformers with it, or "
                          "strategy=single")
    sync = parts["sync"][0]
    if why := capability(sync, WeightSyncScheme, "NOT_ON_LEARNER_RANKS"):
        raise ConfigError(f"{_label('sync', sync)} does not run on the ranks of {name} yet: {why}")
    for key in ("compile", "cuda_graph"):
        if algo_values.get(key) is True:
            raise ConfigError(f"algo.{key}=true is not supported with {name} yet (its update exchanges statistics "
                              f"with the other ranks mid-step); use algo.{key}=auto, which is off with it")


def capability(cls: type, interface: type, name: str):
    """What ``cls`` declares as ``name``, or the interface's default for it."""
    return getattr(cls, name, getattr(interface, name))


def _label(group: str, cls: type) -> str:
    """``group=option`` for a class one of rltrain's config options builds, else ``group._target_=...``."""
    for path, option in _options(group):
        if option is cls:
            return f"{group}={path.stem}"
    return f"{group}._target_={cls.__module__}.{cls.__qualname__}"


def moved_key(key: str) -> str | None:
    """What replaced config key ``key`` (``collector.engine``: "is now engine=..."), if a class of rltrain's
    options of its group had it once (its ``MOVED_KEYS``) and none of them takes it now; else None."""
    group, _, name = key.rpartition(".")
    folder = group.replace(".", "/")
    if not group or not (CONFIGS / folder).is_dir():
        return None
    classes = [cls for _, cls in _options(folder)]
    if any(name in _parameter_names(cls) - set(RUNTIME_ARGS.get(group, ())) for cls in classes):
        return None
    return next((cls.MOVED_KEYS[name] for cls in classes if name in getattr(cls, "MOVED_KEYS", {})), None)


def _parameter_names(cls) -> set[str]:
    try:
        return set(inspect.signature(cls).parameters)
    except (TypeError, ValueError):
        return set()


def _options(group: str) -> list[tuple[Path, Any]]:
    """Each of rltrain's config options of ``group`` (its YAML file) and what its ``_target_`` names."""
    options = []
    for path in sorted((CONFIGS / group).glob("*.yaml")):
        target = re.search(r"^\s*_target_:\s*(\S+)", path.read_text(), flags=re.M)  # the first: the option's own
        if target:
            options.append((path, _import_target(group, target.group(1))))
    return options


def _check_env(cfg: DictConfig) -> None:
    """The env id exists, its optional packages are installed, and its spaces are supported."""
    env_id = cfg.env.get("id")
    if not isinstance(env_id, str):
        raise ConfigError(f"env.id must be a gymnasium id string (got {env_id!r})")
    resolve_env_spec(env_id)
    kwargs, wrappers = _env_arguments(cfg)
    if cfg.env.get("backend", "gymnasium") != "gymnasium":
        # Refuses ids without a usable vector env or EnvPool task; the spaces are the backend's own.
        env = make_envs(env_id, 1, cfg.env.backend, kwargs, wrappers=wrappers)
        spec = env.spec
        env.close()
    else:
        try:
            env = make_gym_env(env_id, kwargs, wrappers)
        except TypeError as e:
            raise ConfigError(f"env.kwargs={kwargs} rejected by {env_id}: {e}") from None
        try:
            spec = spec_from_env(env_id, env)
        finally:
            env.close()
    algo_cls = _import_target("algo", cfg.algo._target_)
    name = algo_cls.__name__
    supported = capability(algo_cls, Algo, "ACTION_SPACES")
    if TOKENS in supported:
        raise _language_algo_on_gym_env(algo_cls, env_id)
    if spec.action.kind not in supported:
        raise ConfigError(
            f"algo={name} supports {', '.join(supported)} action spaces, but env.id={env_id!r} has a "
            f"{spec.action.kind} one; use algo=ppo (Discrete, Box, MultiDiscrete and MultiBinary actions)"
        )
    readable = capability(algo_cls, Algo, "OBSERVATIONS")
    for key, leaf in flat_leaves(spec.observation).items():
        if leaf.kind not in readable:
            raise ConfigError(f"algo={name} reads {', '.join(readable)} observations, but env.id={env_id!r} has an "
                              f"{leaf.kind} one ({key}: {' x '.join(map(str, leaf.shape))} {leaf.dtype}); use "
                              "algo=ppo, whose networks encode images with a CNN")
    for key in ("sign_reward", "normalize_reward"):
        if cfg.env.get(key) and key not in inspect.signature(algo_cls).parameters:
            raise ConfigError(f"env.{key}=true, but algo={algo_cls.__name__} does not transform rewards (its "
                              f"constructor takes no {key}); use algo=ppo, or env.{key}=false")


def _check_task(cfg: DictConfig, parts: dict[str, tuple[type, dict]]) -> Task:
    """A language task: an algo, collector, engine and model for it, reward functions that are functions, a
    model that loads, and prompts that fit its context with room for the completion. The task, made."""
    env = cfg.env._target_.rsplit(".", 1)[-1]
    algo = parts["algo"][0]
    if TOKENS not in capability(algo, Algo, "ACTION_SPACES"):
        raise ConfigError(f"env._target_={cfg.env._target_} is a language task (prompts for a language model), which "
                          f"{_label('algo', algo)} cannot learn; use algo=grpo")
    collector = parts["collector"][0]
    if not capability(collector, Collector, "TASKS"):
        raise ConfigError(f"the language task {env} needs a collector that generates text; use collector=generation "
                          f"(not {_label('collector', collector)})")
    for group, choice in (("engine", "engine=transformers (or vllm, vllm_server)"),
                          ("model", "model=tiny (then model.path=DIR or a hub id)")):
        if group not in parts:
            raise ConfigError(f"the language task {env} needs a {'generation engine' if group == 'engine' else group}"
                              f", and the config has none; choose one with {choice}")
    model_cls, model_values = parts["model"]
    model = model_cls(**model_values)
    model.check()
    for name, node in (cfg.env.get("rewards") or {}).items():
        if not isinstance(node, DictConfig) or "_target_" not in node:
            raise ConfigError(f"env.rewards.{name} must be a mapping with a _target_ (a function (prompt, completion, "
                              f"**row) -> float), got {node!r}")
        if not callable(_import_target(f"env.rewards.{name}", node._target_)):
            raise ConfigError(f"env.rewards.{name}._target_={node._target_} is not callable; give a function "
                              "(prompt, completion, **row) -> float")
    rewards = task_rewards(cfg)  # the weights name rewards that exist; configured arguments the functions take
    task = env_maker(cfg)()  # a dataset's file read: a ConfigError names what is wrong in it
    rows = task.rows_to_check()
    for split, split_rows in rows.items():  # each split's columns, as the reward functions read them
        rewards.check_rows(split_rows, task.describe(split))
    prompts = [row["prompt"] for split_rows in rows.values() for row in split_rows]
    model.check_prompts(prompts, parts["collector"][1].get("max_new_tokens", 16), "collector.max_new_tokens")
    if is_language_env(task):
        _check_episodes(task, cfg, parts, model)
    return task


def _check_episodes(env, cfg: DictConfig, parts: dict[str, tuple[type, dict]], model) -> None:
    """A language environment's: the interface, an engine that takes token ids, and room for a turn."""
    check_interface(env, f"env._target_={cfg.env._target_}")
    engine = parts["engine"][0]
    if not capability(engine, Engine, "TOKEN_PROMPTS"):
        raise ConfigError(f"env={type(env).__name__} plays episodes of several turns, which need an engine that "
                          f"takes token ids (TOKEN_PROMPTS); {_label('engine', engine)} does not: use "
                          "engine=transformers or vllm")
    if getattr(env, "format", None) == "template" and not (model.chat_template and
                                                          getattr(model.tokenizer(), "chat_template", None)):
        raise ConfigError(f"env.format=template has the model call tools in its chat template's format, and "
                          f"model.path={model.path} has no chat template (or model.chat_template=false): use "
                          "env.format=tagged")
    values = parts["collector"][1]
    if values.get("max_lag"):
        raise ConfigError("collector.max_lag=1 generates a batch during the update, and an episode of several "
                          f"turns (env={type(env).__name__}) is played turn by turn: use collector.max_lag=0")
    strategy = parts["strategy"][0] if "strategy" in parts else Single
    if capability(strategy, Strategy, "SHARDED"):
        raise ConfigError(f"env={type(env).__name__} plays episodes of several turns, which "
                          f"{_label('strategy', strategy)} does not run yet (its ranks generate in step, and each "
                          "rank's episodes end at a turn of their own): use strategy=ddp")
    budget = values.get("max_context")
    if budget is not None and Path(model.source()).is_dir():
        context = model.context()
        if context is not None and budget > context:
            raise ConfigError(f"collector.max_context={budget} is beyond the context of model.path={model.path} "
                              f"({context} tokens): lower it, or leave it null (the model's context)")
        tokenizer = model.tokenizer()
        template = bool(model.chat_template and getattr(tokenizer, "chat_template", None))
        conversation = Conversation(tokenizer, template, getattr(env, "template_tools", lambda: None)())
        rows = heapq.nlargest(16, env.rows_to_check()["train"], key=lambda row: len(row["prompt"]))
        longest = max(len(conversation.opening(env.reset(row)[1])) for row in rows)
        if longest >= budget:
            raise ConfigError(f"collector.max_context={budget} leaves no room for a turn after the longest opening "
                              f"prompt ({longest} tokens); raise it above {longest}")


def _language_algo_on_gym_env(algo: type, env_id: str) -> ConfigError:
    return ConfigError(f"algo={algo.__name__} trains a language model on a language task (env=reverse, arithmetic or "
                       f"dataset), but env.id={env_id!r} is a gymnasium env; use algo=ppo or algo=sac with it")


def _check_weights(cfg: DictConfig, parts: dict[str, tuple[type, dict]]) -> None:
    """The sync scheme delivers weights the way what acts takes them: a generation engine's ``WEIGHTS``, or
    a collector's policy copies (``module``); a lag only an engine of its own process can generate ahead for."""
    sync = parts["sync"][0]
    delivers = capability(sync, WeightSyncScheme, "DELIVERS")
    engine = parts.get("engine", (None,))[0] if is_language_task(cfg) else None  # (else: _check_env's refusal)
    takes = ("module",) if engine is None else capability(engine, Engine, "WEIGHTS")
    if delivers not in takes:
        collector, algo = parts["collector"][0], parts["algo"][0]
        fits = [f"sync={path.stem}" for path, cls in _options("sync")  # those the other checks let through too
                if capability(cls, WeightSyncScheme, "DELIVERS") in takes
                and not (capability(cls, WeightSyncScheme, "CROSS_PROCESS_ONLY")
                         and capability(collector, Collector, "IN_LEARNER_PROCESS"))
                and not (capability(algo, Algo, "NEEDS_PUSHES") and not capability(cls, WeightSyncScheme, "PUSHES"))]
        what = _label("engine", engine) if engine is not None else _label("collector", parts["collector"][0])
        raise ConfigError(f"{_label('sync', sync)} delivers weights as {delivers}, and {what} takes them as "
                          f"{' or '.join(takes)}; use {' or '.join(fits) or 'a sync scheme that delivers those'}")
    lag = parts["collector"][1].get("max_lag") if engine is not None else None
    if lag and not capability(engine, Engine, "GENERATES_AHEAD"):
        raise ConfigError(f"collector.max_lag={lag} generates the next batch while the learner updates, which "
                          f"{_label('engine', engine)} cannot (it generates in the learner's process); use "
                          "engine=vllm (or vllm_server), or collector.max_lag=0")


def _env_arguments(cfg: DictConfig) -> tuple[dict, list]:
    """``env.kwargs`` and ``env.wrappers`` as plain values (a ConfigError if the wrappers are no list)."""
    kwargs = OmegaConf.to_container(cfg.env.kwargs) if cfg.env.get("kwargs") else {}
    wrappers = OmegaConf.to_container(cfg.env.wrappers, resolve=True) if cfg.env.get("wrappers") else []
    if not isinstance(wrappers, list):
        raise ConfigError(f"env.wrappers must be a list of {{wrapper: NAME, ...arguments}} (got {wrappers!r})")
    return kwargs, wrappers


def _check_requires(path: str, cls: type) -> None:
    """The packages a logger imports once it starts (its ``REQUIRES``) are installed."""
    for package, install in capability(cls, Logger, "REQUIRES").items():
        if importlib.util.find_spec(package) is None:
            raise ConfigError(f"{path} ({cls.__name__}) needs {package}, which is not installed: {install} "
                              f"(or leave {path.split('.')[-1]} out of logger=[...])")


def _check_video(cfg: DictConfig) -> None:
    """Eval videos need moviepy (gymnasium's RecordVideo) and the env's rgb_array renderer."""
    if cfg.env.get("backend", "gymnasium") != "gymnasium":
        raise ConfigError("hooks.eval.video=true records a single gymnasium env, which env.backend="
                          f"{cfg.env.backend} does not make; set hooks.eval.video=false, or env.backend=gymnasium")
    if importlib.util.find_spec("moviepy") is None:
        raise ConfigError("hooks.eval.video=true records with gymnasium's RecordVideo, which needs moviepy: "
                          "pip install 'rltrain[video]' (or set hooks.eval.video=false)")
    kwargs, wrappers = _env_arguments(cfg)
    try:
        env = make_gym_env(cfg.env.id, {**kwargs, "render_mode": "rgb_array"}, wrappers)
        try:
            env.reset(seed=0)
            env.render()
        finally:
            env.close()
    except Exception as e:  # noqa: BLE001  (a missing renderer shows up in many forms: pygame, OpenGL)
        raise ConfigError(f"hooks.eval.video=true, but env.id={cfg.env.id!r} cannot render rgb_array frames "
                          f"here ({type(e).__name__}: {e}); pip install 'rltrain[video]' for classic-control "
                          "envs, MUJOCO_GL=egl (or osmesa) for MuJoCo on a headless machine") from None
