"""The budget stress's outside sampler: what several processes hold
together, read from outside them.

Theory of operation
-------------------
An `OutsideSampler` thread makes a pass every SAMPLE_EVERY_S over every
watched process (in the budget stress, extkv.testing.stress.budget, every
live engine's), reading its chunks file by file (`read_chunks`:
extkv.memfds.host_chunks, what the budget daemon's own outside reading
sums). A pass reads the processes one after another, so its plain sum may
count one engine's chunks before it released them and another's created
after, from the room the release made: more than was ever held at once.
So a sample counts only the chunks two passes in a row both read in the
same process, each at the smaller reading (`consistent_bytes`): a chunk
lives one interval, so all of those lived at the instant between the
passes, and the sample is at most what the processes held together then.
Its maximum is what the run holds to its bound; the plain sums' maximum
is kept beside it, for the record, and each process's last reading is
kept until it is forgotten, so the run can look for its chunks after it
ended.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from ...memfds import host_chunks
from .base import CHILD_TIMEOUT_S

#: The outside sampler's period: the issue's 10 ms.
SAMPLE_EVERY_S = 0.01
#: What a process reaches: each extkv chunk's bytes, by file ((device,
#: inode)), as extkv.memfds.host_chunks reads them.
Chunks = dict[tuple[int, int], int]


def consistent_bytes(first: dict[int, Chunks], second: dict[int, Chunks]) -> int:
    """Bytes of the chunks both passes read in the same process, each at
    the smaller of its two readings: all of them lived at once, between the
    passes (see the module's theory)."""
    total = 0
    for pid, chunks in first.items():
        again = second.get(pid, {})
        total += sum(min(size, again[key]) for key, size in chunks.items() if key in again)
    return total


def read_chunks(pid: int) -> Chunks:
    """The chunks process `pid` reaches, by file; none once it is gone."""
    try:
        return host_chunks(pid)
    except (FileNotFoundError, ProcessLookupError):
        return {}


class OutsideSampler:
    """Every `every_s`, a pass over the watched processes, each read from
    outside by `read`; each sample matches a pass with the one before it
    (see the module's theory): `samples` taken, `max_bytes` the largest
    consistent total, `max_plain_bytes` the largest plain sum of a pass,
    `last_bytes` the latest consistent total, `over` the samples above
    `bound` (if set) as (time.monotonic(), bytes)."""

    def __init__(self, every_s: float = SAMPLE_EVERY_S, read: Callable[[int], Chunks] = read_chunks,
                 bound: int | None = None):
        if not every_s > 0:
            raise ValueError(f"every_s must be > 0 seconds, got {every_s!r}")
        self.every_s, self._read, self.bound = every_s, read, bound
        self._pids: set[int] = set()
        self._lock = threading.Lock()
        self._sampled = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._previous: dict[int, Chunks] = {}
        self.passes = 0
        self.samples = 0
        self.max_bytes = 0
        self.max_plain_bytes = 0
        self.last_bytes = 0
        self.over: list[tuple[float, int]] = []
        #: The chunks each watched process was last read holding, in the last two passes.
        self.last: dict[int, Chunks] = {}
        self.error: BaseException | None = None

    def watch(self, pid: int) -> None:
        with self._lock:
            self._pids.add(pid)

    def forget(self, pid: int) -> Chunks:
        """Stop reading `pid`; returns the chunks it was last read holding."""
        with self._lock:
            self._pids.discard(pid)
            return self.last.pop(pid, {})

    def sample(self) -> int | None:
        """Take one pass; returns the consistent total it and the pass
        before it give (None for the first pass: no sample yet)."""
        with self._lock:
            pids = sorted(self._pids)
        chunks = {pid: self._read(pid) for pid in pids}
        with self._sampled:
            previous, self._previous = self._previous, chunks
            self.passes += 1
            self.max_plain_bytes = max(self.max_plain_bytes, sum(sum(held.values()) for held in chunks.values()))
            for pid in pids:
                if pid in self._pids:
                    self.last[pid] = {**previous.get(pid, {}), **chunks[pid]}
            if self.passes == 1:
                return None
            total = consistent_bytes(previous, chunks)
            self.samples += 1
            self.max_bytes = max(self.max_bytes, total)
            self.last_bytes = total
            if self.bound is not None and total > self.bound:
                self.over.append((time.monotonic(), total))
            self._sampled.notify_all()
        return total

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                self.sample()
                self._stop.wait(max(started + self.every_s - time.monotonic(), 0))
        except BaseException as error:  # noqa: BLE001 - raised again by stop()
            self.error = error
            with self._sampled:
                self._sampled.notify_all()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="extkv-outside-sampler", daemon=True)
        self._thread.start()

    def wait_samples(self, count: int, timeout_s: float = CHILD_TIMEOUT_S) -> bool:
        """Wait until `count` samples were taken in all; False at the timeout."""
        with self._sampled:
            return self._sampled.wait_for(lambda: self.samples >= count or self.error is not None, timeout_s)

    def stop(self) -> None:
        """Stop the thread; raises what stopped it, if anything did."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(CHILD_TIMEOUT_S)
        if self.error is not None:
            raise AssertionError(f"the outside sampler failed: {self.error!r}") from self.error
