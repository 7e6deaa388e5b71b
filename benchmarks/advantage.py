"""GAE on a rollout of ``envs x steps``: rltrain's ``gae`` against TorchRL's
``vec_generalized_advantage_estimate`` (TorchRL's own benchmark shapes: [1, 512] and [32, 512],
gamma 0.99, lambda 0.95, 10% of steps done, half of them terminations), same inputs, and the
largest difference between the two libraries' advantages."""

from __future__ import annotations

from benchmarks.core import OURS, Goal, Row, Table

NAME, TITLE = "advantage", "GAE advantages"
SHAPES = [(1, 512), (32, 512)]
GAMMA, LAMBDA = 0.99, 0.95


def rollout(envs: int, steps: int):
    """The same [envs, steps] inputs in every process (the same torch draws them from the same seed)."""
    import torch

    g = torch.Generator().manual_seed(0)
    value, next_value, reward = (torch.randn(envs, steps, generator=g) for _ in range(3))
    done = torch.rand(envs, steps, generator=g) < 0.1
    terminated = done & (torch.rand(envs, steps, generator=g) < 0.5)
    return value, next_value, reward, done, terminated


def rltrain_case(envs: int, steps: int):
    from rltrain.algos.advantages import gae

    value, next_value, reward, done, terminated = (x.T.contiguous() for x in rollout(envs, steps))  # [T, N]
    return lambda: gae(reward, value, next_value, terminated, done, GAMMA, LAMBDA).T


def torchrl_case(envs: int, steps: int):
    from torchrl.objectives.value.functional import vec_generalized_advantage_estimate

    value, next_value, reward, done, terminated = (x.unsqueeze(-1) for x in rollout(envs, steps))  # [N, T, 1]
    return lambda: vec_generalized_advantage_estimate(GAMMA, LAMBDA, value, next_value, reward, done, terminated)[0][
        ..., 0]


def run(ctx) -> list[Table]:
    peers = ["torchrl"] if ctx.peer("torchrl") else []
    table = Table(f"{TITLE}: ms per call, median [p10-p90]", [OURS, *peers], notes=ctx.peer_notes("torchrl"))
    for envs, steps in SHAPES:
        cases = {OURS: ("benchmarks.advantage:rltrain_case", {"envs": envs, "steps": steps})}
        if peers:
            cases["torchrl"] = ("benchmarks.advantage:torchrl_case", {"envs": envs, "steps": steps})
        reps = 20 if ctx.quick else 50  # tiny calls: a whole round of warm-up, not 3 calls
        row = Row(f"[{envs}, {steps}]", ctx.compare(cases, reps=reps, warmup=reps, notes=table.notes),
                  target=">= 2x TorchRL, same values", goals=(Goal("torchrl", at_least=2),))
        outputs = ctx.outputs(cases, notes=table.notes)
        if len(outputs) == 2:
            ours, theirs = outputs.values()
            largest = max(abs(a - b) for r, s in zip(ours, theirs) for a, b in zip(r, s))
            row.extra["largest |difference|"] = f"{largest:.1e}"
        table.rows.append(row)
    return [table]
