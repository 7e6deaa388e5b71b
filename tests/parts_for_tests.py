"""A user's own algo, collector and hook that declare their rules the way rltrain's parts do
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
from rltrain.llm.rewards import correct_answer
from rltrain.rules import InRange, NonNegativeNumber, OneOf, PositiveInt


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
