"""torch.distributed on loopback (gloo): ``sync=distributed`` push latency beside its engine's
floor, and ``collector=distributed`` under torchrun beside ``collector=lockstep``.

Push: until every receiver holds the new version (the push returns after their acknowledgements),
against a raw gloo broadcast of the same bytes in one flat buffer followed by the same
acknowledgements; and for a policy of many small tensors, one broadcast per tensor (TorchRL's
distributed scheme) against rltrain's bucketed push. Throughput: PPO with 2 collector ranks x 8 envs
(``torchrun --standalone --nproc-per-node=3``) beside 2 lock-step workers x 8 envs, 512-frame
batches, frames/s from summary.json, and a one-batch run's whole process (start-up), alternating.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.core import ROOT, Goal, Row, Stat, Table
from benchmarks.weight_sync import make_net, parse_count, push_times

NAME, TITLE = "scale_out", "Scaling out"
RAW, PER_TENSOR, STOP = 1, 2, 3


def _broadcast(group, tensor) -> None:
    from torch import distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def raw_receiver(address, rank: int, size: int, nbytes: int, tensor_sizes: list[int]) -> None:
    import torch

    from rltrain import process_groups

    torch.set_num_threads(1)
    group = process_groups.gloo_group(address.connect(30), "raw", rank, size, 60, loopback=True)
    flat = torch.empty(nbytes, dtype=torch.uint8)
    small = [torch.empty(n) for n in tensor_sizes]
    while True:
        kind, _, _ = process_groups.recv_header(group, 0, 600)
        if kind == STOP:
            return
        for t in [flat] if kind == RAW else small:
            _broadcast(group, t)
        process_groups.send_frame(group, 0, kind)


def raw_floor(net, receivers: int, repeats: int, many=None) -> tuple[list[float], list[float] | None]:
    """ms of one flat broadcast of ``net``'s bytes + acks and, given ``many`` (a policy of many small
    tensors), of one broadcast per tensor of ``many`` + acks; ``repeats`` each. Both floors share
    one set of receivers: starting them (torch imported in each) is most of what a floor costs."""
    import torch

    from rltrain import process_groups

    nbytes = 4 * sum(t.numel() for t in net.state_dict().values())
    tensor_sizes = [] if many is None else [t.numel() for t in many.state_dict().values()]
    ctx = mp.get_context("spawn")
    server, address = process_groups.local_store(30)
    procs = [ctx.Process(target=raw_receiver, args=(address, r, receivers + 1, nbytes, tensor_sizes), daemon=True)
             for r in range(1, receivers + 1)]
    for p in procs:
        p.start()
    try:
        group = process_groups.gloo_group(server, "raw", 0, receivers + 1, 60, loopback=True)
        flat = torch.randn(nbytes // 4).view(torch.uint8)
        small = [torch.randn(n) for n in tensor_sizes]
        results = {}
        for kind, tensors in [(RAW, [flat])] + ([(PER_TENSOR, small)] if small else []):
            times = []
            for _ in range(repeats + 2):
                t0 = time.perf_counter()
                for r in range(1, receivers + 1):
                    process_groups.send_frame(group, r, kind)
                for t in tensors:
                    _broadcast(group, t)
                for r in range(1, receivers + 1):
                    process_groups.recv_header(group, r, 60)
                times.append((time.perf_counter() - t0) * 1e3)
            results[kind] = times[2:]
        for r in range(1, receivers + 1):
            process_groups.send_frame(group, r, STOP)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return results[RAW], results.get(PER_TENSOR)


def push(ctx) -> list[Table]:
    # A quick run starts one receiver per push: each imports torch, the most a busy box slows.
    sizes, receivers, repeats = (["1M"], [1], 5) if ctx.quick else (["1M", "10M", "50M"], [2, 4], 10)
    # shared_mem: the same push without a network; weight_sync times it, so a quick run leaves it out here
    columns = ["raw gloo broadcast", "distributed", *([] if ctx.quick else ["shared_mem"])]
    flat = Table(f"sync=distributed push: ms, median [p10-p90] of {repeats}", columns,
                 ratio_to="raw gloo broadcast", ratio_header="{peer} / raw", ratio_mode="over")
    n_small = parse_count("1M")
    many = make_net(n_small, "many_small")
    per_tensor = {}  # receivers -> the small policy's floor, measured with the 1M rows' flat one
    for text in sizes:
        n = parse_count(text)
        for r in receivers:
            raw, floor = raw_floor(make_net(n), r, repeats, many if n == n_small else None)
            if floor is not None:
                per_tensor[r] = floor
            cells = {"raw gloo broadcast": Stat(raw), "distributed": Stat(push_times("distributed", n, r, repeats))}
            if "shared_mem" in columns:
                cells["shared_mem"] = Stat(push_times("shared_mem", n, r, repeats))
            flat.rows.append(Row(f"{text} params, {r} receiver{'s' * (r > 1)}", cells, target="distributed <= 1.2x raw",
                                 goals=(Goal("distributed", at_most=1.2),)))
    small = Table(f"A policy of {len(many.state_dict())} small tensors (1M weights in 64x64 layers): ms",
                  ["distributed (bucketed)", "one broadcast per tensor"], ratio_to="distributed (bucketed)",
                  ratio_header="x vs {peer}")
    for r in receivers:  # a quick run leaves the bucketed push out: the row above runs the same DistributedSync
        bucketed = None if ctx.quick else Stat(push_times("distributed", n_small, r, repeats, "many_small"))
        cells = {"distributed (bucketed)": bucketed, "one broadcast per tensor": Stat(per_tensor[r])}
        small.rows.append(Row(f"{r} receiver{'s' * (r > 1)}", cells, target=">= 3x",
                              goals=(Goal("one broadcast per tensor", at_least=3),)))
    return [flat, small]


ONE_BATCH = 512
COMMON = ["trainer.stop_at_return=null", "hooks.eval.episodes=1", "hooks.checkpoint.every=null",
          f"collector.frames_per_batch={ONE_BATCH}", "hooks.progress.bar=false"]
KINDS = {
    "lockstep 2 workers x 8": [sys.executable, "-m", "rltrain", "collector=lockstep", "collector.workers=2",
                               "collector.envs_per_worker=8", "sync=shared_mem"],
    "distributed 2 ranks x 8": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
                                "-m", "rltrain", "collector=distributed", "collector.envs_per_rank=8",
                                "sync=distributed"],
}


def run_job(cmd: list[str], frames: int, env: str) -> tuple[float, float]:
    """(frames/s from summary.json, whole-process seconds)."""
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        subprocess.run([*cmd, f"env={env}", f"trainer.total_frames={frames}", *COMMON], cwd=tmp, check=True,
                       capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=900)
        wall = time.perf_counter() - t0
        (summary,) = Path(tmp).glob("outputs/*/*/summary.json")
        return json.loads(summary.read_text())["fps"], wall


def throughput(ctx) -> list[Table]:
    # Whole processes are what a busy box slows most. A quick run starts torchrun's once, for one
    # batch, so that run is also the start-up table's one-batch run; and no lockstep run (the
    # collection category starts lockstep workers).
    frames, repeats = (ONE_BATCH, 1) if ctx.quick else (60_000, 3)
    envs = ["cartpole"] if ctx.quick else ["cartpole", "halfcheetah"]
    base, other = KINDS
    kinds = [other] if ctx.quick else [base, other]
    fps = Table(f"PPO frames/s over {frames:,} frames, median of {repeats}", list(KINDS), ratio_to=base,
                ratio_header="{peer} / lockstep", ratio_mode="over")
    start = Table(f"A one-batch PPO run, whole process: seconds, median of {repeats}", list(KINDS), ratio_to=base,
                  ratio_header="{peer} / lockstep", ratio_mode="over")
    for env in envs:
        f, s = {k: [] for k in kinds}, {k: [] for k in kinds}
        for _ in range(repeats):  # alternating
            for kind in kinds:
                rate, wall = run_job(KINDS[kind], frames, env)
                f[kind].append(rate)
                s[kind].append(wall if frames == ONE_BATCH else run_job(KINDS[kind], ONE_BATCH, env)[1])
        fps.rows.append(Row(env, {k: Stat(v, "frames/s", higher_is_better=True) for k, v in f.items()},
                            target=">= 0.8x", goals=(Goal(other, at_least=0.8),)))
        start.rows.append(Row(env, {k: Stat(v, "s") for k, v in s.items()}, target="<= 1.5x",
                              goals=(Goal(other, at_most=1.5),)))
    return [fps, start]


def run(ctx) -> list[Table]:
    return push(ctx) + throughput(ctx)
