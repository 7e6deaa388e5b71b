"""Evaluates a language-model policy: greedy completions of the task's eval prompts (or greedy episodes of a
language environment's), scored by the run's reward functions, with the learner's current weights."""

from __future__ import annotations

import logging
from dataclasses import replace

from rltrain.collectors.generation import GenerationCollector, complete
from rltrain.hooks.base import Every
from rltrain.hooks.eval import Evaluation, raise_if_stopping
from rltrain.llm.engine import Sampling, TransformersEngine
from rltrain.llm.model import LanguageModel
from rltrain.llm.rewards import Rewards
from rltrain.llm.tasks import Task
from rltrain.rules import Flag, PositiveInt
from rltrain.state import TrainState
from rltrain.strategies import Single, Strategy

log = logging.getLogger("rltrain")


class GenerationEvalHook(Evaluation):
    """Completes ``prompts`` eval prompts greedily (the most likely token each step), ``batch_size`` at a
    time, on its schedule (``every``; null: never) and at the end of the run (``at_end``).

    Every evaluation uses the same prompts (the first of the eval split; every row of a smaller one, each
    once), completed as the collector's are (its ``max_new_tokens`` and ``stop``), greedily. Logs ``eval/return`` (the
    mean total reward; summary.json's ``eval_return``), ``eval/reward/<name>`` (each function's
    mean: ``correct`` is the accuracy), ``eval/completion_length`` and ``eval/truncated``.
    """

    RUNS_LEARNER = True  # strategy=fsdp: every rank completes its share of the prompts with its shards
    # Keys this hook had while it copied the collector's: it reads them from the collector now.
    MOVED_KEYS = {"max_new_tokens": "is now collector.max_new_tokens (the eval hook completes as the collector does)",
                  "stop": "is now collector.stop (the eval hook completes as the collector does)"}

    def __init__(
        self,
        policy,
        task: Task,
        collector: GenerationCollector,
        model: LanguageModel,
        rewards: Rewards,
        prompts: PositiveInt = 64,
        batch_size: PositiveInt = 64,
        every: Every = None,
        at_end: Flag = True,
        strategy: Strategy = Single(),
    ):
        super().__init__(every, at_end)
        self.policy, self.task, self.model, self.rewards = policy, task.eval_split(), model, rewards
        self.strategy = strategy
        size = self.task.split_size()
        if size is not None and size < prompts:  # a row counted twice would weigh twice in the mean
            log.info("hooks.eval.prompts=%d, but %s holds %d rows: each is scored once", prompts,
                     self.task.describe("eval"), size)
        self.prompts, self.batch_size = prompts if size is None else min(prompts, size), batch_size
        self.sampling: Sampling = replace(collector.sampling, greedy=True)
        self.episodes = collector.episodes  # a language environment's: greedy episodes, played as the collector's
        self._engine: TransformersEngine | None = None

    def evaluate(self, state: TrainState) -> float:
        """The mean total reward of greedy completions of the eval prompts; a stop request (SIGINT,
        SIGTERM) ends it between two batches of prompts: StopRequested, nothing recorded."""
        if self._engine is None:
            self._engine = TransformersEngine(self.policy, self.model.tokenizer())
        self.task.position = 0
        # A sharded learner's ranks each complete their share of every batch (they generate together: a rank
        # without a prompt of a batch completes one anyway, not counted), then every rank takes all the scores.
        ranks = self.strategy.size if self.strategy.SHARDED else 1
        scores: dict[str, list[float]] = {"reward": [], "length": [], "truncated": []}
        for start in range(0, self.prompts, self.batch_size):
            raise_if_stopping(state)
            rows = self.task.take(min(self.batch_size, self.prompts - start))
            mine = rows[self.strategy.rank::ranks]
            if self.episodes is None:
                batch = complete(self._engine, self.model, mine or rows[:1], 1, self.sampling, self.rewards)
            else:
                batch = self.episodes.play(self._engine, self.task, mine or rows[:1], 1, self.rewards, greedy=True)
            if not mine:
                continue
            named = {"reward": batch["reward"], "length": batch["episode_length"], "truncated": batch["truncated"],
                     **{f"reward/{name}": values for name, values in batch["rewards"].items()}}
            for name, values in named.items():
                scores.setdefault(name, []).extend(values.reshape(-1).tolist())
        if ranks > 1:
            parts = self.strategy.gather(scores)
            scores = {name: [x for part in parts for x in part.get(name, [])] for name in parts[0]}
        mean = {name: sum(values) / len(values) for name, values in scores.items()}
        metrics = {"eval/completion_length": mean.pop("length"), "eval/truncated": mean.pop("truncated")}
        total = mean.pop("reward")
        metrics.update({f"eval/{name}": value for name, value in mean.items()})
        return self.record(state, total, metrics)
