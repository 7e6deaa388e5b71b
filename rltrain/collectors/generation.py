"""``collector=generation``: a language-model policy's collector. Each batch takes the task's next
prompts, samples ``group_size`` completions of each with the weights of the last push, and scores
every completion with the task's reward functions.

Two engines generate (``engine``). ``transformers`` (the default): a copy of the learner's model, on
the learner's device, fed only through the weight-sync receiver at the start of each batch, as every
collector's policy is (on the CPU it reads the published snapshot in place; on a GPU each new version
is copied into it). ``vllm``: a vLLM engine in a process of its own (``rltrain.llm.vllm_engine``;
beside a CUDA learner, on the GPU ``engine_gpu`` with ``engine_gpu_memory`` of its memory), fed by
``sync=vllm``; or, given ``vllm_url``, a vLLM server the user runs (``rltrain.llm.vllm_server``).
Either way the learner's optimizer never touches the weights that generate, and each completion
carries the version that generated it.

With the vLLM engine, ``max_lag: 1`` generates the next batch while the learner updates on this one:
its completions then come from the weights one push older than the learner's (GRPO's ``tis_cap``
corrects for that), and the trainer drops a batch more than ``max_lag`` versions old.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated

import torch
from tensordict import TensorDict

from rltrain.collectors.batch import MaxLag, batch_steps
from rltrain.llm.engine import Engine, Sampling, TransformersEngine
from rltrain.llm.model import LanguageModel
from rltrain.llm.rewards import Rewards
from rltrain.llm.tasks import Task
from rltrain.protocols import Collector
from rltrain.rules import Flag, Integer, OneOf, PositiveFraction, PositiveInt, PositiveNumber, Satisfies
from rltrain.sync.base import WeightReceiver

STOP = Satisfies(lambda v: isinstance(v, (list, tuple)) and all(isinstance(s, str) and s for s in v),
                 "a list of non-empty strings")
ENGINES = ("transformers", "vllm")
THREADS = Integer(1, null="vLLM's own choice: every core")  # collector.engine_threads
GPU = Integer(0, null="the learner's GPU")  # collector.engine_gpu


def engine_gpu_index(device: torch.device | str, engine_gpu: int | None) -> int:
    """The CUDA device index rltrain's vLLM engine runs on beside a learner on ``device``."""
    device = torch.device(device)
    return engine_gpu if engine_gpu is not None else (device.index or 0)


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
        engine: Annotated[str, OneOf(ENGINES)] = "transformers",
        max_lag: MaxLag = 0,
        timeout_s: PositiveNumber = 300.0,
        kv_cache_gb: PositiveNumber = 1.0,
        vllm_url: str | None = None,
        engine_threads: Annotated[int | None, THREADS] = 1,
        engine_gpu: Annotated[int | None, GPU] = None,
        engine_gpu_memory: PositiveFraction = 0.4,
        run_dir: str | Path | None = None,  # set by build: the run a vLLM server of the user's is claimed for
    ):
        self.prompts_per_batch = batch_steps(frames_per_batch, group_size, "collector.group_size")
        self.group_size, self.seed, self.batches, self.max_lag = group_size, seed, 0, max_lag
        self.sampling = Sampling(temperature, top_p, max_new_tokens, tuple(stop), greedy)
        self.task, self.rewards, self.model = make_env(), rewards, model
        self.receiver = make_receiver()
        self.engine: Engine
        if engine == "vllm" and vllm_url:
            from rltrain.llm.vllm_server import VLLMServer

            self.engine = VLLMServer(vllm_url, model.tokenizer(), self.receiver, timeout_s=timeout_s, dtype=model.dtype,
                                     run_dir=run_dir)
        elif engine == "vllm":
            from rltrain.llm.vllm_engine import VLLMEngine

            gpu = None if torch.device(device).type != "cuda" else engine_gpu_index(device, engine_gpu)
            self.engine = VLLMEngine(model.source(), model.tokenizer(), self.receiver, seed=seed, dtype=model.dtype,
                                     kv_cache_gb=kv_cache_gb, timeout_s=timeout_s, threads=engine_threads,
                                     gpu=gpu, gpu_memory=engine_gpu_memory)
        else:
            self.engine = TransformersEngine(make_policy().to(device), model.tokenizer())
            self.receiver.connect(self.engine.model)
        self._local = engine == "transformers"  # its weights come through this process's receiver
        self._pending: tuple[list[dict], float] | None = None  # a batch asked of the engine: its rows, and when
        self._ready: TensorDict | None = None  # a batch generated ahead, finished for a checkpoint, not yet returned
        self._failed: Exception | None = None  # what finishing a batch ahead for a checkpoint raised

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
        if self.max_lag and not self._local:
            self._ready = batch  # kept for a checkpoint, should asking for the next one fail
            self._submit()  # generates while the learner updates on this batch
            self._ready = None
        return batch

    def _submit(self) -> None:
        rows = self.task.take(self.prompts_per_batch)
        prompts = [self.model.prompt_text(self.engine.tokenizer, row["prompt"]) for row in rows]
        seed = self.seed + self.batches
        self.batches += 1
        if self._local:  # the newest weights; the vLLM engine's process loads them itself
            self.receiver.poll()
            self.engine.version = self.receiver.version
        started = time.perf_counter()
        try:
            self.engine.submit(prompts, self.group_size, self.sampling, seed=seed)
        except Exception:
            self._give_back(rows)
            raise
        self._pending = (rows, started)

    def _finish(self) -> TensorDict:
        rows, started = self._pending
        try:
            generated = self.engine.collect()
            seconds = self.engine.generate_s or time.perf_counter() - started  # not the learner's update meanwhile
            batch = score(generated, rows, self.group_size, self.rewards, seconds)
        except Exception:
            self._give_back(rows)
            raise
        finally:
            self._pending = None
        return batch

    def _give_back(self, rows: list[dict]) -> None:
        """The engine or a reward failed on the batch of ``rows``: it goes back to the task, so a checkpoint
        (the run's, as it fails) resumes with these prompts and this seed, and nothing is skipped."""
        self.task.position -= len(rows)
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
        state = {"task": self.task.state_dict(), "seed": self.seed, "batches": self.batches}
        return state if self._ready is None else {**state, "ready": self._ready}

    def load_state_dict(self, state: dict) -> None:
        if self._pending is not None or self._ready is not None:
            raise ValueError("cannot restore the task with a batch generated ahead of it")
        self.task.load_state_dict(state["task"])
        self.seed, self.batches = int(state["seed"]), int(state["batches"])
        self._ready = state.get("ready")

    def close(self) -> None:
        self.engine.close()
        self.receiver.close()


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
