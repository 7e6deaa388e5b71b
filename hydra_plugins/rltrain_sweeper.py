"""rltrain's ``-m`` sweeper: Hydra's basic sweeper, checking every job's config before the first job
starts, and running every job even when some fail (each failed job then gets one line at the end).

Without it, a bad value in the second job of ``-m algo.gamma=0.9,1.5`` is found only after the
first job has trained, and a job that fails stops the batches after it. Each job's config is
composed exactly as its launch will compose it. (A Hydra plugin lives in the ``hydra_plugins``
namespace, where Hydra looks for plugins; rltrain itself is imported only when a sweep starts, so
other Hydra apps' start-up does not pay for it.)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf, open_dict


class CheckedSweeper(BasicSweeper):
    """The basic sweeper (every combination of the swept values) with rltrain's config checks up front."""

    def sweep(self, arguments: list[str]) -> Any:
        overrides = OverridesParser.create(config_loader=self.hydra_context.config_loader).parse_overrides(
            [*self._parse_config(), *arguments])
        self.overrides = self.split_arguments(overrides, self.max_batch_size)
        self._check_every_job([job for batch in self.overrides for job in batch])
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

    def _check_every_job(self, jobs: list[list[str]]) -> None:
        """Compose and validate every job's config as its launch will; exit 2 naming the first bad one."""
        from rltrain.errors import ConfigError
        from rltrain.validate import check_resume_in_sweep, validate

        master = HydraConfig.instance().cfg
        try:
            for num, job in enumerate(jobs):
                cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(job))
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


def _report_failed(failed: list[tuple[int, JobReturn]], everyone: list[JobReturn]) -> None:
    """One line per failed job (the overrides that set it apart, why, its run dir), then exit 1: the
    other jobs ran to their end (each failure's traceback is in its job's cli.log)."""
    shared = set.intersection(*(set(r.overrides) for r in everyone))
    lines = []
    for num, ret in failed:
        try:
            ret.return_value
        except BaseException as e:  # noqa: BLE001  (what the job raised)
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        own = [o for o in ret.overrides if o not in shared] or list(ret.overrides)
        lines.append(f"  job {num} ({' '.join(own)}): {why}; its summary.json and cli.log are in "
                     f"{ret.hydra_cfg.hydra.runtime.output_dir}")
    print(f"rltrain: {len(failed)} of {len(everyone)} sweep jobs failed (the others ran to their end):\n"
          + "\n".join(lines), file=sys.stderr)
    sys.exit(1)
