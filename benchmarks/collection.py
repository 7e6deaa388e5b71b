"""Collection throughput (frames/s handed to the learner, which does nothing else) per collector
kind, on CartPole-v1 and HalfCheetah-v5, with the default 64x64 MLP policy: rltrain's collectors
against TorchRL's (``Collector`` over a ``SerialEnv``, ``MultiSyncCollector``,
``MultiAsyncCollector``), stable-baselines3's ``DummyVecEnv`` / ``SubprocVecEnv`` stepped with its
PPO policy (as ``collect_rollouts`` does), and the raw gymnasium loop (1 env, random actions: the
env's own floor). Each cell is built, timed for a few seconds and stopped, the columns taking turns.
Also the multi-process collectors' start-up (construction to first batch) beside a fresh
interpreter that only imports torch."""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
import time

from benchmarks.core import OURS, Goal, Row, Stat, Table

NAME, TITLE = "collection", "Collection"
ENVS = {"CartPole-v1": 16, "HalfCheetah-v5": 8}  # envs per process (the env configs' defaults for local)
WORKERS = 2
RAW = "raw loop"


def raw_loop(env_id: str, envs: int = 1, kind: str = "local"):
    """The usual hand-written loop: gym.make defaults, random actions, reset on episode end."""
    import gymnasium as gym

    env = gym.make(env_id)
    env.reset(seed=0)
    env.action_space.seed(0)

    def step():
        for _ in range(100):
            _, _, terminated, truncated, _ = env.step(env.action_space.sample())
            if terminated or truncated:
                env.reset()
        return 100

    return step


def rltrain_collector(env_id: str, envs: int, kind: str, frames_per_batch: int | None = None,
                      backend: str = "gymnasium", workers: int = WORKERS):
    """kind: local (one process), lockstep or async (``workers`` worker processes of ``envs`` envs each)."""
    from rltrain.algos import ActorCritic
    from rltrain.collectors import AsyncCollector, LocalCollector, LockstepCollector
    from rltrain.envs import GymnasiumBatchedEnv, make_envs
    from rltrain.sync import SharedMemSync

    spec = GymnasiumBatchedEnv(env_id, num_envs=1).spec
    make_policy = functools.partial(ActorCritic, spec)
    scheme = SharedMemSync()
    scheme.sender(make_policy())
    if kind == "local":
        collector = LocalCollector(functools.partial(make_envs, env_id, num_envs=envs, backend=backend), make_policy,
                                   scheme.receiver, frames_per_batch or envs * 32)
    else:
        cls = {"lockstep": LockstepCollector, "async": AsyncCollector}[kind]
        per_batch = frames_per_batch or (workers if kind == "lockstep" else 1) * envs * 32
        collector = cls(make_env=functools.partial(GymnasiumBatchedEnv, env_id), make_policy=make_policy,
                        make_receiver=scheme.receiver, env_spec=spec, frames_per_batch=per_batch, workers=workers,
                        envs_per_worker=envs)
    batches = iter(collector)
    step = lambda: next(batches).numel()  # noqa: E731
    step.close = collector.close
    return step


def _torchrl_policy(env):
    from tensordict.nn import NormalParamExtractor, TensorDictModule
    from torch import nn
    from torchrl.modules import MLP, OneHotCategorical, ProbabilisticActor, TanhNormal

    n_obs, spec = env.observation_spec["observation"].shape[-1], env.action_spec
    discrete = spec.domain == "discrete"
    n_out = spec.shape[-1] * (1 if discrete else 2)
    net = MLP(in_features=n_obs, out_features=n_out, num_cells=[64, 64], activation_class=nn.Tanh)
    if discrete:
        module = TensorDictModule(net, in_keys=["observation"], out_keys=["logits"])
        return ProbabilisticActor(module, in_keys=["logits"], distribution_class=OneHotCategorical, spec=spec)
    module = TensorDictModule(nn.Sequential(net, NormalParamExtractor()), in_keys=["observation"],
                              out_keys=["loc", "scale"])
    return ProbabilisticActor(module, in_keys=["loc", "scale"], distribution_class=TanhNormal, spec=spec)


def _torchrl_env(env_id: str):
    """gymnasium's env in TorchRL, with MuJoCo's float64 observations cast to the policy's float32."""
    from torchrl.envs import DoubleToFloat, GymEnv, TransformedEnv

    return TransformedEnv(GymEnv(env_id), DoubleToFloat())


def torchrl_collector(env_id: str, envs: int, kind: str):
    from torchrl.collectors import Collector, MultiAsyncCollector, MultiSyncCollector
    from torchrl.envs import SerialEnv

    make_env = functools.partial(SerialEnv, envs, functools.partial(_torchrl_env, env_id))
    policy = _torchrl_policy(_torchrl_env(env_id))
    if kind == "local":
        collector = Collector(make_env(), policy, frames_per_batch=envs * 32, total_frames=-1)
    else:
        cls = MultiSyncCollector if kind == "lockstep" else MultiAsyncCollector
        per_batch = (WORKERS if kind == "lockstep" else 1) * envs * 32
        collector = cls([make_env] * WORKERS, policy, frames_per_batch=per_batch, total_frames=-1)
    batches = iter(collector)
    step = lambda: next(batches).numel()  # noqa: E731
    step.close = collector.shutdown
    return step


def sb3_collector(env_id: str, envs: int, kind: str):
    """SB3 has one env per subprocess: the multi-process kinds get 2 processes of 1 env (its design)."""
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

    if kind == "local":
        venv = make_vec_env(env_id, n_envs=envs, vec_env_cls=DummyVecEnv)
    else:
        venv = make_vec_env(env_id, n_envs=WORKERS, vec_env_cls=SubprocVecEnv,
                            vec_env_kwargs={"start_method": "spawn"})
    policy = PPO("MlpPolicy", venv, device="cpu").policy
    obs = venv.reset()

    def step():
        nonlocal obs
        for _ in range(32):
            with torch.no_grad():
                actions, _, _ = policy(torch.as_tensor(obs))
            obs, _, _, _ = venv.step(actions.numpy())
        return 32 * venv.num_envs

    step.close = venv.close
    return step


CASES = {OURS: "rltrain_collector", "torchrl": "torchrl_collector", "sb3": "sb3_collector", RAW: "raw_loop"}


def throughput(ctx, env_id: str, seconds: float) -> Table:
    peers = [p for p in ("torchrl", "sb3") if ctx.peer(p)]
    columns = [OURS, *peers, RAW]
    envs = ENVS[env_id]
    table = Table(f"{TITLE}, {env_id}: frames/s, median [p10-p90] over rounds of {seconds:g} s", columns,
                  notes=ctx.peer_notes("torchrl", "sb3"))
    cartpole = env_id.startswith("CartPole")  # the targets are CartPole's (HalfCheetah's env dominates)
    kinds = [("local", f"local, {envs} envs", 0.7 if cartpole else None),
             ("lockstep", f"lockstep, {WORKERS} workers x {envs}", 1.3 if cartpole else None),
             ("async", f"async, {WORKERS} workers x {envs}", None)]
    raw = None
    # A quick run times the local collector alone: startup() below builds the multi-process ones
    # and takes a batch from each, which is what proves they run.
    for kind, label, times_raw in kinds[:1] if ctx.quick else kinds:
        wanted = [c for c in columns if c != RAW or raw is None]  # the raw floor is the same for every row
        cases = {c: (OURS if c == RAW else c, f"benchmarks.collection:{CASES[c]}",
                     {"env_id": env_id, "envs": envs, "kind": kind}) for c in wanted}
        samples = rates(ctx, cases, rounds(ctx), seconds, table.notes)
        if raw is None and samples.get(RAW):
            raw = Stat(samples[RAW], "frames/s", higher_is_better=True)
        cells = {c: Stat(samples[c], "frames/s", higher_is_better=True) if samples.get(c) else None
                 for c in columns if c != RAW}
        table.rows.append(Row(label, {**cells, RAW: raw}, target=f">= {times_raw}x raw loop" if times_raw else "",
                              goals=(Goal(RAW, at_least=times_raw),) if times_raw else ()))
    if ctx.peer("sb3"):
        table.notes.append(f"sb3's multi-process rows: SubprocVecEnv with {WORKERS} processes of 1 env each")
    return table


ATARI = "ALE/Breakout-v5"
# The usual Atari preprocessing (DQN / PPO papers, CleanRL), the same in both backends: no sticky
# actions, 4 frames skipped (max-pooled), up to 30 no-ops at reset, 84x84 grayscale, 4 frames stacked.
ATARI_LOOP = {"kwargs": {"frameskip": 1, "repeat_action_probability": 0.0},
              "wrappers": [{"wrapper": "AtariPreprocessing", "frame_skip": 4, "noop_max": 30, "screen_size": 84},
                           {"wrapper": "FrameStackObservation", "stack_size": 4}]}
ATARI_VECTOR = {"kwargs": {"frameskip": 4, "repeat_action_probability": 0.0, "noop_max": 30, "stack_num": 4,
                           "reward_clipping": False, "use_fire_reset": False}}
ATARI_ENVPOOL = {"kwargs": {"frame_skip": 4, "repeat_action_probability": 0.0, "noop_max": 30, "stack_num": 4,
                            "reward_clip": False, "episodic_life": False, "use_fire_reset": False}}
ATARI_CONFIG = {"gymnasium": ATARI_LOOP, "vector": ATARI_VECTOR, "envpool": ATARI_ENVPOOL}


def atari_steps(backend: str, envs: int):
    """Random actions in ``envs`` Breakout envs (agent steps of 4 frames each), on either backend."""
    import numpy as np

    from rltrain.envs import make_envs

    env = make_envs(ATARI, envs, backend=backend, **ATARI_CONFIG[backend])
    env.reset()
    actions = np.random.default_rng(0).integers(0, env.spec.num_actions, (64, envs))

    def step():
        for a in actions:
            env.step(a)
        return actions.size

    step.close = env.close
    return step


def rounds(ctx) -> int:
    """Rounds per cell: a quick run builds each case once (building one, e.g. spawning workers, is
    what proves it runs, and what a busy box makes slow)."""
    return 1 if ctx.quick else 3


def rates(ctx, cases: dict[str, tuple[str, str, dict]], rounds: int, seconds: float, notes: list[str]) -> dict:
    """Frames/s samples per column: each case built, warmed up, timed for ``seconds`` and stopped,
    the columns taking turns for ``rounds`` rounds. ``cases``: column -> (runner, case ref, kwargs).
    A column that fails is a note, and has no samples."""
    samples = {column: [] for column in cases}
    for _ in range(rounds):
        for column in [c for c in cases if c in samples]:
            runner_name, ref, kwargs = cases[column]
            try:
                runner = ctx.runner(runner_name)
                handle = runner.setup(ref, **kwargs)
                try:
                    runner.rate(handle, min(1.0, seconds / 2))  # warm-up
                    samples[column].append(runner.rate(handle, seconds))
                finally:
                    runner.drop(handle)
            except Exception as e:  # noqa: BLE001  a failing case leaves its cell empty
                notes.append(f"{column} {kwargs.get('kind', '')} failed: {str(e).strip().splitlines()[-1]}")
                del samples[column]
    return samples


def backends(ctx, seconds: float) -> Table:
    """env.backend=vector and envpool beside the Python loop (gymnasium): CartPole through the
    local collector (the default policy acting), Breakout's envs alone (random actions)."""
    columns = ["vector", *(["envpool"] if importlib.util.find_spec("envpool") else []), "gymnasium"]
    table = Table("Env backends: frames/s (Breakout: agent steps of 4 frames), median [p10-p90]",
                  columns, ratio_to="gymnasium", ratio_header="{peer} / gymnasium", ratio_mode="over")
    if "envpool" not in columns:
        table.notes.append("no envpool column: pip install 'rltrain[envpool]'")
    rows = [(f"CartPole-v1, local collector, {n} envs", "benchmarks.collection:rltrain_collector",
             {"env_id": "CartPole-v1", "envs": n, "kind": "local"}, 3 if n == 16 else None)
            for n in ((16,) if ctx.quick else (16, 128))]
    if importlib.util.find_spec("ale_py") is not None:
        rows += [(f"{ATARI}, {n} envs", "benchmarks.collection:atari_steps", {"envs": n}, 2)
                 for n in ((2,) if ctx.quick else (8, 32))]  # quick: each Breakout env takes ~0.4 s to build
    else:
        table.notes.append("Atari rows need ale-py: pip install 'rltrain[atari]'")
    for label, ref, kwargs, times in rows:  # the targets are the vector backend's
        cases = {b: (OURS, ref, {**kwargs, "backend": b}) for b in columns}
        samples = rates(ctx, cases, rounds(ctx), seconds, table.notes)
        table.rows.append(Row(label, {c: Stat(v, "frames/s", higher_is_better=True) if v else None
                                      for c, v in samples.items()}, target=f">= {times}x" if times else "",
                              goals=(Goal("vector", at_least=times),) if times else ()))
    table.notes.append(f"{os.cpu_count()} CPUs: ale-py's vector env and EnvPool step their envs in C++ threads")
    return table


def startup(ctx) -> Table:
    """Construction to the first batch of 2 spawned workers (a quick run: 1, as each imports torch),
    beside `python -c "import torch"`."""
    workers = 1 if ctx.quick else WORKERS
    table = Table(f"Multi-process collector start-up ({workers} worker{'s' * (workers > 1)} x 4 CartPole envs, "
                  "spawn): seconds to the first batch", ["collector", "import torch"], ratio_to=None)
    floor = []
    for _ in range(rounds(ctx)):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        floor.append(time.perf_counter() - t0)
    for kind in ("lockstep", "async"):
        starts = []
        for _ in range(rounds(ctx)):
            t0 = time.perf_counter()
            step = rltrain_collector("CartPole-v1", 4, kind, workers=workers)  # batches of one step per env
            step()
            starts.append(time.perf_counter() - t0)
            step.close()
        table.rows.append(Row(f"collector={kind}", {"collector": Stat(starts, "s"), "import torch": Stat(floor, "s")},
                              target="<= 2 s", goals=(Goal("collector", at_most=2, median=True),)))
    return table


def run(ctx) -> list[Table]:
    seconds = 0.25 if ctx.quick else 4.0
    envs = ["CartPole-v1"] if ctx.quick else list(ENVS)
    return [throughput(ctx, env_id, seconds) for env_id in envs] + [backends(ctx, seconds), startup(ctx)]
