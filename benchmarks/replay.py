"""Replay buffer throughput: adding 10k frames and sampling a batch of 256, at capacities of 1e4,
1e5 and 1e6 frames (TorchRL's ``test_rb_extend_sample`` sizes), with SAC's frames on HalfCheetah
(observation 17, action 6, reward, terminated, next observation). rltrain's ``ReplayBuffer``
against TorchRL's ``ReplayBuffer(LazyTensorStorage, RandomSampler)``; both buffers start full."""

from __future__ import annotations

from benchmarks.core import OURS, Goal, Row, Table

NAME, TITLE = "replay", "Replay buffer"
OBS, ACT, CHUNK, BATCH = 17, 6, 10_000, 256

def frames(n: int, nested_reward: bool = False):
    import torch
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(0)
    reward, terminated = torch.randn(n, generator=g), torch.zeros(n, dtype=torch.bool)
    if nested_reward:  # TorchRL keeps reward and done flags under "next", with a trailing dim
        nxt = {"observation": torch.randn(n, OBS, generator=g), "reward": reward.unsqueeze(-1),
               "terminated": terminated.unsqueeze(-1), "done": terminated.unsqueeze(-1)}
        data = {"observation": torch.randn(n, OBS, generator=g), "action": torch.randn(n, ACT, generator=g)}
    else:
        nxt = {"observation": torch.randn(n, OBS, generator=g)}
        data = {"observation": torch.randn(n, OBS, generator=g), "action": torch.randn(n, ACT, generator=g),
                "reward": reward, "terminated": terminated}
    return TensorDict({**data, "next": nxt}, batch_size=[n])

def rltrain_case(capacity: int, op: str):
    from rltrain.data import ReplayBuffer

    buffer, chunk = ReplayBuffer(capacity), frames(CHUNK)
    for _ in range(-(-capacity // CHUNK)):
        buffer.extend(chunk)
    return (lambda: buffer.extend(chunk)) if op == "extend" else (lambda: buffer.sample(BATCH))

def torchrl_case(capacity: int, op: str):
    from torchrl.data import LazyTensorStorage, RandomSampler, ReplayBuffer

    buffer = ReplayBuffer(storage=LazyTensorStorage(capacity), sampler=RandomSampler(), batch_size=BATCH)
    chunk = frames(CHUNK, nested_reward=True)
    for _ in range(-(-capacity // CHUNK)):
        buffer.extend(chunk)
    return (lambda: buffer.extend(chunk)) if op == "extend" else buffer.sample

def run(ctx) -> list[Table]:
    peers = ["torchrl"] if ctx.peer("torchrl") else []
    table = Table(f"{TITLE}: ms per call, median [p10-p90]", [OURS, *peers], notes=ctx.peer_notes("torchrl"))
    capacities = [10_000, 100_000] if ctx.quick else [10_000, 100_000, 1_000_000]
    for capacity in capacities:
        for op, what, reps in (("extend", f"extend {CHUNK:,}", 5), ("sample", f"sample {BATCH}", 50)):
            kwargs = {"capacity": capacity, "op": op}
            cases = {OURS: ("benchmarks.replay:rltrain_case", kwargs)}
            if peers:
                cases["torchrl"] = ("benchmarks.replay:torchrl_case", kwargs)
            cells = ctx.compare(cases, reps=reps, notes=table.notes)
            row = Row(f"{what}, capacity {capacity:.0e}", cells, target=">= 2x TorchRL",
                      goals=(Goal("torchrl", at_least=2),))
            if cells.get(OURS):
                per = CHUNK if op == "extend" else BATCH
                row.extra["rltrain frames/s"] = f"{per / cells[OURS].median * 1e3:,.0f}"
            table.rows.append(row)
    return [table]
