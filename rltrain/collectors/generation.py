"""``collector=generation``: a language-model policy's collector. Each batch takes the task's next
prompts, samples ``group_size`` completions of each with the weights of the last push, and scores
every completion with the task's reward functions.

The engine's model is a copy of the learner's, on the learner's device, fed only through the
weight-sync receiver at the start of each batch, as every collector's policy is: the learner's
optimizer never touches the weights that generate, and each completion carries the version that
generated it. (On the CPU the engine reads the published snapshot in place; on a GPU each new
version is copied into it.)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Annotated

import torch
from tensordict import TensorDict

from rltrain.collectors.batch import batch_steps
from rltrain.llm.engine import Sampling, TransformersEngine
from rltrain.llm.model import LanguageModel
from rltrain.llm.rewards import Rewards
from rltrain.llm.tasks import Task
from rltrain.protocols import Collector
from rltrain.rules import Flag, PositiveFraction, PositiveInt, PositiveNumber, Satisfies
from rltrain.sync.base import WeightReceiver

STOP = Satisfies(lambda v: isinstance(v, (list, tuple)) and all(isinstance(s, str) and s for s in v),
                 "a list of non-empty strings")


class GenerationCollector(Collector):
    """Yields ``[prompts, group_size]`` TensorDict batches of ``frames_per_batch`` completions (a
    frame is one completion), forever; keys: ``rltrain.llm.engine.Generated.as_batch``."""

    BATCH_ENVS = ("collector.group_size",)  # frames_per_batch must be a multiple of it
    IN_LEARNER_PROCESS = True

    def __init__(
        self,
        make_env: Callable[[], Task],
        make_policy: Callable[[], torch.nn.Module],
        make_receiver: Callable[[], WeightReceiver],
        model: LanguageModel,
        rewards: Rewards,
        device: torch.device | str = "cpu",
        seed: int = 0,
        frames_per_batch: PositiveInt = 128,
        group_size: PositiveInt = 8,
        temperature: PositiveNumber = 1.0,
        top_p: PositiveFraction = 1.0,
        max_new_tokens: PositiveInt = 4,
        stop: Annotated[list[str], STOP] = (),
        greedy: Flag = False,
    ):
        self.prompts_per_batch = batch_steps(frames_per_batch, group_size, "collector.group_size")
        self.group_size, self.seed, self.batches = group_size, seed, 0
        self.sampling = Sampling(temperature, top_p, max_new_tokens, tuple(stop), greedy)
        self.task, self.rewards, self.model = make_env(), rewards, model
        self.engine = TransformersEngine(make_policy().to(device), model.tokenizer())
        self.receiver = make_receiver()
        self.receiver.connect(self.engine.model)

    def __iter__(self) -> Iterator[TensorDict]:
        while True:
            yield self.collect()

    def collect(self) -> TensorDict:
        """One batch: the next prompts, with the newest weights (polled first), scored."""
        self.receiver.poll()
        self.engine.version = self.receiver.version
        rows = self.task.take(self.prompts_per_batch)
        batch = complete(self.engine, self.model, rows, self.group_size, self.sampling, self.rewards,
                         seed=self.seed + self.batches)
        self.batches += 1
        return batch

    def state_dict(self) -> dict:
        """Where the task is (its next prompt), and the seed and count of the batches drawn (batch n
        samples with seed + n: a resumed run draws what the uninterrupted one would have)."""
        return {"task": self.task.state_dict(), "seed": self.seed, "batches": self.batches}

    def load_state_dict(self, state: dict) -> None:
        self.task.load_state_dict(state["task"])
        self.seed, self.batches = int(state["seed"]), int(state["batches"])

    def close(self) -> None:
        self.receiver.close()
        self.engine.close()


def complete(engine: TransformersEngine, model: LanguageModel, rows: list[dict], group_size: int,
             sampling: Sampling, rewards: Rewards, seed: int | None = None) -> TensorDict:
    """``group_size`` completions of each row's prompt, as the model reads it (``model.prompt_text``),
    scored: the collector's batches and the eval hook's (with the seconds generation took)."""
    prompts = [model.prompt_text(engine.tokenizer, row["prompt"]) for row in rows]
    start = time.perf_counter()
    generated = engine.generate(prompts, group_size, sampling, seed=seed)
    return score(generated, rows, group_size, rewards, time.perf_counter() - start)


def score(generated, rows: list[dict], group_size: int, rewards: Rewards, generate_s: float = 0.0) -> TensorDict:
    """``generated``'s batch (``Generated.as_batch``) with every completion scored by ``rewards``
    against its prompt's row (the task's own prompt, not the chat-templated text)."""
    totals, each = [], {name: [] for name in rewards.functions}
    for i, text in enumerate(generated.texts):
        row = rows[i // group_size]
        total, values = rewards(row["prompt"], text, row)
        totals.append(total)
        for name, value in values.items():
            each[name].append(value)
    return generated.as_batch(group_size, torch.tensor(totals),
                              {name: torch.tensor(values) for name, values in each.items()}, generate_s)
