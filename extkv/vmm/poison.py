"""Poisoned physical memory around a real driver, in the spirit of MALLOC_PERTURB_.

Theory of operation
-------------------
extkv promises that newly committed bytes read zero. On the host a fresh memfd
page reads zero, and on the H200 so does a fresh CUDA chunk, whether or not
extkv zeroes anything: a test over a plain driver proves the kernel's zeroing,
not extkv's. `PoisoningDriver(inner)` behaves exactly like `inner` except that
every chunk it creates is filled with a non-zero byte before extkv sees it, so
any byte extkv forgets to zero reads as the pattern.

The fill uses only the inner driver's own protocol, identical on the host and
on CUDA: reserve scratch address space, map the new chunk there, grant access,
fill through `inner.view`, synchronize, unmap, free the scratch. The scratch
reservation goes through the inner driver's public methods, so the harness's
live counts see it if it ever outlived a fill; the chunk itself is counted
once, by this wrapper's public `create`, like any driver's.

Imported chunks are another process's memory and are never poisoned.

Like `FaultInjectingDriver`, the wrapper delegates each `_`-step to the inner
driver's `_`-step. To inject faults into poisoned memory, wrap this driver in
the fault injector, not the other way round: wrapped inside, the injector
would count the fill's own map and set-access calls.
"""

from __future__ import annotations

from typing import Hashable, Iterable

import torch

from .. import validate
from .base import Chunk, Driver

DEFAULT_POISON = 0xA5


class PoisoningDriver(Driver):
    """Wraps a driver; fills every chunk it creates with `pattern` (1..255)."""

    def __init__(self, inner: Driver, pattern: int = DEFAULT_POISON):
        if not isinstance(inner, Driver):
            raise ValueError(f"PoisoningDriver wraps a Driver, got {inner!r}")
        self.pattern = validate.integer("pattern", pattern, minimum=1, maximum=255, what="a non-zero byte")
        self.inner = inner
        self.kind = inner.kind
        self.device = inner.device
        self.granularity = inner.granularity
        self.max_reservation_bytes = inner.max_reservation_bytes
        #: Chunks and bytes filled with the pattern so far: a test that relies
        #: on poison can prove some was laid.
        self.poisoned_chunks = 0
        self.poisoned_bytes = 0

    def _create(self, size: int) -> Chunk:
        chunk = self.inner._create(size)
        try:
            self._poison(chunk)
        except BaseException:
            self.inner._release(chunk)
            raise
        return chunk

    def _poison(self, chunk: Chunk) -> None:
        inner = self.inner
        scratch = inner.reserve(chunk.size)
        try:
            inner.map(scratch, chunk)
            try:
                inner.set_access(scratch, chunk.size)
                inner.view(scratch, chunk.size).fill_(self.pattern)
                # The fill is queued on the device; unmapping under it is an
                # illegal-address fault.
                inner.synchronize()
            finally:
                inner.unmap(scratch, chunk.size)
        finally:
            inner.free_reservation(scratch, chunk.size)
        self.poisoned_chunks += 1
        self.poisoned_bytes += chunk.size

    def _reserve(self, size: int) -> int:
        return self.inner._reserve(size)

    def _free_reservation(self, address: int, size: int) -> None:
        self.inner._free_reservation(address, size)

    def _release(self, chunk: Chunk) -> None:
        self.inner._release(chunk)

    def _export_fd(self, chunk: Chunk, writable: bool) -> int:
        return self.inner._export_fd(chunk, writable)

    def _import_fd(self, fd: int, size: int) -> Chunk:
        return self.inner._import_fd(fd, size)

    def _map(self, address: int, chunk: Chunk) -> None:
        self.inner._map(address, chunk)

    def _set_access(self, address: int, size: int, writable: bool) -> None:
        self.inner._set_access(address, size, writable)

    def _unmap(self, address: int, size: int) -> None:
        self.inner._unmap(address, size)

    def synchronize(self) -> None:
        self.inner.synchronize()

    def memory_info(self) -> tuple[int, int]:
        return self.inner.memory_info()

    def reclaim_cache(self) -> bool:
        return self.inner.reclaim_cache()

    def chunk_at(self, address: int) -> Hashable | None:
        return self.inner.chunk_at(address)

    def chunks_at(self, addresses: Iterable[int]) -> list[Hashable | None]:
        return self.inner.chunks_at(addresses)

    def view(self, address: int, size: int) -> torch.Tensor:
        return self.inner.view(address, size)

    def describe(self) -> dict[str, str]:
        return {**self.inner.describe(), "poison": f"every created chunk filled with {self.pattern:#04x}"}

    def __repr__(self) -> str:
        return f"PoisoningDriver({self.inner!r}, pattern={self.pattern:#04x})"
