"""`extkv bench`: the benchmarks on the GPU (or the host driver), and their report.

Theory of operation
-------------------
Two phases, each announced by a progress line and timed:

1. Measuring, in a pytest subprocess over the benchmark modules of
   `reports/` (`bench_*.py`, kept out of the default collection, whose
   testpaths are conformance): on cuda:0 with the `gpu` profile where a CUDA
   GPU is usable (one is enough), else on the host driver with the `host`
   profile, whose sizes fit a small machine; `--quick` runs the `quick`
   profile (tiny sizes, two rounds) for CI. The engine
   (extkv.benchmarking.engine) prints a line per case; pytest-benchmark
   writes `<run>/bench.json` with extkv's playback clock as its timer, and
   the engine `<run>/bench_cases.json`.
2. The report: `render_report(<run>)` writes `summary.md` with the bench
   section (extkv.benchmarking.report) and its plots; the machine's facts come
   from `machine.json`, written before phase 1. With `--quick` the run fails
   unless the summary holds the bench section: CI's proof that a report
   renders, not a claim about speed.

The run directory is a new `reports/runs/<date>-<host>-<gpus>/` (extkv.reporting.rundir)
unless `--report-dir` names one. `--rounds N` caps the rounds of every case.
Other arguments go to pytest (`extkv bench -k commit`). Device settings
(clocks) are never changed: the report says they were not pinned.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from .. import vmm
from ..reporting import render_report
from ..reporting.check_run import add_report_dir_argument, installed_suite_options
from ..reporting.machine import machine_facts, write_machine_facts
from ..reporting.rundir import RunDirectoryInUse, checkout_root, prepare_run_directory, suite_directory
from .playback import BENCH_JSON, PLAYBACK_TIMER

#: Files of an earlier bench that --overwrite removes from --report-dir.
BENCH_FILES = ("bench*.json", "bench*.png", "bench.log", "summary.md")

#: The heading bench_section writes; --quick checks the summary has it.
BENCH_HEADING = "## Benchmarks"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `extkv bench`; other arguments go to pytest."""
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, two rounds; fails unless the report renders")
    add_report_dir_argument(parser)
    parser.add_argument("--rounds", type=int, default=None, metavar="N", help="at most N rounds per case (default: the profile's)")


def pytest_command(suite: Path, run_dir: Path, profile: str, device: str, rounds: int | None) -> list[str]:
    """The pytest command of the measuring phase."""
    command = [sys.executable, "-m", "pytest", str(suite), "-q", "-s", "-o", "python_files=bench_*.py"]
    command += installed_suite_options(suite)
    command += [
        f"--benchmark-json={run_dir / BENCH_JSON}",
        f"--benchmark-timer={PLAYBACK_TIMER}",
        "--benchmark-quiet",  # the report is the table; one line per case is the progress
        f"--extkv-bench-profile={profile}",
        f"--extkv-bench-device={device}",
        f"--extkv-bench-dir={run_dir}",
    ]
    if rounds is not None:
        command.append(f"--extkv-bench-rounds={rounds}")
    return command


def _phase(number: int, what: str, command: list[str] | None = None) -> float:
    print(f"extkv bench [{number}/2] {what}", flush=True)
    if command is not None:
        print("$ " + " ".join(command), flush=True)
    return time.monotonic()


def run(args: argparse.Namespace, pytest_args: list[str]) -> int:
    if args.rounds is not None and args.rounds < 1:
        raise SystemExit(f"extkv bench: --rounds must be an int >= 1, got {args.rounds}")
    facts = machine_facts()
    gpu = vmm.cuda_usable()
    device = "cuda:0" if gpu else "cpu"
    profile = "quick" if args.quick else "gpu" if gpu else "host"
    try:
        run_dir = prepare_run_directory(args.report_dir, facts, args.overwrite, BENCH_FILES)
    except RunDirectoryInUse as error:
        print(f"extkv bench: {error}", file=sys.stderr)
        return 2
    write_machine_facts(run_dir)
    where = f"cuda:0 ({facts['gpus'][0]['label']})" if gpu else f"the host driver ({facts['no_gpu_reason']})"
    print(f"extkv bench: profile {profile} on {where}; results in {run_dir}", flush=True)

    command = pytest_command(suite_directory("reports"), run_dir, profile, device, args.rounds) + pytest_args
    started = _phase(1, "measuring (a line per case)", command)
    status = subprocess.call(command, cwd=checkout_root() or Path.cwd())
    print(f"extkv bench [1/2] {'done' if status == 0 else f'FAILED (exit status {status})'} "
          f"in {time.monotonic() - started:.0f} s", flush=True)

    started = _phase(2, "report")
    try:
        summary = render_report(run_dir)
    except (OSError, ValueError) as error:
        print(f"extkv bench: the report could not be rendered: {error}", flush=True)
        return 1
    print(f"extkv bench [2/2] done in {time.monotonic() - started:.0f} s; report {summary}", flush=True)
    if args.quick and BENCH_HEADING not in summary.read_text():
        print(f"extkv bench: FAILED: {summary} has no bench section ({BENCH_HEADING!r})", flush=True)
        return 1
    return status
