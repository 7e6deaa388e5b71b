"""collector=distributed (2 collector ranks under torchrun) beside collector=lockstep (2 worker
processes), same envs and policy: frames/s of PPO, and the start-up (a one-batch run, whole
process). Whole processes, alternating, medians; frames/s is what summary.json reports.

    python benchmarks/distributed_throughput.py [--env cartpole halfcheetah] [--frames 60000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMON = ["trainer.stop_at_return=null", "hooks.eval.episodes=1", "hooks.checkpoint.every=null",
          "collector.frames_per_batch=512"]
KINDS = {
    "lockstep 2 workers x 8": ([sys.executable, "-m", "rltrain", "collector=lockstep", "collector.workers=2",
                                "collector.envs_per_worker=8", "sync=shared_mem"]),
    "distributed 2 ranks x 8": ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
                                 "-m", "rltrain", "collector=distributed", "collector.envs_per_rank=8",
                                 "sync=distributed"]),
}


def run(cmd: list[str], frames: int, env: str) -> tuple[float, float]:
    """(frames/s from summary.json, whole-process seconds)."""
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        subprocess.run([*cmd, f"env={env}", f"trainer.total_frames={frames}", *COMMON], cwd=tmp, check=True,
                       capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        wall = time.perf_counter() - t0
        (summary,) = Path(tmp).glob("outputs/*/*/summary.json")
        return json.loads(summary.read_text())["fps"], wall


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--env", nargs="+", default=["cartpole", "halfcheetah"])
    parser.add_argument("--frames", type=int, default=60000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for env in args.env:
        fps, start = {k: [] for k in KINDS}, {k: [] for k in KINDS}
        for _ in range(args.repeats):  # alternating: the machine's noise falls on both alike
            for kind, cmd in KINDS.items():
                fps[kind].append(run(cmd, args.frames, env)[0])
                start[kind].append(run(cmd, 512, env)[1])
        base = next(iter(KINDS))
        print(f"\nPPO on {env}, {args.frames:,} frames, median of {args.repeats}")
        print(f"{'collector':<26} {'frames/s':>9} {'ratio':>6} {'1-batch run s':>14} {'ratio':>6}")
        for kind in KINDS:
            f, s = statistics.median(fps[kind]), statistics.median(start[kind])
            f0, s0 = statistics.median(fps[base]), statistics.median(start[base])
            print(f"{kind:<26} {f:9.0f} {f / f0:6.2f} {s:14.2f} {s / s0:6.2f}", flush=True)
    print("\ntargets: distributed >= 0.8x the frames/s of lockstep; start-up within 1.5x")


if __name__ == "__main__":
    main()
