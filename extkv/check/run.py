"""`extkv check`: certify this machine: the conformance suite on the host
driver and on every GPU, with its report and a verdict.

Theory of operation
-------------------
The run is a plan of phases, one after the other; a phase's steps run at
once, each step one pytest subprocess. A step's output goes to `<run>/<step>.log`, its results
to `<step>.json` (the harness's record) and `<step>-junit.xml`; while steps
run, a line every PROGRESS_EVERY_S says how far each is, read from the
progress file the harness keeps.

1. Every device at once, a step each: the host driver's tests (`check-host`:
   every test without a GPU, run once) and every GPU's (`check-gpu<id>`:
   CUDA_VISIBLE_DEVICES narrowed to that GPU, every GPU test), each with
   several xdist workers. NVML's per-process readings and a process's own
   memfds do not see other processes, so workers on one device do not
   disturb each other's accounting; the host's step sees no GPU
   (CUDA_VISIBLE_DEVICES empty), so it takes no GPU memory.
   Each run orders the planted defects first
   (conformance/test_planted_defects.py, on that device: each test passes
   only when a check flags a deliberately broken implementation), since a
   certificate is only as good as the checks behind it. The tests marked
   `exclusive` (they fill a device or read what it has free) come last and
   run alone on their device: every test holds locks in `<run>/locks`
   (extkv.testing.exclusive), a GPU's exclusive test waits for that GPU's
   other tests and a host-driver one for the whole machine's. On a machine
   without a GPU the host run keeps every test, so the GPU tests show as
   skipped and why.
2. With two GPUs or more, the multi-GPU tests (NCCL rank agreement) in one
   process that sees every GPU (`check-multi-gpu`).
3. The report (`render`: extkv.report.render_report) and the verdict
   (extkv.check.verdict).

Every step runs under xdist, at least one worker, so a test that kills its
process (a SIGSEGV in the code under test) is a failed test with its name,
and its worker is replaced, rather than a lost run. The run directory is a
new one under `reports/runs/` (extkv.runs.rundir) unless `--report-dir`
names one. Arguments `extkv check` does not know go to pytest in every step
(`extkv check -k sizing`); a run they narrow certifies nothing. The exit
status is 0 only for a CERTIFIED run. Ctrl-C or SIGTERM, to this process
alone or to its whole group, ends every step and what they started
(extkv.runs.steps), renders the report of what ran, marked
INTERRUPTED, and ends in one line and exit status 130 or 143. `check-run.json` records the plan,
the paths each step was given, the phases' and the run's wall time.

From a checkout the suite is `conformance/` and pytest reads the checkout's
pyproject.toml. From an installed package the suite is the installed
`extkv_conformance` package; pytest then runs with no configuration file of
its own (`-c /dev/null`, so nothing in the current directory is picked up),
the harness as a plugin (`-p extkv.testing.harness`) and INSTALLED_OPTIONS in
place of the checkout's ini options.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..runs.bytecode import run_bytecode
from ..runs.commands import installed_suite_options, interrupted_report
from ..runs.machine import machine_facts
from ..runs.rundir import RunDirectoryInUse, checkout_root, prepare_run_directory, suite_directory
from ..runs.steps import RunInterrupted, end_all, interruptible, start as start_step
from .report import RUN_FILE, load_check, slowest_tests
from .verdict import run_verdict

#: Seconds between progress lines.
PROGRESS_EVERY_S = 15.0
#: xdist workers of one GPU's step at most: beyond this its tests' own
#: subprocesses and the CUDA contexts' start-up outweigh what runs at once.
MOST_GPU_WORKERS = 10
#: Files of an earlier check that --overwrite removes from --report-dir.
CHECK_FILES = ("check*.json", "check*.xml", "check*.log", "check*.progress", "locks", "timeline-*", "summary.md")


@dataclass
class Step:
    name: str                        # its results file's stem: check-host, check-gpu0, ...
    what: str                        # for progress lines: `host`, `GPU 0 (NVIDIA H200)`
    targets: list[str]               # the paths it is given
    options: list[str]               # the harness's selection and xdist
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Phase:
    name: str
    steps: list[Step]            # at once


def workers(cores: int, gpus: int, host: int | None, gpu: int | None) -> tuple[int, int]:
    """(host workers, workers per GPU): without a GPU every core on the host
    driver; with GPUs, each GPU's share of three quarters of the cores (at
    most MOST_GPU_WORKERS), and the host driver every core left, at least a
    quarter. On one H100 with 16 cores and 8 workers each, the host driver's
    tests took 44-47 s of each worker (360 s) and ended at 67 s, the GPU's
    61-66 s (496 s) and ended at 83 s, then its tests that need the GPU alone
    ran until 94 s: the GPU's tests are the longer part, so they get more of
    the cores."""
    if gpus == 0:
        return max(1, host or cores), 0
    gpu_workers = gpu or max(1, min(MOST_GPU_WORKERS, (cores - cores // 4) // gpus))
    return host or max(1, cores // 4, cores - gpus * gpu_workers), gpu_workers


def plan(suite: Path, facts: dict, host_workers: int, gpu_workers: int) -> list[Phase]:
    gpus = facts["gpus"]
    host_device = "host" if gpus else "all"
    whole = [str(suite)]
    locks = "--extkv-lock-dir={run}/locks"
    # Beside GPUs the host's run sees none: tests without a GPU of their own
    # (the README's example, a report's inner run) would otherwise take GPU
    # memory under a GPU's exclusive tests, which hold that GPU's lock only.
    hidden = {"CUDA_VISIBLE_DEVICES": ""} if gpus else {}
    # Two tests at a time per worker, in the harness's order (the long ones
    # first): xdist's default hands each worker a quarter of its share at
    # once, so one worker took every long test and the run waited for it.
    spread = ["--dist=load", "--maxschedchunk=2", locks]
    steps = [Step("check-host", "host", whole, [f"--extkv-device={host_device}", "-n", str(host_workers), *spread], hidden)]
    steps += [Step(f"check-gpu{gpu['id']}", gpu["label"], whole,
                   ["--extkv-device=gpu", "-n", str(gpu_workers), *spread], {"CUDA_VISIBLE_DEVICES": gpu["id"]})
              for gpu in gpus]
    phases = [Phase("every device at once", steps)]
    if len(gpus) >= 2:
        phases.append(Phase(f"multi-GPU tests in one process that sees all {len(gpus)} GPUs", [
            Step("check-multi-gpu", f"{len(gpus)} GPUs", whole, ["--extkv-device=multi-gpu", "-n", "1"]),
        ]))
    return phases


def pytest_command(suite: Path, run_dir: Path, step: Step, pytest_args: list[str]) -> list[str]:
    """The pytest command of one step, whose results go to `run_dir`."""
    command = [sys.executable, "-m", "pytest", *step.targets, "-q", "-p", "no:cacheprovider"]
    command += installed_suite_options(suite)
    command += [
        f"--junitxml={run_dir / f'{step.name}-junit.xml'}",
        f"--extkv-report-dir={run_dir}",
        f"--extkv-report-step={step.name}",
        f"--extkv-progress={run_dir / f'{step.name}.progress'}",
        *(option.replace("{run}", str(run_dir)) for option in step.options),
    ]
    return command + pytest_args


def _progress(run_dir: Path, step: Step) -> str:
    try:
        done, total, failed = (run_dir / f"{step.name}.progress").read_text().split()
    except (OSError, ValueError):
        return f"{step.what}: starting"
    return f"{step.what}: {done}/{total}" + (f" ({failed} FAILED)" if failed != "0" else "")


def run_phase(number: int, total: int, phase: Phase, suite: Path, run_dir: Path, pytest_args: list[str],
              started_steps: list[subprocess.Popen]) -> dict:
    """Run `phase`'s steps at once, printing progress until all end; returns
    the phase's record. Each step's process joins `started_steps` as it starts."""
    print(f"extkv check [{number}/{total}] {phase.name}", flush=True)
    started = time.monotonic()
    running = []
    for step in phase.steps:
        command = pytest_command(suite, run_dir, step, pytest_args)
        with open(run_dir / f"{step.name}.log", "w") as log:
            process = start_step(command, cwd=checkout_root() or Path.cwd(), env={**os.environ, **step.env},
                                stdout=log, stderr=subprocess.STDOUT)
        started_steps.append(process)
        print(f"  {step.name}: " + " ".join(command[3:]) + f"  > {step.name}.log", flush=True)
        running.append((step, process))
    statuses: dict[str, int] = {}
    said = time.monotonic()
    while len(statuses) < len(running):
        time.sleep(0.5)
        for step, process in running:
            if step.name not in statuses and process.poll() is not None:
                statuses[step.name] = process.returncode
                print(f"  {step.name} ended (exit status {process.returncode}) after {time.monotonic() - started:.0f} s", flush=True)
        if time.monotonic() - said >= PROGRESS_EVERY_S and len(statuses) < len(running):
            said = time.monotonic()
            print(f"  {time.monotonic() - started:.0f} s: " + "; ".join(_progress(run_dir, step) for step, _ in running), flush=True)
    wall = time.monotonic() - started
    print(f"extkv check [{number}/{total}] done in {wall:.0f} s", flush=True)
    return {"name": phase.name, "steps": [step.name for step in phase.steps], "statuses": statuses, "wall_s": round(wall, 1)}


def run(args: argparse.Namespace, pytest_args: list[str], *, render: Callable[[Path], Path]) -> int:
    """`extkv check`; `render` writes the report (extkv.report.render_report).
    Where writing bytecode is forbidden and torch has none, its processes
    share one bytecode tree (extkv.runs.bytecode), which this process fills
    with torch first."""
    started = time.monotonic()
    with run_bytecode(lambda words: print(f"extkv check: {words}", flush=True)):
        return _run(started, args, pytest_args, render)


def _run(started: float, args: argparse.Namespace, pytest_args: list[str], render: Callable[[Path], Path]) -> int:
    facts = machine_facts()
    try:
        run_dir = prepare_run_directory(args.report_dir, facts, args.overwrite, CHECK_FILES)
    except RunDirectoryInUse as error:
        print(f"extkv check: {error}", file=sys.stderr)
        return 2
    suite = suite_directory("conformance")
    cores = len(os.sched_getaffinity(0))
    host_workers, gpu_workers = workers(cores, len(facts["gpus"]), args.host_workers, args.gpu_workers)
    phases = plan(suite, facts, host_workers, gpu_workers)
    gpus = ", ".join(gpu["label"] for gpu in facts["gpus"])
    where = f"the host driver ({host_workers} workers) and {gpus} ({gpu_workers} workers each)" if gpus else (
        f"the host driver only, {host_workers} workers ({facts['no_gpu_reason']})")
    print(f"extkv check: {suite} on {where}; results in {run_dir}", flush=True)
    (run_dir / "locks").mkdir(exist_ok=True)
    record = {
        "steps": [step.name for phase in phases for step in phase.steps],
        "targets": {step.name: step.targets for phase in phases for step in phase.steps},
        "arguments": pytest_args,
        "machine": facts,
        "phases": [],
        "wall_s": 0.0,
    }
    total = len(phases) + 1
    started_steps: list[subprocess.Popen] = []
    with interruptible():
        try:
            for number, phase in enumerate(phases, 1):
                record["phases"].append(run_phase(number, total, phase, suite, run_dir, pytest_args, started_steps))
            record["wall_s"] = round(time.monotonic() - started, 1)
            (run_dir / RUN_FILE).write_text(json.dumps(record, indent=1) + "\n")
            print(f"extkv check [{total}/{total}] report", flush=True)
            return _report(run_dir, record, render)
        except RunInterrupted as interrupt:
            end_all(started_steps)
            record["interrupted"] = interrupt.signal_name
            record["wall_s"] = round(time.monotonic() - started, 1)
            (run_dir / RUN_FILE).write_text(json.dumps(record, indent=1) + "\n")
            print(f"extkv check: INTERRUPTED by {interrupt.signal_name}: nothing certified; "
                  f"{interrupted_report(run_dir, render)}", flush=True)
            return interrupt.exit_status
        except BaseException:
            end_all(started_steps)  # a run that fails takes its steps with it
            raise


def _report(run_dir: Path, record: dict, render: Callable[[Path], Path]) -> int:
    """Render the report, print its closing lines; the run's exit status."""
    try:
        summary = render(run_dir)
        check = load_check(run_dir)  # not None: the run's record is there
    except (OSError, ValueError) as error:
        print(f"extkv check: the report could not be rendered: {error}", flush=True)
        print("extkv check: NOT CERTIFIED: no report", flush=True)
        return 1
    lines = closing_lines(check, record, summary)
    for line in lines:
        print(f"extkv check: {line}", flush=True)
    return 0 if lines[-1].startswith("CERTIFIED") else 1


def closing_lines(check: dict, record: dict, summary: Path) -> list[str]:
    """What the terminal ends with: the slowest ten tests, the failures, the
    report and every plot beside it, then the verdict, last."""
    lines = ["slowest tests:"]
    lines += [f"  {seconds:6.1f} s  {key}  [{device}]" for seconds, key, device in slowest_tests(check["tests"])]
    lines += [
        f"FAILED {key} [{test['device']}]: {test['message']}"
        for key, test in check["tests"].items()
        if test["outcome"] in ("failed", "error")
    ]
    lines.append(f"report {summary}")
    lines += [f"plot {image}" for image in sorted(summary.parent.glob("*.png"))]
    return lines + run_verdict(check, record)
