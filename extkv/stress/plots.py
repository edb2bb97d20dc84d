"""The stress report's memory plots, drawn with matplotlib (the optional
`report` extra).

Theory of operation
-------------------
A stress run's timeline (one per worker) samples, per device, this
process's extkv memory read by the usage probe and the device's used
memory. `plot_memory` draws one worker's device on two axes, since a
stressed cache is megabytes beside a device of gigabytes; matplotlib is
imported inside it, with the Agg backend. The report asks for a plot
through `memory_plot`, which draws it only where the timeline or this
module changed since the PNG there was drawn
(extkv.runs.plots.draw_unless_current), so this module holds the drawing
code alone: an edit of the report's text redraws nothing.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

from ..runs.plots import draw_unless_current
from ..runs.rundir import save_figure

#: Units the byte axes may use: the largest whose value stays >= 1 at the peak.
_UNITS = [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"), (1, "bytes")]


def timeline_series(timeline: dict) -> dict[str, list[tuple[float, int, int]]]:
    series: dict[str, list[tuple[float, int, int]]] = {}
    for seconds, device, process_bytes, device_used in timeline["samples"]:
        series.setdefault(device, []).append((seconds, process_bytes, device_used))
    return series


def where(timeline: dict, device: str) -> str:
    pinned = timeline.get("pinned_gpu")
    name = timeline.get("devices", {}).get(device, {}).get("device", device)
    return f"{name} (GPU {pinned}, worker {timeline['worker']})" if pinned and device != "cpu" else f"{name} (worker {timeline['worker']})"


def _scale(peak: int) -> tuple[int, str]:
    return next((scale, unit) for scale, unit in _UNITS if max(peak, 1) >= scale)


def plot_memory(timeline: dict, device: str, path: Path) -> Path:
    """This process's extkv memory (usage probe, left axis) and the device's
    used memory (right axis) over the run, for one worker and device, into
    the PNG `path`. Two axes: a stressed cache is megabytes beside a device
    of gigabytes."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    samples = timeline_series(timeline)[device]
    times = [seconds for seconds, _, _ in samples]
    figure, axes = pyplot.subplots(figsize=(12, 4.5), dpi=100)
    used_axes = axes.twinx()
    source = timeline.get("sources", {}).get(device, "usage probe")
    for target, values, color, label in (
        (axes, [p for _, p, _ in samples], "tab:blue", f"this process's extkv memory ({source}), left"),
        (used_axes, [u for _, _, u in samples], "tab:gray", "device's used memory (all processes, pressure included), right"),
    ):
        scale, unit = _scale(max(values))
        target.plot(times, [value / scale for value in values], drawstyle="steps-post", color=color, linewidth=1.0, label=label)
        target.set_ylim(0, max(max(values), 1) / scale * 1.15)
        target.set_ylabel(unit, color=color)
    axes.set_xlabel("seconds since the stress run started in this process")
    axes.set_title(f"extkv stress: memory on {where(timeline, device)}", fontsize=10)
    handles = axes.get_legend_handles_labels()[0] + used_axes.get_legend_handles_labels()[0]
    axes.legend(handles, [h.get_label() for h in handles], loc="upper left", fontsize=8)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    save_figure(figure, path)
    pyplot.close(figure)
    return path


def memory_plot(timeline: dict, device: str, path: Path) -> str | None:
    """`plot_memory` into `path` unless the PNG there is current; None, or
    why plots are skipped."""
    return draw_unless_current(
        path, {"timeline": timeline, "device": device}, (sys.modules[__name__],), partial(plot_memory, timeline, device)
    )
