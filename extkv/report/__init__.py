"""Reports of extkv runs: `reports/<date>-<host>-<gpu>/`.

Theory of operation
-------------------
Every run that proves or measures something (`extkv check`, `extkv bench`,
`extkv stress`) leaves its raw results as files in one run directory: JUnit
XML and JSON. `render_report(run_dir)` turns whatever raw results the
directory holds into `summary.md` and PNG plots, so a report can be rendered
again later (`extkv report DIR`) from the same files.

The summary opens with its front page (extkv.report.front): each run's
verdict on one screen. Its sections follow, in order: the machine (from the check results,
or `machine.json` of a run without them), the check (extkv.check.report,
with a memory-timeline plot per device drawn by extkv.check.plots), then
the bench section (extkv.benchmarking.report) and the stress section
(extkv.testing.stress.report), each of which returns None when the
directory holds none of its results. Each plot is drawn only where its
results or its drawing code changed since the PNG in the directory was
drawn (extkv.runs.plots), so rendering a report again draws nothing and
imports no matplotlib unless something changed.

This package stands above every kind of run: it imports each kind's
section, and no kind imports it; the run commands get `render_report`
from the command line (extkv.runs.commands).
"""

from __future__ import annotations

from pathlib import Path

from ..benchmarking.report import bench_section
from ..check.plots import timeline_plot
from ..check.report import check_section, load_check
from ..runs.machine import machine_section, read_machine_facts
from ..runs.rundir import results_as_written, write_text
from ..stress.report import stress_section
from ..testing.timeline import TIMELINE_GLOB, Timeline
from .front import front_page

SUMMARY_FILE = "summary.md"


def render_report(run_dir: Path) -> Path:
    """Write `summary.md` (and plots) for the raw results in `run_dir`; return its path."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such run directory")
    with results_as_written(run_dir, "check results and machine facts"):
        check = load_check(run_dir)
        facts = check["machine"] if check is not None else read_machine_facts(run_dir)
        sections = []
        if facts is not None:
            sections.append(machine_section(facts, check["worker_gpus"] if check is not None else None))
        if check is not None:
            # Every timeline is read before any is drawn: a garbled one fails the report with nothing drawn.
            paths = sorted(run_dir.glob(TIMELINE_GLOB))
            timelines = [(Timeline.load(path), path.with_suffix(".png")) for path in paths]
            why_not = [timeline_plot(timeline, image) for timeline, image in timelines]
            drawn = [(timeline, None if why else image.name) for (timeline, image), why in zip(timelines, why_not)]
            plots_skipped = next((why for why in why_not if why is not None), None)
            sections.append(check_section(check, drawn, plots_skipped))
    with results_as_written(run_dir, "bench results"):
        bench = bench_section(run_dir)
    with results_as_written(run_dir, "stress results"):
        stress = stress_section(run_dir)
    found = [section for section in (bench, stress) if section is not None]
    if check is None and not found:
        raise ValueError(
            f"{run_dir}: no results to report: expected check.json (extkv check), or bench or stress results"
        )
    with results_as_written(run_dir, "results"):
        front = front_page(run_dir, facts, check)
    summary = run_dir / SUMMARY_FILE
    write_text(summary, "\n".join([front] + sections + found).rstrip() + "\n")
    return summary
