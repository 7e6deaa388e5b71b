"""The factory behind ``rltrain.build``: a composed config in, a ready Trainer out. The only place
that wires parts together (a module apart from the package root so that importing ``rltrain`` stays
cheap for spawned collector workers).

Order: validate everything (and read the checkpoint to resume from, if any), then env -> policy
-> algo -> sync (scheme, sender) -> engine (its receiver; a language model's run) -> collector ->
loggers -> hooks. If any step fails, whatever was already started is closed again. What each part is
given is stated in ``rltrain.wiring``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import logging
import os
import pickle
import random
import traceback
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import torch
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

from rltrain import checkpoint, process_groups
from rltrain.algos.recurrent import state_size
from rltrain.collectors.local import LocalCollector
from rltrain.collectors.lockstep import LockstepCollector
from rltrain.collectors.rank_pool import frame_buffer
from rltrain.collectors.rank_server import RankServer, report_and_wait
from rltrain.device import resolve_device
from rltrain.envs import EnvSpec
from rltrain.errors import CheckpointError, ConfigError, RunDirError
from rltrain.llm.tasks import Task, TaskSpec
from rltrain.loggers import JsonlLogger
from rltrain.protocols import Collector
from rltrain.run_dir import RunDirLock, place
from rltrain.state import TrainState
from rltrain.strategies import Single, Strategy
from rltrain.sync.base import WeightReceiver, WeightSender, WeightSyncScheme
from rltrain.sync.distributed import CONTACT_FILE
from rltrain.sync.shared_mem import SharedMemSync
from rltrain.trainer import Trainer, summarize, write_summary
from rltrain.validate import Checked, validate
from rltrain.wiring import (
    ENV_TO_ALGO,
    WIRING_KEYS,
    env_maker,
    plain_partial,
    rank_share,
    runtime,
    task_rewards,
    without,
)

log = logging.getLogger("rltrain")
_SETUP = "setup"  # rank 0 -> collector ranks: the run dir, weights version and seed (or why it was refused)

class RefusedByLearner(Exception):
    """Rank 0 refused the run (a config, checkpoint or run-dir error it reported itself)."""


def build(cfg: DictConfig, run_dir: str | Path | None = None) -> Trainer:
    """Validate ``cfg`` and build the Trainer it describes; ``run_dir`` defaults to Hydra's output dir
    (or, outside Hydra, a new ``outputs/DATE/TIME``).

    With ``resume`` set, the run continues in the dir of the checkpoint it resumes from, and every
    part is restored from it before anything starts (a checkpoint that does not fit fails here).
    The run dir is locked before anything is written to it: a dir that a live run holds, or that
    another run already finished in, is refused (RunDirError).

    In a torchrun job this is rank 0 (the learner); it tells the collector ranks (``serve_rank``)
    the run dir, or why the run was refused.
    """
    world = process_groups.current()
    if learner_ranks(cfg):
        return _build_on_rank(cfg, run_dir)
    if world is not None and world.rank != 0:
        raise ConfigError(f"build() makes the learner, which is rank 0; this is rank {world.rank} of a torchrun job, "
                          "which collects: rltrain.factory.serve_rank(cfg)")
    try:
        return _build(cfg, run_dir, world, validate(cfg), Single())
    except BaseException as e:
        if world is not None and not world.store.check([_SETUP]):  # the collector ranks wait for it: tell them
            world.store.set(_SETUP, pickle.dumps({"refused": f"{type(e).__name__}: {e}"}))
        raise


def learner_ranks(cfg: DictConfig) -> bool:
    """Whether ``cfg`` runs a learner on every rank of a torchrun job (``strategy=ddp``)."""
    node = cfg.get("strategy")
    if node is None:
        return False
    module, _, name = str(node.get("_target_")).rpartition(".")
    try:
        return bool(getattr(getattr(importlib.import_module(module), name), "PARALLEL", False))
    except (ImportError, ValueError, AttributeError):  # a target that does not import: the config check names it
        return False


def _build_on_rank(cfg: DictConfig, run_dir: str | Path | None) -> Trainer:
    """This rank's learner of a data-parallel job: the config checked on every rank and compared with rank 0's,
    then the run dir and the checkpoint that rank 0 places and reads, and this rank's share of the parts."""
    checked = validate(cfg)
    strategy = _construct(cfg.strategy)
    try:
        _same_config_everywhere(strategy, OmegaConf.to_container(cfg, resolve=True))
        if strategy.is_main:
            told = []

            def announce(setup: dict) -> None:
                told.append(strategy.broadcast(setup))

            try:
                return _build(cfg, run_dir, None, checked, strategy, announce)
            except BaseException as e:
                if not told:  # the other ranks wait for the run dir: tell them why there is none
                    strategy.broadcast({"refused": f"{type(e).__name__}: {e}"})
                raise
        setup = strategy.broadcast(None)
        if "refused" in setup:
            raise RefusedByLearner(f"rank 0 did not start the run: {setup['refused']}")
        _log_to_file(Path(setup["run_dir"]) / "ranks" / f"{strategy.rank}.log")
        for handler in logging.getLogger().handlers:  # the terminal tells rank 0's story; the others' warnings
            if type(handler) is logging.StreamHandler:
                handler.setLevel(logging.WARNING)
        restore = checkpoint.Restore(setup["saved"], setup["path"], rank=strategy.rank)
        trainer = _build_parts(cfg, OmegaConf.to_container(cfg, resolve=True), Path(setup["run_dir"]), None, restore,
                               checked, strategy)
        return trainer
    except BaseException:
        strategy.close()
        raise


def _same_config_everywhere(strategy, resolved: dict) -> None:
    """Ranks started with different configs would learn different things: name the first key that differs."""
    configs = strategy.gather(resolved)
    for rank, other in enumerate(configs):
        if changes := checkpoint.config_changes(configs[0], other):
            raise ConfigError(f"the ranks were started with different configs: rank {rank} has {changes[0]} (against "
                              "rank 0's); start every rank with the same command")


def _build(cfg: DictConfig, run_dir: str | Path | None, world: process_groups.World | None, checked: Checked,
           strategy, announce=None) -> Trainer:
    resolved = OmegaConf.to_container(cfg, resolve=True)
    placement = place(cfg.get("resume"), resolved, run_dir)
    found = placement.checkpoint
    restore = checkpoint.Restore(checkpoint.load(found), found) if found else checkpoint.Restore.none()
    run_dir = placement.path
    lock = placement.claim()
    try:
        if world is not None:  # every rank uses rank 0's run dir; envs a checkpoint cannot restore start reseeded
            world.store.set(_SETUP, pickle.dumps({"run_dir": str(Path(run_dir).resolve()), "version": restore.version,
                                                  "seed": cfg.seed + restore.frames}))
        if announce is not None:  # the other learner ranks: rank 0's run dir, and its checkpoint
            announce({"run_dir": str(Path(run_dir).resolve()), "saved": restore.saved, "path": found})
        trainer = _build_parts(cfg, resolved, run_dir, lock, restore, checked, strategy)
    except BaseException as e:
        if not placement.in_place and not isinstance(e, (ConfigError, CheckpointError, RunDirError)):
            # Started, then failed (an env raising on reset, a signal while workers start): say so.
            status = "interrupted" if isinstance(e, KeyboardInterrupt) else f"failed: {type(e).__name__}: {e}"
            write_summary(run_dir, summarize(TrainState(run_dir, cfg.trainer.total_frames), status, None))
        lock.release()
        raise
    if placement.in_place:
        checkpoint.set_aside_newer(run_dir, found)  # a resume from an older checkpoint: a new branch
    return trainer


def _build_parts(cfg: DictConfig, resolved: dict, run_dir: Path, lock: RunDirLock | None,
                 restore: checkpoint.Restore, checked: Checked, strategy: Strategy) -> Trainer:
    """env -> policy -> algo -> sync -> engine -> collector -> loggers -> hooks -> Trainer, each restored
    from the checkpoint (if any) as it is made; whatever was started is closed if a step fails. A rank of a
    data-parallel learner collects its share (``rank_share``) and makes the loggers and the hooks that are
    rank 0's only on rank 0."""
    _seed_everything(cfg.seed)  # the same initial weights on every rank
    if cfg.get("threads"):
        torch.set_num_threads(cfg.threads)
    device = strategy.device(resolve_device(cfg.device))
    share = rank_share(cfg, strategy.rank, strategy.size)  # cfg itself with one learner

    make_env, env_spec, make_policy = _env_and_policy(share, checked.task)
    # A language model's run: the task (the one the config check read), the model node and the task's
    # rewards, for the engine, the collector and the hooks.
    task = checked.task
    model = _construct(cfg.model) if task is not None else None
    rewards = task_rewards(cfg) if task is not None else None

    with ExitStack() as cleanup:
        # a sharded learner's ranks but 0 read no weights: they shard the model's shapes and get rank 0's weights
        meta = strategy.SHARDED and not strategy.is_main and task is not None  # (a language model's: it can)
        policy = make_policy(meta=True) if meta else make_policy().to(device)
        # env.sign_reward and env.normalize_reward transform rewards on the learner: the algo is told
        # (clip_reward only with normalize_reward). Logged episode returns stay the env's own.
        reward_scaling = {k: cfg.env[k] for k in ENV_TO_ALGO
                          if k in cfg.env and cfg.env.get("sign_reward" if k == "sign_reward" else "normalize_reward")}
        algo_args = {"strategy": strategy} if strategy.PARALLEL else {}  # (a user's own algo: single needs nothing)
        algo = _construct(without(cfg.algo, WIRING_KEYS["algo"]), **runtime(
            "algo", policy=policy, device=device, total_frames=cfg.trainer.total_frames, **reward_scaling,
            **algo_args))
        restore.algo(algo, resolved, sharded=strategy.SHARDED)
        if strategy.rank:  # each rank samples its own actions (rank 0 as one process would)
            _seed_everything(share.seed + 7919 * strategy.rank)
        scheme = _construct(cfg.sync)
        sender = restore.sender(scheme, policy)
        cleanup.callback(sender.close)
        if (contact := sender.contact()) is not None:  # how a process of the user's own joins (rltrain.sync.listen)
            (run_dir / CONTACT_FILE).write_text(json.dumps(contact) + "\n")
        sender.start()
        seed = share.seed + restore.frames  # a resumed run's collection does not replay the first frames' draws
        engine = None
        if task is not None:
            engine = _build_engine(cfg.engine, scheme, sender, model, make_policy, policy, device, seed, run_dir)
            cleanup.callback(engine.close)
        # Collectors build their own policy copies; weights reach them only through the sync scheme.
        # Envs a checkpoint cannot restore start fresh episodes, reseeded so as not to replay the first ones.
        collector = _instantiate_with(share.collector, **runtime(
            "collector", make_env=make_env, make_policy=make_policy, make_receiver=scheme.receiver, env_spec=env_spec,
            seed=seed, sender=sender, task=task, engine=engine, model=model, rewards=rewards, device=device,
            strategy=strategy, state_size=state_size(policy)))
        cleanup.callback(collector.close)
        restore.collector(collector)

        loggers = _build_loggers(cfg, run_dir, resolved, restore, cleanup) if strategy.is_main else []
        hooks = {}  # the checkpoint hook saves each hook's state: filled as they are made
        hook_args = runtime("hooks", policy=policy, sender=sender, sync=scheme, loggers=loggers, device=device,
                           make_env=functools.partial(make_env, seed=cfg.seed + 1_000_000), env_spec=env_spec,
                           run_dir=run_dir, algo=algo, collector=collector, config=resolved, hooks=hooks, task=task,
                           model=model, rewards=rewards, strategy=strategy)
        hooks.update((name, _instantiate_with(node, **hook_args)) for name, node in (cfg.get("hooks") or {}).items()
                     if strategy.is_main or _on_every_rank(get_class(node._target_), strategy))

        trainer_args = OmegaConf.to_container(cfg.trainer, resolve=True)  # the trainer's keys are its arguments
        if trainer_args.get("stop_at_return") == "auto":
            trainer_args["stop_at_return"] = env_spec.reward_threshold
        trainer = Trainer(**runtime("trainer", collector=collector, algo=algo, hooks=hooks, loggers=loggers,
                                     run_dir=run_dir, max_lag=collector.max_lag, run_dir_lock=lock,
                                     strategy=strategy), **trainer_args)
        restore.trainer(trainer)
        cleanup.pop_all()
    ranks = f" | learner rank {strategy.rank} of {strategy.size}, pid {os.getpid()}" if strategy.PARALLEL else ""
    resumed = f" | resumed at {restore.frames:,} frames" if restore.saved else ""
    log.info("run dir %s | %s on %s | %s collector | device %s%s%s", run_dir, type(algo).__name__, env_spec.id,
             type(collector).__name__, device, ranks, resumed)
    return trainer


def _on_every_rank(hook: type, strategy: Strategy) -> bool:
    """Whether a hook of class ``hook`` runs on every rank of a data-parallel learner, not on rank 0 alone: it
    says so (``ALL_RANKS``), or it runs the learner's model, which a sharded learner runs on every rank at once."""
    return getattr(hook, "ALL_RANKS", False) or (strategy.SHARDED and getattr(hook, "RUNS_LEARNER", False))


def serve_rank(cfg: DictConfig) -> None:
    """Run this process as collector rank ``RANK`` of a torchrun job: rank 0's run dir, this rank's
    log in ``ranks/<rank>.log`` there, then collect for rank 0 until it says stop (or is gone)."""
    world = process_groups.current()
    validate(cfg)
    config = OmegaConf.to_container(without(cfg.collector, {"_target_"}), resolve=True)
    timeout_s, envs = config.get("timeout_s", 60.0), config.get("envs_per_rank", 8)
    setup = pickle.loads(process_groups.wait_for_key(world.store, _SETUP, timeout_s))
    if "refused" in setup:
        raise RefusedByLearner(f"rank 0 did not start the run: {setup['refused']}")
    run_dir = Path(setup["run_dir"])
    _log_to_file(run_dir / "ranks" / f"{world.rank}.log")
    log.info("collector rank %d of %d on %s, pid %d; run dir %s", world.rank, world.size, world.host, os.getpid(),
             run_dir)
    _seed_everything(setup["seed"] + world.rank)  # setup's seed counts a resumed run's frames
    if cfg.get("threads"):
        torch.set_num_threads(cfg.threads)
    frames = get_class(cfg.collector._target_).rank_frames(config, world.size - 1)
    receiver = collector = relay = None
    try:
        make_env, env_spec, make_policy = _env_and_policy(cfg)
        receiver = _construct(cfg.sync).receiver()
        collector, relay = _rank_collector(make_env, make_policy, receiver, env_spec, frames, setup["version"],
                                           seed=setup["seed"] + (world.rank - 1) * envs, envs_per_rank=envs,
                                           workers_per_rank=config.get("workers_per_rank", 0),
                                           start_method=config.get("start_method", "spawn"), timeout_s=timeout_s)
    except BaseException as e:  # an env that does not start on this machine, say: rank 0 shows why
        if not isinstance(e, KeyboardInterrupt):
            report_and_wait(world, f"{type(e).__name__}: {e}",
                            f"collector rank {world.rank}:\n{traceback.format_exc()}", timeout_s)
        for part in (collector, relay, receiver):
            if part is not None:
                part.close()
        raise
    buffer = frame_buffer(env_spec, frames // envs, envs, state_size(make_policy()))
    RankServer(world, collector, receiver, relay, buffer, timeout_s).run()


def _rank_collector(make_env, make_policy, receiver: WeightReceiver, env_spec: EnvSpec, frames_per_batch: int,
                    version: int, seed: int, envs_per_rank: int, workers_per_rank: int, start_method: str,
                    timeout_s: float) -> tuple[Collector, WeightSender | None]:
    """A collector rank's own collector, acting with weights ``version`` or newer from the start:
    its ``envs_per_rank`` envs in this process, acting with the received weights in place; or
    ``workers_per_rank`` lock-step worker processes, to which the weights that reach this rank fan
    out through shared memory (the relay: a sender of this rank's policy copy, pushed by the rank)."""
    if not workers_per_rank:
        collector = LocalCollector(functools.partial(make_env, num_envs=envs_per_rank, seed=seed), make_policy,
                                   lambda: receiver, frames_per_batch)
        try:
            receiver.wait_for(version)
        except BaseException:
            collector.close()
            raise
        return collector, None
    policy = make_policy()
    receiver.connect(policy)
    receiver.wait_for(version)
    fan_out = SharedMemSync(timeout_s=timeout_s)
    relay = fan_out.sender(policy, version=receiver.version)
    try:
        collector = LockstepCollector(make_env, make_policy, fan_out.receiver, env_spec, frames_per_batch,
                                      workers=workers_per_rank, envs_per_worker=envs_per_rank // workers_per_rank,
                                      start_method=start_method, timeout_s=timeout_s, seed=seed,
                                      state_size=state_size(policy))
    except BaseException:
        relay.close()
        raise
    return collector, relay


def _log_to_file(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    logging.getLogger().addHandler(handler)


def _build_loggers(cfg: DictConfig, run_dir: Path, config: dict, restore: checkpoint.Restore,
                   cleanup: ExitStack) -> list:
    """metrics.jsonl's logger plus ``cfg.logger``'s; in a resumed run each gets ``resume``: its
    checkpointed state and the checkpoint's frame count."""
    loggers = [JsonlLogger(run_dir, resume=restore.logger(JsonlLogger))]
    cleanup.callback(loggers[-1].close)
    for node in (cfg.get("logger") or {}).values():
        resume = restore.logger(get_class(node._target_))
        loggers.append(_instantiate_with(node, **runtime("logger", run_dir=run_dir, config=config, resume=resume)))
        cleanup.callback(loggers[-1].close)
    return loggers


def _env_and_policy(cfg: DictConfig, task: Task | None = None,
                    ) -> tuple[functools.partial, EnvSpec | TaskSpec, functools.partial]:
    """What makes the env and the policy (plain functools.partial factories of plain values: they pickle
    into spawned worker processes), and the env's spec, read from one env made for it. A language
    task's "env" is the task (one stream of prompts: ``task``, made once), and its policy the model of
    ``cfg.model``."""
    make_env = env_maker(cfg)
    if task is not None:
        return make_env, task.spec, _construct(cfg.model).load
    env_spec = _probe_spec(make_env)
    return make_env, env_spec, plain_partial(cfg.algo.network, **runtime("algo.network", env_spec=env_spec))


def _build_engine(node: DictConfig, scheme: WeightSyncScheme, sender: WeightSender, model, make_policy, learner,
                  device: torch.device, seed: int, run_dir: Path):
    """The generation engine of ``node`` (``engine=``), fed by a receiver of ``scheme``: the engine binds the
    receiver to what it generates with; a scheme that pushes into the engine (``DELIVERS: push``) has its
    sender connected to the engine's ``transfer_client()``, which also pushes the current weights. An
    engine that asks for ``policy`` gets a copy of the learner's model on ``device``; one that asks for
    ``learner``, the learner's model itself."""
    receiver = scheme.receiver()
    objects = {"model": model, "tokenizer": model.tokenizer(), "receiver": receiver, "device": device, "seed": seed,
               "run_dir": run_dir}
    asks = inspect.signature(get_class(node._target_)).parameters
    if "policy" in asks:
        objects["policy"] = make_policy().to(device)
    if "learner" in asks:
        objects["learner"] = learner
    try:
        engine = _instantiate_with(node, **runtime("engine", **objects))
    except BaseException:
        receiver.close()
        raise
    if scheme.DELIVERS == "push":
        try:
            sender.connect(engine.transfer_client())
        except BaseException:
            engine.close()
            raise
    return engine


def _probe_spec(make_env) -> EnvSpec:
    env = make_env(num_envs=1)
    try:
        return env.spec
    finally:
        env.close()


def _construct(node: DictConfig, **runtime):
    """Build ``node``'s ``_target_`` from its config values plus runtime objects.

    The runtime objects go straight to the constructor (Hydra would merge them into the config,
    turning a dataclass such as EnvSpec into a DictConfig).
    """
    return instantiate(node, _partial_=True, _convert_="all")(**runtime)


def _instantiate_with(node: DictConfig, **runtime):
    """Like ``_construct``, passing only the runtime objects the class asks for by name."""
    partial = instantiate(node, _partial_=True, _convert_="all")
    params = inspect.signature(partial.func).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return partial(**{k: v for k, v in runtime.items() if takes_all or k in params})


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
