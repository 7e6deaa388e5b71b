"""A user's own algo, collector, hook and generation engine that declare their rules the way rltrain's parts do
(rltrain.rules): annotated constructor parameters, and ``check_config`` for combinations; and reward
functions of a language task, some with the faults users meet."""

from __future__ import annotations

import itertools
import os
import signal
import time
from typing import Annotated

import numpy as np
import torch

from rltrain.algos import PPO
from rltrain.collectors import LocalCollector
from rltrain.errors import ConfigError
from rltrain.hooks import Hook
from rltrain.hooks.base import EVERY_UPDATE
from rltrain.llm.engine import Engine, Generated, Sampling
from rltrain.llm.environments import GuessNumber
from rltrain.llm.rewards import correct_answer
from rltrain.llm.tasks import ReverseDigits
from rltrain.rules import InRange, NonNegativeNumber, OneOf, PositiveInt


class OneProcessPPO(PPO):
    """An algo of a user's own that does not say which of its sizes a data-parallel learner splits."""

    DATA_PARALLEL = None


class KLPenaltyPPO(PPO):
    """PPO with a KL penalty: its own parameters have rules; PPO's keep theirs (``algo.lr``, ...)."""

    def __init__(self, *args, kl_coef: NonNegativeNumber = 0.0, kl_decay: Annotated[float, InRange(0, 1)] = 1.0,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.kl_coef, self.kl_decay = kl_coef, kl_decay

    @classmethod
    def check_config(cls, values: dict, config: dict) -> None:
        super().check_config(values, config)
        if values["kl_decay"] < 1 and values["kl_coef"] == 0:
            raise ConfigError(f"algo.kl_decay={values['kl_decay']} decays a penalty of 0; set algo.kl_coef > 0 too")


class EveryOtherBatchCollector(LocalCollector):
    """Yields every ``keep``-th batch of an in-process collector."""

    def __init__(self, make_env, make_policy, make_receiver, frames_per_batch: int, keep: PositiveInt = 2):
        super().__init__(make_env, make_policy, make_receiver, frames_per_batch)
        self.keep = keep

    def __iter__(self):
        for i, batch in enumerate(super().__iter__()):
            if i % self.keep == 0:
                yield batch


class TaggingHook(Hook):
    """Tags the log; ``every`` keeps Hook's schedule rule without restating it."""

    def __init__(self, every=EVERY_UPDATE, level: Annotated[str, OneOf(("info", "debug"))] = "info"):
        super().__init__(every)
        self.level = level


def reward_that_raises(prompt: str, completion: str, **row) -> float:
    """A user's reward function with a bug (a language task's env.rewards.<name>._target_)."""
    raise KeyError("score")


def reward_failing_on_eval(prompt: str, completion: str, answer: str, split: str, **row) -> float:
    """A reward with a bug that only the eval rows reach (their ``split`` column says eval)."""
    if split == "eval":
        raise ValueError("no score for eval rows")
    return correct_answer(prompt, completion, answer)


_HANG_CALLS = itertools.count()


def reward_that_hangs(prompt: str, completion: str, after: int = 64, **row) -> float:
    """A reward that never returns from its call number ``after`` on (once the run has trained a little); a
    scheduler's SIGTERM reaches the run while it hangs."""
    if next(_HANG_CALLS) < after:
        return 0.0
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(3600)
    return 0.0


def reward_of_numpy_and_torch_types(prompt: str, completion: str, answer: str, **row):
    """correct_answer's value as numpy's and torch's number types and a bool, by the prompt's digit."""
    right = correct_answer(prompt, completion, answer)
    kinds = (np.float32(right), np.int64(right), torch.tensor(right), bool(right), np.bool_(right))
    return kinds[int(prompt.split()[-1][0]) % len(kinds)]


def first_row_only(prompt: str, completion: str, id: int, **row) -> float:
    """1 for the row whose ``id`` column is 0, else 0: the eval's mean says how often each row counted."""
    return float(id == 0)


class PlainSamplingEngine(Engine):
    """A user's own generation engine (``engine._target_=tests.parts_for_tests.PlainSamplingEngine``): token by
    token from the full logits of a model of this process, no cache, no transformers ``generate``. It asks build
    for what it needs by name (a copy of the learner's model, its tokenizer, the sync scheme's receiver) and
    says how weights reach it (``WEIGHTS``); ``calls`` counts its generations."""

    WEIGHTS = ("module",)

    def __init__(self, policy, tokenizer, receiver):
        self.model, self.tokenizer, self.receiver, self.calls = policy, tokenizer, receiver, 0
        receiver.connect(policy)

    @torch.no_grad()
    def generate(self, prompts: list[str], group_size: int, sampling: Sampling, seed: int | None = None) -> Generated:
        self.receiver.poll()
        self.version, self.calls = self.receiver.version, self.calls + 1
        tok = self.tokenizer
        tok.padding_side = "left"
        encoded = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        prompt_ids = encoded["input_ids"].repeat_interleave(group_size, 0)
        prompt_mask = encoded["attention_mask"].repeat_interleave(group_size, 0)
        generator = torch.Generator().manual_seed(seed or 0)
        ids, mask, logprobs = prompt_ids, prompt_mask, []
        done = torch.zeros(len(ids), dtype=torch.bool)
        steps = []
        for _ in range(sampling.max_new_tokens):
            positions = (mask.cumsum(1) - 1).clamp_min(0)
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1].float()
            logp = torch.log_softmax(logits / sampling.policy_temperature, -1)
            token = (logp.argmax(-1) if sampling.greedy else
                     torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1))
            token = token.masked_fill(done, tok.pad_token_id)
            logprobs.append(logp.gather(1, token[:, None]).squeeze(1).masked_fill(done, 0.0))
            steps.append(~done)  # a token of the completion: its row had not ended before it
            ids, mask = torch.cat([ids, token[:, None]], 1), torch.cat([mask, steps[-1].long()[:, None]], 1)
            done = done | (token == tok.eos_token_id)
        completion_mask = torch.stack(steps, 1).long()
        completion = ids[:, prompt_ids.shape[1]:].masked_fill(completion_mask == 0, tok.pad_token_id)
        texts = [tok.decode(row[m.bool()], skip_special_tokens=True) for row, m in zip(completion, completion_mask)]
        return Generated(prompt_ids, prompt_mask, completion, completion_mask, torch.stack(logprobs, 1),
                         ~done, texts, self.version)


class PushOnlyEngine(PlainSamplingEngine):
    """An engine that says it takes pushes only (as an engine behind a weight-transfer API would)."""

    WEIGHTS = ("push",)


# Tools of a language environment (rltrain.llm.tools), with the faults users meet.

def tool_that_raises(x: str) -> str:
    """Divides one by zero."""
    return str(1 / (len(x) - len(x)))


def tool_that_hangs(x: str) -> str:
    """Never answers."""
    while True:
        time.sleep(1)


def tool_that_exits(x: str) -> str:
    """Ends its process."""
    os._exit(3)


def lookup(key: str) -> str:
    """A store of other values than rltrain.llm.tools.lookup's (each moved by 50): a model that answers from
    memory gets them wrong, one that says what its tool returned gets them right."""
    from rltrain.llm.tools import lookup_value

    return f"{(int(lookup_value(key)) + 50) % 100:02d}"


NOT_A_TOOL = 42


class EnvWithoutStep(ReverseDigits):
    """A language environment that forgot ``step``."""

    def reset(self, row):
        return None, [{"role": "user", "content": row["prompt"]}]


class GuessThatSignals(GuessNumber):
    """env=guess that sends its own process SIGTERM at the ``RLTRAIN_TEST_SIGTERM_AT_STEP``-th step of the
    process's episodes (where that variable is set): a scheduler's signal landing while a batch's turns are played."""

    steps = 0  # of every episode of this process

    def step(self, state, reply):
        GuessThatSignals.steps += 1
        if GuessThatSignals.steps == int(os.environ.get("RLTRAIN_TEST_SIGTERM_AT_STEP", 0)):
            os.kill(os.getpid(), signal.SIGTERM)
        return super().step(state, reply)
