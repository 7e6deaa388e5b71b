"""python -m rltrain.report: a sweep's table (one row per learning rate, seeds aggregated), its learning-curve
PNG, runs still going or failed, runs of different recipes, csv and json, files it cannot read, and the errors
a user sees."""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rltrain.report import group, load_runs, table
from rltrain.report.cli import NO_MATPLOTLIB
from rltrain.report.curves import PANEL_SIZE
from tests.conftest import ROOT, run_cli

# A low bar (stop_at_return=60), so that some seeds solve CartPole and stop early and some may not.
SWEEP = ("-m", "seed=0,1", "algo.lr=1e-3,3e-3", "trainer.total_frames=6144", "trainer.stop_at_return=60",
         "hooks.log.every.seconds=0.1", "hooks.eval.every={frames:2048}", "hooks.eval.episodes=3")


def report(*args: str | Path, cwd: Path | None = None, python: list[str] | None = None,
           prefix: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m rltrain.report ARGS`` (after the command ``prefix``, if given)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([*(prefix or []), sys.executable, *(python or ["-m", "rltrain.report"]), *map(str, args)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """A finished sweep of 2 learning rates x 2 seeds: outputs/multirun/DATE/TIME/{0,1,2,3}."""
    cwd = tmp_path_factory.mktemp("sweep")
    result = run_cli(*SWEEP, cwd=cwd)
    assert result.returncode == 0, result.stderr
    (sweep_dir,) = (cwd / "outputs" / "multirun").glob("*/*")
    return sweep_dir


@pytest.fixture(scope="module")
def recipes(tmp_path_factory) -> Path:
    """Two seeds each of two recipes, and one more ppo_cartpole run at another learning rate, as a user starts
    them (+recipe=NAME), in runs/{ppo_cartpole,ppo_pendulum,ppo_cartpole_lr}/ (side by side: ~20 s on 2 cores)."""
    cwd = tmp_path_factory.mktemp("recipes")
    tiny = ("trainer.total_frames=4096", "hooks.log.every.seconds=0.1")
    commands = [("-m", "+recipe=ppo_cartpole", "seed=0,1", *tiny, "hydra.sweep.dir=runs/ppo_cartpole"),
                ("-m", "+recipe=ppo_pendulum", "seed=0,1", *tiny, "hydra.sweep.dir=runs/ppo_pendulum"),
                ("+recipe=ppo_cartpole", "algo.lr=1e-3", *tiny, "hydra.run.dir=runs/ppo_cartpole_lr")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = [subprocess.Popen([sys.executable, "-m", "rltrain", *args], cwd=cwd, env=env, text=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for args in commands]
    for process in started:
        _, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr
    return cwd / "runs"


def summaries_by_lr(sweep_dir: Path) -> dict[str, list[dict]]:
    by_lr: dict[str, list[dict]] = {}
    for run_dir in sorted(p for p in sweep_dir.iterdir() if (p / "summary.json").is_file()):
        lr = next(o for o in (run_dir / ".hydra/overrides.yaml").read_text().split() if o.startswith("algo.lr="))
        by_lr.setdefault(lr, []).append(json.loads((run_dir / "summary.json").read_text()))
    return by_lr


def json_report(*args: str | Path) -> list[dict]:
    result = report(*args, "--format", "json", "--no-plot")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["groups"]


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def copy_as_live_run(run_dir: Path, to: Path) -> list[dict]:
    """``run_dir`` as if it were still going: no summary.json, half its metrics rows (at least up to its
    first evaluation: rows are logged by the wall clock, so on a busy machine the first half may end before
    it) and half a line, and the run.lock a live run holds (naming this process). Returns the rows it kept."""
    shutil.copytree(run_dir, to)
    (to / "summary.json").unlink()
    lines = (to / "metrics.jsonl").read_text().splitlines()
    first_eval = next(i for i, line in enumerate(lines) if json.loads(line).get("eval/return") is not None)
    kept = lines[:max(len(lines) // 2, first_eval + 1)]
    assert len(kept) < len(lines), "the run's first evaluation is its last row: nothing left to be writing"
    (to / "metrics.jsonl").write_text("\n".join(kept) + "\n" + lines[len(kept)][:40])
    (to / "run.lock").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": "now"}))
    return [json.loads(line) for line in kept]


def test_the_json_table_has_a_row_per_learning_rate_with_the_seeds_statistics(sweep):
    groups = json_report(sweep)
    expected = summaries_by_lr(sweep)
    assert sorted(g["label"] for g in groups) == sorted(expected) == ["algo.lr=0.001", "algo.lr=0.003"]
    for g in groups:
        summaries = expected[g["label"]]
        assert g["seeds"] == 2 and len(g["runs"]) == 2 and g["status"] == ""
        for key in ("eval_return", "train_return"):
            values = [s[key] for s in summaries]
            assert g[key]["mean"] == pytest.approx(statistics.mean(values), abs=1e-9)
            assert g[key]["std"] == pytest.approx(statistics.stdev(values), abs=1e-9)  # sample std, ddof=1
        assert g["frames"] == statistics.mean(s["frames"] for s in summaries)
        assert g["solved"] == sum(s["solved"] for s in summaries)
        solve_frames = [s["frames_to_solve"] for s in summaries if s["solved"]]
        assert g["frames_to_solve_median"] == (statistics.median(solve_frames) if solve_frames else None)
        assert sorted(r["seed"] for r in g["runs"]) == [0, 1]
        assert all(Path(r["dir"]).parent == sweep for r in g["runs"])


def test_the_markdown_table_and_the_learning_curves_of_a_sweep(sweep):
    result = report(sweep, "--title", "CartPole: lr sweep")
    assert result.returncode == 0, result.stderr
    for lr, summaries in summaries_by_lr(sweep).items():
        (row,) = [line for line in result.stdout.splitlines() if line.startswith(f"| {lr} |")]
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        evals, trains = [s["eval_return"] for s in summaries], [s["train_return"] for s in summaries]
        assert cells[1] == "2"
        assert cells[2] == f"{statistics.mean(evals):.1f} ± {statistics.stdev(evals):.1f}"
        assert cells[3] == f"{statistics.mean(trains):.1f} ± {statistics.stdev(trains):.1f}"
        assert cells[7] == f"{sum(s['solved'] for s in summaries)}/2"

    png = sweep / "report.png"
    assert f"plot written to {png}" in result.stderr
    width, height = png_size(png)
    assert width > 600 and height > 250 and png.stat().st_size > 10_000


def test_a_quoted_glob_reports_the_same_runs_and_csv_parses(sweep):
    result = report(f"{sweep}/[0-9]", "--format", "csv", "--no-plot")
    assert result.returncode == 0, result.stderr
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    by_label = {g["label"]: g for g in json_report(sweep)}
    assert sorted(row["configuration"] for row in rows) == sorted(by_label)
    for row in rows:
        assert int(row["seeds"]) == 2
        assert float(row["eval_return_mean"]) == by_label[row["configuration"]]["eval_return"]["mean"]
        assert float(row["eval_return_std"]) == by_label[row["configuration"]]["eval_return"]["std"]


def test_a_run_still_going_is_reported_from_its_partial_metrics(sweep, tmp_path):
    kept = copy_as_live_run(sweep / "0", tmp_path / "live")
    # Its half line is the row it is writing now, not a line cut short by a crash: nothing to warn about.
    assert report(tmp_path / "live", "--no-plot").stderr == ""

    (g,) = json_report(tmp_path / "live")
    (run,) = g["runs"]
    assert run["status"] == "running" and g["status"] == "1 running"
    assert run["frames"] == kept[-1]["frames"]
    assert run["eval_return"] == [r["eval/return"] for r in kept if r.get("eval/return") is not None][-1]
    assert run["train_return"] == [r["train/episode_return"] for r in kept if "train/episode_return" in r][-1]

    # Beside the sweep, it is a third seed of its configuration (a copy: same config, same seed).
    by_label = {g["label"]: g for g in json_report(sweep, tmp_path / "live")}
    assert by_label["algo.lr=0.001"]["seeds"] == 3 and by_label["algo.lr=0.001"]["status"] == "1 running"


def test_a_failed_run_is_listed_with_its_reason_but_not_counted(sweep, tmp_path):
    shutil.copytree(sweep / "0", tmp_path / "failed")
    summary = json.loads((tmp_path / "failed/summary.json").read_text())
    (tmp_path / "failed/summary.json").write_text(json.dumps({**summary, "status": "failed: RuntimeError: boom"}))

    groups = group(load_runs([sweep, tmp_path / "failed"]))
    lr_1e3 = next(g for g in groups if g.label == "algo.lr=0.001")
    assert [run.reason for run in lr_1e3.runs if run.status == "failed"] == ["RuntimeError: boom"]
    assert lr_1e3.stats()["seeds"] == 2  # the statistics are the sweep's own
    evals = [s["eval_return"] for s in summaries_by_lr(sweep)["algo.lr=0.001"]]
    assert lr_1e3.stats()["eval_return"]["mean"] == pytest.approx(statistics.mean(evals))
    assert "1 failed" in table(groups, "markdown")
    assert '"reason": "RuntimeError: boom"' in table(groups, "json")


def test_a_path_without_runs_is_an_error_that_names_it(tmp_path):
    (tmp_path / "empty").mkdir()
    result = report(tmp_path / "empty")
    assert result.returncode == 2
    assert result.stderr.strip() == f"rltrain.report: no run dir under {tmp_path / 'empty'} " \
                                    "(a run dir holds metrics.jsonl or summary.json)"
    missing = report(tmp_path / "no-such-dir")
    assert missing.returncode == 2 and "no-such-dir does not exist" in missing.stderr
    assert "Traceback" not in result.stderr + missing.stderr


def test_without_matplotlib_the_table_is_still_printed(sweep):
    # None in sys.modules makes `import matplotlib` fail, as it does where it is not installed.
    no_matplotlib = ["-c", "import sys; sys.modules['matplotlib'] = None; from rltrain.report.cli import main; "
                           "sys.exit(main(sys.argv[1:]))"]
    result = report(sweep, "--out", sweep / "never.png", python=no_matplotlib)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == NO_MATPLOTLIB
    assert "| algo.lr=0.001 | 2 |" in result.stdout and not (sweep / "never.png").exists()


def test_runs_of_different_recipes_are_labelled_by_recipe_and_plotted_per_env(recipes):
    result = report(recipes)
    assert result.returncode == 0, result.stderr
    rows = {cells[0]: cells for cells in ([c.strip() for c in line.strip("|").split("|")]
                                          for line in result.stdout.splitlines()[2:])}
    # Not the env, algo settings and budgets the recipes differ in: the recipe, and what was typed beside it.
    assert sorted(rows) == ["recipe=ppo_cartpole algo.lr=0.001", "recipe=ppo_cartpole algo.lr=0.003",
                            "recipe=ppo_pendulum"]
    assert [rows[label][1] for label in sorted(rows)] == ["1", "2", "2"]
    # The recipes run their whole budget (stop_at_return: null): there is nothing to have solved.
    assert all(cells[7] == "–" for cells in rows.values())

    # CartPole and Pendulum returns share no axis: a row of panels each, one legend below.
    width, height = png_size(recipes / "report.png")
    assert width >= 2 * PANEL_SIZE[0] * 120 - 10 and height >= 2 * PANEL_SIZE[1] * 120

    by_label = {g["label"]: g for g in json_report(recipes)}
    assert by_label["recipe=ppo_pendulum"]["settings"] == {"recipe": "ppo_pendulum"}
    assert by_label["recipe=ppo_cartpole algo.lr=0.001"]["settings"] == {"recipe": "ppo_cartpole", "algo.lr": 0.001}
    assert all(g["solved"] is None and g["with_target"] == 0 for g in by_label.values())


def test_one_recipe_alone_is_labelled_by_what_was_typed(recipes):
    (g,) = json_report(recipes / "ppo_pendulum")
    assert g["label"] == "recipe=ppo_pendulum trainer.total_frames=4096 hooks.log.every.seconds=0.1"
    assert g["seeds"] == 2


def test_solved_counts_only_the_runs_that_had_a_target(sweep, tmp_path):
    # A run of the same configuration whose summary says it had no target return (solved: null).
    shutil.copytree(sweep / "0", tmp_path / "no-target")
    summary = json.loads((tmp_path / "no-target/summary.json").read_text())
    (tmp_path / "no-target/summary.json").write_text(json.dumps({**summary, "solved": None, "stop_at_return": None}))

    lr = next(lr for lr, summaries in summaries_by_lr(sweep).items() if summary in summaries)
    solved = sum(s["solved"] for s in summaries_by_lr(sweep)[lr])
    g = {g["label"]: g for g in json_report(sweep, tmp_path / "no-target")}[lr]
    assert g["seeds"] == 3 and g["with_target"] == 2 and g["solved"] == solved
    result = report(sweep, tmp_path / "no-target", "--no-plot")
    (row,) = [line for line in result.stdout.splitlines() if line.startswith(f"| {lr} |")]
    assert row.split("|")[8].strip() == f"{solved}/2"


def test_float_overrides_are_shown_to_4_significant_digits_and_kept_exact_in_json(sweep, tmp_path):
    # An Optuna trial's learning rate, as the sweeper writes it.
    trial = tmp_path / "trial"
    shutil.copytree(sweep / "0", trial)
    lr = 0.0012520653814999472
    overrides = [o if not o.startswith("algo.lr=") else f"algo.lr={lr!r}"
                 for o in yaml.safe_load((trial / ".hydra/overrides.yaml").read_text())]
    (trial / ".hydra/overrides.yaml").write_text(yaml.safe_dump(overrides))
    config = yaml.safe_load((trial / ".hydra/config.yaml").read_text())
    config["algo"]["lr"] = lr
    (trial / ".hydra/config.yaml").write_text(yaml.safe_dump(config))

    by_label = {g["label"]: g for g in json_report(sweep, trial)}
    assert sorted(by_label) == ["algo.lr=0.001", "algo.lr=0.001252", "algo.lr=0.003"]
    assert by_label["algo.lr=0.001252"]["settings"] == {"algo.lr": lr}
    assert "| algo.lr=0.001252 | 1 |" in report(sweep, trial, "--no-plot").stdout


# A file of run 0 of a copy of the sweep, as a crash, a full disk or a stray edit leaves it (None: gone), the start
# of the one line that must name it, and the status run 0 then has.
DAMAGES = {
    "empty summary": ({"summary.json": b""}, "summary.json: unreadable (empty)", "no summary"),
    "garbage summary": ({"summary.json": b"{not json"}, "summary.json: unreadable (Expecting property name",
                        "no summary"),
    "a stray byte in metrics": ({"metrics.jsonl": lambda rows: rows.replace(b"\n", b"\n\xff\n", 1)},
                                "metrics.jsonl: line 2 skipped (not a JSON row", "completed"),
    "metrics cut short by a crash": ({"summary.json": None, "metrics.jsonl": lambda rows: rows + b'{"frames": 6'},
                                     "metrics.jsonl: line ", "no summary"),
    "garbage config": ({".hydra/config.yaml": b"{not: [yaml"}, ".hydra/config.yaml: unreadable (expected ','",
                       "completed"),
    "a config that is a list": ({".hydra/config.yaml": b"- seed\n"}, ".hydra/config.yaml: unreadable (a list",
                                "completed"),
    "garbage overrides": ({".hydra/overrides.yaml": b"[seed=0"}, ".hydra/overrides.yaml: unreadable (expected ','",
                          "completed"),
    "garbage hydra.yaml": ({".hydra/hydra.yaml": b"{not: [yaml"}, ".hydra/hydra.yaml: unreadable (expected ','",
                           "completed"),
    "garbage checkpoint config": ({".hydra/config.yaml": None, "checkpoints/config.json": b"{not json"},
                                  "checkpoints/config.json: unreadable (Expecting property name", "completed"),
    "a lock cut short": ({"summary.json": None, "run.lock": b'{"pid": 12'}, "run.lock: unreadable (Expecting",
                         "no summary"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_file_that_cannot_be_read_is_named_and_every_run_still_reported(sweep, tmp_path, damage):
    shutil.copytree(sweep, tmp_path / "sweep", ignore=shutil.ignore_patterns("*.png"))
    files, named, status = DAMAGES[damage]
    for name, content in files.items():
        path = tmp_path / "sweep/0" / name
        if content is None:
            path.unlink()
        else:
            path.write_bytes(content(path.read_bytes()) if callable(content) else content)

    result = report(tmp_path / "sweep", "--format", "json", "--no-plot")
    assert result.returncode == 0, result.stderr
    assert result.stderr.startswith(f"rltrain.report: {tmp_path / 'sweep/0'}/{named}")
    assert len(result.stderr.splitlines()) == 1, result.stderr
    runs = {Path(run["dir"]).name: run for g in json.loads(result.stdout)["groups"] for run in g["runs"]}
    assert sorted(runs) == ["0", "1", "2", "3"]
    assert runs["0"]["status"] == status and runs["0"]["frames"] > 0  # without its summary: from its metrics rows
    assert all(runs[name]["status"] == "completed" for name in "123")


def test_a_dir_or_file_without_permission_is_named_and_the_other_runs_reported(sweep, tmp_path):
    # Root reads any file: run the report without that power (setpriv drops it), as a user runs it.
    prefix = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"] if os.geteuid() == 0 else []
    if prefix and subprocess.run([*prefix, "true"], capture_output=True).returncode != 0:
        pytest.skip("root reads any file, and setpriv cannot take that away here")
    copy = tmp_path / "sweep"
    shutil.copytree(sweep, copy, ignore=shutil.ignore_patterns("*.png"))
    locked = [copy / "0", copy / "1/.hydra", copy / "2/summary.json"]
    for path in locked:
        path.chmod(0)
    try:
        result = report(copy, "--format", "json", "--no-plot", prefix=prefix)
    finally:
        for path in locked:
            path.chmod(0o755)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        f"rltrain.report: {copy / '0'}: cannot be listed (Permission denied); the runs in it, if any, are left out",
        *[f"rltrain.report: {copy / '1/.hydra' / name}: unreadable (Permission denied); the run is reported without it"
          for name in ("config.yaml", "hydra.yaml", "overrides.yaml")],
        f"rltrain.report: {copy / '2/summary.json'}: unreadable (Permission denied); the run is reported without it"]
    runs = {Path(run["dir"]).name: run for g in json.loads(result.stdout)["groups"] for run in g["runs"]}
    assert sorted(runs) == ["1", "2", "3"]
    assert runs["2"]["status"] == "no summary" and runs["2"]["frames"] > 0
    # Its config is read from checkpoints/config.json instead.
    assert runs["1"]["seed"] == yaml.safe_load((sweep / "1/.hydra/config.yaml").read_text())["seed"]


def test_the_plot_is_written_where_the_message_says(sweep, tmp_path):
    (tmp_path / "plots").mkdir()
    for out, written in [(tmp_path / "lr", tmp_path / "lr.png"),  # a name without .png: .png is added
                         (tmp_path / "plots", tmp_path / "plots/report.png"),  # a dir: report.png in it
                         (tmp_path / "new/lr.png", tmp_path / "new/lr.png")]:  # in a dir not made yet
        result = report(sweep, "--out", out)
        assert result.returncode == 0, result.stderr
        assert result.stderr == f"rltrain.report: plot written to {written}\n"
        assert png_size(written)[0] > 600
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [
        "lr.png", "new", "new/lr.png", "plots", "plots/report.png"]
