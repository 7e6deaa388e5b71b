"""``collector.engine=vllm``: a vLLM engine, in a process of its own, generating for the collector.

rltrain spawns one process that runs vLLM's ``LLM`` inside it (``VLLM_ENABLE_V1_MULTIPROCESSING=0``:
no process of vLLM's own) on the run's model, and holds the ``sync=vllm`` receiver there. Requests
come one at a time over a pipe, and before each generation the receiver loads the newest pushed
weights into vLLM's model: a generation never sees two versions, and each completion carries the
version it was generated with. With ``sync.transport`` other than ``shared_mem`` the learner pushes
instead, through vLLM's weight-transfer calls, which the engine makes in its turn, between batches
(``EngineClient``).

Every wait of the learner on the engine is bounded (``collector.timeout_s``) and watches the
process: an engine that raises comes back as a CollectorError with its traceback, one that dies as
a CollectorError naming it, its pid, its exit signal and what it was doing.

Messages, learner -> engine: ``("generate", reserved, prompt_ids, group_size, sampling, seed)`` (``reserved``:
the weights version the learner pinned for it, ``_VLLMReceiver.reserve``),
``("probe", ids)`` (the log-probs of a token sequence under the weights it holds), ``("sync",)``
(load the newest weights now), ``("transfer", method, arg)`` (one of vLLM's weight-transfer calls),
``("close",)``. Engine -> learner: ``("ready", version)``, ``("doing", what)`` (for error messages),
``("generated", rows, version, seconds)``, ``("probed", logprobs, version)``, ``("synced", version)``,
``("transferred", version)``, ``("error", what, traceback_text)``.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable
from multiprocessing.connection import wait

import torch

from rltrain.errors import CollectorError, send_failure
from rltrain.llm.engine import Engine, Generated, Sampling

_WAKE_S = 0.5  # the engine looks this often whether the learner is still there


class VLLMEngine(Engine):
    """A vLLM engine on ``source`` (a model dir or hub id) in a spawned process, fed by ``receiver``
    (``sync=vllm``'s); ``submit`` then ``collect`` (or ``generate``, both) a batch of completions."""

    def __init__(self, source: str, tokenizer, receiver, seed: int = 0, dtype: str = "float32",
                 kv_cache_gb: float = 1.0, timeout_s: float = 120.0, threads: int | None = 1,
                 gpu: int | None = None, gpu_memory: float = 0.4):
        """``gpu``: the CUDA device the engine runs on (an index among this process's visible ones), with
        ``gpu_memory`` of its memory (vLLM's ``gpu_memory_utilization``); None: the CPU (vLLM's CPU build)."""
        self.tokenizer, self.timeout_s, self._receiver = tokenizer, timeout_s, receiver
        self._doing = "starting"
        options = {"dtype": dtype, "seed": seed, "enforce_eager": True,
                   # the log-prob of each drawn token under the distribution it was drawn from (temperature, top_p)
                   "logprobs_mode": "processed_logprobs", **receiver.engine_options()}
        environment = {"OMP_NUM_THREADS": None if threads is None else str(threads)}
        if gpu is not None:
            options["gpu_memory_utilization"] = gpu_memory
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            environment["CUDA_VISIBLE_DEVICES"] = visible.split(",")[gpu] if visible else str(gpu)
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=engine_main, name="rltrain-vllm-engine", daemon=True,
                                 args=(child, source, options, receiver, kv_cache_gb))
        try:
            with temporary_environment(**environment):
                self._proc.start()  # the spawned process's OpenMP reads it when torch loads, before any code of ours
        finally:
            child.close()
        receiver.after_spawn()
        self._pending: tuple | None = None
        self._early: tuple | None = None  # a batch that came back while a push waited for the engine
        try:
            self.version = self._wait("ready", timeout_s)[1]
            self._doing = "loading the learner's weights"
            receiver.attach(EngineClient(self), source)  # a push through vLLM's transfer API: the first one now
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self._proc.pid

    def generate(self, prompts: list[str], group_size: int, sampling: Sampling, seed: int | None = None) -> Generated:
        self.submit(prompts, group_size, sampling, seed)
        return self.collect()

    def submit(self, prompts: list[str], group_size: int, sampling: Sampling, seed: int | None = None) -> None:
        """Ask for ``group_size`` completions of each prompt; the engine starts at once, with the
        newest pushed weights, while this process goes on (``collect`` waits for them)."""
        self._idle("submit")
        rows, self._pending = encode_prompts(self.tokenizer, prompts, group_size)
        reserved = self._receiver.reserve()  # the newest version now, whenever the engine reads the request
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
        if self._proc is not None and not self._proc.is_alive():
            self._raise_dead()

    def _idle(self, what: str) -> None:
        if self._pending is not None:  # its answer would be taken for the other's
            raise RuntimeError(f"{what}() while a batch is being generated: collect() it first")

    def _send(self, msg: tuple, doing: str) -> None:
        self._doing = doing
        try:
            self._conn.send(msg)
        except OSError:
            self._raise_dead()

    def _wait(self, what: str, timeout_s: float) -> tuple:
        """The engine's ``what`` answer; raises CollectorError once it raises, dies or takes over ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            ready = wait([self._conn, self._proc.sentinel], timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            if self._conn in ready:
                try:
                    msg = self._conn.recv()
                except (EOFError, OSError):
                    self._raise_dead()
                if msg[0] == "doing":
                    self._doing = msg[1]
                    continue
                if msg[0] == "error":
                    raise CollectorError(f"the vLLM engine (pid {self.pid}) failed while {self._doing}: {msg[1]}",
                                         details=msg[2])
                if msg[0] == "generated" and what != "generated":  # a push waited for the batch to end
                    self._early = msg
                    continue
                if msg[0] != what:
                    raise CollectorError(f"the vLLM engine sent {msg[0]!r} while the learner waited for {what!r}")
                return msg
            if self._proc.sentinel in ready and not self._conn.poll():
                self._raise_dead()
            if time.monotonic() > deadline:
                raise CollectorError(f"the vLLM engine (pid {self.pid}) did not answer within {timeout_s:g}s while "
                                     f"{self._doing} (collector.timeout_s); it is alive but stuck, or slower than "
                                     "that: raise collector.timeout_s")

    def _raise_dead(self):
        self._proc.join(timeout=1.0)
        code = self._proc.exitcode
        how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        hint = "; SIGKILL often comes from the out-of-memory killer (see dmesg)" if code == -signal.SIGKILL else ""
        raise CollectorError(f"the vLLM engine (pid {self.pid}) died ({how}) while {self._doing}{hint}")

    def close(self) -> None:
        """Stop the engine process (killed if it does not stop within 10 s); safe to call twice."""
        if self._proc is None:
            return
        if self._pending is not None:  # a batch nobody will collect: no need to wait for it
            self._proc.terminate()
        try:
            self._conn.send(("close",))
        except OSError:
            pass
        self._proc.join(timeout=10.0)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=5.0)
        self._conn.close()
        self._proc = None


class VLLMModel:
    """What the ``sync=vllm`` receiver loads weights into: vLLM's model in this process (the engine's,
    or a server's worker's)."""

    def __init__(self, model, model_config, reset_prefix_cache: Callable[[], bool] | None = None):
        """``model`` and ``model_config``: vLLM's (its worker's model runner's); ``reset_prefix_cache``:
        vLLM's, called after each load (None: the caller resets it, as a server's client does over HTTP)."""
        self.model, self.model_config, self.reset_prefix_cache = model, model_config, reset_prefix_cache
        self.expected = {name for name, _ in self.model.named_parameters()}
        quiet_reloads()
        self.checkpoint = checkpoint_names(model_config.model, model_config.hf_config)

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        """Load weights named as in the Hugging Face checkpoint (vLLM fuses and repacks them as it loads
        its own); raises ValueError naming what does not fit: a weight vLLM's model does not have, a
        shape it refuses, a weight of its own that nothing loaded.

        This is vLLM's in-place reload (``reload_weights``), plus two things it leaves stale: on the
        CPU an embedding keeps a packed copy of its weights for the output layer's GEMM, which the
        reload does not repack (the output layer would go on with the old weights: measured), and
        the prefix cache holds keys and values computed with the old weights."""
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        if unlike := names_unlike(self.checkpoint, set(weights)):
            # vLLM's own check is per fused weight: a learner without k_proj still "loads" qkv_proj
            raise ValueError(f"the learner's weights are not the served model's: {unlike}")
        current = [None]

        def named():
            for name, tensor in weights.items():
                current[0] = name
                yield name, tensor

        initialize_layerwise_reload(self.model)
        try:
            loaded = self.model.load_weights(named())
        except (KeyError, AssertionError, RuntimeError, ValueError) as e:
            raise ValueError(f"vLLM's {type(self.model).__name__} cannot load the learner's {current[0]} "
                             f"{tuple(weights[current[0]].shape)} ({type(e).__name__}: {e})") from None
        finally:
            finalize_layerwise_reload(self.model, self.model_config)
        for module in self.model.modules():
            if isinstance(getattr(module, "quant_method", None), UnquantizedEmbeddingMethod):
                module.quant_method.process_weights_after_loading(module)
        if self.reset_prefix_cache is not None and not self.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache after a weight update (cached keys and values "
                               "of the old weights would be reused)")
        if missing := sorted(self.expected - set(loaded)):
            raise ValueError(f"the learner's weights leave vLLM's {', '.join(missing)} unloaded (the learner's model "
                             "has other names than the engine's)")

    def load_slot(self, slot) -> None:
        """Load a ``sync=vllm`` slot (a FlatBuffer of the served weights)."""
        self.load(slot.views)


# The lines vLLM logs at every in-place reload (its loggers and format strings), and what this process shows
# once instead: the layers without weights of their own in a checkpoint "fail to load" at each push (those
# that do have weights and are not loaded fail VLLMModel.load), and the prefix cache is reset after each.
RELOAD_LINES = {
    "vllm.model_executor.model_loader.reload.layerwise": {
        "%s: Failed to load weights": "%s: no weights reloaded into it, as expected of a layer with none of its own "
                                      "in a checkpoint (rotary tables; an output layer tied to the embedding); any "
                                      "other weight left unloaded fails the load, named. Shown once, not at every push",
    },
    "vllm.v1.core.block_pool": {
        "Successfully reset prefix cache": "Successfully reset prefix cache (rltrain resets it after each weight "
                                           "update; shown once, not at every push)",
    },
}


class _OnceInstead(logging.Filter):
    """Shows each of ``lines``' records once (per message and arguments), as the INFO line given for it."""

    def __init__(self, lines: dict[str, str]):
        super().__init__()
        self.lines, self.shown = lines, set()

    def filter(self, record: logging.LogRecord) -> bool:
        instead = self.lines.get(record.msg)
        if instead is None:
            return True
        key = (record.msg, record.args)
        if key in self.shown:
            return False
        self.shown.add(key)
        record.msg, record.levelno, record.levelname = instead, logging.INFO, "INFO"
        return True


def quiet_reloads() -> None:
    """In a process where vLLM reloads weights in place (rltrain's engine, a server's worker): each of
    ``RELOAD_LINES`` once, not at every push. Idempotent."""
    for name, lines in RELOAD_LINES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _OnceInstead) for f in logger.filters):
            logger.addFilter(_OnceInstead(lines))


def names_unlike(expected: set[str] | None, given: set[str]) -> str:
    """What differs between the served model's weight names (``checkpoint_names``; None: unknown) and the
    learner's: "" if nothing."""
    if expected is None or given == expected:
        return ""
    missing, extra = sorted(expected - given), sorted(given - expected)
    return "; ".join(f"{what}: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}"
                     for what, names in (("missing", missing), ("not in the served model", extra)) if names)


def checkpoint_names(source: str, hf_config=None) -> set[str] | None:
    """The weight names in a local model dir's safetensors files (None for a hub id or another format),
    less the output layer's copy some checkpoints keep of a tied embedding (the learner names it once)."""
    from pathlib import Path

    files = sorted(Path(source).glob("*.safetensors")) if Path(source).is_dir() else []
    if not files:
        return None
    from safetensors import safe_open

    names = set()
    for file in files:
        with safe_open(file, "pt") as f:
            names.update(f.keys())
    if hf_config is None:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(source)
    if getattr(hf_config, "tie_word_embeddings", False):
        names.discard("lm_head.weight")
    return names


def engine_main(conn, source: str, options: dict, receiver, kv_cache_gb: float) -> None:
    """The engine process: vLLM on ``source``, the receiver connected to it, requests served in order."""
    # Ctrl-C or a scheduler's SIGTERM to the learner's process group does not reach the engine (its own
    # session): the learner finishes its step, checkpoints, then closes it. It dies with the learner.
    os.setsid()
    _die_with_parent()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{kv_cache_gb:g}"
    # vLLM and tqdm make multiprocessing locks in this process. Under the fork method a lock's semaphore
    # is unlinked as soon as it is made (no child needs its name); under spawn it stays in /dev/shm
    # until the learner's resource tracker removes it, or forever if the learner is killed.
    mp.set_start_method("fork", force=True)
    code = 0
    try:
        from vllm import LLM

        receiver.prepare()
        llm = LLM(model=source, **options)
        receiver.on_load = lambda version: conn.send(("doing", f"loading weights version {version}"))
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        receiver.connect(VLLMModel(runner.get_model(), runner.model_config, llm.reset_prefix_cache))
        conn.send(("ready", receiver.version))
        while (msg := _next(conn)) is not None:
            receiver.poll(msg[1] if msg[0] == "generate" else None)
            if msg[0] == "transfer":
                _transfer(llm, receiver, *msg[1:])
                conn.send(("transferred", receiver.version))
            elif msg[0] == "generate":
                conn.send(("doing", f"generating with weights version {receiver.version}"))
                started = time.perf_counter()
                rows = _generate(llm, *msg[2:])
                conn.send(("generated", rows, receiver.version, time.perf_counter() - started))
            elif msg[0] == "probe":
                conn.send(("probed", _probe(llm, msg[1]), receiver.version))
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


class EngineClient:
    """vLLM's weight-sync client (``VLLMWeightSyncClient``: the four calls its trainer engines make) for
    rltrain's own engine, over its pipe. ``version``: what ``finish_weight_update`` stamps the push with."""

    def __init__(self, engine: VLLMEngine):
        self.engine, self.version = engine, 0

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


@contextlib.contextmanager
def temporary_environment(**values: str | None):
    """``values`` in os.environ while the block runs (None: as it is), then as they were."""
    before = {key: os.environ.get(key) for key in values}
    os.environ.update({key: value for key, value in values.items() if value is not None})
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _die_with_parent() -> None:
    """SIGKILL this process when its parent dies, even mid-generation (Linux; elsewhere the request
    loop notices between requests)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _next(conn) -> tuple | None:
    """The learner's next request; None on close, or once the learner is gone."""
    parent = mp.parent_process()
    while not conn.poll(_WAKE_S):
        if parent is not None and not parent.is_alive():
            return None
    try:
        msg = conn.recv()
    except (EOFError, OSError):
        return None
    return None if msg[0] == "close" else msg


def _generate(llm, rows: list[list[int]], group_size: int, sampling: Sampling, seed: int | None) -> list:
    """Each prompt's ``group_size`` completions, one after another: (token ids, each one's log-prob,
    whether ``max_new_tokens`` cut it). The eos token or the one completing a stop string ends one."""
    from vllm import SamplingParams

    requests = sampling_requests(rows, group_size, sampling, seed)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids, _ in requests],
                           [SamplingParams(**params) for _, params in requests], use_tqdm=False)
    out = []
    for request in outputs:
        for c in sorted(request.outputs, key=lambda c: c.index):
            ids = list(c.token_ids)
            logprobs = [d[t].logprob for d, t in zip(c.logprobs, ids)]
            out.append((ids, logprobs, c.finish_reason == "length"))
    return out


def sampling_requests(rows: list[list[int]], group_size: int, sampling: Sampling,
                      seed: int | None) -> list[tuple[list[int], dict]]:
    """The vLLM requests that draw ``group_size`` completions of each prompt (token ids), in order:
    each one's prompt and sampling parameters (``SamplingParams``'s, and the completions API's)."""
    n = 1 if sampling.greedy else group_size  # vLLM draws one greedy completion per request
    count = len(rows) * (group_size // n)
    return [(ids, {"n": n, "max_tokens": sampling.max_new_tokens, "logprobs": 0,
                   # seeds of each request's own (vLLM seeds its n samples seed, seed + 1, ...): one
                   # seed for all would draw the same random numbers for every prompt
                   "seed": None if seed is None else (seed * count + i) * n,
                   "temperature": 0.0 if sampling.greedy else sampling.temperature,
                   # every sampling setting said, none left to a server's defaults (the model's generation_config)
                   "top_p": 1.0 if sampling.greedy else sampling.top_p, "top_k": 0, "min_p": 0.0,
                   "stop": list(sampling.stop) or None, "include_stop_str_in_output": True,
                   "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0})
            for i, ids in enumerate(ids for ids in rows for _ in range(group_size // n))]


def encode_prompts(tokenizer, prompts: list[str], group_size: int) -> tuple[list[list[int]], tuple]:
    """Each prompt's token ids (no padding), and the left-padded ids and mask of every completion's
    prompt (``group_size`` rows each), which ``as_generated`` takes."""
    tokenizer.padding_side = "left"
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    rows = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    return rows, (ids.repeat_interleave(group_size, dim=0), mask.repeat_interleave(group_size, dim=0))


def as_generated(tokenizer, prompts: tuple, rows: list, version: int) -> Generated:
    """``Generated`` from vLLM's completions (each one's token ids, their log-probs, whether
    ``max_new_tokens`` cut it) and ``encode_prompts``'s padded prompts."""
    longest = max(1, max(len(ids) for ids, _, _ in rows))
    completion = torch.full((len(rows), longest), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    logprobs = torch.zeros((len(rows), longest))
    for i, (ids, lps, _) in enumerate(rows):
        completion[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        mask[i, :len(ids)] = 1
        logprobs[i, :len(ids)] = torch.tensor(lps)
    truncated = torch.tensor([cut for _, _, cut in rows])
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids, _, _ in rows]
    return Generated(*prompts, completion, mask, logprobs, truncated, texts, version)


def _probe(llm, ids: list[int]) -> list[float]:
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0),
                       use_tqdm=False)[0]
    return [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], ids[1:])]
