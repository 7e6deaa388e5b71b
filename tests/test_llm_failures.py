"""A language-model run under faults: nothing trains on NaN, a failure outside the learner keeps what
the learner has, and reward functions get exactly the arguments they are configured with."""

from __future__ import annotations

import functools
import json
import signal
import time

import pytest
import torch

from rltrain import build, checkpoint
from rltrain.errors import ConfigError, NonFiniteError
from rltrain.llm.rewards import Rewards, RewardTimeout, time_limit
from rltrain.validate import validate
from tests.conftest import make_config, run_cli
from tests.test_outputs import read_jsonl

SHORT = ("algo=grpo", "collector.frames_per_batch=32", "collector.group_size=4", "trainer.total_frames=256", "seed=1",
         "hooks.eval.prompts=8")


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def dataset(tmp_path, train_columns=None, eval_columns=None, train=16, evals=4):
    """A reverse-the-digit dataset: train and eval files with each row's extra columns."""
    def rows(n, split, columns):
        return [{"prompt": f"reverse {i % 10}:", "answer": str(i % 10), "split": split, "id": i,
                 **(columns or {})} for i in range(n)]
    return (f"env.path={write_rows(tmp_path / 'train.jsonl', rows(train, 'train', train_columns))}",
            f"env.eval_path={write_rows(tmp_path / 'eval.jsonl', rows(evals, 'eval', eval_columns))}")


# 1. No training on NaN.

def test_a_nan_gradient_stops_grpo_at_that_update_with_the_weights_untouched(tmp_path):
    trainer = build(make_config(*SHORT), run_dir=tmp_path / "run")
    policy = trainer.algo.policy
    before = {name: p.detach().clone() for name, p in policy.named_parameters()}
    policy.model.norm.weight.register_hook(lambda grad: grad * float("nan"))
    with pytest.raises(NonFiniteError, match=r"^update 1 \(after 32 frames\): a loss or its gradient was NaN"):
        trainer.fit()
    assert all(torch.equal(p, before[name]) for name, p in policy.named_parameters())  # the step was skipped
    assert [p.name for p in checkpoint.listing(tmp_path / "run")] == []  # nothing written past the last finite one
    assert not (tmp_path / "run/model").exists()


def test_algo_nonfinite_skip_skips_and_counts_such_steps(tmp_path):
    trainer = build(make_config(*SHORT, "algo.nonfinite=skip"), run_dir=tmp_path / "run")
    trainer.algo.policy.model.norm.weight.register_hook(lambda grad: grad * float("nan"))
    summary = trainer.fit()
    assert summary["status"] == "completed" and summary["nonfinite"]["skipped_steps"] == summary["updates"] == 8


def test_float16_fails_naming_the_version_and_the_dtype_and_keeps_the_last_finite_checkpoint(tmp_path):
    run = run_cli(*SHORT, "model.dtype=float16", "trainer.total_frames=2560", "~hooks.checkpoint.every",
                  "+hooks.checkpoint.every={batches:1}",
                  "hydra.run.dir=run", cwd=tmp_path)
    assert run.returncode == 1, run.stderr
    assert "NonFiniteError: the model computed NaN or infinite logits while generating with weights version" \
           in run.stderr and "model.dtype=float32" in run.stderr
    saved = checkpoint.listing(tmp_path / "run")
    assert saved and "resume=" not in run.stderr  # the last checkpoint is the last finite one: none at the failure
    assert all(torch.isfinite(t).all() for t in checkpoint.load(saved[-1])["algo"]["policy"].values())


def test_a_checkpoint_of_grpo_s_unfused_optimizer_resumes_fused_with_its_step_on_the_weights_device(tmp_path):
    trainer = build(make_config(*SHORT), run_dir=tmp_path / "run")
    trainer.collector.close()  # only the learner is used: nothing of the run stays open in this process
    trainer.run_dir_lock.release()
    algo = trainer.algo
    unfused = torch.optim.AdamW(algo._params, lr=algo.lr)  # as GRPO's optimizer was before its guard
    for p in algo._params:
        p.grad = torch.full_like(p, 1e-3)
    unfused.step()
    state = {"policy": algo.policy.state_dict(), "optimizer": unfused.state_dict(), "frames": 128, "reference": None}
    algo.load_state_dict(state)
    assert algo.optimizer.defaults["fused"] and algo.optimizer.param_groups[0]["fused"]
    steps = [s["step"] for s in algo.optimizer.state.values()]
    assert steps and all(s.device == p.device and s.dtype == torch.float32 and s.item() == 1
                         for s, p in zip(steps, algo._params))
    algo.update(make_batch(algo))
    assert all(s["step"].item() == 2 for s in algo.optimizer.state.values())


def make_batch(algo):
    """One batch of the tiny task's completions from GRPO ``algo``'s own policy."""
    from rltrain.collectors.generation import complete
    from rltrain.llm.engine import Sampling, TransformersEngine
    from rltrain.llm.model import LanguageModel
    from rltrain.llm.rewards import Rewards, correct_answer
    from rltrain.llm.tasks import ReverseDigits

    model = LanguageModel()
    engine = TransformersEngine(algo.policy, model.tokenizer())
    return complete(engine, model, ReverseDigits().take(8), 4, Sampling(max_new_tokens=2),
                    Rewards({"correct": correct_answer}), seed=0)


# 3. A failure outside the learner keeps what the learner has.

def test_a_final_evaluation_that_fails_keeps_the_checkpoint_and_the_model_and_the_run_resumes(tmp_path):
    data = dataset(tmp_path)
    failing = ("env=dataset", *data, "env.rewards.correct._target_=tests.parts_for_tests.reward_failing_on_eval")
    run = run_cli(*SHORT, *failing, "hydra.run.dir=run", cwd=tmp_path)
    assert run.returncode == 1, run.stderr
    assert "the run failed after 256 frames: RunError: reward function correct raised ValueError" in run.stderr
    assert f"Continue with: python -m rltrain resume={tmp_path / 'run'}" in run.stderr
    assert [p.name for p in checkpoint.listing(tmp_path / "run")] == [checkpoint.path_for(tmp_path, 256).name]
    assert (tmp_path / "run/model/config.json").is_file()
    # Fixed, the run evaluates and completes without training again.
    fixed = run_cli(*SHORT, "env=dataset", *data, "resume=run", cwd=tmp_path)
    assert fixed.returncode == 0, fixed.stderr
    summary = json.loads((tmp_path / "run/summary.json").read_text())
    assert summary["status"] == "completed" and summary["frames"] == 256 and summary["eval_return"] is not None


def test_a_reward_that_hangs_is_bounded_and_a_sigterm_meanwhile_ends_the_run(tmp_path):
    run = run_cli(*SHORT, "+env.rewards.slow._target_=tests.parts_for_tests.reward_that_hangs",
                  "env.reward_timeout_s=2", "hydra.run.dir=run", cwd=tmp_path, timeout=120)
    assert run.returncode == 1, run.stderr
    assert "reward function slow took longer than env.reward_timeout_s=2" in run.stderr
    # Kept after the two batches trained (64 rewards), with the failed third batch given back to the task.
    assert [p.name for p in checkpoint.listing(tmp_path / "run")] == [checkpoint.path_for(tmp_path, 64).name]
    saved = checkpoint.load(checkpoint.listing(tmp_path / "run")[0])
    assert saved["collector"] == {"task": {"position": 16}, "seed": 1, "batches": 2, "ranks": 1}


def test_the_eval_rows_columns_are_checked_against_the_rewards_before_training(tmp_path):
    train, _ = dataset(tmp_path)
    bare = write_rows(tmp_path / "bare.jsonl", [{"prompt": "reverse 1:"}])
    with pytest.raises(ConfigError, match=r"env.rewards.correct reads the column 'answer', which row 1 of the eval "
                                          r"split \(env.eval_path=.*bare.jsonl\) lacks"):
        validate(make_config(*SHORT, "env=dataset", train, f"env.eval_path={bare}"))


def test_a_reward_s_time_limit_puts_back_the_timer_it_found_and_is_not_swallowed(monkeypatch):
    fired = []
    monkeypatch.setattr(signal, "SIGALRM", signal.SIGALRM)  # restored below by hand: the handler and the timer
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(True))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)  # an outer timer, as pytest-timeout's
        with pytest.raises(RewardTimeout):  # a function's own `except Exception` does not turn it into a reward
            with time_limit(0.05):
                try:
                    time.sleep(5)
                except Exception:  # noqa: BLE001
                    pass
        with time_limit(5):
            pass
        time.sleep(1)
        assert fired == [True]  # the outer timer fired once, after its own time
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# 4. Reward arguments mean what they say.

def test_a_positional_only_reward_function_takes_its_configured_arguments():
    rewards = Rewards({"short": functools.partial(short_answer, max_chars=1)})
    assert rewards("reverse 7:", "7", {"answer": "7"}) == (1.0, {"short": 1.0})


def short_answer(prompt, completion, /, *, max_chars=4, **row):
    return float(len(completion) <= max_chars)


def test_a_misspelled_reward_argument_is_refused_naming_it(tmp_path):
    with pytest.raises(ConfigError, match=r"env.rewards.short.max_charz: length_penalty takes no argument 'max_charz' "
                                          r"\(its arguments: max_chars\)"):
        validate(make_config(*SHORT, "+env.rewards.short._target_=rltrain.llm.rewards.length_penalty",
                             "+env.rewards.short.max_charz=3"))


def test_a_column_named_like_a_configured_reward_argument_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"env.rewards.short.max_chars is configured, and the train split "
                                          r"\(env.path=.*\) has a column 'max_chars' too"):
        validate(make_config(*SHORT, "env=dataset", *dataset(tmp_path, {"max_chars": 100}),
                             "+env.rewards.short._target_=rltrain.llm.rewards.length_penalty",
                             "+env.rewards.short.max_chars=4"))


# 5. Any finite real number is a reward; 6. each eval row counts once.

def test_rewards_of_numpy_and_torch_number_types_train(tmp_path):
    cfg = make_config(*SHORT, "env.rewards.correct._target_=tests.parts_for_tests.reward_of_numpy_and_torch_types",
                      "trainer.total_frames=64")
    summary = build(cfg, run_dir=tmp_path / "run").fit()
    assert summary["status"] == "completed"


def test_an_eval_split_smaller_than_hooks_eval_prompts_scores_each_row_once(tmp_path):
    cfg = make_config(*SHORT, "env=dataset", *dataset(tmp_path, evals=3), "trainer.total_frames=32",
                      "env.rewards.correct._target_=tests.parts_for_tests.first_row_only", "hooks.eval.prompts=4")
    summary = build(cfg, run_dir=tmp_path / "run").fit()
    assert summary["eval_return"] == pytest.approx(1 / 3)  # rows 0, 1, 2 once each (cycled: 0, 1, 2, 0 -> 1/2)
    assert read_jsonl(tmp_path / "run/metrics.jsonl")[-1]["eval/return"] == pytest.approx(1 / 3)


def test_lora_on_a_tied_output_layer_is_refused():
    # peft adapts lm_head alone; the model merged at the end then differs from the learner (eval 0.45 while
    # training, the merged model's greedy answers wrong for most prompts)
    with pytest.raises(ConfigError, match=r"model.lora_targets names lm_head, and model.path=tiny ties its output "
                                          r"layer to its input embedding"):
        validate(make_config(*SHORT, "model.lora_rank=4", "model.lora_targets=[q_proj,lm_head]"))
    validate(make_config(*SHORT, "model.lora_rank=4", "model.lora_targets=[q_proj,v_proj]"))
