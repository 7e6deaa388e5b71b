"""The language-model examples of docs/language-models.md, run as written: a reward of your own beside the
task's or instead of it (the rewards each command composes), the "your own reward" example learning the task
and its penalty, and LoRA learning where the output layer lets it (and why the 64-wide tiny model's
does not)."""

from __future__ import annotations

import re
import shlex

import pytest
import torch

from rltrain import build
from rltrain.factory import task_rewards
from rltrain.llm import tiny
from tests.conftest import ROOT, learning_check, make_config
from tests.test_outputs import read_jsonl

PAGE = ROOT / "docs" / "language-models.md"


def readme_commands(bullet: str) -> list[list[str]]:
    """The ``python -m`` commands in the code blocks of the ``- **bullet**`` item of docs/language-models.md (up to
    the next item or heading), each as the arguments after ``python -m`` (the module first)."""
    item = re.split(r"\n(?:- \*\*|#)", PAGE.read_text().split(f"- **{bullet}**", 1)[1], maxsplit=1)[0]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", item, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip().startswith("python -m "):
                commands.append(shlex.split(line, comments=True)[2:])
    return commands


def rltrain_overrides(command: list[str]) -> list[str]:
    assert command[0] == "rltrain", command
    return command[1:]


def train(tmp_path, command: list[str]) -> tuple[dict, dict]:
    """The summary and the last metrics row of ``python -m COMMAND``, trained in this process."""
    summary = build(make_config(*rltrain_overrides(command)), run_dir=tmp_path / "run").fit()
    return summary, read_jsonl(tmp_path / "run" / "metrics.jsonl")[-1]


def test_a_reward_of_your_own_goes_beside_the_task_s_or_instead_of_it():
    beside, instead = (rltrain_overrides(c) for c in readme_commands("Rewards"))
    cfg = make_config(*beside)
    assert list(cfg.env.rewards) == ["correct", "short"]
    assert cfg.env.rewards.short == {"_target_": "rltrain.llm.rewards.length_penalty", "max_chars": 4}
    rewards = task_rewards(cfg)
    assert rewards.weights == {"correct": 1.0, "short": 0.5}
    assert rewards.functions["short"]("reverse 7:", "7?", answer="7") == -0.25  # max_chars=4 bound

    cfg = make_config(*instead)
    assert list(cfg.env.rewards) == ["partial"]
    assert list(task_rewards(cfg).functions) == ["partial"]


@pytest.mark.parametrize("prefix", ["+", "++"])
def test_a_mapping_given_whole_is_merged_into_the_task_s_as_the_readme_warns(prefix):
    cfg = make_config("algo=grpo", f"{prefix}env.rewards={{short: {{_target_: rltrain.llm.rewards.length_penalty}}}}")
    assert list(cfg.env.rewards) == ["correct", "short"]  # correct kept: a merge, not a replacement


def test_the_64_wide_tiny_model_s_frozen_output_layer_caps_every_token_near_5_percent(tmp_path):
    """Why LoRA (which leaves the tied embedding, the output layer, as it is) cannot learn on the tiny model from
    random weights: the best probability any token can get, from a hidden state of the final norm's size aimed
    straight at its embedding. 256 wide, the docs' LoRA example, lets a token stand out."""
    from transformers import AutoModelForCausalLM

    best = {}
    for width in (64, 256):
        model = AutoModelForCausalLM.from_pretrained(tiny.write_tiny_model(tmp_path / str(width), hidden_size=width))
        embedding = model.get_input_embeddings().weight.detach()
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied
        tokens = (embedding.norm(dim=1) > 0).nonzero().squeeze(1)  # the pad row is zeros
        hidden = width ** 0.5 * torch.nn.functional.normalize(embedding[tokens], dim=1)  # RMS 1, the norm's weight
        best[width] = (hidden @ embedding.T).softmax(-1)[torch.arange(len(tokens)), tokens].max().item()
    assert best[64] < 0.06 and best[256] > 0.5, best


@learning_check  # about 10 s
def test_the_readme_s_own_reward_example_learns_the_answer_and_to_end_it(tmp_path):
    summary, last = train(tmp_path, readme_commands("Rewards")[0])
    # Every eval answer exact and nothing after it (seed 0: 1.0 and 0.0); with algo.scale_rewards=true, 0.1.
    assert last["eval/reward/correct"] >= 0.95 and last["eval/reward/short"] >= -0.05, last
    assert summary["eval_return"] >= 0.9


@learning_check
@pytest.mark.slow  # about 25 s on one thread, more on a busy box
def test_the_readme_s_lora_example_learns_on_a_wider_random_tiny_model(tmp_path, monkeypatch):
    make, lora = readme_commands("LoRA")
    monkeypatch.chdir(tmp_path)  # the commands' outputs/ dir
    assert make[0] == "rltrain.llm.tiny"
    tiny.main(make[1:])
    summary, last = train(tmp_path, lora)
    assert last["eval/reward/correct"] >= 0.9 and summary["eval_return"] >= 0.9, last  # seed 0: 1.0; 64 wide: 0.09
    assert (tmp_path / "run" / "model-adapter").is_dir()
