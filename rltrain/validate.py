"""Checks a composed config before anything is built: every problem is a ConfigError naming
the key, the value and what is allowed. Nothing here starts a process or writes a file."""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import math
import numbers
import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rltrain import distributed
from rltrain.algos.finite import MODES as NONFINITE_ALGO
from rltrain.algos.networks import ACTIVATIONS
from rltrain.algos.update_step import compile_enabled, cuda_graph_enabled
from rltrain.collectors.distributed import MODES as DISTRIBUTED_MODES
from rltrain.device import DEVICES, resolve_device
from rltrain.envs.batched import NONFINITE as NONFINITE_ENV
from rltrain.envs.batched import make_gym_env, resolve_env_spec, spec_from_env
from rltrain.envs.spaces import flat_leaves
from rltrain.envs.vector import BACKENDS, make_envs
from rltrain.errors import ConfigError
from rltrain.hooks.base import SCHEDULE_UNITS
from rltrain.loggers import Logger
from rltrain.protocols import Algo, Collector, missing_members
from rltrain.sync.base import WeightSyncScheme
from rltrain.trainer import OBJECTIVES, Trainer

CONFIGS = Path(__file__).parent / "configs"

# The interface each part's class must have (rltrain.protocols); hooks subclass rltrain.hooks.Hook.
INTERFACES = {"algo": Algo, "collector": Collector, "logger": Logger}

# The top level of rltrain's config: its own keys and its config groups (config.yaml). Anything
# else there is a typo (``+trainer.total_frame=...`` adds a key nothing reads); ``hydra`` is Hydra's.
TOP_LEVEL_KEYS = ("seed", "device", "threads", "resume", "objective", "trainer", "algo", "env", "collector", "sync",
                  "logger", "hooks", "hydra")
# env keys that build() hands to the algo (the learner scales rewards, whichever process stepped the env).
ENV_TO_ALGO = ("sign_reward", "normalize_reward", "clip_reward")
# Keys that build() consumes itself rather than passing to the node's _target_.
WIRING_KEYS = {"algo": {"network"}, "env": set(ENV_TO_ALGO)}
# Arguments build() passes at instantiate time; a config must not set them.
RUNTIME_ARGS = {
    "env": {"seed"},
    "algo": {"policy", "total_frames", "device", *ENV_TO_ALGO},
    "algo.network": {"env_spec"},
    "collector": {"make_env", "make_policy", "make_receiver", "env_spec", "seed", "sender"},
    "logger": {"run_dir", "config", "resume"},
    "hooks": {"policy", "sender", "sync", "loggers", "make_env", "device", "env_spec", "run_dir", "algo",
              "collector", "config", "hooks"},
    "trainer": {"collector", "algo", "hooks", "loggers", "run_dir", "max_lag", "run_dir_lock"},
}


def _number(v) -> bool:
    """A finite int or float (not a bool): inf and nan pass no rule that asks for a number."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def _positive(v) -> bool:
    return _number(v) and v > 0


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _non_negative_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _non_negative(v) -> bool:
    return _number(v) and v >= 0


def _unit(v) -> bool:
    return _number(v) and 0 <= v <= 1


# (key, check, what is allowed, optional hint). A rule applies when its key is in the config.
RULES: list[tuple[str, Callable, str, str]] = [
    ("seed", lambda v: isinstance(v, int) and v >= 0, "an integer >= 0", ""),
    ("objective", lambda v: v in OBJECTIVES, " or ".join(OBJECTIVES),
     "; it names the summary.json value a sweeper optimizes"),
    ("threads", lambda v: v is None or _positive_int(v), "an integer >= 1 or null", ""),
    ("trainer.total_frames", _positive_int, "an integer >= 1", ""),
    ("trainer.return_window", _positive_int, "an integer >= 1", ""),
    ("trainer.stop_at_return", lambda v: v is None or v == "auto" or _number(v),
     "a number, auto (the env's reward threshold) or null (never stop early)", ""),
    ("env.num_envs", _positive_int, "an integer >= 1", ""),
    ("env.nonfinite", lambda v: v in NONFINITE_ENV, " or ".join(NONFINITE_ENV), ""),
    ("env.normalize_reward", lambda v: isinstance(v, bool), "true or false", ""),
    ("env.sign_reward", lambda v: isinstance(v, bool), "true or false", ""),
    ("env.clip_reward", lambda v: v is None or _positive(v), "a number > 0, or null (no clip)", ""),
    ("algo.nonfinite", lambda v: v in NONFINITE_ALGO, " or ".join(NONFINITE_ALGO), ""),
    ("collector.frames_per_batch", _positive_int, "an integer >= 1", ""),
    ("collector.workers", _positive_int, "an integer >= 1", ""),
    ("collector.envs_per_worker", _positive_int, "an integer >= 1", ""),
    ("collector.envs_per_rank", _positive_int, "an integer >= 1", ""),
    ("collector.workers_per_rank", _non_negative_int, "an integer >= 0 (0: a rank steps its envs itself)", ""),
    ("collector.mode", lambda v: v in DISTRIBUTED_MODES, " or ".join(DISTRIBUTED_MODES), ""),
    ("sync.listeners", _non_negative_int, "an integer >= 0", ""),
    ("sync.bucket_mb", _positive, "a number > 0", ""),
    ("collector.max_lag", lambda v: v is None or (isinstance(v, int) and v >= 0), "an integer >= 0 or null", ""),
    ("collector.start_method", lambda v: v in ("spawn", "forkserver", "fork"), "spawn, forkserver or fork", ""),
    ("collector.timeout_s", _positive, "a number > 0", ""),
    ("sync.every", lambda v: v is None or _positive_int(v), "an integer >= 1, or null (never push)", ""),
    ("sync.timeout_s", _positive, "a number > 0", ""),
    ("sync.slots", lambda v: _positive_int(v) and v >= 2, "an integer >= 2", ""),
    ("algo.lr", _positive, "a number > 0", ""),
    ("algo.gamma", lambda v: _unit(v) and v > 0, "a number in (0, 1]", ""),
    ("algo.gae_lambda", _unit, "a number in [0, 1]", ""),
    ("algo.epochs", _positive_int, "an integer >= 1", ""),
    ("algo.minibatch_size", _positive_int, "an integer >= 1", ""),
    ("algo.clip_coef", _positive, "a number > 0", ""),
    ("algo.vf_coef", _non_negative, "a number >= 0", ""),
    ("algo.ent_coef", _non_negative, "a number >= 0", ""),
    ("algo.max_grad_norm", _positive, "a number > 0", ""),
    ("algo.target_kl", lambda v: v is None or _positive(v), "a number > 0 or null", ""),
    ("algo.adam_eps", _positive, "a number > 0", ""),
    ("algo.critic_lr", _positive, "a number > 0", ""),
    ("algo.tau", lambda v: _unit(v) and v > 0, "a number in (0, 1]", ""),
    ("algo.batch_size", _positive_int, "an integer >= 1", ""),
    ("algo.utd", _positive, "a number > 0", ""),
    ("algo.warmup_frames", lambda v: isinstance(v, int) and v >= 0, "an integer >= 0", ""),
    ("algo.buffer_size", _positive_int, "an integer >= 1", ""),
    ("algo.alpha", _positive, "a number > 0", ""),
    ("algo.critic_hidden_sizes", lambda v: len(v) > 0 and all(_positive_int(h) for h in v),
     "a non-empty list of integers >= 1", ""),
    ("algo.network.hidden_sizes", lambda v: isinstance(v, list) and all(_positive_int(h) for h in v),
     "a list of integers >= 1 ([] for a single linear layer over the features, PPO only)", ""),
    ("algo.network.activation", lambda v: v in ACTIVATIONS, f"one of {', '.join(ACTIVATIONS)}", ""),
    ("resume", lambda v: v is None or (isinstance(v, str) and v != ""),
     "null, auto, or the path of a run dir or checkpoint file", ""),
    ("hooks.eval.episodes", _positive_int, "an integer >= 1", ""),
    ("hooks.eval.video", lambda v: isinstance(v, bool), "true or false", ""),
    ("env.backend", lambda v: v in BACKENDS, f"one of {', '.join(BACKENDS)}", ""),
    ("hooks.checkpoint.keep_last", _positive_int, "an integer >= 1", ""),
    ("hooks.checkpoint.replay_buffer", lambda v: isinstance(v, bool), "true or false", ""),
    ("hooks.timing.cuda_sync", lambda v: isinstance(v, bool), "true or false", ""),
    ("algo.compile", lambda v: v in (True, False, "auto"), "true, false or auto (on with device=cuda)", ""),
    ("algo.cuda_graph", lambda v: v in (True, False, "auto"), "true, false or auto (on with device=cuda)", ""),
    ("hooks.progress.bar", lambda v: v in (True, False, "auto"), "auto, true or false", ""),
]


def validate(cfg: DictConfig) -> None:
    """Raise ConfigError for the first problem found in ``cfg``."""
    try:
        OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:
        raise ConfigError(f"the config does not resolve: {e}") from None
    _check_keys("", cfg.keys(), TOP_LEVEL_KEYS, "a top-level key of rltrain's config",
                listed=[k for k in TOP_LEVEL_KEYS if k != "hydra"])
    if isinstance(cfg.get("trainer"), DictConfig):  # the trainer's keys are its constructor's arguments
        params = inspect.signature(Trainer).parameters
        _check_keys("trainer.", cfg.trainer.keys(), [p for p in params if p not in RUNTIME_ARGS["trainer"]],
                    "a key of trainer (the arguments of rltrain.Trainer)")
    for key, check, allowed, hint in RULES:
        value = OmegaConf.select(cfg, key, default="__absent__")
        if value == "__absent__":
            continue
        value = OmegaConf.to_object(value) if OmegaConf.is_config(value) else value
        try:
            ok = check(value)
        except TypeError:
            ok = False
        if not ok:
            if isinstance(value, float) and value.is_integer() and "integer" in allowed:
                hint += f"; write {int(value)} (YAML and the command line read 1e9 as a float)"
            raise ConfigError(f"{key} must be {allowed} (got {value!r}){hint}")
    _check_device(cfg.get("device", "auto"))
    _check_compile(cfg)
    for path in ("env", "algo", "algo.network", "collector", "sync"):
        _check_node(cfg, path, required=path != "algo.network")
    for group in ("logger", "hooks"):
        for name in (cfg.get(group) or {}):
            _check_node(cfg, f"{group}.{name}", required=True, runtime_group=group)
    for name, node in (cfg.get("logger") or {}).items():
        _check_requires(f"logger.{name}", _import_target(f"logger.{name}", node._target_))
    for name, hook in (cfg.get("hooks") or {}).items():
        _check_schedule(f"hooks.{name}.every", hook.get("every"))
    _check_cross(cfg)
    _check_env(cfg)
    if OmegaConf.select(cfg, "hooks.eval.video", default=False):
        _check_video(cfg)


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


def _check_node(cfg: DictConfig, path: str, required: bool, runtime_group: str | None = None) -> None:
    node = OmegaConf.select(cfg, path)
    if node is None:
        if required:
            raise ConfigError(f"{path} is missing; choose one with {path.split('.')[0]}=<choice>")
        return
    if not isinstance(node, DictConfig) or "_target_" not in node:
        raise ConfigError(f"{path} must be a mapping with a _target_ (the class to build), got {node!r}")
    target = _import_target(path, node._target_)
    interface = INTERFACES.get(runtime_group or path)
    if interface is not None and isinstance(target, type) and (missing := missing_members(target, interface)):
        raise ConfigError(f"{path}._target_={node._target_} lacks {', '.join(missing)} of rltrain's "
                          f"{interface.__name__} interface; add them (see {interface.__module__}.{interface.__name__}, "
                          "which says what each does)")
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    group = runtime_group or path
    runtime = RUNTIME_ARGS.get(group, set())
    wiring = WIRING_KEYS.get(path, set())
    for key in node:
        if key in runtime:
            raise ConfigError(f"{path}.{key} is set by rltrain at build time; remove it from the config")
    allowed = [p for p in params if p not in runtime and p != "self"]
    _check_keys(f"{path}.", [k for k in node if not k.startswith("_") and k not in wiring], [*allowed, *wiring],
                f"a parameter of {node._target_}", listed=allowed)


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


def _check_schedule(key: str, every) -> None:
    if every is None:
        return
    if not isinstance(every, DictConfig) or len(every) != 1 or next(iter(every)) not in SCHEDULE_UNITS:
        raise ConfigError(f"{key} must be null or one of {{frames|batches|updates|seconds: N}} (got {every!r})")
    unit, n = next(iter(every.items()))
    if not _positive(n) or (unit != "seconds" and not isinstance(n, int)):
        raise ConfigError(f"{key}.{unit} must be {'a number' if unit == 'seconds' else 'an integer'} > 0 (got {n!r})")


def _check_cross(cfg: DictConfig) -> None:
    """Combinations of parts, checked through what each class declares it needs or does (its
    capabilities: ``BATCH_ENVS``, ``IN_LEARNER_PROCESS``, ``CROSS_PROCESS_ONLY``, ``PUSHES``,
    ``NEEDS_PUSHES``; see rltrain/protocols.py), so a class of your own gets the same checks."""
    collector = _import_target("collector", cfg.collector._target_)
    sync = _import_target("sync", cfg.sync._target_)
    algo = _import_target("algo", cfg.algo._target_)
    batch = cfg.collector.get("frames_per_batch")
    keys = capability(collector, Collector, "BATCH_ENVS")
    sizes = [OmegaConf.select(cfg, key) for key in keys]
    if batch is not None and keys and all(isinstance(n, int) for n in sizes) and batch % math.prod(sizes):
        num_envs = math.prod(sizes)
        raise ConfigError(
            f"collector.frames_per_batch ({batch}) must be a multiple of {' x '.join(keys)} ({num_envs}); "
            f"e.g. collector.frames_per_batch={max(1, batch // num_envs) * num_envs}"
        )
    if capability(sync, WeightSyncScheme, "CROSS_PROCESS_ONLY") and capability(collector, Collector,
                                                                               "IN_LEARNER_PROCESS"):
        raise ConfigError(f"{_label('sync', sync)} sends weights to worker processes, but "
                          f"{_label('collector', collector)} runs in the learner's process; use sync=shared_mem with "
                          f"it, or collector=lockstep|async with {_label('sync', sync)}")
    _check_job(cfg, collector, sync)
    why = capability(algo, Algo, "NEEDS_PUSHES")
    if why and not capability(sync, WeightSyncScheme, "PUSHES"):
        raise ConfigError(f"{_label('algo', algo)} with {_label('sync', sync)}: {why}; use sync=shared_mem")
    buffer_size = cfg.algo.get("buffer_size")
    for key, need, what in [("algo.batch_size", cfg.algo.get("batch_size"), "the frames of one gradient step"),
                            ("collector.frames_per_batch", batch, "one collector batch")]:
        if buffer_size is not None and need is not None and buffer_size < need:
            raise ConfigError(f"algo.buffer_size ({buffer_size}) is smaller than {key} ({need}): the replay buffer "
                              f"cannot hold {what}; use algo.buffer_size={need} or more")
    minibatch = cfg.algo.get("minibatch_size")
    if minibatch is not None and batch is not None and minibatch > batch:
        raise ConfigError(
            f"algo.minibatch_size ({minibatch}) is larger than the batch "
            f"(collector.frames_per_batch={batch}); use at most {batch}"
        )


def _check_job(cfg: DictConfig, collector: type, sync: type) -> None:
    """A torchrun job of several processes needs a collector that runs on the other ranks, and
    such a collector needs a sync scheme that reaches them (the same check on every rank)."""
    world = distributed.current()
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
                          "sync=distributed (rank 0 learns, the other ranks collect), or run without torchrun")


def capability(cls: type, interface: type, name: str):
    """What ``cls`` declares as ``name``, or the interface's default for it."""
    return getattr(cls, name, getattr(interface, name))


def _label(group: str, cls: type) -> str:
    """``group=option`` for a class one of rltrain's config options builds, else ``group._target_=...``."""
    for path in sorted((CONFIGS / group).glob("*.yaml")):
        target = re.search(r"^_target_:\s*(\S+)", path.read_text(), flags=re.M)
        if target and _import_target(group, target.group(1)) is cls:
            return f"{group}={path.stem}"
    return f"{group}._target_={cls.__module__}.{cls.__qualname__}"


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
