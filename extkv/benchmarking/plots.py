"""The bench section's plots: cost against bytes and against segments.

Theory of operation
-------------------
Two PNGs, saved into the run directory through
extkv.runs.rundir.save_figure: time against bytes (one segment) and
against segments (a fixed total), per operation, extkv against its floors,
log-log, wall time and host CPU time in separate panels, each point the
least round of a case. matplotlib is optional (`[report]`): without it
`plot` says the plots were skipped and why. A figure is drawn only where
its points or the code that draws them (this module and the size labels of
extkv.benchmarking.sizes) changed since its PNG was drawn
(extkv.runs.plots.draw_unless_current).
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

from ..runs.plots import draw_unless_current
from ..runs.rundir import save_figure
from . import sizes
from .results import BenchRun
from .sizes import size_label

#: Operations drawn against bytes and against segments, and the contenders drawn.
PLOTTED_BY_BYTES = ("commit", "grow8", "release")
PLOTTED_BY_SEGMENTS = ("commit", "grow8", "release", "recommit", "defrag_preserve")
PLOTTED_CONTENDERS = ("extkv", "raw", "memset", "copy")
SEGMENT_SERIES = ("blhnc1", "lbhnc32", "lhbnc256", "lhbnc1024")


def _series_points(run: BenchRun, op: str, by: str) -> tuple[dict[str, list[tuple[float, float, float]]], str]:
    """contender -> [(x, wall min, cpu min)] for one plot panel, and the x label."""
    if by == "bytes":
        cases = [c for c in run.cases if c.facts["op"] == op and c.facts["geometry"] == "blhnc1"
                 and c.facts["state"] == "recycled"]
        x_of, label = (lambda c: c.facts["bytes"]), "bytes committed (1 segment)"
    else:
        headline = run.facts.get("headline_bytes")
        cases = [c for c in run.cases if c.facts["op"] == op and c.facts["geometry"] in SEGMENT_SERIES
                 and c.facts["state"] == "recycled" and c.facts["bytes"] == headline]
        x_of, label = (lambda c: c.facts["segments"]), f"segments ({size_label(headline or 0)} in all)"
    points: dict[str, list[tuple[float, float, float]]] = {}
    for case in sorted(cases, key=x_of):
        for name in PLOTTED_CONTENDERS:
            entry = case.entries.get(name)
            if entry is not None:
                points.setdefault(name, []).append((x_of(case), min(entry.wall), min(entry.cpu)))
    return points, label


def plot(run: BenchRun, run_dir: Path) -> tuple[list[Path], str]:
    """Make the scaling PNGs the plots of `run`, drawing each only where its
    points or its code changed (extkv.runs.plots.draw_unless_current):
    (the PNGs that are its plots now, why a plot is not there, or "")."""
    written, why_not = [], ""
    for by, ops in (("bytes", PLOTTED_BY_BYTES), ("segments", PLOTTED_BY_SEGMENTS)):
        panels = [(op, *_series_points(run, op, by)) for op in ops]
        panels = [panel for panel in panels if any(len(series) > 1 for series in panel[1].values())]
        if not panels:
            continue
        title = f"extkv bench, {run.facts['profile']} profile, {run.facts['device']}: cost against {by}"
        path = Path(run_dir) / f"bench_scaling_{by}.png"
        missing = draw_unless_current(
            path, {"by": by, "panels": panels, "title": title}, (sys.modules[__name__], sizes),
            partial(_draw, panels, by, title),
        )
        if missing is None:
            written.append(path)
        else:
            why_not = f"plots skipped: {missing}"
    if not written and not why_not:
        why_not = "plots skipped: no series with two or more sizes was measured"
    return written, why_not


def _draw(panels: list, by: str, title: str, path: Path) -> None:
    """Draw one scaling figure, a row of wall and CPU time per panel, into the PNG `path`."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot, ticker

    styles = {"extkv": "o-", "raw": "s--", "memset": "^:", "copy": "v:"}
    figure, axes = pyplot.subplots(len(panels), 2, figsize=(11, 3.2 * len(panels)), squeeze=False)
    for row, (op, points, label) in enumerate(panels):
        for column, (index, what) in enumerate(((1, "wall time"), (2, "host CPU time"))):
            axis = axes[row][column]
            for name, series in points.items():
                axis.plot([p[0] for p in series], [p[index] for p in series], styles.get(name, "o-"), label=name)
            axis.set_xscale("log", base=2)
            axis.set_yscale("log")
            xs = sorted({p[0] for series in points.values() for p in series})
            # Slanted: 16, 32 and 64 GiB sit close on a log axis, and level labels run together.
            axis.set_xticks(xs, [size_label(x) if by == "bytes" else str(x) for x in xs], rotation=30, ha="right")
            axis.xaxis.set_minor_locator(ticker.NullLocator())
            axis.set_xlabel(label)
            axis.set_ylabel("seconds (min over rounds)")
            axis.set_title(f"{op}: {what}")
            axis.grid(True, which="both", alpha=0.3)
            axis.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout(rect=(0, 0, 1, 0.98))
    save_figure(figure, path, dpi=90)
    pyplot.close(figure)
