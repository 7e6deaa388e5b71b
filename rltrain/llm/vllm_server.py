"""``collector.vllm_url``: generate in a vLLM server the user runs, and push the learner's weights into it.

The user starts vLLM's OpenAI-compatible server on the run's model, on the learner's machine, as the
same user, in dev mode (for ``/collective_rpc`` and ``/pause``) and with rltrain's worker extension
(``server_command`` gives the command; the README shows it), and trains with
``collector.engine=vllm collector.vllm_url=http://127.0.0.1:8000 sync=vllm``.

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
why the server must run on the learner's machine, as its user.

A server serves one run's weights at a time: a run claims it (the worker extension keeps the claim)
before its first load and releases it when it closes, and another run is refused while the claim is
live, naming the holder (``ServerClaim``, ``ClaimLedger``).
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from datetime import datetime

import torch

from rltrain.errors import CollectorError
from rltrain.llm.engine import Engine, Generated, Sampling
from rltrain.llm.vllm_engine import as_generated, encode_prompts, quiet_reloads, sampling_requests
from rltrain.sync.vllm import BACKENDS

EXTENSION = "rltrain.llm.vllm_server.WorkerExtension"
PROTOCOL = 2  # the extension's methods and what they take; a server running another rltrain's extension is refused
_CHECK_S = 10.0  # how long the checks before training (and a claim's release) wait for a server's answer
_LEASE_S = 60.0  # a holder the server cannot see live (another host or container) keeps it while it renews within this
_RENEW_S = 10.0  # how often such a holder renews its claim
_IN_FLIGHT = 64  # requests sent together at most (one per prompt; one per completion when greedy)


def server_command(model_dir: str = "MODEL_DIR", port: int = 8000,
                   transport: str = "shared_mem") -> tuple[dict[str, str], list[str]]:
    """The environment and the command that start a vLLM server rltrain can use (the CPU build), on
    ``model_dir`` at 127.0.0.1:``port``, taking pushes by ``transport`` (``sync.transport``)."""
    argv = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--worker-extension-cls", EXTENSION, "--logprobs-mode", "processed_logprobs", "--dtype", "float32",
            "--enforce-eager", "--host", "127.0.0.1", "--port", str(port)]
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    if transport != "shared_mem":
        argv += ["--weight-transfer-config", transfer_config(transport)]
    if transport == "ipc":  # vLLM pickles the CUDA IPC handles over HTTP
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    return env, argv


def transfer_config(transport: str) -> str:
    """``--weight-transfer-config``'s value for ``sync.transport`` (vLLM's backend names; rltrain's gloo)."""
    return json.dumps({"backend": BACKENDS[transport]}, separators=(",", ":"))


def _command_line(transport: str = "shared_mem") -> str:
    env, argv = server_command(transport=transport)
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


def check_server(url: str, timeout_s: float = _CHECK_S, transport: str = "shared_mem") -> dict:
    """What rltrain needs to know of the vLLM server at ``url`` (its extension's ``rltrain_info``, the model
    name it serves and its context), for pushes by ``transport``; raises ServerError with one line that
    says what to fix."""
    url = url.rstrip("/")
    start = f"{_command_line(transport)} (see the README's 'A vLLM server of your own')"
    key = f"collector.vllm_url={url}"
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
    wanted = BACKENDS.get(transport)  # None for shared_mem: the worker extension loads the slots
    if wanted is not None and info.get("weight_transfer") != wanted:
        raise ServerError(f"{key} with sync.transport={transport}: the server takes no {wanted} weight transfer "
                          f"(its backend: {info.get('weight_transfer')}); restart it with --weight-transfer-config "
                          f"'{transfer_config(transport)}'")
    if info.get("holder") is not None:
        raise ServerError(in_use(url, info["holder"]))
    return {**info, "served_model": models[0]["id"], "max_model_len": models[0].get("max_model_len")}


class VLLMServer(Engine):
    """A vLLM server the user runs at ``url``, on the learner's machine; ``receiver`` (``sync=vllm``'s, in
    this process) loads each pushed version into it before a batch. ``submit`` then ``collect`` (or
    ``generate``) a batch of completions; every request is bounded by ``timeout_s``. ``run_dir``: the run's,
    which the claim names to another run (None: the one this process holds open, if one)."""

    def __init__(self, url: str, tokenizer, receiver, timeout_s: float = 120.0, dtype: str = "float32",
                 run_dir: str | os.PathLike | None = None):
        self.url, self.tokenizer, self.receiver, self.timeout_s = url.rstrip("/"), tokenizer, receiver, timeout_s
        self._doing = "connecting"
        try:
            self.info = check_server(self.url, min(timeout_s, _CHECK_S))
        except ServerError as e:
            raise CollectorError(str(e)) from None
        if self.info["dtype"] != f"torch.{dtype}":
            raise CollectorError(f"collector.vllm_url={self.url}: the server computes in {self.info['dtype']}, the "
                                 f"learner in {dtype} (model.dtype); restart the server with --dtype {dtype}")
        self._pool, self._pending = None, None
        # before anything reaches the server: refused while another run holds it
        self.claim = ServerClaim(self, run_dir)
        try:
            self._pool = ThreadPoolExecutor(max_workers=_IN_FLIGHT, thread_name_prefix="rltrain-vllm-server")
            self._doing = "loading the learner's weights"
            receiver.connect(ServerModel(self))  # the first load: the server's model is checked against the learner's
            receiver.attach(ServerClient(self), self.info["model"])  # or the first push through vLLM's transfer API
        except BaseException:
            self.close()
            raise
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
                                 f"requests within {self.timeout_s:g}s while {self._doing} (collector.timeout_s); "
                                 "it is stuck, or slower than that: raise collector.timeout_s")

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
        self.receiver.poll()
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
                                 f"within {_LEASE_S:g} s) and another run holds it now ({describe(answer['held'])})")

    def _keep(self) -> None:
        body = {"method": "rltrain_claim", "args": [self._json], "timeout": _RENEW_S}
        while not self._stop.wait(_RENEW_S):
            try:
                call(self.server.url, "/collective_rpc", body, timeout=_RENEW_S)
            except ServerError:
                pass  # the run's own calls name a server that is gone or stuck; renew() one that another run took

    def release(self) -> None:
        """Let other runs have the server (best effort: a server that is gone holds no claim)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._keeper is not None:  # a renewal in flight would otherwise claim the server again after this
            self._keeper.join(timeout=_RENEW_S + 1)
        try:
            call(self.server.url, "/collective_rpc", {"method": "rltrain_release", "args": [self.token]},
                 timeout=min(self.server.timeout_s, _CHECK_S))
        except ServerError:
            pass


def holder(pid: int | None = None, run_dir: str | os.PathLike | None = None) -> dict:
    """Who claims a server: the process ``pid`` of this machine (None: this one), where its pid means it
    (this boot's pid namespace, where a server that shares it checks that it lives), its run dir (None: the
    one it holds open, if one), its command, since when; and a token of its own."""
    pid = os.getpid() if pid is None else pid
    run_dir = str(run_dir) if run_dir is not None else _run_dir(pid)
    return {"token": uuid.uuid4().hex, "pid": pid, "started": _started(pid), "where": _pid_space(),
            "host": socket.gethostname(), "run_dir": run_dir, "command": _command(pid),
            "since": datetime.now().isoformat(timespec="seconds"), "lease_s": _LEASE_S}


def describe(holder: dict) -> str:
    """The run a claim names, for a message: its run dir (or command), pid, host and since when."""
    run = f"run dir {holder['run_dir']}" if holder.get("run_dir") else f"`{holder.get('command')}`"
    seen = "" if _sees(holder) else (f"; from another machine or container, its claim lapses "
                                     f"{holder['lease_s']:g} s after it last renewed it")
    return f"{run}, pid {holder['pid']} on {holder['host']}, since {holder['since']}{seen}"


def in_use(url: str, holder: dict) -> str:
    return (f"collector.vllm_url={url} is in use by another run ({describe(holder)}); a vLLM server serves one "
            "run's weights at a time (no setting overrides it: two runs would push theirs into one model). Wait "
            "for that run to end or stop it, or start a second server for this run on another --port")


class ClaimLedger:
    """The worker extension's record of the run that holds its server, if any. A holder this process can
    see live (``_sees``) holds it while its process lives (a pid reused since is another process: its
    start time differs); one elsewhere, while it renews its claim within its lease. vLLM runs the
    extension's RPCs one at a time: a claim is atomic."""

    def __init__(self, clock=time.monotonic):
        self._clock, self._held, self._renewed = clock, None, 0.0

    def holder(self) -> dict | None:
        """The live holder (None: the server is free); a dead or lapsed one is forgotten."""
        held = self._held
        if held is not None and not (_alive(held) if _sees(held) else
                                     self._clock() - self._renewed <= held["lease_s"]):
            self._held = None
        return self._held

    def claim(self, holder: dict) -> dict | None:
        """Take the server for ``holder`` (or renew its claim); the live holder in the way, if another."""
        held = self.holder()
        if held is not None and held["token"] != holder["token"]:
            return public(held)
        self._held, self._renewed = holder, self._clock()
        return None

    def holds(self, token: str) -> bool:
        held = self.holder()
        return held is not None and held["token"] == token

    def release(self, token: str) -> None:
        if self.holds(token):
            self._held = None


def public(holder: dict | None) -> dict | None:
    """A holder as others are told of it: without the token that renews and releases its claim."""
    return None if holder is None else {k: v for k, v in holder.items() if k != "token"}


def _sees(holder: dict) -> bool:
    """Whether this process can tell if ``holder``'s process lives: its pid means the same here."""
    return holder.get("where") is not None and holder["where"] == _pid_space() and holder.get("started") is not None


def _alive(holder: dict) -> bool:
    return _started(holder["pid"]) == holder["started"]


def _pid_space() -> str | None:
    """This boot's id and this process's pid namespace (None off Linux): where a pid names one process."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{f.read().strip()} {os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return None


def _started(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot); None if there is none, or only its zombie (a
    killed learner that its parent, a sweep's launcher say, has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return None if fields[0] == "Z" else int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _run_dir(pid: int) -> str | None:
    """The run dir process ``pid`` holds (the lock ``rltrain.run_dir`` keeps open while a run lasts), if one."""
    from rltrain.run_dir import LOCK_FILE

    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    held = set()
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.endswith(f"/{LOCK_FILE}"):
            held.add(os.path.dirname(target))
    return held.pop() if len(held) == 1 else None


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")[:-1]
    except OSError:
        argv = sys.argv if pid == os.getpid() else ["?"]
    argv[0] = os.path.basename(argv[0])
    command = " ".join(argv)
    return command if len(command) <= 200 else command[:197] + "..."


class ServerModel:
    """The server's model as the ``sync=vllm`` receiver sees it: ``load_slot`` has the server load one,
    paused (requests in flight finish first; none starts until it has loaded)."""

    def __init__(self, server: VLLMServer):
        self.server = server
        self._addresses: dict[int, str] = {}

    def load_slot(self, slot) -> None:
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
        self.server, self.version = server, 0

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

        from rltrain.llm.vllm_transfer import address_toward

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


def slot_address(slot) -> dict:
    """Where another process of this machine (and user) maps ``slot`` (a shared FlatBuffer): the path
    of its shared-memory file under /proc, its size, and each weight's place in it."""
    fd, nbytes = slot.buffer.untyped_storage()._share_fd_cpu_()
    stat = os.fstat(fd)
    return {"protocol": PROTOCOL, "path": f"/proc/{os.getpid()}/fd/{fd}", "nbytes": nbytes,
            "file": [stat.st_dev, stat.st_ino],  # what the path must name where the server opens it
            "weights": [[name, list(shape), str(dtype).removeprefix("torch."), slot.offset(name)]
                        for name, (shape, dtype) in slot.layout.items()]}


def open_slot(address: dict) -> dict[str, torch.Tensor]:
    """The weights of ``slot_address``'s slot, read in place (a shared mapping of the learner's file);
    OSError where this process cannot open it, or the path names another file here (another pid
    namespace: another machine or container)."""
    stat = os.stat(address["path"])
    if [stat.st_dev, stat.st_ino] != address["file"] or stat.st_size != address["nbytes"]:
        raise OSError(f"{address['path']} is not the learner's slot here")
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
        transfer = getattr(self.vllm_config, "weight_transfer_config", None)
        return {"protocol": PROTOCOL, "model": config.model, "logprobs_mode": str(config.logprobs_mode),
                "dtype": str(config.dtype), "pid": os.getpid(), "holder": public(self._rltrain_claims().holder()),
                "weight_transfer": None if transfer is None else transfer.backend}

    def rltrain_claim(self, holder: str) -> dict:
        """Take the server for the run ``holder`` names (``holder()``'s, as JSON), or renew its claim:
        ``{"leased": ...}`` (whether the claim lapses unless renewed), or ``{"held": ...}``, the other run
        that holds it."""
        quiet_reloads()  # the first thing a run asks: vLLM's lines of each reload are shown once from now on
        holder = json.loads(holder)
        claims = self._rltrain_claims()
        if (held := claims.claim(holder)) is not None:
            return {"held": held}
        return {"leased": not _sees(holder)}

    def rltrain_release(self, token: str) -> dict:
        self._rltrain_claims().release(token)
        return {"released": token}

    def _rltrain_claims(self) -> ClaimLedger:
        if getattr(self, "_rltrain_ledger", None) is None:
            self._rltrain_ledger = ClaimLedger()
        return self._rltrain_ledger

    def rltrain_load(self, address: str, token: str) -> dict:
        """Load the learner's slot at ``address`` (``slot_address``'s, as JSON) into the model in place, for
        the run holding the claim ``token``; a refusal comes back as ``{"error": ..., "kind": "map" | "claim" |
        "weights"}`` (the learner raises it). The slot is mapped for this load only: the server keeps nothing
        of a learner between pushes, so a learner that dies leaves none of its memory held here."""
        from rltrain.llm.vllm_engine import VLLMModel

        claims = self._rltrain_claims()
        if not claims.holds(token):
            held = claims.holder()
            return {"kind": "claim", "error": "this run does not hold the server any more (restarted since, or its "
                                              "claim lapsed)" + (f"; {describe(held)} does" if held else "")}
        address = json.loads(address)
        try:
            weights = open_slot(address)
        except OSError as e:
            return {"kind": "map", "error": f"it cannot map the learner's weight slot {address['path']} ({e}); it "
                                            "must run on the learner's machine (not in another container), as "
                                            "the learner's user"}
        if getattr(self, "_rltrain_model", None) is None:
            self._rltrain_model = VLLMModel(self.model_runner.get_model(), self.model_runner.model_config)
        try:
            self._rltrain_model.load(weights)
        except ValueError as e:
            return {"kind": "weights", "error": str(e)}
        return {"loaded": address["path"]}


if "vllm" in sys.modules:  # imported by vLLM's worker (the extension): rltrain's gloo backend into vLLM's factories
    import rltrain.llm.vllm_transfer  # noqa: E402, F401
