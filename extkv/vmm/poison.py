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

Like `FaultInjectingDriver`, it is a `WrappingDriver`: every other step goes
to the inner driver's `_`-step unchanged. To inject faults into poisoned
memory, wrap this driver in the fault injector, not the other way round:
wrapped inside, the injector would count the fill's own map and set-access
calls.
"""

from __future__ import annotations

from .. import validate
from .base import Chunk, Driver
from .wrapping import WrappingDriver

DEFAULT_POISON = 0xA5


class PoisoningDriver(WrappingDriver):
    """Wraps a driver; fills every chunk it creates with `pattern` (1..255)."""

    def __init__(self, inner: Driver, pattern: int = DEFAULT_POISON):
        super().__init__(inner)
        self.pattern = validate.integer("pattern", pattern, minimum=1, maximum=255, what="a non-zero byte")
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

    def describe(self) -> dict[str, str]:
        return {**self.inner.describe(), "poison": f"every created chunk filled with {self.pattern:#04x}"}

    def __repr__(self) -> str:
        return f"PoisoningDriver({self.inner!r}, pattern={self.pattern:#04x})"
