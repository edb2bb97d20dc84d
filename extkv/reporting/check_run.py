"""`extkv check`: the conformance suite on every GPU found, else on the host
driver, and its report.

Theory of operation
-------------------
Three phases, each announced by a progress line and timed:

1. The suite, in a pytest subprocess: one xdist worker per GPU when there
   are several (the harness pins each worker's GPU before CUDA starts), with
   `--junitxml=<run>/check-junit.xml` (pytest's own) and
   `--extkv-report-dir=<run>` (the harness's `check.json`, which also carries
   what JUnit XML cannot: the machine facts).
2. Only with 2+ GPUs, in one process without -n that sees every GPU: the
   multi_gpu-marked tests (NCCL rank agreement), which xdist workers skip
   because each sees one GPU, and the per_gpu-marked ones (the memory
   timeline), which phase 1 ran on one GPU only; into
   `check-multi-gpu-junit.xml` and `check-multi-gpu.json`, which the report
   merges with phase 1's.
3. The report: `render_report(<run>)` writes `summary.md` and the plots.

The run directory is `reports/<date>-<host>-<gpus>/` (extkv.reporting.rundir)
unless `--report-dir` names one. Arguments `extkv check` does not know go to
pytest in both test phases (`extkv check -x -k sizing`). The exit status is
nonzero when any phase failed.

From a checkout the suite is `conformance/` and pytest reads the checkout's
pyproject.toml. From an installed package the suite is the installed
`extkv_conformance` package; pytest then runs with no configuration file of
its own (`-c /dev/null`, so nothing in the current directory is picked up),
the harness as a plugin (`-p extkv.testing.harness`) and INSTALLED_OPTIONS in
place of the checkout's ini options.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from . import render_report
from .machine import machine_facts
from .rundir import checkout_root, run_directory, suite_directory

#: What the checkout's [tool.pytest.ini_options] gives, on the command line
#: for an installed package (the harness arrives through -p there).
INSTALLED_OPTIONS = ["-ra", "--strict-markers", "-o", "timeout=600"]
#: Tests of phase 2, the step in one process that sees every GPU.
ALL_GPUS_MARKERS = "multi_gpu or per_gpu"
#: pytest's exit status when no test was selected.
NO_TESTS_SELECTED = 5


def add_report_dir_argument(parser: argparse.ArgumentParser) -> None:
    """`--report-dir DIR`, which check, bench and stress share."""
    parser.add_argument(
        "--report-dir",
        metavar="DIR",
        type=Path,
        default=None,
        help="write the results and the report here instead of reports/<date>-<host>-<gpus>/",
    )


def installed_suite_options(suite: Path) -> list[str]:
    """What pytest needs to run `suite` from an installed package, where no
    checkout gives it a conftest and ini options; nothing in a checkout."""
    if checkout_root() is not None:
        return []
    return ["-c", os.devnull, "--rootdir", str(suite), "-p", "no:cacheprovider", "-p", "extkv.testing.harness", *INSTALLED_OPTIONS]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `extkv check`; other arguments go to pytest."""
    add_report_dir_argument(parser)


def pytest_command(suite: Path, run_dir: Path, step: str, options: list[str]) -> list[str]:
    """The pytest command of one test phase, whose results go to `run_dir` as `<step>.json` and `<step>-junit.xml`."""
    command = [sys.executable, "-m", "pytest", str(suite), "-q"]
    command += installed_suite_options(suite)
    command += [
        f"--junitxml={run_dir / f'{step}-junit.xml'}",
        f"--extkv-report-dir={run_dir}",
        f"--extkv-report-step={step}",
    ]
    return command + options


def _phase(number: int, total: int, what: str, command: list[str] | None = None) -> float:
    print(f"extkv check [{number}/{total}] {what}", flush=True)
    if command is not None:
        print("$ " + " ".join(command), flush=True)
    return time.monotonic()


def _finished(number: int, total: int, started: float, status: int, failed: bool) -> None:
    verdict = f"FAILED (exit status {status})" if failed else "done"
    print(f"extkv check [{number}/{total}] {verdict} in {time.monotonic() - started:.0f} s", flush=True)


def run(args: argparse.Namespace, pytest_args: list[str]) -> int:
    facts = machine_facts()
    gpus = len(facts["gpus"])
    run_dir = (args.report_dir or run_directory(facts)).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    suite = suite_directory("conformance")
    phases = 3 if gpus >= 2 else 2
    failed_phases = []
    where = f"{gpus} GPU(s) and the host driver" if gpus else f"the host driver only ({facts['no_gpu_reason']})"
    print(f"extkv check: {suite} on {where}; results in {run_dir}", flush=True)

    command = pytest_command(suite, run_dir, "check", ["-n", str(gpus)] if gpus > 1 else [])
    started = _phase(1, phases, "conformance suite" + (f", one xdist worker per GPU ({gpus})" if gpus > 1 else ""), command + pytest_args)
    status = subprocess.call(command + pytest_args, cwd=checkout_root() or Path.cwd())
    if status != 0:
        failed_phases.append("conformance suite")
    _finished(1, phases, started, status, status != 0)

    if gpus >= 2:
        command = pytest_command(suite, run_dir, "check-multi-gpu", ["-m", ALL_GPUS_MARKERS])
        started = _phase(2, phases, f"multi-GPU and per-GPU tests in one process that sees all {gpus} GPUs", command + pytest_args)
        status = subprocess.call(command + pytest_args, cwd=checkout_root() or Path.cwd())
        # Extra arguments (-k ...) may leave none of them selected: nothing failed.
        failed = status not in (0, NO_TESTS_SELECTED)
        if failed:
            failed_phases.append("multi-GPU tests")
        _finished(2, phases, started, status, failed)

    started = _phase(phases, phases, "report")
    try:
        summary = render_report(run_dir)
    except (OSError, ValueError) as error:
        print(f"extkv check: the report could not be rendered: {error}", flush=True)
        failed_phases.append("report")
        _finished(phases, phases, started, 1, True)
    else:
        _finished(phases, phases, started, 0, False)
        print(f"extkv check: report {summary}", flush=True)
    if failed_phases:
        print(f"extkv check: FAILED: {', '.join(failed_phases)}", flush=True)
        return 1
    print("extkv check: passed", flush=True)
    return 0
