"""rltrain's ``-m`` sweeper: Hydra's basic sweeper, checking every job's config before the first job starts.

Without it, a bad value in the second job of ``-m algo.gamma=0.9,1.5`` is found only after the
first job has trained. Each job's config is composed exactly as its launch will compose it. (A
Hydra plugin lives in the ``hydra_plugins`` namespace, where Hydra looks for plugins; rltrain
itself is imported only when a sweep starts, so other Hydra apps' start-up does not pay for it.)
"""

from __future__ import annotations

import sys
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import open_dict


class CheckedSweeper(BasicSweeper):
    """The basic sweeper (every combination of the swept values) with rltrain's config checks up front."""

    def sweep(self, arguments: list[str]) -> Any:
        from rltrain.errors import ConfigError
        from rltrain.validate import check_resume_in_sweep, validate

        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        overrides = parser.parse_overrides([*self._parse_config(), *arguments])
        jobs = [job for batch in self.split_arguments(overrides, None) for job in batch]
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
        return super().sweep(arguments)
