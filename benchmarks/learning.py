"""Learning quality at a fixed budget, beside stable-baselines3 (only when named: ``--only learning``;
about 40 minutes per seed on an idle 2-core box, 2 minutes with ``--quick``).

SAC on HalfCheetah-v5 for 100k frames: rltrain's ``sac_halfcheetah`` recipe against SB3's SAC with
RL-Zoo's HalfCheetah settings, the same 256x256 networks, one gradient step per frame. For each seed
both run at once as whole processes, one CPU thread each; each scores 10 deterministic episodes at
the end and the mean return of its last 10 training episodes. rltrain's run dirs are kept under
``outputs/benchmarks/learning/`` (for ``python -m rltrain.report``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from benchmarks.core import OURS, ROOT, Goal, Row, Stat, Table

NAME, TITLE = "learning", "Learning"
OUT = ROOT / "outputs" / "benchmarks" / "learning"


def run(ctx) -> list[Table]:
    frames, seeds = (3_000, [0]) if ctx.quick else (100_000, [0, 1, 2])
    sb3 = ctx.peer("sb3")
    results = {OURS: [], "sb3": []}
    for seed in seeds:
        run_dir = OUT / f"sac_halfcheetah_{frames}" / f"seed{seed}"
        ours = subprocess.Popen([sys.executable, "-m", "rltrain", "+recipe=sac_halfcheetah", f"seed={seed}",
                                 "threads=1", f"trainer.total_frames={frames}", "hooks.progress.bar=false",
                                 f"hydra.run.dir={run_dir}"], cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            if sb3:
                t0 = time.perf_counter()
                out = subprocess.run([sb3.python or sys.executable, str(ROOT / "benchmarks" / "programs" /
                                                                         "sb3_sac_halfcheetah.py"),
                                      f"--seed={seed}", f"--frames={frames}"], cwd=ROOT, check=True,
                                     capture_output=True, text=True, timeout=4 * 3600).stdout
                results["sb3"].append({**json.loads(out.strip().splitlines()[-1]), "wall_s": time.perf_counter() - t0})
            if ours.wait(timeout=4 * 3600) != 0:
                raise RuntimeError(f"rltrain failed for seed {seed}: see {run_dir}/cli.log")
        finally:
            if ours.poll() is None:
                ours.kill()
        summary = json.loads((run_dir / "summary.json").read_text())
        results[OURS].append({"eval_return": summary["eval_return"], "train_return": summary["train_return"],
                              "learn_s": summary["wall_time_s"]})
    columns = [c for c in (OURS, "sb3") if results[c]]
    table = Table(f"SAC HalfCheetah-v5 at {frames:,} frames, 256x256, seeds {seeds}: return, median [p10-p90]",
                  columns, notes=ctx.peer_notes("sb3"))
    for key, label in (("eval_return", "eval return (10 deterministic episodes)"),
                       ("train_return", "training return (last 10 episodes)")):
        judged = key == "eval_return"  # a ratio to SB3's: both are thousands at 100k frames
        table.rows.append(Row(label, {c: Stat([r[key] for r in results[c] if r[key] is not None] or [float("nan")],
                                              "return", higher_is_better=True) for c in columns},
                              target=">= SB3" if judged else "", goals=(Goal("sb3", at_least=1),) if judged else ()))
    for c in columns:
        table.rows[0].extra[f"{c} per seed"] = " / ".join(f"{r['eval_return']:.0f}" for r in results[c])
    table.rows.append(Row("learning time (s)", {c: Stat([r["learn_s"] for r in results[c]], "s") for c in columns}))
    return [table]
