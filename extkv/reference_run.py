"""`extkv reference [--stress-minutes M] [--report-dir DIR]`: re-make this
machine kind's reference run.

Theory of operation
-------------------
The reference runs committed under `reports/reference/<kind>/` (`host`,
`h200`, `2xh200`: the run directories' GPU slug) are what a reader of the
project compares a machine against: one commit's full check, benchmarks and
stress run on one machine, in one directory. This command makes one the
only way it is made: `extkv check`, `extkv bench --part cases`, `extkv
bench --part engines` and `extkv stress --minutes M` run one after another,
each as a process of its own (as a user runs them), into the same directory
with `--overwrite`, so each replaces its own files and leaves the others';
then `summary.md` is rendered once over them all. The bench runs as its two
parts so that every step fits a GPU machine's ten minutes
(extkv.benchmarking.result_files.PARTS). Every step runs even when one
before failed, so a failing check still leaves its benchmarks and stress
results to read; the exit status is the first non-zero one. Extra
arguments go to every step's pytest run (narrowing them makes the check say `partial run`). Ctrl-C or SIGTERM
passes the same signal on to the step running, which ends its own pytest,
writes its report and says in the one INTERRUPTED line that the signal
ended it (extkv.runs.steps); the reference stops there, saying it
made no reference, with exit status 130 or 143. A signal between steps is
the reference's own INTERRUPTED line.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .report import render_report
from .runs.commands import interrupted_report
from .runs.machine import machine_facts
from .runs.rundir import checkout_root, gpu_slug
from .runs.steps import GRACE_S, RunInterrupted, end_all, interruptible, start as start_step


def reference_directory(facts: dict) -> Path:
    """`reports/reference/<gpus>` of the checkout (of the current directory
    for an installed extkv)."""
    root = checkout_root()
    return (root if root is not None else Path.cwd()) / "reports" / "reference" / gpu_slug(facts)


def steps(report_dir: Path, stress_minutes: float, pytest_args: list[str]) -> list[tuple[str, list[str]]]:
    """(name, command) of each step, in order."""
    common = ["--report-dir", str(report_dir), "--overwrite", *pytest_args]
    extkv = [sys.executable, "-m", "extkv"]
    return [
        ("check", [*extkv, "check", *common]),
        ("bench cases", [*extkv, "bench", "--part", "cases", *common]),
        ("bench engines", [*extkv, "bench", "--part", "engines", *common]),
        ("stress", [*extkv, "stress", "--minutes", f"{stress_minutes:g}", *common]),
    ]


def run(args: argparse.Namespace, pytest_args: list[str]) -> int:
    report_dir = (args.report_dir or reference_directory(machine_facts())).resolve()
    report_dir.mkdir(parents=True, exist_ok=True)
    status, started = 0, time.monotonic()
    with interruptible():
        process = None
        try:
            for name, command in steps(report_dir, args.stress_minutes, pytest_args):
                print(f"extkv reference: {name} -> {report_dir}", flush=True)
                process = start_step(command)
                code = process.wait()
                print(f"extkv reference: {name} exited {code}", flush=True)
                status = status or code
        except RunInterrupted as interrupt:
            running = process is not None and process.poll() is None
            # The step ends its own pytest and writes its report first.
            end_all([process] if process else [], grace_s=2 * GRACE_S, number=interrupt.number)
            if running:  # the step said in its INTERRUPTED line what ended it
                print(f"extkv reference: no reference made: its {name} step ended on {interrupt.signal_name}; "
                      f"{interrupted_report(report_dir, render_report)}", flush=True)
            else:
                print(f"extkv reference: INTERRUPTED by {interrupt.signal_name}: no reference made; "
                      f"{interrupted_report(report_dir, render_report)}", flush=True)
            return interrupt.exit_status
        except BaseException:
            end_all([process] if process else [])  # a run that fails takes its steps with it
            raise
    summary = render_report(report_dir)
    held = sum(path.stat().st_size for path in report_dir.rglob("*") if path.is_file())
    print(f"extkv reference: {summary} ({held / 2**20:.1f} MiB in {report_dir}, "
          f"{time.monotonic() - started:.0f} s); exit {status}")
    return status
