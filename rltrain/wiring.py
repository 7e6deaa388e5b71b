"""What ``rltrain.build`` wires, stated once: the runtime objects it gives each part, the config keys it
consumes itself, and how it makes a run's env (or language task) and its reward functions. The factory
builds with these and the config check refuses what contradicts them; both import this module, and
neither imports the other's checks or builders through it.
"""

from __future__ import annotations

import copy
import functools
import math

from hydra.utils import get_class, get_object, instantiate
from omegaconf import DictConfig, OmegaConf, open_dict

from rltrain.llm.environments import is_language_env
from rltrain.llm.rewards import Rewards
from rltrain.llm.tasks import Task
from rltrain.rules import parameter_defaults

# env keys that go to the algo (the learner scales rewards, whichever process stepped the env):
ENV_TO_ALGO = ("sign_reward", "normalize_reward", "clip_reward")
# A language task's reward functions (env.rewards: name -> {_target_: function, ...its arguments}) and their
# weights, which build() turns into one Rewards for the collector and the hooks:
TASK_REWARDS = ("rewards", "reward_weights", "reward_timeout_s")
# Keys of a node that build() consumes itself rather than passing to the node's _target_:
WIRING_KEYS = {"algo": {"network"}, "env": {*ENV_TO_ALGO, *TASK_REWARDS}}
# The runtime objects build() passes to each group's constructors (by name, to those that ask for
# them); a config must not set them. Every injection in the factory goes through ``runtime``, which holds it
# to this.
RUNTIME_ARGS = {
    "env": ("seed",),
    "algo": ("policy", "total_frames", "device", "strategy", *ENV_TO_ALGO),
    "algo.network": ("env_spec",),
    "engine": ("model", "tokenizer", "receiver", "policy", "learner", "device", "seed", "run_dir"),
    "collector": ("make_env", "make_policy", "make_receiver", "env_spec", "seed", "sender", "task", "engine", "model",
                  "rewards", "device", "strategy", "state_size"),
    "logger": ("run_dir", "config", "resume"),
    "hooks": ("policy", "sender", "sync", "loggers", "make_env", "device", "env_spec", "run_dir", "algo", "collector",
              "config", "hooks", "task", "model", "rewards", "strategy"),
    "trainer": ("collector", "algo", "hooks", "loggers", "run_dir", "max_lag", "run_dir_lock", "strategy"),
}


def runtime(group: str, **objects) -> dict:
    """``objects``, the runtime arguments of ``group``'s constructors, if RUNTIME_ARGS states each of
    them (the config check refuses a config that sets one: the two cannot drift apart)."""
    unstated = set(objects) - set(RUNTIME_ARGS[group])
    if unstated:
        raise TypeError(f"build() injects {', '.join(sorted(unstated))} into {group}: add it to RUNTIME_ARGS")
    return objects


def env_maker(cfg: DictConfig) -> functools.partial:
    """What makes ``cfg.env``'s env (a language task: the task), seeded by the run's seed."""
    return plain_partial(without(cfg.env, WIRING_KEYS["env"]), **runtime("env", seed=cfg.get("seed", 0)))


def is_language_task(cfg: DictConfig) -> bool:
    """Whether ``cfg.env`` is a language task (``rltrain.llm.tasks.Task``): prompts for a language model."""
    target = cfg.env.get("_target_") if isinstance(cfg.get("env"), DictConfig) else None
    try:  # get_object, not get_class: get_class logs an error line for a function target (make_envs)
        cls = get_object(target) if isinstance(target, str) else None
    except (ImportError, ValueError):  # a target the config check names
        return False
    return isinstance(cls, type) and issubclass(cls, Task)


def task_rewards(cfg: DictConfig) -> Rewards:
    """The task's reward functions: each ``env.rewards`` node's function with its other keys bound
    (the task class's own rewards when the config names none), weighted by ``env.reward_weights``."""
    nodes = cfg.env.get("rewards")
    task = get_class(cfg.env._target_)
    if nodes is None:
        functions = dict(task.REWARDS)
    else:
        # Plain functools.partials: a reward function is called for every completion, and Hydra's own
        # partial would check the target against its policy at each call (10 ms a batch of 128).
        functions = {name: plain_partial(node) if isinstance(node, DictConfig) else node
                     for name, node in nodes.items()}
    weights = OmegaConf.to_container(cfg.env.reward_weights) if cfg.env.get("reward_weights") else {}
    return Rewards(functions, weights, timeout_s=cfg.env.get("reward_timeout_s", Rewards.TIMEOUT_S),
                   required=not is_language_env(task))  # (an environment's own rewards may stand alone)


def plain_partial(node: DictConfig, **kwargs) -> functools.partial:
    """``node``'s target with its config values bound, as a plain functools.partial (Hydra's own
    partial type would make every worker process import Hydra to unpickle it)."""
    deferred = instantiate(node, _partial_=True, _convert_="all")
    return functools.partial(deferred.func, *deferred.args, **{**deferred.keywords, **kwargs})


def without(node: DictConfig, keys: set[str]) -> DictConfig:
    """``node`` without ``keys``, its interpolations resolved (``${collector.max_new_tokens}`` points outside it)."""
    return OmegaConf.create({k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if k not in keys})


def rank_share(cfg: DictConfig, rank: int, size: int) -> DictConfig:
    """``cfg`` as learner rank ``rank`` of a data-parallel learner of ``size`` ranks collects: its share of
    ``collector.frames_per_batch`` and of the envs (the collector's ``RANK_SPLIT`` keys), and ``seed`` that
    of its first env, so that env i of the whole job gets ``seed + i`` as in one process (a collector that
    splits no envs keeps the job's seed, and takes its rank from the strategy it is given)."""
    if size == 1:
        return cfg
    cls = get_class(cfg.collector._target_)
    defaults = parameter_defaults(cls)

    def value(key: str) -> int:
        group, _, name = key.partition(".")
        return OmegaConf.select(share, key, default=defaults.get(name) if group == "collector" else None)

    share = copy.deepcopy(cfg)
    with open_dict(share):
        for key in ("collector.frames_per_batch", *cls.RANK_SPLIT):
            OmegaConf.update(share, key, value(key) // size, force_add=True)
        if cls.RANK_SPLIT:  # (a collector that splits no envs seeds its ranks itself: GenerationCollector)
            share.seed = cfg.seed + rank * math.prod(value(key) for key in cls.BATCH_ENVS)
    return share
