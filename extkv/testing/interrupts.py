"""Interrupts at random moments: a signal handler that raises, through every operation.

Theory of operation
-------------------
Ctrl-C, pytest-timeout's signal method and serving frameworks' SIGTERM
handlers raise from a signal handler, so the exception can surface between
any two bytecodes of the main thread. `run_interrupted` drives a tensor and
a KV cache through every state-changing operation (creation, growth,
shrink, discarding or keeping contents, preserving and discarding
defragmentation, release, recommit, free,
and an export to an import in this process, either side on the interrupted
thread) and arms `setitimer(ITIMER_REAL)` before each at a random delay drawn from the
durations it has measured, so interrupts land anywhere inside operations;
the SIGALRM handler raises `Interrupted`, a BaseException as
KeyboardInterrupt is, which no `except Exception` can swallow.

After each operation, interrupted or not, the timer is disarmed and each
object is checked without trusting its bookkeeping:

- the kernel's or driver's read-back of every granule partitions the
  reservation as the bookkeeping does (`check_readback_matches_bookkeeping`);
- every committed byte lies in a mapped granule, and the first and last
  byte of each committed range can be written and read back;
- the cache's committed sizes are its block count times its strides, or
  zero after a release;
- the host chunks alive by the driver's count are exactly the extkv memfds
  this process holds (a descriptor closed but still counted, or counted
  released but still open, differs).

An object that is broken (a failed step's undo failed) must still `free()`;
anything else, and any error other than `Interrupted`, is an inconsistency.
At the end everything is freed and no reservation, chunk, memfd or mapping
may remain. The tally counts the interrupts, those that arrived while extkv
code ran (the handler reads the frame it interrupted), and what went wrong.

`run_in_child` runs it in a child of the fork server, so that a run that
ends in SIGSEGV (a write to a granule the bookkeeping thinks mapped) is an
exit status to report rather than the end of the test process; a planted
defect (`extkv.testing.planted`) can be staged in the child first.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import os
import random
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Callable

import torch

from .. import vmm
from ..cache import ExtensibleKVCache
from ..connector import SegmentExportConnector
from ..deferred_signals import deferred_signals, run_deferred
from ..layout import KVCacheLayout
from ..peer import ImportedSegments, import_segments
from ..tensor import ExtensibleTensor
from ..usage import open_chunk_fds
from .checks import check_readback_matches_bookkeeping
from .children import one_report
from .configs import config_for

_EXTKV_DIR = str(Path(__file__).parent.parent) + os.sep
_TESTING_DIR = str(Path(__file__).parent) + os.sep
#: The tensor's segments: four of 3 granules and a half, so segments share granules.
SEGMENT_GRANULES = (3.5, 3.5, 3.5, 3.5)
CACHE_CAPACITY_BLOCKS = 64


class Interrupted(BaseException):
    """What the SIGALRM handler raises."""


@dataclass
class InterruptTally:
    """What a run saw: `inside` counts interrupts that arrived while extkv
    code ran; `problems` names every inconsistency, the first ones in full."""

    steps: int = 0
    interrupts: int = 0
    inside: int = 0
    broken: int = 0
    #: Imports the workload's own code dropped between return and close.
    dropped_by_the_caller: int = 0
    operations: collections.Counter = field(default_factory=collections.Counter)
    interrupted: collections.Counter = field(default_factory=collections.Counter)
    problems: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "steps": self.steps, "interrupts": self.interrupts, "inside": self.inside, "broken": self.broken,
            "dropped_by_the_caller": self.dropped_by_the_caller,
            "operations": dict(self.operations), "interrupted": dict(self.interrupted), "problems": self.problems[:20],
            "problem_count": len(self.problems),
        }


class _Objects:
    """The tensor and the cache under test, recreated once freed."""

    def __init__(self, device: torch.device, layout: KVCacheLayout) -> None:
        self.device, self.layout = device, layout
        self.tensor: ExtensibleTensor | None = None
        self.cache: ExtensibleKVCache | None = None

    # A constructor that returned has handed its object over; an interrupt
    # before the assignment would drop it unfreed. Deferring signals over
    # the assignment is the caller's share, as it is for any resource.
    def new_tensor(self) -> None:
        granule = vmm.driver_for(self.device).granularity
        capacities = [int(granule * share) for share in SEGMENT_GRANULES]
        with deferred_signals():
            self.tensor = ExtensibleTensor(sum(capacities), self.device, capacities)

    def new_cache(self) -> None:
        config = config_for("full", self.layout, CACHE_CAPACITY_BLOCKS)
        with deferred_signals():
            self.cache = ExtensibleKVCache(config, self.device, self.layout)


def _operations(objects: _Objects, rng: random.Random) -> dict[str, Callable[[], None]]:
    def sizes() -> list[int]:
        tensor = objects.tensor
        return [rng.randint(size, capacity) for size, capacity in zip(tensor.segment_sizes, tensor.segment_capacities)]

    def blocks() -> int:
        return rng.randint(1, CACHE_CAPACITY_BLOCKS)

    return {
        "ExtensibleTensor()": lambda: objects.new_tensor(),
        "tensor grow": lambda: objects.tensor.resize_segments_(sizes(), zero_new=True),
        "tensor shrink": lambda: objects.tensor.shrink_segments_([rng.randint(0, size) for size in objects.tensor.segment_sizes]),
        "tensor defragment": lambda: objects.tensor.defragment_segments_(),
        "tensor release_physical": lambda: objects.tensor.release_physical(),
        "tensor free": lambda: objects.tensor.free(),
        "ExtensibleKVCache()": lambda: objects.new_cache(),
        "cache commit": lambda: objects.cache.commit(blocks()),
        "cache shrink": lambda: objects.cache.commit(blocks(), shrink=True),
        "cache preserving shrink": lambda: objects.cache.commit(blocks(), shrink=True, preserve_contents=True),
        "cache defragment, preserving": lambda: objects.cache.commit(blocks(), defragment=True, preserve_contents=True),
        "cache defragment": lambda: objects.cache.commit(blocks(), defragment=True),
        "cache release_physical": lambda: objects.cache.release_physical(),
        "cache recommit": lambda: objects.cache.recommit(),
        "cache free": lambda: objects.cache.free(),
        "cache export": lambda: _exchange(objects.cache, main_exports=True),
        "cache import": lambda: _exchange(objects.cache, main_exports=False),
    }


#: Seconds either side of an exchange may take: the other side of one the
#: interrupt stopped is woken by a shutdown at once.
EXCHANGE_TIMEOUT_S = 30.0


def _exchange(cache: ExtensibleKVCache, *, main_exports: bool) -> None:
    """Export the cache to an import in this process, one side on this
    (the interrupted) thread, the other on a thread of its own; the import
    is closed at once. The export needs one chunk per segment: the
    defragment is part of the operation."""
    cache.commit(max(cache.num_committed_blocks, 1), defragment=True)
    connector = SegmentExportConnector()
    sender, receiver = socket.socketpair()
    try:
        connector.register_kv_caches(cache)

        def export() -> None:
            connector.export_to(sender, timeout=EXCHANGE_TIMEOUT_S)

        def import_and_close() -> None:
            import_segments(receiver, timeout=EXCHANGE_TIMEOUT_S).close()

        mine, theirs = (export, import_and_close) if main_exports else (import_and_close, export)
        failures: list[BaseException] = []

        def other_side() -> None:
            try:
                theirs()
            except Exception as error:  # noqa: BLE001 - the interrupted side's doing, or reported below
                failures.append(error)

        thread = threading.Thread(target=other_side, daemon=True)
        try:
            # Deferred: an interrupt inside Thread.start can leave its
            # condition's lock released twice, and the thread started unseen.
            run_deferred(thread.start)
            mine()
        except BaseException:
            for end in (sender, receiver):
                end.shutdown(socket.SHUT_RDWR)
            raise
        finally:
            # The other side must be over before anything is checked: an
            # interrupt here waits for the join (run_deferred: also one that
            # lands on the call itself).
            if thread.ident is not None:
                run_deferred(thread.join, EXCHANGE_TIMEOUT_S)
        if failures:
            raise failures[0]
    finally:
        sender.close()
        receiver.close()
        connector.close()


def _legal(name: str, objects: _Objects) -> bool:
    tensor, cache = objects.tensor, objects.cache
    if name == "ExtensibleTensor()":
        return tensor is None or tensor.is_freed
    if name == "ExtensibleKVCache()":
        return cache is None or cache.is_freed
    target = tensor if name.startswith("tensor") else cache
    return target is not None and not target.is_freed


def check_tensor(tensor: ExtensibleTensor) -> None:
    """The structural checks of the theory above, for one live tensor."""
    check_readback_matches_bookkeeping(tensor)
    granule, driver = tensor.granularity, tensor.driver
    ends = []
    for offset, size in zip(tensor.segment_offsets, tensor.segment_sizes):
        if size:
            ends.append((tensor.base + offset, tensor.base + offset + size - 1))
    owners = driver.chunks_at([address for pair in ends for address in pair])
    for index, owner in enumerate(owners):
        if owner is None:
            address = ends[index // 2][index % 2]
            raise AssertionError(f"committed byte at {address:#x} (granule {(address - tensor.base) // granule}) is not mapped")
    view = tensor.full_view()
    for first, last in ends:
        for address in (first, last):
            view[address - tensor.base] = 0x5A
            if int(view[address - tensor.base]) != 0x5A:
                raise AssertionError(f"committed byte at {address:#x} did not keep what was written")


def check_cache(cache: ExtensibleKVCache) -> None:
    check_tensor(cache.buffer)
    sizes = cache.buffer.segment_sizes
    expected = [cache.num_committed_blocks * stride for stride in cache.segment_strides]
    if sizes != expected and any(sizes):
        raise AssertionError(f"cache of {cache.num_committed_blocks} blocks has segment sizes {sizes}, expected {expected} or all 0")


def check_descriptors() -> None:
    held, counted = len(open_chunk_fds()), vmm.live_chunks["host"]
    if held != counted:
        raise AssertionError(f"{held} extkv memfds open, {counted} host chunks alive by the driver's count")


def _check(objects: _Objects, tally: InterruptTally) -> None:
    for target, check in ((objects.tensor, check_tensor), (objects.cache, check_cache)):
        if target is None or target.is_freed:
            continue
        if target.is_broken:
            tally.broken += 1
            target.free()
            continue
        check(target)
    check_descriptors()


def _disarm() -> None:
    signal.setitimer(signal.ITIMER_REAL, 0)


def run_interrupted(
    device: torch.device | str, *, inside_target: int = 1000, max_steps: int = 20000, seed: int = 0,
    layout: KVCacheLayout | None = None, stop_at_problem: bool = False,
) -> InterruptTally:
    """Drive the operations with SIGALRM armed at random delays until
    `inside_target` interrupts arrived inside extkv code (or `max_steps`, or
    with `stop_at_problem` the first inconsistency); main thread only.
    Returns the tally; the objects are freed at the end."""
    device = torch.device(device)
    rng = random.Random(seed)
    tally = InterruptTally()
    objects = _Objects(device, layout or KVCacheLayout.LHBNC)
    operations = _operations(objects, rng)
    durations: dict[str, float] = collections.defaultdict(lambda: 1e-3)
    baseline = (vmm.live_reservations[vmm.driver_for(device).kind], vmm.live_chunks["host"], len(open_chunk_fds()))

    def interrupt(number, frame) -> None:
        tally.interrupts += 1
        landed_in[:] = [_where(frame), _where(frame.f_back if frame is not None else None),
                        frame is not None and frame.f_lineno == frame.f_code.co_firstlineno]
        if lands_in_library(frame):
            tally.inside += 1
        raise Interrupted()

    landed_in: list = []  # [function, its caller, whether at the function's first instruction]
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        while tally.inside < inside_target and tally.steps < max_steps and not (stop_at_problem and tally.problems):
            tally.steps += 1
            name = rng.choice([name for name in operations if _legal(name, objects)])
            tally.operations[name] += 1
            delay = rng.uniform(0, 1.5 * durations[name])
            started = time.perf_counter()
            try:
                try:
                    signal.setitimer(signal.ITIMER_REAL, max(delay, 1e-6))
                    operations[name]()
                finally:
                    _disarm()
                durations[name] = 0.8 * durations[name] + 0.2 * (time.perf_counter() - started)
            except Interrupted:
                tally.interrupted[name] += 1
                if _dropped_an_import(*landed_in):
                    _close_dropped_imports(tally)
            except Exception as error:  # noqa: BLE001 - any other error is a finding
                tally.problems.append(f"step {tally.steps}, {name}: {type(error).__name__}: {error}")
            try:
                _check(objects, tally)
            except Interrupted:
                tally.problems.append(f"step {tally.steps}, {name}: interrupted while checking, after the timer was disarmed")
            except Exception as error:  # noqa: BLE001
                tally.problems.append(f"step {tally.steps} after {name}: {type(error).__name__}: {error}")
                for target in (objects.tensor, objects.cache):
                    _free_quietly(target, tally)
                objects.tensor = objects.cache = None
    finally:
        _disarm()
        signal.signal(signal.SIGALRM, previous)
    for target in (objects.tensor, objects.cache):
        _free_quietly(target, tally)
    left = (vmm.live_reservations[vmm.driver_for(device).kind], vmm.live_chunks["host"], len(open_chunk_fds()))
    if left != baseline:
        tally.problems.append(f"after free: (reservations, host chunks, memfds) {left}, at the start {baseline}")
    return tally


def lands_in_library(frame: FrameType | None) -> bool:
    """Whether an interrupt that arrived in `frame` (what a signal handler
    is given) landed in extkv's own code: neither in this workload and the
    rest of extkv.testing, nor in torch, the standard library or any other
    code extkv calls, which a deferral does not cover."""
    filename = frame.f_code.co_filename if frame is not None else ""
    return filename.startswith(_EXTKV_DIR) and not filename.startswith(_TESTING_DIR)


def _where(frame) -> str:
    return getattr(frame.f_code, "co_qualname", frame.f_code.co_name) if frame is not None else ""


def _dropped_an_import(function: str, caller: str, at_entry: bool) -> bool:
    """Whether the interrupt landed where the workload drops an import:
    in `import_and_close` or `close` itself, or on the first instruction of
    the `run_deferred` close calls. A call can be interrupted before its
    first line runs, as `close` can; past that first instruction
    `run_deferred` closes the import whatever lands."""
    if function.endswith(("import_and_close", "ImportedSegments.close")):
        return True
    return function == "run_deferred" and caller == "ImportedSegments.close" and at_entry


def _close_dropped_imports(tally: InterruptTally) -> None:
    """An interrupt in this module's `import_and_close`, after
    `import_segments` returned and before `close()` began, drops the
    import: the window every call that returns a resource leaves its caller
    (at the call of `close` itself, before its first line, too). Close what
    was dropped there; the workload holds no other import, so every one
    still open is such."""
    for candidate in gc.get_objects():
        if type(candidate) is ImportedSegments and not candidate.closed:
            candidate.close()
            tally.dropped_by_the_caller += 1


def _free_quietly(target, tally: InterruptTally) -> None:
    if target is None:
        return
    try:
        target.free()
    except Exception as error:  # noqa: BLE001
        tally.problems.append(f"free: {type(error).__name__}: {error}")


def _child(device: str, inside_target: int, seed: int, defect: str | None, sender) -> None:
    from . import planted

    plant = planted.DEFECTS[defect].make(vmm.driver_for(device)) if defect else contextlib.nullcontext()
    with plant:
        tally = run_interrupted(device, inside_target=inside_target, seed=seed, stop_at_problem=defect is not None)
    sender.send(tally.as_dict())


def run_in_child(device: torch.device | str, *, inside_target: int = 1000, seed: int = 0,
                 defect: str | None = None, timeout_s: float = 600) -> tuple[int | None, dict | None]:
    """`run_interrupted` in a child process (with the planted `defect`
    staged, stopping at the first problem): its exit code and tally (None
    where it died before sending one)."""
    return one_report(timeout_s, _child, str(device), inside_target, seed, defect)
