"""The check's memory timeline plots, drawn with matplotlib (the optional
`report` extra).

Theory of operation
-------------------
matplotlib is imported inside the function that draws, with the Agg backend
(no display), so extkv imports and reports render without it
(extkv.runs.plots.matplotlib_missing says why plots are skipped, and the
report prints that instead of images).

The memory timeline plot shows, for one device, the physical memory read
outside extkv over time (the background samples and the readings at every
operation's start and end) and the cache's own `physical_bytes` at those
marks; each operation is a shaded span labelled with its name. Every plot
is saved through extkv.runs.rundir.save_figure, never through an entry
planted at its name in the run directory. A report asks for it through
`timeline_plot`, which draws it only where the timeline or this module
changed since the PNG there was drawn (extkv.runs.plots.draw_unless_current).
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from functools import partial
from pathlib import Path

from ..runs.plots import draw_unless_current
from ..runs.rundir import save_figure
from ..testing.timeline import Timeline

#: Units the byte axis may use: the largest whose value stays >= 1 at the peak.
_UNITS = [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"), (1, "bytes")]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    return pyplot


def plot_timeline(timeline: Timeline, path: Path) -> Path:
    """Draw `timeline` into the PNG `path`; returns `path`."""
    pyplot = _pyplot()
    peak = max([1] + [reading for _, reading in timeline.samples] + [m.physical_bytes_end for m in timeline.marks])
    scale, unit = next((scale, unit) for scale, unit in _UNITS if peak >= scale)
    figure, axes = pyplot.subplots(figsize=(12, 5.5), dpi=100)
    times = [seconds * 1e3 for seconds, _ in timeline.samples]
    axes.plot(
        times,
        [reading / scale for _, reading in timeline.samples],
        drawstyle="steps-post",
        color="tab:blue",
        linewidth=1.2,
        label=f"measured outside extkv ({timeline.source})",
    )
    mark_times = [t for mark in timeline.marks for t in (mark.start_s * 1e3, mark.end_s * 1e3)]
    booked = [b / scale for mark in timeline.marks for b in (mark.physical_bytes_start, mark.physical_bytes_end)]
    axes.plot(mark_times, booked, "o", color="tab:orange", markersize=4, label="cache.physical_bytes at each mark")
    # The data keep the lower part; the operations' names stand above them.
    top = peak / scale * 1.75
    for number, mark in enumerate(timeline.marks):
        start, end = mark.start_s * 1e3, mark.end_s * 1e3
        axes.axvspan(start, end, color="tab:gray", alpha=0.12 if number % 2 else 0.22, linewidth=0)
        axes.text(
            (start + end) / 2,
            top * 0.98,
            mark.operation,
            rotation=90,
            fontsize=7,
            ha="center",
            va="top",
        )
    axes.set_ylim(0, top)
    axes.set_xlabel("time since the first operation (ms)")
    axes.set_ylabel(f"physical memory over the starting reading ({unit})")
    geometry = timeline.geometry
    axes.set_title(
        f"KV cache memory timeline on {timeline.device}: {geometry['layers']} layers x "
        f"{geometry['capacity_blocks']} blocks, {geometry['layout']}",
        fontsize=10,
    )
    axes.legend(loc="center left", fontsize=8)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    save_figure(figure, path)
    pyplot.close(figure)
    return path


def timeline_plot(timeline: Timeline, path: Path) -> str | None:
    """Make the PNG `path` the plot of `timeline`, drawing it only where it
    changed; None where it is, else why it could not be drawn."""
    return draw_unless_current(path, asdict(timeline), (sys.modules[__name__],), partial(plot_timeline, timeline))
