"""Language models: rltrain's GRPO beside TRL's GRPOTrainer, and its generation engine beside a bare
``model.generate``.

GRPO beside TRL: the tiny Qwen2 model (``rltrain.llm.tiny``: random weights, the same dir for both)
learns ``reverse D:`` -> ``D`` on the CPU with one torch thread, 16 prompts x 8 completions a step,
temperature 1, lr 3e-3, micro-batches of 64, token-mean loss, clip 0.2/0.28, std-scaled rewards, no
KL (benchmarks/trl_grpo.py lists TRL's settings). Each side is its own process, seeds interleaved
(TRL first, then rltrain, for each seed); seed s is the trainer's seed and the task's on both sides
(rltrain's ``seed`` seeds its task too; TRL gets ``--seed s --task-seed s``). Both stop once the mean
reward of the last 10 steps reaches 0.8, or at MAX_STEPS. A step is generation + update: TRL's from a
callback's ``on_step_begin`` to ``on_step_end``; rltrain's from a hook that runs after every update
(benchmarks/step_clock.py: the generation, scoring, update and every hook of the step). The time to
0.8 runs from the first step's start to the step that reached it. Start-up (imports, model loading)
is in neither.

GRPO beside TRL on episodes with a tool: the same, on ``env=tools`` (10 keys, up to 2 turns of up to 24
tokens, lr 3e-4, to a mean reward of 0.9), from the model ``rltrain.llm.cold_start`` makes (it copies text
and calls the tool with a key of its own choosing: right 1 in 10 by chance). TRL plays the episodes through
a ``rollout_func`` over the same ``ToolEnv`` (benchmarks/trl_grpo.py ``--task tools``).

Generation: ``TransformersEngine.generate(prompts, 8, Sampling(...))`` (one prefill per group's
prompt, and each token's sampling log-prob) beside ``model.generate(**tokenizer(each prompt 8
times), do_sample=True, ...)``, same model, the 16 prompts, temperature 1, top_p 1, top_k 0, the same
seed every call, tokenization included, alternating rounds; generated tokens (up to and including
eos) per second.

``--quick``: GRPO for QUICK_STEPS steps of seed 0 (no run to 0.8), and fewer generation rounds.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.core import OURS, ROOT, Goal, Row, Stat, Table

NAME, TITLE = "llm", "Language models"
PROMPTS, GROUP, THRESHOLD, WINDOW = 16, 8, 0.8, 10
LR = 3e-3  # both sides; algo=grpo's default is 1e-3 (no seed lets a digit's token die there, but it takes more steps)
MAX_STEPS = 200
# the tool task: 10 keys, a call turn then an answer turn; algo.lr 3e-4 (1e-3 unlearns the call syntax)
TOOL_KEYS, TOOL_TURNS, TOOL_TOKENS, TOOL_LR, TOOL_THRESHOLD, TOOL_MAX_STEPS = 10, 2, 24, 3e-4, 0.9, 300
SEEDS = [0, 1, 2]
QUICK_STEPS = 5
BARE = "model.generate"


def model_dir() -> Path:
    from rltrain.llm.tiny import tiny_model_dir

    return tiny_model_dir()


def _env() -> dict:
    # the worktree's rltrain first (a venv made with --system-site-packages may see another install of it)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}


@dataclass(frozen=True)
class Task:
    """What both sides train on: ``ours``, the run's overrides beyond ``algo=grpo``; ``theirs``, trl_grpo.py's
    arguments beyond the shared ones."""

    name: str
    model: Path
    lr: float
    threshold: float
    max_steps: int
    ours: tuple[str, ...] = ()
    theirs: tuple[str, ...] = ()


def reverse_task(model: Path) -> Task:
    return Task("reverse D: -> D", model, LR, THRESHOLD, MAX_STEPS)


def tool_task() -> Task:
    """Episodes of env=tools (rltrain.llm.cold_start's model: chance until it learns which key to ask for)."""
    from rltrain.llm.cold_start import tool_caller_dir

    return Task(f"env=tools episodes ({TOOL_KEYS} keys, up to {TOOL_TURNS} turns, the cold-started model)",
                tool_caller_dir(TOOL_KEYS), TOOL_LR, TOOL_THRESHOLD, TOOL_MAX_STEPS,
                ("env=tools", f"env.keys={TOOL_KEYS}", f"collector.max_turns={TOOL_TURNS}"),
                ("--task", "tools", "--keys", str(TOOL_KEYS), "--max-turns", str(TOOL_TURNS)))


def rltrain_run(task: Task, seed: int, max_new_tokens: int, steps: int, stop: bool) -> dict:
    """One ``python -m rltrain algo=grpo`` process with the step clock."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "clock.json"
        cmd = [sys.executable, "-m", "rltrain", "algo=grpo", *task.ours, f"model.path={task.model}", f"seed={seed}",
               f"algo.lr={task.lr}", f"collector.max_new_tokens={max_new_tokens}",
               f"trainer.total_frames={steps * PROMPTS * GROUP}", "trainer.stop_at_return=null",
               f"hydra.run.dir={tmp}/run", "hooks.progress.bar=false",
               "+hooks.clock._target_=benchmarks.step_clock.StepClock", f"+hooks.clock.path={out}",
               f"+hooks.clock.threshold={task.threshold}", f"+hooks.clock.window={WINDOW}",
               f"+hooks.clock.stop={str(stop).lower()}"]
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=1800, env=_env())
        result = json.loads(out.read_text())
    result["command"] = " ".join(["python", *cmd[1:]]).replace(tmp, "TMP")
    return result


def trl_run(python: str, task: Task, seed: int, max_new_tokens: int, steps: int, stop: bool) -> dict:
    """One benchmarks/trl_grpo.py process in TRL's Python."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "trl.json"
        cmd = [python, "-m", "benchmarks.trl_grpo", *task.theirs, "--model", str(task.model), "--steps", str(steps),
               "--max-new-tokens", str(max_new_tokens), "--seed", str(seed), "--task-seed", str(seed),
               "--lr", str(task.lr), "--threshold", str(task.threshold), "--out", str(out),
               *([] if stop else ["--no-stop"])]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600, env=_env())
        if proc.returncode:
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            raise RuntimeError(f"trl_grpo.py exited {proc.returncode}: {lines[-1] if lines else ''}")
        result = json.loads(out.read_text())
    result["command"] = " ".join([python, *cmd[1:]]).replace(tmp, "TMP")
    return result


def grpo_table(ctx, task: Task, tokens: list[int], notes: list[str]) -> tuple[Table, dict]:
    trl = ctx.peer("trl")
    columns = [OURS, "trl"] if trl else [OURS]
    seeds, steps = ([0], QUICK_STEPS) if ctx.quick else (SEEDS, task.max_steps)
    tokens = tokens[:1] if ctx.quick else tokens
    what = (f"{QUICK_STEPS} steps (--quick: not run to {task.threshold})" if ctx.quick else
            f"until the mean reward of the last {WINDOW} steps >= {task.threshold} (at most {steps} steps)")
    table = Table(f"GRPO beside TRL, the tiny model on {task.name}, {PROMPTS}x{GROUP} completions a step, lr "
                  f"{task.lr:g}, CPU, seeds {seeds}, {what}: step ms (generation + update) pooled over seeds, and "
                  f"seconds to {task.threshold}, median [p10-p90]", columns, notes=notes + ctx.peer_notes("trl"))
    raw = {}
    for n in tokens:
        runs = {OURS: [], "trl": []}
        for seed in seeds:  # interleaved: the machine's noise falls on both alike
            if trl:
                try:
                    runs["trl"].append(trl_run(trl.python or sys.executable, task, seed, n, steps, not ctx.quick))
                except Exception as e:  # noqa: BLE001  TRL failing leaves its cells empty
                    table.notes.append(f"trl failed (seed {seed}, max_new_tokens {n}): {e}")
            runs[OURS].append(rltrain_run(task, seed, n, steps, not ctx.quick))
        raw[n] = runs
        step_cells = {c: Stat([s * 1e3 for r in rs for s in r["step_seconds"]]) if rs else None
                      for c, rs in runs.items() if c in columns}
        row = Row(f"max_new_tokens {n}: ms per step", step_cells, target="" if ctx.quick else ">= 1.5x TRL",
                  goals=() if ctx.quick else (Goal("trl", at_least=1.5),))
        for c, rs in runs.items():
            if rs:
                row.extra[f"{c} steps run"] = "/".join(str(len(r["step_seconds"])) for r in rs)
        table.rows.append(row)
        if ctx.quick:
            continue
        wall_cells = {}
        row = Row(f"max_new_tokens {n}: seconds to {task.threshold}", {}, target=">= 1.5x TRL",
                  goals=(Goal("trl", at_least=1.5),))
        for c in columns:
            rs = runs[c]
            reached = [r["threshold_wall_s"] for r in rs if r["threshold_wall_s"] is not None]
            wall_cells[c] = Stat(reached, "s") if reached else None
            if rs:
                row.extra[f"{c} steps to {task.threshold}"] = "/".join(str(r["threshold_step"] or "–") for r in rs)
                if len(reached) < len(rs):
                    row.extra[f"{c} not reached"] = f"{len(rs) - len(reached)}/{len(rs)}"
                    row.extra[f"{c} last-{WINDOW} mean reward"] = "/".join(
                        f"{statistics.mean(r['step_rewards'][-WINDOW:]):.2f}" for r in rs)
        row.cells = wall_cells
        table.rows.append(row)
    _commands(table, raw)
    return table, raw


def _commands(table: Table, raw: dict) -> None:
    """Each side's versions and first command, in the table's notes."""
    trl_versions = next((r["versions"] for runs in raw.values() for r in runs["trl"]), None)
    if trl_versions:
        table.notes.append("trl's side: " + ", ".join(f"{k} {v}" for k, v in trl_versions.items()))
    for n, runs in raw.items():
        for c, rs in runs.items():
            if rs:
                table.notes.append(f"{c}, max_new_tokens {n}: {rs[0]['command']}")


def count_tokens(ids, eos: int) -> int:
    """Generated tokens of a ``[B, T]`` batch: each row up to and including its first eos."""
    total = 0
    for row in ids.tolist():
        total += row.index(eos) + 1 if eos in row else len(row)
    return total


def generation_table(ctx, model: Path) -> Table:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rltrain.llm.engine import Sampling, TransformersEngine
    from rltrain.llm.tasks import ReverseDigits

    torch.set_num_threads(ctx.threads)  # as the function-level cases (2 threads on a busy 2-core box wait)
    tok = AutoTokenizer.from_pretrained(model, padding_side="left")
    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    engine = TransformersEngine(net, tok)
    prompts = [r["prompt"] for r in ReverseDigits(length=1, seed=0).take(PROMPTS)]
    repeated = [p for p in prompts for _ in range(GROUP)]
    seed = 0

    def bare(n: int) -> int:
        with torch.no_grad():
            enc = tok(repeated, return_tensors="pt", padding=True, add_special_tokens=False)
            torch.manual_seed(seed)
            out = net.generate(**enc, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=n,
                               pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        return count_tokens(out[:, enc["input_ids"].shape[1]:], tok.eos_token_id)

    def ours(n: int) -> int:
        return int(engine.generate(prompts, GROUP, Sampling(1.0, 1.0, n), seed=seed).completion_mask.sum())

    table = Table(f"Generation: {PROMPTS} prompts x {GROUP} completions of the tiny model, sampled (temperature 1, "
                  f"top_p 1, top_k 0, seed {seed} every call), CPU, {ctx.threads} torch thread(s): generated tokens/s, "
                  "median [p10-p90]", [OURS, BARE])
    table.notes.append(f"{OURS}: TransformersEngine.generate (one prefill per group's prompt, and each token's "
                       f"sampling log-prob); {BARE}: model.generate on each prompt {GROUP} times, tokenizer included")
    reps = 2 if ctx.quick else 5
    for n in [16] if ctx.quick else [1, 16]:
        samples = {OURS: [], BARE: []}
        ms = {OURS: [], BARE: []}
        counts = {OURS: set(), BARE: set()}
        for round_ in range(1 + ctx.rounds):  # a warm-up round, then rounds alternating between the two
            for column, step in ((BARE, bare), (OURS, ours)):
                for _ in range(1 if round_ == 0 else reps):
                    t0 = time.perf_counter()
                    count = step(n)
                    seconds = time.perf_counter() - t0
                    if round_:
                        samples[column].append(count / seconds)
                        ms[column].append(seconds * 1e3)
                        counts[column].add(count)
        row = Row(f"max_new_tokens {n}", {c: Stat(v, "tokens/s", True) for c, v in samples.items()},
                  target="" if ctx.quick else f">= 0.9x {BARE}", goals=() if ctx.quick else (Goal(BARE, at_least=0.9),))
        for c in (OURS, BARE):
            row.extra[f"{c} ms per call"] = f"{statistics.median(ms[c]):.1f}"
            row.extra[f"{c} tokens per call"] = "/".join(str(x) for x in sorted(counts[c]))
        table.rows.append(row)
    return table


def run(ctx) -> list[Table]:
    import transformers

    model = model_dir()
    notes = [f"the model: {model}; transformers {transformers.__version__} here"]
    reverse, _ = grpo_table(ctx, reverse_task(model), [1, 4], notes)
    tools, _ = grpo_table(ctx, tool_task(), [TOOL_TOKENS], [
        "an episode: the model calls lookup (<tool>lookup(kN)</tool>, a turn of up to 24 tokens), reads the result "
        "and answers; rltrain plays them with its episode collector, TRL with a rollout_func over the same ToolEnv "
        "(benchmarks/trl_grpo.py: tool_rollout, model.generate per turn, env_mask over the tools' tokens)"])
    return [reverse, tools, generation_table(ctx, model)]
