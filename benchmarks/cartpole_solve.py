"""Time to solve CartPole-v1: rltrain's default run against stable-baselines3 PPO (RL-Zoo
hyperparameters), both as whole processes, seeds interleaved, on this machine in one run.

    pip install -e ".[bench]"      # stable-baselines3
    python benchmarks/cartpole_solve.py --seeds 0 1 2 3 4

Solved = mean return of the last 10 training episodes >= 475, checked after every batch (rltrain)
or env step (SB3). Wall time is the whole process: interpreter start, imports, training, exit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_rltrain(seed: int, threads: int | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        extra = [] if threads is None else [f"threads={threads}"]
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "rltrain", f"seed={seed}", f"hydra.run.dir={tmp}/run", *extra],
                       cwd=ROOT, check=True, capture_output=True)
        wall = time.perf_counter() - t0
        summary = json.loads((Path(tmp) / "run" / "summary.json").read_text())
    return {"wall_s": wall, "frames_to_solve": summary["frames_to_solve"], "learn_s": summary["wall_time_s"]}


def run_sb3(seed: int) -> dict:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sb3_cartpole.py"), f"--seed={seed}"],
                         check=True, capture_output=True, text=True).stdout
    wall = time.perf_counter() - t0
    result = json.loads(out.strip().splitlines()[-1])
    return {"wall_s": wall, "frames_to_solve": result["frames_to_solve"], "learn_s": result["learn_s"]}


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    args = parser.parse_args()
    rows = {"sb3": [], "rltrain": []}
    for seed in args.seeds:  # interleaved, so machine noise hits both alike
        rows["sb3"].append(run_sb3(seed))
        rows["rltrain"].append(run_rltrain(seed, threads=None))
        print(f"seed {seed}: sb3 {rows['sb3'][-1]}  rltrain {rows['rltrain'][-1]}", file=sys.stderr)

    print(f"\nCartPole-v1 solve (last-10 training return >= 475), seeds {args.seeds}, medians")
    print(f"{'':10} {'whole process s':>16} {'learning s':>11} {'frames to solve':>16} {'unsolved':>9}")
    for name, results in rows.items():
        wall, learn = median([r["wall_s"] for r in results]), median([r["learn_s"] for r in results])
        print(f"{name:10} {wall:16.2f} {learn:11.2f}"
              f" {median([r['frames_to_solve'] for r in results]):16,.0f}"
              f" {sum(r['frames_to_solve'] is None for r in results):9d}")
    ratio_wall = median([r["wall_s"] for r in rows["rltrain"]]) / median([r["wall_s"] for r in rows["sb3"]])
    ratio_frames = (median([r["frames_to_solve"] for r in rows["rltrain"]])
                    / median([r["frames_to_solve"] for r in rows["sb3"]]))
    print(f"\nrltrain / sb3: whole-process wall time x{ratio_wall:.2f} (target <= 0.5), "
          f"frames to solve x{ratio_frames:.2f} (target <= 1.0)")


if __name__ == "__main__":
    main()
