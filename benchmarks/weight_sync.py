"""Weight-push latency per sync scheme, against the memcpy floor measured in the same run.

A push counts until every worker process holds the new version (each acknowledges the version it
applied through shared memory). The floor is one copy of the same bytes in the learner's process.
shared_mem workers look for a new version every 0.2 ms, as an async collector's do between env
steps; pipe workers block on their pipe. "raw pipe" is the pipe mechanism's own floor: the same
bytes written down one pipe per worker (a thread each, 1 MiB pipe buffers) and read into a
buffer, no weights involved. (``sync=distributed`` beside its engine's floor: the ``scale_out``
category.)
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import time
from multiprocessing.connection import wait

from benchmarks.core import Goal, Row, Stat, Table

NAME, TITLE = "weight_sync", "Weight push"
POLL_S = 0.0002
FLOOR = "memcpy floor"


def scheme_class(name: str):
    from rltrain.sync import DistributedSync, PipeSync, SharedMemSync

    return {"shared_mem": SharedMemSync, "pipe": PipeSync, "distributed": DistributedSync}[name]


def make_net(n_params: int, kind: str = "square"):
    """``square``: four square linear layers plus a normalizer-like buffer, about ``n_params``
    weights; ``many_small``: about ``n_params`` weights in 64x64 layers (hundreds of tensors)."""
    import torch
    from torch import nn

    if kind == "many_small":
        return nn.Sequential(*[nn.Linear(64, 64) for _ in range(max(1, n_params // (64 * 65)))])
    d = max(1, int(math.sqrt(n_params / 4)))
    net = nn.Sequential(*[nn.Linear(d, d) for _ in range(4)])
    net.register_buffer("obs_mean", torch.zeros(d))
    return net


def worker(n_params: int, receiver, ack, index: int, stop, kind: str) -> None:
    import torch

    torch.set_num_threads(1)
    policy = make_net(n_params, kind)
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


def push_times(scheme_name: str, n_params: int, workers: int, repeats: int, kind: str = "square",
               device: str = "cpu") -> list[float]:
    """ms per push until every worker acknowledged it (see ``push_and_held_times``)."""
    return push_and_held_times(scheme_name, n_params, workers, repeats, kind, device)[1]


def push_and_held_times(scheme_name: str, n_params: int, workers: int, repeats: int, kind: str = "square",
                        device: str = "cpu") -> tuple[list[float], list[float]]:
    """ms per push until ``push`` returned to the learner, and until every worker acknowledged it
    (the same pushes: one set of workers to start), ``repeats`` pushes after 2 warm-up ones; the
    learner's weights on ``device``, the workers' on the CPU."""
    import torch

    ctx = mp.get_context("spawn")
    learner = make_net(n_params, kind).to(device)
    scheme = scheme_class(scheme_name)()
    sender = scheme.sender(learner)
    ack = torch.full((workers,), -1, dtype=torch.int64).share_memory_()
    stop = ctx.Event()
    procs = [ctx.Process(target=worker, args=(n_params, scheme.receiver(), ack, i, stop, kind), daemon=True)
             for i in range(workers)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + 120
        while int(ack.min()) < 0:
            if time.monotonic() > deadline or not all(p.is_alive() for p in procs):
                raise RuntimeError(f"{scheme_name}: a worker did not start (exit codes {[p.exitcode for p in procs]})")
            time.sleep(0.01)
        pushed, held = [], []
        for _ in range(repeats + 2):
            with torch.no_grad():
                next(learner.parameters()).add_(1.0)
            t0 = time.perf_counter()
            version = sender.push()
            pushed.append((time.perf_counter() - t0) * 1e3)
            deadline = time.monotonic() + 60
            while int(ack.min()) < version:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{scheme_name}: a worker did not acknowledge version {version} in 60 s")
            held.append((time.perf_counter() - t0) * 1e3)
        return pushed[2:], held[2:]
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        sender.close()


def pipe_reader(conn, nbytes: int, ack, index: int) -> None:
    """The pipe's own floor, receiving side: read ``nbytes`` into one buffer, acknowledge, repeat."""
    import fcntl

    fd = conn.fileno()
    fcntl.fcntl(fd, 1031, 1 << 20)  # F_SETPIPE_SZ: the 1 MiB buffer sync=pipe uses
    buffer = memoryview(bytearray(nbytes))
    count = 0
    while True:
        got = 0
        while got < nbytes:
            n = os.readv(fd, [buffer[got:]])
            if n == 0:
                os._exit(0)
            got += n
        count += 1
        ack[index] = count


def raw_pipe_times(n_params: int, workers: int, repeats: int) -> list[float]:
    """ms to write the snapshot's bytes down one pipe per worker (a thread each, as sync=pipe does)
    until every worker has read them all: the floor of the pipe mechanism itself."""
    import fcntl
    from concurrent.futures import ThreadPoolExecutor

    import torch

    nbytes = 4 * sum(t.numel() for t in make_net(n_params).state_dict().values())
    payload = memoryview(bytearray(os.urandom(1024)) * (nbytes // 1024 + 1))[:nbytes]
    ctx = mp.get_context("spawn")
    ack = torch.zeros(workers, dtype=torch.int64).share_memory_()
    pipes = [ctx.Pipe(duplex=False) for _ in range(workers)]
    procs = [ctx.Process(target=pipe_reader, args=(r, nbytes, ack, i), daemon=True) for i, (r, _) in enumerate(pipes)]
    for p in procs:
        p.start()
    writers = [w.fileno() for _, w in pipes]
    for fd in writers:
        fcntl.fcntl(fd, 1031, 1 << 20)

    def write_all(fd: int) -> None:
        sent = 0
        while sent < nbytes:
            sent += os.write(fd, payload[sent:])

    times = []
    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            for k in range(1, repeats + 3):
                t0 = time.perf_counter()
                list(pool.map(write_all, writers))
                deadline = time.monotonic() + 60
                while int(ack.min()) < k:
                    if time.monotonic() > deadline:
                        raise RuntimeError("a pipe reader did not read the snapshot in 60 s")
                times.append((time.perf_counter() - t0) * 1e3)
    finally:
        for _, w in pipes:
            w.close()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return times[2:]


def _pendulum():
    from torchrl.envs import GymEnv

    return GymEnv("Pendulum-v1")


def torchrl_case(scheme: str, n_params: int, workers: int, repeats: int):
    """TorchRL's push, as its users make one: ``MultiSyncCollector(..., weight_sync_schemes=
    {"policy": scheme})`` and ``collector.update_policy_weights_(weights)`` from a separate learner
    copy (the collector's own policy is shared with its workers, so pushing it would move nothing).
    With the schemes' default ``sync=True`` the call returns once every worker acknowledged that
    its model holds the new weights (weight_update/_shared.py ``send`` -> ``_wait_for_ack``; the
    worker acks after applying them), the same end point as rltrain's pushes here. TorchRL waits
    for acks without a timeout; here each push is bounded at 60 s. The step returns the ms of
    ``repeats`` pushes after 2 warm-up ones; the collector is idle meanwhile."""
    import copy

    import torch
    from tensordict import TensorDict
    from tensordict.nn import TensorDictModule
    from torch import nn
    from torchrl.collectors import MultiSyncCollector
    from torchrl.weight_update import MultiProcessWeightSyncScheme, SharedMemWeightSyncScheme

    net = make_net(n_params)
    policy = TensorDictModule(nn.Sequential(nn.Linear(3, net[0].in_features), *net, nn.Linear(net[-1].out_features, 1)),
                              in_keys=["observation"], out_keys=["action"])
    learner = copy.deepcopy(policy)
    sync = {"shared_mem": SharedMemWeightSyncScheme, "multiprocess": MultiProcessWeightSyncScheme}[scheme]()
    collector = MultiSyncCollector([_pendulum] * workers, policy, frames_per_batch=8 * workers, total_frames=-1,
                                   weight_sync_schemes={"policy": sync})
    wait_for_ack = sync._wait_for_ack
    sync._wait_for_ack = lambda worker_ids=None, timeout=None: wait_for_ack(worker_ids=worker_ids, timeout=60.0)
    batches = iter(collector)
    next(batches)  # the workers are up

    def step() -> list[float]:
        weights, times = TensorDict.from_module(learner), []
        for _ in range(repeats + 2):
            with torch.no_grad():
                next(learner.parameters()).add_(1.0)
            t0 = time.perf_counter()
            collector.update_policy_weights_(weights)
            times.append((time.perf_counter() - t0) * 1e3)
        return times[2:]

    step.close = lambda: collector.shutdown(timeout=20, raise_on_error=False)
    return step


def memcpy_times(n_params: int, repeats: int) -> list[float]:
    import torch

    n = sum(t.numel() for t in make_net(n_params).state_dict().values())
    src, dst = torch.randn(n), torch.empty(n)
    times = []
    for _ in range(repeats + 2):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append((time.perf_counter() - t0) * 1e3)
    return times[2:]


def run(ctx) -> list[Table]:
    import torch

    torch.set_num_threads(ctx.threads)
    # A quick run starts one worker per scheme: each worker imports torch, the most a busy box slows.
    sizes, workers, repeats = (["1M"], [1], 5) if ctx.quick else (["1M", "10M", "50M"], [2, 4], 15)
    peers = {"torchrl SharedMem": "shared_mem", "torchrl MultiProcess": "multiprocess"} if ctx.peer("torchrl") else {}
    table = Table(f"{TITLE} until every worker holds the new version: ms, median [p10-p90] of {repeats}",
                  [FLOOR, "shared_mem", "pipe", "raw pipe", *peers], ratio_to=FLOOR, ratio_header="{peer} / floor",
                  ratio_mode="over", notes=ctx.peer_notes("torchrl"))
    for text in sizes:
        n = parse_count(text)
        floor = Stat(memcpy_times(n, repeats))
        for w in workers:
            cells = {FLOOR: floor}
            for scheme in ("shared_mem", "pipe"):
                cells[scheme] = Stat(push_times(scheme, n, w, repeats))
            cells["raw pipe"] = Stat(raw_pipe_times(n, w, repeats))
            for column, scheme in peers.items():  # TorchRL's collector and schemes, where torchrl runs
                times = ctx.outputs({"torchrl": ("benchmarks.weight_sync:torchrl_case",
                                                 {"scheme": scheme, "n_params": n, "workers": w,
                                                  "repeats": repeats})}, notes=table.notes)
                cells[column] = Stat(times["torchrl"]) if times.get("torchrl") else None
            if n >= 10_000_000:  # large pushes are bounded by the copy; small ones by a fixed cost
                target, shared_mem = "shared_mem <= 1.5x, pipe <= 3x", Goal("shared_mem", at_most=1.5)
            else:
                target, shared_mem = "shared_mem <= 1 ms, pipe <= 3x", Goal("shared_mem", at_most=1, median=True)
            table.rows.append(Row(f"{text} params, {w} worker{'s' * (w > 1)}", cells, target=target,
                                  goals=(shared_mem, Goal("pipe", at_most=3))))
    return [table]
