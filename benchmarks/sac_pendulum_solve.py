"""Time to solve Pendulum-v1 with SAC: rltrain's recipe against stable-baselines3, whole processes,
seeds interleaved, in one run.

    pip install -e ".[bench]"
    python benchmarks/sac_pendulum_solve.py --seeds 0 1 2
    python benchmarks/sac_pendulum_solve.py --seeds 0 1 2 --widths 256 64 128   # both at each width

Solved = mean return of the last 10 training episodes >= -200.
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


def run_rltrain(seed: int, width: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "rltrain", "+recipe=sac_pendulum", f"seed={seed}",
                        f"algo.network.hidden_sizes=[{width},{width}]", f"algo.critic_hidden_sizes=[{width},{width}]",
                        f"hydra.run.dir={tmp}/run"],
                       cwd=ROOT, check=True, capture_output=True)
        wall = time.perf_counter() - t0
        summary = json.loads((Path(tmp) / "run" / "summary.json").read_text())
    return {"wall_s": wall, "frames_to_solve": summary["frames_to_solve"]}


def run_sb3(seed: int, width: int) -> dict:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sb3_pendulum_sac.py"), f"--seed={seed}",
                          f"--width={width}"], check=True, capture_output=True, text=True).stdout
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "frames_to_solve": json.loads(out.strip().splitlines()[-1])["frames_to_solve"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--widths", type=int, nargs="+", default=[256],
                        help="hidden width of every MLP, both libraries")
    args = parser.parse_args()
    rows = {(lib, w): [] for w in args.widths for lib in ("sb3", "rltrain")}
    for seed in args.seeds:
        for w in args.widths:
            rows["sb3", w].append(run_sb3(seed, w))
            rows["rltrain", w].append(run_rltrain(seed, w))
            print(f"seed {seed} width {w}: sb3 {rows['sb3', w][-1]}  rltrain {rows['rltrain', w][-1]}",
                  file=sys.stderr, flush=True)
    med = {key: {k: statistics.median([r[k] or float("inf") for r in rs]) for k in ("wall_s", "frames_to_solve")}
           for key, rs in rows.items()}
    print(f"\nPendulum-v1 SAC solve (last-10 training return >= -200), seeds {args.seeds}, medians")
    print(f"{'':16} {'whole process s':>16} {'frames to solve':>16}")
    for (lib, w), m in med.items():
        print(f"{lib + f' {w}x{w}':16} {m['wall_s']:16.1f} {m['frames_to_solve']:16,.0f}")
    for w in args.widths:
        print(f"width {w}: rltrain / sb3 wall time x{med['rltrain', w]['wall_s'] / med['sb3', w]['wall_s']:.2f} "
              f"(target <= 0.4); rltrain median frames {med['rltrain', w]['frames_to_solve']:,.0f} (target <= 8k)")


if __name__ == "__main__":
    main()
