"""A cold start for the tool environment: the tiny model (random weights), then a few thousand steps of
next-token loss that give it what a pretrained instruct model brings to ``env=tools``, and nothing of the task:

- repeating text it has read (random strings, written twice: the copying every pretrained model can do);
- the call syntax, ``<tool>lookup(kB)</tool>``, and saying the tool's result once it comes back.

The key it calls is drawn at random, never the row's, and the results it is shown are random numbers, never the
store's: taught this way, the model asks for a key of its own choosing and repeats whatever the tool says, so
its answer is right by chance (1 in ``keys``). Which key to ask for is what GRPO teaches it
(``tests/test_language_envs.py`` measures it going from chance to nine in ten)::

    python -m rltrain.llm.cold_start outputs/tool-caller --keys 10
    python -m rltrain algo=grpo env=tools env.keys=10 model.path=outputs/tool-caller algo.lr=3e-4 \\
        collector.max_new_tokens=24 collector.max_turns=2

``tool_caller_dir(keys)`` makes one in ``$RLTRAIN_CACHE`` on first use and returns it afterwards.
"""

from __future__ import annotations

import argparse
import random
import string
from pathlib import Path

from rltrain.llm.tiny import cached_model_dir, stage_model_dir, tiny_model_dir

COPY_STEPS, CALL_STEPS, BATCH, LR = 1500, 600, 32, 1e-3
_CHARACTERS = string.digits + string.ascii_lowercase


def teach_tool_calls(path: str | Path, keys: int = 10, copy_steps: int = COPY_STEPS, call_steps: int = CALL_STEPS,
                     seed: int = 0) -> Path:
    """Write the tiny model, taught as the module's docstring says, at ``path``: ``copy_steps`` steps of copying
    alone, then ``call_steps`` steps of half copies, half calls (with keys ``k0`` to ``k{keys - 1}``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir())
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir())
    rng = random.Random(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def copied() -> list[tuple[list[int], bool]]:  # (ids, trained on): the text, then the text again
        text = "".join(rng.choice(_CHARACTERS) for _ in range(rng.randint(2, 8)))
        return [(ids(text + "|"), False), (ids(text) + [tokenizer.eos_token_id], True)]

    def call() -> list[tuple[list[int], bool]]:  # as rltrain.llm.rollout renders an episode without a template
        asked, called = rng.randrange(keys), rng.randrange(keys)
        value = f"{rng.randrange(100):02d}"  # any result: never the store's (its values are the task's)
        return [(ids(f"value of k{asked}?"), False), (ids(f"<tool>lookup(k{called})</tool>"), True),
                (ids(f"<result>{value}</result>"), False), (ids(value) + [tokenizer.eos_token_id], True)]

    model.train()
    for step in range(copy_steps + call_steps):
        rows = [call() if step >= copy_steps and rng.random() < 0.5 else copied() for _ in range(BATCH)]
        tokens = [[i for part, _ in row for i in part] for row in rows]
        trained = [[own for part, own in row for _ in part] for row in rows]
        width = max(map(len, tokens))
        batch = torch.tensor([t + [tokenizer.pad_token_id] * (width - len(t)) for t in tokens])
        mask = torch.tensor([m + [False] * (width - len(m)) for m in trained])[:, 1:]
        logits = model(batch).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits[mask], batch[:, 1:][mask])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    with stage_model_dir(path, {"cold_start": "tool_calls", "keys": keys, "copy_steps": copy_steps,
                                "call_steps": call_steps, "seed": seed}) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
    return Path(path)


def tool_caller_dir(keys: int = 10) -> Path:
    """The dir of the tiny model taught by ``teach_tool_calls(keys=keys)`` in rltrain's cache, made on first use."""
    return cached_model_dir(f"tiny-qwen2-tool-caller-k{keys}", lambda path: teach_tool_calls(path, keys))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rltrain.llm.cold_start", description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="the model dir to write (it must not exist)")
    parser.add_argument("--keys", type=int, default=10, help="env.keys of the runs it is for")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if Path(args.path).exists():
        parser.error(f"{args.path} exists; give a new path")
    if args.keys < 1:
        parser.error("--keys must be at least 1")
    print(teach_tool_calls(args.path, args.keys, seed=args.seed))


if __name__ == "__main__":
    main()
