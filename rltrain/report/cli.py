"""The command line of ``python -m rltrain.report``: the table to stdout, where the plot went to stderr
(so that ``--format json > report.json`` holds the table alone)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from rltrain.report.compare import FORMATS, group, table
from rltrain.report.curves import plot
from rltrain.report.runs import NoRunsError, expand, load_runs

NO_MATPLOTLIB = "rltrain.report: the plot needs matplotlib: pip install 'rltrain[report]'"


def main(argv: list[str] | None = None) -> int:
    """Print the report of the runs under the paths in ``argv``; 2 if a path holds no run."""
    parser = argparse.ArgumentParser(
        prog="python -m rltrain.report", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Compare runs: one row per configuration (the runs grouped by their config but for seed\n"
                    "and resume), the seeds' returns as mean ± sample std (ddof=1; none for a single seed), and\n"
                    "a PNG of the learning curves (mean over seeds in a min-max band). Runs still going are\n"
                    "read from their metrics.jsonl; failed runs are listed but not counted.",
        epilog="examples:\n"
               "  python -m rltrain.report outputs/multirun/2026-01-01/12-00-00\n"
               "  python -m rltrain.report 'outputs/multirun/2026-01-*' --format csv --no-plot > runs.csv")
    parser.add_argument("paths", nargs="+", metavar="PATH", help="run dirs, dirs that hold runs, or glob patterns")
    parser.add_argument("--format", choices=FORMATS, default="markdown", help="the table's format (default: markdown)")
    parser.add_argument("--out", metavar="FILE.png",
                        help="the plot's file (.png is added to a name without it), or a dir to write report.png in "
                             "(default: report.png in PATH, or in the common parent of the PATHs)")
    parser.add_argument("--no-plot", action="store_true", help="the table only")
    parser.add_argument("--title", help="the plot's title")
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(name)s: %(message)s")  # a file the report cannot read: "rltrain.report: FILE: why"
    try:
        groups = group(load_runs(args.paths))
    except NoRunsError as e:
        print(f"rltrain.report: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(table(groups, args.format))
    sys.stdout.flush()  # the table before the line about the plot (stderr), in a terminal or a log
    if not args.no_plot:
        try:
            written = plot(groups, args.out or default_plot_path(args.paths), args.title)
        except ModuleNotFoundError as e:
            if not (e.name or "").startswith("matplotlib"):
                raise
            print(NO_MATPLOTLIB, file=sys.stderr)
        except OSError as e:  # a dir we may not write in
            print(f"rltrain.report: the plot cannot be written: {e}", file=sys.stderr)
            return 1
        else:
            print(f"rltrain.report: plot written to {written}", file=sys.stderr)
    return 0


def default_plot_path(paths: list[str]) -> Path:
    """``report.png`` in the one dir given, else in the deepest dir that holds all the paths."""
    matches = [match for path in paths for match in expand(path)]
    if len(matches) == 1 and os.path.isdir(matches[0]):
        return Path(matches[0]) / "report.png"
    parent = os.path.commonpath([os.path.abspath(match) for match in matches])
    return Path(parent if os.path.isdir(parent) else os.path.dirname(parent)) / "report.png"
