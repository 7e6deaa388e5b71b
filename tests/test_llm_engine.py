"""The in-process generation engine on the tiny model: groups of completions, their masks, and the
sampling log-probs, which the learner's recomputation on the same weights must agree with."""

from __future__ import annotations

import pytest
import torch

from rltrain.llm.engine import Sampling, TransformersEngine
from rltrain.llm.model import LanguageModel
from rltrain.llm.tiny import write_tiny_model


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = LanguageModel(str(write_tiny_model(tmp_path_factory.mktemp("model") / "tiny")))
    return TransformersEngine(model.load(), model.tokenizer())


def recomputed_logprobs(engine, g):
    """Each completion token's log-prob under the model, from one forward pass over prompt + completion."""
    ids = torch.cat([g.prompt_ids, g.completion_ids], dim=1)
    mask = torch.cat([g.prompt_mask, g.completion_mask], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        logits = engine.model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
    prompt = g.prompt_ids.shape[1]
    logp = torch.log_softmax(logits[:, prompt - 1:-1], dim=-1).gather(-1, g.completion_ids.unsqueeze(-1)).squeeze(-1)
    return logp * g.completion_mask


def test_groups_of_completions_with_masks_and_the_sampling_log_probs(engine):
    prompts = ["12+7=", "reverse 4821:", "3*3="]
    g = engine.generate(prompts, group_size=4, sampling=Sampling(max_new_tokens=8), seed=0)
    assert g.completion_ids.shape[0] == 12 and g.prompt_ids.shape[0] == 12 and len(g.texts) == 12
    assert g.version == 0 and g.truncated.dtype == torch.bool
    decoded = engine.tokenizer.batch_decode(g.prompt_ids, skip_special_tokens=True)
    assert decoded == [p for p in prompts for _ in range(4)]  # each prompt's group, one after another
    assert len({tuple(row) for row in g.completion_ids[:4].tolist()}) > 1  # sampled, not one answer four times
    ours = recomputed_logprobs(engine, g)
    gap = (ours - g.logprobs).abs().max().item()
    assert gap < 1e-4, gap  # the engine's log-probs are the learner's, on the same weights
    assert (g.logprobs[g.completion_mask == 0] == 0).all() and (g.logprobs[g.completion_mask == 1] < 0).all()


def test_the_same_seed_gives_the_same_completions(engine):
    a = engine.generate(["1+1="], 3, Sampling(max_new_tokens=6), seed=7)
    b = engine.generate(["1+1="], 3, Sampling(max_new_tokens=6), seed=7)
    assert torch.equal(a.completion_ids, b.completion_ids) and a.texts == b.texts


def test_temperature_and_top_p_log_probs_are_those_of_the_distribution_sampled(engine):
    g = engine.generate(["7-2="], 8, Sampling(temperature=0.5, top_p=0.9, max_new_tokens=5), seed=1)
    kept = g.logprobs[g.completion_mask == 1]
    assert (kept <= 0).all() and (kept > -float("inf")).all()  # a sampled token is never outside top-p


def test_completions_end_at_eos_or_a_stop_string_and_say_when_they_were_cut(engine):
    tok = engine.tokenizer
    eos, stop = tok.eos_token_id, tok.convert_tokens_to_ids("=")
    x = tok.convert_tokens_to_ids("1")
    assert engine._length([x, x, eos, x], ()) == (3, False)  # the eos token belongs to the completion
    assert engine._length([x, x, x, x], ()) == (4, True)  # max_new_tokens reached
    assert engine._length([x, stop, x, eos], ("=",)) == (2, False)
    g = engine.generate(["9+9="] * 4, 8, Sampling(temperature=3.0, max_new_tokens=24, stop=("1", "2")), seed=3)
    ended = 0
    for text, cut, n in zip(g.texts, g.truncated.tolist(), g.completion_mask.sum(1).tolist()):
        hit = [text.find(s) for s in ("1", "2") if s in text]
        if hit:
            ended += 1
            assert not cut and min(hit) == len(text) - 1  # nothing generated after the stop string counts
        assert n <= 24
    assert ended > 0
