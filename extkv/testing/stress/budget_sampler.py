"""The budget stress's outside sampler: what several processes hold
together, read from outside them.

Theory of operation
-------------------
An `OutsideSampler` thread makes a pass every SAMPLE_EVERY_S over every
watched process (in the budget stress, extkv.testing.stress.budget, every
live engine's), read through `read`: the budget device's `read_pieces`
(extkv.budget.device), what the budget daemon's own outside reading sums.
A reading comes in pieces that keep their identity from one pass to the
next: on the host each chunk (memfd) a process reaches, read process after
process; on a GPU each process's whole NVML reading, all of them from one
listing.

A pass reads the processes one after another, so its plain sum may count
one engine's chunks before it released them and another's created after,
from the room the release made: more than was ever held at once. So a
sample counts only the pieces two passes in a row both read in the same
process, each at the smaller reading (`consistent_bytes`): a chunk lives
one interval, so on the host all of those lived at the instant between
the passes, and the sample is at most what the processes held together
then. A GPU's piece, a process's total, has no such identity: the smaller
of its two readings is what it held at both, not between them, so an
engine that gave bytes back and took as many again between two passes,
while another engine held them meanwhile, could count them twice
(creates and releases on a GPU take well under a millisecond; two-pass
samples of engines sharing a 512 MiB budget on an H100 once read 948 MiB,
in 1 of 368 samples).

So where a piece has no identity (`still=True`, which the budget stress
asks for where its device does not read chunks), a pass is made while
every watched process is stopped: each is sent SIGSTOP through a pidfd
(opened at `watch`, so a pid reused after its process was reaped is never
signalled), the pass waits until each one has stopped or exited (waitid
on the pidfd: they must be this process's children), reads them all, then
sends SIGCONT. No process creates or releases memory while it is stopped,
so the pass reads what they held at one instant, and it is a sample by
itself. The stops cost the engines the pass's time (one NVML listing)
every SAMPLE_EVERY_S; the budget bench, which times the engines' steps,
samples without them.

Each process is watched with its baseline, what it held, read from
outside, before it could take any of the budget (an engine's at `ready`):
0 on the host, where only chunks count; on a GPU its CUDA context and
torch's memory, which NVML counts with the KV cache. A process's part of a
sample is its matched bytes less its baseline, never below 0.

Its maximum is what the run holds to its bound; the plain sums' maximum
is kept beside it, for the record, and each process's last pieces are kept
until it is forgotten, so the run can look for them after it ended.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Callable, Iterator

from ...budget.device import Pieces
from .base import CHILD_TIMEOUT_S

#: The outside sampler's period: the issue's 10 ms.
SAMPLE_EVERY_S = 0.01
#: How the sampler reads the processes of a pass: a budget device's `read_pieces`.
Read = Callable[[list[int]], dict[int, Pieces | None]]


def consistent_bytes(first: dict[int, Pieces], second: dict[int, Pieces],
                     baselines: dict[int, int] | None = None) -> int:
    """Bytes of the pieces both passes read in the same process, each at
    the smaller of its two readings, less each process's baseline (0 where
    `baselines` names none), never below 0: all of them lived at once,
    between the passes (see the module's theory)."""
    baselines = baselines or {}
    total = 0
    for pid, pieces in first.items():
        again = second.get(pid, {})
        matched = sum(min(size, again[key]) for key, size in pieces.items() if key in again)
        total += max(matched - baselines.get(pid, 0), 0)
    return total


@contextlib.contextmanager
def _stopped(pidfds: list[int]) -> Iterator[None]:
    """While inside, every process of `pidfds` (children of this one) is
    stopped or has exited; each is continued on the way out."""
    sent = []
    try:
        for pidfd in pidfds:
            with contextlib.suppress(ProcessLookupError):  # exited: it holds nothing more to stop
                signal.pidfd_send_signal(pidfd, signal.SIGSTOP)
                sent.append(pidfd)
        for pidfd in sent:
            with contextlib.suppress(ChildProcessError):  # reaped meanwhile
                os.waitid(os.P_PIDFD, pidfd, os.WSTOPPED | os.WEXITED | os.WNOWAIT)
        yield
    finally:
        for pidfd in sent:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(pidfd, signal.SIGCONT)


class OutsideSampler:
    """Every `every_s`, a pass over the watched processes, read from
    outside by `read`; each sample matches a pass with the one before it,
    or, with `still`, is one pass made with the processes stopped (see the
    module's theory): `samples` taken, `max_bytes` the largest
    consistent total, `max_plain_bytes` the largest plain sum of a pass,
    `last_bytes` the latest consistent total, `over` the samples above
    `bound` (if set) as (time.monotonic(), bytes)."""

    def __init__(self, read: Read, every_s: float = SAMPLE_EVERY_S, bound: int | None = None, *,
                 still: bool = False):
        if not every_s > 0:
            raise ValueError(f"every_s must be > 0 seconds, got {every_s!r}")
        self.every_s, self._read, self.bound, self.still = every_s, read, bound, still
        self._baselines: dict[int, int] = {}
        #: With `still`, a pidfd per watched process; a pass holds `_pass_lock`
        #: while it uses them, so `forget` never closes one under it.
        self._pidfds: dict[int, int] = {}
        self._pass_lock = threading.Lock()
        self._lock = threading.Lock()
        self._sampled = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._previous: dict[int, Pieces] = {}
        self.passes = 0
        self.samples = 0
        self.max_bytes = 0
        self.max_plain_bytes = 0
        self.last_bytes = 0
        self.over: list[tuple[float, int]] = []
        #: Of the largest sample above `bound`: each process's two readings
        #: and its baseline, pid -> (first, second, baseline) bytes.
        self.largest_over: dict[int, tuple[int, int, int]] = {}
        #: The pieces each watched process was last read holding, in the last two passes.
        self.last: dict[int, Pieces] = {}
        self.error: BaseException | None = None

    def watch(self, pid: int, baseline: int = 0) -> None:
        """Read `pid` from the next pass on, less `baseline` bytes. With
        `still`, `pid` must be a live child of this process."""
        with self._pass_lock, self._lock:
            if self.still and pid not in self._pidfds:
                self._pidfds[pid] = os.pidfd_open(pid)
            self._baselines[pid] = baseline

    def forget(self, pid: int) -> Pieces:
        """Stop reading `pid`; returns the pieces it was last read holding."""
        with self._pass_lock, self._lock:
            pidfd = self._pidfds.pop(pid, None)
            if pidfd is not None:
                os.close(pidfd)
            self._baselines.pop(pid, None)
            return self.last.pop(pid, {})

    def sample(self) -> int | None:
        """Take one pass; returns the consistent total it and the pass
        before it give (None for the first pass: no sample yet), or with
        `still`, the total of the pass alone."""
        with self._pass_lock:
            with self._lock:
                pids = sorted(self._baselines)
                pidfds = [self._pidfds[pid] for pid in pids] if self.still else []
            with _stopped(pidfds):
                read = self._read(pids)
        unread = [pid for pid in pids if read[pid] is None]
        if unread:
            raise OSError(f"processes {unread} cannot be read from outside (another uid's, or the device does not "
                          "count memory per process)")
        pieces: dict[int, Pieces] = {pid: read[pid] for pid in pids}
        with self._sampled:
            previous, self._previous = self._previous, pieces
            baselines = dict(self._baselines)
            self.passes += 1
            plain = sum(max(sum(held.values()) - baselines.get(pid, 0), 0) for pid, held in pieces.items())
            self.max_plain_bytes = max(self.max_plain_bytes, plain)
            for pid in pids:
                if pid in self._baselines:
                    self.last[pid] = {**previous.get(pid, {}), **pieces[pid]}
            if self.still:  # one instant: the pass alone
                total = plain
            elif self.passes == 1:
                return None
            else:
                total = consistent_bytes(previous, pieces, baselines)
            self.samples += 1
            self.max_bytes = max(self.max_bytes, total)
            self.last_bytes = total
            if self.bound is not None and total > self.bound:
                if total > max((over for _, over in self.over), default=0):
                    self.largest_over = {pid: (sum(previous.get(pid, {}).values()), sum(pieces[pid].values()),
                                               baselines.get(pid, 0)) for pid in pids}
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
        """Stop the thread and close the pidfds of processes still watched;
        raises what stopped the thread, if anything did."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(CHILD_TIMEOUT_S)
        if self._thread is None or not self._thread.is_alive():  # else a pass still uses them
            with self._pass_lock:
                for pidfd in self._pidfds.values():
                    os.close(pidfd)
                self._pidfds.clear()
        if self.error is not None:
            raise AssertionError(f"the outside sampler failed: {self.error!r}") from self.error
