"""Tests that need their device alone, run alone, inside a parallel run.

Theory of operation
-------------------
`extkv check` runs every device's tests at once, each device in its own
pytest run with several xdist workers. A few tests (marked `exclusive`)
fill a device or read what it has free, and must not share it while they
run. Rather than a pytest run of their own after the others (whose start-up
and collection cost as much as the tests: about 10 s on 2 cores), every
test takes advisory locks (flock) on files in one directory for as long as
its setup, call and teardown last:

| test                         | machine.lock | <gpu>.lock |
|------------------------------|--------------|------------|
| on the host driver           | shared       |            |
| on the host driver, exclusive| exclusive    |            |
| on a GPU                     | shared       | shared     |
| on a GPU, exclusive          | shared       | exclusive  |

A host-driver test that is exclusive waits for every test of the machine,
since the host's free memory is what every process uses; one on a GPU waits
for that GPU's tests only. Locks are always taken machine first, so no two
tests wait for each other. The harness orders exclusive tests last, so they
wait for the tail of the run instead of holding a worker early. A parallel
run given no lock directory (`pytest -n N`) makes one for its duration
(extkv.testing.harness_hooks); a serial run needs none and locks nothing.
While a test holds its device alone, ALONE_VARIABLE says so.

Alone among the suite's tests is not alone on the machine: the locks keep
the suite's own workers off a device, never another job, which may take
and free memory there at any moment. So an exclusive test's verdict rests
only on what other jobs cannot move: the memory of the processes the test
made (NVML's per-process reading, the kernel's pages of their memfds) and
out-of-memory as the driver reports it to the test's own calls. Where
another job's memory can still decide an attempt (a commit sized to fail
fits because a job freed memory meanwhile; a fill the test made is undone
by a job's release; a job takes what the test left and the next allocation
meets out-of-memory), the attempt raises `Inconclusive`, the test checks
that its cache is still consistent and usable, and tries again, at most
INCONCLUSIVE_ATTEMPTS times in a row (`until_conclusive`). If every attempt
was decided by others, the test is skipped with their reasons: that
machine could not say, which is neither a pass nor a failure. A defect
cannot hide there: what each inconclusive attempt leaves behind is checked
as a failure would be, once the memory is back.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from pathlib import Path
from typing import Callable, Iterator, TypeVar

MACHINE_LOCK = "machine.lock"
#: Attempts in a row that other jobs' memory may decide before a test gives
#: up as inconclusive. Each is a window of a second or less in which a job
#: must free or take memory at just the wrong moment: ten in a row do not
#: happen beside a job that allocates and frees in a loop.
INCONCLUSIVE_ATTEMPTS = 10
#: Set to "1" while a test holds its device alone, so that a workload can
#: take the CPUs the device's other workers are not using then
#: (extkv.testing.stress.under_pressure.host_compare_threads).
ALONE_VARIABLE = "EXTKV_ALONE_ON_DEVICE"


def lock_name(gpu_id: str) -> str:
    return f"gpu-{re.sub(r'[^A-Za-z0-9]+', '-', gpu_id)}.lock"


def plan(exclusive: bool, gpu_id: str | None) -> list[tuple[str, int]]:
    """(lock file, flock mode) in the order a test takes them."""
    if gpu_id is None:
        return [(MACHINE_LOCK, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)]
    return [(MACHINE_LOCK, fcntl.LOCK_SH), (lock_name(gpu_id), fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)]


@contextlib.contextmanager
def held(directory: Path | None, exclusive: bool, gpu_id: str | None) -> Iterator[None]:
    """Hold the locks `plan` names for the duration of the block; nothing
    without a directory."""
    if directory is None:
        yield
        return
    descriptors = []
    try:
        for name, mode in plan(exclusive, gpu_id):
            fd = os.open(Path(directory) / name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            descriptors.append(fd)
            fcntl.flock(fd, mode)
        yield
    finally:
        for fd in reversed(descriptors):
            os.close(fd)  # closing the last descriptor of the file releases its flock


@contextlib.contextmanager
def alone_on_device(alone: bool) -> Iterator[None]:
    """ALONE_VARIABLE set for the duration of the block when `alone`."""
    if not alone:
        yield
        return
    os.environ[ALONE_VARIABLE] = "1"
    try:
        yield
    finally:
        os.environ.pop(ALONE_VARIABLE, None)


class Inconclusive(Exception):
    """An attempt whose outcome another job's memory decided, not extkv."""


Result = TypeVar("Result")


def until_conclusive(attempt: Callable[[], Result], attempts: int = INCONCLUSIVE_ATTEMPTS) -> Result:
    """`attempt()`'s result, tried again each time it raises `Inconclusive`;
    after `attempts` in a row, `Inconclusive` naming every reason."""
    reasons: list[str] = []
    while len(reasons) < attempts:
        try:
            return attempt()
        except Inconclusive as why:
            reasons.append(str(why))
    raise Inconclusive(f"{attempts} attempts in a row were decided by other jobs' memory: " + "; ".join(reasons))
