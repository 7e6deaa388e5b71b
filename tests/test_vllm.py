"""``engine=vllm`` with ``sync=vllm`` (and ``sync=vllm_transfer``): a real vLLM engine (the CPU build) in a
process of its own, serving the tiny model. Engines start in seconds but each costs a process: the tests share one
where they can."""

from __future__ import annotations

import importlib.util
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

from rltrain import checkpoint
from rltrain.errors import CollectorError, ConfigError
from rltrain.factory import build
from rltrain.llm.engine import Sampling, TransformersEngine
from rltrain.llm.model import LanguageModel
from rltrain.llm.tiny import write_tiny_model
from rltrain.llm.vllm.slots import VLLMSlotsSync
from rltrain.llm.vllm.transfer import VLLMTransferSync
from rltrain.validate import validate
from tests.conftest import ROOT, make_config, run_cli, without_package
from tests.test_distributed import run_dirs, torchrun
from tests.test_grpo import ONE_TOKEN
from tests.test_llm_runs import SHORT
from tests.test_outputs import read_jsonl
from tests.test_run_management import learning_rows, signal_at

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("CI"):  # the quick start installs it: in CI a missing vLLM is a failure, not a skip
        raise RuntimeError("vLLM is not installed, but the suite's install has it (pip install -e '.[dev,vllm]')")
    pytest.skip("vLLM is not installed (pip install 'rltrain[vllm]')", allow_module_level=True)

VLLM = ("engine=vllm",)  # it chooses sync=vllm
_OMP_BEFORE = os.environ.get("OMP_NUM_THREADS")
PROMPTS = ["reverse 4:", "3+5=", "sort 93:"]
GREEDY = Sampling(max_new_tokens=6, greedy=True)


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


def _left_behind(tag: str) -> list[int]:
    """The processes still alive that a run started with ``RLTRAIN_TEST_TAG=tag`` in its environment
    (its engine inherits it)."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("RLTRAIN_TEST_TAG") == tag:
                found.append(p.info["pid"])
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            pass
    return found


def scheme_of(transport: str):
    """``sync=vllm`` (``shared_mem``: the slots) or ``sync=vllm_transfer`` with that backend."""
    return VLLMSlotsSync() if transport == "shared_mem" else VLLMTransferSync(backend=transport)


def connected(scheme, sender, engine):
    """What build does once the engine runs: a scheme that pushes into it joins it (and pushes the weights)."""
    if scheme.DELIVERS == "push":
        sender.connect(engine.transfer_client())
    return engine


@pytest.fixture(scope="module", params=["shared_mem", "gloo"])
def served(request, tmp_path_factory):
    """A learner (the tiny model), its sync=vllm sender (or sync=vllm_transfer's, each backend that runs on
    the CPU), and a vLLM engine on the same model dir."""
    from rltrain.llm.vllm.engine import VLLMEngine

    model = LanguageModel(str(write_tiny_model(tmp_path_factory.mktemp("model") / "tiny")))
    learner = model.load()
    scheme = scheme_of(request.param)
    sender = scheme.sender(learner)
    engine = connected(scheme, sender, VLLMEngine(model, scheme.receiver(), timeout_s=60))
    yield model, learner, sender, engine
    engine.close()
    sender.close()


def _learner_probe(model, learner, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = learner(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)


def _force(learner, token: int) -> None:
    """Weights under which the model's most likely next token is ``token`` whatever it reads: no layer
    writes to the residual stream (o_proj and down_proj are 0), so the final state is the input's
    embedding; every embedding is e_0, ``token``'s 2 e_0, and the output layer is the embedding (tied)."""
    with torch.no_grad():
        for name, p in learner.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
        embedding = learner.model.embed_tokens.weight
        embedding.zero_()
        embedding[:, 0] = 1.0
        embedding[token, 0] = 2.0


def test_pushed_weights_arrive_checked_by_the_engine_and_change_its_generation(served):
    import psutil

    model, learner, sender, engine = served
    # one OpenMP thread (engine.threads): vLLM's default spins on every core, and beside a busy
    # learner it generated 10-15x slower (benchmarks/RESULTS.md); the learner's own setting is left alone
    assert psutil.Process(engine.pid).environ().get("OMP_NUM_THREADS") == "1"
    assert os.environ.get("OMP_NUM_THREADS") == _OMP_BEFORE
    tokenizer = model.tokenizer()
    original = {k: v.clone() for k, v in learner.state_dict().items()}
    ids = tokenizer("reverse 123: 321", add_special_tokens=False)["input_ids"]
    before = engine.generate(PROMPTS, 1, GREEDY)
    # vLLM's greedy completions are the learner's own, token for token, on the same weights
    ours = TransformersEngine(learner, tokenizer).generate(PROMPTS, 1, GREEDY)
    assert before.completion_ids.equal(ours.completion_ids)
    try:
        chosen = tokenizer.convert_tokens_to_ids("7")
        _force(learner, chosen)
        version = sender.push()
        assert engine.sync() == version
        # asked of the engine: the log-probs it computes with what it holds are the learner's
        logprobs, held = engine.probe(ids)
        assert held == version and torch.allclose(logprobs, _learner_probe(model, learner, ids), atol=1e-4)
        forced = engine.generate(PROMPTS, 2, Sampling(max_new_tokens=5, greedy=True))
        assert forced.version == version and (forced.completion_ids == chosen).all()
        assert forced.texts == ["77777"] * 6
    finally:
        learner.load_state_dict(original)
        restored = sender.push()
    after = engine.generate(PROMPTS, 1, GREEDY)
    assert after.version == restored and after.completion_ids.equal(before.completion_ids)
    assert after.logprobs.equal(before.logprobs)
    logprobs, _ = engine.probe(ids)
    assert torch.allclose(logprobs, _learner_probe(model, learner, ids), atol=1e-4)


def test_a_push_while_a_batch_is_generated_never_mixes_two_versions(served):
    model, learner, sender, engine = served
    original = {k: v.clone() for k, v in learner.state_dict().items()}
    chosen = model.tokenizer().convert_tokens_to_ids("7")
    forced = Sampling(max_new_tokens=5, greedy=True)
    held = engine.sync()
    try:
        engine.submit(PROMPTS, 4, forced)  # as collector.max_lag=1 does, then the learner pushes meanwhile
        _force(learner, chosen)
        version = sender.push()
        batch = engine.collect()
        # the batch asked for before the push is the old weights' alone; the next one the new weights'
        assert batch.version == held and not any(text == "77777" for text in batch.texts)
        after = engine.generate(PROMPTS, 4, forced)
        assert after.version == version and after.texts == ["77777"] * 12
    finally:
        learner.load_state_dict(original)
        sender.push()


def test_sampled_log_probs_are_the_learner_s_and_a_seed_repeats_a_batch(served):
    model, learner, sender, engine = served
    sampling = Sampling(temperature=0.7, max_new_tokens=4, stop=("3",))
    first = engine.generate(PROMPTS, 4, sampling, seed=5)
    again = engine.generate(PROMPTS, 4, sampling, seed=5)
    assert first.completion_ids.equal(again.completion_ids) and first.version == sender.version
    assert first.prompt_ids.shape[0] == 12 and first.completion_mask.sum(1).le(4).all()
    twice = engine.generate(["reverse 4:"] * 2, 4, Sampling(max_new_tokens=8), seed=5).completion_ids
    assert len({tuple(row) for row in twice.tolist()}) == 8  # each completion its own random numbers, one seed
    ends = [t for t in first.texts if "3" in t]
    assert all(t.endswith("3") for t in ends)  # a stop string ends its completion, and is kept
    with torch.no_grad():
        ids = torch.cat([first.prompt_ids, first.completion_ids], dim=1)
        mask = torch.cat([first.prompt_mask, first.completion_mask], dim=1)
        logits = learner(input_ids=ids, attention_mask=mask,
                         position_ids=(mask.cumsum(1) - 1).clamp_min(0)).logits[:, first.prompt_ids.shape[1] - 1:-1]
    ours = torch.log_softmax(logits.float() / 0.7, -1).gather(-1, first.completion_ids[..., None]).squeeze(-1)
    kept = first.completion_mask.bool()
    assert (ours[kept] - first.logprobs[kept]).abs().max() < 1e-4  # the mismatch tis_cap corrects: small here


def test_episodes_of_several_turns_through_vllm_train_on_its_tokens_and_its_log_probs(served):
    # the guessing game's episodes, generated by vLLM from token ids (a conversation is never tokenized again;
    # vLLM's prefix cache could keep it, but its 128-token blocks are longer than these): the learner's log-probs of the
    # model's tokens equal vLLM's (measured: 4.8e-7 at most over 4,457 tokens of 512 episodes)
    model, learner, sender, engine = served
    assert_episodes_train_on_the_engine_s_tokens(engine, learner, model.tokenizer())


def assert_episodes_train_on_the_engine_s_tokens(engine, learner, tokenizer) -> None:
    """512 episodes of the guessing game through ``engine``, most of them of several turns: the learner's
    log-probs of the model's tokens equal the engine's within 1e-4. A later turn's prompts hold more tokens than
    one of vLLM's steps (4,096 by default): split over steps, the CPU build failed on its seeded requests."""
    from rltrain.algos.grpo import token_logprobs
    from rltrain.llm.environments import GuessNumber
    from rltrain.llm.rewards import Rewards
    from rltrain.llm.rollout import Conversation, Limits, as_batch, run_episodes

    env = GuessNumber(low=1, high=9, max_guesses=3, seed=4)
    sampling = Sampling(max_new_tokens=3)
    episodes, _ = run_episodes(engine, env, Conversation(tokenizer, template=False), env.take(128), 4, sampling,
                               Limits(max_turns=3), seed=0)
    assert sum(e.turns > 1 for e in episodes) > 256
    assert sum(len(e.prompt) for e in episodes if e.turns > 1) > 4096  # the second turn's prompts, at the least
    flat = as_batch(episodes, 4, sampling, Rewards({}, required=False), tokenizer.pad_token_id, engine.version,
                    0.0, 9).reshape(-1)
    with torch.no_grad():
        ours, _ = token_logprobs(learner, flat, group_size=4)
    own = flat["loss_mask"].bool()
    assert (ours[own] - flat["log_prob"][own]).abs().max() < 1e-4


@pytest.mark.parametrize(("learner", "message"), [
    ({"hidden_size": 96}, r"vLLM's Qwen2ForCausalLM cannot load the learner's model\.embed_tokens\.weight \(\d+, 96\)"),
    ({"arch": "llama"}, r"the learner's weights are not the served model's: missing: "
                        r"model\.layers\.0\.self_attn\.k_proj\.bias"),
])
def test_a_learner_whose_weights_vllm_cannot_take_is_refused_naming_them(tmp_path, learner, message):
    from multiprocessing import resource_tracker

    import psutil

    from rltrain.llm.vllm.engine import VLLMEngine

    served_dir = write_tiny_model(tmp_path / "served")  # a Qwen2 (biases on q, k, v); a Llama has none
    other = LanguageModel(str(write_tiny_model(tmp_path / "other", **learner))).load()
    scheme = VLLMSlotsSync()
    scheme.sender(other)
    resource_tracker.ensure_running()  # multiprocessing's own helper, for the whole process: not the engine's
    before = set(psutil.Process().children())
    with pytest.raises(CollectorError, match=r"do not fit the engine's model: " + message):
        VLLMEngine(LanguageModel(str(served_dir)), scheme.receiver(), timeout_s=60)
    assert not [p for p in set(psutil.Process().children()) - before
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]  # the engine is gone


def _perturb_adapters(learner, seed: int) -> None:
    """Adapters that change the model (B starts at 0), different for each ``seed``."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in learner.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def test_a_lora_learner_pushes_its_adapters_alone_and_the_engine_applies_each_version(tmp_path):
    import tempfile

    from rltrain.llm.vllm.engine import VLLMEngine
    from rltrain.llm.vllm.loading import adapter_weights, served_weights

    model = LanguageModel(str(write_tiny_model(tmp_path / "tiny")), lora_rank=4)
    learner = model.load()
    _perturb_adapters(learner, 0)
    scheme = VLLMSlotsSync()  # sync.adapters=true, the default
    sender = scheme.sender(learner)
    pushed = sum(t.nbytes for t in adapter_weights(learner).values())
    assert pushed * 8 < sum(t.nbytes for t in served_weights(learner).values())  # (rank 4 of 64-wide layers)
    receiver = scheme.receiver()
    assert receiver.adapters
    before = set(Path(tempfile.gettempdir()).glob("rltrain-adapters-*"))
    engine = VLLMEngine(model, receiver, timeout_s=60)
    try:
        ids = model.tokenizer()("reverse 123: 321", add_special_tokens=False)["input_ids"]
        held, version = engine.probe(ids)
        assert version == 0 and torch.allclose(held, _learner_probe(model, learner, ids), atol=1e-4)
        with learner.disable_adapter():
            assert not torch.allclose(held, _learner_probe(model, learner, ids), atol=1e-2)  # not the base alone
        for seed in (1, 2):  # each version applied, never an earlier one vLLM still has cached
            _perturb_adapters(learner, seed)
            pushed_version = sender.push()
            newer, version = engine.probe(ids)
            assert version == pushed_version and torch.allclose(newer, _learner_probe(model, learner, ids), atol=1e-4)
            assert not torch.allclose(newer, held, atol=1e-2)
            held = newer
        generated = engine.generate(PROMPTS, 2, Sampling(max_new_tokens=4))  # sampled under the newest adapters
        assert generated.version == 2 and generated.logprobs.isfinite().all()
    finally:
        engine.close()
    assert set(Path(tempfile.gettempdir()).glob("rltrain-adapters-*")) == before  # each version's files removed


def test_a_lora_run_samples_every_batch_under_the_adapters_its_learner_pushed(tmp_path):
    summary = build(make_config(*SHORT, *VLLM, "model.lora_rank=4"), run_dir=tmp_path).fit()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert summary["status"] == "completed" and summary["sync"]["pushes"] == 8
    # a new adapter version after each update, and the engine's log-probs are the learner's on every token
    assert [row["sync/version"] for row in rows] == list(range(1, 9)) and summary["sync"]["max_lag"] == 0
    assert all(abs(row["grpo/tis/ratio_max"] - 1) < 1e-3 for row in rows), [r["grpo/tis/ratio_max"] for r in rows]
    assert all(abs(row["grpo/tis/ratio_mean"] - 1) < 1e-4 for row in rows), [r["grpo/tis/ratio_mean"] for r in rows]


def test_a_lora_learner_reaches_the_engine_merged_with_sync_adapters_false(tmp_path):
    from rltrain.llm.vllm.engine import VLLMEngine

    model = LanguageModel(str(write_tiny_model(tmp_path / "tiny")), lora_rank=4)
    learner = model.load()
    _perturb_adapters(learner, 0)
    scheme = VLLMSlotsSync(adapters=False)
    scheme.sender(learner)
    engine = VLLMEngine(model, scheme.receiver(), timeout_s=60)
    try:
        ids = model.tokenizer()("reverse 123: 321", add_special_tokens=False)["input_ids"]
        merged = LanguageModel.merged(learner)
        held, _ = engine.probe(ids)
        assert torch.allclose(held, _learner_probe(model, merged, ids), atol=1e-4)  # the merged model
        with learner.disable_adapter():
            base = _learner_probe(model, learner, ids)
        assert not torch.allclose(held, base, atol=1e-2)  # never the base weights alone
    finally:
        engine.close()


@pytest.mark.slow
def test_the_single_token_task_learns_through_vllm_generating_one_push_behind(tmp_path):
    # collector.max_lag=1: each batch is generated while the learner updates on the one before, with the
    # weights one push older than the learner's; GRPO's truncated importance sampling corrects for it
    learns_one_push_behind(tmp_path / "run")


def learns_one_push_behind(run_dir, *overrides: str, engine: tuple[str, ...] = VLLM) -> None:
    """The single-token task, through vLLM one push behind: from chance to near perfect in 19,200
    completions, with the lag corrected."""
    summary = build(make_config(*ONE_TOKEN, *engine, "collector.max_lag=1", *overrides), run_dir=run_dir).fit()
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert summary["status"] == "completed" and summary["frames"] == 19200
    assert rows[0]["reward/mean"] < 0.2, rows[0]  # chance, from random weights
    assert rows[-1]["reward/mean"] > 0.8 and summary["train_return"] > 0.8, rows[-1]
    assert summary["eval_return"] > 0.9
    assert summary["sync"]["pushes"] == 150 and summary["sync"]["max_lag"] == 1  # one push behind, no more
    # the learner has moved on from the sampler (the engine's numerics alone differ by ~1e-6)
    assert max(row["grpo/tis/ratio_max"] for row in rows) > 1.01


def test_grpo_on_two_ddp_ranks_generates_with_an_engine_per_rank_holding_its_learners_weights(tmp_path,
                                                                                               monkeypatch):
    tag = str(tmp_path)
    monkeypatch.setenv("RLTRAIN_TEST_TAG", tag)
    result = torchrun("strategy=ddp", *SHORT, *VLLM, cwd=tmp_path, nproc=2, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    [run_dir] = run_dirs(tmp_path)
    summary, rows = json.loads((run_dir / "summary.json").read_text()), read_jsonl(run_dir / "metrics.jsonl")
    assert summary["status"] == "completed" and summary["frames"] == 256 and summary["sync"]["pushes"] == 8
    # every batch sampled by each rank's engine with the weights its learner held, a new version after each
    # update (the largest ratio of any rank's tokens: the engine's numerics alone differ by ~1e-6)
    assert all(abs(row["grpo/tis/ratio_max"] - 1) < 1e-3 for row in rows), [r["grpo/tis/ratio_max"] for r in rows]
    assert [row["sync/version"] for row in rows] == list(range(1, 9)) and summary["sync"]["max_lag"] == 0
    assert "learner rank 1 of 2" in (run_dir / "ranks" / "1.log").read_text()
    assert not _left_behind(tag)  # both engines stopped with their ranks


def test_grpo_lora_on_two_fsdp_ranks_pushes_each_ranks_engine_the_adapters_gathered_from_the_shards(tmp_path,
                                                                                                      monkeypatch):
    tag = str(tmp_path)
    monkeypatch.setenv("RLTRAIN_TEST_TAG", tag)
    result = torchrun("strategy=fsdp", *SHORT, *VLLM, "model.lora_rank=4", cwd=tmp_path, nproc=2, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    [run_dir] = run_dirs(tmp_path)
    summary, rows = json.loads((run_dir / "summary.json").read_text()), read_jsonl(run_dir / "metrics.jsonl")
    assert summary["status"] == "completed" and summary["frames"] == 256 and summary["sync"]["pushes"] == 8
    # each rank's engine applies the adapters its learner's shards gathered into: the learner's log-probs
    assert all(abs(row["grpo/tis/ratio_max"] - 1) < 1e-3 for row in rows), [r["grpo/tis/ratio_max"] for r in rows]
    assert [row["sync/version"] for row in rows] == list(range(1, 9))
    # the eval generates with the sharded peft model; the checkpoint holds each rank's shards
    assert "eval_return" in summary and (run_dir / "model-adapter").is_dir()
    assert [p.name for p in checkpoint.listing(run_dir)] == ["frames_000000000256.dcp"]
    assert not _left_behind(tag)


def test_a_run_stopped_by_sigterm_stops_its_engine_and_resumes_as_if_never_stopped(tmp_path):
    # one push behind: the checkpoint holds the batch generated ahead, and the resumed run returns it first
    lagged = (*SHORT, *VLLM, "collector.max_lag=1")
    full = run_cli(*lagged, "hydra.run.dir=outputs/full", cwd=tmp_path)
    assert full.returncode == 0, full.stderr
    # vLLM's lines of an in-place reload (the layers that have no weights to load, the prefix cache reset) are
    # shown once, not at every push (8 in this run)
    for source in ("layerwise.py", "block_pool.py"):
        assert_once_each(full.stdout + full.stderr, source)
    tag = str(tmp_path)
    stopped = run_cli(*lagged, *signal_at(100), "hydra.run.dir=outputs/split", cwd=tmp_path,
                      env={"RLTRAIN_TEST_TAG": tag})
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
    assert json.loads((tmp_path / "outputs/split/summary.json").read_text())["frames"] == 128
    assert not _left_behind(tag)  # the engine stopped with the run
    # the resumed run's engine starts from the checkpoint's weights, and draws what the full run drew
    resumed = run_cli(*lagged, "resume=outputs/split", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert learning_rows(tmp_path / "outputs/split") == learning_rows(tmp_path / "outputs/full")


@pytest.mark.parametrize("transport", ["shared_mem", "gloo"])
def test_an_engine_killed_mid_run_fails_the_run_naming_it(tmp_path, transport):
    import psutil

    shm, tag, engine = _shm(), str(tmp_path), []

    def kill_engine(run):
        engine.extend(p for p in psutil.Process(run.pid).children() if "spawn_main" in " ".join(p.cmdline()))
        engine[0].kill()

    sync = ["sync=vllm"] if transport == "shared_mem" else ["sync=vllm_transfer", f"sync.backend={transport}"]
    err = fails_when_killed_mid_run(tmp_path, kill_engine, *sync, env={"RLTRAIN_TEST_TAG": tag})
    # mid-generation or mid-push (gloo: most of a step is pushes), the engine is named, not waited for
    assert f"the vLLM engine (pid {engine[0].pid}) died (killed by SIGKILL) while" in err, err[-2000:]
    assert not _left_behind(tag) and _shm() <= shm


def assert_once_each(log: str, source: str) -> None:
    """Each of the lines ``source`` (a vLLM file) logged is in ``log`` once at most, and vLLM's "Failed to load
    weights" not at all (rltrain says what it means)."""
    lines = [line.split("] ", 1)[1] for line in log.splitlines() if f"[{source}:" in line]
    assert lines and len(lines) == len(set(lines)), lines[:6]
    assert "Failed to load weights" not in log


def fails_when_killed_mid_run(tmp_path, kill, *overrides: str, env: dict | None = None,
                              engine: tuple[str, ...] = VLLM) -> str:
    """Start a long vLLM run, ``kill(run)`` (its Popen) once it has logged, and return its stderr once it
    has failed, as a CollectorError."""
    run = subprocess.Popen([sys.executable, "-m", "rltrain", *SHORT, *engine, "trainer.total_frames=1000000",
                            "engine.timeout_s=60", "hydra.run.dir=run", *overrides], cwd=tmp_path,
                           env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "run/metrics.jsonl").exists() or not (tmp_path / "run/metrics.jsonl").read_text():
            assert run.poll() is None and time.monotonic() < deadline, "the run ended or never started training"
            time.sleep(0.2)
        kill(run)
        _, err = run.communicate(timeout=120)
    finally:
        run.kill()
    assert run.returncode != 0
    summary = json.loads((tmp_path / "run/summary.json").read_text())
    assert summary["status"].startswith("failed: CollectorError")
    # The learner was healthy: its checkpoint and model are kept, and the message says how to resume.
    assert checkpoint.listing(tmp_path / "run")[-1].name == checkpoint.path_for(tmp_path, summary["frames"]).name
    assert (tmp_path / "run/model/config.json").is_file()
    assert f"The learner was kept: checkpoint frames_{summary['frames']:012d}.pt" in err, err[-2000:]
    # Its task resumes with the prompts of the batch the engine failed on: none is skipped (4 completions each).
    kept = checkpoint.load(checkpoint.listing(tmp_path / "run")[-1])["collector"]
    assert kept["task"]["position"] * 4 == summary["frames"] and kept["batches"] * 32 == summary["frames"], kept
    return err


@pytest.mark.parametrize(("overrides", "message"), [
    (("algo=grpo", *VLLM, "sync=shared_mem"), "sync=shared_mem delivers weights as module, and engine=vllm takes "
                                               "them as snapshot or push; use sync=vllm or sync=vllm_transfer"),
    (("algo=grpo", "sync=vllm"), "sync=vllm delivers weights as snapshot, and engine=transformers takes them as "
                                 "module; use sync=shared_mem"),  # (only what the other checks let through too)
    (("sync=vllm",), "sync=vllm delivers weights as snapshot, and collector=local takes them as module"),  # CartPole
    (("engine=transformers",), "engine=transformers generates completions for a language task"),  # CartPole
    (("engine=vllm",), "engine=vllm generates completions for a language task"),  # (its sync=vllm beside the point)
    (("algo=grpo", "+collector.engine=vllm"), "collector.engine is now engine=transformers|vllm|vllm_server"),
    (("algo=grpo", "collector.max_lag=1"), "collector.max_lag=1 generates the next batch while the learner updates, "
                                           "which engine=transformers cannot"),
    (("algo=grpo", *VLLM, "collector.max_lag=2"), "collector.max_lag must be 0 (generate, then update) or 1"),
    (("algo=grpo", *VLLM, "collector.top_p=0.9"), "collector.top_p=0.9 with a vLLM engine"),
    (("algo=grpo", *VLLM, "+sync.every=2"), "sync.every is no key of sync=vllm"),
    (("algo=grpo", *VLLM, "+sync.transport=gloo"), "sync.transport is now the scheme itself"),
    (("algo=grpo", *VLLM, "sync=vllm_transfer", "sync.backend=nccl"),
     "sync.backend=nccl moves GPU tensors, and the learner is on cpu"),
    (("algo=grpo", *VLLM, "sync=vllm_transfer", "sync.backend=ipc"), "sync.backend=ipc moves GPU tensors"),
    (("algo=grpo", *VLLM, "sync=vllm_transfer", "sync.backend=tcp"), "sync.backend"),
    (("algo=grpo", "+collector.vllm_url=http://127.0.0.1:8000"),
     "collector.vllm_url is now engine=vllm_server engine.url=URL"),
    (("algo=grpo", "+algo.temperature=0.5"), "algo.temperature is now collector.temperature"),
    (("algo=grpo", "engine=vllm_server", "engine.url=http://127.0.0.1:8000", "model.lora_rank=4"),
     "model.lora_rank=4 with engine=vllm_server: rltrain pushes a server the merged weights, not the adapters alone; "
     "add sync.adapters=false"),
    (("algo=grpo", *VLLM, "model.lora_rank=600"), "model.lora_rank=600: vLLM applies adapters of rank 512 at most; "
                                                  "push the merged weights instead (sync.adapters=false)"),
])
def test_an_engine_and_a_sync_that_do_not_go_together_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(make_config(*overrides))


def test_without_vllm_the_pip_install_is_named(monkeypatch):
    without_package(monkeypatch, "vllm")
    with pytest.raises(ConfigError, match=r"engine=vllm needs vLLM, which is not installed: "
                                          r"pip install 'rltrain\[vllm\]'"):
        validate(make_config("algo=grpo", *VLLM))
    # a server of the user's needs no vLLM beside the learner, unless the learner drives vLLM's transfer API
    with pytest.raises(ConfigError, match=r"sync=vllm_transfer drives vLLM's weight-transfer API from the learner, "
                                          r"and vLLM is not installed here"):
        validate(make_config("algo=grpo", "engine=vllm_server", "engine.url=http://127.0.0.1:8000",
                             "sync=vllm_transfer"))
