"""Clocks inside the driver's steps: what of a commit's CPU time is extkv's own.

Theory of operation
-------------------
A commit's host CPU time is the driver's work (which grows with the bytes
committed) and extkv's bookkeeping around it (which must not). To tell them
apart, a clocked round wraps the calls that reach the driver and sums the
thread CPU time spent inside them (`StepClock`): `DriverClock` wraps the
steps of extkv's driver (a vmm `WrappingDriver`), `PrimitivesClock` the raw
sequence's calls, so the raw sequence's CPU time outside its calls is the
yardstick for extkv's own (what the machine adds around driver calls, such
as caches a large call evicted, shows in both). Reading a thread clock is a
system call, microseconds a step, so clocked rounds are never the timed
rounds the ratios come from: they are extra rounds of their own.

A large driver call (a 64 GiB create or access grant) walks the driver's
page bookkeeping and leaves the CPU caches and TLB cold: on the H200's host
the Python after it ran 1.3-1.9x slower than after a 64 MiB call, over a
one-segment commit, for the raw sequence's fixed four calls too. A clock
with an `evict` (`CacheEvictor`) ends every step by writing a buffer twice
the CPU's largest cache, inside the step's time, so the Python after each
step starts from equally cold caches at every size: what is left to grow
with the bytes is extkv's own work. Clocked rounds run pinned to the CPU
they start on (`pinned_to_this_cpu`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

from ..vmm.wrapping import WrappingDriver
from .sizes import GiB, KiB, MiB
from .primitives import Primitives, primitives_for
from .raw import RawStore

_libc = ctypes.CDLL(None)


class CacheEvictor:
    """Writes a host buffer twice the size of the CPU's largest cache, so
    that whatever ran before it no longer sits in any cache."""

    #: Where sysfs cannot say (or the machine has no cache hierarchy there).
    FALLBACK_CACHE_BYTES = 64 * MiB

    def __init__(self, cache_bytes: int | None = None):
        self.cache_bytes = largest_cpu_cache_bytes() if cache_bytes is None else cache_bytes
        self.size = 2 * self.cache_bytes
        self._buffer = ctypes.create_string_buffer(self.size)
        self._value = 0

    def __call__(self) -> None:
        # A new value each time: every line gets data it did not hold, so
        # no store can be dropped as silent.
        self._value = (self._value + 1) & 0xFF
        ctypes.memset(self._buffer, self._value, self.size)


def largest_cpu_cache_bytes(sysfs: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The largest cache of cpu0 in bytes, as sysfs states it ("307200K"),
    or `CacheEvictor.FALLBACK_CACHE_BYTES` where it states none."""
    units = {"K": KiB, "M": MiB, "G": GiB}
    sizes = []
    for size_file in sorted(sysfs.glob("index*/size")):
        try:
            text = size_file.read_text().strip()
        except OSError:
            continue
        if text[:-1].isdigit() and text[-1:] in units:
            sizes.append(int(text[:-1]) * units[text[-1]])
        elif text.isdigit():
            sizes.append(int(text))
    return max(sizes, default=CacheEvictor.FALLBACK_CACHE_BYTES)


@functools.lru_cache(maxsize=1)
def cache_evictor() -> CacheEvictor:
    """The process's one evictor (its buffer is hundreds of MiB)."""
    return CacheEvictor()


class StepClock:
    """Sums up the thread CPU time spent inside the steps it runs
    (`cpu_seconds`); with `evict`, calls it at the end of every step, inside
    the step's time."""

    #: A class default: the first step's `+=` gives each clock its own.
    cpu_seconds: float = 0.0
    evict: Callable[[], None] | None = None

    def _timed(self, step: Callable, *args):
        start = time.thread_time()
        try:
            return step(*args)
        finally:
            if self.evict is not None:
                self.evict()
            self.cpu_seconds += time.thread_time() - start

    @contextlib.contextmanager
    def _timed_context(self, context: contextlib.AbstractContextManager):
        """`context`, with its entering and leaving timed as steps."""
        self._timed(context.__enter__)
        try:
            yield
        finally:
            self._timed(context.__exit__, None, None, None)


class DriverClock(StepClock, WrappingDriver):
    """The real driver, with the thread CPU time spent inside its steps
    summed up: a commit's CPU time minus this is extkv's own bookkeeping,
    which must not grow with the bytes committed (the driver's does). Like
    every wrapper it maps a commit's runs step by step (so each step can be
    timed), not in the inner driver's own loop, if it has one."""

    def _reserve(self, size):
        return self._timed(self.inner._reserve, size)

    def _free_reservation(self, address, size):
        self._timed(self.inner._free_reservation, address, size)

    def _create(self, size):
        return self._timed(self.inner._create, size)

    def _release(self, chunk):
        self._timed(self.inner._release, chunk)

    def _map(self, address, chunk):
        self._timed(self.inner._map, address, chunk)

    def _set_access(self, address, size, writable):
        self._timed(self.inner._set_access, address, size, writable)

    def _unmap(self, address, size):
        self._timed(self.inner._unmap, address, size)

    def _zero(self, address, size):
        self._timed(self.inner._zero, address, size)

    def _copy(self, destination, source, size):
        self._timed(self.inner._copy, destination, source, size)

    def synchronize(self):
        self._timed(self.inner.synchronize)

    def batch(self):
        # Entering and leaving a batch is driver setup (CUDA: a context push
        # and pop, the current stream looked up), not extkv's bookkeeping.
        return self._timed_context(self.inner.batch())


class PrimitivesClock(StepClock):
    """The raw sequence's calls, with the thread CPU time inside them summed
    up as `DriverClock` does for extkv's driver."""

    def __init__(self, inner: Primitives):
        self.inner = inner
        self.device = inner.device
        self.granularity = inner.granularity

    def batch(self):
        return self._timed_context(self.inner.batch())

    def reserve(self, size):
        return self._timed(self.inner.reserve, size)

    def free_reservation(self, address, size):
        self._timed(self.inner.free_reservation, address, size)

    def create(self, size):
        return self._timed(self.inner.create, size)

    def map(self, address, chunk):
        self._timed(self.inner.map, address, chunk)

    def set_access(self, address, size):
        self._timed(self.inner.set_access, address, size)

    def zero(self, address, size):
        self._timed(self.inner.zero, address, size)

    def copy(self, destination, source, size):
        self._timed(self.inner.copy, destination, source, size)

    def unmap(self, address, size):
        self._timed(self.inner.unmap, address, size)

    def release(self, chunk):
        self._timed(self.inner.release, chunk)

    def synchronize(self):
        self._timed(self.inner.synchronize)


class ClockedRawStore(RawStore):
    """The raw sequence on clocked primitives (`PrimitivesClock`)."""

    def __init__(self, device: torch.device, strides: list[int], capacity_blocks: int):
        self.clock = PrimitivesClock(primitives_for(device))
        super().__init__(device, strides, capacity_blocks, primitives=self.clock)

    def driver_cpu_seconds(self) -> float | None:
        return self.clock.cpu_seconds


@contextlib.contextmanager
def pinned_to_this_cpu() -> Iterator[None]:
    """The calling thread kept on the CPU it runs on, then let go again. A
    clocked round is pinned: a move to another core mid-round would put the
    Python after a driver step on that core's cold caches, in some rounds
    and not others (on the H200's host, pinned and with the caches evicted,
    a one-segment commit's own CPU read 1.00x from 64 MiB to 64 GiB where
    unpinned it read 1.06x)."""
    cpu = _libc.sched_getcpu() if hasattr(os, "sched_setaffinity") else -1
    if cpu < 0:
        yield
        return
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        yield
    finally:
        os.sched_setaffinity(0, allowed)
