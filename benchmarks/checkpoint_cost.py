"""What a checkpoint costs: SAC on HalfCheetah-v5 sizes, with the replay buffer filled to N frames.

    python -m benchmarks.checkpoint_cost --frames 100000 1000000

Prints the file size and the seconds to write (torch.save + fsync + rename) and to read back,
next to the time the same bytes take to copy in memory (the floor).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from tensordict import TensorDict

from rltrain import checkpoint
from rltrain.algos import SAC, SquashedGaussianActor
from rltrain.envs import BatchedEnv


def fill(sac: SAC, frames: int) -> None:
    spec = BatchedEnv("HalfCheetah-v5", num_envs=1).spec
    chunk = 10_000
    for start in range(0, frames, chunk):
        n = min(chunk, frames - start)
        sac.buffer.extend(TensorDict({
            "observation": torch.randn(n, *spec.obs_shape), "action": torch.rand(n, *spec.action_shape),
            "reward": torch.randn(n), "terminated": torch.zeros(n, dtype=torch.bool),
            "next": {"observation": torch.randn(n, *spec.obs_shape)}}, batch_size=[n]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--frames", type=int, nargs="+", default=[100_000, 1_000_000])
    args = parser.parse_args()
    spec = BatchedEnv("HalfCheetah-v5", num_envs=1).spec
    print(f"{'buffer frames':>14} {'file MB':>9} {'write s':>8} {'read s':>7} {'memcpy s':>9}")
    for frames in args.frames:
        sac = SAC(SquashedGaussianActor(spec), total_frames=frames, buffer_size=frames, warmup_frames=0)
        fill(sac, frames)
        with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp:
            path = checkpoint.path_for(Path(tmp), frames)
            t0 = time.perf_counter()
            checkpoint.save(path, {"format": checkpoint.FORMAT, "algo": sac.state_dict()})
            write = time.perf_counter() - t0
            size = path.stat().st_size
            t0 = time.perf_counter()
            checkpoint.load(path)
            read = time.perf_counter() - t0
        t0 = time.perf_counter()
        sac.buffer.storage.clone()
        copy = time.perf_counter() - t0
        print(f"{frames:>14,} {size / 1e6:>9.1f} {write:>8.2f} {read:>7.2f} {copy:>9.3f}")


if __name__ == "__main__":
    main()
