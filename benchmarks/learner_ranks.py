"""The learner on many processes (``strategy=ddp|fsdp``): one process beside a 2-rank torchrun job of
the same config, and what the ranks compute beside what one process computes.

Time: the learner's seconds per global batch (summary.json's ``update`` time over its updates), PPO on
the default CartPole config and GRPO on the tiny model's single-token task, whole runs alternating
between the two launches. On a 2-core machine the ideal is 1.0x at most (each rank updates on half the
batch); what bounds it is said in docs/learner-ranks.md.

Equivalence: one update on the same global batch (``tests/ranks_for_tests.py``: PPO with every
normalization on; GRPO with TIS and a KL penalty), in one process and on 2 ranks: the largest weight
difference after it.

A sharded learner (``strategy=fsdp``), GRPO on a 75M-parameter model (``python -m rltrain.llm.tiny DIR
--hidden-size 768 --layers 14``): the peak resident memory of the largest process (each rank holds
half of the weights, gradients and Adam's states, plus whatever generates), the tokens generated per
second (all ranks together), and the milliseconds a push takes, for one process and 2 ranks, with an
engine copy of the model per process (``engine=transformers``, pushed through ``sync=shared_mem``) or
generating with the learner's own model (``engine=learner``: nothing to copy or push).
"""

from __future__ import annotations

import json
import os
import statistics
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


PEAK_RSS = ("import resource, subprocess, sys\n"  # the largest RSS among a command's processes (ranks included)
            "code = subprocess.run(sys.argv[2:]).returncode\n"
            "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))\n"
            "sys.exit(code)")
FSDP_LAUNCH = [*TORCHRUN[:-1], "strategy=fsdp"]
BASELINE, SHARDED_LEARNER, SHARDED_COPY = "1 process, copy", "fsdp 2 ranks, learner", "fsdp 2 ranks, copy"
SHARDED = {  # column -> (launch, engine): an engine copy of the model per process, or engine=learner
    BASELINE: (LAUNCH[ONE], "transformers"),
    "1 process, learner": (LAUNCH[ONE], "learner"),
    SHARDED_LEARNER: (FSDP_LAUNCH, "learner"),
    SHARDED_COPY: (FSDP_LAUNCH, "transformers"),
}
GRPO_RUN = ("algo=grpo", "collector.frames_per_batch=16", "collector.group_size=8", "collector.max_new_tokens=16",
            "algo.micro_batch_size=8", "hooks.save_model.at_end=false", "hooks.checkpoint.at_end=false", *COMMON)


def sharded_run(launch: list[str], engine: str, model: Path, batches: int) -> dict[str, float]:
    """One GRPO run of ``batches`` batches: its largest process's peak RSS (MiB), and the medians over its
    batches of the tokens generated per second and of the milliseconds per push."""
    with tempfile.TemporaryDirectory() as tmp:
        peak = Path(tmp) / "peak"
        proc = subprocess.run([sys.executable, "-c", PEAK_RSS, str(peak), *launch, *GRPO_RUN, f"model.path={model}",
                               f"engine={engine}", f"trainer.total_frames={16 * batches}", "hydra.run.dir=run"],
                              cwd=tmp, capture_output=True, text=True, env=_env(), timeout=900)
        if proc.returncode:
            raise RuntimeError(f"{' '.join(launch)} engine={engine} failed:\n{proc.stderr[-3000:]}")
        rows = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
        tokens = [r["perf/generated_tokens_per_s"] for r in rows if "perf/generated_tokens_per_s" in r]
        pushes = [r["sync/push_ms"] for r in rows if "sync/push_ms" in r]
        return {"peak": int(peak.read_text()) / 1024, "tokens": statistics.median(tokens),
                "push": statistics.median(pushes) if pushes else float("nan")}


def sharded(ctx) -> list[Table]:
    from rltrain.llm.tiny import write_tiny_model

    sizes = {} if ctx.quick else {"hidden_size": 768, "layers": 14}
    repeats, batches = (1, 2) if ctx.quick else (2, 4)
    runs: dict[str, list[dict]] = {column: [] for column in SHARDED}
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(Path(tmp) / "model", **sizes)
        for _ in range(repeats):  # alternating
            for column, (launch, engine) in SHARDED.items():
                runs[column].append(sharded_run(launch, engine, model, batches))
    what = "the default tiny model" if ctx.quick else "a 75M-parameter model"
    label = f"GRPO, {what}, 16 completions x 16 tokens a batch"

    def cells(key: str, unit: str, higher: bool = False) -> dict[str, Stat]:
        return {c: Stat([r[key] for r in rs], unit, higher_is_better=higher) for c, rs in runs.items()}

    memory = Table(f"Peak resident memory of the largest process (MiB), {repeats} run(s) of {batches} batches",
                   list(SHARDED), ratio_to=BASELINE, ratio_header="{peer} / copy", ratio_mode="over")
    memory.rows.append(Row(label, cells("peak", "MiB"), target=f"{SHARDED_LEARNER} <= 0.6x",
                           goals=(Goal(SHARDED_LEARNER, at_most=0.6),)))
    memory.notes.append("a rank's peak: its half of the weights, gradients and Adam's states, the layer FSDP2 "
                        "gathers for a forward or backward, and what generates (nothing more with engine=learner; a "
                        "whole copy of the model with an engine copy per rank)")
    tokens = Table("Tokens generated per second, all ranks together (median over batches)", list(SHARDED),
                  ratio_to=BASELINE, ratio_header="{peer} / copy", ratio_mode="over")
    tokens.rows.append(Row(label, cells("tokens", "tok/s", higher=True)))
    tokens.notes.append("engine=learner on fsdp gathers every layer for each new token (one all-gather per layer "
                       "per step over gloo); an engine copy per rank generates its own prompts with whole weights")
    push = Table("Milliseconds per push (median over pushes), engine copy per process", [BASELINE, SHARDED_COPY],
                 ratio_to=BASELINE, ratio_header="{peer} / 1 process", ratio_mode="over")
    push.rows.append(Row(label, {c: Stat([r["push"] for r in runs[c]], "ms") for c in push.columns},
                         target="<= 1.5x", goals=(Goal(SHARDED_COPY, at_most=1.5),)))
    push.notes.append("the ranks of one machine share the slots (rltrain/sync/node_shared.py): each copies its own "
                      "rows of every weight into place, at once, and a barrier ends the push; one process copies all "
                      "its weights with both cores. Both are bound by memory bandwidth (a rank's 149 MB take 33-36 "
                      "ms, the two ranks together). Ranks on several machines all-gather instead (gloo on loopback: "
                      "265-300 ms for the 298 MB)")
    return [memory, tokens, push]


def run(ctx) -> list[Table]:
    return [speed(ctx), equivalence(ctx), *sharded(ctx)]
