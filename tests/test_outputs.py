"""The run dir contract: summary.json (also on error and Ctrl-C), metrics.jsonl, wandb files, sweeps."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time

import pytest

from rltrain import build
from tests.conftest import ROOT, make_config, run_cli

SUMMARY_KEYS = {"frames", "updates", "wall_time_s", "fps", "eval_return", "train_return", "solved",
                "frames_to_solve", "time", "sync", "status"}


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_summary_and_metrics_hold_the_contract_keys(tmp_path):
    cfg = make_config("trainer.total_frames=4096", "collector.frames_per_batch=256", "hooks.log.every.seconds=0.001")
    summary = build(cfg, run_dir=tmp_path).fit()
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    assert SUMMARY_KEYS <= on_disk.keys()
    assert on_disk["status"] == "completed" and on_disk["frames"] == 4096 and on_disk["updates"] == 16
    assert on_disk["solved"] is False and on_disk["frames_to_solve"] is None
    assert set(on_disk["sync"]) == {"pushes", "version", "mean_lag", "max_lag", "dropped_batches", "dropped_frames",
                                    "dropped_share"}
    assert on_disk["sync"]["pushes"] == 16
    assert {"collect", "update", "sync", "eval", "log", "other"} <= on_disk["time"].keys()
    assert sum(on_disk["time"].values()) == pytest.approx(on_disk["wall_time_s"], rel=0.05)
    assert 9.0 <= on_disk["eval_return"] <= 500.0

    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert len(rows) >= 2
    frames = [r["frames"] for r in rows]
    assert frames == sorted(frames) and frames[-1] == 4096
    logged = set().union(*rows)
    for key in ["frames", "updates", "train/episode_return", "train/episode_length", "eval/return",
                "loss/policy", "loss/value", "loss/entropy", "time/collect", "time/update",
                "perf/fps", "sync/version", "sync/lag", "sync/push_ms"]:
        assert key in logged, key
    assert rows[-1]["sync/version"] == 16 and rows[-1]["eval/return"] == on_disk["eval_return"]
    assert all(r["sync/lag"] == 0 for r in rows if "sync/lag" in r)


def test_the_last_metrics_row_and_the_summary_agree_on_the_eval_return(tmp_path):
    # Evaluations every 1024 frames and one log row for the whole run: its window holds four of them.
    cfg = make_config("trainer.total_frames=4096", "trainer.stop_at_return=null", "hooks.eval.every={frames:1024}",
                      "hooks.eval.episodes=3", "hooks.log.every.seconds=3600")
    summary = build(cfg, run_dir=tmp_path).fit()
    last = read_jsonl(tmp_path / "metrics.jsonl")[-1]
    assert last["frames"] == summary["frames"] == 4096
    assert last["eval/return"] == summary["eval_return"]  # the latest evaluation, not a mean of the window's


def test_a_log_row_due_at_the_last_batch_is_the_one_final_row_with_the_final_evaluation(tmp_path):
    cfg = make_config("trainer.total_frames=4096", "trainer.stop_at_return=null", "hooks.eval.every={frames:2048}",
                      "hooks.eval.episodes=3", "~hooks.log.every", "+hooks.log.every={frames:1024}")
    summary = build(cfg, run_dir=tmp_path).fit()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["frames"] for r in rows] == [1024, 2048, 3072, 4096]
    assert rows[-1]["eval/return"] == summary["eval_return"] and summary["evaluations"] == 2


@pytest.mark.parametrize("logger", ["console", "csv"])
def test_the_cli_ends_with_the_result_line_whatever_the_loggers(logger, tmp_path):
    proc = run_cli(f"logger={logger}", "trainer.total_frames=2048", "hooks.progress.bar=false", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]  # Hydra's console log goes to stdout
    assert "done: status completed | frames 2,048 |" in last and "eval return" in last


def test_summary_says_failed_when_a_hook_raises(tmp_path):
    cfg = make_config("+hooks.bad._target_=tests.hooks_for_tests.FailingHook", "+hooks.bad.at_update=2",
                      "trainer.total_frames=4096")
    with pytest.raises(RuntimeError, match="boom from a hook"):
        build(cfg, run_dir=tmp_path).fit()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed: RuntimeError: boom from a hook"
    assert summary["updates"] == 2


def test_summary_says_interrupted_on_keyboard_interrupt(tmp_path):
    cfg = make_config("+hooks.bad._target_=tests.hooks_for_tests.FailingHook", "+hooks.bad.at_update=3",
                      "+hooks.bad.error=KeyboardInterrupt", "trainer.total_frames=4096",
                      "collector.frames_per_batch=256")
    with pytest.raises(KeyboardInterrupt):
        build(cfg, run_dir=tmp_path).fit()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["frames"] == 768


def test_ctrl_c_on_the_cli_checkpoints_writes_the_summary_and_exits_130(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "rltrain", "trainer.total_frames=100000000", "trainer.stop_at_return=null",
         "hooks.log.every.seconds=0.2", "hydra.run.dir=run"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 60
    while not (metrics.exists() and metrics.stat().st_size > 0) and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["frames"] > 0
    assert "Traceback" not in err
    # The step under way was finished and checkpointed, so the run can continue from there.
    assert (tmp_path / "run" / "checkpoints" / f"frames_{summary['frames']:012d}.pt").is_file()


def test_multirun_sweep_runs_each_job_in_its_own_dir_under_outputs(tmp_path):
    result = run_cli("-m", "seed=0,1", "algo.lr=3e-4,1e-3", "trainer.total_frames=1024", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    summaries = sorted((tmp_path / "outputs" / "multirun").glob("*/*/*/summary.json"))
    assert len(summaries) == 4
    overrides = set()
    for path in summaries:
        assert json.loads(path.read_text())["status"] == "completed"
        overrides.add((path.parent / ".hydra" / "overrides.yaml").read_text())
    assert len(overrides) == 4


def test_the_app_returns_the_final_eval_return(tmp_path, monkeypatch):
    from rltrain.cli import run

    monkeypatch.chdir(tmp_path)  # its run dir goes under ./outputs
    # Hydra's decorator keeps the undecorated function; calling it directly shows the return value.
    cfg = make_config("trainer.total_frames=512", "hooks.eval.episodes=2")
    value = run.__wrapped__(cfg)
    assert isinstance(value, float) and 8.0 <= value <= 500.0


def test_wandb_offline_run_holds_the_config_metrics_and_summary(tmp_path):
    cfg = make_config("logger=[console,wandb]", "trainer.total_frames=1024", "hooks.log.every.seconds=0.001")
    build(cfg, run_dir=tmp_path).fit()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    history_keys, config_keys, summary = set(), set(), {}
    for record in read_wandb_records(next(runs[0].glob("*.wandb"))):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history_keys |= {item.key or ".".join(item.nested_key) for item in record.history.item}
        elif kind == "run":
            config_keys |= {item.key for item in record.run.config.update}
        elif kind == "summary":
            summary.update({item.key or ".".join(item.nested_key): item.value_json for item in record.summary.update})
    assert {"frames", "train/episode_return", "loss/policy", "perf/fps"} <= history_keys
    assert {"algo", "env", "trainer", "seed"} <= config_keys
    assert json.loads(summary["status"]) == "completed"


def read_wandb_records(path):
    """Records of a .wandb file: a 7-byte header, then LevelDB-log framed protobuf records in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, payload = path.read_bytes(), 32768, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        payload += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST fragment
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            payload = b""
            yield record


def test_the_readmes_python_example_runs_as_written(tmp_path):
    readme = (ROOT / "docs" / "python.md").read_text()
    block = readme.split("<!-- python-example -->", 1)[1].split("<!-- /python-example -->", 1)[0]
    code = block.split("```python\n", 1)[1].split("```", 1)[0]
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    status, frames, eval_return, run_dir = result.stdout.split()[-4:]
    assert status == "completed" and int(frames) >= 512 and float(eval_return) > 9
    summary = json.loads((tmp_path / run_dir / "summary.json").read_text())
    assert summary["frames"] == int(frames) and (tmp_path / run_dir).parent.parent == tmp_path / "outputs"


def test_help_shows_each_keys_comment(tmp_path):
    result = run_cli("--help", "algo=sac", "env=pendulum", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = {line.split(":", 1)[0].strip(): line for line in result.stdout.splitlines() if ":" in line}

    def comment(key):
        return lines[key].split("# ", 1)[1] if "# " in lines[key] else None

    assert comment("critic_lr") == "critics' learning rate (Adam)"  # from SAC's signature
    assert comment("num_envs") == "envs stepped together per collector"  # from env/pendulum.yaml
    assert comment("total_frames") == "env frames to collect (all envs together)"  # from config.yaml
    assert comment("resume").endswith("none: start fresh)")  # a comment continued on the next line
    assert "algo: dqn, grpo, ppo, sac" in result.stdout  # the groups are still listed
