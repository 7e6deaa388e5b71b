"""What a checkpoint costs: SAC with HalfCheetah-v5 sizes (256x256 networks, obs 17, action 6) and
its replay buffer filled with N frames, saved with ``rltrain.checkpoint.save`` (torch.save, fsync,
rename) to the local disk and read back, next to an in-memory copy of the buffer (the floor)."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from benchmarks.core import Row, Stat, Table

NAME, TITLE = "checkpoint", "Checkpoint"


def fill(sac, spec, frames: int) -> None:
    import torch
    from tensordict import TensorDict

    chunk = 10_000
    for start in range(0, frames, chunk):
        n = min(chunk, frames - start)
        sac.buffer.extend(TensorDict({
            "observation": torch.randn(n, *spec.obs_shape), "action": torch.rand(n, *spec.action_shape),
            "reward": torch.randn(n), "terminated": torch.zeros(n, dtype=torch.bool),
            "next": {"observation": torch.randn(n, *spec.obs_shape)}}, batch_size=[n]))


def run(ctx) -> list[Table]:
    from rltrain import checkpoint
    from rltrain.algos import SAC, SquashedGaussianActor
    from rltrain.envs import GymnasiumBatchedEnv

    spec = GymnasiumBatchedEnv("HalfCheetah-v5", num_envs=1).spec
    table = Table(f"{TITLE} of SAC with a full replay buffer: seconds, median [p10-p90]",
                  ["write", "read", "buffer copy"], ratio_to=None)
    for frames in [100_000] if ctx.quick else [100_000, 1_000_000]:
        sac = SAC(SquashedGaussianActor(spec), total_frames=frames, buffer_size=frames, warmup_frames=0)
        fill(sac, spec, frames)
        times = {"write": [], "read": [], "buffer copy": []}
        with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp:
            path = checkpoint.path_for(Path(tmp), frames)
            for _ in range(3):
                t0 = time.perf_counter()
                checkpoint.save(path, {"format": checkpoint.FORMAT, "algo": sac.state_dict()})
                times["write"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                checkpoint.load(path)
                times["read"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                sac.buffer.storage.clone()
                times["buffer copy"].append(time.perf_counter() - t0)
            size = path.stat().st_size
        table.rows.append(Row(f"{frames:,} frames", {k: Stat(v, "s") for k, v in times.items()},
                              extra={"file": f"{size / 1e6:.1f} MB"}))
    return [table]
