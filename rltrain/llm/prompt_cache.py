"""One pass over each group's prompt: GRPO samples ``group_size`` completions of every prompt, so a
batch holds each prompt ``group_size`` times. The engine and the learner run each prompt through the
model once and repeat its keys and values (the KV cache) for every completion of the group, instead of
running every copy: the same logits, for a fraction of the prompt's cost."""

from __future__ import annotations

import inspect

import torch

from rltrain.llm.model import base_model


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Each token's position among the real (unmasked) tokens of its row: left padding does not count."""
    return (mask.cumsum(-1) - 1).clamp_min(0)


def cache_name(model) -> str:
    """The name of the KV cache among ``model.forward``'s arguments and outputs: ``cache`` in recent
    transformers 5 releases, ``past_key_values`` before (and deprecated since)."""
    forward = base_model(model).forward  # a peft model passes the argument on
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def whole_groups(ids: torch.Tensor, group_size: int) -> bool:
    """Whether the rows of ``ids`` are whole groups of ``group_size`` copies of one prompt."""
    rows = ids.shape[0]
    if group_size < 2 or rows % group_size:
        return False
    groups = ids.view(rows // group_size, group_size, -1)
    return bool((groups == groups[:, :1]).all())


def prompt_pass(model, ids: torch.Tensor, mask: torch.Tensor, group_size: int, forward=None):
    """The model's output on the first row of each group of ``ids`` (left-padded, ``mask``), and its
    KV cache repeated for every row of the group. ``forward``: what calls the model (a data-parallel
    learner's wrapper); the model itself by default."""
    out = (forward or model)(input_ids=ids[::group_size], attention_mask=mask[::group_size],
                position_ids=positions(mask[::group_size]), use_cache=True)
    cache = out[cache_name(model)]
    cache.batch_repeat_interleave(group_size)
    return out, cache
