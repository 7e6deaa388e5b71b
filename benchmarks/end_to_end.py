"""Whole processes, as a user runs them: start-up, and time to solve beside stable-baselines3.

Start-up: from launching ``python -m rltrain`` (the default config) until its first batch reaches
the trainer (a hook writes the time), beside a bare ``python -c "import torch"``, alternating.
Time to solve, whole process (interpreter start, imports, training, exit), seeds interleaved:
CartPole-v1 PPO (rltrain's default run; SB3 with RL-Zoo's CartPole settings: 8 envs, n_steps 32,
batch 256, 20 epochs, gamma 0.98, lambda 0.8, linear lr 1e-3 and clip 0.2), both stopping once the
last 10 training episodes average >= 475; Pendulum-v1 SAC (``+recipe=sac_pendulum``; SB3's SAC with
lr 1e-3, batch 256, one gradient step per frame, its default 256x256 networks), both stopping at
>= -200.

CartPole-v1 DQN: ``+recipe=dqn_cartpole`` beside SB3's DQN with RL-Zoo's CartPole settings (the recipe starts
from them: 256x256 layers, 128 gradient steps of 64 per 256 frames, epsilon 1 -> 0.04 over 8k frames; then 3-step
returns, a Polyak target and lr 5e-4 where SB3 copies its target and uses lr 2.3e-3), both stopping at >= 475;
and both for a fixed 50k frames, scored by 10 deterministic episodes at the end.

Beside sb3-contrib (``RecurrentPPO``, ``MaskablePPO``), on the envs of issue 38's learning tests
(``tests/toy_envs.py``), both with rltrain's PPO defaults (16 envs, 32 steps, 10 epochs of 256, lr 3e-3
annealed, gamma 0.98, lambda 0.8, 64x64 layers) and stopping once the last 100 training episodes average the
threshold: CueMemory-v0 with its cue 16 steps before the question (an LSTM of 128 units; >= 0.9, that is 95%
of the answers right, where chance is 0) and ConnectFour-v0 against a random player (masks from its
``action_masks()`` method, a full column raises; >= 0.95, wins minus losses per game).

``--quick`` proves each program runs, not how fast it solves: one start-up round, and CartPole for
a fixed small budget (QUICK_FRAMES, the same for SB3) instead of until solved, since a run to a goal
takes as long as the machine and the seed make it.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.core import OURS, ROOT, Goal, Row, Stat, Table

NAME, TITLE = "end_to_end", "End to end"
PROGRAMS = ROOT / "benchmarks" / "programs"
QUICK_FRAMES = 2048  # four of the default run's 512-frame batches: learning starts, well short of solving


def rltrain_run(seed: int, *overrides: str) -> dict:
    """One whole ``python -m rltrain`` process: wall seconds, its summary, and when its first batch came."""
    with tempfile.TemporaryDirectory() as tmp:
        mark = Path(tmp) / "first_batch"
        cmd = [sys.executable, "-m", "rltrain", f"seed={seed}", f"hydra.run.dir={tmp}/run", "hooks.progress.bar=false",
               "+hooks.first_batch._target_=benchmarks.first_batch.FirstBatch", f"+hooks.first_batch.path={mark}",
               *overrides]
        t0_wall, t0 = time.time(), time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=900)
        wall = time.perf_counter() - t0
        summary = json.loads((Path(tmp) / "run" / "summary.json").read_text())
        first = float(mark.read_text()) - t0_wall if mark.exists() else None
    return {"wall_s": wall, "frames_to_solve": summary["frames_to_solve"], "learn_s": summary["wall_time_s"],
            "first_batch_s": first, "eval_return": summary["eval_return"]}


def sb3_run(python: str, program: str, seed: int, *args: str) -> dict:
    t0 = time.perf_counter()
    out = subprocess.run([python, str(PROGRAMS / program), f"--seed={seed}", *args], cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=900).stdout
    wall = time.perf_counter() - t0
    result = json.loads(out.strip().splitlines()[-1])
    return {"wall_s": wall, "frames_to_solve": result["frames_to_solve"], "learn_s": result["learn_s"],
            "eval_return": result.get("eval_return")}


def import_torch_s() -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True, timeout=120)
    return time.perf_counter() - t0


def startup(ctx) -> Table:
    table = Table("Start-up: seconds from launch, median [p10-p90]", ["import torch", OURS], ratio_to="import torch",
                  ratio_header="{peer} / import torch", ratio_mode="over")
    floor, first, wall, grpo = [], [], [], []
    for _ in range(1 if ctx.quick else 7):  # alternating
        floor.append(import_torch_s())
        run = rltrain_run(0, "trainer.total_frames=512", "trainer.stop_at_return=null", "hooks.eval.episodes=1",
                          "hooks.checkpoint.every=null")
        first.append(run["first_batch_s"])
        wall.append(run["wall_s"])
        # a language model's run: the tiny model loaded, its task checked and made, its engine started
        grpo.append(rltrain_run(0, "algo=grpo", "trainer.total_frames=128", "hooks.eval.prompts=8",
                                "hooks.checkpoint.every=null")["first_batch_s"])
    table.rows.append(Row("python -m rltrain: launch to the first batch", {"import torch": Stat(floor, "s"),
                                                                           OURS: Stat(first, "s")},
                          target="<= 1.5x", goals=(Goal(OURS, at_most=1.5),)))
    table.rows.append(Row("python -m rltrain, one batch: the whole process", {"import torch": Stat(floor, "s"),
                                                                              OURS: Stat(wall, "s")}))
    table.rows.append(Row("python -m rltrain algo=grpo: launch to the first batch",
                          {"import torch": Stat(floor, "s"), OURS: Stat(grpo, "s")}))
    return table


def median_or_none(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def solve(ctx, label: str, overrides: list[str], program: str, seeds: list[int], target: str,
          goals: tuple[Goal, ...] = (), sb3_args: tuple[str, ...] = (), peer: str = "sb3") -> Row:
    sb3 = ctx.peer(peer)
    runs = {OURS: [], peer: []}
    for seed in seeds:  # interleaved: the machine's noise falls on both alike
        if sb3:
            runs[peer].append(sb3_run(sb3.python or sys.executable, program, seed, *sb3_args))
        runs[OURS].append(rltrain_run(seed, *overrides))
    cells = {c: Stat([r["wall_s"] for r in rs], "s") if rs else None for c, rs in runs.items()}
    row = Row(label, cells, target=target, goals=goals)
    for c, rs in runs.items():
        if rs:
            frames = median_or_none([r["frames_to_solve"] for r in rs])
            learn = median_or_none([r["learn_s"] for r in rs])
            unsolved = sum(r["frames_to_solve"] is None for r in rs)
            row.extra[f"{c} frames to solve"] = f"{frames:,.0f}" if frames else "–"
            row.extra[f"{c} learning s"] = f"{learn:.2f}"
            if unsolved:
                row.extra[f"{c} unsolved"] = f"{unsolved}/{len(rs)}"
    return row


# Issue 38's envs beside sb3-contrib: (label, rltrain's overrides, sb3_contrib_solve.py's arguments); each stops
# once the mean of the last 100 training episodes reaches its threshold (--quick: after QUICK_FRAMES).
CONTRIB = [
    ("CueMemory-v0, cue 16 steps back, recurrent PPO (LSTM 128)",
     ["env.id=tests.toy_envs:CueMemory-v0", "+env.kwargs.delay=16", "algo.network.recurrent=lstm",
      "trainer.stop_at_return=0.9"],
     ["--algo=recurrent", "--env=CueMemory-v0", "--delay=16", "--threshold=0.9"]),
    ("ConnectFour-v0 against random play, full columns masked (action_masks())",
     ["env.id=tests.toy_envs:ConnectFour-v0", "trainer.stop_at_return=0.95"],
     ["--algo=maskable", "--env=ConnectFour-v0", "--threshold=0.95"]),
]


def contrib(ctx) -> Table:
    """Recurrent and masked PPO beside sb3-contrib's RecurrentPPO and MaskablePPO, whole processes."""
    columns = [OURS, "sb3_contrib"] if ctx.peer("sb3_contrib") else [OURS]
    seeds = [0] if ctx.quick else [0, 1, 2]
    budget = ([f"trainer.total_frames={QUICK_FRAMES}", "trainer.stop_at_return=null"], [f"--total={QUICK_FRAMES}"]) \
        if ctx.quick else ([], [])
    what = f"a fixed budget of {QUICK_FRAMES:,} frames (--quick)" if ctx.quick else \
        f"time to solve, median [p10-p90] over seeds {seeds}"
    table = Table(f"Beside sb3-contrib, whole process: {what}, seconds", columns, notes=ctx.peer_notes("sb3_contrib"))
    for label, ours, theirs in CONTRIB:
        table.rows.append(solve(ctx, label, [*ours, "trainer.return_window=100", *budget[0]], "sb3_contrib_solve.py",
                                seeds, "" if ctx.quick else "<= 0.5x sb3-contrib",
                                goals=() if ctx.quick else (Goal("sb3_contrib", at_least=2.0),),
                                sb3_args=(*theirs, "--window=100", *budget[1]), peer="sb3_contrib"))
    return table


DQN_FRAMES = 50_000  # the dqn_cartpole recipe's budget (rltrain's batches of 256 make it 50,176)
# Time to solve: SB3's RL-Zoo settings do not reach 475 within 50k frames (3 of 3 seeds), so both get 200k; epsilon
# still decays over the first 8k frames (both programs keep the recipe's schedule in frames).
DQN_SOLVE_BUDGET = 200_000


def dqn_returns(ctx, seeds: list[int], frames: int) -> Row:
    """DQN's final evaluation (10 deterministic episodes) after ``frames`` frames, rltrain's recipe beside SB3's."""
    sb3 = ctx.peer("sb3")
    returns = {OURS: [], "sb3": []}
    for seed in seeds:
        if sb3:
            returns["sb3"].append(sb3_run(sb3.python or sys.executable, "sb3_dqn_cartpole.py", seed,
                                          f"--total={frames}")["eval_return"])
        returns[OURS].append(rltrain_run(seed, "+recipe=dqn_cartpole", f"trainer.total_frames={frames}")["eval_return"])
    cells = {c: Stat(r, "return", higher_is_better=True) if r else None for c, r in returns.items()}
    return Row(f"CartPole-v1, DQN: eval return after {frames:,} frames", cells,
               target="" if ctx.quick else ">= SB3's", goals=() if ctx.quick else (Goal("sb3", at_least=1.0),))


def run(ctx) -> list[Table]:
    columns, notes = [OURS, "sb3"] if ctx.peer("sb3") else [OURS], ctx.peer_notes("sb3")
    if ctx.quick:
        table = Table(f"A fixed budget of {QUICK_FRAMES:,} frames (--quick: not run to solve), whole process: "
                      "seconds, seed 0", columns, notes=notes)
        table.rows.append(solve(ctx, "CartPole-v1, PPO", [f"trainer.total_frames={QUICK_FRAMES}"],
                                "sb3_cartpole.py", [0], "", sb3_args=(f"--total={QUICK_FRAMES}",)))
        table.rows.append(dqn_returns(ctx, [0], QUICK_FRAMES))
        return [startup(ctx), table, contrib(ctx)]
    seeds = [0, 1, 2, 3, 4]
    table = Table(f"Time to solve, whole process: seconds, median [p10-p90] over seeds {seeds}", columns, notes=notes)
    # The targets bound rltrain's time as a fraction of SB3's; the table prints SB3's over rltrain's.
    table.rows.append(solve(ctx, "CartPole-v1, PPO", [], "sb3_cartpole.py", seeds, "<= 0.35x SB3",
                            goals=(Goal("sb3", at_least=1 / 0.35),)))
    table.rows.append(solve(ctx, "Pendulum-v1, SAC 256x256", ["+recipe=sac_pendulum"], "sb3_pendulum_sac.py",
                            seeds, "<= 0.8x SB3, frames <= SB3's", goals=(Goal("sb3", at_least=1 / 0.8),)))
    table.rows.append(solve(ctx, "CartPole-v1, DQN 256x256", ["+recipe=dqn_cartpole", "trainer.stop_at_return=475",
                                                            f"trainer.total_frames={DQN_SOLVE_BUDGET}",
                                                            f"algo.exploration_fraction={8_000 / DQN_SOLVE_BUDGET}"],
                            "sb3_dqn_cartpole.py", seeds, "<= 0.5x SB3", goals=(Goal("sb3", at_least=2.0),),
                            sb3_args=("--threshold=475", f"--total={DQN_SOLVE_BUDGET}")))
    returns = Table(f"At equal frames, whole process: final eval return (10 deterministic episodes), median "
                    f"[p10-p90] over seeds {seeds}", columns, notes=notes)
    returns.rows.append(dqn_returns(ctx, seeds, DQN_FRAMES))
    return [startup(ctx), table, returns, contrib(ctx)]
