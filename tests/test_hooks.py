"""Hooks fire at their events and on their schedule, and user hooks join from the config."""

from __future__ import annotations

import json

import pytest

from rltrain import build
from rltrain.hooks import Schedule
from rltrain.state import TrainState
from tests.conftest import make_config, run_cli

RECORDING = "+hooks.rec._target_=tests.hooks_for_tests.RecordingHook"


def run_with_recorder(tmp_path, every: str | None, *overrides: str):
    extra = [f"+hooks.rec.every={every}"] if every else []
    cfg = make_config(RECORDING, *extra, "trainer.total_frames=2048", "trainer.stop_at_return=null",
                      "collector.frames_per_batch=256", *overrides)
    trainer = build(cfg, run_dir=tmp_path)
    trainer.fit()
    return trainer.hooks["rec"].calls


def test_user_hook_sees_every_event_in_order_with_the_train_state(tmp_path):
    calls = run_with_recorder(tmp_path, None)
    assert calls[0] == ("start", 0, 0, 0)
    assert calls[-1] == ("end", 2048, 8, 8)
    body = calls[1:-1]
    assert [c[0] for c in body] == ["batch", "update"] * 8
    # At "batch" the frames are counted but the update not yet done; at "update" it is.
    assert body[0] == ("batch", 256, 1, 0) and body[1] == ("update", 256, 1, 1)
    assert body[-1] == ("update", 2048, 8, 8)


@pytest.mark.parametrize(("every", "expected_frames"), [
    ("{frames:1000}", [1024, 2048]),
    ("{batches:3}", [768, 1536]),
    ("{updates:4}", [1024, 2048]),
])
def test_scheduled_hook_runs_when_its_period_is_crossed(tmp_path, every, expected_frames):
    calls = run_with_recorder(tmp_path, every)
    assert [c[1] for c in calls if c[0] == "update"] == expected_frames


def test_seconds_schedule(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("rltrain.hooks.base.time.monotonic", lambda: clock[0])
    schedule = Schedule({"seconds": 5})
    state = TrainState(run_dir=".", total_frames=1)
    due = []
    for _ in range(6):
        clock[0] += 2.0
        due.append(schedule.due(state))
    assert due == [False, False, True, False, False, True]  # at +6 s and +12 s


def test_a_resumed_schedule_does_not_fire_for_the_past():
    schedule = Schedule({"frames": 1000})
    state = TrainState(run_dir=".", total_frames=10_000)
    state.progress.frames = 4500  # a run resumed from a checkpoint at 4500 frames
    schedule.catch_up(state)
    assert not schedule.due(state)
    state.progress.frames = 4999
    assert not schedule.due(state)
    state.progress.frames = 5000
    assert schedule.due(state)


def test_a_user_hook_joins_from_the_command_line(tmp_path):
    result = run_cli(RECORDING, "+hooks.rec.every={batches:2}", "trainer.total_frames=1024",
                     "collector.frames_per_batch=256",
                     "trainer.stop_at_return=null", "hydra.run.dir=run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    calls = json.loads((tmp_path / "run" / "recording.json").read_text())
    assert [c[2] for c in calls if c[0] == "update"] == [2, 4]
    assert calls[0][0] == "start" and calls[-1][0] == "end"


def test_weight_push_follows_sync_every(tmp_path):
    cfg = make_config("sync.every=3", "trainer.total_frames=2560", "trainer.stop_at_return=null",
                      "collector.frames_per_batch=256")
    summary = build(cfg, run_dir=tmp_path).fit()
    assert summary["updates"] == 10
    assert summary["sync"]["pushes"] == 3 and summary["sync"]["version"] == 3
    # The local collector polls before every batch, so it always acts with the newest pushed version.
    assert summary["sync"]["max_lag"] == 0 and summary["sync"]["mean_lag"] == 0


def test_every_null_means_never_and_at_end_runs_the_hook_once_more_at_the_end(tmp_path):
    from rltrain.hooks import Hook

    class Counting(Hook):
        def __init__(self):
            super().__init__(every=None, at_end=True)
            self.frames_seen = []

        def on_update(self, state):
            self.frames_seen.append(state.frames)

    state = TrainState(run_dir=".", total_frames=10)
    state.progress.frames = state.progress.batches = state.progress.updates = 10**6
    hook = Counting()
    assert not hook.schedule.due(state)  # null: never on a schedule
    hook.on_end(state)
    assert hook.frames_seen == [10**6]  # ...but once at the end, with at_end
