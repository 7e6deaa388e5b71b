"""Multi-process collectors: start-up time and throughput, side by side with in-process baselines.

    python benchmarks/collector_scaling.py [--seconds 5]

Start-up: from constructing the collector (2 workers, spawn) until its first batch is in hand.
Throughput: frames/s of batches handed to the learner (the learner does nothing else). Policies
are the default 64x64 MLP actor-critic.
"""

from __future__ import annotations

import argparse
import functools
import subprocess
import sys
import time

import torch

from benchmarks.collector_throughput import raw_gymnasium_fps
from rltrain.algos import ActorCritic
from rltrain.envs import BatchedEnv
from rltrain.sync import SharedMemSync

# Spawned workers re-import this module: the collectors (and tensordict with them) are imported
# inside the functions, as rltrain's own entry point does, so workers start as they would in a run.


def make_parts(env_id: str):
    spec = BatchedEnv(env_id, num_envs=1).spec
    make_policy = functools.partial(ActorCritic, spec)
    scheme = SharedMemSync()
    scheme.sender(make_policy())
    return spec, make_policy, scheme


def multiprocess(env_id: str, mode: str, workers: int, envs_per_worker: int, frames_per_batch: int):
    """``mode``: lockstep or async (the collector= choice)."""
    from rltrain.collectors import AsyncCollector, LockstepCollector

    spec, make_policy, scheme = make_parts(env_id)
    t0 = time.perf_counter()
    collector = {"lockstep": LockstepCollector, "async": AsyncCollector}[mode](
        make_env=functools.partial(BatchedEnv, env_id), make_policy=make_policy, make_receiver=scheme.receiver,
        env_spec=spec, frames_per_batch=frames_per_batch, workers=workers, envs_per_worker=envs_per_worker)
    batches = iter(collector)
    next(batches)
    return collector, batches, time.perf_counter() - t0


def local(env_id: str, num_envs: int, frames_per_batch: int):
    from rltrain.collectors import LocalCollector

    spec, make_policy, scheme = make_parts(env_id)
    collector = LocalCollector(functools.partial(BatchedEnv, env_id, num_envs=num_envs), make_policy,
                               scheme.receiver, frames_per_batch)
    batches = iter(collector)
    next(batches)
    return collector, batches


def fps(batches, seconds: float) -> float:
    frames, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        frames += next(batches).numel()
    return frames / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    torch.set_num_threads(1)

    print("\nStart-up, 2 workers, spawn, until the first batch")
    floor = []
    for _ in range(3):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        floor.append(time.perf_counter() - t0)
    print(f"  floor: a fresh interpreter importing torch  {min(floor):.2f} s best of 3")
    for mode in ("lockstep", "async"):
        starts = []
        for _ in range(3):
            collector, _, seconds = multiprocess("CartPole-v1", mode, 2, 4, 256 if mode == "lockstep" else 128)
            collector.close()
            starts.append(seconds)
        print(f"  collector={mode:8}  {min(starts):.2f} s best of 3 ({', '.join(f'{s:.2f}' for s in starts)})"
              "   target <= 2 s")

    raw = raw_gymnasium_fps(args.seconds)
    rows = [("CartPole: raw gymnasium loop, 1 process", raw, raw)]
    for envs in (4, 16, 32):
        collector, batches, _ = multiprocess("CartPole-v1", "lockstep", 2, envs, 2 * envs * 32)
        rows.append((f"CartPole: collector=lockstep, 2 workers x {envs} envs", fps(batches, args.seconds), raw))
        collector.close()
    collector, batches, _ = multiprocess("CartPole-v1", "async", 2, 16, 16 * 32)
    rows.append(("CartPole: collector=async, 2 workers x 16 envs", fps(batches, args.seconds), raw))
    collector.close()

    collector, batches = local("HalfCheetah-v5", 8, 8 * 32)
    single = fps(batches, args.seconds)
    collector.close()
    rows.append(("HalfCheetah: collector=local, 8 envs", single, single))
    for mode in ("lockstep", "async"):
        collector, batches, _ = multiprocess("HalfCheetah-v5", mode, 2, 8, 2 * 8 * 32 if mode == "lockstep" else 8 * 32)
        rows.append((f"HalfCheetah: collector={mode}, 2 workers x 8 envs", fps(batches, args.seconds), single))
        collector.close()

    print(f"\n{'':52} {'frames/s':>10} {'x baseline':>11}")
    for name, value, baseline in rows:
        print(f"{name:52} {value:10,.0f} {value / baseline:11.2f}")
    print("\ntargets: CartPole collector=lockstep (2 workers) >= 0.8x the raw loop; "
          "HalfCheetah lockstep >= 1.5x collector=local")


if __name__ == "__main__":
    main()
