"""A second run for a test whose only failure is memory its device's context took once.

Theory of operation
-------------------
CUDA loads a kernel's module at the kernel's first launch in a process, and
the context, which NVML's per-process reading includes, grows by whole 2 MiB
steps as loaded modules fill it. The leak check (the harness's `no_leaks`)
and `checks.check_usage_matches` read that reading against a baseline, so
the first test of a process to launch a new kernel reads a step as a leak:
on an H100 under load, 784334848 -> 786432000 bytes, in whichever test the
run's order made first. Warm-ups load the kernels the suites know of before
any baseline (`checks.warm_up_kernels`); a kernel they miss (a GEMM shape
that cuBLAS serves from another module) still steps.

One run cannot tell that step from a leaked chunk; two runs can: a module
loads once per process, a leak happens at every run. Both checks raise
`checks.ContextGrowth` when the reading is above the baseline by whole
steps of a witness whose context grows by itself
(`UsageProbe.lazy_growth_step`; 0 on the host, where nothing loads
lazily), and the leak check only when extkv's own bookkeeping (live
reservations, chunks, memfds) is clean. A test whose failures are all
ContextGrowth runs once more, in the same process, and its second run is
its outcome: the verdict depends on what the test does, not on which test
a run's order put first. Its second run's reports carry the bytes the
first run read above the baseline (record.SECOND_RUN_PROPERTY) in their
user_properties, so in the run's junit and results, and the check's
report lists every test that ran twice. A defect that leaks at every run (the planted
`chunk-kept-uncounted`) fails both runs.

What two runs cannot see: memory taken once per process, outside extkv's
bookkeeping, and never given back. extkv counts every chunk where it is
created (`vmm.live_chunks`), and the leak check reads that count first.
"""

from __future__ import annotations

import pytest
# pytest's protocol of one test, as its own runner calls it; it has no public name.
from _pytest.runner import runtestprotocol

from .checks import ContextGrowth
from .record import SECOND_RUN_PROPERTY

_GREW = pytest.StashKey[int]()
_OTHER_FAILURE = pytest.StashKey[bool]()
_SETUP_LOGGED = pytest.StashKey[bool]()
#: Set while this module's protocol runs the item, which logs what it
#: makes; a protocol of another plugin logs its own reports.
_OURS = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Note what each phase's failure was. A setup's report is logged as it
    is made, as pytest's own protocol does, so that a run interrupted during
    the test knows it started; a second run's passing setup is not logged
    twice."""
    report = yield
    if not item.stash.get(_OURS, False):
        return report
    if call.when == "setup" and not (report.passed and item.stash.get(_SETUP_LOGGED, False)):
        item.stash[_SETUP_LOGGED] = True
        item.ihook.pytest_runtest_logreport(report=report)
    if call.excinfo is not None:
        if call.when != "setup" and call.excinfo.errisinstance(ContextGrowth):
            item.stash[_GREW] = item.stash.get(_GREW, 0) + call.excinfo.value.excess
        elif report.failed:
            item.stash[_OTHER_FAILURE] = True
    return report


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """pytest's own protocol (setup, call, teardown, each reported), with
    one more run where every failure of the first was ContextGrowth."""
    item.stash[_OURS] = True
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    reports = runtestprotocol(item, nextitem=nextitem, log=False)
    grew, other = item.stash.get(_GREW, 0), item.stash.get(_OTHER_FAILURE, False)
    if grew and not other:
        item.user_properties.append((SECOND_RUN_PROPERTY, grew))
        reports = runtestprotocol(item, nextitem=nextitem, log=False)
    for report in reports:
        if report.when != "setup":  # logged as it was made
            item.ihook.pytest_runtest_logreport(report=report)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True
