"""The learning-curve PNG of a report: eval and training return against frames, one line per
configuration (the mean over its seeds, in a min-max band). Needs matplotlib (``rltrain[report]``)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from rltrain.report.compare import NUMBERED_ABOVE, Group

PANELS = (("eval", "eval return"), ("train", "training return"))  # Run.curves key, panel title
STYLE = {"font.size": 10, "axes.titlesize": 11, "legend.fontsize": 8.5, "axes.spines.top": False,
         "axes.spines.right": False}
PANEL_SIZE = (5.5, 3.3)  # inches per panel, whatever the legend below them holds
WRAP_AT = 70  # legend labels longer than this many characters go on more lines
# For the legend's size: DejaVu Sans at legend.fontsize averages ~5.1 pt a character; a handle and its gaps
# take ~30 pt across; a line of text is ~10.2 pt high and entries have ~4.3 pt between them.
CHAR_PT, HANDLE_PT, LINE_PT, ENTRY_GAP_PT = 5.1, 30.0, 10.2, 4.3


def plot(groups: list[Group], out: str | Path, title: str | None = None) -> Path:
    """Write the learning curves of ``groups`` to the PNG ``out`` (``report.png`` in it if it is a dir; ``.png`` added
    to a name without it) and return the path written; raises ModuleNotFoundError without matplotlib.
    A row of panels (eval, training return) per env, as returns of different envs share no scale, and one legend
    below them all: the labels, or #1..#N (the markdown table's # column) for more than NUMBERED_ABOVE groups.
    Each seed is interpolated onto the frames any seed logged and counts only within the frames it reached."""
    # The Agg canvas of a bare Figure, not pyplot: no display needed, and the caller's backend stays as it was.
    import matplotlib
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import EngFormatter

    out = Path(out)
    if out.is_dir():
        out = out / "report.png"
    elif out.suffix.lower() != ".png":  # matplotlib would add .png to a bare name, and refuse an unknown suffix
        out = out.with_name(out.name + ".png")
    out.parent.mkdir(parents=True, exist_ok=True)
    by_env: dict[str, list[int]] = {}  # env id ("" where unknown): the indices of its groups
    for i, g in enumerate(groups):
        by_env.setdefault(str(g.runs[0].config.get("env.id", "")), []).append(i)
    numbered = len(groups) > NUMBERED_ABOVE
    labels = [f"#{i}" if numbered else textwrap.fill(g.label, WRAP_AT) for i, g in enumerate(groups, 1)]
    colors = [matplotlib.colormaps["tab20"](i % 20) if len(groups) > 10 else f"C{i}" for i in range(len(groups))]
    plotted = [i for i, g in enumerate(groups) if any(run.curves.get(c, ([], []))[0] for run in g.counted
                                                       for c, _ in PANELS)]
    ncol, legend_height = _legend_shape([labels[i] for i in plotted])
    width, height = PANEL_SIZE[0] * len(PANELS), PANEL_SIZE[1] * len(by_env) + legend_height + 0.4 * bool(title)
    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=(width, height), dpi=120, layout="constrained")
        FigureCanvasAgg(fig)
        axes = fig.subplots(len(by_env), len(PANELS), squeeze=False)
        for row, (env_id, members) in zip(axes, sorted(by_env.items())):
            last_frame = max([run.frames or 0 for i in members for run in groups[i].counted]
                             + [frames[-1] for i in members for run in groups[i].counted
                                for frames, _ in run.curves.values() if frames], default=0)
            for ax, (curve, name) in zip(row, PANELS):
                for i in members:
                    _draw(ax, np, groups[i], curve, colors[i], labels[i], f"#{i + 1}" if numbered else None)
                ax.set_title(f"{name} ({env_id})" if env_id else name)
                ax.set(xlabel="frames", ylabel="return")
                # From 0, as a run starts there (its first row is logged a batch later); a little past the last
                # frame, so that a marker there shows whole.
                ax.set_xlim(0, last_frame * 1.03 or 1)
                ax.xaxis.set_major_formatter(EngFormatter(sep=""))  # 500k, 1M
                ax.grid(alpha=0.3)
        if plotted:  # one legend: a configuration has the same color in every panel
            handles = [matplotlib.lines.Line2D([], [], color=colors[i], lw=1.8) for i in plotted]
            fig.legend(handles, [labels[i] for i in plotted], loc="outside lower center", ncol=ncol, frameon=False)
        if title:
            fig.suptitle(title, fontsize=12)
        fig.savefig(out, format="png")
    return out


def _draw(ax: Any, np: Any, g: Group, curve: str, color: Any, label: str, tag: str | None) -> None:
    """The mean over ``g``'s seeds of one curve, in their min-max band; ``tag`` (#N) at its end, if given."""
    seeds = [run.curves[curve] for run in g.counted if run.curves.get(curve, ([], []))[0]]
    if not seeds:
        return
    grid = np.unique(np.concatenate([frames for frames, _ in seeds]))
    values = np.full((len(seeds), len(grid)), np.nan)
    for row, (frames, returns) in zip(values, seeds):
        inside = (grid >= frames[0]) & (grid <= frames[-1])  # no extrapolation past a seed's end
        row[inside] = np.interp(grid[inside], frames, returns)
    mean, every_seed = np.nanmean(values, axis=0), ~np.isnan(values).any(axis=0)
    marker = "o" if len(grid) < 5 else None  # a lone point (eval at the end only) stays visible
    # Solid where every seed has data; dashed where some have stopped (solved early) or not got there
    # yet (still running), as a mean over fewer seeds is not the same curve.
    ax.plot(grid, mean, color=color, lw=1.2, ls="--", marker=marker, ms=4)
    ax.plot(grid[every_seed], mean[every_seed], color=color, lw=1.8, label=label, marker=marker, ms=4)
    low, high = np.nanmin(values, axis=0), np.nanmax(values, axis=0)
    if len(grid) > 1:
        ax.fill_between(grid, low, high, color=color, alpha=0.2, lw=0)
    else:
        ax.vlines(grid, low, high, color=color, alpha=0.5, lw=3)
    if tag:  # with many lines, colors repeat: the number at the end tells them apart
        ax.annotate(tag, (grid[-1], mean[-1]), xytext=(3, 0), textcoords="offset points", color=color,
                    fontsize=7, va="center")


def _legend_shape(labels: list[str]) -> tuple[int, float]:
    """The legend's columns (as many as fit the figure's width) and its height in inches."""
    if not labels:
        return 1, 0.0
    widest = max(len(line) for label in labels for line in label.splitlines())
    ncol = max(1, min(len(labels), int(PANEL_SIZE[0] * len(PANELS) * 72 // (widest * CHAR_PT + HANDLE_PT))))
    lines = max(label.count("\n") + 1 for label in labels)
    rows = -(-len(labels) // ncol)
    return ncol, (rows * (lines * LINE_PT + ENTRY_GAP_PT) + 2 * LINE_PT) / 72
