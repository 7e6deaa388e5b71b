"""The learner on many processes (``strategy=ddp``): one process beside a 2-rank torchrun job of the
same config, and what the ranks compute beside what one process computes.

Time: the learner's seconds per global batch (summary.json's ``update`` time over its updates), PPO on
the default CartPole config and GRPO on the tiny model's single-token task, whole runs alternating
between the two launches. On a 2-core machine the ideal is 1.0x at most (each rank updates on half the
batch); what bounds it is said in docs/learner-ranks.md.

Equivalence: one update on the same global batch (``tests/ranks_for_tests.py``: PPO with every
normalization on; GRPO with TIS and a KL penalty), in one process and on 2 ranks: the largest weight
difference after it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.core import ROOT, Goal, Row, Stat, Table

NAME, TITLE = "learner_ranks", "The learner on many processes"
ONE, TWO = "1 process", "2 ranks (ddp)"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "rltrain",
            "strategy=ddp"]
LAUNCH = {ONE: [sys.executable, "-m", "rltrain"], TWO: TORCHRUN}
CASES = {  # label -> (overrides, total frames of a full run, of a quick one)
    "PPO CartPole (default config)": (("trainer.stop_at_return=null",), 20_480, 2_048),
    "GRPO tiny model, single-token task": (("algo=grpo", "collector.max_new_tokens=1"), 3_840, 512),
}
COMMON = ("hooks.checkpoint.every=null", "hooks.eval.every=null", "hooks.eval.at_end=false", "seed=0")


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline"}


def update_seconds(launch: list[str], overrides: tuple[str, ...], frames: int) -> float:
    """The learner's seconds per update (one global batch) of a whole run."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([*launch, *overrides, f"trainer.total_frames={frames}", *COMMON, "hydra.run.dir=run"], cwd=tmp,
                       check=True, capture_output=True, env=_env(), timeout=900)
        summary = json.loads((Path(tmp) / "run" / "summary.json").read_text())
        return summary["time"]["update"] / summary["updates"]


def speed(ctx) -> Table:
    repeats = 1 if ctx.quick else 3
    table = Table(f"Learner seconds per global batch, median of {repeats} whole runs", [ONE, TWO], ratio_to=ONE,
                  ratio_header="{peer} / 1 process", ratio_mode="over")
    for label, (overrides, frames, quick_frames) in list(CASES.items())[:1 if ctx.quick else None]:
        times = {kind: [] for kind in LAUNCH}
        for _ in range(repeats):  # alternating
            for kind, launch in LAUNCH.items():
                times[kind].append(update_seconds(launch, overrides, quick_frames if ctx.quick else frames))
        table.rows.append(Row(label, {k: Stat(v, "s") for k, v in times.items()}, target="<= 1.0x (2 cores)",
                              goals=(Goal(TWO, at_most=1.0),)))
    table.notes.append("ideal on 2 cores: each rank updates on half the batch; a small network's step costs about "
                       "the same on half the samples, and each step adds the gradient average and the global "
                       "statistics (gloo on loopback)")
    return table


def weight_difference(algo: str) -> float:
    """The largest weight difference between one process and 2 ranks after one update on the same batch."""
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        args = []
        if algo == "grpo":
            from rltrain.llm.tiny import write_tiny_model

            args = ["grpo", str(write_tiny_model(Path(tmp) / "tiny"))]
        runs = {}
        for name, launch in (("one", []), ("two", ["-m", "torch.distributed.run", "--standalone",
                                                   "--nproc-per-node=2"])):
            out = Path(tmp) / f"{name}.pt"
            subprocess.run([sys.executable, *launch, "-m", "tests.ranks_for_tests", str(out), *args], cwd=ROOT,
                           check=True, capture_output=True, env=_env(), timeout=300)
            runs[name] = torch.load(out)["weights"]
        return max((runs["one"][k] - runs["two"][k]).abs().max().item() for k in runs["one"])


def equivalence(ctx) -> Table:
    table = Table("One update on the same global batch: largest weight difference, 2 ranks vs 1 process",
                  ["2 ranks vs 1 process"], ratio_to=None)
    cases = {"PPO, 4 epochs, every normalization": ("ppo", 1e-6), "GRPO, 2 epochs, TIS, KL penalty": ("grpo", 2e-5)}
    for label, (algo, bound) in list(cases.items())[:1 if ctx.quick else None]:
        started = time.perf_counter()
        diff = weight_difference(algo)
        table.rows.append(Row(label, {"2 ranks vs 1 process": Stat([diff], "abs")}, target=f"<= {bound:g}",
                              goals=(Goal("2 ranks vs 1 process", at_most=bound, median=True),),
                              extra={"seconds": round(time.perf_counter() - started, 1)}))
    table.notes.append("not bitwise: each rank sums its share and DDP averages the shares' gradients, so float32 "
                       "sums run in another order; Adam's first steps magnify that in weights that barely moved")
    return table


def run(ctx) -> list[Table]:
    return [speed(ctx), equivalence(ctx)]
