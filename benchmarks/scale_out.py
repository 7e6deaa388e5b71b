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

from benchmarks.core import ROOT, Row, Stat, Table
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

    from rltrain import distributed as rd

    torch.set_num_threads(1)
    group = rd.gloo_group(address.connect(30), "raw", rank, size, 60, loopback=True)
    flat = torch.empty(nbytes, dtype=torch.uint8)
    small = [torch.empty(n) for n in tensor_sizes]
    while True:
        kind, _, _ = rd.recv_header(group, 0, 600)
        if kind == STOP:
            return
        for t in [flat] if kind == RAW else small:
            _broadcast(group, t)
        rd.send_frame(group, 0, kind)


def raw_floor(net, receivers: int, repeats: int) -> tuple[list[float], list[float]]:
    """ms of (one flat broadcast + acks, one broadcast per tensor + acks), ``repeats`` each."""
    import torch

    from rltrain import distributed as rd

    tensor_sizes = [t.numel() for t in net.state_dict().values()]
    nbytes = 4 * sum(tensor_sizes)
    ctx = mp.get_context("spawn")
    server, address = rd.local_store(30)
    procs = [ctx.Process(target=raw_receiver, args=(address, r, receivers + 1, nbytes, tensor_sizes), daemon=True)
             for r in range(1, receivers + 1)]
    for p in procs:
        p.start()
    try:
        group = rd.gloo_group(server, "raw", 0, receivers + 1, 60, loopback=True)
        flat = torch.randn(nbytes // 4).view(torch.uint8)
        small = [torch.randn(n) for n in tensor_sizes]
        results = {}
        for kind, tensors in ((RAW, [flat]), (PER_TENSOR, small)):
            times = []
            for _ in range(repeats + 2):
                t0 = time.perf_counter()
                for r in range(1, receivers + 1):
                    rd.send_frame(group, r, kind)
                for t in tensors:
                    _broadcast(group, t)
                for r in range(1, receivers + 1):
                    rd.recv_header(group, r, 60)
                times.append((time.perf_counter() - t0) * 1e3)
            results[kind] = times[2:]
        for r in range(1, receivers + 1):
            rd.send_frame(group, r, STOP)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return results[RAW], results[PER_TENSOR]


def push(ctx) -> list[Table]:
    sizes, receivers, repeats = (["1M"], [2], 5) if ctx.quick else (["1M", "10M", "50M"], [2, 4], 10)
    flat = Table(f"sync=distributed push: ms, median [p10-p90] of {repeats}",
                 ["raw gloo broadcast", "distributed", "shared_mem"], ratio_to="raw gloo broadcast",
                 ratio_header="{peer} / raw", ratio_mode="over")
    for text in sizes:
        n = parse_count(text)
        for r in receivers:
            raw, _ = raw_floor(make_net(n), r, repeats)
            flat.rows.append(Row(f"{text} params, {r} receivers", {
                "raw gloo broadcast": Stat(raw), "distributed": Stat(push_times("distributed", n, r, repeats)),
                "shared_mem": Stat(push_times("shared_mem", n, r, repeats))}, target="distributed <= 1.2x raw"))
    n = parse_count("1M")
    net = make_net(n, "many_small")
    small = Table(f"A policy of {len(net.state_dict())} small tensors (1M weights in 64x64 layers): ms",
                  ["distributed (bucketed)", "one broadcast per tensor"], ratio_to="distributed (bucketed)",
                  ratio_header="x vs {peer}")
    for r in receivers:
        _, per_tensor = raw_floor(net, r, repeats)
        small.rows.append(Row(f"{r} receivers", {"distributed (bucketed)": Stat(push_times("distributed", n, r, repeats,
                                                                                             "many_small")),
                                                 "one broadcast per tensor": Stat(per_tensor)}, target=">= 3x"))
    return [flat, small]


COMMON = ["trainer.stop_at_return=null", "hooks.eval.episodes=1", "hooks.checkpoint.every=null",
          "collector.frames_per_batch=512", "hooks.progress.bar=false"]
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
    frames, repeats = (8192, 1) if ctx.quick else (60_000, 3)
    envs = ["cartpole"] if ctx.quick else ["cartpole", "halfcheetah"]
    base, other = KINDS
    fps = Table(f"PPO frames/s over {frames:,} frames, median of {repeats}", list(KINDS), ratio_to=base,
                ratio_header="{peer} / lockstep", ratio_mode="over")
    start = Table(f"A one-batch PPO run, whole process: seconds, median of {repeats}", list(KINDS), ratio_to=base,
                  ratio_header="{peer} / lockstep", ratio_mode="over")
    for env in envs:
        f, s = {k: [] for k in KINDS}, {k: [] for k in KINDS}
        for _ in range(repeats):  # alternating
            for kind, cmd in KINDS.items():
                f[kind].append(run_job(cmd, frames, env)[0])
                s[kind].append(run_job(cmd, 512, env)[1])
        fps.rows.append(Row(env, {k: Stat(v, "frames/s", higher_is_better=True) for k, v in f.items()},
                            target=">= 0.8x"))
        start.rows.append(Row(env, {k: Stat(v, "s") for k, v in s.items()}, target="<= 1.5x"))
    return [fps, start]


def run(ctx) -> list[Table]:
    return push(ctx) + throughput(ctx)
