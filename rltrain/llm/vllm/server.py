"""``engine=vllm_server``: generate in a vLLM server the user runs, and push the learner's weights into it.

The user starts vLLM's OpenAI-compatible server on the run's model, on the learner's machine, as the
same user, in dev mode (for ``/collective_rpc`` and ``/pause``) and with rltrain's worker extension
(``server_command`` gives the command; docs/vllm.md shows it), and trains with
``algo=grpo engine=vllm_server engine.url=http://127.0.0.1:8000``.

Generation: vLLM's completions API (``/v1/completions``), prompts as token ids, one request per
prompt with seeds of its own (the same draws as rltrain's own engine), in flight together, every
sampling setting given (none left to the server's defaults).

A push is ``sync=vllm``'s, as with rltrain's own engine: the learner copies its weights into a
shared-memory slot. Here the receiver is in the learner: before each batch it pauses the server
(``/pause``, letting requests in flight finish), has the worker extension load the newest slot in
place (``/collective_rpc``), resets the server's prefix cache and resumes it, whatever failed in
between. Only the slot's address crosses HTTP: the worker maps the learner's slot through
``/proc/<learner pid>/fd/<fd>`` for that one load (checked to be the same file: device and inode), so
nothing is named in /dev/shm, and the server holds none of a learner's memory between pushes. That is
why the server must run on the learner's machine, as its user. With ``sync=vllm_transfer`` the pushes
go through vLLM's weight-transfer routes instead (``ServerClient``), and the server may be elsewhere.

A server serves one run's weights at a time: a run claims it (the worker extension keeps the claim)
before its first load and releases it when it closes, and another run is refused while the claim is
live, naming the holder (``ServerClaim``; ``rltrain.llm.vllm.claim``).
"""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor
from concurrent.futures import wait as wait_all

import torch

from rltrain.errors import CollectorError, ConfigError
from rltrain.llm.engine import Engine, Generated, Sampling
from rltrain.llm.model import LanguageModel
from rltrain.llm.vllm import BACKENDS
from rltrain.llm.vllm.claim import LEASE_S, RENEW_S, describe, holder, in_use
from rltrain.llm.vllm.engine import check_sampling
from rltrain.llm.vllm.extension import EXTENSION, PROTOCOL, slot_address
from rltrain.llm.vllm.requests import as_generated, encode_prompts, sampling_requests
from rltrain.rules import PositiveNumber
from rltrain.sync.base import WeightReceiver

_CHECK_S = 10.0  # how long the checks before training (and a claim's release) wait for a server's answer
_IN_FLIGHT = 64  # requests sent together at most (one per prompt; one per completion when greedy)
def server_command(model_dir: str = "MODEL_DIR", port: int = 8000,
                   backend: str | None = None) -> tuple[dict[str, str], list[str]]:
    """The environment and the command that start a vLLM server rltrain can use (the CPU build), on
    ``model_dir`` at 127.0.0.1:``port``, taking ``sync=vllm``'s slots, or ``sync=vllm_transfer``'s pushes
    with ``backend`` (``sync.backend``)."""
    argv = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--worker-extension-cls", EXTENSION, "--logprobs-mode", "processed_logprobs", "--dtype", "float32",
            "--enforce-eager", "--no-enable-chunked-prefill", "--host", "127.0.0.1", "--port", str(port)]
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    if backend is not None:
        argv += ["--weight-transfer-config", transfer_config(backend)]
    if backend == "ipc":  # vLLM pickles the CUDA IPC handles over HTTP
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    return env, argv


def transfer_config(backend: str) -> str:
    """``--weight-transfer-config``'s value for ``sync.backend`` (vLLM's backend names; rltrain's gloo)."""
    return json.dumps({"backend": BACKENDS[backend]}, separators=(",", ":"))


def _command_line(backend: str | None = None) -> str:
    env, argv = server_command(backend=backend)
    return " ".join([*(f"{k}={v}" for k, v in env.items()), *(f"'{a}'" if "{" in a else a for a in argv)])


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
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:  # refused, reset, timed out, cut
        reason = getattr(e, "reason", None) or e
        raise ServerError(f"no answer from {url} ({reason})", reason=str(reason)) from None
    try:
        return json.loads(text) if text.strip() else None
    except ValueError:
        raise ServerError(f"{url}{path} answered something that is not JSON: {text[:200]!r}") from None


def check_server(url: str, timeout_s: float = _CHECK_S, backend: str | None = None) -> dict:
    """What rltrain needs to know of the vLLM server at ``url`` (its extension's ``rltrain_info``, the model
    name it serves and its context), for ``sync=vllm``'s slots or, given ``backend``, ``sync=vllm_transfer``'s
    pushes; raises ServerError with one line that
    says what to fix."""
    url = url.rstrip("/")
    start = f"{_command_line(backend)} (see docs/vllm.md, 'A vLLM server of your own')"
    key = f"engine.url={url}"
    try:
        call(url, "/health", timeout=timeout_s)
    except ServerError as e:
        raise ServerError(f"{key}: no vLLM server answers there ({e.reason}); start one with: {start}") from None
    try:
        infos = call(url, "/collective_rpc", {"method": "rltrain_info"}, timeout=timeout_s)["results"]
        models = call(url, "/v1/models", timeout=timeout_s)["data"]
    except ServerError as e:
        if e.status == 404:
            raise ServerError(f"{key}: the server is not in dev mode (it has no /collective_rpc); restart it with "
                              f"VLLM_SERVER_DEV_MODE=1: {start}") from None
        if e.status is not None and "rltrain_info" in str(e):
            raise ServerError(f"{key}: the server does not have rltrain's worker extension; restart it with "
                              f"--worker-extension-cls {EXTENSION}: {start}") from None
        raise ServerError(f"{key}: {e}") from None
    info = infos[0]
    if info.get("protocol") != PROTOCOL:
        raise ServerError(f"{key}: the server's rltrain worker extension speaks protocol {info.get('protocol')}, "
                          f"this rltrain {PROTOCOL}; install the same rltrain in the server's environment")
    if len(infos) != 1:
        raise ServerError(f"{key}: the server runs {len(infos)} workers (tensor or pipeline parallel); rltrain "
                          "pushes into one, for now")
    if info.get("logprobs_mode") != "processed_logprobs":
        raise ServerError(f"{key}: the server reports log-probs as {info.get('logprobs_mode')}, while GRPO needs "
                          "those of the distribution each token was drawn from; restart it with "
                          "--logprobs-mode processed_logprobs")
    wanted = BACKENDS.get(backend)  # None for sync=vllm: the worker extension loads the slots
    if wanted is not None and info.get("weight_transfer") != wanted:
        raise ServerError(f"{key} with sync.backend={backend}: the server takes no {wanted} weight transfer "
                          f"(its backend: {info.get('weight_transfer')}); restart it with --weight-transfer-config "
                          f"'{transfer_config(backend)}'")
    if info.get("holder") is not None:
        raise ServerError(in_use(url, info["holder"]))
    return {**info, "served_model": models[0]["id"], "max_model_len": models[0].get("max_model_len")}


class VLLMServer(Engine):
    """``engine=vllm_server``: a vLLM server the user runs at ``url``, on the learner's machine. Its weights
    come by ``sync=vllm`` (``receiver``, in this process, has the server load each pushed version before a
    batch) or by ``sync=vllm_transfer`` (build connects the learner's sender to ``transfer_client()``).
    ``submit`` then ``collect`` (or ``generate``) a batch of completions; every request is bounded by
    ``timeout_s``. ``run_dir``: the run's, which the claim names to another run (None: the one this
    process holds open, if one)."""

    WEIGHTS = ("snapshot", "push")
    TOKEN_PROMPTS = True  # (its requests are token ids: a conversation's are sent as they are)
    GENERATES_AHEAD = True

    def __init__(self, model: LanguageModel, receiver: WeightReceiver, url: str,
                 timeout_s: PositiveNumber = 300.0, run_dir: str | os.PathLike | None = None):
        """``url``: the server's (http://127.0.0.1:8000); ``timeout_s``: the longest wait for an answer of it."""
        self.url, self.receiver, self.timeout_s = url.rstrip("/"), receiver, timeout_s
        self.tokenizer = model.tokenizer()
        self._doing = "connecting"
        try:
            self.info = check_server(self.url, min(timeout_s, _CHECK_S))
        except ServerError as e:
            raise CollectorError(str(e)) from None
        if self.info["dtype"] != f"torch.{model.dtype}":
            raise CollectorError(f"engine.url={self.url}: the server computes in {self.info['dtype']}, the "
                                 f"learner in {model.dtype} (model.dtype); restart the server with --dtype "
                                 f"{model.dtype}")
        self._pool, self._pending = None, None
        # before anything reaches the server: refused while another run holds it
        self.claim = ServerClaim(self, run_dir)
        try:
            self._pool = ThreadPoolExecutor(max_workers=_IN_FLIGHT, thread_name_prefix="rltrain-vllm-server")
            self._doing = "loading the learner's weights"
            # sync=vllm: the first load, which checks the server's model against the learner's (with
            # sync=vllm_transfer, the first push, once build connects the sender)
            receiver.connect(ServerModel(self))
        except BaseException:
            self.close()
            raise
        self.version = receiver.version

    @classmethod
    def check_config(cls, values: dict, config: dict) -> None:
        """``engine.url`` is a URL where a vLLM server answers, in dev mode, with rltrain's worker extension,
        the log-probs GRPO needs and the sync scheme's backend (asked of it now: a few seconds at most)."""
        url = values.get("url")
        if not (isinstance(url, str) and url.startswith(("http://", "https://"))):
            raise ConfigError(f"engine.url={url!r} is not a URL; give the server's, e.g. "
                              "engine.url=http://127.0.0.1:8000 (or engine=vllm for rltrain's own engine)")
        check_sampling(config)
        if config.get("model", {}).get("lora_rank") and config.get("sync", {}).get("adapters"):
            raise ConfigError(f"model.lora_rank={config['model']['lora_rank']} with engine=vllm_server: rltrain pushes "
                              "a server the merged weights, not the adapters alone; add sync.adapters=false (or "
                              "engine=vllm, which applies the adapters)")
        try:
            check_server(url, backend=config.get("sync", {}).get("backend"))
        except ServerError as e:
            raise ConfigError(str(e)) from None

    def transfer_client(self) -> ServerClient:
        return ServerClient(self)

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
        self._pending = (padded, futures, started, self.version)

    def collect(self) -> Generated:
        if self._pending is None:
            raise RuntimeError("collect() without submit()")
        padded, futures, started, version = self._pending
        self.finish_batch()
        self._pending = None
        answers = [future.result() for future in futures]
        self.generate_s = max(end for _, end in answers) - started  # not the learner's update meanwhile
        return as_generated(self.tokenizer, padded, [row for rows, _ in answers for row in rows], version)

    def finish_batch(self) -> None:
        """Wait until every request of the batch in flight has its answer (kept for ``collect``): a push
        through vLLM's transfer API waits for it, so that no batch mixes two versions."""
        if self._pending is None:
            return
        futures = self._pending[1]
        done, late = wait_all(futures, timeout=self.timeout_s, return_when=FIRST_EXCEPTION)
        for future in done:
            if future.exception() is not None:
                self._pending = None
                raise self._fault(future.exception())
        if late:
            raise CollectorError(f"the vLLM server at {self.url} did not finish {len(late)} of {len(futures)} "
                                 f"requests within {self.timeout_s:g}s while {self._doing} (engine.timeout_s); "
                                 "it is stuck, or slower than that: raise engine.timeout_s")

    def _complete(self, ids: list[int], params: dict) -> tuple[list, float]:
        """One request's completions (token ids, their log-probs, cut by max_tokens), and when it ended."""
        body = {"model": self.info["served_model"], "prompt": ids, "return_token_ids": True,
                **{key: value for key, value in params.items() if value is not None}}
        answer = call(self.url, "/v1/completions", body, timeout=self.timeout_s)
        rows = [(c["token_ids"], c["logprobs"]["token_logprobs"], c["finish_reason"] == "length")
                for c in sorted(answer["choices"], key=lambda c: c["index"])]
        for completion, _, cut in rows:
            if cut and len(completion) < params["max_tokens"]:  # vLLM caps max_tokens at its context, silently
                raise ServerError(f"the server cut a completion at {len(completion)} tokens, before "
                                  f"collector.max_new_tokens={params['max_tokens']}: its context "
                                  f"(--max-model-len {self.info['max_model_len']}) is shorter than the prompt "
                                  "and the completion; restart it with a longer one")
        return rows, time.perf_counter()

    def probe(self, ids: list[int]) -> tuple[torch.Tensor, int]:
        """Each token's log-prob (after the first) under the weights the server holds, and their version."""
        self._idle("probe")
        answer = self.post("/v1/completions", "scoring a probe sequence",
                           {"model": self.info["served_model"], "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                            "prompt_logprobs": 0})
        scored = answer["choices"][0]["prompt_logprobs"][1:]
        return torch.tensor([each[str(token)]["logprob"] for each, token in zip(scored, ids[1:])]), self.version

    def sync(self) -> int:
        """Have the server load the newest pushed weights now; returns the version it holds."""
        self._idle("sync")
        self.claim.renew()
        if self.receiver.poll():  # sync=vllm: the newest slot, loaded (a push through vLLM's API sets it itself)
            self.version = self.receiver.version
        return self.version

    def rpc(self, method: str, *args: str, doing: str) -> list:
        """The worker extension's ``method``'s answers (one per worker)."""
        body = {"method": method, "args": list(args), "timeout": self.timeout_s}
        return self.post("/collective_rpc", doing, body)["results"]

    def post(self, path: str, doing: str, body: dict | None = None):
        """``path``'s answer to a POST of ``body``; a CollectorError naming the server and ``doing`` if none."""
        self._doing = doing
        try:
            return call(self.url, path, body, timeout=self.timeout_s, post=True)
        except ServerError as e:
            raise self._fault(e) from None

    def _idle(self, what: str) -> None:
        if self._pending is not None:
            raise RuntimeError(f"{what}() while a batch is being generated: collect() it first")

    def _fault(self, error: BaseException | str) -> CollectorError:
        return CollectorError(f"the vLLM server at {self.url} failed while {self._doing}: {error}")

    def close(self) -> None:
        """Forget the batch in flight (the server finishes it for nobody) and release the server for other
        runs. The server is the user's: it goes on running, with the last weights pushed; it holds nothing
        of the learner's (slots are mapped for one load at a time). Safe to call twice."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool, self._pending = None, None
        self.claim.release()
        self.receiver.close()


class ServerClaim:
    """This run's hold on its server, which serves one run's weights at a time (two runs would push theirs
    into one model): taken before anything reaches the server (refused, naming the holder, while another
    run's claim is live), released when the run closes however it ends. A server that can see this process
    (the same machine and pid namespace) keeps the claim while the process lives, so a SIGKILLed learner
    frees it at once; one elsewhere keeps it while this process renews it within its lease (a thread does,
    and each batch and push checks it still holds it)."""

    def __init__(self, server: VLLMServer, run_dir: str | os.PathLike | None = None):
        self.server, self.holder = server, holder(run_dir=run_dir)
        self.token, self._json = self.holder["token"], json.dumps(self.holder)
        self._stop, self.leased = threading.Event(), False
        answer = server.rpc("rltrain_claim", self._json, doing="claiming the server for this run")[0]
        if "held" in answer:
            raise CollectorError(in_use(server.url, answer["held"]))
        self._keeper = None
        if answer["leased"]:
            self.leased = True
            self._keeper = threading.Thread(target=self._keep, name="rltrain-vllm-claim", daemon=True)
            self._keeper.start()

    def renew(self) -> None:
        """Raise CollectorError if this run's claim has lapsed and another run holds the server now."""
        if not self.leased:
            return  # the server sees this process: the claim lasts while it lives
        answer = self.server.rpc("rltrain_claim", self._json, doing="renewing this run's claim on the server")[0]
        if "held" in answer:
            raise CollectorError(f"this run's claim on the vLLM server at {self.server.url} lapsed (not renewed "
                                 f"within {LEASE_S:g} s) and another run holds it now ({describe(answer['held'])})")

    def _keep(self) -> None:
        body = {"method": "rltrain_claim", "args": [self._json], "timeout": RENEW_S}
        while not self._stop.wait(RENEW_S):
            try:
                call(self.server.url, "/collective_rpc", body, timeout=RENEW_S)
            except ServerError:
                pass  # the run's own calls name a server that is gone or stuck; renew() one that another run took

    def release(self) -> None:
        """Let other runs have the server (best effort: a server that is gone holds no claim)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._keeper is not None:  # a renewal in flight would otherwise claim the server again after this
            self._keeper.join(timeout=RENEW_S + 1)
        try:
            call(self.server.url, "/collective_rpc", {"method": "rltrain_release", "args": [self.token]},
                 timeout=min(self.server.timeout_s, _CHECK_S))
        except ServerError:
            pass


class ServerModel:
    """The server's model as the ``sync=vllm`` receiver sees it: ``load_slot`` has the server load one,
    paused (requests in flight finish first; none starts until it has loaded)."""

    def __init__(self, server: VLLMServer):
        self.server = server
        self._addresses: dict[int, str] = {}

    def load_slot(self, slot, version: int) -> None:
        server = self.server
        address = self._addresses.get(id(slot))
        if address is None:
            address = self._addresses[id(slot)] = json.dumps(slot_address(slot))
        server.post("/pause?mode=wait", "pausing the server for a weight update (its requests in flight finish "
                                        "first)")
        try:
            answers = server.rpc("rltrain_load", address, server.claim.token, doing="loading pushed weights")
            if refused := next((a for a in answers if "error" in a), None):
                if refused.get("kind") in ("map", "claim"):
                    raise CollectorError(f"the vLLM server at {server.url}: {refused['error']}")
                raise ValueError(refused["error"])
            if not server.post("/reset_prefix_cache", "resetting its prefix cache")["success"]:
                # vLLM refuses while blocks are held; paused after the requests in flight, none should be
                raise server._fault("vLLM could not reset its prefix cache after a weight update (cached keys and "
                                    "values of the old weights would be reused)")
        except BaseException:
            try:  # a server left paused would hang every other client of it
                server.post("/resume", "resuming the server after a failed weight update")
            except CollectorError:
                pass  # gone, or stuck: the load's own fault is the one to report
            raise
        server.post("/resume", "resuming the server after a weight update")


class ServerClient:
    """vLLM's weight-sync client (``VLLMWeightSyncClient``: the four calls its trainer engines make) for a
    server, over its HTTP routes (dev mode): the server is paused
    from ``start_weight_update`` to ``finish_weight_update``, after which its prefix cache is reset and it
    resumes (``abort`` resumes it after a failed push). ``version``: what the push is stamped with."""

    def __init__(self, server: VLLMServer):
        self.server, self.version, self.source = server, 0, server.info["model"]

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.server.post("/init_weight_transfer_engine", "joining the learner for weight transfer",
                         {"init_info": init_info})

    def start_weight_update(self) -> None:
        self.server.claim.renew()
        self.server.post("/pause?mode=wait", "pausing the server for a weight update")
        self.server.post("/start_weight_update", f"starting the update to weights version {self.version}")

    def update_weights(self, update_info) -> None:
        from vllm.distributed.weight_transfer.clients import _json_safe_update_payload  # CUDA IPC handles, pickled

        self.server.post("/update_weights", f"receiving weights version {self.version}",
                         {"update_info": _json_safe_update_payload(update_info)})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        server = self.server
        server.post("/finish_weight_update", f"finishing the update to weights version {self.version}",
                    {"weight_version": str(self.version)})
        if not server.post("/reset_prefix_cache", "resetting its prefix cache")["success"]:
            raise server._fault("vLLM could not reset its prefix cache after a weight update")
        server.post("/resume", "resuming the server after a weight update")
        server.version = self.version

    def finish_batch(self) -> None:
        self.server.finish_batch()

    def check_alive(self) -> None:
        """Nothing here: every call to the server is bounded, and names it when it fails."""

    def address(self) -> str:
        """This machine's address as the server reaches it (the store or rendezvous of the transfer)."""
        from urllib.parse import urlsplit

        from rltrain.llm.vllm.backends import address_toward

        return address_toward(urlsplit(self.server.url).hostname)

    def abort(self) -> None:
        """After a failed push: end vLLM's update (its layerwise reload holds the layers not yet loaded; ended,
        they keep their old weights) and resume the server (left paused, it would hang every other client of
        it). Its weights may then mix two versions: the run fails, and the next push replaces them all."""
        for path, doing in (("/finish_weight_update", "ending a failed weight update"),
                            ("/resume", "resuming the server after a failed weight update")):
            try:
                self.server.post(path, doing)
            except CollectorError:
                pass  # gone, stuck, or no update to end: the push's own fault is the one to report


