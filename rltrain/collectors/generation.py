"""``collector=generation``: a language-model policy's collector. Each batch:

1. takes the task's next ``frames_per_batch / group_size`` prompts (the task's own order: resumable);
2. asks the engine (``engine=``) for ``group_size`` completions of each, with the weights of the last
   push (the engine holds the sync scheme's receiver) and this batch's seed (``seed + batch index``);
3. scores every completion with the task's reward functions, against its prompt's row;
4. returns them as one ``[prompts, group_size]`` TensorDict stamped with the weights version that
   generated them and how they were sampled (``temperature``, ``max_new_tokens``: GRPO reads them
   from the batch, so the learner scores the distribution that was sampled).

The learner's optimizer never touches the weights that generate. With an engine of its own process
(``GENERATES_AHEAD``: ``engine=vllm``, ``engine=vllm_server``), ``max_lag: 1`` asks for the next batch
before this one is returned, so it generates while the learner updates: its completions then come
from the weights one push older than the learner's (GRPO's ``tis_cap`` corrects for that), and the
trainer drops a batch more than ``max_lag`` versions old.

On the ranks of a data-parallel learner (``strategy=ddp``) each rank's collector holds the same task at
the same position: every batch takes the whole job's prompts from it, the ones one process would take,
and rank r keeps its r-th share of them (whole groups, never a prompt another rank has), sampled with a
seed of its own (``seed + batch x ranks + r``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Annotated

import torch
from tensordict import TensorDict

from rltrain.collectors.batch import batch_steps
from rltrain.llm.engine import Engine, Sampling
from rltrain.llm.environments import is_language_env
from rltrain.llm.model import LanguageModel
from rltrain.llm.rewards import Rewards
from rltrain.llm.rollout import Conversation, Episodes, Limits, with_turn_tokens
from rltrain.llm.tasks import Task
from rltrain.protocols import Collector
from rltrain.rules import Flag, OneOf, PositiveFraction, PositiveInt, PositiveNumber, Satisfies
from rltrain.strategies import Single, Strategy

STOP = Satisfies(lambda v: isinstance(v, (list, tuple)) and all(isinstance(s, str) and s for s in v),
                 "a list of non-empty strings")
LAG = OneOf((0, 1), "0 (generate, then update) or 1 (generate the next batch during the update): the collector "
                    "asks for one batch ahead at most")


class GenerationCollector(Collector):
    """Yields ``[prompts, group_size]`` TensorDict batches of ``frames_per_batch`` completions (a
    frame is one completion), forever; keys: ``rltrain.llm.engine.Generated.as_batch``."""

    BATCH_ENVS = ("collector.group_size",)  # frames_per_batch must be a multiple of it
    RANK_SPLIT = ()  # data-parallel: each rank's frames_per_batch is its share, whole groups of its own prompts
    JOB_STATE = True  # its state (the task's position, batches drawn) is the job's: a rank without one takes rank 0's
    IN_LEARNER_PROCESS = True
    TASKS = True
    # Keys this collector had before the engine became a part of its own (engine=): the key that replaced each.
    MOVED_KEYS = {
        "engine": "is now engine=transformers|vllm|vllm_server (a config group: algo=grpo engine=vllm)",
        "vllm_url": "is now engine=vllm_server engine.url=URL",
        "kv_cache_gb": "is now engine.kv_cache_gb (engine=vllm)",
        "engine_threads": "is now engine.threads (engine=vllm)",
        "engine_gpu": "is now engine.gpu (engine=vllm)",
        "engine_gpu_memory": "is now engine.gpu_memory (engine=vllm)",
        "timeout_s": "is now engine.timeout_s (engine=vllm or vllm_server)",
    }

    def __init__(
        self,
        task: Task,
        engine: Engine,
        model: LanguageModel,
        rewards: Rewards,
        seed: int = 0,
        frames_per_batch: PositiveInt = 128,
        group_size: PositiveInt = 8,
        temperature: PositiveNumber = 1.0,
        top_p: PositiveFraction = 1.0,
        max_new_tokens: PositiveInt = 4,
        stop: Annotated[list[str], STOP] = (),
        greedy: Flag = False,
        max_lag: Annotated[int, LAG] = 0,
        strategy: Strategy = Single(),
        max_turns: PositiveInt = 4,  # a language environment's episodes: the model's turns at most
        max_context: PositiveInt | None = None,  # ... and their tokens in all, prompt and every turn (null: no bound)
        discount: PositiveFraction = 1.0,  # ... the environment's reward of turn t counts this ** t
    ):
        self.prompts_per_batch = batch_steps(frames_per_batch, group_size, "collector.group_size")
        self.rank, self.ranks = strategy.rank, strategy.size  # this rank's share of frames_per_batch (the factory's)
        self.group_size, self.seed, self.batches, self.max_lag = group_size, seed, 0, max_lag
        self.sampling = Sampling(temperature, top_p, max_new_tokens, tuple(stop), greedy)
        self.task, self.engine, self.rewards, self.model = task, engine, rewards, model
        self._pending: tuple[list[dict], float] | None = None  # a batch asked of the engine: its rows, and when
        self._ready: TensorDict | None = None  # a batch generated ahead, finished for a checkpoint, not yet returned
        self._failed: Exception | None = None  # what finishing a batch ahead for a checkpoint raised
        self.env = task if is_language_env(task) else None  # episodes of several turns (rltrain.llm.rollout)
        self.episodes: Episodes | None = None  # how its episodes are played (the eval hook plays them alike)
        if self.env is not None:
            template = bool(model.chat_template and getattr(engine.tokenizer, "chat_template", None))
            tools = getattr(task, "template_tools", lambda: None)()  # (the functions a template lists)
            limits = Limits(max_turns, max_context or model.context())  # (by default, the model's context)
            self.episodes = Episodes(Conversation(engine.tokenizer, template, tools), limits,
                                     with_turn_tokens(self.sampling, getattr(task, "STOP", ())), discount)

    def __iter__(self) -> Iterator[TensorDict]:
        while True:
            yield self.collect()

    def collect(self) -> TensorDict:
        """One batch: the next prompts, with the newest weights, scored. With ``max_lag`` (the vLLM
        engine), the batch after it is asked for before this one is returned."""
        if self._failed is not None:  # a checkpoint finished the batch ahead, and it failed
            failed, self._failed = self._failed, None
            raise failed
        if self._ready is not None:
            batch, self._ready = self._ready, None
        else:
            if self._pending is None:
                self._submit()
            batch = self._finish()
        if self.max_lag:
            self._ready = batch  # kept for a checkpoint, should asking for the next one fail
            self._submit()  # generates while the learner updates on this batch
            self._ready = None
        return batch

    def _submit(self) -> None:
        rows = self.task.take(self.prompts_per_batch * self.ranks)  # the whole job's prompts: this rank's share
        rows = rows[self.rank * self.prompts_per_batch:(self.rank + 1) * self.prompts_per_batch]
        prompts = [self.model.prompt_text(self.engine.tokenizer, row["prompt"]) for row in rows]
        seed = self.seed + self.batches * self.ranks + self.rank
        self.batches += 1
        started = time.perf_counter()
        try:
            if self.env is None:
                self.engine.submit(prompts, self.group_size, self.sampling, seed=seed)
        except Exception:
            self._give_back(rows)
            raise
        self._pending = (rows, started, seed)

    def _finish(self) -> TensorDict:
        rows, started, seed = self._pending
        try:
            if self.env is not None:
                batch = self._play(rows, seed)
            else:
                generated = self.engine.collect()
                seconds = self.engine.generate_s or time.perf_counter() - started  # not the update meanwhile
                batch = score(generated, rows, self.group_size, self.rewards, self.sampling, seconds)
        except Exception:
            self._give_back(rows)
            raise
        finally:
            self._pending = None
        return batch

    def _play(self, rows: list[dict], seed: int) -> TensorDict:
        """The episodes of ``rows`` (a language environment's), ``group_size`` of each, played to their ends with
        the newest weights, as one batch. Turn t of batch n samples with seed ``(seed + n) x max_turns + t``."""
        self.engine.refresh()
        return self.episodes.play(self.engine, self.env, rows, self.group_size, self.rewards,
                                  seed * self.episodes.limits.max_turns)

    def _give_back(self, rows: list[dict]) -> None:
        """The engine or a reward failed on the batch of ``rows``: it goes back to the task, so a checkpoint
        (the run's, as it fails) resumes with these prompts and this seed, and nothing is skipped."""
        self.task.position -= len(rows) * self.ranks
        self.batches -= 1

    def state_dict(self) -> dict:
        """Where the task is (its next prompt), and the seed and count of the batches drawn (batch n
        samples with seed + n: a resumed run draws what the uninterrupted one would have). A batch
        asked for ahead (``max_lag``) is finished and saved too: a resumed run returns it first, as
        it was generated (one push behind), as the uninterrupted run does."""
        if self._pending is not None:
            try:
                self._ready = self._finish()
            except Exception as e:  # noqa: BLE001  (given back to the task: the state below stays whole)
                self._failed = e  # the next collect() raises it: the run fails as it would have there
        state = {"task": self.task.state_dict(), "seed": self.seed, "batches": self.batches, "ranks": self.ranks}
        return state if self._ready is None else {**state, "ready": self._ready}

    def load_state_dict(self, state: dict) -> None:
        if self._pending is not None or self._ready is not None:
            raise ValueError("cannot restore the task with a batch generated ahead of it")
        self.task.load_state_dict(state["task"])
        self.seed, self.batches = int(state["seed"]), int(state["batches"])
        ready, ranks = state.get("ready"), state.get("ranks", 1)
        if ready is not None and ranks != self.ranks:
            # a share generated ahead for another number of ranks: its batch's prompts go back to the task, to be
            # generated again as this job splits them (every rank gives back the same prompts)
            self.task.position -= ready.shape[0] * ranks
            self.batches -= 1
            ready = None
        if ready is not None and "temperature" not in ready.keys():
            # saved before batches said how they were sampled: with this collector's settings, as they were then
            shape = ready.shape
            ready = ready.reshape(-1)
            ready["temperature"] = torch.full((ready.numel(),), self.sampling.policy_temperature)
            ready["max_new_tokens"] = torch.full((ready.numel(),), self.sampling.max_new_tokens, dtype=torch.int64)
            ready = ready.reshape(*shape)
        self._ready = ready

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
        self.engine.close()


def complete(engine: Engine, model: LanguageModel, rows: list[dict], group_size: int,
             sampling: Sampling, rewards: Rewards, seed: int | None = None) -> TensorDict:
    """``group_size`` completions of each row's prompt, as the model reads it (``model.prompt_text``),
    scored: the collector's batches and the eval hook's (with the seconds generation took)."""
    prompts = [model.prompt_text(engine.tokenizer, row["prompt"]) for row in rows]
    start = time.perf_counter()
    generated = engine.generate(prompts, group_size, sampling, seed=seed)
    return score(generated, rows, group_size, rewards, sampling, time.perf_counter() - start)


def score(generated, rows: list[dict], group_size: int, rewards: Rewards, sampling: Sampling,
          generate_s: float = 0.0) -> TensorDict:
    """``generated``'s batch (``Generated.as_batch``) with every completion scored by ``rewards``
    against its prompt's row (the task's own prompt, not the chat-templated text)."""
    totals, each = [], {name: [] for name in rewards.functions}
    for i, text in enumerate(generated.texts):
        row = rows[i // group_size]
        total, values = rewards(row["prompt"], text, row)
        totals.append(total)
        for name, value in values.items():
            each[name].append(value)
    return generated.as_batch(group_size, sampling, torch.tensor(totals),
                              {name: torch.tensor(values) for name, values in each.items()}, generate_s)
