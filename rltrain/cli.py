"""The Hydra app behind ``python -m rltrain [overrides]`` (see --help).

Exit codes: 0 the run completed (or had nothing left to do); 1 it failed while starting or
training (the message, ``summary.json`` and the traceback in ``cli.log`` say why); 2 it was
refused before anything started (a config error, a checkpoint that cannot be resumed, a run dir
that belongs to another run); 128 + N when signal N stopped it (130: Ctrl-C, 143: SIGTERM).
"""

# ruff: noqa: E402  (rltrain's own modules are imported after lazy_dynamo.install())

from __future__ import annotations

import importlib.util
import logging
import os
import re
import signal
import sys
import tempfile
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from rltrain import lazy_dynamo

# The CLI owns its process (a torchrun job's collector ranks run it too): torch._dynamo stays
# unimported until something compiles, a second less before the first batch. Installed before the
# imports below, which bring in torch and tensordict (Hydra and OmegaConf do not).
lazy_dynamo.install()

from rltrain import checkpoint, process_groups, stop_signals
from rltrain.errors import CheckpointError, ConfigError, NonFiniteError, RunDirError, RunError
from rltrain.factory import RefusedByLearner, build, learner_ranks, serve_rank
from rltrain.help import config_help
from rltrain.run_dir import abandon_hydra_dir, log_file, record_invocation, unique_dir
from rltrain.trainer import result_line
from rltrain.validate import check_resume_in_sweep, moved_key

EXIT_FAILED, EXIT_REFUSED = 1, 2
_REFUSED = (ConfigError, CheckpointError, RunDirError)

# The default run and sweep dirs (config.yaml) claim a dir of their own, even within one second;
# --help shows every key with its comment (hydra.help.template in config.yaml).
OmegaConf.register_new_resolver("rltrain.unique_dir", unique_dir, use_cache=True, replace=True)
OmegaConf.register_new_resolver("rltrain.config_help", config_help, replace=True)
OmegaConf.register_new_resolver("rltrain.log_file", log_file, use_cache=True, replace=True)

_RENAMED = {"collector=sync": "collector=lockstep (lock-step worker processes; sync= chooses how weights travel)"}
# Hydra plugins a user may ask for by name, and the package that provides each.
_PLUGINS = {
    "launcher": {"joblib": "hydra-joblib-launcher", "submitit_local": "hydra-submitit-launcher",
                 "submitit_slurm": "hydra-submitit-launcher", "ray": "hydra-ray-launcher", "rq": "hydra-rq-launcher"},
    "sweeper": {"optuna": "hydra-optuna-sweeper", "checked_optuna": "hydra-optuna-sweeper",
                "ax": "hydra-ax-sweeper", "nevergrad": "hydra-nevergrad-sweeper"},
}
_SWEEP_EXTRA = {"hydra-optuna-sweeper", "hydra-joblib-launcher", "hydra-submitit-launcher"}  # rltrain[sweep]


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def run(cfg: DictConfig) -> float | None:
    """Train one run; returns its ``objective`` (the final evaluation return unless the config says
    otherwise), what an optimizing sweeper such as Optuna maximizes."""
    world = process_groups.current()
    main = world is None or world.rank == 0
    if not main and not learner_ranks(cfg):
        return _collect_on_rank(cfg, world)
    with stop_signals.at_once() as seen:
        try:
            if _sweeping():
                check_resume_in_sweep(cfg)
            trainer = build(cfg)  # locks the run dir before anything is written there
        except RefusedByLearner as e:  # a learner rank: rank 0 has said why
            return _exit(EXIT_REFUSED, str(e))
        except _REFUSED as e:
            if main:  # (rank 0's dir: the other learner ranks of a job leave it to rank 0)
                abandon_hydra_dir()
            return _refuse(e)
        except KeyboardInterrupt:
            return _stopped(seen.signum, f"stopped by {seen.signum.name} while starting; nothing was trained")
        except Exception as e:  # noqa: BLE001  (an env raising on reset, a worker dying at start-up)
            return _failed(e, "while starting")
        run_dir = trainer.state.run_dir
        if main:
            record_invocation(cfg, run_dir)
        try:
            summary = trainer.fit()
        except KeyboardInterrupt:
            signum = trainer.state.stop_signal or signal.SIGINT
            return _stopped(signum, f"stopped at once by {signal.Signals(signum).name}; summary written to "
                                    f"{run_dir / 'summary.json'}")
        except Exception as e:  # noqa: BLE001
            # A learner that went NaN/inf was not checkpointed as it failed (its message says what to change).
            frames = trainer.state.frames
            kept = "" if isinstance(e, NonFiniteError) else _resume_hint(run_dir, frames, world is not None)
            return _failed(e, f"after {trainer.state.frames:,} frames", kept)
    logging.getLogger("rltrain").info(result_line(summary))
    if summary["status"] == "interrupted":
        signum = signal.Signals(trainer.state.stop_signal or signal.SIGINT)
        if not main:  # another learner rank: the checkpoint is rank 0's to write and to tell (it may not be there yet)
            return _exit(128 + signum, f"learner rank {world.rank} stopped by {signum.name}; rank 0 says whether "
                                       "and where it checkpointed the job")
        hint = _resume_hint(run_dir, summary["frames"], world is not None)
        where = (f"{hint} and summary.json" if hint else
                 f"summary.json in {run_dir}; no checkpoint (hooks.checkpoint is off), so it cannot be resumed")
        return _exit(128 + signum, f"stopped by {signum.name}; {where}")
    return summary[cfg.get("objective", "eval_return")]


def _resume_hint(run_dir: Path, frames: int, torchrun: bool) -> str:
    """How to continue the run from its checkpoint at ``frames``, if it wrote one; else ""."""
    last = checkpoint.path_for(run_dir, frames)
    if not any(p.name == last.name for p in checkpoint.listing(run_dir)):
        return ""
    command = "the same torchrun command" if torchrun else "python -m rltrain"
    return (f"checkpoint {last.name} in {run_dir}. Continue with: {command} resume={run_dir} "
            "(plus the same overrides)")


def _collect_on_rank(cfg: DictConfig, world: process_groups.World) -> None:
    """A collector rank: collect for rank 0 until it stops; failures go to rank 0 (which shows
    them), to this rank's log (ranks/<rank>.log) and to the exit code. The process then leaves
    without the interpreter's teardown (``process_groups.exit_without_teardown``)."""
    code = 0
    with stop_signals.at_once() as seen:
        try:
            serve_rank(cfg)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else EXIT_FAILED
        except BaseException as e:  # noqa: BLE001
            code = _rank_failure(e, world, seen)
    process_groups.exit_without_teardown(code)


def _rank_failure(e: BaseException, world: process_groups.World, seen) -> int:
    """Report a collector rank's failure as the CLI does for the learner; returns the exit code."""
    try:
        if isinstance(e, _REFUSED):
            _refuse(e)
        elif isinstance(e, RefusedByLearner):
            _exit(EXIT_REFUSED, str(e))
        elif isinstance(e, KeyboardInterrupt):
            _stopped(seen.signum, f"collector rank {world.rank} stopped by {seen.signum.name}")
        else:
            _failed(e, f"on collector rank {world.rank}")
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else EXIT_FAILED
    return EXIT_FAILED


def _refuse(e: Exception) -> None:
    if _full_error():
        raise e
    what = {ConfigError: "config error", CheckpointError: "cannot resume", RunDirError: "run dir taken"}
    return _exit(EXIT_REFUSED, f"{next(v for k, v in what.items() if isinstance(e, k))}: {e}", e)


def _failed(e: Exception, when: str, resume_hint: str = "") -> None:
    """One paragraph on the terminal: what failed and the fix (and how to continue, where the run was
    checkpointed as it failed); the full traceback goes to cli.log."""
    details = e.details if isinstance(e, RunError) else None
    text = "".join(traceback.format_exception(e)) + (f"\n{details}" if details else "")
    logs = _write_to_log_files(f"the run failed {when}:\n{text}")
    if _full_error():
        if details:
            print(details, file=sys.stderr)
        raise e
    where = f"The full traceback is in {logs[0]}" if logs else "No log file holds the traceback"
    kept = f"\nThe learner was kept: {resume_hint}, once the cause is fixed." if resume_hint else ""
    return _exit(EXIT_FAILED, f"the run failed {when}: {type(e).__name__}: {e}{kept}\n"
                              f"{where} (HYDRA_FULL_ERROR=1 prints it here).", e)


def _stopped(signum: int, message: str) -> None:
    return _exit(128 + signum, message, KeyboardInterrupt())


def _exit(code: int, message: str, error: BaseException | None = None) -> None:
    """Print ``rltrain: <message>`` and exit with ``code``. In a sweep, raise instead, so that
    Hydra records this job as failed and the sweep's other jobs still run."""
    print(f"rltrain: {message}", file=sys.stderr)
    if error is not None and _sweeping():
        raise error
    sys.exit(code)


def _sweeping() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _full_error() -> bool:
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def _write_to_log_files(text: str) -> list[str]:
    """Write ``text`` to the log files only (the terminal gets one paragraph); returns their paths."""
    record = logging.LogRecord("rltrain", logging.ERROR, __file__, 0, text, None, None)
    paths = []
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and handler.baseFilename != os.devnull:
            handler.handle(record)
            paths.append(handler.baseFilename)
    return paths


class RunDirCheck(Callback):
    """Before Hydra makes the run dir, check that it can be written (rltrain's sweepers check the
    sweep dir once every job's config passed: ``check_writable``)."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        check_writable(config, "hydra.run.dir")


def check_writable(config: DictConfig, key: str) -> None:
    """Make the dir at ``key`` and check that a file can be written in it: else one line naming it
    and exit code 2, instead of Hydra's traceback from its ``mkdir`` or its log file."""
    try:
        folder = Path(str(OmegaConf.select(config, key)))  # the default dir's resolver makes it
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        _unwritable(key, f"{e.strerror}: {e.filename}" if e.strerror else str(e))
    except InterpolationResolutionError as e:  # the default dir's resolver could not make it
        _unwritable(key, re.sub(r"^\w+ raised while resolving interpolation: ", "", str(e).splitlines()[0]))


def _unwritable(key: str, what: str) -> None:
    which = "sweep" if key == "hydra.sweep.dir" else "run"
    print(f"rltrain: cannot write the {which} dir ({what}); set another with {key}=PATH, or run from a dir you can "
          "write", file=sys.stderr)
    sys.exit(EXIT_REFUSED)


def check_command_line(args: list[str]) -> None:
    """Exit with one line for what Hydra would answer with a list of options: a choice that was
    renamed, or a Hydra launcher or sweeper that is not installed (naming its ``pip install``)."""
    for arg in args:
        if arg in _RENAMED:
            print(f"rltrain: {arg} is now {_RENAMED[arg]}", file=sys.stderr)
            sys.exit(EXIT_REFUSED)
        key = re.fullmatch(r"[+~]*([\w.]+)(=.*)?", arg)
        if key and "." in key.group(1) and (moved := moved_key(key.group(1))):  # Hydra would say "not in struct"
            print(f"rltrain: {key.group(1)} {moved}", file=sys.stderr)
            sys.exit(EXIT_REFUSED)
        m = re.fullmatch(r"[+~]*hydra/(launcher|sweeper)=(\w+)", arg)
        package = m and _PLUGINS[m.group(1)].get(m.group(2))
        if package and importlib.util.find_spec(f"hydra_plugins.{package.replace('-', '_')}") is None:
            extra = " (or pip install 'rltrain[sweep]')" if package in _SWEEP_EXTRA else ""
            print(f"rltrain: {arg} needs the Hydra plugin {package}, which is not installed: "
                  f"pip install {package}{extra}", file=sys.stderr)
            sys.exit(EXIT_REFUSED)


def main() -> None:
    check_command_line(sys.argv[1:])
    try:
        world = process_groups.current()  # under torchrun: reach the job's store before Hydra makes the run dir
    except (ConfigError, ConnectionError) as e:
        print(f"rltrain: {e}", file=sys.stderr)
        sys.exit(EXIT_REFUSED)
    if world is not None and any(a in ("-m", "--multirun") for a in sys.argv[1:]):
        print("rltrain: a sweep (-m) cannot run inside a torchrun job; start one torchrun job per configuration",
              file=sys.stderr)
        sys.exit(EXIT_REFUSED)
    if world is None:
        run()
        return
    # A rank of a torchrun job ends without the interpreter's teardown, its run closed by then: gloo's worker
    # thread may still be releasing the last collective's tensors, which takes the GIL, and a thread taking it
    # during finalization aborts the process ("terminate called without an active exception").
    code = 0
    try:
        run()
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else EXIT_FAILED
    except BaseException:  # noqa: BLE001  (HYDRA_FULL_ERROR=1 raises the run's error: shown as Python would)
        traceback.print_exc()
        code = 128 + signal.SIGINT if isinstance(sys.exc_info()[1], KeyboardInterrupt) else EXIT_FAILED
    process_groups.exit_without_teardown(code)
