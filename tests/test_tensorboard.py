"""logger=tensorboard: event files in the run dir holding what metrics.jsonl holds, at step = frames."""

from __future__ import annotations

import importlib.util

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rltrain import build, checkpoint
from rltrain.errors import ConfigError
from tests.conftest import make_config, run_cli
from tests.test_outputs import read_jsonl

TENSORBOARD = ("logger=[console,tensorboard]",)


def read_events(log_dir) -> EventAccumulator:
    """What `tensorboard --logdir` shows of ``log_dir`` (every event file in it, in order)."""
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return events


def scalars(events: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in events.Scalars(tag)]


def jsonl_series(run_dir, key: str) -> list[tuple[int, float]]:
    return [(row["frames"], pytest.approx(row[key], rel=1e-6)) for row in read_jsonl(run_dir / "metrics.jsonl")
            if key in row]


def test_every_metric_of_metrics_jsonl_is_a_scalar_at_its_frames(tmp_path):
    cfg = make_config(*TENSORBOARD, "trainer.total_frames=4096", "~hooks.log.every", "+hooks.log.every={frames:1024}")
    summary = build(cfg, run_dir=tmp_path).fit()

    events = read_events(tmp_path / "tensorboard")
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    for key in ["train/episode_return", "perf/fps", "loss/policy", "ppo/approx_kl", "eval/return", "time/update"]:
        assert scalars(events, key) == jsonl_series(tmp_path, key), key
    logged = {key for row in rows for key in row if key != "frames"}
    assert logged <= set(events.Tags()["scalars"])  # every metric, not only those above
    # The summary's numbers at the final frame count, the config and the summary as text.
    assert scalars(events, "summary/frames") == [(4096, 4096.0)]
    assert scalars(events, "summary/eval_return") == [(4096, pytest.approx(summary["eval_return"]))]
    assert scalars(events, "summary/time/update") == [(4096, pytest.approx(summary["time"]["update"]))]
    config_text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "total_frames: 4096" in config_text


def test_a_run_resumed_from_an_older_checkpoint_shows_no_step_twice(tmp_path):
    run = (*TENSORBOARD, "trainer.total_frames=6144", "trainer.stop_at_return=null", "~hooks.log.every",
           "+hooks.log.every={frames:1024}", "~hooks.checkpoint.every", "+hooks.checkpoint.every={frames:2048}",
           "hooks.checkpoint.keep_last=5")
    build(make_config(*run), run_dir=tmp_path).fit()
    build(make_config(*run, f"resume={checkpoint.path_for(tmp_path, 2048)}")).fit()  # as after a crash at 2048
    build(make_config(*run, f"resume={tmp_path}")).fit()  # nothing left to do: nothing is added

    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2  # one per session that trained
    events = read_events(tmp_path / "tensorboard")
    for key in ["train/episode_return", "loss/policy", "sync/version"]:  # the first session's rows past 2048 are gone
        assert scalars(events, key) == jsonl_series(tmp_path, key), key
    assert scalars(events, "summary/frames") == [(6144, 6144.0)]
    assert len(events.Tensors("config/text_summary")) == 1


def test_logger_tensorboard_without_tensorboard_installed_is_a_config_error(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError, match=r"logger.tensorboard .* needs tensorboard, which is not installed: "
                                          r"pip install 'rltrain\[tensorboard\]'"):
        build(make_config(*TENSORBOARD), run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_help_documents_the_tensorboard_keys(tmp_path):
    result = run_cli(*TENSORBOARD, "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.strip().startswith("subdir:"))
    assert "subdir: tensorboard" in line and "# where in the run dir the event files go" in line
