"""rltrain's ``-m`` sweepers: Hydra's basic sweeper, checking every job's config before the first job
starts, and running every job even when some fail (each failed job then gets one line at the end);
and hydra-optuna-sweeper's Optuna sweeper with the same checks (of its first trials) and summary.

Without them, a bad value in the second job of ``-m algo.gamma=0.9,1.5`` is found only after the
first job has trained, and a job that fails stops the batches after it (an Optuna study ends in a
traceback). Each job's config is composed exactly as its launch will compose it. (A Hydra plugin
lives in the ``hydra_plugins`` namespace, where Hydra looks for plugins; rltrain itself, and Optuna,
are imported only when a sweep starts, so other Hydra apps' start-up does not pay for them, and
rltrain starts without hydra-optuna-sweeper installed.)
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from dataclasses import field, make_dataclass
from pathlib import Path
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict


class CheckedSweeper(BasicSweeper):
    """The basic sweeper (every combination of the swept values) with rltrain's config checks up front."""

    def sweep(self, arguments: list[str]) -> Any:
        overrides = OverridesParser.create(config_loader=self.hydra_context.config_loader).parse_overrides(
            [*self._parse_config(), *arguments])
        self.overrides = self.split_arguments(overrides, self.max_batch_size)
        _check_every_job(self.hydra_context, self.config, [job for batch in self.overrides for job in batch])
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        # As BasicSweeper.sweep, but a failed job does not stop the batches after it.
        returns: list[list[JobReturn]] = []
        failed: list[tuple[int, JobReturn]] = []
        first = 0  # the number of the batch's first job
        while not self.is_done():
            batch = self.get_job_batch()
            self.validate_batch_is_legal(batch)
            results = list(self.launcher.launch(batch, initial_job_idx=first))
            failed += [(first + i, r) for i, r in enumerate(results) if r.status == JobStatus.FAILED]
            returns.append(results)
            first += len(batch)
        if failed:
            _report_failed(failed, [r for batch in returns for r in batch])
        return returns


class CheckedOptunaSweeper(Sweeper):
    """hydra-optuna-sweeper's ``OptunaSweeper``, with its config and its study unchanged, as rltrain
    runs it: the configs of the first trials (the first batch of ``n_jobs``) are checked before they
    start, and each failed trial gets one line at the end, as a failed job of ``CheckedSweeper`` does,
    instead of the study ending in the traceback of the first one (which stays in its cli.log).

    Optuna marks a trial failed and goes on; a batch of ``n_jobs`` trials in which more than
    ``max_failure_rate`` failed ends the study (hydra-optuna-sweeper's rule, per batch: with
    ``n_jobs=1``, any value below 1.0 ends it at the first failed trial). The exit code is 1 when a
    trial failed, as for a failed job of any sweep."""

    def __init__(self, sampler: DictConfig, **optuna_config: Any) -> None:
        _quiet_optuna_set_up()
        from hydra.utils import instantiate
        from hydra_plugins.hydra_optuna_sweeper.optuna_sweeper import OptunaSweeper

        # The sampler's config is made here (_recursive_: false), once importing optuna is quieter.
        self.optuna = OptunaSweeper(sampler=instantiate(sampler), **optuna_config)
        self.trials: list[tuple[int, JobReturn]] = []  # (job number, return) of every trial launched

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        from rltrain.cli import check_writable

        check_writable(config, "hydra.sweep.dir")  # the study's set-up makes it
        self.optuna.setup(hydra_context=hydra_context, task_function=task_function, config=config)
        self.hydra_context, self.config = hydra_context, config
        study = self.optuna.sweeper  # hydra-optuna-sweeper's OptunaSweeperImpl: it launches every trial
        study.launcher = _CheckedLauncher(study.launcher, self)

    def sweep(self, arguments: list[str]) -> None:
        rate, batch = self.optuna.sweeper.max_failure_rate, self.optuna.sweeper.n_jobs
        try:
            self.optuna.sweep(arguments)
        except Exception as e:  # noqa: BLE001  (what the study ended with: see below)
            failed = self._failed()
            if any(_raised(ret) is e for _, ret in failed):  # re-raised by OptunaSweeperImpl: too many failed
                _report_failed(failed, [r for _, r in self.trials], (
                    f"the Optuna study stopped after {_count(self.trials, 'trial')}, {len(failed)} failed: in its "
                    f"last batch of {batch} (hydra.sweeper.n_jobs) more than hydra.sweeper.max_failure_rate={rate} "
                    f"failed (with 1.0 a study goes on past failed trials)"))
            if failed and len(failed) == len(self.trials) and isinstance(e, ValueError):  # study.best_trial
                _report_failed(failed, [r for _, r in self.trials],
                               f"all {len(self.trials)} trials of the Optuna study failed: it has no best trial")
            raise
        failed = self._failed()
        if failed:
            _report_failed(failed, [r for _, r in self.trials], (
                f"{len(failed)} of the Optuna study's {len(self.trials)} trials failed (the study ran to its end; "
                f"its best trial is in {Path(self.config.hydra.sweep.dir).resolve() / 'optimization_results.yaml'})"))

    def _failed(self) -> list[tuple[int, JobReturn]]:
        """The trials that Optuna counted as failed: the job failed, or returned something not a number."""
        return [(num, ret) for num, ret in self.trials if ret.status == JobStatus.FAILED or _not_a_number(ret)]


try:  # hydra/sweeper=checked_optuna: hydra/sweeper=optuna's config (the same keys and defaults), run as above
    from hydra_plugins.hydra_optuna_sweeper.config import OptunaSweeperConf
except ImportError:  # hydra-optuna-sweeper is not installed (pip install 'rltrain[sweep]')
    pass
else:  # (made by a call: Hydra's plugin scan runs this module before it is in sys.modules, as @dataclass needs)
    CheckedOptunaSweeperConf = make_dataclass("CheckedOptunaSweeperConf", [
        ("_target_", str, field(default="hydra_plugins.rltrain_sweeper.CheckedOptunaSweeper")),
        ("_recursive_", bool, field(default=False)),  # the sampler is made by CheckedOptunaSweeper
    ], bases=(OptunaSweeperConf,))
    ConfigStore.instance().store(group="hydra/sweeper", name="checked_optuna", node=CheckedOptunaSweeperConf,
                                 provider="rltrain")


class _CheckedLauncher:
    """The study's launcher, checking the configs of the first batch of trials before they start and
    recording every trial's return (hydra-optuna-sweeper keeps neither its trials nor their returns)."""

    def __init__(self, launcher: Any, sweeper: CheckedOptunaSweeper) -> None:
        self.launcher, self.sweeper = launcher, sweeper

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        if not self.sweeper.trials:  # a value every trial shares is refused before anything trains
            _check_every_job(self.sweeper.hydra_context, self.sweeper.config, [list(j) for j in job_overrides],
                             first=initial_job_idx)
        returns = self.launcher.launch(job_overrides, initial_job_idx=initial_job_idx)
        self.sweeper.trials += [(initial_job_idx + i, ret) for i, ret in enumerate(returns)]
        return returns


def _quiet_optuna_set_up() -> None:
    """Importing optuna (making the sampler does) imports alembic, for optuna's database storages, which
    logs a line per plugin it sets up ("setup plugin alembic.autogenerate.schemas", 7 of them) at INFO,
    which Hydra's logging shows; and when too many trials fail, hydra-optuna-sweeper logs every failure
    in one line, which rltrain's summary says better. Both are dropped where they are logged; the rest
    (the study's name, storage, sampler, each trial's launch and failure, the best trial) stays."""
    def not_a_plugin_set_up(record: logging.LogRecord) -> bool:
        return record.msg != "setup plugin %s"

    def not_the_failures_in_one_line(record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith("Failed [")
                    and " with max_failure_rate=" in record.msg)

    for name, keep in (("alembic.runtime.plugins", not_a_plugin_set_up),
                       ("hydra_plugins.hydra_optuna_sweeper._impl", not_the_failures_in_one_line)):
        logger = logging.getLogger(name)
        if not any(getattr(f, "__name__", None) == keep.__name__ for f in logger.filters):
            logger.addFilter(keep)


def _count(items: Sequence[Any], noun: str) -> str:
    return f"{len(items)} {noun}{'' if len(items) == 1 else 's'}"


def _raised(ret: JobReturn) -> BaseException | None:
    """What a failed job raised (None for a job that did not fail). Read from the JobReturn's field:
    its return_value property also prints "Error executing job with overrides: [...]" each time."""
    return ret._return_value if ret.status == JobStatus.FAILED else None


def _not_a_number(ret: JobReturn) -> bool:
    if ret.status != JobStatus.COMPLETED:
        return False
    try:
        float(ret.return_value)
    except (TypeError, ValueError):
        return True
    return False


def _check_every_job(hydra_context: HydraContext, config: DictConfig, jobs: list[list[str]], first: int = 0) -> None:
    """Compose and validate every job's config as its launch will; exit 2 naming the first bad one
    (``first``: the number of the first of ``jobs``, before which no job was started), or a sweep dir
    that cannot be written."""
    from rltrain.errors import ConfigError
    from rltrain.validate import check_resume_in_sweep, validate

    master = HydraConfig.instance().cfg
    try:
        for num, job in enumerate(jobs, start=first):
            cfg = hydra_context.config_loader.load_sweep_config(config, list(job))
            with open_dict(cfg):  # as the launcher sets them, for ${hydra:job.num} and the like
                cfg.hydra.job.num, cfg.hydra.job.id = num, f"job_id_for_{num}"
            HydraConfig.instance().set_config(cfg)
            task = cfg.copy()
            with open_dict(task):
                del task["hydra"]
            try:
                check_resume_in_sweep(task)
                validate(task)
            except ConfigError as e:
                print(f"rltrain: config error in sweep job {num} ({' '.join(job)}): {e}. No job was started",
                      file=sys.stderr)
                sys.exit(2)
    finally:
        HydraConfig.instance().cfg = master
    from rltrain.cli import check_writable

    check_writable(config, "hydra.sweep.dir")  # the basic sweeper makes it only now: a refused sweep leaves none


def _report_failed(failed: list[tuple[int, JobReturn]], everyone: list[JobReturn], heading: str | None = None) -> None:
    """One line per failed job (the overrides that set it apart, why, its run dir) under ``heading``
    (by default: the other jobs ran to their end), then exit 1 (each failure's traceback is in its
    job's cli.log)."""
    shared = set.intersection(*(set(r.overrides) for r in everyone))
    lines = []
    for num, ret in failed:
        error = _raised(ret)
        if error is not None:
            why = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        else:  # a trial whose job returned something an Optuna study cannot score
            why = f"its objective ({ret.cfg.get('objective')}) is {ret.return_value!r}, not a number"
        own = [o for o in ret.overrides if o not in shared] or list(ret.overrides)
        lines.append(f"  job {num} ({' '.join(own)}): {why}; its summary.json and cli.log are in "
                     f"{ret.hydra_cfg.hydra.runtime.output_dir}")
    heading = heading or f"{len(failed)} of {len(everyone)} sweep jobs failed (the others ran to their end)"
    print(f"rltrain: {heading}:\n" + "\n".join(lines), file=sys.stderr)
    sys.exit(1)
