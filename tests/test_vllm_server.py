"""``engine=vllm_server``: a vLLM server the user runs (vLLM's OpenAI-compatible server, the CPU build,
in dev mode with rltrain's worker extension), serving the tiny model; rltrain generates through it
and pushes into it. One server for the module (it takes about a minute to start); the test that
kills it runs last."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rltrain.errors import CollectorError, ConfigError, SyncError
from rltrain.llm.engine import Sampling, TransformersEngine
from rltrain.llm.model import LanguageModel
from rltrain.llm.tiny import write_tiny_model
from rltrain.llm.vllm.claim import ClaimLedger, holder
from rltrain.llm.vllm.server import ServerError, VLLMServer, call, check_server, server_command
from rltrain.run_dir import RunDirLock
from rltrain.validate import validate
from tests.conftest import make_config, run_cli
from tests.test_distributed import free_port
from tests.test_llm_runs import SHORT
from tests.test_run_management import learning_rows, signal_at
from tests.test_vllm import (
    GREEDY,
    PROMPTS,
    _force,
    _learner_probe,
    _left_behind,
    _shm,
    assert_episodes_train_on_the_engine_s_tokens,
    assert_once_each,
    connected,
    fails_when_killed_mid_run,
    learns_one_push_behind,
    scheme_of,
)

SERVER_START_S = 600  # a loaded 2-core machine; about 40 s on an idle one


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A vLLM server on the tiny model, started as docs/vllm.md says (its own session: it is the user's),
    stopped with its whole process group at the end: its URL, model dir, process and log."""
    here, shm = tmp_path_factory.mktemp("server"), _shm()
    model = write_tiny_model(here / "tiny")
    port = free_port()
    url, log = f"http://127.0.0.1:{port}", here / "server.log"
    env, argv = server_command(model, port, backend="gloo")  # docs/vllm.md's command; it takes either scheme
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, *argv[1:]], env={**os.environ, **env, "RLTRAIN_TEST_TAG": str(here)},
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + SERVER_START_S
        while not _healthy(url):
            assert proc.poll() is None, f"the vLLM server exited: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"the vLLM server did not start: {log.read_text()[-3000:]}"
            time.sleep(1.0)
        yield url, model, proc, log
    finally:
        _stop(proc, str(here))
        # the last test SIGKILLs the server, whose vLLM leaves its shared-memory queues (psm_*, Python's
        # SharedMemory) and a multiprocessing semaphore (sem.mp-*) behind: a user's server's own, not
        # rltrain's; removed so that reruns do not pile them up
        for name in _shm() - shm:
            if name.startswith(("psm_", "sem.mp-")):
                os.unlink(os.path.join("/dev/shm", name))


def _stop(proc, tag: str) -> None:
    """SIGTERM the server's process group, as a user's Ctrl-C would; SIGKILL what is left after 60 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 60
    while (left := _left_behind(tag)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)
    assert not left, f"the vLLM server's processes {left} outlived SIGTERM by 60 s"


def _healthy(url: str) -> bool:
    try:
        call(url, "/health", timeout=2)
        return True
    except Exception:  # noqa: BLE001  (not up yet)
        return False


def _connected(url: str, model_dir, learner=None, transport: str = "shared_mem", run_dir=None):
    model = LanguageModel(str(model_dir))
    learner = model.load() if learner is None else learner
    scheme = scheme_of(transport)
    sender = scheme.sender(learner)
    engine = VLLMServer(model, scheme.receiver(), url=url, timeout_s=120, run_dir=run_dir)
    try:
        return model, learner, sender, connected(scheme, sender, engine)
    except BaseException:
        engine.close()
        raise


def _server(url: str) -> tuple[str, str]:
    return "engine=vllm_server", f"engine.url={url}"


@pytest.mark.parametrize("transport", ["shared_mem", "gloo"])
def test_pushed_weights_reach_the_user_s_server_checked_where_they_land(server, transport):
    url, model_dir, *_ = server
    shm = _shm()
    model, learner, sender, engine = _connected(url, model_dir, transport=transport)
    tokenizer = model.tokenizer()
    original = {k: v.clone() for k, v in learner.state_dict().items()}
    ids = tokenizer("reverse 123: 321", add_special_tokens=False)["input_ids"]
    try:
        before = engine.generate(PROMPTS, 1, GREEDY)
        assert before.completion_ids.equal(TransformersEngine(learner, tokenizer).generate(PROMPTS, 1, GREEDY)
                                           .completion_ids)
        chosen = tokenizer.convert_tokens_to_ids("7")
        _force(learner, chosen)
        version = sender.push()
        assert engine.sync() == version
        logprobs, held = engine.probe(ids)  # asked of the server: what it computes with what it holds
        assert held == version and torch.allclose(logprobs, _learner_probe(model, learner, ids), atol=1e-4)
        forced = engine.generate(PROMPTS, 2, Sampling(max_new_tokens=5, greedy=True))
        assert forced.version == version and forced.texts == ["77777"] * 6
        learner.load_state_dict(original)
        restored = sender.push()
        after = engine.generate(PROMPTS, 1, GREEDY)
        assert after.version == restored and after.completion_ids.equal(before.completion_ids)
        assert after.logprobs.equal(before.logprobs)
        # sampled: each token's log-prob is the learner's, a seed repeats a batch, each prompt draws its own
        sampling = Sampling(temperature=0.7, max_new_tokens=4)
        first, again = (engine.generate(["3+5=", "3+5="], 4, sampling, seed=5) for _ in range(2))
        assert first.completion_ids.equal(again.completion_ids) and first.logprobs.equal(again.logprobs)
        assert first.texts[:4] != first.texts[4:]
        with torch.no_grad():
            ids = torch.cat([first.prompt_ids, first.completion_ids], dim=1)
            mask = torch.cat([first.prompt_mask, first.completion_mask], dim=1)
            logits = learner(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp_min(0)
                             ).logits[:, first.prompt_ids.shape[1] - 1:-1]
        ours = torch.log_softmax(logits / 0.7, -1).gather(-1, first.completion_ids[..., None]).squeeze(-1)
        kept = first.completion_mask.bool()
        assert (ours[kept] - first.logprobs[kept]).abs().max() < 1e-4
    finally:
        engine.close()
        sender.close()
    assert _shm() <= shm  # the slots reach the server through /proc, gloo over TCP: nothing named in /dev/shm


def test_a_learner_the_server_cannot_take_is_refused_naming_its_weights(server, tmp_path):
    url, model_dir, *_ = server
    wider = LanguageModel(str(write_tiny_model(tmp_path / "wider", hidden_size=96))).load()
    with pytest.raises(SyncError, match=r"weights version 0 do not fit the engine's model: vLLM's Qwen2ForCausalLM "
                                        r"cannot load the learner's model\.embed_tokens\.weight \(\d+, 96\)"):
        _connected(url, model_dir, wider)
    assert call(url, "/is_paused")["is_paused"] is False  # the failed update resumed the server
    # through vLLM's transfer API: names are checked before anything crosses the wire, shapes where they land
    other = LanguageModel(str(model_dir)).load()
    other.model.register_parameter("extra", torch.nn.Parameter(torch.zeros(2)))
    with pytest.raises(SyncError, match=r"the learner's weights are not the served model's \(.*\): not in the "
                                        r"served model: model\.extra"):
        _connected(url, model_dir, other, transport="gloo")
    with pytest.raises(CollectorError, match=r"failed while receiving weights version 0: .*cannot load the "
                                             r"learner's model\.embed_tokens\.weight \(\d+, 96\)"):
        _connected(url, model_dir, wider, transport="gloo")
    assert call(url, "/is_paused")["is_paused"] is False
    with pytest.raises(ServerError, match=re.escape("with sync.backend=ipc: the server takes no ipc weight "
                                                    "transfer (its backend: rltrain_gloo); restart it with "
                                                    "--weight-transfer-config '{\"backend\":\"ipc\"}'")):
        check_server(url, backend="ipc")
    with pytest.raises(CollectorError, match=r"the server computes in torch.float32, the learner in bfloat16 "
                                             r"\(model.dtype\); restart the server with --dtype bfloat16"):
        VLLMServer(LanguageModel(str(model_dir), dtype="bfloat16"), None, url=url)
    model, learner, sender, engine = _connected(url, model_dir)  # the server is as it was: the right one loads
    try:
        ids = model.tokenizer()("3+5=8", add_special_tokens=False)["input_ids"]
        assert torch.allclose(engine.probe(ids)[0], _learner_probe(model, learner, ids), atol=1e-4)
    finally:
        engine.close()


def test_episodes_of_several_turns_through_the_server_train_on_its_tokens_and_its_log_probs(server):
    # token-id prompts over HTTP, one request per turn across the episodes still running
    url, model_dir, *_ = server
    model, learner, sender, engine = _connected(url, model_dir)
    try:
        assert_episodes_train_on_the_engine_s_tokens(engine, learner, model.tokenizer())
    finally:
        engine.close()
        sender.close()


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shared_mem", "gloo"])
def test_the_single_token_task_learns_through_the_user_s_server_one_push_behind(server, tmp_path, transport):
    # gloo: each push waits for the batch in flight, then pauses the server around vLLM's transfer calls
    url, _, proc, _ = server
    sync = ["sync=vllm"] if transport == "shared_mem" else ["sync=vllm_transfer", f"sync.backend={transport}"]
    learns_one_push_behind(tmp_path / "run", *sync, engine=_server(url))
    assert proc.poll() is None and _healthy(url)  # the user's server goes on after the run


def test_a_run_through_the_server_stopped_by_sigterm_resumes_as_if_never_stopped(server, tmp_path):
    url, *_, log = server
    lagged = (*SHORT, *_server(url), "collector.max_lag=1")
    full = run_cli(*lagged, "hydra.run.dir=outputs/full", cwd=tmp_path)
    assert full.returncode == 0, full.stderr
    stopped = run_cli(*lagged, *signal_at(100), "hydra.run.dir=outputs/split", cwd=tmp_path)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
    assert json.loads((tmp_path / "outputs/split/summary.json").read_text())["frames"] == 128
    # the resumed run pushes the checkpoint's weights into the server first, and draws what the full run drew
    resumed = run_cli(*lagged, "resume=outputs/split", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert learning_rows(tmp_path / "outputs/split") == learning_rows(tmp_path / "outputs/full")
    # the server's worker logs vLLM's lines of an in-place reload once, not at every push (these runs pushed 16
    # times); the rest of a push's lines are the server's own (docs/vllm.md says which)
    assert_once_each(log.read_text(), "layerwise.py")


def _rpc(url: str, method: str, *args: str) -> dict:
    return call(url, "/collective_rpc", {"method": method, "args": list(args)})["results"][0]


def test_a_server_serves_one_run_at_a_time_and_names_the_run_holding_it(server, tmp_path):
    url, model_dir, *_ = server
    check = make_config("algo=grpo", *_server(url))
    lock = RunDirLock.acquire(tmp_path / "first")  # as build() holds its run dir, and names it to the server
    model, learner, sender, first = _connected(url, model_dir, run_dir=tmp_path / "first")
    try:
        named = rf"in use by another run \(run dir {re.escape(str(tmp_path / 'first'))}, pid {os.getpid()} on "
        with pytest.raises(ConfigError, match=named + r".*start a second server for this run on another --port"):
            validate(check)  # a second run: refused at its config check, before anything starts
        with pytest.raises(CollectorError, match=named):
            _connected(url, model_dir)
        # one started meanwhile (past its check): its claim is refused, and the server loads for the holder alone
        assert _rpc(url, "rltrain_claim", json.dumps(holder()))["held"]["run_dir"] == str(tmp_path / "first")
        assert "does not hold the server" in _rpc(url, "rltrain_load", "{}", holder()["token"])["error"]
        assert first.generate(PROMPTS, 1, GREEDY).version == sender.version  # the holder goes on
    finally:
        first.close()
        sender.close()
        lock.release()
    validate(check)  # released when it closed
    # a holder that dies without releasing it (a SIGKILLed learner) frees it at once
    learner_process = subprocess.Popen(["sleep", "600"])
    for _ in range(500):  # its /proc cmdline reads empty until it has exec'd sleep
        if Path(f"/proc/{learner_process.pid}/cmdline").read_bytes():
            break
        time.sleep(0.01)
    try:
        assert _rpc(url, "rltrain_claim", json.dumps(holder(learner_process.pid))) == {"leased": False}
        with pytest.raises(ConfigError, match=rf"in use by another run \(`sleep 600`, pid {learner_process.pid} on "):
            validate(check)
    finally:
        learner_process.kill()
        learner_process.wait()
    validate(check)


def test_a_claim_lasts_while_its_holder_lives_here_or_renews_it_from_elsewhere():
    now = [0.0]
    ledger = ClaimLedger(clock=lambda: now[0])
    learner_process = subprocess.Popen(["sleep", "600"])
    mine = holder()
    try:
        assert ledger.claim(holder(learner_process.pid)) is None
        now[0] += 3600  # a holder the server sees (this machine, this pid namespace) has no lease: it lives
        in_the_way = ledger.claim(mine)
        assert in_the_way["pid"] == learner_process.pid and "token" not in in_the_way
    finally:
        learner_process.kill()
        learner_process.wait()
    assert ledger.claim(mine) is None  # dead: free at once
    ledger.release(mine["token"])
    assert ledger.holder() is None
    assert ledger.claim({**holder(), "started": -1}) is None  # its pid is now another process's (reused): free
    assert ledger.claim(mine) is None
    ledger.release(mine["token"])
    # a holder the server cannot see (another machine or container) keeps it while it renews within its lease
    elsewhere = {**holder(), "where": "another machine"}
    assert ledger.claim(elsewhere) is None
    now[0] += 50
    assert ledger.claim(elsewhere) is None  # renewed
    now[0] += 50
    assert ledger.claim(mine) is not None
    now[0] += elsewhere["lease_s"]
    assert ledger.claim(mine) is None  # lapsed


@pytest.mark.parametrize(("url", "message"), [
    ("localhost:8000", "engine.url='localhost:8000' is not a URL"),
    ("http://127.0.0.1:{port}", "engine.url=http://127.0.0.1:{port}: no vLLM server answers there "
                                "([Errno 111] Connection refused); start one with: VLLM_SERVER_DEV_MODE=1"),
])
def test_a_server_that_does_not_answer_is_one_line_before_training(url, message):
    port = free_port()
    with pytest.raises(ConfigError, match=re.escape(message.format(port=port))):
        validate(make_config("algo=grpo", *_server(url.format(port=port))))


def test_a_server_engine_without_its_url_names_the_key():
    with pytest.raises(ConfigError, match=re.escape("engine.url is required by engine=vllm_server: give it on the "
                                                    "command line, e.g. engine.url=...")):
        validate(make_config("algo=grpo", "engine=vllm_server"))


def test_a_server_killed_mid_run_fails_the_run_naming_it(server, tmp_path):
    # last: it kills the module's server
    url, model_dir, proc, _ = server
    shm = _shm()
    err = fails_when_killed_mid_run(tmp_path, lambda run: os.killpg(proc.pid, signal.SIGKILL), engine=_server(url))
    assert _shm() <= shm
    named = re.escape(url)
    assert re.search(rf"the vLLM server at {named} failed while [^:]+: no answer from {named}", err), err[-2000:]
    with pytest.raises(CollectorError, match="no vLLM server answers there"):
        VLLMServer(LanguageModel(str(model_dir)), None, url=url, timeout_s=5)
