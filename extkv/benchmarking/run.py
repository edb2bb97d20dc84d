"""`extkv bench`: the benchmarks on the GPU (or the host driver), and their report.

Theory of operation
-------------------
Two phases, each announced by a progress line and timed:

1. Measuring, in a pytest subprocess over the benchmark modules of
   `bench/` (`bench_*.py`, kept out of the default collection, whose
   testpaths are conformance): on cuda:0 with the `gpu` profile where a CUDA
   GPU is usable (one is enough), else on the host driver with the `host`
   profile, whose sizes fit a small machine; `--quick` runs the `quick`
   profile (tiny sizes, two rounds) for CI. The engine
   (extkv.benchmarking.engine) prints a line per case; pytest-benchmark
   writes `<run>/bench.json` with extkv's playback clock as its timer, and
   saves the run in its storage (below); the engine writes
   `<run>/bench_cases.json`; the harness writes its record of the pytest
   run, what selected its tests included, to `<run>/bench_tests.json`.
2. The report: `render_report(<run>)` writes `summary.md` with the bench
   section (extkv.benchmarking.report) and its plots; the machine's facts come
   from `machine.json`, written before phase 1. With `--quick` the run fails
   unless the summary holds the bench section: CI's proof that a report
   renders, not a claim about speed.

The run directory is a new `reports/runs/<date>-<host>-<gpus>/` (extkv.runs.rundir)
unless `--report-dir` names one. `--rounds N` caps the rounds of every case
(the report then judges nothing: the profile's rounds were not run).
Other arguments go to pytest (`extkv bench -k commit`). `--part cases` or
`--part engines` runs one part's modules (extkv.benchmarking.result_files.PARTS),
records the run under the part's own names and, with `--overwrite`, replaces
only that part's files: two part runs into one directory are one whole run,
each fitting a GPU machine's ten minutes. Device settings
(clocks) are never changed: the report says they were not pinned. Ctrl-C
or SIGTERM ends pytest and everything it started (extkv.runs.steps),
renders the report of what was measured, headed as partial, and ends in
one line and exit status 130 or 143. `bench-run.json` records pytest's
command and exit status, and the signal that ended the run, if one did:
the report reads from it whether the run is complete.

Run against run: pytest-benchmark's storage and compare
--------------------------------------------------------
Comparing runs is pytest-benchmark's job, and it does it. Every run is
saved in its storage, rounds included (`--benchmark-save-data`), under the
run directory's name: by default in `reports/runs/.benchmarks/<profile>/`
whatever `--report-dir` says, so that runs written anywhere join one
history; else in the directory `--benchmark-storage` names. One storage per
profile, because `--benchmark-compare` without a number compares with the
latest run saved, and a run of another profile measures other cases. What
it stores is what the engine measured (extkv.benchmarking.playback), so its
figures are the report's.

`pytest-benchmark --storage DIR list` lists the saved runs and `compare`
sets them side by side, benchmark by benchmark (one per case and
contender; `--group-by=name` puts each one's runs together, and recent
releases' `--between=min` gives a column per run). `--benchmark-compare
--benchmark-compare-fail=min:10%`, handed to pytest like any argument
`extkv bench` does not know, fails the run where a benchmark's least round
is over 10% slower than in the latest run saved: a nightly gate. The run is
saved all the same, so the next night compares with it; on a storage with
no run yet, pytest-benchmark stops with a usage error. The gate compares
absolute times, so a slower driver or machine trips it as a slower extkv
does. Keep a storage under the directory pytest runs in (the checkout; the
current directory for an installed extkv): where a compared run's
machine_info differs, pytest-benchmark names the storage relative to that
directory in its warning, and stops with a ValueError where it cannot.

What extkv's own code still does, because pytest-benchmark cannot: it runs
one benchmark's rounds back to back, test after test, while a verdict needs
a case's contenders interleaved round by round in one process in a Williams
order (extkv.benchmarking.rounds), so that drift and the driver state a
round leaves behind weigh on every contender alike; so the engine measures
and pytest-benchmark only records. A verdict is a ratio inside one run
(extkv against the raw sequence, through pivots for peers in processes of
their own), which no benchmark compared with itself across runs gives; and
compare sets runs side by side, but never joins their rounds into one run
whose verdicts read them all, which `extkv pool` does
(extkv.benchmarking.pool).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable

from .. import vmm
from ..runs.commands import installed_suite_options, interrupted_report
from ..runs.machine import machine_facts, write_machine_facts
from ..runs.rundir import (
    RunDirectoryInUse,
    checkout_root,
    prepare_run_directory,
    reports_root,
    slug,
    suite_directory,
)
from ..runs.steps import RunInterrupted, end_all, interruptible, start as start_step
from .playback import PLAYBACK_TIMER
from .result_files import BENCH_JSON, PARTS, harness_step, run_file

#: Files of an earlier bench that --overwrite removes from --report-dir.
BENCH_FILES = ("bench*.json", "bench*.png", "bench.log", "summary.md")


def own_files(part: str | None) -> tuple[str, ...]:
    """What --overwrite removes before a run of `part` (None: the whole
    bench): that part's results and records, and the summary, which the
    run renders anew; another part's results stay."""
    if part is None:
        return BENCH_FILES
    return (*PARTS[part]["files"], run_file(part), f"{harness_step(part)}.json", "summary.md")


#: The heading bench_section writes; --quick checks the summary has it.
BENCH_HEADING = "## Benchmarks"

#: pytest-benchmark's storage, under reports/runs/ unless --benchmark-storage names one.
STORAGE_DIRECTORY = ".benchmarks"


def benchmark_storage(chosen: str | None, profile: str) -> str:
    """Where pytest-benchmark saves the run: `chosen` (a directory, or a
    pytest-benchmark storage URI), else reports/runs/.benchmarks/<profile>."""
    if chosen is None:
        return str(reports_root().resolve() / STORAGE_DIRECTORY / profile)
    if "://" in chosen:
        return chosen
    # Absolute: pytest runs in the checkout, not where the user typed it.
    return str(Path(chosen).absolute())


def saves_benchmarks(part: str | None) -> bool:
    """Whether a run of `part` (None: the whole bench) records pytest-benchmark
    results: those whose files hold its json. The engine-level benches write
    their own files."""
    return part is None or BENCH_JSON in PARTS[part]["files"]


def pytest_command(suite: Path, run_dir: Path, profile: str, device: str, rounds: int | None, storage: str,
                   part: str | None = None) -> list[str]:
    """The pytest command of the measuring phase, of `part` (None: the whole bench)."""
    command = [sys.executable, "-m", "pytest", str(suite), "-q", "-s", "-o", "python_files=bench_*.py"]
    command += installed_suite_options(suite)
    if saves_benchmarks(part):
        command += [
            f"--benchmark-json={run_dir / BENCH_JSON}",
            f"--benchmark-timer={PLAYBACK_TIMER}",
            "--benchmark-quiet",  # the report is the table; one line per case is the progress
            f"--benchmark-storage={storage}",
            # Named after the run directory, so that a saved run leads to its report.
            f"--benchmark-save={slug(run_dir.name) or 'run'}",
            "--benchmark-save-data",
        ]
    if part is not None:
        command.append(f"--extkv-bench-part={part}")
    command += [
        f"--extkv-bench-profile={profile}",
        f"--extkv-bench-device={device}",
        f"--extkv-bench-dir={run_dir}",
        # The harness's record: what pytest selected, as its own parse of
        # this command read it (a report names the test paths given).
        f"--extkv-report-dir={run_dir}",
        f"--extkv-report-step={harness_step(part)}",
    ]
    if rounds is not None:
        command.append(f"--extkv-bench-rounds={rounds}")
    return command


def _phase(number: int, what: str, command: list[str] | None = None) -> float:
    print(f"extkv bench [{number}/2] {what}", flush=True)
    if command is not None:
        print("$ " + " ".join(command), flush=True)
    return time.monotonic()


def _record_run(run_dir: Path, part: str | None, command: list[str], status: int | None,
                interrupted: str | None = None) -> None:
    """Write the run record (`run_file`): pytest's command and exit status, and the signal that ended the run."""
    record = {"pytest": command, "exit_status": status} | ({"interrupted": interrupted} if interrupted else {})
    (run_dir / run_file(part)).write_text(json.dumps(record, indent=1) + "\n")
    if part is not None:
        drop_whole_run_records(run_dir)


def drop_whole_run_records(run_dir: Path) -> None:
    """Remove a whole bench run's records from `run_dir` once every part
    has a record of its own: they then describe none of its results."""
    if all((run_dir / run_file(part)).exists() for part in PARTS):
        for name in (run_file(None), f"{harness_step(None)}.json"):
            (run_dir / name).unlink(missing_ok=True)


def run(args: argparse.Namespace, pytest_args: list[str], *, render: Callable[[Path], Path]) -> int:
    """`extkv bench`; `render` writes the report (extkv.report.render_report)."""
    facts = machine_facts()
    gpu = vmm.cuda_usable()
    device = "cuda:0" if gpu else "cpu"
    profile = "quick" if args.quick else "gpu" if gpu else "host"
    try:
        run_dir = prepare_run_directory(args.report_dir, facts, args.overwrite, own_files(args.part))
    except RunDirectoryInUse as error:
        print(f"extkv bench: {error}", file=sys.stderr)
        return 2
    write_machine_facts(run_dir)
    where = f"cuda:0 ({facts['gpus'][0]['label']})" if gpu else f"the host driver ({facts['no_gpu_reason']})"
    which = f"the {args.part} part of profile" if args.part else "profile"
    print(f"extkv bench: {which} {profile} on {where}; results in {run_dir}", flush=True)

    storage = benchmark_storage(args.benchmark_storage, profile)
    command = pytest_command(suite_directory("bench"), run_dir, profile, device, args.rounds, storage, args.part)
    command += pytest_args
    started = _phase(1, "measuring (a line per case)", command)
    process = None
    with interruptible():
        try:
            process = start_step(command, cwd=checkout_root() or Path.cwd())
            status = process.wait()
        except RunInterrupted as interrupt:
            end_all([process] if process else [])
            _record_run(run_dir, args.part, command, process.returncode if process else None, interrupt.signal_name)
            print(f"extkv bench: INTERRUPTED by {interrupt.signal_name}: the run did not measure every case; "
                  f"{interrupted_report(run_dir, render)}", flush=True)
            return interrupt.exit_status
        except BaseException:
            end_all([process] if process else [])  # a run that fails takes its pytest with it
            raise
    _record_run(run_dir, args.part, command, status)
    saved = (f"; pytest-benchmark's storage {storage} (`pytest-benchmark --storage {storage} compare` sets its "
             "runs side by side)") if saves_benchmarks(args.part) else ""
    print(f"extkv bench [1/2] {'done' if status == 0 else f'FAILED (exit status {status})'} "
          f"in {time.monotonic() - started:.0f} s{saved}", flush=True)

    started = _phase(2, "report")
    try:
        summary = render(run_dir)
    except (OSError, ValueError) as error:
        print(f"extkv bench: the report could not be rendered: {error}", flush=True)
        return 1
    print(f"extkv bench [2/2] done in {time.monotonic() - started:.0f} s; report {summary}", flush=True)
    if args.quick and BENCH_HEADING not in summary.read_text():
        print(f"extkv bench: FAILED: {summary} has no bench section ({BENCH_HEADING!r})", flush=True)
        return 1
    return status
