"""vLLM requests from rltrain's sampling settings, and vLLM's completions back into ``Generated``: what
rltrain's own engine and a user's server share, so that both draw the same completions."""

from __future__ import annotations

import torch

from rltrain.llm.engine import Generated, Sampling, left_padded


def sampling_requests(rows: list[list[int]], group_size: int, sampling: Sampling,
                      seed: int | None) -> list[tuple[list[int], dict]]:
    """The vLLM requests that draw ``group_size`` completions of each prompt (token ids), in order:
    each one's prompt and sampling parameters (``SamplingParams``'s, and the completions API's)."""
    n = 1 if sampling.greedy else group_size  # vLLM draws one greedy completion per request
    count = len(rows) * (group_size // n)
    return [(ids, {"n": n, "max_tokens": sampling.max_new_tokens, "logprobs": 0,
                   # seeds of each request's own (vLLM seeds its n samples seed, seed + 1, ...): one
                   # seed for all would draw the same random numbers for every prompt
                   "seed": None if seed is None else (seed * count + i) * n,
                   "temperature": 0.0 if sampling.greedy else sampling.temperature,
                   # every sampling setting said, none left to a server's defaults (the model's generation_config)
                   "top_p": 1.0 if sampling.greedy else sampling.top_p, "top_k": 0, "min_p": 0.0,
                   "stop": list(sampling.stop) or None, "include_stop_str_in_output": True,
                   "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0})
            for i, ids in enumerate(ids for ids in rows for _ in range(group_size // n))]


def encode_prompts(tokenizer, prompts: list[str] | list[list[int]], group_size: int) -> tuple[list[list[int]], tuple]:
    """Each prompt's token ids (no padding; a prompt given as token ids stays as it is), and the left-padded ids
    and mask of every completion's prompt (``group_size`` rows each), which ``as_generated`` takes."""
    ids, mask = left_padded(tokenizer, prompts)
    rows = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    return rows, (ids.repeat_interleave(group_size, dim=0), mask.repeat_interleave(group_size, dim=0))


def as_generated(tokenizer, prompts: tuple, rows: list, version: int) -> Generated:
    """``Generated`` from vLLM's completions (each one's token ids, their log-probs, whether
    ``max_new_tokens`` cut it) and ``encode_prompts``'s padded prompts."""
    longest = max(1, max(len(ids) for ids, _, _ in rows))
    completion = torch.full((len(rows), longest), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    logprobs = torch.zeros((len(rows), longest))
    for i, (ids, lps, _) in enumerate(rows):
        completion[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        mask[i, :len(ids)] = 1
        logprobs[i, :len(ids)] = torch.tensor(lps)
    truncated = torch.tensor([cut for _, _, cut in rows])
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids, _, _ in rows]
    return Generated(*prompts, completion, mask, logprobs, truncated, texts, version)


