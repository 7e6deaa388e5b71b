"""``sync=distributed`` push latency beside the floor of its engine, measured side by side.

For each size and number of receiving processes (loopback, gloo): a rltrain push (until every
receiver holds the new version: it returns after their acknowledgements), a raw gloo broadcast
of the same bytes in one flat buffer followed by the same acknowledgements (the floor), and, for
a policy of many small tensors, one broadcast per tensor (TorchRL's distributed scheme) against
rltrain's bucketed push. ``sync=shared_mem`` in the same table, for context.

    python benchmarks/distributed_push.py [--params 1M 10M 50M] [--receivers 2 4] [--repeats 10]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import torch
from sync_push_latency import Net, measure, parse_count
from torch import distributed as dist
from torch import nn

from rltrain import distributed as rd

RAW, PER_TENSOR, STOP = 1, 2, 3


class ManySmall(nn.Module):
    """About ``n_params`` weights in 64x64 layers: hundreds of small tensors."""

    def __init__(self, n_params: int):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(64, 64) for _ in range(max(1, n_params // (64 * 65)))])


def _broadcast(group, tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def raw_receiver(address, rank: int, size: int, nbytes: int, tensor_sizes: list[int]) -> None:
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


def raw_floor(nbytes: int, tensor_sizes: list[int], receivers: int, repeats: int) -> tuple[float, float]:
    """Median ms of (one flat broadcast + acks, one broadcast per tensor + acks)."""
    ctx = mp.get_context("spawn")
    server, address = rd.local_store(30)
    procs = [ctx.Process(target=raw_receiver, args=(address, r, receivers + 1, nbytes, tensor_sizes), daemon=True)
             for r in range(1, receivers + 1)]
    for p in procs:
        p.start()
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
            times.append(time.perf_counter() - t0)
        results[kind] = statistics.median(times[2:]) * 1e3
    for r in range(1, receivers + 1):
        rd.send_frame(group, r, STOP)
    for p in procs:
        p.join(timeout=10)
    return results[RAW], results[PER_TENSOR]


def nbytes_of(module: nn.Module) -> tuple[int, list[int]]:
    sizes = [t.numel() for t in module.state_dict().values()]
    return 4 * sum(sizes), sizes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", nargs="+", default=["1M", "10M", "50M"])
    parser.add_argument("--receivers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"\nPush latency until every receiver holds the new version (median of {args.repeats}, ms; loopback)")
    print(f"{'params':>7} {'recv':>4} {'raw gloo':>9} {'distributed':>12} {'/raw':>6} {'shared_mem':>11}")
    for text in args.params:
        n = parse_count(text)
        nbytes, sizes = nbytes_of(Net(n))
        for receivers in args.receivers:
            raw, _ = raw_floor(nbytes, sizes, receivers, args.repeats)
            ours = measure("distributed", n, receivers, args.repeats)
            shm = measure("shared_mem", n, receivers, args.repeats)
            print(f"{text:>7} {receivers:>4} {raw:9.2f} {ours:12.2f} {ours / raw:6.2f} {shm:11.2f}", flush=True)
    n = parse_count("1M")
    nbytes, sizes = nbytes_of(ManySmall(n))
    print(f"\nA policy of {len(sizes)} small tensors ({sum(sizes):,} weights): one message per tensor vs bucketed")
    print(f"{'recv':>4} {'per tensor':>11} {'distributed':>12} {'speed-up':>9}")
    for receivers in args.receivers:
        _, per_tensor = raw_floor(nbytes, sizes, receivers, args.repeats)
        ours = measure("distributed", n, receivers, args.repeats, net=ManySmall)
        print(f"{receivers:>4} {per_tensor:11.2f} {ours:12.2f} {per_tensor / ours:8.1f}x", flush=True)
    print("\ntargets: distributed <= 1.2x the raw broadcast; >= 3x faster than one message per tensor")


if __name__ == "__main__":
    main()
