"""Time, seeds and results of the nightly stress suite (`extkv stress` runs it).

Theory of operation
-------------------
Every test here is marked `stress`, which the harness (the root conftest)
skips unless pytest runs with `--extkv-stress`; the harness also gives the
`device` fixture, one GPU per xdist worker and the leak check after every
test. This file adds what only stress runs need:

- A time bound for the whole run: `--stress-deadline` (seconds since the
  epoch; `extkv stress` sets it) or else `--stress-minutes` from the start of
  the session. Each test, as it starts, gets its share of what is left: its
  `stress_weight` over the weights of the tests still to run in this process
  (so time a test did not need goes to the ones after it), nothing once the
  bound is spent (extkv.testing.stress.share_of_bound). The `stress` fixture
  carries that share as `until`, a `time.monotonic()` deadline the workloads
  run to; it is a floor, not a hard stop: every workload runs its least
  episode (one whole pressure episode, a walk through every kind of
  operation, two crashes, ...) however small its share, so a bound too
  short for the tests' least runs over, and each test whose least outlasted
  its share says so (its tally's `short_bounds`, a progress line, the
  report). Every test also has a timeout (pytest-timeout): the whole bound
  plus TIMEOUT_SLACK_S.
- Seeds: each test's seed mixes `--stress-seed` with a checksum of its
  nodeid and xdist worker, so every test of a run (and every GPU's run of
  it) draws differently, and one seed replays the whole run.
- Results: with `--stress-results DIR`, every test's `StressTally` (what it
  did and found), outcome, seed, share and device are written to
  `DIR/tests/<worker>--<test>.json` once its teardown is over, so a leak the
  harness finds at teardown counts as a leak; each process's memory
  timeline (`MemoryTimeline`, read outside extkv) goes to
  `DIR/timeline-<worker>.json` at the end of the session, and progress
  lines to `DIR/progress.log` (xdist workers cannot print to the terminal;
  `extkv stress` prints the file as it grows).
- `--stress-device host|gpu|all` deselects tests by the device they run on.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from extkv import vmm
from extkv.testing import harness
from extkv.testing.harness import DEVICE_PROPERTY
from extkv.testing.stress import MemoryTimeline, StressTally, share_of_bound

#: Format tag of the files written here (extkv.stress.report reads them).
RESULT_FORMAT = "extkv-stress/1"
#: Seconds of the bound kept back for the last teardowns and the session's end.
SESSION_RESERVE_S = 5.0
#: A test's timeout past the run's whole bound.
TIMEOUT_SLACK_S = 300.0
#: Modules in the order they run: a fixed amount of work first (a full fault
#: enumeration, a least number of crashes), then the workloads that run for
#: whatever time is left.
MODULE_ORDER = (
    "test_faults", "test_crash", "test_pressure", "test_threads", "test_processes", "test_budget", "test_ahead",
    "test_endurance",
)

_SCHEDULE = pytest.StashKey[list]()
_DEADLINE = pytest.StashKey[float]()
_TEST = pytest.StashKey["StressTest"]()
_REPORTS = pytest.StashKey[dict]()


def pytest_addoption(parser):
    group = parser.getgroup("extkv-stress", "extkv stress runs")
    group.addoption("--stress-minutes", type=float, default=5.0, help="time bound of the whole run (default 5)")
    group.addoption(
        "--stress-deadline", type=float, default=None, metavar="EPOCH_S",
        help="the run's end, in seconds since the epoch (overrides --stress-minutes)",
    )
    group.addoption("--stress-seed", type=int, default=None, help="seed of the whole run (default: from the clock, printed)")
    group.addoption("--stress-results", default=None, metavar="DIR", help="write each test's tally and the memory timeline here")
    group.addoption(
        "--stress-device", choices=("all", "host", "gpu"), default="all", help="run only the tests on these devices"
    )


def pytest_configure(config):
    harness.activate(config)
    config.addinivalue_line("markers", "stress_weight(w): the test's share of the run's time bound, relative to others")
    deadline = config.getoption("--stress-deadline")
    config.stash[_DEADLINE] = deadline if deadline is not None else time.time() + 60 * config.getoption("--stress-minutes")
    if config.getoption("--stress-seed") is None:
        config.option.stress_seed = int(time.time()) % 1_000_000


def device_param(item) -> str | None:
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("device") if callspec is not None else None


def module_rank(item) -> int:
    name = item.module.__name__.rpartition(".")[2]
    return MODULE_ORDER.index(name) if name in MODULE_ORDER else len(MODULE_ORDER)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Deselect by device, give every test its timeout, and list, in order,
    the weights of the tests that will run (not skipped)."""
    wanted = config.getoption("--stress-device")
    kept, dropped = [], []
    for item in items:
        device = device_param(item)
        on_gpu = device is not None and device != "host"
        (dropped if wanted == "host" and on_gpu or wanted == "gpu" and not on_gpu else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    # Tests of fixed work first: time they leave over goes to the ones after.
    kept.sort(key=module_rank)
    items[:] = kept
    whole = config.stash[_DEADLINE] - time.time()
    schedule = []
    for item in items:
        item.add_marker(pytest.mark.timeout(max(whole, 0) + TIMEOUT_SLACK_S))
        if not item.get_closest_marker("skip"):
            marker = item.get_closest_marker("stress_weight")
            schedule.append((item.nodeid, float(marker.args[0]) if marker else 1.0))
    config.stash[_SCHEDULE] = schedule


@dataclass
class StressTest:
    """One stress test's share of the run: its tally, seed, and the
    `time.monotonic()` deadline its workloads run to."""

    tally: StressTally
    seed: int
    until: float
    budget_s: float
    started: float

    def left(self) -> float:
        return max(self.until - time.monotonic(), 0.0)


def progress(config, text: str) -> None:
    """A progress line: into the results' progress.log (which `extkv stress`
    prints), else to the terminal, past pytest's capture."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    line = f"{time.strftime('%H:%M:%S')} [{worker}] {text}\n"
    results = config.getoption("--stress-results")
    if results is None:
        sys.__stderr__.write(line)
        sys.__stderr__.flush()
        return
    Path(results).mkdir(parents=True, exist_ok=True)
    with open(Path(results) / "progress.log", "a") as log:
        log.write(line)


@pytest.fixture
def stress(request) -> StressTest:
    """This test's share of the time bound, its seed and its tally."""
    config = request.config
    schedule = config.stash[_SCHEDULE]
    names = [nodeid for nodeid, _ in schedule]
    index = names.index(request.node.nodeid) if request.node.nodeid in names else len(schedule)
    weight = schedule[index][1] if index < len(schedule) else 1.0
    weights_left = sum(w for _, w in schedule[index:]) or weight
    left = config.stash[_DEADLINE] - time.time() - SESSION_RESERVE_S
    budget = share_of_bound(left, weight, weights_left)
    # The worker is part of it: under `--dist each` every GPU runs every test,
    # each with draws of its own.
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    seed = (config.getoption("--stress-seed") * 1_000_003 + zlib.crc32(f"{worker} {request.node.nodeid}".encode())) % (1 << 31)
    test = StressTest(StressTally(), seed, time.monotonic() + budget, budget, time.time())
    request.node.stash[_TEST] = test
    progress(config, f"{request.node.nodeid}: start, {budget:.0f} s, seed {seed}")
    return test


@pytest.fixture(scope="session", autouse=True)
def memory_timeline(request):
    """Physical memory of every device this process stresses, sampled
    outside extkv for the whole session (with --stress and --stress-results)."""
    config = request.config
    results = config.getoption("--stress-results")
    if not config.getoption("--extkv-stress") or results is None:
        yield None
        return
    gpus = torch.cuda.device_count() if vmm.cuda_usable() else 0
    wanted = config.getoption("--stress-device")
    devices = ([torch.device("cpu")] if wanted != "gpu" else []) + (
        [torch.device("cuda", i) for i in range(gpus)] if wanted != "host" else []
    )
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with MemoryTimeline(devices) as timeline:
        yield timeline
    document = {
        "format": RESULT_FORMAT,
        "worker": worker,
        "pinned_gpu": os.environ.get("CUDA_VISIBLE_DEVICES") if worker != "main" else None,
        "devices": {str(device): vmm.driver_for(device).describe() for device in devices},
        **timeline.to_json(),
    }
    path = Path(results) / f"timeline-{worker}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    reports = item.stash.setdefault(_REPORTS, {})
    reports[report.when] = report
    if report.when == "teardown" and item.config.getoption("--stress-results") is not None:
        write_result(item, reports)


def _text(report) -> str:
    return str(report.longrepr)[-6000:] if report.longrepr is not None else ""


def write_result(item, reports: dict) -> None:
    """The test's record: outcome, where it failed and why (the text holds a
    Hypothesis reproduction or a walk's seed and steps), its tally."""
    test = item.stash.get(_TEST, None)
    tally = test.tally if test is not None else StressTally()
    failed = [when for when, report in reports.items() if report.failed]
    skipped = next((report for report in reports.values() if report.skipped), None)
    teardown = reports.get("teardown")
    if teardown is not None and teardown.failed and "test leaked" in _text(teardown):
        tally.leaks.append(teardown.longrepr.reprcrash.message if hasattr(teardown.longrepr, "reprcrash") else _text(teardown))
    outcome = (
        ("failed" if "call" in failed else "error") if failed else "skipped" if skipped is not None else "passed"
    )
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    document = {
        "format": RESULT_FORMAT,
        "nodeid": item.nodeid,
        "worker": worker,
        "device": device_param(item),
        "device_label": dict(item.user_properties).get(DEVICE_PROPERTY),
        "outcome": outcome,
        "failure": "\n\n".join(f"[{when}]\n{_text(reports[when])}" for when in failed),
        "skip_reason": skipped.longrepr[2] if skipped is not None and isinstance(skipped.longrepr, tuple) else None,
        "seed": test.seed if test is not None else None,
        "budget_s": round(test.budget_s, 1) if test is not None else None,
        "started": test.started if test is not None else None,
        "duration_s": round(sum(report.duration for report in reports.values()), 3),
        "tally": tally.to_json(),
    }
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", item.nodeid.split("/")[-1])[:150]
    path = Path(item.config.getoption("--stress-results")) / "tests" / f"{worker}--{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1) + "\n")
    if test is not None:
        total = sum(tally.operations.values())
        progress(item.config, f"{item.nodeid}: {outcome}, {total} operations, {sum(tally.faults.values())} faults")
        for short in tally.short_bounds:
            progress(
                item.config,
                f"{item.nodeid}: bound too short: {short['workload']} ran only its least, {short['ran']}, "
                f"in {short['seconds']:.1f} s of its {short['share_s']:.1f} s share",
            )
