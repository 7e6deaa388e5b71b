"""A run dir belongs to one live run: unique default dirs, a lock with the owner's pid, takeover
of a dead owner's lock, and refusal (before anything is written) of a dir another run holds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rltrain import build
from rltrain.errors import RunDirError
from rltrain.run_dir import LOCK_FILE, RunDirLock, claim_unique, place
from tests.conftest import ROOT, make_config, run_cli

LONG_RUN = ("trainer.total_frames=100000000", "trainer.stop_at_return=null", "hooks.log.every.seconds=0.2",
            "~hooks.checkpoint.every", "+hooks.checkpoint.every={frames:2048}")


def start_cli(*args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rltrain", *args], cwd=cwd, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the run"
        time.sleep(0.1)


def lock_owner(run_dir: Path) -> int | None:
    try:
        return json.loads((run_dir / LOCK_FILE).read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None


def stop(proc: subprocess.Popen, sig=signal.SIGTERM) -> tuple[str, str]:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
    out, err = proc.communicate(timeout=60)
    return out, err


def records(run_dir: Path) -> dict[str, str]:
    """The files of a run that no later moment of the run changes: its config, Hydra's, its lock."""
    paths = [*(run_dir / ".hydra").iterdir(), run_dir / "checkpoints" / "config.json", run_dir / LOCK_FILE]
    return {str(p.relative_to(run_dir)): p.read_text() for p in paths}


def test_runs_started_together_claim_dirs_of_their_own(tmp_path):
    # The default hydra.run.dir is outputs/DATE/TIME through this resolver; same base, same second.
    base = "hydra.run.dir=${rltrain.unique_dir:outputs/same}"
    procs = [start_cli(base, f"seed={seed}", "trainer.total_frames=2048", cwd=tmp_path) for seed in (1, 2)]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    dirs = sorted((tmp_path / "outputs").iterdir())
    assert [d.name for d in dirs] == ["same", "same_1"]
    seeds = set()
    for run_dir in dirs:
        assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["frames"] for r in rows] == sorted({r["frames"] for r in rows})  # one run's rows, in order
        assert rows[-1]["frames"] == 2048
        seeds.add(make_seed(run_dir))
        assert not (run_dir / LOCK_FILE).exists()  # released at the end
    assert seeds == {1, 2}


def make_seed(run_dir: Path) -> int:
    import yaml

    return yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())["seed"]


def test_the_default_run_and_sweep_dirs_claim_a_unique_dir():
    from omegaconf import OmegaConf

    from rltrain.configs import __file__ as configs_init

    config = OmegaConf.load(Path(configs_init).parent / "config.yaml")
    assert config.hydra.run._get_node("dir")._value().startswith("${rltrain.unique_dir:outputs/")
    assert config.hydra.sweep._get_node("dir")._value().startswith("${rltrain.unique_dir:outputs/multirun/")


def test_claim_unique_never_hands_out_a_dir_twice(tmp_path):
    claimed = [claim_unique(tmp_path / "runs" / "12-00-00") for _ in range(3)]
    assert [p.name for p in claimed] == ["12-00-00", "12-00-00_1", "12-00-00_2"]
    assert all(p.is_dir() for p in claimed)


def test_a_second_run_in_a_live_runs_dir_stops_before_writing_anything(tmp_path):
    run_dir = tmp_path / "run"
    first = start_cli(*LONG_RUN, "hydra.run.dir=run", cwd=tmp_path)
    try:
        wait_for(lambda: list((run_dir / "checkpoints").glob("frames_*.pt"))
                 and (run_dir / "metrics.jsonl").exists())
        assert lock_owner(run_dir) == first.pid
        before, names = records(run_dir), {p.name for p in run_dir.iterdir()}
        log_before = (run_dir / "cli.log").read_text()
        for target in ("hydra.run.dir=run", "resume=run"):
            second = run_cli("seed=7", target, cwd=tmp_path, timeout=120)
            assert second.returncode == 2, second.stderr
            assert f"{run_dir} is in use by a live run (pid {first.pid} on" in second.stderr
            assert "Traceback" not in second.stderr
        assert records(run_dir) == before and {p.name for p in run_dir.iterdir()} == names
        assert (run_dir / "cli.log").read_text().startswith(log_before)  # only the first run's lines
        assert "seed=7" not in (run_dir / "cli.log").read_text()
        assert not (tmp_path / "outputs").exists()  # the refused runs left no dir of their own
    finally:
        _, err = stop(first)
    assert first.returncode == 128 + signal.SIGTERM, err
    assert not (run_dir / LOCK_FILE).exists()


def test_two_resume_auto_runs_cannot_both_continue_one_run(tmp_path):
    original = start_cli(*LONG_RUN, cwd=tmp_path)
    runs = tmp_path / "outputs"
    wait_for(lambda: list(runs.glob("*/*/checkpoints/frames_*.pt")) and list(runs.glob("*/*/metrics.jsonl")))
    stop(original)
    run_dir = next(runs.glob("*/*/checkpoints")).parent
    rows_before = len((run_dir / "metrics.jsonl").read_text().splitlines())

    first = start_cli(*LONG_RUN, "resume=auto", cwd=tmp_path)
    try:
        wait_for(lambda: lock_owner(run_dir) == first.pid)
        second = run_cli(*LONG_RUN, "resume=auto", cwd=tmp_path, timeout=120)
        assert second.returncode == 2, second.stderr
        assert f"{run_dir} is in use by a live run (pid {first.pid} on" in second.stderr
        assert len(list(runs.glob("*/*"))) == 1  # neither made a dir of its own
    finally:
        _, err = stop(first)
    assert first.returncode == 128 + signal.SIGTERM, err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) >= rows_before  # nothing lost


def test_a_dead_runs_lock_is_taken_over(tmp_path):
    run_dir = tmp_path / "run"
    dead = start_cli(*LONG_RUN, "hydra.run.dir=run", cwd=tmp_path)
    wait_for(lambda: list((run_dir / "checkpoints").glob("frames_*.pt")))
    stop(dead, signal.SIGKILL)
    assert lock_owner(run_dir) == dead.pid  # its lock file stays behind, with its pid
    frames = max(int(p.stem.split("_")[1]) for p in (run_dir / "checkpoints").glob("frames_*.pt"))

    resumed = run_cli(*LONG_RUN, "resume=run", f"trainer.total_frames={frames + 1024}", cwd=tmp_path, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["frames"] >= frames + 1024
    assert not (run_dir / LOCK_FILE).exists()


def test_a_fresh_run_refuses_a_dir_another_run_finished_in(tmp_path):
    build(make_config("trainer.total_frames=1024"), run_dir=tmp_path).fit()
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(RunDirError, match=r"already holds a run \(metrics.jsonl, checkpoints\); "
                                          r"continue it with resume="):
        build(make_config("trainer.total_frames=1024", "seed=1"), run_dir=tmp_path)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_the_lock_is_exclusive_while_held_and_free_after_release(tmp_path):
    lock = RunDirLock.acquire(tmp_path)
    assert lock_owner(tmp_path) == os.getpid()
    with pytest.raises(RunDirError, match=f"in use by a live run \\(pid {os.getpid()} on"):
        RunDirLock.acquire(tmp_path)  # another open file description: refused, as another process is
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()
    RunDirLock.acquire(tmp_path).release()


def without_root_powers() -> list[str]:
    """A command prefix that runs as root does without its power to write anywhere (as a user runs)."""
    if os.geteuid() != 0:
        return []
    prefix = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"]
    if subprocess.run([*prefix, "true"], capture_output=True).returncode != 0:
        pytest.skip("root writes anywhere, and setpriv cannot take that away here")
    return prefix


@pytest.mark.parametrize("case", ["under a file", "read-only cwd", "read-only cwd, sweep",
                                  "read-only cwd, optuna sweep"])
def test_an_unwritable_run_dir_is_one_line_naming_it_and_exit_code_2(case, tmp_path):
    (tmp_path / "a_file").write_text("")
    args, prefix, cwd = ["hydra.run.dir=a_file/run"], [], tmp_path
    if case != "under a file":
        prefix, cwd = without_root_powers(), tmp_path / "read_only"
        cwd.mkdir(mode=0o555)
        args = {"read-only cwd": [], "read-only cwd, sweep": ["-m", "seed=0,1"],
                "read-only cwd, optuna sweep": ["-m", "sweep=ppo_cartpole_optuna"]}[case]
    proc = subprocess.run([*prefix, sys.executable, "-m", "rltrain", *args, "trainer.total_frames=1024"], cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.splitlines()
    key = "hydra.sweep.dir" if "sweep" in case else "hydra.run.dir"
    which = "sweep" if "sweep" in case else "run"
    assert line.startswith(f"rltrain: cannot write the {which} dir (") and f"set another with {key}=PATH" in line
    assert ("Not a directory: a_file/run" if case == "under a file" else "Permission denied: 'outputs'") in line


def test_place_decides_the_run_dir_for_every_way_a_run_starts(tmp_path, monkeypatch):
    """Fresh (given, or a new outputs/DATE/TIME), resume=PATH (the checkpoint's own dir), a copied
    checkpoint file (a fresh dir), resume=auto (the newest run of the same config under outputs/)."""
    monkeypatch.chdir(tmp_path)
    config = {"seed": 0, "resume": None}
    given = place(None, config, tmp_path / "mine")
    assert (given.path, given.checkpoint, given.in_place) == (tmp_path / "mine", None, False)
    default = place(None, config)
    assert default.path.parent.parent == Path("outputs") and default.path.is_dir() and not default.in_place

    old_run = tmp_path / "outputs" / "2026-01-01" / "00-00-00"
    (old_run / "checkpoints").mkdir(parents=True)
    (old_run / "checkpoints" / "frames_64.pt").write_bytes(b"")
    (old_run / "checkpoints" / "config.json").write_text(json.dumps({**config, "resume": "x"}))
    for resume in (str(old_run), "auto"):
        resumed = place(resume, {**config, "resume": resume}, tmp_path / "ignored")
        assert (resumed.path, resumed.in_place) == (old_run.resolve(), True)
        assert resumed.checkpoint.name == "frames_64.pt"
    assert place("auto", {**config, "seed": 1}, tmp_path / "new").path == tmp_path / "new"  # no run of that config

    copied = tmp_path / "frames_64.pt"
    copied.write_bytes(b"")
    elsewhere = place(str(copied), config, tmp_path / "copy")
    assert (elsewhere.path, elsewhere.checkpoint, elsewhere.in_place) == (tmp_path / "copy", copied, False)
