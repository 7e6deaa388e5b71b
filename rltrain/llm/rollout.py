"""Episodes of several turns: the model and a language environment (``rltrain.llm.environments``) taking turns.

Every episode of a batch steps together: one generate call per turn across the episodes still running (the
first turn generates each row's group from its one prompt; the ones that have ended drop out of the calls).

**Tokens in, tokens out.** An episode is token ids from start to end, never text tokenized again: its opening
messages tokenized once, then each turn's tokens exactly as the engine generated them, then the environment's
answer tokenized alone and appended. The learner trains on that sequence, with a loss mask that keeps the
model's tokens only (``loss_mask``; the prompt and every environment token are context), and the engine's
log-prob of each of them.

**Rendering.** With a chat template (``model.chat_template`` and a tokenizer that has one), the opening messages
are the template's, with the generation prompt, and each answer of the environment is what the template adds
after the model's turn: its messages, and the next generation prompt. Without one (the tiny model), the
opening is the first message's content, a tool's result is appended as ``<result>TEXT</result>``, and any
other message as its content on a line of its own.

**Limits.** ``max_turns`` model turns at most; each turn at most the collector's ``max_new_tokens``; the whole
episode (prompt and every turn) at most ``context`` tokens (by default the model's context). An episode that
ends by a limit, not by the environment, is cut and marked ``truncated``, as is one whose last turn was cut at
``max_new_tokens``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict

from rltrain.errors import NonFiniteError
from rltrain.llm.engine import Engine, Sampling
from rltrain.llm.rewards import Rewards

COUNTS = ("tool_calls", "tool_errors")  # what a step may count, summed per episode into the batch
_MARK = "\x00rltrain-turn\x00"  # stands for a model turn while the template renders what follows it


@dataclass(frozen=True)
class Limits:
    """How long an episode may run: model turns, and tokens in all (None: no bound; the collector passes the
    model's context)."""

    max_turns: int = 4
    context: int | None = None


class Conversation:
    """Turns messages into the token ids an episode appends (see the module's docstring, Rendering)."""

    def __init__(self, tokenizer, template: bool, tools: list | None = None):
        """``tools``: the functions the template lists for the model (a tool environment's, in the template's
        format)."""
        self.tokenizer, self.template, self.tools = tokenizer, template, tools

    def opening(self, messages: list[dict]) -> list[int]:
        if self.template:
            text = self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                      add_generation_prompt=True)
        else:
            text = "\n".join(m["content"] for m in messages)
        return self._ids(text)

    def answer(self, messages: list[dict], turn_ended: bool) -> list[int]:
        """The ids of the environment's ``messages`` after a model turn (``turn_ended``: the turn ended with the
        end-of-turn token, which the template writes after a turn and the model wrote itself)."""
        if not self.template:
            return self._ids("".join(f"<result>{m['content']}</result>" if m["role"] == "tool" else
                                     f"\n{m['content']}\n" for m in messages))
        before = [{"role": "user", "content": "-"}, {"role": "assistant", "content": _MARK}]
        text = self.tokenizer.apply_chat_template([*before, *messages], tokenize=False, add_generation_prompt=True)
        text = text[text.index(_MARK) + len(_MARK):]
        eos = self.tokenizer.eos_token or ""
        if turn_ended and eos and text.startswith(eos):
            text = text[len(eos):]
        return self._ids(text)

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


@dataclass
class Episode:
    """One episode as it runs: its row and state, its opening ``prompt`` ids, then every later token (``tail``)
    with whether the model generated it (``own``) and the engine's log-prob of it."""

    row: dict
    state: Any
    prompt: list[int]
    tail: list[int] = field(default_factory=list)
    own: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    env_reward: float = 0.0
    turns: int = 0
    done: bool = False
    truncated: bool = False
    reply: str = ""  # the model's last turn, as text (what the reward functions score)
    counts: Counter = field(default_factory=Counter)

    def length(self) -> int:
        return len(self.prompt) + len(self.tail)


def run_episodes(engine: Engine, env, conversation: Conversation, rows: list[dict], group_size: int,
                 sampling: Sampling, limits: Limits, seed: int | None = None,
                 discount: float = 1.0) -> tuple[list[Episode], float]:
    """``group_size`` episodes of each row, played to their ends; and the seconds generation took. Turn ``t``
    samples with ``seed + t`` (None: unseeded); the environment's reward for turn ``t`` counts ``discount ** t``."""
    episodes = []
    for row in rows:
        for _ in range(group_size):
            state, messages = env.reset(row)
            episodes.append(Episode(row, state, conversation.opening(messages)))
    context = limits.context or 1 << 62
    with engine.turns():
        generate_s = _play(engine, env, conversation, episodes, group_size, sampling, limits.max_turns, context,
                           seed, discount)
    return episodes, generate_s


def _play(engine: Engine, env, conversation: Conversation, episodes: list[Episode], group_size: int,
          sampling: Sampling, max_turns: int, context: int, seed: int | None, discount: float) -> float:
    """``run_episodes``'s turns; the seconds generation took."""
    generate_s = 0.0
    for turn in range(max_turns):
        for episode in episodes:
            if not episode.done and episode.length() >= context:  # no room left for a token of a turn
                episode.done = episode.truncated = True
        running = [e for e in episodes if not e.done]
        if not running:
            break
        started = time.perf_counter()
        turn_seed = None if seed is None else seed + turn
        if turn == 0 and len(running) == len(episodes):  # each row's group from its one prompt (one pass each)
            generated = engine.generate([e.prompt for e in running[::group_size]], group_size, sampling, turn_seed)
        else:
            generated = engine.generate([e.prompt + e.tail for e in running], 1, sampling, turn_seed)
        generate_s += time.perf_counter() - started
        for i, episode in enumerate(running):
            n = int(generated.completion_mask[i].sum())
            room = max(context - episode.length(), 0)
            ids = generated.completion_ids[i, :min(n, room)].tolist()
            episode.tail += ids
            episode.own += [True] * len(ids)
            episode.logprobs += generated.logprobs[i, :len(ids)].tolist()
            episode.reply, episode.turns = generated.texts[i] if len(ids) == n else "", turn + 1
            if len(ids) < n:  # out of context in the middle of the turn
                episode.done = episode.truncated = True
                continue
            step = env.step(episode.state, generated.texts[i])
            reward = float(step.reward)
            if not math.isfinite(reward):
                raise NonFiniteError(f"env {type(env).__name__} gave the reward {step.reward!r} at turn {turn + 1} "
                                     f"of an episode on {episode.row['prompt']!r}: a reward must be a finite number")
            episode.state = episode.state if step.state is None else step.state  # (None: unchanged)
            episode.env_reward += discount ** turn * reward
            episode.counts.update(step.counts)
            if step.done:
                episode.done = True
                episode.truncated = bool(generated.truncated[i])  # its last turn cut at max_new_tokens
                continue
            answer = conversation.answer(step.messages, ended_with(ids, engine.tokenizer.eos_token_id))
            if turn == max_turns - 1 or episode.length() + len(answer) >= context:
                episode.done = episode.truncated = True  # (no room for the environment's answer and a turn)
                continue
            episode.tail += answer
            episode.own += [False] * len(answer)
            episode.logprobs += [0.0] * len(answer)
    return generate_s


def ended_with(ids: list[int], token: int | None) -> bool:
    return bool(ids) and ids[-1] == token


def as_batch(episodes: list[Episode], group_size: int, sampling: Sampling, rewards: Rewards, pad_id: int,
             version: int, generate_s: float, most_tokens: int) -> TensorDict:
    """The learner's ``[rows, group_size]`` TensorDict of ``episodes`` (a frame is one episode): the keys of a
    single-turn batch (``Generated.as_batch``: ``completion_*`` is everything after the opening prompt, the
    environment's tokens included), and ``loss_mask`` (the model's tokens), ``turns`` and each of ``COUNTS``.
    The reward is the environment's (summed over turns) plus the reward functions' on the last reply.
    ``max_new_tokens`` is ``most_tokens``, the model's tokens an episode can hold (Dr. GRPO's normaliser)."""
    rows = len(episodes)
    width_p = max(len(e.prompt) for e in episodes)
    width_t = max(max(len(e.tail) for e in episodes), 1)
    prompt_ids = torch.full((rows, width_p), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((rows, width_p), dtype=torch.long)
    ids = torch.full((rows, width_t), pad_id, dtype=torch.long)
    mask = torch.zeros((rows, width_t), dtype=torch.long)
    own = torch.zeros((rows, width_t), dtype=torch.long)
    logprobs = torch.zeros((rows, width_t))
    totals, each = [], {name: [] for name in rewards.functions}
    for i, e in enumerate(episodes):
        prompt_ids[i, width_p - len(e.prompt):] = torch.tensor(e.prompt)
        prompt_mask[i, width_p - len(e.prompt):] = 1
        n = len(e.tail)
        if n:
            ids[i, :n], mask[i, :n] = torch.tensor(e.tail), 1
            own[i, :n], logprobs[i, :n] = torch.tensor(e.own, dtype=torch.long), torch.tensor(e.logprobs)
        total, values = rewards(e.row["prompt"], e.reply, e.row) if rewards.functions else (0.0, {})
        totals.append(e.env_reward + total)
        for name, value in values.items():
            each[name].append(value)
    reward = torch.tensor(totals, dtype=torch.float32)
    data = {
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": ids, "completion_mask": mask,
        "loss_mask": own, "log_prob": logprobs, "truncated": torch.tensor([e.truncated for e in episodes]),
        "reward": reward, "rewards": {"env": torch.tensor([e.env_reward for e in episodes], dtype=torch.float32),
                                      **{k: torch.tensor(v, dtype=torch.float32) for k, v in each.items()}},
        "done": torch.ones(rows, dtype=torch.bool), "episode_return": reward, "episode_length": own.sum(dim=1),
        "policy_version": torch.full((rows,), version, dtype=torch.int64),
        "nonfinite": torch.zeros(rows, dtype=torch.bool), "generate_s": torch.full((rows,), generate_s / rows),
        "temperature": torch.full((rows,), sampling.policy_temperature),
        "max_new_tokens": torch.full((rows,), most_tokens, dtype=torch.int64),
        "turns": torch.tensor([e.turns for e in episodes]),
        **{name: torch.tensor([e.counts[name] for e in episodes]) for name in COUNTS},
    }
    return TensorDict(data, batch_size=[rows]).reshape(rows // group_size, group_size)


@dataclass(frozen=True)
class Episodes:
    """How a run plays a language environment's episodes (the collector's settings, which the eval hook shares)."""

    conversation: Conversation
    limits: Limits
    sampling: Sampling  # each turn's (the environment's turn-ending strings among its stop strings)
    discount: float = 1.0

    def play(self, engine: Engine, env, rows: list[dict], group_size: int, rewards: Rewards,
             seed: int | None = None, greedy: bool = False) -> TensorDict:
        """``group_size`` episodes of each row, played to their ends, as one batch (``as_batch``)."""
        sampling = dataclasses.replace(self.sampling, greedy=True) if greedy else self.sampling
        episodes, seconds = run_episodes(engine, env, self.conversation, rows, group_size, sampling, self.limits,
                                         seed, self.discount)
        return as_batch(episodes, group_size, sampling, rewards, engine.tokenizer.pad_token_id, engine.version,
                        seconds, self.limits.max_turns * sampling.max_new_tokens)


def with_turn_tokens(sampling: Sampling, stop: tuple[str, ...]) -> Sampling:
    """``sampling`` that also ends a turn at each of ``stop`` (an environment's: ``</tool>``)."""
    return dataclasses.replace(sampling, stop=tuple(dict.fromkeys((*sampling.stop, *stop))))
