"""Generation engines (``engine=``): what samples groups of completions with the policy's current weights.

An ``Engine`` turns prompts into ``Generated``: ``group_size`` completions of each prompt (one after
another), padded token batches with masks, each generated token's sampling log-prob (under the
distribution it was drawn from: after temperature and top-p) and the weights version that produced
them. It also says how the learner's weights reach it (``WEIGHTS``), which the sync scheme's
``DELIVERS`` must be one of. ``TransformersEngine`` (``engine=transformers``) runs transformers' own
generation (with its KV cache) in this process; ``rltrain.llm.vllm`` has vLLM's (``engine=vllm``,
``engine=vllm_server``). A class of your own is a ``_target_`` away.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
from tensordict import TensorDict
from torch.distributed.tensor import DTensor

from rltrain.errors import NonFiniteError
from rltrain.llm.model import base_model
from rltrain.llm.prompt_cache import cache_name, prompt_pass
from rltrain.rules import Flag, PositiveFraction, PositiveInt, PositiveNumber
from rltrain.sync.base import WeightReceiver


@dataclass(frozen=True)
class Sampling:
    """How completions are drawn (the collector's keys)."""

    temperature: PositiveNumber = 1.0
    top_p: PositiveFraction = 1.0
    max_new_tokens: PositiveInt = 4
    stop: tuple[str, ...] = field(default_factory=tuple)  # a completion ends after the first of these strings
    greedy: Flag = False  # the most likely token at every step (evaluation), instead of sampling

    @property
    def policy_temperature(self) -> float:
        """The temperature of the policy whose log-probs the completions carry (greedy ones: the model's own)."""
        return 1.0 if self.greedy else self.temperature


@dataclass
class Generated:
    """``B = prompts x group_size`` completions, row ``i`` of prompt ``i // group_size``.

    ``prompt_ids``/``prompt_mask`` ``[B, P]`` (left-padded), ``completion_ids``/``completion_mask``
    ``[B, T]`` (right-padded: the mask keeps each completion's tokens up to and including its end, the
    eos token or the token that completed a stop string), ``logprobs`` ``[B, T]`` (0 where masked),
    ``truncated`` ``[B]`` (cut at ``max_new_tokens``), ``texts`` (each completion, without eos or
    padding), ``version`` (of the weights that generated every row)."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    logprobs: torch.Tensor
    truncated: torch.Tensor
    texts: list[str]
    version: int

    def as_batch(self, group_size: int, sampling: Sampling, reward: torch.Tensor,
                 rewards: dict[str, torch.Tensor] | None = None, generate_s: float = 0.0) -> TensorDict:
        """The learner's ``[prompts, group_size]`` TensorDict: the token tensors above (``log_prob``:
        the sampling log-probs), ``reward`` (the weighted total) and ``("rewards", name)`` (each
        function's), and what the trainer counts of every batch: each completion is one frame and one
        episode (``done``; ``episode_return``, its reward; ``episode_length``, its tokens),
        ``policy_version``, ``nonfinite`` (never: rewards are checked as they are computed), and
        ``generate_s``, each completion's share of the seconds the batch took to generate; and how it was
        sampled, which the learner reads instead of a setting of its own: ``temperature`` (the policy is the
        model's distribution at it: 1 for greedy completions) and ``max_new_tokens``."""
        rows = len(self.texts)
        shape = (rows // group_size, group_size)
        lengths = self.completion_mask.sum(dim=1).cpu()
        data = {  # on the host, as every collector's batch (the learner takes it to its device)
            "prompt_ids": self.prompt_ids.cpu(), "prompt_mask": self.prompt_mask.cpu(),
            "completion_ids": self.completion_ids.cpu(), "completion_mask": self.completion_mask.cpu(),
            "log_prob": self.logprobs.cpu(), "truncated": self.truncated.cpu(),
            "reward": reward.float(), "rewards": {k: v.float() for k, v in (rewards or {}).items()},
            "done": torch.ones(rows, dtype=torch.bool), "episode_return": reward.float(), "episode_length": lengths,
            "policy_version": torch.full((rows,), self.version, dtype=torch.int64),
            "nonfinite": torch.zeros(rows, dtype=torch.bool), "generate_s": torch.full((rows,), generate_s / rows),
            "temperature": torch.full((rows,), sampling.policy_temperature),
            "max_new_tokens": torch.full((rows,), sampling.max_new_tokens, dtype=torch.int64),
        }
        return TensorDict(data, batch_size=[rows]).reshape(*shape)


class Engine(ABC):
    """Generates with the weights it holds (``version``); rltrain's sync schemes replace them.

    Its constructor takes its config keys (``engine.*``) and, by name, what build gives it: ``model``
    (the run's ``LanguageModel``), ``tokenizer`` (its tokenizer), ``receiver`` (the sync scheme's), ``policy``
    (a copy of the learner's model on the learner's device, for an engine of this process), ``device``,
    ``seed``, ``run_dir``.
    Capabilities: ``WEIGHTS``, how the learner's weights reach it (see ``WeightSyncScheme.DELIVERS``):
    ``module``, the receiver is connected to the engine's model in this process (by the engine); ``snapshot``,
    the engine loads the newest snapshot itself (a ``SnapshotReceiver``'s); ``push``, the learner pushes
    through ``transfer_client()``; ``GENERATES_AHEAD``, whether ``submit`` returns at once (generation in
    another process), so that ``collector.max_lag: 1`` can generate the next batch during an update;
    ``LEARNER_RANKS``, whether every rank of a data-parallel learner (``strategy=ddp``) can hold one of its
    own, generating that rank's share; ``TOKEN_PROMPTS``, whether ``generate`` takes prompts as token ids (a
    conversation of several turns, which must never be tokenized again).
    """

    WEIGHTS: tuple[str, ...] = ("module",)
    GENERATES_AHEAD = False
    LEARNER_RANKS = False
    TOKEN_PROMPTS = False
    version: int = 0
    generate_s: float | None = None  # what the last collected batch took to generate, where the engine times it

    @abstractmethod
    def generate(self, prompts: list[str], group_size: int, sampling: Sampling, seed: int | None = None) -> Generated:
        """``group_size`` sampled completions of each prompt (a text, or token ids where the engine takes them:
        ``TOKEN_PROMPTS``)."""

    def submit(self, prompts: list[str], group_size: int, sampling: Sampling, seed: int | None = None) -> None:
        """Ask for ``generate``'s completions, returned by ``collect``. An engine of another process
        starts and returns at once (the learner updates meanwhile); this default generates now."""
        self._submitted = self.generate(prompts, group_size, sampling, seed)

    def turns(self) -> contextlib.AbstractContextManager:
        """Around the ``generate`` calls of an episode's turns, each continuing the sequences of the last: an
        engine that can keeps what it computed of them (its KV cache) from one call to the next."""
        return contextlib.nullcontext()

    def refresh(self) -> None:
        """Take the newest pushed weights now (before the ``generate`` calls of one batch: an episode's turns all
        generate with the same weights). Nothing to do for an engine that loads them as it generates."""

    def collect(self) -> Generated:
        """The completions the last ``submit`` asked for."""
        generated, self._submitted = getattr(self, "_submitted", None), None
        if generated is None:
            raise RuntimeError("collect() without submit()")
        return generated

    def transfer_client(self):
        """What the learner's sender pushes through (``rltrain.llm.vllm.transfer.TransferClient``), for an
        engine whose ``WEIGHTS`` has ``push``."""
        raise NotImplementedError(f"{type(self).__name__} takes no pushes")

    def close(self) -> None:
        """Release what the engine holds."""


class TransformersEngine(Engine):
    """``engine=transformers``: transformers' ``generate`` on a model of this process (the embedded default).
    ``policy``: the model it generates with, fed by ``receiver`` before each batch (None: the weights stay
    as they are, as for the eval hook, which generates with the learner's own model)."""

    LEARNER_RANKS = True  # one per rank, generating with that rank's copy of the policy (fed by its pushes)
    TOKEN_PROMPTS = True

    def __init__(self, policy, tokenizer, receiver: WeightReceiver | None = None):
        self.model, self.tokenizer, self.receiver = policy, tokenizer, receiver
        self._turns: tuple | None = None  # within turns(): the last call's rows, kept for the next (else None)
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token; set one (tokenizer.pad_token = tokenizer.eos_token)")
        if receiver is not None:  # on the CPU it reads the published snapshot in place; on a GPU, copies each one
            receiver.connect(policy)

    def submit(self, prompts: list[str], group_size: int, sampling: Sampling, seed: int | None = None) -> None:
        """Generate now, with the newest pushed weights."""
        self.refresh()
        super().submit(prompts, group_size, sampling, seed)

    def refresh(self) -> None:
        if self.receiver is not None:
            self.receiver.poll()
            self.version = self.receiver.version

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()

    @torch.no_grad()
    def generate(self, prompts: list[str], group_size: int, sampling: Sampling, seed: int | None = None) -> Generated:
        tok, model = self.tokenizer, self.model
        continued = self._continued(prompts) if group_size == 1 else None
        if continued is None:
            ids, mask = left_padded(tok, prompts)
            prompt_ids, prompt_mask = (t.repeat_interleave(group_size, dim=0).to(model.device)
                                       for t in (ids, mask))  # each prompt's group, one after another
            cache = None
        else:
            prompt_ids, prompt_mask, cache = continued
        with torch.random.fork_rng(devices=[model.device] if model.device.type == "cuda" else []):
            if seed is not None:  # this draw's own seed; the caller's random state stays as it was
                torch.manual_seed(seed)
            out = self._generate(prompt_ids, prompt_mask, sampling, group_size, cache)
        ids = out.sequences[:, prompt_ids.shape[1]:]
        # Each token's log-prob under the policy: the model's distribution at the sampling temperature, as the
        # learner computes it (top_p narrows what is drawn, not the policy whose ratios the learner takes).
        logits = torch.stack(out.logits, dim=1).float() / sampling.policy_temperature  # [B, T, V]
        if not torch.isfinite(logits).all():  # the sampler drew from cleaned scores (remove_invalid_values), so say it
            raise self._nonfinite()
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        lengths = [self._length(row, sampling.stop) for row in ids.tolist()]
        steps = torch.arange(ids.shape[1], device=ids.device)
        ends = torch.tensor([n for n, _ in lengths], device=ids.device)
        mask = (steps[None, :] < ends[:, None]).long()
        texts = [tok.decode(row[:n], skip_special_tokens=True) for row, (n, _) in zip(ids.tolist(), lengths)]
        if self._turns is not None:  # kept for the next turn: every row's tokens so far, and their keys and values
            whole = torch.cat([prompt_mask, mask], dim=1)
            cache = getattr(out, "past_key_values", None) or getattr(out, cache_name(model), None)
            self._turns = (out.sequences, whole, cache,
                           {tuple(row[m.bool()].tolist()): i for i, (row, m) in enumerate(zip(out.sequences, whole))})
        return Generated(prompt_ids, prompt_mask, ids.masked_fill(mask == 0, tok.pad_token_id), mask,
                         logprobs.masked_fill(mask == 0, 0.0),
                         torch.tensor([cut for _, cut in lengths], device=ids.device), texts, self.version)

    def _nonfinite(self) -> NonFiniteError:
        dtype = next(self.model.parameters()).dtype
        return NonFiniteError(f"the model computed NaN or infinite logits while generating with weights version "
                              f"{self.version} (its weights are finite: the learner checks them after every update, "
                              f"but their values overflow a {dtype} forward pass). float16 is too narrow to train in "
                              "(Adam's steps grow its weights until a forward pass overflows): use model.dtype=float32 "
                              "(or bfloat16, for LoRA); with float32 already, lower algo.lr")

    def _generate(self, ids: torch.Tensor, mask: torch.Tensor, sampling: Sampling, group_size: int, cache=None):
        """transformers' generation (KV cache) with the raw logits of every step. Each group's prompt but
        its last token goes through the model once, and every completion of the group starts from that
        cache (``rltrain.llm.prompt_cache``); ``cache``: the keys and values of the start of ``ids`` (an
        episode's turns so far). Tokens are drawn by ``sampling`` alone: the model's own generation defaults
        (its generation_config.json: a repetition penalty, top_k, ...) are set aside for the call, since the
        learner knows nothing of them."""
        tok, model = self.tokenizer, self.model
        drawn = {"do_sample": False} if sampling.greedy else {
            "do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": 0}
        if cache is not None:
            drawn[cache_name(model)] = cache
        elif group_size > 1 and ids.shape[1] > 1:
            drawn[cache_name(model)] = prompt_pass(model, ids[:, :-1], mask[:, :-1], group_size)[1]
        from transformers import GenerationConfig

        base = base_model(model)
        own = base.generation_config
        base.generation_config = GenerationConfig(bos_token_id=own.bos_token_id, eos_token_id=tok.eos_token_id,
                                                  pad_token_id=tok.pad_token_id)
        try:
            return model.generate(input_ids=ids, attention_mask=mask, **drawn, max_new_tokens=sampling.max_new_tokens,
                                  pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                  stop_strings=list(sampling.stop) or None, tokenizer=tok if sampling.stop else None,
                                  output_logits=True, return_dict_in_generate=True,
                                  # sharded over ranks (strategy=fsdp): every forward pass is a collective of all
                                  # of them, so a rank whose completions have ended steps on until every rank's have
                                  synced_gpus=isinstance(next(model.parameters()), DTensor),
                                  # NaN/inf scores cleaned before drawing: torch's sampler would raise on them, and
                                  # on CUDA assert on the device (which ends the process's CUDA context). The raw
                                  # logits stay as they were, and generate() names the failure from them.
                                  remove_invalid_values=True)
        finally:
            base.generation_config = own

    @contextlib.contextmanager
    def turns(self):
        # Each call's sequences and KV cache are kept for the next. A prompt that continues a kept row (its
        # tokens so far, then the environment's answer) is appended to that row as it is laid out, padding and
        # all (masked), and only what the cache does not hold goes through the model.
        sharded = isinstance(next(self.model.parameters()), DTensor)  # (every rank generates in step: no reuse)
        self._turns = None if sharded else ()
        try:
            yield
        finally:
            self._turns = None

    def _continued(self, prompts: list) -> tuple[torch.Tensor, torch.Tensor, object] | None:
        """``prompts`` as continuations of the rows the last call kept (within ``turns``): their ids and mask,
        each a kept row with its new tokens right-aligned after it, and the kept cache of those rows; None where a
        prompt continues no kept row (or is text)."""
        if not self._turns or not prompts or isinstance(prompts[0], str):
            return None
        sequences, mask, cache, rows = self._turns
        lengths = sorted({len(r) for r in rows}, reverse=True)
        picks, tails = [], []
        for prompt in prompts:
            row = next((rows[key] for n in lengths if n < len(prompt) and (key := tuple(prompt[:n])) in rows), None)
            if row is None:
                return None
            picks.append(row)
            tails.append(prompt[int(mask[row].sum()):])
        width = max(len(t) for t in tails)
        new_ids = torch.full((len(prompts), width), self.tokenizer.pad_token_id, dtype=torch.long)
        new_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, tail in enumerate(tails):
            new_ids[i, width - len(tail):], new_mask[i, width - len(tail):] = torch.tensor(tail), 1
        index = torch.tensor(picks, device=sequences.device)
        cache.batch_select_indices(index)
        self._turns = ()  # (its cache now holds the picked rows only)
        device = sequences.device
        return (torch.cat([sequences[index], new_ids.to(device)], dim=1),
                torch.cat([mask[index], new_mask.to(device)], dim=1), cache)

    def _length(self, row: list[int], stop: tuple[str, ...]) -> tuple[int, bool]:
        """How many tokens of ``row`` the completion holds, and whether ``max_new_tokens`` cut it."""
        eos = self.tokenizer.eos_token_id
        end = row.index(eos) + 1 if eos in row else len(row)
        if stop and self._stops_in(row[:end], stop):
            low, high = 1, end  # the shortest prefix that holds a stop string (a longer one holds it too)
            while low < high:
                middle = (low + high) // 2
                low, high = (low, middle) if self._stops_in(row[:middle], stop) else (middle + 1, high)
            return low, False
        return end, eos not in row[:end]

    def _stops_in(self, ids: list[int], stop: tuple[str, ...]) -> bool:
        text = self.tokenizer.decode(ids)
        return any(s in text for s in stop)


def left_padded(tokenizer, prompts: list[str] | list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``prompts`` as a left-padded batch of token ids and its attention mask: texts tokenized (no special tokens
    added), or token ids as they are (a conversation's turns, never tokenized again)."""
    if prompts and not isinstance(prompts[0], str):
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            if p:
                ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
                mask[i, width - len(p):] = 1
        return ids, mask
    tokenizer.padding_side = "left"
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    return encoded["input_ids"], encoded["attention_mask"]


class LearnerEngine(TransformersEngine):
    """``engine=learner``: transformers' ``generate`` on the learner's own model, in the learner's process. No
    copy is made and no weights move (``sync=in_place``): every batch is generated with the newest weights.
    With ``strategy=fsdp`` it generates through the sharded model, gathering one decoder layer at a time, so
    that no rank ever holds the whole model; every rank generates its share of the prompts in step (transformers'
    ``synced_gpus``: a rank whose completions have ended goes on stepping until the longest has)."""

    WEIGHTS = ("learner",)

    def __init__(self, learner, tokenizer, receiver: WeightReceiver | None = None):
        super().__init__(learner, tokenizer, receiver)
