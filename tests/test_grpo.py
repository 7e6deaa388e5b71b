"""GRPO through the trainer, as ``python -m rltrain algo=grpo`` runs it: the tiny model made here learns a
verifiable task from random weights; pushed weights reach the engine whole; a truncated completion is
masked or kept as the user chose; truncated importance sampling weighs each token by how much likelier the
learner finds it than the sampler did."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rltrain import build
from rltrain.algos.grpo import GRPO, token_logprobs
from rltrain.algos.grpo_loss import Normalizer, aggregate, group_advantages, tis_weights, token_losses
from rltrain.collectors.generation import score
from rltrain.llm.engine import Sampling, TransformersEngine
from rltrain.llm.model import LanguageModel
from rltrain.llm.rewards import Rewards, correct_answer
from rltrain.llm.tasks import ReverseDigits
from rltrain.llm.tiny import write_tiny_model
from rltrain.sync import SharedMemSync
from tests.conftest import make_config
from tests.test_outputs import read_jsonl

# The single-token task (reverse 7: -> 7): chance is about 1 in 90 (any token of the vocabulary).
ONE_TOKEN = ("algo=grpo", "collector.max_new_tokens=1", "trainer.total_frames=19200", "seed=0",
             "~hooks.log.every", "+hooks.log.every={batches:10}", "hooks.eval.every={frames:6400}")


def test_the_tiny_model_learns_a_single_token_task_from_chance_to_near_perfect(tmp_path):
    summary = build(make_config(*ONE_TOKEN), run_dir=tmp_path / "run").fit()
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    first, last = rows[0], rows[-1]
    assert summary["status"] == "completed" and summary["frames"] == 19200 and summary["updates"] == 150
    assert first["reward/mean"] < 0.2, first  # chance, from random weights
    assert last["reward/mean"] > 0.8 and summary["train_return"] > 0.8, last  # the last batches (sampled)
    assert summary["eval_return"] > 0.9 and last["eval/reward/correct"] > 0.9  # greedy, on the eval split
    assert summary["evaluations"] == 3  # at 6400 and 12800 frames, and once at the end (19200)
    model = tmp_path / "run" / "model"
    assert json.loads((model / "config.json").read_text())["model_type"] == "qwen2"


def test_pushed_weights_reach_the_engine_with_its_tied_output_layer(tmp_path):
    model = LanguageModel(str(write_tiny_model(tmp_path / "tiny")))
    learner, engine = model.load(), TransformersEngine(model.load(), model.tokenizer())
    scheme = SharedMemSync()
    sender = scheme.sender(learner)
    receiver = scheme.receiver()
    receiver.connect(engine.model)
    with torch.no_grad():  # new weights: the embedding (which the output layer shares) too
        for p in learner.parameters():
            p.add_(torch.randn_like(p))
    sender.push()
    assert receiver.poll()
    head, embedding = engine.model.lm_head.weight, engine.model.model.embed_tokens.weight
    assert head is embedding and torch.equal(head, learner.model.embed_tokens.weight)
    prompts, greedy = ["reverse 4:", "3+5=", "sort 93:"], Sampling(max_new_tokens=6, greedy=True)
    ours = TransformersEngine(learner, model.tokenizer()).generate(prompts, 1, greedy)
    assert engine.generate(prompts, 1, greedy).completion_ids.equal(ours.completion_ids)
    receiver.close()
    sender.close()


def test_truncated_completions_are_masked_or_kept_as_chosen(tmp_path):
    model = LanguageModel(str(write_tiny_model(tmp_path / "tiny")))
    engine = TransformersEngine(model.load(), model.tokenizer())
    rows = ReverseDigits(length=1).take(4)
    sampling = Sampling(max_new_tokens=3)
    generated = engine.generate([r["prompt"] for r in rows], 4, sampling, seed=0)
    assert generated.truncated.all()  # random weights: nothing ends within 3 tokens
    batch = score(generated, rows, 4, Rewards({"correct": correct_answer}), sampling)
    batch["reward"] = torch.arange(16.0).view(4, 4)  # spread in every group: every advantage is non-zero

    def changed(mask_truncated: bool) -> bool:
        policy = model.load()
        before = [p.clone() for p in policy.parameters()]
        algo = GRPO(policy, total_frames=16, lr=1e-2, mask_truncated=mask_truncated)
        algo.update(batch)
        return any(not torch.equal(a, b) for a, b in zip(before, policy.parameters()))

    assert changed(mask_truncated=False) and not changed(mask_truncated=True)


def test_one_pass_per_group_prompt_gives_what_a_pass_per_completion_gives(tmp_path):
    """The engine and the learner run each group's prompt once (rltrain.llm.prompt_cache): the same
    samples, log-probs, entropies and gradients as running every copy, with left padding and several tokens."""
    model = LanguageModel(str(write_tiny_model(tmp_path / "tiny")))
    engine = TransformersEngine(model.load(), model.tokenizer())
    prompts = ["7+5=", "12*34=", "reverse 4821:"]  # of different lengths: left padding
    sampling = Sampling(max_new_tokens=5)
    shared = engine.generate(prompts, 4, sampling, seed=3)
    each = engine.generate([p for p in prompts for _ in range(4)], 1, sampling, seed=3)
    assert shared.completion_ids.equal(each.completion_ids) and shared.prompt_mask.equal(each.prompt_mask)
    assert (shared.logprobs - each.logprobs).abs().max() < 1e-5
    batch = score(shared, [{"prompt": p, "answer": "1"} for p in prompts], 4,
                  Rewards({"correct": correct_answer}), sampling).reshape(-1)
    policy = model.load().train()
    results = []
    for group_size in (1, 4):
        policy.zero_grad()
        logp, entropy = token_logprobs(policy, batch, group_size)
        (logp * batch["completion_mask"]).sum().backward()
        results.append((logp, entropy, [p.grad.clone() for p in policy.parameters()]))
    (logp_1, entropy_1, grads_1), (logp_4, entropy_4, grads_4) = results
    kept = batch["completion_mask"].bool()
    assert (logp_1 - logp_4)[kept].abs().max() < 1e-5 and (entropy_1 - entropy_4)[kept].abs().max() < 1e-5
    assert max((a - b).abs().max().item() for a, b in zip(grads_1, grads_4)) < 1e-4
    assert (logp_4 - shared.logprobs)[kept].abs().max() < 1e-4  # and what the engine sampled with


def test_the_learner_scores_tokens_at_the_temperature_they_were_sampled_at(tmp_path):
    model = LanguageModel(str(write_tiny_model(tmp_path / "tiny")))
    engine = TransformersEngine(model.load(), model.tokenizer())
    rows = ReverseDigits(length=3).take(4)
    sampling = Sampling(temperature=0.7, max_new_tokens=4)
    generated = engine.generate([r["prompt"] for r in rows], 4, sampling, seed=1)
    batch = score(generated, rows, 4, Rewards({"correct": correct_answer}), sampling)
    assert batch["temperature"].eq(0.7).all() and batch["max_new_tokens"].eq(4).all()  # how it was sampled
    flat = batch.reshape(-1)
    kept = flat["completion_mask"].bool()
    with torch.no_grad():
        at_sampling = token_logprobs(engine.model, flat, 4, temperature=0.7)[0]
        at_one = token_logprobs(engine.model, flat, 4)[0]
    assert (at_sampling - flat["log_prob"])[kept].abs().max() < 1e-4  # every ratio starts at 1
    assert (at_one - flat["log_prob"])[kept].abs().max() > 0.01
    # GRPO takes the temperature from the batch: its first ratios are 1 (the sampler's own log-probs)
    batch["reward"] = torch.arange(16.0).view(4, 4)
    metrics = GRPO(model.load(), total_frames=16, lr=1e-2, tis_cap=None).update(batch)
    assert abs(metrics["grpo/ratio_max"] - 1) < 1e-3 and metrics["grpo/clip_fraction"] == 0


def test_every_ratio_starts_at_one_whatever_top_p_and_the_model_s_own_generation_defaults(tmp_path):
    """top_p narrows what is drawn, not the policy; a generation_config.json's repetition penalty or top_k
    (an instruct model's) would make the sampler another policy than the learner's: the engine sets them aside."""
    model = LanguageModel(str(write_tiny_model(tmp_path / "tiny")))
    engine = TransformersEngine(model.load(), model.tokenizer())
    engine.model.generation_config.repetition_penalty, engine.model.generation_config.top_k = 1.5, 3
    rows = ReverseDigits(length=3).take(4)
    sampling = Sampling(temperature=0.8, top_p=0.5, max_new_tokens=6)
    generated = engine.generate([r["prompt"] for r in rows], 4, sampling, seed=2)
    assert engine.model.generation_config.repetition_penalty == 1.5  # the model's own, as it was
    engine.model.generation_config.repetition_penalty, engine.model.generation_config.top_k = 1.0, 50
    plain = engine.generate([r["prompt"] for r in rows], 4, sampling, seed=2)
    assert plain.completion_ids.equal(generated.completion_ids)  # drawn by `sampling` alone
    batch = score(generated, rows, 4, Rewards({"correct": correct_answer}), sampling).reshape(-1)
    with torch.no_grad():
        learner = token_logprobs(engine.model, batch, 4, temperature=0.8)[0]
    kept = batch["completion_mask"].bool()
    assert (learner - batch["log_prob"])[kept].abs().max() < 1e-4


@pytest.fixture
def sampled(tmp_path):
    """The tiny model, and a batch its engine sampled (so with the learner's log-probs) whose every group has
    a spread of rewards."""
    model = LanguageModel(str(write_tiny_model(tmp_path / "tiny")))
    engine = TransformersEngine(model.load(), model.tokenizer())
    rows = ReverseDigits(length=2).take(4)
    sampling = Sampling(max_new_tokens=3)
    generated = engine.generate([r["prompt"] for r in rows], 4, sampling, seed=0)
    batch = score(generated, rows, 4, Rewards({"correct": correct_answer}), sampling)
    batch["reward"] = torch.arange(16.0).view(4, 4)
    return model, batch


def step(policy, batch, **algo) -> tuple[list[torch.Tensor], dict[str, float]]:
    """The gradient of ``policy``'s last pass of one GRPO update (unclipped: as the loss gives it), and the metrics."""
    metrics = GRPO(policy, total_frames=16, lr=1e-2, max_grad_norm=1e9, **algo).update(batch)
    return [p.grad.clone() for p in policy.parameters()], metrics


def sampled_at(batch, ratio: float):
    """``batch`` as if its sampler had given each token ``1 / ratio`` times the learner's probability."""
    shifted = batch.clone()
    shifted["log_prob"] = batch["log_prob"] - math.log(ratio)
    return shifted


def close(grads, expected, rtol=1e-3) -> bool:
    return all(torch.allclose(g, e, rtol=rtol, atol=1e-6) for g, e in zip(grads, expected))


def reference_gradient(policy, batch, old_logp, cap: float | None) -> list[torch.Tensor]:
    """The gradient of GRPO's token-mean loss on ``batch``, by hand (one pass, not micro-batches)."""
    flat = batch.reshape(-1)
    mask = flat["completion_mask"].float()
    advantages, _ = group_advantages(flat["reward"], 4)
    policy.zero_grad()
    logp = token_logprobs(policy, flat, 4)[0]
    weight = None if cap is None else tis_weights(old_logp, flat["log_prob"], cap)
    losses = token_losses(logp, old_logp, advantages, 0.2, 0.28, is_weight=weight)
    aggregate(losses, mask, "token_mean", Normalizer.of(mask, 3)).backward()
    return [p.grad.clone() for p in policy.parameters()]


def test_tis_weighs_each_token_by_the_sampler_s_ratio_up_to_the_cap(sampled):
    model, batch = sampled
    plain, _ = step(model.load(), batch, tis_cap=None)  # the engine's log-probs are the learner's: every ratio 1
    assert max(g.abs().max().item() for g in plain) > 1e-3
    for ratio, weight in ((1.5, 1.5), (4.0, 2.0)):  # below the cap of 2, then over it: truncated
        grads, metrics = step(model.load(), sampled_at(batch, ratio), tis_cap=2.0)
        assert close(grads, [weight * g for g in plain])
        assert metrics["grpo/tis/ratio_mean"] == pytest.approx(ratio, rel=1e-3)
        assert metrics["grpo/tis/ratio_max"] == pytest.approx(ratio, rel=1e-3)
        assert metrics["grpo/tis/truncated"] == (1.0 if ratio > 2 else 0.0)
        assert metrics["grpo/tis/ess"] == pytest.approx(1.0)  # all tokens weigh alike
        assert metrics["grpo/clip_fraction"] == 0.0  # the ratio is against the learner before the update: 1


def test_a_null_cap_takes_the_ratio_against_the_sampling_log_probs_and_weighs_nothing(sampled):
    model, batch = sampled
    batch = sampled_at(batch, 1.5)
    grads, metrics = step(model.load(), batch, tis_cap=None)
    expected = reference_gradient(model.load().train(), batch, batch.reshape(-1)["log_prob"], cap=None)
    assert close(grads, expected, rtol=1e-5)
    assert metrics["grpo/clip_fraction"] > 0.5 and metrics["grpo/ratio_max"] == pytest.approx(1.5, rel=1e-3)
    assert not any(k.startswith("grpo/tis/") for k in metrics)


def test_a_second_epoch_takes_the_ratio_against_the_learner_before_the_first(sampled):
    model, batch = sampled
    batch = sampled_at(batch, 1.5)
    once = model.load()
    step(once, batch, tis_cap=2.0, micro_batch_size=8)  # the weights the second epoch starts from
    grads, _ = step(model.load(), batch, tis_cap=2.0, epochs=2, micro_batch_size=8)
    flat = batch.reshape(-1)
    with torch.no_grad():
        before = token_logprobs(model.load(), flat, 4)[0]
        after_one = token_logprobs(once, flat, 4)[0]
    assert close(grads, reference_gradient(once.train(), batch, before, cap=2.0), rtol=1e-4)
    assert not close(grads, reference_gradient(once.train(), batch, after_one, cap=2.0), rtol=0.1)
