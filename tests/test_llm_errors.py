"""Bad input for a language-model run names its cause and fix in one line, before anything loads where it
can: a model dir that holds no causal LM, a tokenizer whose special tokens the model lacks, characters the
tokenizer drops, a mistyped path shaped like a hub id, a dataset file's format, a broken torchvision; and
at checkpoint time, a full disk. Every bad input is made here: nothing is downloaded."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import torch

from rltrain import build, checkpoint
from rltrain.errors import CheckpointError, ConfigError, RunError
from rltrain.llm.model import LanguageModel
from rltrain.llm.tasks import Dataset
from rltrain.llm.tiny import make_tokenizer, write_tiny_model
from rltrain.validate import validate
from tests.conftest import ROOT, make_config, run_cli


def refused(*overrides: str) -> str:
    """The ConfigError text the config check gives ``python -m rltrain algo=grpo OVERRIDES``."""
    with pytest.raises(ConfigError) as e:
        validate(make_config("algo=grpo", *overrides))
    return str(e.value)


def config_error_line(result: subprocess.CompletedProcess) -> str:
    """The CLI's one line for a refused config (exit code 2)."""
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("rltrain: config error: ")]
    assert len(lines) == 1, result.stderr[-2000:]
    return lines[0]


def save_with_tokenizer(model, path: Path) -> Path:
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


# A model dir that is no causal LM: refused from its config.json, no weights loaded.

@pytest.fixture(scope="module")
def other_models(tmp_path_factory):
    import transformers as tf

    root = tmp_path_factory.mktemp("other_models")
    small = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}
    bert = tf.BertConfig(vocab_size=len(make_tokenizer()), **small)
    bart = tf.BartConfig(vocab_size=len(make_tokenizer()), d_model=32, encoder_layers=1, decoder_layers=1,
                      encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64)
    return {
        "bert": save_with_tokenizer(tf.BertModel(bert), root / "bert"),
        "bert_mlm": save_with_tokenizer(tf.BertForMaskedLM(bert), root / "bert_mlm"),
        "vit": save_with_tokenizer(tf.ViTModel(tf.ViTConfig(image_size=32, patch_size=16, **small)), root / "vit"),
        "bart": save_with_tokenizer(tf.BartForConditionalGeneration(bart), root / "bart"),
    }


@pytest.mark.parametrize("name, message", [
    ("bert", r"holds an encoder or another head \(model_type 'bert', architectures BertModel: config.json's "
             r"architectures\), not a causal LM head; rltrain trains causal \(decoder-only\) language models"),
    ("bert_mlm", r"holds an encoder or another head \(model_type 'bert', architectures BertForMaskedLM"),
    ("vit", r"holds a model \(model_type 'vit', architectures ViTModel\) that transformers has no causal LM for"),
    ("bart", r"holds an encoder-decoder \(sequence-to-sequence\) model \(model_type 'bart'"),
])
def test_a_model_dir_that_holds_no_causal_lm_is_refused_naming_what_it_holds(other_models, name, message):
    text = refused(f"model.path={other_models[name]}")
    assert text.startswith(f"model.path={other_models[name]} ")
    assert "python -m rltrain.llm.tiny DIR" in text
    assert len(text) < 600  # one line, not transformers' list of every causal LM config
    with pytest.raises(ConfigError, match=message):
        LanguageModel(str(other_models[name])).check()


# A tokenizer whose special tokens the model has no embedding for.

def edit_tokenizer_config(path: Path, **changes) -> Path:
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    config_file.write_text(json.dumps(config))
    return path


def test_a_qwen2_tokenizer_without_a_pad_token_is_refused_naming_the_token_past_the_vocabulary(tmp_path):
    # Qwen2's tokenizer class adds its default pad token, <|endoftext|>, which this vocabulary lacks: its id is
    # one past the model's embeddings, and the first batch failed with "index 86 is out of bounds".
    path = edit_tokenizer_config(write_tiny_model(tmp_path / "tiny"), pad_token=None)
    text = refused(f"model.path={path}")
    assert text == (f"model.path={path}: its tokenizer's pad token '<|endoftext|>' has id 86, past the model's "
                    "vocabulary (vocab_size=86 in config.json), so the model has no embedding for it (the tokenizer "
                    "added it: its tokenizer_config.json names no pad_token, or one the vocabulary lacks); set "
                    "pad_token in tokenizer_config.json to a token of the vocabulary (e.g. pad_token: '<eos>', the "
                    "eos token), or resize the model's embeddings (model.resize_token_embeddings(len(tokenizer))) "
                    "and save it again")
    # The fix the message names works.
    validate(make_config("algo=grpo", f"model.path={edit_tokenizer_config(path, pad_token='<eos>')}"))


def test_a_tokenizer_with_neither_pad_nor_eos_token_is_refused(tmp_path):
    path = edit_tokenizer_config(write_tiny_model(tmp_path / "tiny", arch="llama"), pad_token=None, eos_token=None)
    assert refused(f"model.path={path}") == (
        f"model.path={path}: its tokenizer has neither a pad nor an eos token, which generation needs; set eos_token "
        "(and pad_token) in its tokenizer_config.json to tokens of its vocabulary")


# Characters the tokenizer drops.

def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_prompt_characters_the_tokenizer_drops_are_refused_naming_them_and_a_prompt(tmp_path):
    rows = [{"prompt": f"reverse {i}:", "answer": str(i)} for i in range(8)] + [
        {"prompt": "reverse 12#:", "answer": "21"}, {"prompt": "inverse é4:", "answer": "4"}]
    path = write_rows(tmp_path / "rows.jsonl", rows)
    text = refused("env=dataset", f"env.path={path}", f"env.eval_path={path}")
    assert text == ("model.path=tiny: its tokenizer has no token for the characters '#', 'é' of the prompts "
                    "(rltrain's tiny tokenizer has a token for each character of rltrain.llm.tiny.CHARACTERS only): "
                    "they tokenize to nothing, or to an unknown token, so the model would never read them (e.g. the "
                    "prompt 'reverse 12#:'); remove them from the prompts, or give model.path a model whose "
                    "tokenizer covers them")
    clean = write_rows(tmp_path / "clean.jsonl", rows[:8])
    validate(make_config("algo=grpo", "env=dataset", f"env.path={clean}", f"env.eval_path={clean}"))


# A path shaped like a hub id that is neither a local dir nor on the hub.

def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_mistyped_local_path_shaped_like_a_hub_id_is_refused_at_once(tmp_path):
    # No network here: the hub is a local port nobody listens on (the machine's DNS fails the same way).
    env = {"HF_ENDPOINT": f"http://127.0.0.1:{closed_port()}", "HF_HOME": str(tmp_path / "hf")}
    result = run_cli("algo=grpo", "model.path=outputs/tiny-qwen", "trainer.total_frames=128", cwd=tmp_path, env=env,
                     timeout=120)
    line = config_error_line(result)
    assert line.startswith(f"rltrain: config error: model.path=outputs/tiny-qwen: no such local dir "
                           f"({tmp_path / 'outputs/tiny-qwen'}), and the Hugging Face hub could not provide it as a "
                           "model id (ConnectError: ")
    assert line.endswith("give the path of a save_pretrained dir (python -m rltrain.llm.tiny DIR writes one), or a "
                         "hub id the hub has")


def test_a_hub_id_is_checked_in_the_cache_first_and_offline_named(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError, match=r"^model.path=acme/tiny: no such local dir \(.*/acme/tiny\), and the "
                                          r"Hugging Face cache does not hold it \(and HF_HUB_OFFLINE keeps the hub"):
        LanguageModel("acme/tiny").check()
    snapshot = tmp_path / "hub/models--acme--tiny/snapshots" / ("0" * 40)
    shutil.copytree(write_tiny_model(tmp_path / "tiny"), snapshot)
    (tmp_path / "hub/models--acme--tiny/refs").mkdir()
    (tmp_path / "hub/models--acme--tiny/refs/main").write_text("0" * 40)
    LanguageModel("acme/tiny").check()  # in the cache: transformers loads it from there


# A dataset file's format and its prompts' type.

@pytest.mark.parametrize("name", ["rows.json", "rows.jsonl"])
def test_a_json_array_of_rows_is_read_like_json_lines(name, tmp_path):
    rows = [{"prompt": f"reverse {i}:", "answer": str(i)} for i in range(10)]
    (tmp_path / name).write_text(json.dumps(rows, indent=1))
    task = Dataset(str(tmp_path / name), eval_share=0.2)
    assert sorted(task.rows["train"] + task.rows["eval"], key=lambda r: r["prompt"]) == rows
    validate(make_config("algo=grpo", "env=dataset", f"env.path={tmp_path / name}"))


@pytest.mark.parametrize("content, message", [
    ('[{"prompt": "reverse 1:", "answer": "1"}, [1, 2]]',
     r"row 2 is a JSON array, not an object of columns: a file holds one JSON object per line \(JSON Lines\) or one "
     r"JSON array of objects, each with a 'prompt' column"),
    ('[{"prompt": "reverse 1:"},\n', r"starts as a JSON array but is not valid JSON"),
    ('{"prompt": "reverse 1:"}\n{"prompt": 5, "answer": "5"}\n',
     r"row 2: the 'prompt' column is an int \(5\), not text; write each prompt as a string \(e.g. \"5\"\)"),
    ('{"prompt": null}\n', r"row 1: the 'prompt' column is null, not text"),
    ('{"prompt": "reverse 1:",\n "answer": "1"}\n', r"line 1: not a JSON object \(.*\); a .json file holds one JSON "
                                                    r"object per line \(JSON Lines\) or one JSON array of objects"),
])
def test_a_dataset_file_s_format_or_prompt_type_is_named(content, message, tmp_path):
    (tmp_path / "rows.json").write_text(content)
    with pytest.raises(ConfigError, match=rf"^env.path={re.escape(str(tmp_path / 'rows.json'))}(, |: | ){message}"):
        Dataset(str(tmp_path / "rows.json"))


# A torchvision (torchaudio, torchcodec) that does not import beside this torch.

def broken_package(root: Path, name: str) -> Path:
    """A package ``name`` that looks installed (its dist-info) and raises on import, as a build for another
    torch does ("operator torchvision::nms does not exist")."""
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text(f'raise RuntimeError("operator {name}::nms does not exist")\n')
    (root / f"{name}-0.0.dist-info").mkdir()
    (root / f"{name}-0.0.dist-info/METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.0\n")
    return root


def test_a_torchvision_that_does_not_import_is_named_with_the_uninstall(tmp_path):
    fake = broken_package(tmp_path / "site", "torchvision")
    result = run_cli("algo=grpo", "trainer.total_frames=128", cwd=tmp_path,
                     env={"PYTHONPATH": f"{fake}{os.pathsep}{ROOT}"})
    assert config_error_line(result) == (
        f"rltrain: config error: model.path=tiny: transformers cannot load models here: torchvision 0.0 is installed "
        f"but does not import beside torch {torch.__version__} (RuntimeError: operator torchvision::nms does not "
        "exist); rltrain needs none of torchvision, torchaudio, torchcodec: pip uninstall -y torchvision torchaudio "
        "torchcodec")
    assert not list((tmp_path / "outputs").rglob("checkpoints"))  # refused before anything started


def test_a_torchaudio_that_does_not_import_is_named(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(broken_package(tmp_path / "site", "torchaudio")))
    with pytest.raises(ConfigError, match=r"torchaudio 0.0 is installed but does not import beside torch .*"
                                          r"pip uninstall -y torchvision torchaudio torchcodec$"):
        LanguageModel().check()


def test_a_torchcodec_that_does_not_import_is_left_alone(tmp_path, monkeypatch):
    # transformers imports it only to decode video or audio; a sound one fails to import without FFmpeg
    monkeypatch.syspath_prepend(str(broken_package(tmp_path / "site", "torchcodec")))
    LanguageModel().check()


# Checkpoints: a full disk, and a run killed before its first checkpoint.

@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs mounted at tmp_path/disk (root only), unmounted afterwards."""
    disk = tmp_path / "disk"
    disk.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True,
                                 text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot mount a small tmpfs here ({e}); test_a_write_that_meets_enospc_* covers the mapping")
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (not root?): {mounted.stderr.strip()}; "
                    "test_a_write_that_meets_enospc_* covers the mapping")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True, timeout=30)


def test_a_full_disk_at_checkpoint_time_says_so_and_keeps_the_previous_checkpoint(small_disk):
    run_dir = small_disk / "run"
    first = checkpoint.path_for(run_dir, 64)
    checkpoint.save(first, {"format": checkpoint.FORMAT, "weights": torch.zeros(1000)})
    second = checkpoint.path_for(run_dir, 128)
    with pytest.raises(RunError) as e:
        checkpoint.save(second, {"format": checkpoint.FORMAT, "weights": torch.zeros(1_000_000)})  # 4 MB
    assert str(e.value).startswith(f"no space left on device for checkpoint {second}: ")
    assert (" MB free on its filesystem, and the checkpoint needs more; the previous checkpoint frames_000000000064.pt "
            f"is intact (resume={run_dir} continues from it). Free some space there") in str(e.value)
    assert "unexpected pos" not in str(e.value)
    assert checkpoint.listing(run_dir) == [first] and sorted(os.listdir(first.parent)) == [first.name]  # no .tmp
    assert torch.equal(checkpoint.load(first)["weights"], torch.zeros(1000))


def test_a_full_disk_during_a_sharded_checkpoint_says_so_and_keeps_the_previous_one(small_disk):
    # What every rank of strategy=fsdp calls; one process writes all the shards here (torch's no-process-group mode).
    from rltrain.sharded_checkpoint import Part
    from rltrain.strategies.base import Single

    run_dir = small_disk / "run"
    small, big = torch.nn.Linear(10, 10), torch.nn.Linear(1000, 1000)  # 4 MB
    first = checkpoint.path_for(run_dir, 64, sharded=True)
    checkpoint.save_sharded(first, {"policy": Part(small)}, lambda: {"format": checkpoint.FORMAT}, Single())
    second = checkpoint.path_for(run_dir, 128, sharded=True)
    with pytest.raises(RunError) as e:
        checkpoint.save_sharded(second, {"policy": Part(big)}, lambda: {"format": checkpoint.FORMAT}, Single())
    assert str(e.value).startswith(f"no space left on device for checkpoint {second}: ")
    assert (" MB free on its filesystem, and the checkpoint needs more; the previous checkpoint "
            f"frames_000000000064.dcp is intact (resume={run_dir} continues from it). Free some space there"
            ) in str(e.value)
    assert checkpoint.listing(run_dir) == [first] and sorted(os.listdir(first.parent)) == [first.name]  # no .tmp
    loaded = torch.nn.Linear(10, 10)
    checkpoint.sharded_checkpoint.read(first, {"policy": Part(loaded)}, sharded=False)
    assert torch.equal(loaded.weight, small.weight)


def test_shared_weight_slots_that_do_not_fit_in_dev_shm_say_so_and_leave_nothing(small_disk, monkeypatch):
    # what rank 0 of a sharded learner does as it makes the slots its ranks share (a container's /dev/shm is
    # often 64 MB): a clean error told to every rank, not a bus error at the first write
    from rltrain.sync import node_shared

    monkeypatch.setattr(node_shared, "_SHM", small_disk)
    paths, error, fds = node_shared._make(4_000_000, 3)
    assert paths is None and fds == [] and os.listdir(small_disk) == []
    assert error.startswith(f"sync: the 3 weight slots need 12 MB of shared memory, and {small_disk} has ")
    assert error.endswith("MB free: give this machine (or container) more shared memory (docker run "
                          "--shm-size=...), or lower sync.slots")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full on this system")
def test_a_write_that_meets_enospc_is_a_full_disk_whatever_torch_says(tmp_path):
    # The kernel's own ENOSPC, for every user: the temporary file a checkpoint is written to is /dev/full.
    target = checkpoint.path_for(tmp_path / "run", 64)
    target.parent.mkdir(parents=True)
    target.with_name(target.name + ".tmp").symlink_to("/dev/full")
    with pytest.raises(RunError, match=rf"^no space left on device for checkpoint {target}: .* MB free on its "
                                       r"filesystem, .*; no earlier checkpoint of this run was written"):
        checkpoint.save(target, {"weights": torch.zeros(10)})
    assert os.listdir(target.parent) == []


def test_resuming_a_run_killed_before_its_first_checkpoint_says_so(tmp_path):
    run_dir = tmp_path / "run"
    checkpoint.write_config(run_dir, {"seed": 0})  # what a run has written when SIGKILL stops it that early
    with pytest.raises(CheckpointError) as e:
        build(make_config(f"resume={run_dir}"))
    assert str(e.value) == (
        f"resume={run_dir}: {run_dir} stopped before its first checkpoint ({run_dir / 'checkpoints'} holds no "
        "frames_*.pt or .dcp, only the config.json a run writes as it starts), so there is nothing to resume: start it "
        "again without resume=. hooks.checkpoint.every sets how often checkpoints are written (e.g. "
        "hooks.checkpoint.every.seconds=60)")
