"""Measuring: rounds timed, a case's contenders interleaved, fresh memory.

Theory of operation
-------------------
Each round of a contender is: a new store, untimed setup (reserve, the
growth a defragment starts from, ...), the timed operation ended by a device
synchronize, untimed teardown that gives everything back (`time_round`).
Wall time (`perf_counter`) runs to the end of the synchronize; host CPU time
(`thread_time` of the calling thread) stops before it, since a GPU
synchronize spins the CPU for as long as the device works. No garbage
collection runs inside the timed part. extkv's own CPU time, and the raw
sequence's as its yardstick, come from an extra clocked round per round of
a recycled commit (extkv.benchmarking.clocks), and the Python work of the
operation from one more, counted in bytecode instructions.

`interleave` measures a case's contenders in the order of
extkv.benchmarking.rounds. Memory a round uses has been released by the
round before: those cases are *recycled*. *Fresh* cases (the headline first
commits, `measure_fresh`) run every contender once, each keeping its memory
until all have run, so all of them meet never-used memory. What a release
leaves behind shows in the next creates: on the H200, every driver call
timed, one 32 GiB cuMemCreate took 0.23 ms in the fast rounds, 7-11 ms when
the round before had slept 0.4 s after its release, and 10-150 ms in the
slow rounds that double a recycled case's median, for extkv and the raw
sequence alike; the up-front allocation (through torch, not timed call by
call) has the same slow rounds, the memset floor none (it allocates in its
untimed setup).

Flatness in bytes divides a reading of one case by one of another, so its
readings with the CPU caches evicted come from one pass over both cases
(`interleave_evicted`): the smallest and largest one-segment commit, extkv
and the raw sequence, interleaved round by round like the contenders of a
case. A contender that cannot run (no GPU, a missing package, a failure of
a peer) is recorded as not run with the reason, never dropped.
"""

from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..testing.work import python_instructions
from .cases import OPERATIONS, Case
from .clocks import StepClock, cache_evictor, pinned_to_this_cpu
from .contenders import CONTENDERS, Contender, ExtkvStore
from .geometry import GEOMETRIES
from .raw import RawStore
from .rounds import in_rounds
from .store import Store, Unsupported


@dataclass
class Measurement:
    """One contender's rounds in one case."""

    contender: str
    process: str
    status: str = "measured"  # "measured", "not run" or "failed"
    reason: str = ""
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    #: extkv and the raw sequence only: the CPU seconds of each round spent
    #: outside driver calls (extkv's own bookkeeping; the driver's own CPU
    #: time grows with bytes).
    own_cpu: list[float] = field(default_factory=list)
    #: The same, from rounds whose every driver step ends by evicting the
    #: CPU caches (`CacheEvictor`): at the two ends of the byte series only,
    #: measured together (`interleave_evicted`).
    own_cpu_evicted: list[float] = field(default_factory=list)
    #: Where `own_cpu` is read: the bytecode instructions Python executes in
    #: the operation, counted in one extra round (exact, so one tells it;
    #: see extkv.testing.work).
    python_instructions: int | None = None
    #: For a peer measured in another process: that process's pivot,
    #: {"contender": name, "wall": [...], "cpu": [...]}.
    pivot: dict | None = None

    def stop(self, status: str, reason: str) -> None:
        self.status, self.reason = status, reason
        self.wall, self.cpu, self.own_cpu, self.own_cpu_evicted, self.python_instructions = [], [], [], [], None

    def add(self, times: tuple[float, float, float | None]) -> None:
        wall, cpu, own_cpu = times
        self.wall.append(wall)
        self.cpu.append(cpu)
        if own_cpu is not None:
            self.own_cpu.append(own_cpu)

    def summary(self) -> str:
        if self.status != "measured":
            return f"{self.contender} {self.status}"
        if not self.wall:
            return f"{self.contender} no rounds"
        return f"{self.contender} {min(self.wall) * 1e3:.3g} ms"


def not_runnable(contender: Contender, device: torch.device) -> str | None:
    return contender.store.unsupported_reason(device)


def prepare_and_time(
    store: Store, case: Case, contender: Contender, *, evict_caches: bool = False
) -> tuple[float, float, float | None]:
    """Open and prepare `store` (untimed), then time the operation: (wall
    seconds to the end of a device synchronize, CPU seconds before it, and
    of those the seconds outside driver calls where the store counts them).
    With `evict_caches`, the store's step clock evicts the CPU caches inside
    every driver step of the operation (not of its setup or teardown)."""
    operation = OPERATIONS[case.op]
    store.open()
    operation.prepare(store, case, contender)
    store.synchronize()
    clock = getattr(store, "clock", None) if evict_caches else None
    if evict_caches and not isinstance(clock, StepClock):
        raise ValueError(f"evicting caches needs a clocked store, got {type(store).__name__}")
    # No collection here: a full one costs 80 ms with torch loaded, more than
    # many rounds; disabled, none lands inside the timed part.
    gc.disable()
    try:
        if clock is not None:
            clock.evict = cache_evictor()  # the first call allocates: before the clocks start
        driver_start = store.driver_cpu_seconds()
        wall_start, cpu_start = time.perf_counter(), time.thread_time()
        try:
            operation.timed(store, case)
        finally:
            cpu_end = time.thread_time()
            if clock is not None:
                clock.evict = None
        driver_end = store.driver_cpu_seconds()
        store.synchronize()
        wall_end = time.perf_counter()
    finally:
        gc.enable()
    own = None if driver_start is None else (cpu_end - cpu_start) - (driver_end - driver_start)
    return wall_end - wall_start, cpu_end - cpu_start, own


def counts_own_cpu(case: Case, contender: Contender) -> bool:
    """Whether the CPU time outside driver calls is read in `case`: extkv's
    and the raw sequence's (its yardstick), in recycled commits, the cases
    the scaling targets compare. It takes a second, clocked round: timing
    every driver step costs microseconds per step (a thread-time read is a
    system call), which would weigh on the timed round that the ratios
    against the raw sequence come from."""
    return contender.store in (ExtkvStore, RawStore) and case.op == "commit" and case.state == "recycled"


def time_round(
    case: Case, contender: Contender, device: torch.device, *, clocked: bool = False, evict_caches: bool = False
) -> tuple[float, float, float | None]:
    """(wall seconds, CPU seconds, own CPU seconds or None) of one round of `contender` in `case`,
    on a store of its own that gives everything back afterwards. Own CPU
    seconds only from a `clocked` round of extkv or the raw sequence (with
    `evict_caches`, one whose steps each end by evicting the CPU caches),
    which runs pinned to one CPU."""
    store = contender.make(device, GEOMETRIES[case.geometry], case.capacity_blocks, clocked=clocked)
    try:
        with pinned_to_this_cpu() if clocked else contextlib.nullcontext():
            return prepare_and_time(store, case, contender, evict_caches=evict_caches)
    finally:
        store.close()


def count_python_work(case: Case, contender: Contender, device: torch.device) -> int:
    """Bytecode instructions Python executes in one round's operation, on a
    store of its own (setup and teardown not counted)."""
    store = contender.make(device, GEOMETRIES[case.geometry], case.capacity_blocks)
    operation = OPERATIONS[case.op]
    try:
        store.open()
        operation.prepare(store, case, contender)
        store.synchronize()
        count = python_instructions(lambda: operation.timed(store, case))
        store.synchronize()
        return count
    finally:
        store.close()


def recorded_failure(contender: Contender, error: BaseException) -> tuple[str, str]:
    """How a contender's exception is recorded: a peer that does not work
    here is not run; extkv or a baseline that fails is a failure."""
    words = f"{type(error).__name__}: {error}"
    if isinstance(error, Unsupported):
        return "not run", str(error)
    if contender.role == "peer":
        return "not run", f"failed here: {words}"
    return "failed", words


def interleave(
    case: Case,
    names: Sequence[str],
    device: torch.device,
    *,
    rounds: int,
    case_seconds: float,
    costly_rounds: int,
    process: str = "main",
    order_log: list[str] | None = None,
) -> dict[str, Measurement]:
    """Measure `names` in `case`, round r running each once in the order
    `round_order` gives; stop after `rounds`, or at the end of the round in
    which the contenders other than the costly ones have used `case_seconds`
    (a slow case's next round would cost more than it tells). `order_log`
    receives each contender as it runs."""
    results = {name: Measurement(name, process) for name in names}
    for name in names:
        reason = not_runnable(CONTENDERS[name], device)
        if reason:
            results[name].stop("not run", reason)

    def live(name: str) -> bool:
        measured = results[name]
        return measured.status == "measured" and len(measured.wall) < (
            costly_rounds if CONTENDERS[name].costly else rounds
        )

    def charged(name: str) -> bool:
        return not CONTENDERS[name].costly

    for name in in_rounds(names, live, rounds=rounds, case_seconds=case_seconds, charged=charged):
        if order_log is not None:
            order_log.append(name)
        try:
            times = time_round(case, CONTENDERS[name], device)
            if counts_own_cpu(case, CONTENDERS[name]):
                times = times[:2] + time_round(case, CONTENDERS[name], device, clocked=True)[2:]
        except Exception as error:
            results[name].stop(*recorded_failure(CONTENDERS[name], error))
            continue
        results[name].add(times)
    for name in names:
        if results[name].status == "measured" and counts_own_cpu(case, CONTENDERS[name]):
            try:
                results[name].python_instructions = count_python_work(case, CONTENDERS[name], device)
            except Exception as error:
                results[name].stop(*recorded_failure(CONTENDERS[name], error))
    return results


#: Whose own CPU time flatness in bytes compares.
FLATNESS_CONTENDERS = ("extkv", "raw")


def interleave_evicted(
    cases: Sequence[Case],
    names: Sequence[str],
    device: torch.device,
    *,
    rounds: int,
    case_seconds: float,
    order_log: list[tuple[str, str]] | None = None,
) -> dict[tuple[str, str], list[float] | BaseException]:
    """Own CPU seconds of each of `names` in each of `cases`, from clocked
    rounds whose every driver step ends by evicting the CPU caches; round r
    runs every (case, name) pair once, in row r of the Williams design over
    the pairs. Flatness in bytes is a ratio between two cases: measured
    case by case, minutes apart, each size met another state of the
    machine (on the H200's host, the raw sequence's fixed calls read 0.94x
    to 1.43x from the smaller size to the larger over four runs), and the
    minima came from unequal numbers of rounds. Interleaved, both sizes
    meet the same machine, in equal numbers, as the contenders of a case
    do. Stops as `in_rounds` does; a pair that raises keeps the error in
    place of its readings and leaves the rotation. `order_log` receives
    each (case id, name) as it runs."""
    pairs = [(case, name) for case in cases for name in names]
    readings: dict[tuple[str, str], list[float] | BaseException] = {(case.id, name): [] for case, name in pairs}

    def live(pair: tuple[Case, str]) -> bool:
        return isinstance(readings[(pair[0].id, pair[1])], list)

    for case, name in in_rounds(pairs, live, rounds=rounds, case_seconds=case_seconds):
        if order_log is not None:
            order_log.append((case.id, name))
        try:
            own_cpu = time_round(case, CONTENDERS[name], device, clocked=True, evict_caches=True)[2]
        except Exception as error:
            readings[(case.id, name)] = error
            continue
        readings[(case.id, name)].append(own_cpu)
    return readings


def warm_up(device: torch.device, names: Sequence[str], ops: Sequence[str]) -> None:
    """One tiny round (4 MiB) of each contender in each operation, so that
    first-call costs (kernel loading, lazy imports) land in no case."""
    for op in ops:
        tiny = Case(op, "blhnc1", 2, 2, (), replays=1)
        interleave(tiny, names, device, rounds=1, case_seconds=0.0, costly_rounds=1)


def measure_fresh(case: Case, names: Sequence[str], device: torch.device, process: str = "fresh") -> dict[str, Measurement]:
    """One round of each contender on memory never used by this process:
    every store keeps its memory until all have run (the engine passes one
    contender per process)."""
    results = {name: Measurement(name, process) for name in names}
    stores: list[Store] = []
    try:
        for name in names:
            contender = CONTENDERS[name]
            reason = not_runnable(contender, device)
            if reason:
                results[name].stop("not run", reason)
                continue
            store = contender.make(device, GEOMETRIES[case.geometry], case.capacity_blocks)
            stores.append(store)
            try:
                times = prepare_and_time(store, case, contender)
            except Exception as error:
                results[name].stop(*recorded_failure(contender, error))
                continue
            results[name].add(times)
    finally:
        for store in stores:
            store.close()
    return results
