"""Weight push into a vLLM engine (``engine=vllm``, ``sync=vllm``): the time until the engine holds a new
version of the learner's weights, beside the same bytes with no vLLM, one call per tensor, a file, and the
same push into a vLLM server the user runs (``engine=vllm_server engine.url=...``); and vLLM's generation,
in rltrain's engine and in that server, beside ``TransformersEngine``.

Models: Qwen2 models written by ``rltrain.llm.tiny.write_tiny_model`` (random weights, 32-wide heads)
at each size of SIZES, into a temporary dir under /tmp, float32; the learner is that dir loaded with
transformers (``LanguageModel.load``), one torch thread (``--threads``). Before every timed push the
learner's first parameter gets 1e-3 added, so every method moves new weights. Rounds alternate
between the methods (rltrain, floor, per tensor, file, server, gloo, in that order); a warm-up round first,
discarded; ms per push, median [p10-p90] of ROUNDS rounds. Each method counts from the learner's
first step until the engine has answered that it holds the new weights:

- ``rltrain``: ``sender.push()`` (``VLLMSlotsSync``: one copy into a free shared-memory slot) then
  ``VLLMEngine.sync()``, whose answer comes once the engine's receiver has loaded the slot into vLLM
  (``VLLMModel.load``: vLLM's in-place layerwise reload, the embedding's CPU GEMM repack, the
  prefix-cache reset). The engine process is rltrain's own, as ``engine=vllm`` starts it.
- ``floor``: the same push into the same slots, and a spawned process with no vLLM (one torch thread,
  as vLLM serves with here) that holds a receiver of the same scheme, answers ``("sync",)`` on its
  pipe as the engine does, and loads the slot by copying every tensor into tensors of its own.
- ``per tensor`` (TRL's server mode: one ``update_named_param`` request per parameter): for each
  parameter, a header then its bytes down a multiprocessing pipe (``send_bytes``: the bytes, not a
  shared-memory handle), and the engine process (vLLM as rltrain's, started by ``peer_engine_main``)
  loads that one tensor (initialize_layerwise_reload / load_weights / finalize_layerwise_reload, as
  ``VLLMModel.load`` does for all of them: its check that every vLLM weight was loaded refuses one
  tensor) and acknowledges it before the next is sent; then one message for the embedding repack and
  the prefix-cache reset that ``VLLMModel.load`` does once.
- ``file`` (TorchRL's double-buffer scheme): ``safetensors.torch.save_file`` of every weight to a file
  in /dev/shm (two files, used in turn), then one message asks the same engine process to
  ``load_file`` it and ``VLLMModel.load`` the dict.
- ``server``: the same push into the same slots, then ``VLLMServer.sync()`` (``rltrain.llm.vllm.server``)
  into vLLM's OpenAI-compatible server, started for each size as docs/vllm.md's "A vLLM server of your
  own" says (``python -m vllm.entrypoints.openai.api_server`` on the model dir, ``VLLM_SERVER_DEV_MODE=1``,
  rltrain's worker extension, ``--logprobs-mode processed_logprobs --dtype float32 --enforce-eager``,
  ``VLLM_CPU_KVCACHE_SPACE=1``) on 127.0.0.1 at a free port, in its own session, and stopped at the end
  (SIGTERM to its process group, SIGKILL to what is left after 60 s). Its receiver is in the learner:
  sync() makes four HTTP requests in turn, each answered before the next: ``/pause?mode=wait``,
  ``/collective_rpc`` ``rltrain_load`` (the server's worker maps the slot through
  ``/proc/<learner pid>/fd/<fd>`` and ``VLLMModel.load``s it), ``/reset_prefix_cache``, ``/resume``; it
  returns the version once ``/resume`` has answered. The server table times each request in the
  learner, and the learner's ``sender.push()`` before them.
- ``gloo`` (``sync=vllm_transfer sync.backend=gloo``): ``sender.push()`` of a
  ``VLLMTransferSync(backend="gloo")`` sender into a second rltrain engine started with it (connected to
  ``transfer_client()`` as build does): vLLM's transfer calls over the engine's pipe while the learner
  copies its weights into one host buffer and broadcasts it over a loopback gloo group; the engine
  receives it into one buffer and ``VLLMModel.load``s it, then resets its prefix cache. ``push()``
  returns once the engine has answered ``finish_weight_update``.

After the timed rounds each method loads one more version and the engine's log-probs of a fixed
sequence are compared with the learner's (transformers) under those weights: ``max |dlogp|`` (the
server's: ``VLLMServer.probe``, prompt log-probs through ``/v1/completions``).
The profile table times ``VLLMModel.load``'s steps in the per-tensor/file engine process (the same
vLLM, the same model), loading each round's pushed slot through a ``sync=vllm`` receiver as
rltrain's engine does, with the steps wrapped by timers: initialize, load_weights (vLLM repacks each
linear layer for oneDNN as soon as all its weights arrived: "GEMM repack"), finalize, rltrain's extra
embedding repack, reset_prefix_cache.

Generation: ``VLLMEngine.generate``, ``VLLMServer.generate`` (a server started as above on the same
model: one ``/v1/completions`` request per prompt, all in flight together) and
``TransformersEngine.generate`` on the tiny model (``tiny_model_dir``), 16 prompts x 8 completions,
temperature 1, top_p 1, max_new_tokens 16, seed 0 every call, alternating rounds (in that order) after
a warm-up one; generated tokens (``completion_mask``) per second.

``--quick``: only the smallest size, 2 rounds. A full run takes several minutes (a vLLM start per
engine and server, the largest model's writes and loads): the category runs only when named.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from benchmarks.core import OURS, ROOT, Goal, Row, Stat, Table
from rltrain.child_process import ChildProcess, die_with_parent, next_request
from rltrain.errors import RunError, send_failure

NAME, TITLE = "vllm_push", "Weight push into vLLM"
SIZES = [(128, 12), (640, 21), (1280, 20)]  # (hidden size, layers): about 1.8M, 77M and 296M parameters
ROUNDS, QUICK_ROUNDS = 5, 2
FLOOR, PER_TENSOR, FILE, SERVER, GLOO = "floor", "per tensor", "file", "server", "gloo"
KV_CACHE_GB = 1
TIMEOUT_S = 600.0
STOP_S = 60.0  # how long a server's process group has after SIGTERM before SIGKILL
MEMORY_FACTOR = 20  # bytes of RAM per byte of weights the methods hold at once (slots, engines, server, files, gloo)
PROMPTS, GROUP, MAX_NEW_TOKENS = 16, 8, 16
ADAPTERS, MERGED, LORA_RANK = "adapters", "merged", 16  # a LoRA learner's pushes (sync.adapters=true|false)
SERVER_STEPS = ["/pause", "rltrain_load", "/reset_prefix_cache", "/resume"]  # VLLMServer's calls in a push
FLOOR_PROCESS, PEER_PROCESS = "the floor's process", "the per-tensor/file engine"
STEPS = ["initialize", "load_weights", "GEMM repack", "finalize", "embedding repack", "reset_prefix_cache", "other"]


# --- the engine processes -------------------------------------------------------------------------------------------

def _serve(conn, who: str, setup, handlers: dict) -> None:
    """A spawned process's loop, as rltrain's engine's: ``setup()`` then ``("ready",)``, then each request
    to its handler, which answers; a failure goes back as rltrain's ``("error", what, traceback)``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the learner closes it
    die_with_parent()
    code = 0
    try:
        state = setup()
        conn.send(("ready",))
        while (msg := next_request(conn)) is not None:
            handlers[msg[0]](conn, state, *msg[1:])
    except BaseException as e:  # noqa: BLE001  everything goes back to the learner
        send_failure(conn, who, e)
        code = 1
    os._exit(code)  # vLLM's teardown may wait on its threads


class CopyModel:
    """What the floor's receiver loads a slot into: tensors of its own, one ``copy_`` per weight; it tells the
    learner which version it loads first, as rltrain's engine does."""

    def __init__(self, conn):
        self.conn, self.tensors = conn, {}

    def load(self, weights: dict) -> None:
        import torch

        if not self.tensors:
            self.tensors = {name: torch.empty_like(t) for name, t in weights.items()}
        for name, t in weights.items():
            self.tensors[name].copy_(t)

    def load_slot(self, slot, version: int) -> None:
        self.conn.send(("doing", f"loading weights version {version}"))
        self.load(slot.views)


def floor_main(conn, receiver) -> None:
    """The floor's process: ``engine_main``'s sync path with a CopyModel where vLLM would be."""

    def setup():
        import torch

        torch.set_num_threads(1)
        receiver.connect(CopyModel(conn))
        return receiver

    def sync(conn, receiver):
        receiver.poll()
        conn.send(("synced", receiver.version))

    _serve(conn, FLOOR_PROCESS, setup, {"sync": sync})


class TimedModel:
    """``VLLMModel.load`` with its steps timed: the functions it calls are wrapped while it runs."""

    def __init__(self, model):
        self.model = model
        self.times: dict[str, float] = {}

    def load(self, weights: dict) -> None:
        import vllm.model_executor.layers.utils as layer_utils
        import vllm.model_executor.model_loader.reload.layerwise as layerwise
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

        times, phase = defaultdict(float), [None]

        def timed(step: str, fn):
            def wrapper(*args, **kwargs):
                inner = phase[0] is not None  # a repack inside load_weights or finalize counts as a repack
                if not inner:
                    phase[0] = step
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    seconds = time.perf_counter() - t0
                    if not inner:
                        times[step] += seconds
                        phase[0] = None
                    elif step == "GEMM repack":
                        times[step] += seconds
                        times[phase[0]] -= seconds  # the outer step's own time leaves its repacks out
            return wrapper

        patches = [(layerwise, "initialize_layerwise_reload", "initialize"),
                   (layerwise, "finalize_layerwise_reload", "finalize"),
                   (layer_utils, "dispatch_cpu_unquantized_gemm", "GEMM repack"),
                   (UnquantizedEmbeddingMethod, "process_weights_after_loading", "embedding repack"),
                   (self.model.model, "load_weights", "load_weights"),
                   (self.model, "reset_prefix_cache", "reset_prefix_cache")]
        saved = [(owner, attr, owner.__dict__.get(attr)) for owner, attr, _ in patches]
        for owner, attr, step in patches:
            setattr(owner, attr, timed(step, getattr(owner, attr)))
        t0 = time.perf_counter()
        try:
            self.model.load(weights)
        finally:
            total = time.perf_counter() - t0
            for owner, attr, original in saved:
                if original is None:
                    delattr(owner, attr)  # an instance's attribute wrapped its class's method
                else:
                    setattr(owner, attr, original)
        times["other"] = total - sum(times.values())
        self.times = {"total": total, **times}

    def load_slot(self, slot, version: int) -> None:
        self.load(slot.views)


def _start_vllm(source: str):
    """vLLM's ``LLM`` in this process, as ``rltrain.llm.vllm.engine.engine_main`` starts it."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{KV_CACHE_GB:g}"
    mp.set_start_method("fork", force=True)
    from vllm import LLM

    return LLM(model=source, dtype="float32", enforce_eager=True, seed=0, logprobs_mode="processed_logprobs")


def load_one(model, name: str, tensor) -> None:
    """One tensor into vLLM's model, as a per-parameter update does: vLLM's in-place reload for it alone."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    initialize_layerwise_reload(model.model)
    try:
        model.model.load_weights(iter([(name, tensor)]))
    finally:
        finalize_layerwise_reload(model.model, model.model_config)


def repack_and_reset(model) -> None:
    """What ``VLLMModel.load`` does once after the weights: the embedding's GEMM repack, the prefix-cache reset."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    for module in model.model.modules():
        if isinstance(getattr(module, "quant_method", None), UnquantizedEmbeddingMethod):
            module.quant_method.process_weights_after_loading(module)
    model.reset_prefix_cache()


def probe_logprobs(llm, ids: list[int]) -> list[float]:
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0),
                       use_tqdm=False)[0]
    return [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], ids[1:])]


def peer_engine_main(conn, source: str, receiver) -> None:
    """The per-tensor and file methods' engine: vLLM as rltrain's engine runs it, fed one tensor per
    message, or a file per message; and a ``sync=vllm`` receiver whose loads are timed step by step."""

    def setup():
        import torch

        from rltrain.llm.vllm.loading import VLLMModel

        llm = _start_vllm(source)
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        model = VLLMModel(runner.get_model(), runner.model_config, llm.reset_prefix_cache)
        timed = TimedModel(model)
        receiver.connect(timed)
        return {"llm": llm, "model": model, "timed": timed, "receiver": receiver, "torch": torch}

    def tensor(conn, state, name, shape, dtype, nbytes):
        torch = state["torch"]
        buffer = bytearray(nbytes)
        conn.recv_bytes_into(buffer)
        load_one(state["model"], name, torch.frombuffer(buffer, dtype=dtype).view(shape))
        conn.send(("loaded",))

    def tensors_done(conn, state):
        repack_and_reset(state["model"])
        conn.send(("loaded",))

    def file(conn, state, path):
        from safetensors.torch import load_file

        state["model"].load(load_file(path))
        conn.send(("loaded",))

    def profile(conn, state):
        state["receiver"].poll()
        conn.send(("profiled", state["timed"].times))

    def probe(conn, state, ids):
        conn.send(("probed", probe_logprobs(state["llm"], ids)))

    _serve(conn, PEER_PROCESS, setup, {"tensor": tensor, "tensors_done": tensors_done, "file": file, "profile": profile,
                         "probe": probe})


class ProcessFailed(RunError):
    """A benchmark process failed: its traceback is in the message, which is what a failed category shows."""

    def __init__(self, message: str, details: str | None = None):
        super().__init__(message if details is None else f"{message}\n{details}", details)


def spawned(target, args: tuple, who: str) -> ChildProcess:
    """``target(conn, *args)`` (a ``_serve`` loop) in a spawned process with one OpenMP thread, as
    VLLMEngine starts its (``engine.threads``), once it is ready."""
    child = ChildProcess(target, args, who, environment={"OMP_NUM_THREADS": "1"}, error=ProcessFailed)
    try:
        child.wait_for("ready", TIMEOUT_S)
    except BaseException:
        child.close()
        raise
    return child


def request(child: ChildProcess, msg: tuple, answer: str) -> tuple:
    child.send(msg, f"answering {msg[0]!r}")
    return child.wait_for(answer, TIMEOUT_S)


class Server:
    """A vLLM OpenAI-compatible server on ``source``, started as docs/vllm.md's "A vLLM server of your
    own" says (dev mode, rltrain's worker extension, 127.0.0.1 and a free port), in its own session;
    ``close`` stops its whole process group: SIGTERM, then SIGKILL what is left after STOP_S."""

    def __init__(self, source: str, log: Path):
        from rltrain.llm.vllm.server import server_command

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url, self.log = f"http://127.0.0.1:{port}", log
        env, argv = server_command(source, port)  # docs/vllm.md's command
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, *argv[1:]], env={**os.environ, **env, "VLLM_CPU_KVCACHE_SPACE": f"{KV_CACHE_GB:g}"},
                cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_healthy(self, timeout_s: float = TIMEOUT_S) -> str:
        from rltrain.llm.vllm.server import ServerError, call

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                call(self.url, "/health", timeout=2)
                return self.url
            except ServerError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                state = f"did not answer within {timeout_s:g} s" if self.proc.poll() is None else \
                    f"exited ({self.proc.returncode})"
                raise RuntimeError(f"the vLLM server {state}: {self.log.read_text()[-3000:]}")
            time.sleep(1.0)

    def close(self) -> None:
        group = self.proc.pid
        for sig, grace_s in ((signal.SIGTERM, STOP_S), (signal.SIGKILL, 10.0)):
            deadline = time.monotonic() + grace_s
            try:
                os.killpg(group, sig)
                while time.monotonic() < deadline:
                    self.proc.poll()  # reaps the server's first process once it exits
                    os.killpg(group, 0)  # ProcessLookupError once no process is left in the group
                    time.sleep(0.2)
            except ProcessLookupError:
                self.proc.poll()
                return
        print(f"vllm_push: the vLLM server's process group {group} outlived SIGKILL", file=sys.stderr)


# --- the learner's side ---------------------------------------------------------------------------------------------

def learner_logprobs(learner, ids: list[int]) -> list[float]:
    import torch

    with torch.no_grad():
        logits = learner(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1).tolist()


def send_per_tensor(peer: ChildProcess, weights: dict) -> None:
    import torch

    for name, t in weights.items():
        t = t.contiguous()
        peer.send(("tensor", name, tuple(t.shape), t.dtype, t.numel() * t.element_size()), f"loading {name}")
        peer.conn.send_bytes(t.view(-1).view(torch.uint8).numpy())
        peer.wait_for("loaded", TIMEOUT_S)
    request(peer, ("tensors_done",), "loaded")


def memory_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def push_tables(ctx, sizes: list[tuple[int, int]], rounds: int) -> list[Table]:
    import torch
    from safetensors.torch import save_file

    from rltrain.llm.model import LanguageModel
    from rltrain.llm.tiny import write_tiny_model
    from rltrain.llm.vllm.engine import VLLMEngine
    from rltrain.llm.vllm.loading import served_weights
    from rltrain.llm.vllm.server import VLLMServer
    from rltrain.llm.vllm.slots import VLLMSlotsSync
    from rltrain.llm.vllm.transfer import VLLMTransferSync

    torch.set_num_threads(ctx.threads)
    judge = not ctx.quick
    floor_table = Table(f"{TITLE}: ms until the engine holds the new version, median [p10-p90] of {rounds} rounds, "
                        f"each method's over the floor's", [FLOOR, OURS, PER_TENSOR, FILE, SERVER, GLOO],
                        ratio_to=FLOOR,
                        ratio_header="{peer} / floor", ratio_mode="over")
    wins_table = Table(f"{TITLE}: how many times faster rltrain's push is than one call per tensor and a file",
                       [OURS, PER_TENSOR, FILE])
    profile_table = Table(f"{TITLE}: where VLLMModel.load's time goes (the per-tensor/file engine loading each "
                          "round's pushed slot through a sync=vllm receiver, its steps timed): ms, median [p10-p90]",
                          ["total", *STEPS], ratio_to=None)
    server_table = Table(f"{TITLE}: where the server's push goes (the learner's push, then VLLMServer.sync's HTTP "
                         "calls, each timed in the learner until answered): ms, median [p10-p90]",
                         ["total", "push (learner)", *SERVER_STEPS, "other"], ratio_to=None)
    methods = [OURS, FLOOR, PER_TENSOR, FILE, SERVER, GLOO]
    for hidden, layers in sizes:
        with tempfile.TemporaryDirectory(prefix="rltrain-vllm-push-") as tmp, \
                tempfile.TemporaryDirectory(prefix="rltrain-vllm-push-", dir="/dev/shm") as shm:
            source = str(write_tiny_model(Path(tmp) / "model", hidden_size=hidden, layers=layers))
            model = LanguageModel(source)
            learner = model.load()
            weights = served_weights(learner)
            n_params = sum(t.numel() for t in weights.values())
            nbytes = sum(t.numel() * t.element_size() for t in weights.values())
            label = f"{n_params / 1e6:.1f}M params ({hidden} x {layers} layers, {len(weights)} tensors)"
            if memory_available() < MEMORY_FACTOR * nbytes:
                for table in (floor_table, wins_table):
                    table.notes.append(f"{label}: skipped, {memory_available() / 2**30:.1f} GiB available "
                                       f"< {MEMORY_FACTOR} x the weights' {nbytes / 2**30:.2f} GiB")
                continue
            scheme, through_gloo = VLLMSlotsSync(), VLLMTransferSync(backend="gloo")
            sender, gloo_sender = scheme.sender(learner), through_gloo.sender(learner)
            engine = floor = peer = server = served = gloo = None
            try:
                server = Server(source, Path(tmp) / "server.log")  # it starts while the engines below do
                engine = VLLMEngine(model, scheme.receiver(), timeout_s=TIMEOUT_S)
                gloo = VLLMEngine(model, through_gloo.receiver(), timeout_s=TIMEOUT_S)
                gloo_sender.connect(gloo.transfer_client())  # as build does: it also pushes the current weights
                receiver = scheme.receiver()
                floor = spawned(floor_main, (receiver,), FLOOR_PROCESS)
                receiver.after_spawn()
                receiver = scheme.receiver()
                peer = spawned(peer_engine_main, (source, receiver), PEER_PROCESS)
                receiver.after_spawn()
                files = [os.path.join(shm, f"weights-{i}.safetensors") for i in range(2)]
                served = VLLMServer(model, scheme.receiver(), url=server.wait_healthy(), timeout_s=TIMEOUT_S)
                calls = defaultdict(float)  # the server's push, step by step

                def timed_post(path: str, doing: str, body: dict | None = None):
                    # every HTTP call of VLLMServer goes through post; an rpc is named by its method
                    t0 = time.perf_counter()
                    try:
                        return post(path, doing, body)
                    finally:
                        step = body["method"] if path == "/collective_rpc" else path.split("?")[0]
                        calls[step] += time.perf_counter() - t0

                post, served.post = served.post, timed_post

                def step(method: str) -> None:
                    if method == OURS:
                        version = sender.push()
                        if engine.sync() != version:
                            raise RuntimeError(f"the engine holds version {engine.version}, not {version}")
                    elif method == FLOOR:
                        version = sender.push()
                        if request(floor, ("sync",), "synced")[1] != version:
                            raise RuntimeError(f"the floor's process did not load version {version}")
                    elif method == SERVER:
                        calls.clear()
                        t0 = time.perf_counter()
                        version = sender.push()
                        calls["push (learner)"] = time.perf_counter() - t0
                        if served.sync() != version:
                            raise RuntimeError(f"the server holds version {served.version}, not {version}")
                    elif method == GLOO:
                        version = gloo_sender.push()
                        if gloo.version != version:
                            raise RuntimeError(f"the gloo engine holds version {gloo.version}, not {version}")
                    elif method == PER_TENSOR:
                        send_per_tensor(peer, weights)
                    else:
                        files.reverse()  # TorchRL's double buffer: the file not written last time
                        save_file({name: t.contiguous() for name, t in weights.items()}, files[0])
                        request(peer, ("file", files[0]), "loaded")

                samples = {m: [] for m in methods}
                steps, server_steps = defaultdict(list), defaultdict(list)
                first = next(iter(weights.values()))
                for round_ in range(1 + rounds):  # a warm-up round, then rounds alternating between methods
                    for method in methods:
                        with torch.no_grad():
                            first.add_(1e-3)
                        t0 = time.perf_counter()
                        step(method)
                        if round_:
                            samples[method].append((time.perf_counter() - t0) * 1e3)
                        if round_ and method == SERVER:
                            server_steps["total"].append(samples[method][-1])
                            server_steps["other"].append(samples[method][-1] - sum(calls.values()) * 1e3)
                            for key, seconds in calls.items():
                                server_steps[key].append(seconds * 1e3)
                    with torch.no_grad():
                        first.add_(1e-3)
                    t0 = time.perf_counter()
                    sender.push()
                    pushed = time.perf_counter() - t0
                    times = request(peer, ("profile",), "profiled")[1]
                    if round_:
                        steps["push (learner)"].append(pushed * 1e3)
                        for key, seconds in times.items():
                            steps[key].append(seconds * 1e3)
                # each method's result against the learner's own log-probs, under one more version
                ids = model.tokenizer()("reverse 123: 321 and sort 93: 39", add_special_tokens=False)["input_ids"]
                with torch.no_grad():
                    first.add_(1e-3)
                expected = torch.tensor(learner_logprobs(learner, ids))
                error = {}
                step(OURS)
                error[OURS] = (engine.probe(ids)[0] - expected).abs().max().item()
                step(SERVER)
                error[SERVER] = (served.probe(ids)[0] - expected).abs().max().item()
                step(GLOO)
                error[GLOO] = (gloo.probe(ids)[0] - expected).abs().max().item()
                for method in (PER_TENSOR, FILE):
                    step(method)
                    got = torch.tensor(request(peer, ("probe", ids), "probed")[1])
                    error[method] = (got - expected).abs().max().item()
            finally:
                try:
                    for process in (served, engine, gloo, floor, peer):
                        if process is not None:
                            process.close()
                finally:
                    if server is not None:
                        server.close()
                    sender.close()
                    gloo_sender.close()
            cells = {m: Stat(samples[m]) for m in methods}
            extra = {f"{m} max |dlogp|": f"{error[m]:.2g}" for m in (OURS, PER_TENSOR, FILE, SERVER, GLOO)}
            floor_table.rows.append(Row(label, dict(cells), target="" if not judge else "rltrain <= 1.3x floor",
                                        goals=(Goal(OURS, at_most=1.3),) if judge else (), extra=extra))
            wins_table.rows.append(Row(label, {m: cells[m] for m in (OURS, PER_TENSOR, FILE)},
                                       target="" if not judge else ">= 5x both",
                                       goals=(Goal(PER_TENSOR, at_least=5), Goal(FILE, at_least=5)) if judge else ()))
            profile_table.rows.append(Row(label, {k: Stat(steps[k]) for k in ["total", *STEPS] if steps.get(k)},
                                          extra={"push (learner)": Stat(steps["push (learner)"]).format(),
                                                 "weights MB": f"{nbytes / 1e6:.1f}"}))
            server_table.rows.append(Row(label, {k: Stat(v) for k, v in server_steps.items()}))
    floor_table.notes += [
        "floor: the same push into the same shared-memory slots, loaded by a process with no vLLM (a copy_ per "
        "tensor); per tensor: a pipe message and an acknowledged vLLM reload per parameter; file: safetensors in "
        "/dev/shm, loaded by one message; server: the same push, loaded by a vLLM server the benchmark starts as a "
        "user would, through VLLMServer.sync; gloo: sync=vllm_transfer sync.backend=gloo into a second rltrain "
        "engine, vLLM's transfer API (see the module docstring)",
        "max |dlogp|: the engine's log-probs of a fixed sequence against the learner's, after one more load"]
    server_table.notes.append("/pause, /reset_prefix_cache, /resume: the server's endpoints; rltrain_load: the "
                              "worker extension's, through /collective_rpc (VLLMModel.load of the slot it maps via "
                              "/proc); other: the rest of sync() (the receiver's poll)")
    return [floor_table, wins_table, profile_table, server_table]


def generation_table(ctx, rounds: int) -> Table:
    import torch

    from rltrain.llm.engine import Sampling, TransformersEngine
    from rltrain.llm.model import LanguageModel
    from rltrain.llm.tasks import ReverseDigits
    from rltrain.llm.tiny import tiny_model_dir
    from rltrain.llm.vllm.engine import VLLMEngine
    from rltrain.llm.vllm.server import VLLMServer
    from rltrain.llm.vllm.slots import VLLMSlotsSync

    torch.set_num_threads(ctx.threads)
    model = LanguageModel(str(tiny_model_dir()))
    learner = model.load()
    tok = model.tokenizer()
    local = TransformersEngine(learner, tok)
    prompts = [r["prompt"] for r in ReverseDigits(length=1, seed=0).take(PROMPTS)]
    sampling = Sampling(1.0, 1.0, MAX_NEW_TOKENS)
    columns = ["vllm", SERVER, "transformers"]
    table = Table(f"Generation: {PROMPTS} prompts x {GROUP} completions of the tiny model, sampled (temperature 1, "
                  f"top_p 1, max_new_tokens {MAX_NEW_TOKENS}, seed 0 every call), CPU: generated tokens/s, "
                  f"median [p10-p90] of {rounds} rounds", columns, ratio_to="vllm")
    table.notes.append(f"vllm: VLLMEngine.generate (vLLM {_vllm_version()} in its own process, 1 torch thread); "
                       "server: VLLMServer.generate (the same vLLM as an OpenAI-compatible server, started as "
                       "docs/vllm.md says: one /v1/completions request per prompt, all in flight together); "
                       f"transformers: TransformersEngine.generate in this process, {ctx.threads} torch thread(s)")
    scheme = VLLMSlotsSync()
    sender = scheme.sender(learner)
    samples, ms = {c: [] for c in columns}, {c: [] for c in columns}
    engine = served = None
    with tempfile.TemporaryDirectory(prefix="rltrain-vllm-push-") as tmp:
        server = Server(str(model.source()), Path(tmp) / "server.log")  # it starts while the engine does
        try:
            engine = VLLMEngine(model, scheme.receiver(), timeout_s=TIMEOUT_S)
            served = VLLMServer(model, scheme.receiver(), url=server.wait_healthy(), timeout_s=TIMEOUT_S)
            for round_ in range(1 + rounds):
                for column, eng in zip(columns, (engine, served, local)):
                    t0 = time.perf_counter()
                    tokens = int(eng.generate(prompts, GROUP, sampling, seed=0).completion_mask.sum())
                    seconds = time.perf_counter() - t0
                    if round_:
                        samples[column].append(tokens / seconds)
                        ms[column].append(seconds * 1e3)
        finally:
            try:
                for process in (served, engine):
                    if process is not None:
                        process.close()
            finally:
                server.close()
                sender.close()
    row = Row(f"max_new_tokens {MAX_NEW_TOKENS}", {c: Stat(v, "tokens/s", True) for c, v in samples.items()})
    for c in columns:
        row.extra[f"{c} ms per call"] = f"{statistics.median(ms[c]):.1f}"
    table.rows.append(row)
    return table


def adapter_table(ctx, sizes: list[tuple[int, int]], rounds: int) -> Table:
    """A LoRA learner's push (rank LORA_RANK on every linear layer), its adapters alone beside the merged weights:
    two rltrain engines on the same base model, one per ``sync.adapters``, rounds alternating; ms from
    ``sender.push()`` until ``VLLMEngine.sync()`` answers, the bytes each push copies, and after the rounds the
    largest log-prob difference between each engine and the learner (peft) on a fixed sequence."""
    import torch

    from rltrain.llm.model import LanguageModel
    from rltrain.llm.tiny import write_tiny_model
    from rltrain.llm.vllm.engine import VLLMEngine
    from rltrain.llm.vllm.slots import VLLMSlotsSync

    torch.set_num_threads(ctx.threads)
    columns = [ADAPTERS, MERGED]
    table = Table(f"{TITLE}, a LoRA learner (rank {LORA_RANK}, every linear layer): ms until the engine holds the "
                  f"new version, median [p10-p90] of {rounds} rounds", columns, ratio_to=ADAPTERS,
                  ratio_header="x vs {peer}")
    table.notes.append("adapters: sync.adapters=true (the default), the engine saves each version as peft's files and "
                       "vLLM applies it on the base model (add_lora, the previous version removed); merged: "
                       "sync.adapters=false, the merged weights reloaded in place as for a full fine-tune")
    for hidden, layers in sizes:
        with tempfile.TemporaryDirectory(prefix="rltrain-vllm-lora-") as tmp:
            model = LanguageModel(str(write_tiny_model(Path(tmp) / "model", hidden_size=hidden, layers=layers)),
                                  lora_rank=LORA_RANK)
            learner = model.load()
            lora_b = [p for name, p in learner.named_parameters() if "lora_B" in name]
            schemes = {ADAPTERS: VLLMSlotsSync(), MERGED: VLLMSlotsSync(adapters=False)}
            senders = {c: scheme.sender(learner) for c, scheme in schemes.items()}
            engines = {}
            samples = {c: [] for c in columns}
            try:
                for c, scheme in schemes.items():
                    engines[c] = VLLMEngine(model, scheme.receiver(), timeout_s=TIMEOUT_S)
                for round_ in range(1 + rounds):
                    for c in columns:
                        with torch.no_grad():
                            lora_b[0].add_(1e-3)
                        t0 = time.perf_counter()
                        senders[c].push()
                        engines[c].sync()
                        if round_:
                            samples[c].append((time.perf_counter() - t0) * 1e3)
                ids = list(range(3, 40))
                learned = torch.tensor(learner_logprobs(learner, ids))
                error = {c: float((engines[c].probe(ids)[0] - learned).abs().max()) for c in columns}
            finally:
                for c in list(engines):
                    engines[c].close()
                for sender in senders.values():
                    sender.close()
            moved = {c: sum(t.nbytes for t in schemes[c].weights_of(learner).values()) for c in columns}
        params = sum(p.numel() for name, p in learner.named_parameters() if "lora_" not in name)
        label = f"{params / 1e6:.1f}M (hidden {hidden}, {layers} layers)"
        row = Row(f"{label}: ms", {c: Stat(v, "ms") for c, v in samples.items()})
        row.extra["max |dlogp| adapters / merged"] = f"{error[ADAPTERS]:.1e} / {error[MERGED]:.1e}"
        table.rows.append(row)
        wide = hidden >= 40 * LORA_RANK  # a layer's adapters: 2 x rank / width of its bytes (1/20 at 640 wide)
        table.rows.append(Row(f"{label}: MB per push", {c: Stat([moved[c] / 1e6], "MB") for c in columns},
                              target="adapters: 1/20 of the bytes or fewer" if wide else "",
                              goals=(Goal(MERGED, at_least=20),) if wide else ()))
    table.notes.append(f"a square layer's adapters hold 2 x rank / width of its bytes: 1/4 at 128 wide, 1/20 at 640 "
                       f"(rank {LORA_RANK}); the bytes target is for the layers of 640 and wider")
    return table


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "?"


def run(ctx) -> list[Table]:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError("vLLM is not installed here (pip install 'rltrain[vllm]'; on a CPU box, vLLM's CPU build)")
    shm_before = set(os.listdir("/dev/shm"))
    sizes, rounds = (SIZES[:1], QUICK_ROUNDS) if ctx.quick else (SIZES, ROUNDS)
    tables = push_tables(ctx, sizes, rounds)
    tables.append(adapter_table(ctx, sizes[:2], rounds))
    tables.append(generation_table(ctx, rounds))
    left = sorted(set(os.listdir("/dev/shm")) - shm_before)
    shm = f"left behind: {', '.join(left)}" if left else "nothing new"
    tables[0].notes.append(f"/dev/shm after the category: {shm}")
    return tables
