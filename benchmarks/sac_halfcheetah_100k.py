"""SAC on HalfCheetah-v5 for 100k frames: rltrain's sac_halfcheetah recipe beside stable-baselines3's SAC
(RL-Zoo's HalfCheetah settings: 256x256 networks, batch 256, lr 3e-4, 10k random frames, one gradient step
per frame, alpha autotuned), the same network size. For each seed both run at once, one CPU thread
each, as whole processes; each scores 10 deterministic episodes at the end and the mean return of its
last 10 training episodes.

    pip install -e ".[bench,mujoco]"
    python benchmarks/sac_halfcheetah_100k.py --seeds 0 1 --out /tmp/sac_hc   # about 20 min per seed, 2 cores

rltrain's run dirs (for python -m rltrain.report) are kept under --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def sb3_main(seed: int, frames: int) -> None:
    """The stable-baselines3 side, in a process of its own: prints one JSON line."""
    import gymnasium as gym
    import numpy as np
    import torch
    from stable_baselines3 import SAC
    from stable_baselines3.common.evaluation import evaluate_policy

    torch.set_num_threads(1)
    model = SAC("MlpPolicy", "HalfCheetah-v5", learning_starts=10_000, batch_size=256, learning_rate=3e-4,
                train_freq=1, gradient_steps=1, seed=seed, device="cpu", verbose=0,
                policy_kwargs={"net_arch": [256, 256]})
    t0 = time.perf_counter()
    model.learn(frames)
    learn_s = time.perf_counter() - t0
    train_return = float(np.mean([e["r"] for e in list(model.ep_info_buffer)[-10:]]))
    eval_return, _ = evaluate_policy(model, gym.make("HalfCheetah-v5"), n_eval_episodes=10, deterministic=True)
    print(json.dumps({"eval_return": float(eval_return), "train_return": train_return, "learn_s": learn_s}))


def start_rltrain(seed: int, frames: int, out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rltrain", "+recipe=sac_halfcheetah", f"seed={seed}", "threads=1",
                             f"trainer.total_frames={frames}", "hooks.progress.bar=false",
                             f"hydra.run.dir={out}/rltrain/seed{seed}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--frames", type=int, default=100_000)
    parser.add_argument("--out", type=Path, default=Path("outputs/sac_halfcheetah_100k"))
    parser.add_argument("--sb3-only", type=int, default=None, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    if args.sb3_only is not None:
        return sb3_main(args.sb3_only, args.frames)
    rows = {"rltrain": [], "sb3": []}
    for seed in args.seeds:
        t0 = time.perf_counter()
        ours = start_rltrain(seed, args.frames, args.out.resolve())
        theirs = subprocess.run([sys.executable, __file__, f"--sb3-only={seed}", f"--frames={args.frames}"],
                                check=True, capture_output=True, text=True)
        sb3 = json.loads(theirs.stdout.strip().splitlines()[-1])
        sb3["wall_s"] = time.perf_counter() - t0
        if ours.wait() != 0:
            sys.exit(f"rltrain failed for seed {seed}: see {args.out}/rltrain/seed{seed}/cli.log")
        summary = json.loads((args.out / "rltrain" / f"seed{seed}" / "summary.json").read_text())
        rows["sb3"].append(sb3)
        rows["rltrain"].append({"eval_return": summary["eval_return"], "train_return": summary["train_return"],
                                "learn_s": summary["wall_time_s"], "wall_s": time.perf_counter() - t0})
        print(f"seed {seed}: rltrain {rows['rltrain'][-1]}  sb3 {sb3}", file=sys.stderr, flush=True)
    print(f"\nHalfCheetah-v5 SAC at {args.frames:,} frames, 256x256, seeds {args.seeds} (both at once, 1 thread each)")
    print(f"{'':8} {'eval return (each seed)':>32} {'median':>8} {'train return median':>20} {'learn s median':>15}")
    for lib, rs in rows.items():
        each = " ".join(f"{r['eval_return']:.0f}" for r in rs)
        print(f"{lib:8} {each:>32} {median(rs, 'eval_return'):>8} {median(rs, 'train_return'):>20} "
              f"{median(rs, 'learn_s'):>15}")


def median(rows: list[dict], key: str) -> str:
    values = [r[key] for r in rows if r[key] is not None]  # no training return before an episode ends
    return f"{statistics.median(values):.0f}" if values else "-"


if __name__ == "__main__":
    main()
