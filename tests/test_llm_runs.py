"""A language model's run is an rltrain run: its outputs, checkpoint and exact resume, its Hugging Face
model dir, and bad input refused before anything loads, in one line naming the key."""

from __future__ import annotations

import json
import re
import shutil
import signal

import pytest
import torch

from rltrain import build, checkpoint
from rltrain.errors import ConfigError, RunError
from rltrain.llm.tiny import write_tiny_model
from rltrain.validate import validate
from tests.conftest import ROOT, make_config, run_cli, without_package
from tests.test_outputs import read_jsonl
from tests.test_run_management import learning_rows, signal_at

SHORT = ("algo=grpo", "collector.frames_per_batch=32", "collector.group_size=4", "trainer.total_frames=256", "seed=1",
         "~hooks.log.every", "+hooks.log.every={batches:1}", "hooks.eval.prompts=8")


def test_a_run_ends_like_every_run_with_a_model_dir_transformers_loads(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    summary = build(make_config(*SHORT), run_dir=tmp_path / "run").fit()
    run = tmp_path / "run"
    assert summary["status"] == "completed" and summary["frames"] == 256 and summary["updates"] == 8
    assert summary["sync"]["pushes"] == 8 and summary["sync"]["max_lag"] == 0 and summary["eval_return"] is not None
    row = read_jsonl(run / "metrics.jsonl")[-1]
    for key in ("reward/mean", "reward/std", "reward/correct/mean", "reward/correct/std", "completion/length",
                "completion/truncated", "grpo/clip_fraction", "grpo/entropy", "grpo/loss",
                "perf/generated_tokens_per_s", "perf/trained_tokens_per_s", "sync/lag", "eval/return",
                "eval/reward/correct", "time/collect"):
        assert key in row, key
    saved = checkpoint.load(checkpoint.listing(run)[-1])
    assert saved["collector"] == {"task": {"position": 64}, "seed": 1, "batches": 8, "ranks": 1}  # 8 batches of 8
    model = AutoModelForCausalLM.from_pretrained(run / "model")
    learner = saved["algo"]["policy"]
    assert all(torch.equal(t, learner[name]) for name, t in model.state_dict().items())
    assert AutoTokenizer.from_pretrained(run / "model").decode([7, 8]) != ""


@pytest.mark.parametrize("weights", [(), ("model.lora_rank=4", "algo.kl_coef=0.1"),
                                     ("env=guess", "collector.max_new_tokens=2")], ids=["all", "lora", "episodes"])
def test_a_run_stopped_by_sigterm_and_resumed_matches_an_uninterrupted_one(weights, tmp_path):
    full = run_cli(*SHORT, *weights, "hydra.run.dir=outputs/full", cwd=tmp_path)
    assert full.returncode == 0, full.stderr
    stopped = run_cli(*SHORT, *weights, *signal_at(100), "hydra.run.dir=outputs/split", cwd=tmp_path)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
    assert json.loads((tmp_path / "outputs/split/summary.json").read_text())["frames"] == 128
    resumed = run_cli(*SHORT, *weights, "resume=outputs/split", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    # Every row as if it had never stopped: the same prompts, samples, rewards, losses and evaluation.
    assert learning_rows(tmp_path / "outputs/split") == learning_rows(tmp_path / "outputs/full")


def test_sigterm_while_a_batchs_turns_are_played_finishes_the_batch_then_resumes_as_an_uninterrupted_run(tmp_path):
    # The signal lands inside an environment's step (GuessThatSignals, at the 100th step of the process): the batch's
    # episodes are played to their ends and trained on, then the run checkpoints and stops; resumed, it logs every
    # row of the run that never stopped.
    guess = (*SHORT, "env=guess", "env._target_=tests.parts_for_tests.GuessThatSignals", "collector.max_new_tokens=2")
    full = run_cli(*guess, "hydra.run.dir=outputs/full", cwd=tmp_path)
    assert full.returncode == 0, full.stderr
    stopped = run_cli(*guess, "hydra.run.dir=outputs/split", cwd=tmp_path, env={"RLTRAIN_TEST_SIGTERM_AT_STEP": "100"})
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
    frames = json.loads((tmp_path / "outputs/split/summary.json").read_text())["frames"]
    assert 32 <= frames < 256 and frames % 32 == 0  # whole batches: the one under way when the signal came, too
    resumed = run_cli(*guess, "resume=outputs/split", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert learning_rows(tmp_path / "outputs/split") == learning_rows(tmp_path / "outputs/full")


def test_a_reward_function_that_raises_fails_the_run_naming_it_and_the_prompt(tmp_path):
    cfg = make_config(*SHORT, "+env.rewards.mine._target_=tests.parts_for_tests.reward_that_raises")
    with pytest.raises(RunError, match=r"reward function mine raised KeyError: 'score' on the prompt 'reverse \d:'"):
        build(cfg, run_dir=tmp_path / "run").fit()
    assert json.loads((tmp_path / "run/summary.json").read_text())["status"].startswith("failed: RunError")


@pytest.fixture(scope="module")
def no_tokenizer(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("models") / "tiny")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).unlink()
    return path


@pytest.mark.parametrize("overrides, message", [
    (("model.path=/no/such/model",), r"model.path=/no/such/model: no such dir, and not a Hugging Face hub id"),
    (("model.path={no_tokenizer}",), r"model.path=.* has no tokenizer .*tokenizer.save_pretrained"),
    (("model.path={no_tokenizer}/..",), r"has no config.json: not a transformers model dir"),
    (("collector.group_size=1", "collector.frames_per_batch=16"),
     r"collector.group_size=1 with algo=grpo: a group of one completion has no std"),
    (("collector.group_size=1", "collector.frames_per_batch=16", "algo.scale_rewards=false"),
     r"collector.group_size=1 with algo=grpo: a group of one completion has no spread to learn from"),
    (("collector.greedy=true",), r"collector.greedy=true with algo=grpo: every completion of a group would be"),
    (("env=dataset",), r"env.path is required by env=dataset"),
    (("collector.frames_per_batch=100",), r"collector.frames_per_batch \(100\) must be a multiple of "
                                          r"collector.group_size \(8\)"),
    (("+env.rewards.bad._target_=os.sep",), r"env.rewards.bad._target_=os.sep is not callable"),
    (("+env.rewards.bad._target_=no_such_module.f",), r"env.rewards.bad._target_='no_such_module.f' cannot be "
                                                      "imported"),
    (("+env.reward_weights.typo=2",), r"env.reward_weights names typo, which env.rewards does not have"),
    (("env.length=0",), r"env.length"),
    (("algo=ppo", "env=reverse", "model=tiny", "collector=generation"), r"is a language task .* use algo=grpo"),
    (("env=cartpole",), r"algo=GRPO trains a language model .* env.id='CartPole-v1' is a gymnasium env"),
    (("collector=local", "~collector.max_new_tokens"),
     r"the language task ReverseDigits needs a collector that generates text"),
    (("sync=pipe",), r"sync=pipe sends weights to worker processes"),
    (("sync=none",), r"algo=grpo with sync=none: GRPO's ratios"),
    (("model.dtype=int8",), r"model.dtype must be one of float32, bfloat16, float16"),
    (("algo.tis_cap=0.5",), r"algo.tis_cap must be a number >= 1, or null \(the ratio against the sampling"),
])
def test_bad_input_is_refused_before_anything_loads(overrides, message, no_tokenizer):
    cfg = make_config("algo=grpo", *(o.format(no_tokenizer=no_tokenizer) for o in overrides))
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


def test_a_prompt_longer_than_the_context_is_refused(tmp_path):
    rows = [{"prompt": "reverse 12:", "answer": "21"}] * 9 + [{"prompt": "x" * 300, "answer": "1"}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = make_config("algo=grpo", "env=dataset", f"env.path={tmp_path / 'rows.jsonl'}")
    with pytest.raises(ConfigError, match=r"a prompt of 300 tokens plus collector.max_new_tokens=2 exceeds the "
                                          r"context of model.path=tiny \(256 tokens\)"):
        validate(cfg)


def test_without_transformers_the_pip_install_is_named(monkeypatch):
    without_package(monkeypatch, "transformers")
    with pytest.raises(ConfigError, match=r"needs transformers, which is not installed: pip install 'rltrain\[llm\]'"):
        validate(make_config("algo=grpo"))


def test_a_copied_model_dir_is_a_run_s_model(tmp_path):
    path = shutil.copytree(write_tiny_model(tmp_path / "tiny", arch="llama"), tmp_path / "mine")
    cfg = make_config(*SHORT, f"model.path={path}", "trainer.total_frames=64")
    summary = build(cfg, run_dir=tmp_path / "run").fit()
    assert summary["status"] == "completed"
    assert json.loads((tmp_path / "run/model/config.json").read_text())["model_type"] == "llama"


def test_the_recipe_builds_its_task_rewards_and_collector_and_runs(tmp_path):
    trainer = build(make_config("+recipe=grpo_reverse", "trainer.total_frames=512"), run_dir=tmp_path / "run")
    assert trainer.collector.group_size == 16 and trainer.collector.prompts_per_batch == 16
    assert list(trainer.collector.rewards.functions) == ["correct", "partial"]
    summary = trainer.fit()
    assert summary["status"] == "completed" and summary["updates"] == 2


def test_lora_trains_the_adapters_only_and_writes_the_merged_model_and_the_adapters(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rltrain.llm.engine import Sampling, TransformersEngine
    from rltrain.llm.model import LanguageModel
    from rltrain.sync.base import named_weights

    trainer = build(make_config(*SHORT, "model.lora_rank=4", "algo.kl_coef=0.1", "algo.lr=1e-2"),
                    run_dir=tmp_path / "run")
    base_before = {k: v.clone() for k, v in named_weights(trainer.algo.policy).items() if "lora_" not in k}
    summary = trainer.fit()
    assert summary["status"] == "completed"
    learner = named_weights(trainer.algo.policy)
    assert all(torch.equal(learner[k], v) for k, v in base_before.items())  # the base never moves
    adapters = {k for k in learner if "lora_B" in k}
    assert adapters and any(learner[k].abs().sum() > 0 for k in adapters)  # the adapters learned (B starts at 0)
    assert trainer.collector.engine.receiver.poll()  # the push after the last update (no batch came after it)
    engine = named_weights(trainer.collector.engine.model)
    assert all(torch.equal(engine[k], learner[k]) for k in learner)  # adapters and all
    row = read_jsonl(tmp_path / "run/metrics.jsonl")[-1]
    assert row["grpo/kl"] > 0  # against the model with its adapters off: no copy of it
    assert checkpoint.load(checkpoint.listing(tmp_path / "run")[-1])["algo"]["reference"] is None

    prompts, greedy = ["reverse 4:", "reverse 9:", "reverse 0:"], Sampling(max_new_tokens=3, greedy=True)
    tokenizer = LanguageModel().tokenizer()
    ours = TransformersEngine(trainer.algo.policy, tokenizer).generate(prompts, 1, greedy).completion_ids
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "run/model")
    assert not any("lora" in name for name, _ in merged.named_parameters())
    assert TransformersEngine(merged, tokenizer).generate(prompts, 1, greedy).completion_ids.equal(ours)
    base = AutoModelForCausalLM.from_pretrained(LanguageModel().source())
    adapted = PeftModel.from_pretrained(base, tmp_path / "run/model-adapter")
    assert TransformersEngine(adapted, tokenizer).generate(prompts, 1, greedy).completion_ids.equal(ours)


def test_lora_without_peft_names_the_pip_install(monkeypatch):
    without_package(monkeypatch, "peft")
    with pytest.raises(ConfigError, match=r"model.lora_rank=8 trains LoRA adapters with peft, which is not installed: "
                                          r"pip install 'rltrain\[lora\]'"):
        validate(make_config("algo=grpo", "model.lora_rank=8"))


@pytest.mark.parametrize("chat_template", [True, False])
def test_the_chat_template_wraps_each_prompt_unless_turned_off(chat_template, tmp_path):
    from transformers import AutoTokenizer

    path = write_tiny_model(tmp_path / "chat")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                               "{% if add_generation_prompt %}<assistant>{% endif %}")
    tokenizer.save_pretrained(path)
    trainer = build(make_config(*SHORT, f"model.path={path}", f"model.chat_template={chat_template}"),
                    run_dir=tmp_path / "run")
    try:
        batch = next(iter(trainer.collector))
    finally:
        trainer.collector.close()
        trainer.run_dir_lock.release()
    prompt = tokenizer.decode(batch["prompt_ids"][0, 0], skip_special_tokens=True)
    assert prompt == ("<user>reverse 6:<assistant>" if chat_template else "reverse 6:"), prompt


def test_an_engine_of_your_own_is_a_target_away_and_learns_the_one_token_task(tmp_path):
    from tests.parts_for_tests import PlainSamplingEngine
    from tests.test_grpo import ONE_TOKEN

    trainer = build(make_config(*ONE_TOKEN, "engine._target_=tests.parts_for_tests.PlainSamplingEngine"),
                    run_dir=tmp_path / "run")
    engine = trainer.collector.engine
    summary = trainer.fit()
    assert isinstance(engine, PlainSamplingEngine) and engine.calls == summary["frames"] // 128  # every batch its own
    assert summary["status"] == "completed" and summary["eval_return"] > 0.9  # from chance (1 in 10 digits)
    assert read_jsonl(tmp_path / "run/metrics.jsonl")[0]["reward/mean"] < 0.2


@pytest.mark.parametrize(("overrides", "message"), [
    (("engine._target_=tests.parts_for_tests.PushOnlyEngine",),
     "sync=shared_mem delivers weights as module, and engine._target_=tests.parts_for_tests.PushOnlyEngine takes "
     "them as push; use sync=vllm_transfer"),
    (("engine._target_=tests.parts_for_tests.KLPenaltyPPO",),
     "engine._target_=tests.parts_for_tests.KLPenaltyPPO lacks version, generate_s, generate, submit, turns, "
     "refresh, collect, transfer_client, close of rltrain's Engine interface; add them (see rltrain.llm.engine.Engine"),
    (("~engine",), "the language task ReverseDigits needs a generation engine, and the config has none; "
                       "choose one with engine=transformers"),
])
def test_an_engine_of_your_own_gets_the_checks_rltrain_s_own_get(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(make_config("algo=grpo", *overrides))


def test_a_dataset_task_is_read_once_for_the_check_the_collector_and_the_eval_hook(tmp_path, monkeypatch):
    from rltrain.llm import tasks

    reads = []
    read_rows = tasks._read_rows
    monkeypatch.setattr(tasks, "_read_rows", lambda *args: reads.append(args[0]) or read_rows(*args))
    data = ROOT / "tests" / "data" / "sums.jsonl"
    summary = build(make_config(*SHORT, "env=dataset", f"env.path={data}", "env.prompt_key=question",
                                "trainer.total_frames=64"), run_dir=tmp_path / "run").fit()
    assert summary["status"] == "completed" and "eval_return" in summary
    assert reads == [str(data)]  # one task, made by the config check, used by the run


def test_a_batch_generated_ahead_and_checkpointed_before_batches_said_how_they_were_sampled_resumes(tmp_path):
    # a checkpoint of a max_lag=1 run written before issue 35 holds its batch ahead without these keys
    trainer = build(make_config(*SHORT, "collector.temperature=0.7"), run_dir=tmp_path / "run")
    try:
        collector = trainer.collector
        ahead = next(iter(collector)).exclude("temperature", "max_new_tokens")
        state = {**collector.state_dict(), "ready": ahead}
        collector.load_state_dict(state)
        batch = next(iter(collector))
        assert batch["temperature"].eq(0.7).all() and batch["max_new_tokens"].eq(2).all()
        assert trainer.algo.update(batch)["grpo/lr"] > 0  # the learner takes it
    finally:
        trainer.collector.close()  # only the collector and the learner are used: nothing else stays open
        trainer.run_dir_lock.release()
