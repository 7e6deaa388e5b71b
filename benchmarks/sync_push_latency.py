"""Weight-push latency per sync scheme against the memcpy floor, measured side by side.

A push counts until every worker process holds the new version (each worker acknowledges the
version it applied through shared memory). The floor is one copy of the same bytes in the
learner's process. Workers poll as an async collector's would, between short sleeps.

    python benchmarks/sync_push_latency.py [--params 70k 1M 10M 50M] [--workers 2] [--repeats 20]

(``sync=distributed`` beside the floor of its engine: benchmarks/distributed_push.py.)
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import statistics
import time
from multiprocessing.connection import wait

import torch
from torch import nn

from rltrain.sync import DistributedSync, PipeSync, SharedMemSync

SCHEMES = {"shared_mem": SharedMemSync, "pipe": PipeSync, "distributed": DistributedSync}
POLL_S = 0.0002  # shared_mem workers look for a new version this often (an env step or so)


class Net(nn.Module):
    """Four square linear layers plus a normalizer-like buffer: about ``n_params`` weights."""

    def __init__(self, n_params: int):
        super().__init__()
        d = max(1, int(math.sqrt(n_params / 4)))
        self.layers = nn.Sequential(*[nn.Linear(d, d) for _ in range(4)])
        self.register_buffer("obs_mean", torch.zeros(d))


def worker(n_params: int, receiver, ack: torch.Tensor, index: int, stop, net=None) -> None:
    torch.set_num_threads(1)
    policy = (net or Net)(n_params)
    receiver.connect(policy)
    ack[index] = receiver.version
    waitable = getattr(receiver, "waitable", None)
    while not stop.is_set():
        if waitable is not None:
            wait([waitable], timeout=0.1)
        else:
            time.sleep(POLL_S)
        if receiver.poll():
            ack[index] = receiver.version
    os._exit(0)  # as rltrain's workers do: a receiving thread may still wait in C++ (sync=distributed)


def parse_count(text: str) -> int:
    scale = {"k": 1_000, "M": 1_000_000}.get(text[-1], 1)
    return int(float(text.rstrip("kM")) * scale)


def measure(scheme_name: str, n_params: int, workers: int, repeats: int, net=None) -> float:
    ctx = mp.get_context("spawn")
    net = net or Net
    learner = net(n_params)
    scheme = SCHEMES[scheme_name]()
    sender = scheme.sender(learner)
    ack = torch.full((workers,), -1, dtype=torch.int64).share_memory_()
    stop = ctx.Event()
    procs = [ctx.Process(target=worker, args=(n_params, scheme.receiver(), ack, i, stop, net), daemon=True)
             for i in range(workers)]
    for p in procs:
        p.start()
    try:
        while int(ack.min()) < 0:
            time.sleep(0.01)
        times = []
        for _ in range(repeats + 2):
            with torch.no_grad():
                learner.layers[0].bias.add_(1.0)
            t0 = time.perf_counter()
            version = sender.push()
            while int(ack.min()) < version:
                pass
            times.append(time.perf_counter() - t0)
        return statistics.median(times[2:]) * 1e3
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        sender.close()


def memcpy_floor(n_params: int, repeats: int) -> float:
    learner = Net(n_params)
    n = sum(t.numel() for t in learner.state_dict().values())
    src, dst = torch.randn(n), torch.empty(n)
    times = []
    for _ in range(repeats + 2):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", nargs="+", default=["70k", "1M", "10M", "50M"])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"\nPush latency until every worker holds the new version (median of {args.repeats}, ms)")
    header = f"{'params':>8} {'memcpy':>8}" + "".join(
        f" {f'{s} x{w}':>14} {'/floor':>7}" for s in SCHEMES for w in args.workers)
    print(header)
    for text in args.params:
        n = parse_count(text)
        floor = memcpy_floor(n, args.repeats)
        row = f"{text:>8} {floor:8.3f}"
        for scheme_name in SCHEMES:
            for workers in args.workers:
                ms = measure(scheme_name, n, workers, args.repeats)
                row += f" {ms:14.3f} {ms / floor:7.2f}"
        print(row, flush=True)
    print("\ntargets: shared_mem <= 1.5x floor at >= 10M and <= 1 ms at 1M, flat in workers; pipe <= 3x floor")


if __name__ == "__main__":
    main()
