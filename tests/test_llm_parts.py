"""The parts language-model policies build on: the tiny model made here (nothing downloaded), the
built-in verifiable tasks and the reward functions."""

from __future__ import annotations

import json
import math
import pathlib

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rltrain.errors import ConfigError, RunError
from rltrain.llm.rewards import Rewards, correct_answer, follows_format, length_penalty
from rltrain.llm.tasks import Arithmetic, Dataset, ReverseDigits
from rltrain.llm.tiny import tiny_model_dir, write_tiny_model
from tests.conftest import without_package


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_the_tiny_model_is_a_hugging_face_dir_that_loads_and_generates(arch, tmp_path):
    path = write_tiny_model(tmp_path / arch, arch=arch)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == arch and sum(p.numel() for p in model.parameters()) < 200_000
    prompt = "12+7="
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    assert ids.shape[1] == len(prompt) and tokenizer.decode(ids[0]) == prompt  # one token per character
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] > ids.shape[1] and tokenizer.decode(out[0]).startswith(prompt)


def test_the_cached_tiny_model_is_made_once(tmp_path, monkeypatch):
    monkeypatch.setenv("RLTRAIN_CACHE", str(tmp_path))
    first = tiny_model_dir()
    made = (first / "model.safetensors").stat().st_mtime_ns
    assert tiny_model_dir() == first and (first / "model.safetensors").stat().st_mtime_ns == made
    (first / "rltrain_tiny.json").unlink()  # as if a crash cut the first making short
    assert tiny_model_dir() == first and (first / "rltrain_tiny.json").exists()


def test_a_cold_start_writes_a_whole_model_dir_or_nothing(tmp_path, monkeypatch):
    from rltrain.llm import cold_start

    path = cold_start.teach_tool_calls(tmp_path / "taught", keys=3, copy_steps=2, call_steps=2)
    made = json.loads((path / "rltrain_tiny.json").read_text())
    assert made["cold_start"] == "tool_calls" and made["keys"] == 3
    assert AutoModelForCausalLM.from_pretrained(path).config.model_type == "qwen2"

    def fail(*args, **kwargs):
        raise OSError("No space left on device")

    cold_start.tiny_model_dir()  # (made before the failure below)
    monkeypatch.setattr(pathlib.PosixPath, "chmod", fail)  # the last step before the rename
    with pytest.raises(OSError):
        cold_start.teach_tool_calls(tmp_path / "cut", keys=3, copy_steps=1, call_steps=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taught"]  # no half-written dir, no staging left


def test_every_character_of_the_built_in_tasks_is_a_token_of_the_tiny_tokenizer(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(write_tiny_model(tmp_path / "m"))
    for task in (Arithmetic(digits=3, ops="+-*"), ReverseDigits(length=5), ReverseDigits(sort=True)):
        for row in task.take(50):
            for text in (row["prompt"], row["answer"]):
                ids = tokenizer(text).input_ids
                assert tokenizer.unk_token_id not in ids and tokenizer.decode(ids) == text


def test_arithmetic_rows_hold_the_right_answers_and_resume_where_they_stopped():
    task = Arithmetic(digits=2, ops="+-*", seed=5)
    rows = task.take(200)
    for row in rows:
        a, op, b = __import__("re").fullmatch(r"(\d+)([+*-])(\d+)=", row["prompt"]).groups()
        assert int(row["answer"]) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
    assert {r["prompt"][len(r["prompt"]) // 2] for r in rows} and len({r["prompt"] for r in rows}) > 150

    again = Arithmetic(digits=2, ops="+-*", seed=5)
    again.take(120)
    resumed = Arithmetic(digits=2, ops="+-*", seed=5)
    resumed.load_state_dict(again.state_dict())
    assert resumed.take(80) == rows[120:]
    assert Arithmetic(digits=2, ops="+-*", seed=6).take(5) != rows[:5]
    evals = {r["prompt"] for r in task.eval_split().take(200)}
    assert task.eval_split().take(5) == task.eval_split().take(5) and evals != {r["prompt"] for r in rows}


def test_reverse_and_sort_rows():
    for row in ReverseDigits(length=6).take(20):
        digits = row["prompt"].removeprefix("reverse ").removesuffix(":")
        assert len(digits) == 6 and row["answer"] == digits[::-1]
    for row in ReverseDigits(length=4, sort=True).take(20):
        assert row["answer"] == "".join(sorted(row["prompt"].removeprefix("sort ").removesuffix(":")))


@pytest.mark.parametrize("make, match", [
    (lambda: Arithmetic(ops="/"), r"env.ops must be one or more of '\+-\*' \(got '/'\)"),
    (lambda: Arithmetic(digits=0), r"env.digits must be an integer >= 1 \(got 0\)"),
    (lambda: ReverseDigits(length=0), r"env.length must be an integer >= 1"),
    (lambda: Arithmetic(split="test"), r"env.split must be train or eval \(got 'test'\)"),
])
def test_bad_task_settings_are_refused_naming_the_key(make, match):
    with pytest.raises(ConfigError, match=match):
        make()


def test_the_built_in_rewards():
    assert correct_answer("2+3=", "5", answer="5") == 1.0
    assert correct_answer("2-3=", " -1 and more", answer="-1") == 1.0
    assert correct_answer("2+3=", "6", answer="5") == 0.0 and correct_answer("2+3=", "five", answer="5") == 0.0
    assert follows_format("", " 42 ") == 1.0 and follows_format("", "42 is it") == 0.0
    assert length_penalty("", "42") == 0.0 and length_penalty("", "42" + "x" * 8, max_chars=16) == -0.5
    assert length_penalty("", "x" * 100) == -1.0


def test_rewards_are_weighted_and_each_is_reported():
    rewards = Rewards({"correct": correct_answer, "format": follows_format}, {"format": 0.5})
    total, each = rewards("2+3=", "5!", {"prompt": "2+3=", "answer": "5"})
    assert each == {"correct": 1.0, "format": 0.0} and total == 1.0
    total, _ = rewards("2+3=", "5", {"prompt": "2+3=", "answer": "5"})
    assert math.isclose(total, 1.5)


def test_a_reward_function_that_raises_is_named_with_the_prompt():
    def picky(prompt, completion, answer):
        raise KeyError("difficulty")

    with pytest.raises(RunError, match=r"reward function picky raised KeyError: 'difficulty' on the prompt '2\+3='"):
        Rewards({"picky": picky})("2+3=", "5", {"prompt": "2+3=", "answer": "5"})
    with pytest.raises(RunError, match=r"reward function nan returned nan on the prompt '1\+1='; a reward is a finite"):
        Rewards({"nan": lambda p, c, **row: float("nan")})("1+1=", "2", {"answer": "2"})


def test_bad_reward_settings_are_refused():
    with pytest.raises(ConfigError, match=r"env.rewards.nope is not callable \('correct_answer'\)"):
        Rewards({"nope": "correct_answer"})
    with pytest.raises(ConfigError, match=r"env.reward_weights names fomat, which env.rewards does not have"):
        Rewards({"format": follows_format}, {"fomat": 1.0})


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_dataset_file_gives_train_and_eval_rows_with_every_column(tmp_path):
    rows = [{"question": f"{i}+1=", "answer": str(i + 1), "level": i % 3} for i in range(50)]
    path = write_rows(tmp_path / "rows.jsonl", rows)
    train = Dataset(path, prompt_key="question", eval_share=0.2, seed=1)
    evals = train.eval_split()
    seen = train.take(40)
    assert {r["prompt"] for r in seen} | {r["prompt"] for r in evals.take(10)} == {r["question"] for r in rows}
    assert len({r["prompt"] for r in seen}) == 40 and all(set(r) == {"prompt", "answer", "level"} for r in seen)
    assert not {r["prompt"] for r in seen} & {r["prompt"] for r in evals.take(10)}
    second_pass = train.take(40)
    assert {r["prompt"] for r in second_pass} == {r["prompt"] for r in seen} and second_pass != seen  # reshuffled
    resumed = Dataset(path, prompt_key="question", eval_share=0.2, seed=1)
    resumed.load_state_dict({"position": 40})
    assert resumed.take(40) == second_pass
    # The eval hook's task has a seed of its own: the held-out rows must not depend on it.
    other_seed = Dataset(path, prompt_key="question", eval_share=0.2, seed=1_000_001)
    assert other_seed.eval_split().take(10) == evals.eval_split().take(10)
    held_out = Dataset(path, prompt_key="question", eval_path=write_rows(tmp_path / "eval.jsonl", rows[:3]))
    assert held_out.eval_split().take(3) == [{"answer": r["answer"], "level": r["level"], "prompt": r["question"]}
                                            for r in rows[:3]]


@pytest.mark.parametrize("content, name, match", [
    (None, "missing.jsonl", r"env.path=.*missing.jsonl: no such file"),
    ('{"prompt": "1+1="}\nnot json\n', "bad.jsonl", r"line 2: not a JSON object"),
    ('{"prompt": "1+1="}\n{"text": "2+2="}\n', "rows.jsonl",
     r"row 2: no 'prompt' text \(its keys: text\); set env.prompt_key"),
    ("", "empty.jsonl", r"holds no rows"),
    ("a,b\n", "rows.csv", r"reads .jsonl and .parquet files \(got .csv\)"),
])
def test_a_dataset_that_cannot_be_read_is_named(content, name, match, tmp_path):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=match):
        Dataset(str(path))


def test_a_parquet_file_gives_its_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": f"{i}*2=", "answer": str(2 * i)} for i in range(20)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    task = Dataset(str(tmp_path / "rows.parquet"), eval_share=0.25)
    every = {(r["prompt"], r["answer"]) for r in task.rows["train"] + task.rows["eval"]}
    assert len(task.rows["train"]) == 15 and every == {(r["prompt"], r["answer"]) for r in rows}


def test_a_hugging_face_dataset_gives_its_splits(tmp_path):
    """A local dir of data files is a dataset to ``datasets.load_dataset`` (as a hub name is, with a network):
    its splits by their files' names."""
    data = tmp_path / "sums"
    data.mkdir()
    rows = [{"question": f"{i}+1=", "answer": str(i + 1)} for i in range(30)]
    write_rows(data / "train.jsonl", rows[:20])
    write_rows(data / "test.jsonl", rows[20:])
    task = Dataset(str(data), prompt_key="question", eval_split="test")
    assert sorted(r["prompt"] for r in task.take(20)) == sorted(r["question"] for r in rows[:20])
    assert task.eval_split().take(10) == [{"answer": r["answer"], "prompt": r["question"]} for r in rows[20:]]
    with pytest.raises(ConfigError, match=r"env.path=.*sums is no file, and datasets cannot load it as a dataset "
                                          r"\(env.subset=None, split nope\)"):
        Dataset(str(data), prompt_key="question", eval_split="nope")


def test_a_dataset_name_without_datasets_names_the_pip_install(monkeypatch):
    without_package(monkeypatch, "datasets")
    with pytest.raises(ConfigError, match=r"env.path=org/name is no file; to read it as a Hugging Face dataset, "
                                          r"install datasets: pip install 'rltrain\[datasets\]'"):
        Dataset("org/name")
