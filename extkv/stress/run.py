"""`extkv stress --minutes M [--seed S] [--report-dir DIR]`: the nightly
stress suite for a bounded time, and its report.

Theory of operation
-------------------
Two phases, each announced by a progress line and timed:

1. The suite, in a pytest subprocess over `stress/` (from an installed
   package: the `extkv_stress` package, with the harness as a plugin), with
   `--extkv-stress` and the run's end as a deadline (`--stress-deadline`: now plus
   M minutes, less REPORT_RESERVE_S for the report), the seed, and
   `--stress-results <run>/stress`. With GPUs only the GPU tests run
   (`--stress-device gpu`); on a machine of several, one xdist worker per GPU
   with `--dist each`, so every GPU runs every test at the same time. Without
   a GPU the host driver's tests run in one process. Hypothesis runs its
   `nightly` profile. pytest also writes JUnit XML and the harness's results
   (`stress.json`) beside. The stress suite's conftest shares the bound out
   among the tests (a test's share is a floor for one whole episode of its
   workload, so a bound too short for that runs over, and the report and
   the last line here name the tests it was too short for) and gives each a
   timeout; this process prints the lines
   the tests append to `progress.log` and, every PROGRESS_EVERY_S, the time
   left and the operations so far. Should pytest outlive its bound by
   OVERRUN_S, it is killed, and the run fails.
2. The report: `run.json` (bound, seed, command, exit status) joins the raw
   results, and `render_report(<run>)` writes `summary.md`, whose stress
   section (extkv.stress.report) gives the verdict, counts operations,
   faults, (operation, step) pairs, leaks and content mismatches, and plots
   the memory timeline. The closing lines give the verdict, and the exit
   status is 0 only where the run passed.

The run directory is a new `reports/runs/<date>-<host>-<gpus>/`
(extkv.runs.rundir) unless `--report-dir` names one, which must be
empty unless `--overwrite` lets this run replace the stress results there. Arguments `extkv stress` does not know go to
pytest (`extkv stress --minutes 1 -k walk`). Ctrl-C or SIGTERM ends pytest
and everything it started (extkv.runs.steps), renders the report of
what ran, marked INTERRUPTED, and ends in one line and exit status 130 or
143.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from ..runs.commands import installed_suite_options, interrupted_report
from ..runs.machine import machine_facts, write_machine_facts
from ..runs.rundir import RunDirectoryInUse, checkout_root, prepare_run_directory, suite_directory
from ..runs.steps import RunInterrupted, end_all, interruptible, start as start_step
from .report import HARNESS_STEP, RUN_FILE, STRESS_DIR, STRESS_FORMAT, load_stress, stress_totals, stress_verdict

#: Files of an earlier stress run that --overwrite removes from --report-dir.
STRESS_FILES = (STRESS_DIR, "summary.md", "*.png")
#: Seconds of the bound kept for the report after the tests.
REPORT_RESERVE_S = 10.0
#: Seconds between the lines saying how far the run is.
PROGRESS_EVERY_S = 30.0
#: Seconds pytest may run past its bound before it is killed: a test's own
#: timeout is the bound plus five minutes, so this is later still.
OVERRUN_S = 420.0


def pytest_command(suite: Path, results: Path, deadline: float, seed: int, gpus: int) -> list[str]:
    """The pytest command of the stress phase."""
    command = [sys.executable, "-m", "pytest", str(suite), "-q", "-p", "no:cacheprovider", "--extkv-stress"]
    command += installed_suite_options(suite)
    command += [
        f"--stress-deadline={deadline:.0f}",
        f"--stress-seed={seed}",
        f"--stress-results={results}",
        f"--stress-device={'gpu' if gpus else 'host'}",
        f"--junitxml={results / 'stress-junit.xml'}",
        f"--extkv-report-dir={results}",
        f"--extkv-report-step={HARNESS_STEP}",
    ]
    if gpus > 1:
        command += ["-n", str(gpus), "--dist", "each"]
    return command


def _operations_so_far(results: Path) -> tuple[int, int, int]:
    """(tests done, operations, faults) of the results written so far."""
    stress = load_stress(results.parent)
    if stress is None:
        return 0, 0, 0
    overall = stress_totals(stress)["overall"]
    return len(stress["tests"]), sum(overall["operations"].values()), sum(overall["faults"].values())


def _short_bounds(results: Path) -> list[str]:
    """The tests whose least episode outlasted their share of the bound."""
    stress = load_stress(results.parent)
    return [record["nodeid"] for record in (stress or {}).get("tests", []) if record["tally"].get("short_bounds")]


def _watch(process: subprocess.Popen, results: Path, deadline: float) -> int:
    """Wait for pytest, printing the tests' progress lines as they come and
    a line on the whole run every PROGRESS_EVERY_S; kill it past its bound."""
    log, printed, next_line = results / "progress.log", 0, time.monotonic() + PROGRESS_EVERY_S
    while True:
        try:
            status = process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            status = None
        if log.is_file():
            text = log.read_text()
            for line in text[printed:].splitlines(keepends=True):
                if line.endswith("\n"):
                    print(f"extkv stress | {line.rstrip()}", flush=True)
                    printed += len(line)
        if status is not None:
            return status
        if time.monotonic() > next_line:
            next_line += PROGRESS_EVERY_S
            done, operations, faults = _operations_so_far(results)
            left = deadline - time.time()
            print(
                f"extkv stress: {max(left, 0) / 60:.1f} min left; {done} tests done, {operations:,} operations, "
                f"{faults:,} faults so far",
                flush=True,
            )
        if time.time() > deadline + OVERRUN_S:
            print(f"extkv stress: pytest ran {OVERRUN_S:.0f} s past its bound; killing it", flush=True)
            end_all([process])
            return 1


def run(args: argparse.Namespace, pytest_args: list[str], *, render: Callable[[Path], Path]) -> int:
    """`extkv stress`; `render` writes the report (extkv.report.render_report)."""
    suite = suite_directory("stress")
    started = time.time()
    deadline = started + 60 * args.minutes - REPORT_RESERVE_S
    seed = args.seed if args.seed is not None else int(started) % 1_000_000
    facts = machine_facts()
    gpus = len(facts["gpus"])
    try:
        run_dir = prepare_run_directory(args.report_dir, facts, args.overwrite, STRESS_FILES)
    except RunDirectoryInUse as error:
        print(f"extkv stress: {error}", file=sys.stderr)
        return 2
    results = run_dir / STRESS_DIR
    results.mkdir(parents=True)
    write_machine_facts(run_dir)
    if gpus > 1:
        layout = f"one xdist worker per GPU ({gpus}), every test on every GPU at once"
    elif gpus == 1:
        layout = f"one process on {facts['gpus'][0]['label']}"
    else:
        layout = f"one process on the host driver ({facts['no_gpu_reason']})"
    print(f"extkv stress: {args.minutes:g} min, seed {seed}, {layout}; results in {run_dir}", flush=True)

    command = pytest_command(suite, results, deadline, seed, gpus) + pytest_args
    print("extkv stress [1/2] the stress suite (a line per test; every test gets its share of the bound)", flush=True)
    print("$ " + shlex.join(command), flush=True)
    env = dict(os.environ, EXTKV_HYPOTHESIS_PROFILE="nightly")
    document = {
        "format": STRESS_FORMAT,
        "command_line": shlex.join(["extkv", "stress", *sys.argv[2:]]) if sys.argv[1:2] == ["stress"] else "extkv stress",
        "minutes": args.minutes,
        "seed": seed,
        "layout_of_work": layout,
        "pytest": command,
        "started": started,
    }
    process = None
    with interruptible():
        try:
            process = start_step(command, cwd=checkout_root() or Path.cwd(), env=env)
            status = _watch(process, results, deadline)
            print(f"extkv stress [1/2] {'done' if status == 0 else f'FAILED (exit status {status})'} "
                  f"in {time.time() - started:.0f} s", flush=True)
            return _report(run_dir, results, {**document, "finished": time.time(), "exit_status": status}, render)
        except RunInterrupted as interrupt:
            end_all([process] if process else [])
            document.update(finished=time.time(), exit_status=process.returncode if process else None,
                            interrupted=interrupt.signal_name)
            (results / RUN_FILE).write_text(json.dumps(document, indent=1) + "\n")
            print(f"extkv stress: INTERRUPTED by {interrupt.signal_name}: the run ended before its bound; "
                  f"{interrupted_report(run_dir, render)}", flush=True)
            return interrupt.exit_status
        except BaseException:
            end_all([process] if process else [])  # a run that fails takes its pytest with it
            raise


def _report(run_dir: Path, results: Path, document: dict, render: Callable[[Path], Path]) -> int:
    """Phase 2: run.json, the report and the closing lines; the run's exit status."""
    phase = time.time()
    print("extkv stress [2/2] report", flush=True)
    status = document["exit_status"]
    (results / RUN_FILE).write_text(json.dumps(document, indent=1) + "\n")
    try:
        summary = render(run_dir)
    except (OSError, ValueError) as error:
        print(f"extkv stress: the report could not be rendered: {error}", flush=True)
        return 1
    done, operations, faults = _operations_so_far(results)
    passed, verdict = stress_verdict(load_stress(run_dir))  # not None: run.json is there
    print(f"extkv stress [2/2] done in {time.time() - phase:.0f} s; report {summary}", flush=True)
    print(f"extkv stress: {done} tests, {operations:,} operations, {faults:,} faults; {verdict}", flush=True)
    short = _short_bounds(results)
    if short:
        print(f"extkv stress: bound too short for {len(short)} of {done} tests: they ran only their least episode "
              f"(listed in the report): {', '.join(nodeid.split('::')[-1] for nodeid in short)}", flush=True)
    return status or (0 if passed else 1)
