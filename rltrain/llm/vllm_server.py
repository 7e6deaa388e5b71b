"""``collector.vllm_url``: generate in a vLLM server the user runs, and push the learner's weights into it.

The user starts vLLM's OpenAI-compatible server on the run's model, on the learner's machine, as the
same user, in dev mode (for ``/collective_rpc`` and ``/pause``) and with rltrain's worker extension::

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model DIR \\
        --worker-extension-cls rltrain.llm.vllm_server.WorkerExtension \\
        --logprobs-mode processed_logprobs --dtype float32 --host 127.0.0.1 --port 8000

and trains with ``collector.engine=vllm collector.vllm_url=http://127.0.0.1:8000 sync=vllm``.

Generation: vLLM's completions API (``/v1/completions``), prompts as token ids, one request per
prompt with seeds of its own (the same draws as rltrain's own engine), in flight together.

A push is ``sync=vllm``'s, as with rltrain's own engine: the learner copies its weights into a
shared-memory slot. Here the receiver is in the learner: before each batch it pauses the server
(``/pause``, letting requests in flight finish), has the worker extension load the newest slot in
place (``/collective_rpc``), resets the server's prefix cache and resumes it. Only the slot's address
crosses HTTP: the worker maps the learner's slot through ``/proc/<learner pid>/fd/<fd>``, so nothing
is named in /dev/shm and nothing is left there whichever process dies, and a push costs what it
costs rltrain's own engine. That is why the server must run on the learner's machine, as its user.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor
from concurrent.futures import wait as wait_all

import torch

from rltrain.errors import CollectorError
from rltrain.llm.engine import Engine, Generated, Sampling
from rltrain.llm.vllm_engine import as_generated, encode_prompts, sampling_requests

EXTENSION = "rltrain.llm.vllm_server.WorkerExtension"
COMMAND = ("VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model MODEL_DIR "
           f"--worker-extension-cls {EXTENSION} --logprobs-mode processed_logprobs --dtype float32 "
           "--host 127.0.0.1 --port 8000")
_CHECK_S = 10.0  # how long the checks before training wait for a server's answer


class ServerError(Exception):
    """A server that did not answer (``status`` None) or answered with an HTTP error."""

    def __init__(self, message: str, status: int | None = None, reason: str = ""):
        super().__init__(message)
        self.status, self.reason = status, reason or message


def call(url: str, path: str, body: dict | None = None, timeout: float = 60.0, post: bool = False):
    """``url + path``'s JSON answer (None for an empty one): GET, or POST with ``body``; raises
    ServerError saying why not."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method="POST" if post or data is not None else "GET",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            text = answer.read()
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace").strip()
        raise ServerError(f"HTTP {e.code} for {path}: {detail[:500] or e.reason}", e.code) from None
    except (urllib.error.URLError, OSError) as e:  # refused, reset, timed out
        reason = getattr(e, "reason", None) or e
        raise ServerError(f"no answer from {url} ({reason})", reason=str(reason)) from None
    return json.loads(text) if text.strip() else None


def check_server(url: str, timeout_s: float = _CHECK_S) -> dict:
    """What rltrain needs to know of the vLLM server at ``url`` (its extension's ``rltrain_info`` and the
    model name it serves); raises ServerError with one line that says what to fix."""
    url = url.rstrip("/")
    start = f"start one with: {COMMAND} (see the README's 'A vLLM server of your own')"
    try:
        call(url, "/health", timeout=timeout_s)
    except ServerError as e:
        raise ServerError(f"collector.vllm_url={url}: no vLLM server answers there ({e.reason}); {start}") from None
    try:
        info = call(url, "/collective_rpc", {"method": "rltrain_info"}, timeout=timeout_s)["results"][0]
    except ServerError as e:
        if e.status == 404:
            raise ServerError(f"collector.vllm_url={url}: the server is not in dev mode (it has no /collective_rpc); "
                              f"restart it with VLLM_SERVER_DEV_MODE=1: {COMMAND}") from None
        raise ServerError(f"collector.vllm_url={url}: the server does not have rltrain's worker extension ({e}); "
                          f"restart it with --worker-extension-cls {EXTENSION}: {COMMAND}") from None
    if info.get("logprobs_mode") != "processed_logprobs":
        raise ServerError(f"collector.vllm_url={url}: the server reports log-probs as {info.get('logprobs_mode')}, "
                          "while GRPO needs those of the distribution each token was drawn from; restart it with "
                          "--logprobs-mode processed_logprobs")
    models = call(url, "/v1/models", timeout=timeout_s)["data"]
    return {**info, "served_model": models[0]["id"]}


class VLLMServer(Engine):
    """A vLLM server the user runs at ``url``, on the learner's machine; ``receiver`` (``sync=vllm``'s, in
    this process) loads each pushed version into it before a batch. ``submit`` then ``collect`` (or
    ``generate``) a batch of completions; every request is bounded by ``timeout_s``."""

    def __init__(self, url: str, tokenizer, receiver, timeout_s: float = 120.0):
        self.url, self.tokenizer, self.receiver, self.timeout_s = url.rstrip("/"), tokenizer, receiver, timeout_s
        self._doing = "connecting"
        try:
            self.info = check_server(self.url, min(timeout_s, _CHECK_S))
        except ServerError as e:
            raise CollectorError(str(e)) from None
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="rltrain-vllm-server")
        self._pending: tuple | None = None
        self._doing = "loading the learner's weights"
        receiver.connect(ServerModel(self))  # the first load: the server's model is checked against the learner's
        self.version = receiver.version

    def generate(self, prompts: list[str], group_size: int, sampling: Sampling, seed: int | None = None) -> Generated:
        self.submit(prompts, group_size, sampling, seed)
        return self.collect()

    def submit(self, prompts: list[str], group_size: int, sampling: Sampling, seed: int | None = None) -> None:
        """Load the newest pushed weights into the server, then ask it for ``group_size`` completions of
        each prompt (``collect`` waits for them)."""
        self.sync()
        rows, padded = encode_prompts(self.tokenizer, prompts, group_size)
        self._doing = f"generating with weights version {self.version}"
        started = time.perf_counter()
        futures = [self._pool.submit(self._complete, ids, params)
                   for ids, params in sampling_requests(rows, group_size, sampling, seed)]
        self._pending = (padded, futures, started)

    def collect(self) -> Generated:
        if self._pending is None:
            raise RuntimeError("collect() without submit()")
        padded, futures, started = self._pending
        done, late = wait_all(futures, timeout=self.timeout_s, return_when=FIRST_EXCEPTION)
        for future in done:
            if future.exception() is not None:
                self._pending = None
                raise self._fault(future.exception())
        if late:
            raise CollectorError(f"the vLLM server at {self.url} did not finish {len(late)} of {len(futures)} "
                                 f"requests within {self.timeout_s:g}s while {self._doing} (collector.timeout_s); "
                                 "it is stuck, or slower than that: raise collector.timeout_s")
        self._pending = None
        answers = [future.result() for future in futures]
        self.generate_s = max(end for _, end in answers) - started  # not the learner's update meanwhile
        return as_generated(self.tokenizer, padded, [row for rows, _ in answers for row in rows], self.version)

    def _complete(self, ids: list[int], params: dict) -> tuple[list, float]:
        """One request's completions (token ids, their log-probs, cut by max_tokens), and when it ended."""
        body = {"model": self.info["served_model"], "prompt": ids, "return_token_ids": True,
                **{key: value for key, value in params.items() if value is not None}}
        answer = call(self.url, "/v1/completions", body, timeout=self.timeout_s)
        rows = [(c["token_ids"], c["logprobs"]["token_logprobs"], c["finish_reason"] == "length")
                for c in sorted(answer["choices"], key=lambda c: c["index"])]
        return rows, time.perf_counter()

    def probe(self, ids: list[int]) -> tuple[torch.Tensor, int]:
        """Each token's log-prob (after the first) under the weights the server holds, and their version."""
        self._idle("probe")
        self._doing = "scoring a probe sequence"
        try:
            answer = call(self.url, "/v1/completions", {"model": self.info["served_model"], "prompt": ids,
                                                        "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0},
                          timeout=self.timeout_s)
        except ServerError as e:
            raise self._fault(e) from None
        scored = answer["choices"][0]["prompt_logprobs"][1:]
        return torch.tensor([each[str(token)]["logprob"] for each, token in zip(scored, ids[1:])]), self.version

    def sync(self) -> int:
        """Have the server load the newest pushed weights now; returns the version it holds."""
        self._idle("sync")
        self.receiver.poll()
        self.version = self.receiver.version
        return self.version

    def rpc(self, method: str, *args: str, doing: str):
        """The worker extension's ``method``'s answer (its one worker's)."""
        self._doing = doing
        try:
            return call(self.url, "/collective_rpc", {"method": method, "args": list(args), "timeout": self.timeout_s},
                        timeout=self.timeout_s)["results"][0]
        except ServerError as e:
            raise self._fault(e) from None

    def post(self, path: str, doing: str):
        self._doing = doing
        try:
            return call(self.url, path, timeout=self.timeout_s, post=True)
        except ServerError as e:
            raise self._fault(e) from None

    def _idle(self, what: str) -> None:
        if self._pending is not None:
            raise RuntimeError(f"{what}() while a batch is being generated: collect() it first")

    def _fault(self, error: BaseException | str) -> CollectorError:
        return CollectorError(f"the vLLM server at {self.url} failed while {self._doing}: {error}")

    def close(self) -> None:
        """Forget the batch in flight and have the server drop its maps of this run's weight slots (the
        server is the user's: it goes on running)."""
        if self._pool is None:
            return
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool, self._pending = None, None
        try:
            call(self.url, "/collective_rpc", {"method": "rltrain_release"}, timeout=min(self.timeout_s, _CHECK_S))
        except ServerError:
            pass  # gone: nothing of ours is left in it


class ServerModel:
    """The server's model as the ``sync=vllm`` receiver sees it: ``load_slot`` has the server load one."""

    def __init__(self, server: VLLMServer):
        self.server = server
        self._learner = uuid.uuid4().hex  # the server keeps its maps of this learner's slots under it
        self._addresses: dict[int, dict] = {}

    def load_slot(self, slot) -> None:
        address = self._addresses.get(id(slot))
        if address is None:
            address = self._addresses[id(slot)] = {**slot_address(slot), "learner": self._learner}
        server = self.server
        server.post("/pause?mode=wait", "pausing the server for a weight update")  # requests in flight finish first
        loaded = server.rpc("rltrain_load", json.dumps(address), doing="loading pushed weights")
        if "error" not in loaded and not server.post("/reset_prefix_cache", "resetting its prefix cache")["success"]:
            # vLLM refuses while blocks are held; paused after the requests in flight, none should be
            raise server._fault("vLLM could not reset its prefix cache after a weight update (cached keys and "
                                "values of the old weights would be reused)")
        server.post("/resume", "resuming the server after a weight update")
        if "error" in loaded:
            raise ValueError(loaded["error"])


def slot_address(slot) -> dict:
    """Where another process of this machine (and user) maps ``slot`` (a shared FlatBuffer): the path
    of its shared-memory file under /proc, its size, and each weight's place in it."""
    fd, nbytes = slot.buffer.untyped_storage()._share_fd_cpu_()
    return {"path": f"/proc/{os.getpid()}/fd/{fd}", "nbytes": nbytes,
            "weights": [[name, list(shape), str(dtype).removeprefix("torch."), slot.offset(name)]
                        for name, (shape, dtype) in slot.layout.items()]}


def open_slot(address: dict) -> dict[str, torch.Tensor]:
    """The weights of ``slot_address``'s slot, read in place (a shared mapping of the learner's file)."""
    storage = torch.UntypedStorage.from_file(address["path"], shared=True, nbytes=address["nbytes"])
    buffer = torch.empty(0, dtype=torch.uint8).set_(storage)
    views = {}
    for name, shape, dtype, offset in address["weights"]:
        dtype = getattr(torch, dtype)
        count = torch.Size(shape).numel()
        views[name] = buffer[offset:offset + count * dtype.itemsize].view(dtype).view(shape)
    return views


class WorkerExtension:
    """Mixed into vLLM's worker by ``--worker-extension-cls rltrain.llm.vllm_server.WorkerExtension``: what
    rltrain calls through the server's ``/collective_rpc``. Imports nothing of vLLM's at import time."""

    def rltrain_info(self) -> dict:
        config = self.model_runner.model_config
        return {"model": config.model, "logprobs_mode": str(config.logprobs_mode), "dtype": str(config.dtype),
                "pid": os.getpid()}

    def rltrain_load(self, address: str) -> dict:
        """Load the learner's slot at ``address`` (``slot_address``'s, as JSON) into the model in place; a
        refusal comes back as ``{"error": ...}`` (the learner raises it, naming the weights)."""
        from rltrain.llm.vllm_engine import VLLMModel

        address = json.loads(address)
        if getattr(self, "_rltrain_learner", None) != address["learner"]:
            # another learner (the path of a closed slot's descriptor may name another file now): drop the maps
            self._rltrain_learner, self._rltrain_slots = address["learner"], {}
        slots = self._rltrain_slots
        try:
            if address["path"] not in slots:
                slots[address["path"]] = open_slot(address)
        except OSError as e:
            return {"error": f"the server cannot map the learner's weight slot {address['path']} ({e}): it must run "
                             "on the learner's machine, as the learner's user, and see its processes"}
        if getattr(self, "_rltrain_model", None) is None:
            self._rltrain_model = VLLMModel(self.model_runner)
        try:
            self._rltrain_model.load(slots[address["path"]])
        except ValueError as e:
            return {"error": str(e)}
        return {"loaded": address["path"]}

    def rltrain_release(self) -> None:
        """Drop the maps of the learner's slots (its memory is freed once the learner is gone too)."""
        self._rltrain_learner, self._rltrain_slots = None, {}
