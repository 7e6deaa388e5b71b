"""GRPO on the tiny model made here: a model with random weights learns a verifiable task (the digit
of ``reverse 7:``, one token: chance is about 1 in 90)."""

from __future__ import annotations

import pytest
import torch

from rltrain.algos.grpo import GRPO, GroupBatch
from rltrain.llm.engine import Sampling, TransformersEngine
from rltrain.llm.rewards import Rewards, correct_answer
from rltrain.llm.tasks import ReverseDigits
from rltrain.llm.tiny import write_tiny_model


def accuracy(engine, task, rewards, n=64) -> float:
    rows = task.take(n)
    g = engine.generate([r["prompt"] for r in rows], 1, Sampling(max_new_tokens=1, greedy=True))
    return sum(rewards(r["prompt"], text, r)[0] for r, text in zip(rows, g.texts)) / n


@pytest.mark.slow
def test_grpo_teaches_a_random_tiny_model_to_copy_a_digit(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a small model: one thread is fastest, and the same on every machine
    try:
        torch.manual_seed(0)
        engine = TransformersEngine.load(write_tiny_model(tmp_path / "tiny", seed=0))
        task, rewards = ReverseDigits(length=1, seed=0), Rewards({"correct": correct_answer})
        before = accuracy(engine, task.eval_split(), rewards)
        algo = GRPO(engine.model, lr=3e-3, micro_batch_size=64, max_new_tokens=1)
        means = []
        for step in range(150):  # 16 prompts x 8 completions of one token a step
            rows = task.take(16)
            g = engine.generate([r["prompt"] for r in rows], 8, Sampling(max_new_tokens=1), seed=step)
            scores = torch.tensor([rewards(rows[i // 8]["prompt"], text, rows[i // 8])[0]
                                   for i, text in enumerate(g.texts)])
            means.append(algo.update(GroupBatch(g, scores, 8))["reward/mean"])
        after = accuracy(engine, task.eval_split(), rewards)
    finally:
        torch.set_num_threads(threads)
    assert before < 0.2 and sum(means[:10]) / 10 < 0.2
    assert sum(means[-20:]) / 20 > 0.8 and after > 0.9, (means[-20:], after)
