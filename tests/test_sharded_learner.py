"""A learner sharded over the ranks of a torchrun job (strategy=fsdp: torch's FSDP2), and the engine that
generates with the learner's own model (engine=learner): real gloo groups on loopback, real torchrun jobs
of 2 processes."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from rltrain import checkpoint
from rltrain.llm.tiny import tiny_model_dir, write_tiny_model
from tests.conftest import run_cli
from tests.test_distributed import run_dirs, torchrun
from tests.test_grpo import ONE_TOKEN
from tests.test_learner_ranks import _update_on, stopped_and_resumed
from tests.test_outputs import read_jsonl
from tests.test_run_management import learning_rows

FSDP = ("strategy=fsdp", "engine=learner")
GRPO_RUN = ("algo=grpo", "collector.max_new_tokens=1", "trainer.total_frames=2560", "seed=2", "~hooks.log.every",
            "+hooks.log.every={batches:2}")


def test_two_fsdp_ranks_make_grpos_update_of_one_process_on_the_same_groups(tmp_path):
    # tests/ranks_for_tests.py: GRPO's update (2 epochs, TIS, a KL penalty to a sharded frozen reference,
    # micro-batches) on 8 groups of the tiny model's completions; each rank holds half of every weight and
    # takes 4 groups. Rank 1 reads no weights: it builds the model on the meta device and shards rank 0's.
    model_dir = write_tiny_model(tmp_path / "tiny")
    one, two = (_update_on(tmp_path / f"{n}.pt", n, "grpo", str(model_dir), "fsdp") for n in (1, 2))
    # Not bitwise, as with strategy=ddp: each rank sums its half of the tokens and the reduce-scatter averages
    # the halves (float32 sums in another order, ~1e-8 in the gradients, magnified by Adam's first steps).
    assert one["weights"].keys() == two["weights"].keys()  # gathered whole: every name, every shape
    for name, weight in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], weight, rtol=0, atol=2e-5, msg=name)
    assert one["metrics"]["reward/std"] > 0 and one["metrics"]["grpo/clip_fraction"] > 0  # something to compare
    for key, value in one["metrics"].items():
        if not key.startswith("perf/"):
            assert two["metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-7), key


def test_grpo_on_two_fsdp_ranks_learns_the_single_token_task_as_one_process_does(tmp_path):
    # tests/test_grpo.py's run on one process: rewards from chance to above 0.8 (sampled), 0.9 (greedy eval);
    # here each rank generates its share through the sharded model and evaluates with it
    result = torchrun(*FSDP, *ONE_TOKEN, cwd=tmp_path, nproc=2, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    [run_dir] = run_dirs(tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert summary["status"] == "completed" and summary["frames"] == 19200 and summary["updates"] == 150
    assert rows[0]["reward/mean"] < 0.2, rows[0]
    assert rows[-1]["reward/mean"] > 0.8 and summary["train_return"] > 0.8, rows[-1]
    assert summary["eval_return"] > 0.9 and rows[-1]["eval/reward/correct"] > 0.9
    # engine=learner: every batch generated with the weights of the update before it (no lag, nothing pushed)
    assert all(r["sync/lag"] == 0 for r in rows) and rows[-1]["grpo/tis/ratio_mean"] == pytest.approx(1, abs=1e-5)
    # rank 0 writes the whole model once, gathered from the shards: transformers loads it
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run_dir / "model")
    assert sum(p.numel() for p in model.parameters()) > 50_000


def test_a_grpo_fsdp_run_stopped_and_resumed_matches_an_uninterrupted_one(tmp_path):
    def sharded_on_disk(split: Path) -> None:
        # a directory: each rank's shards of the model and Adam's state (torch.distributed.checkpoint), and the rest
        [saved] = checkpoint.listing(split)
        assert saved.name == "frames_000000001280.dcp" and not list(saved.parent.glob("*.tmp"))
        assert sorted(f.name for f in saved.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "state.pt"]
        rest = checkpoint.load(saved)
        assert rest["sharded"] == ["policy"] and "policy" not in rest["algo"] and rest["algo"]["frames"] == 1280

    # the weights and Adam's state go back into each rank's shards: every row as the uninterrupted run's
    split = stopped_and_resumed(tmp_path, (*FSDP, *GRPO_RUN), 1280, sharded_on_disk)
    assert [r["reward/mean"] for r in learning_rows(split)][-1] > 0


def test_an_fsdp_checkpoint_resumes_on_one_process_and_back_on_two_ranks(tmp_path):
    run = (*GRPO_RUN[:-3], "hydra.run.dir=outputs/run")
    two = torchrun(*FSDP, *run, "trainer.total_frames=1280", cwd=tmp_path, nproc=2)
    assert two.returncode == 0, two.stderr
    [sharded] = checkpoint.listing(tmp_path / "outputs/run")
    written = torch.load(sharded / "state.pt", weights_only=True)
    # one process reads both ranks' shards whole (no process group): the weights exactly as they were trained
    from transformers import AutoModelForCausalLM

    from rltrain import sharded_checkpoint

    final = AutoModelForCausalLM.from_pretrained(tmp_path / "outputs/run/model").state_dict()  # gathered at the end
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir())  # the run's initial weights
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    sharded_checkpoint.read(sharded, sharded_checkpoint.parts_of({"policy": (model, optimizer)}), sharded=False)
    loaded = model.state_dict()
    assert loaded.keys() == final.keys() and all(torch.equal(loaded[k], final[k]) for k in final)
    assert written["algo"]["frames"] == 1280 and all(s["step"] == 10 for s in optimizer.state.values())
    # (resume= a file inside the sharded checkpoint names the checkpoint: its run goes on in its own dir)
    one = run_cli(*run, "engine=learner", f"resume={sharded / 'state.pt'}", "trainer.total_frames=2560", cwd=tmp_path)
    assert one.returncode == 0, one.stderr
    assert "resumed at 1,280 frames" in one.stdout + one.stderr
    # one process writes one file; the ranks cut their shards from it
    assert [p.name for p in checkpoint.listing(tmp_path / "outputs/run")][-1] == "frames_000000002560.pt"
    stale = tmp_path / "outputs/run/checkpoints/frames_000000002600.dcp.tmp"  # a write a crash cut short
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"0" * 1000)
    again = torchrun(*FSDP, *run, "resume=outputs/run", "trainer.total_frames=3840", cwd=tmp_path, nproc=2)
    assert again.returncode == 0, again.stderr
    assert not stale.exists()  # swept as the next sharded checkpoint was written
    summary = json.loads((tmp_path / "outputs/run/summary.json").read_text())
    assert summary["status"] == "completed" and summary["frames"] == 3840 and summary["updates"] == 30
    rows = learning_rows(tmp_path / "outputs/run")
    assert rows[-1]["reward/mean"] > rows[0]["reward/mean"]  # it went on learning across the three
    # 2 ranks -> 3 (a global batch of 12 groups, 4 a rank): the rows of each weight split 3 ways now (unevenly
    # where 3 does not divide them), each rank reading its rows from the 2 ranks' shards, then writing its own.
    # With a learning rate of 1e-30 the weights stay as they were loaded: the 3 ranks' checkpoint must hold the
    # 2 ranks' weights (to 1e-20: an exact zero, a bias, moves by 1e-30 a step).
    three = torchrun(*FSDP, *run, "resume=outputs/run", "collector.frames_per_batch=96", "trainer.total_frames=4800",
                     "algo.lr=1e-30", cwd=tmp_path, nproc=3)
    assert three.returncode == 0, three.stderr
    assert "resumed at 3,840 frames" in three.stdout + three.stderr
    *_, before, last = checkpoint.listing(tmp_path / "outputs/run")
    assert (before.name, last.name) == ("frames_000000003840.dcp", "frames_000000004800.dcp")
    assert {"__0_0.distcp", "__1_0.distcp", "__2_0.distcp"} <= {f.name for f in last.iterdir()}
    weights = []
    for saved in (before, last):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir())
        sharded_checkpoint.read(saved, sharded_checkpoint.parts_of({"policy": (model, None)}), sharded=False)
        weights.append(model.state_dict())
    for name, weight in weights[0].items():
        assert torch.allclose(weights[1][name], weight, rtol=0, atol=1e-20), name


def test_pushes_from_fsdp_ranks_give_each_ranks_engine_copy_the_learners_weights(tmp_path):
    # engine=transformers: a whole copy per rank, fed by shared-memory pushes gathered from the shards. The
    # engine's log-probs are then the learner's own: the TIS ratio is 1 on every token of every batch.
    result = torchrun("strategy=fsdp", *GRPO_RUN, "trainer.total_frames=1280", "~hooks.log.every",
                      "+hooks.log.every={batches:1}", cwd=tmp_path, nproc=2)
    assert result.returncode == 0, result.stderr
    [run_dir] = run_dirs(tmp_path)
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "grpo/tis/ratio_max" in r]
    assert len(rows) == 10 and rows[-1]["sync/version"] == 10
    for row in rows:
        assert row["grpo/tis/ratio_max"] == pytest.approx(1, abs=1e-5), row
        assert row["grpo/tis/ratio_mean"] == pytest.approx(1, abs=1e-6), row


def test_ranks_generating_completions_of_different_lengths_through_the_sharded_model_stay_in_step(tmp_path):
    # rank 0's completions end after 2 tokens, rank 1's after 6: rank 0 goes on stepping (each step a gather of
    # every layer) until rank 1 is done, and both get the completions one process generates
    model_dir = write_tiny_model(tmp_path / "tiny")
    ranks = _update_on(tmp_path / "gen.pt", 2, "generate", str(model_dir), "fsdp")["ranks"]
    from rltrain.llm.engine import Sampling, TransformersEngine
    from rltrain.llm.model import LanguageModel
    from rltrain.llm.tasks import ReverseDigits

    model = LanguageModel(str(model_dir))
    engine = TransformersEngine(model.load(), model.tokenizer())
    prompts = [row["prompt"] for row in ReverseDigits(seed=3).take(2)]
    for rank, longest in enumerate((2, 6)):
        alone = engine.generate(prompts, 1, Sampling(max_new_tokens=longest, greedy=True))
        assert ranks[rank] == alone.completion_ids.tolist()
    assert len(ranks[0][0]) == 2 and len(ranks[1][0]) == 6


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_push_gathers_sharded_weights_whole_whether_or_not_the_ranks_divide_their_rows(ranks, tmp_path):
    # Into each rank's own snapshot (ranks on several machines): each rank's rows land in it directly where they
    # split evenly (4 rows over 2), DTensor's gather does it where they do not (5 rows over 2: 3 and 2). Into
    # the slots the ranks of one machine share: each rank writes its rows (3 ranks: 2, 2 and 0 of 4 rows), and
    # every rank reads the whole weights; a process an engine runs in maps the same memory; /dev/shm is left empty
    # (of a killed run's slot file too).
    ended = subprocess.Popen(["true"])
    ended.wait()
    killed = Path(f"/dev/shm/rltrain-slots-{ended.pid}-0")  # what a process killed as it made its slots leaves
    killed.write_bytes(b"0" * 64)
    os.utime(killed, (time.time() - 60, time.time() - 60))  # (one made in the last seconds may be on its way)
    result = _update_on(tmp_path / "push.pt", ranks, "push", "-", "fsdp")
    assert not killed.exists()
    assert result["whole"].keys() == result["pushed"].keys() == {"0.weight", "0.bias", "1.weight", "1.bias"}
    for name, weight in result["whole"].items():
        assert torch.equal(result["pushed"][name], weight), name
    assert result["slots"] == "NodeBuffer" and len(result["shared"]) == ranks
    for rank, seen in enumerate(result["shared"]):
        for name, weight in result["whole"].items():
            assert torch.equal(seen[name], weight), (rank, name)
    assert torch.equal(result["written_by_child"], torch.full((5,), 7.0))
    assert result["left"] == []


@pytest.mark.parametrize("args, says", [
    ((), "algo=ppo does not shard its networks over the ranks of strategy=fsdp"),
    (("algo=grpo", "strategy.cpu_offload=true", "device=cpu"),
     "strategy.cpu_offload=true keeps a GPU learner's shards"),
])
def test_what_cannot_run_sharded_is_refused_in_one_line(args, says, tmp_path):
    result = torchrun("strategy=fsdp", *args, cwd=tmp_path, nproc=2, timeout=120)
    assert result.returncode != 0 and says in result.stderr, result.stderr[-3000:]
    assert not run_dirs(tmp_path)


def test_engine_learner_generates_each_batch_with_the_learners_newest_weights_in_one_process(tmp_path):
    result = run_cli(*GRPO_RUN, "engine=learner", "hydra.run.dir=outputs/run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    rows = learning_rows(tmp_path / "outputs/run")
    assert all(r["sync/lag"] == 0 for r in rows)
    assert all(r["grpo/tis/ratio_max"] == pytest.approx(1, abs=1e-5) for r in rows)  # the learner's own log-probs
    summary = json.loads((tmp_path / "outputs/run/summary.json").read_text())
    assert summary["status"] == "completed" and rows[-1]["reward/mean"] > rows[0]["reward/mean"]


def test_lora_adapters_train_sharded_and_generate_through_the_sharded_peft_model(tmp_path):
    # each decoder layer a shard unit under peft's wrappers; the KL's reference is the model with its adapters
    # off (no copy); peft's generate gathers the root's weights (register_fsdp_forward_method)
    result = torchrun(*FSDP, *GRPO_RUN, "model.lora_rank=4", "algo.kl_coef=0.04", "trainer.total_frames=640",
                      cwd=tmp_path, nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    [run_dir] = run_dirs(tmp_path)
    summary, rows = json.loads((run_dir / "summary.json").read_text()), read_jsonl(run_dir / "metrics.jsonl")
    assert summary["status"] == "completed" and summary["evaluations"] >= 1
    assert all(r["grpo/tis/ratio_max"] == pytest.approx(1, abs=1e-5) for r in rows if "grpo/tis/ratio_max" in r)
    assert rows[-1]["grpo/kl"] > 0  # the adapters moved away from the base model
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir())
    adapted = PeftModel.from_pretrained(base, run_dir / "model-adapter")
    assert any(p.abs().sum() > 0 for n, p in adapted.named_parameters() if "lora_B" in n)  # gathered and written


def test_fsdp_ranks_split_the_eval_prompts_and_score_them_as_one_process_does(tmp_path):
    # a model half way through learning the single-token task, evaluated on 9 prompts in batches of 4: rank 0
    # completes 2, 2 and 1 of them, rank 1 2, 2 and none (it completes one anyway, not counted), and every score
    # counts once. One more batch at an lr too small to change a greedy token keeps the launches' models alike.
    base = run_cli(*GRPO_RUN[:2], "seed=2", "trainer.total_frames=6400", "engine=learner", "hydra.run.dir=outputs/base",
                   cwd=tmp_path)
    assert base.returncode == 0, base.stderr
    saved = tmp_path / "half_way.pt"  # outside a run dir: each resume starts a run dir of its own
    saved.write_bytes(checkpoint.listing(tmp_path / "outputs/base")[-1].read_bytes())
    run = (*GRPO_RUN[:2], "engine=learner", f"resume={saved}", "trainer.total_frames=6528", "algo.lr=1e-12",
           "hooks.eval.prompts=9", "hooks.eval.batch_size=4")
    one = run_cli(*run, "hydra.run.dir=outputs/one", cwd=tmp_path)
    assert one.returncode == 0, one.stderr
    two = torchrun("strategy=fsdp", *run, "hydra.run.dir=outputs/two", cwd=tmp_path, nproc=2)
    assert two.returncode == 0, two.stderr
    last = {name: read_jsonl(tmp_path / "outputs" / name / "metrics.jsonl")[-1] for name in ("one", "two")}
    evals = {k: v for k, v in last["one"].items() if k.startswith("eval/")}
    assert 0 < evals["eval/return"] < 1, evals  # right on some prompts, wrong on others
    assert {k: v for k, v in last["two"].items() if k.startswith("eval/")} == pytest.approx(evals, abs=1e-9)


def test_a_sharded_checkpoint_that_does_not_fit_the_model_or_was_cut_short_is_refused_naming_why(tmp_path):
    from rltrain import sharded_checkpoint
    from rltrain.errors import CheckpointError
    from rltrain.llm.tiny import make_model

    folder = tmp_path / "frames_000000000128.dcp"
    written = make_model(86)
    sharded_checkpoint.write(folder, sharded_checkpoint.parts_of({"policy": (written, None)}))
    same = make_model(86, seed=1)
    sharded_checkpoint.read(folder, sharded_checkpoint.parts_of({"policy": (same, None)}), sharded=False)
    assert all(torch.equal(a, b) for a, b in zip(same.state_dict().values(), written.state_dict().values()))
    narrower = sharded_checkpoint.parts_of({"policy": (make_model(86, hidden_size=32), None)})
    with pytest.raises(CheckpointError, match=r"does not fit this run's model: policy.weights.model.embed_tokens."
                                              r"weight has shape \[86, 64\] there and \[86, 32\] here"):
        sharded_checkpoint.read(folder, narrower, sharded=False)
    (folder / ".metadata").unlink()  # the last file a write makes
    with pytest.raises(CheckpointError, match="holds no complete sharded checkpoint"):
        sharded_checkpoint.read(folder, sharded_checkpoint.parts_of({"policy": (same, None)}), sharded=False)
