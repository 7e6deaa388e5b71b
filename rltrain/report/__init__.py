"""Compare runs (run dirs, sweep dirs, globs): a table with one row per configuration and its seeds
aggregated, and a PNG of the learning curves. ``python -m rltrain.report PATH...``, or from Python:

    groups = group(load_runs(["outputs/multirun/2026-01-01/12-00-00"]))
    print(table(groups, "markdown"))
    plot(groups, "report.png")
"""

from rltrain.report.compare import Group, group, table
from rltrain.report.curves import plot
from rltrain.report.runs import NoRunsError, Run, load_runs

__all__ = ["Group", "NoRunsError", "Run", "group", "load_runs", "plot", "table"]
