"""The benchmark command: its tables, its peers (present, missing, failing), and a quick run of everything."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks import core
from benchmarks.context import Context
from benchmarks.core import OURS, Goal, Row, Stat, Table
from tests.conftest import ROOT


def test_stat_reports_median_and_the_p10_p90_spread():
    s = Stat([float(x) for x in range(1, 12)])  # 1..11
    assert s.median == 6 and s.percentile(0.1) == 2 and s.percentile(0.9) == 10
    assert s.format() == "6 [2-10]"


def test_ratios_say_how_many_times_rltrain_wins_for_times_and_rates():
    table = Table("t", [OURS, "peer"])
    table.rows.append(Row("time", {OURS: Stat([2.0]), "peer": Stat([6.0])}))
    table.rows.append(Row("rate", {OURS: Stat([300.0], higher_is_better=True),
                                   "peer": Stat([100.0], higher_is_better=True)}))
    table.rows.append(Row("missing", {OURS: Stat([1.0]), "peer": None}))
    assert [table.ratio(r, "peer") for r in table.rows] == [3.0, 3.0, None]
    text = table.render()
    assert "x vs peer" in text and "3.00" in text
    assert text.splitlines()[-1].split()[1:3] == ["1", "–"]  # the missing cell and its ratio stay empty
    floor = Table("f", ["floor", "scheme"], ratio_to="floor", ratio_header="{peer} / floor", ratio_mode="over")
    floor.rows.append(Row("1M", {"floor": Stat([0.5]), "scheme": Stat([0.75])}))
    assert floor.ratio(floor.rows[0], "scheme") == 1.5 and "scheme / floor" in floor.render()
    assert table.to_json()["rows"][0]["ratios"] == {"peer": 3.0}


def test_a_full_run_marks_the_rows_that_miss_their_target():
    """A ratio or a median out of its target's bounds ends its row in MISSED (naming the figure when
    the target has several parts); a met target, or an empty cell, prints as before."""
    fps = Table("f", ["lockstep", "distributed"], ratio_to="lockstep", ratio_header="{peer} / lockstep",
                ratio_mode="over")
    for label, distributed in (("slow", 3_800.0), ("fast", 9_800.0)):
        fps.rows.append(Row(label, {"lockstep": Stat([10_000.0], "frames/s", True),
                                    "distributed": Stat([distributed], "frames/s", True)},
                            target=">= 0.8x", goals=(Goal("distributed", at_least=0.8),)))
    fps.rows.append(Row("unmeasured", {"lockstep": Stat([1.0]), "distributed": None}, target=">= 0.8x",
                        goals=(Goal("distributed", at_least=0.8),)))
    slow, fast, unmeasured = fps.render().splitlines()[-3:]
    assert " 0.38 " in slow and slow.endswith(" >= 0.8x  MISSED")
    assert " 0.98 " in fast and fast.endswith(" >= 0.8x") and unmeasured.endswith(" >= 0.8x")
    assert "MISSED" not in fps.render(judge=False)  # a quick run's figures are not judged
    assert [r["met"] for r in fps.to_json()["rows"]] == [False, True, None]
    assert [r["met"] for r in fps.to_json(judge=False)["rows"]] == [None, None, None]

    push = Table("p", ["memcpy floor", "shared_mem", "pipe"], ratio_to="memcpy floor", ratio_header="{peer} / floor",
                 ratio_mode="over")
    goals = (Goal("shared_mem", at_most=1, median=True), Goal("pipe", at_most=3))
    for label, shared_mem, pipe in (("pipe slow", 0.9, 2.4), ("both slow", 1.2, 2.4), ("both fast", 0.9, 0.2)):
        push.rows.append(Row(label, {"memcpy floor": Stat([0.1]), "shared_mem": Stat([shared_mem]),
                                     "pipe": Stat([pipe])}, target="shared_mem <= 1 ms, pipe <= 3x", goals=goals))
    lines = push.render().splitlines()[-3:]
    assert lines[0].endswith("shared_mem <= 1 ms, pipe <= 3x  MISSED: pipe / floor")
    assert lines[1].endswith("shared_mem <= 1 ms, pipe <= 3x  MISSED: shared_mem, pipe / floor")
    assert lines[2].endswith("shared_mem <= 1 ms, pipe <= 3x")


def test_a_peer_that_is_not_installed_is_reported_with_the_install_that_fixes_it(monkeypatch):
    monkeypatch.setitem(core.PEER_MODULES, "ghost", "no_such_module_for_rltrain_tests")
    monkeypatch.setitem(core.INSTALL_HINT, "ghost", "pip install ghost")
    peer = core.find_peer("ghost", None)
    assert peer.missing == "not installed here; pip install ghost"
    elsewhere = core.find_peer("ghost", sys.executable)  # another Python that lacks it too
    assert elsewhere.missing.startswith(f"not importable by {sys.executable}")
    assert "No module named" in elsewhere.missing
    with pytest.raises(SystemExit, match="unknown peer 'nobody'"):
        core.find_peer("nobody", None)


def test_trl_is_looked_for_in_its_own_python_and_reported_with_its_install_when_missing(monkeypatch):
    monkeypatch.setitem(core.PEER_MODULES, "trl", "no_such_trl_for_rltrain_tests")
    assert core.find_peer("trl", None).missing.startswith("not installed here; pip install trl")
    # --trl-python, not --peer-python, is where TRL is looked for when given (a venv of its own)
    ctx = Context(quick=True, compare=["trl"], peer_python="/nonexistent/python", threads=1, trl_python=sys.executable)
    assert ctx.peers["trl"].missing.startswith(f"not importable by {sys.executable}")
    assert ctx.peer("trl") is None and ctx.peer_notes("trl")[0].startswith("trl: not importable")


def test_the_grpo_step_clock_times_every_step_and_stops_at_the_reward_threshold(tmp_path):
    """The rltrain side of the GRPO benchmark: one step per update, the window's mean reward, the stop."""
    import torch

    from benchmarks.llm import count_tokens
    from benchmarks.step_clock import StepClock

    class State:
        should_stop = False

    clock, state = StepClock(str(tmp_path / "clock.json"), threshold=0.5, window=2), State()
    clock.on_start(state)
    for reward in (0.0, 0.5, 0.75):
        clock.on_batch(state, {"reward": torch.full((2, 4), reward)})
        clock.on_update(state)
        assert state.should_stop == (reward == 0.75)  # the last 2 steps' mean: 0.25, then 0.625
    clock.close(state, {})
    out = json.loads((tmp_path / "clock.json").read_text())
    assert len(out["step_seconds"]) == 3 and out["step_rewards"] == [0.0, 0.5, 0.75] and out["threshold_step"] == 3
    assert 0 < out["threshold_wall_s"] >= sum(out["step_seconds"]) - 1e-9
    assert count_tokens(torch.tensor([[5, 2, 0, 0], [5, 6, 7, 8]]), eos=2) == 6  # up to and including eos


def test_cases_run_in_a_worker_process_and_a_failing_case_leaves_only_its_cell_empty(monkeypatch):
    monkeypatch.setitem(core.PEER_MODULES, "worker", "json")  # importable by any Python
    ctx = Context(quick=True, compare=["worker"], peer_python=sys.executable, threads=1)
    try:
        ctx.peers["worker"].python = sys.executable  # force the worker process although json is importable here
        notes = []
        cells = ctx.compare({OURS: ("tests.benchmark_cases:sleeper", {"ms": 1.0}),
                             "worker": ("tests.benchmark_cases:sleeper", {"ms": 3.0})}, reps=3, notes=notes)
        assert 0.9 < cells[OURS].median < cells["worker"].median  # ms; the worker's sleeps are longer
        assert len(cells[OURS].samples) == 3 * ctx.rounds and not notes
        assert ctx.runner("worker").where == sys.executable
        cells = ctx.compare({OURS: ("tests.benchmark_cases:counter", {}),
                             "worker": ("tests.benchmark_cases:broken", {})}, reps=2, notes=notes)
        assert cells["worker"] is None and cells[OURS] is not None
        assert notes == ["worker failed: ValueError: this case cannot be built"]
        assert ctx.outputs({"worker": ("tests.benchmark_cases:counter", {})}) == {"worker": 1}
    finally:
        ctx.close()
    assert ctx.runner("worker").proc.poll() is not None  # closed: no worker left behind


def test_unknown_category_is_refused_naming_the_choices():
    out = subprocess.run([sys.executable, "-m", "benchmarks", "--only", "advantage,nope"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "unknown categories nope" in out.stderr and "weight_sync" in out.stderr


@pytest.mark.slow
def test_the_quick_suite_measures_every_category(tmp_path):
    """What CI runs as a smoke test: every category produces its tables with rltrain's figures;
    peers that are not installed leave their columns out with a note instead of failing."""
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    from benchmarks.cli import CATEGORIES

    assert list(result["categories"]) == CATEGORIES and result["failed"] == []
    for name, tables in result["categories"].items():
        assert tables, name
        for table in tables:
            assert table["rows"], (name, table["title"])
            for row in table["rows"]:
                measured = [c for c in row["cells"].values() if c]
                assert measured and all(c["median"] > 0 for c in measured if c["unit"] != "return"), (name, row)
    missing = {n for n, how in result["meta"]["peers"].items() if how.startswith("not ")}
    for name in missing:  # e.g. torchrl in the dev venv (it pins an older tensordict)
        assert all(name not in t["columns"] for ts in result["categories"].values() for t in ts)
        assert f"peer {name}: not " in proc.stdout
    gae = result["categories"]["advantage"][0]["rows"]
    assert [r["case"] for r in gae] == ["[1, 512]", "[32, 512]"]
    assert "## end_to_end" in proc.stdout and "launch to the first batch" in proc.stdout
    assert "MISSED" not in proc.stdout  # a smoke run's figures are not judged against the targets
