"""A driver that wraps another: the base of every test-facing driver wrapper.

Theory of operation
-------------------
Fault injection, poisoned memory and injected memory readings each change one
aspect of a real driver and leave the rest alone. `WrappingDriver(inner)`
forwards everything to `inner` — each `_`-step to the inner driver's
`_`-step, so that the live reservation and chunk counts are kept once, by the
wrapper's public methods, as for any driver — and a wrapper overrides only
the steps it changes. The real driver still does all the real work.
"""

from __future__ import annotations

from typing import Hashable, Iterable

import torch

from .base import Chunk, Driver
from .transaction import map_new_chunks_step_by_step


class WrappingDriver(Driver):
    """Behaves exactly like `inner`; subclasses override what they change."""

    def __init__(self, inner: Driver):
        if not isinstance(inner, Driver):
            raise ValueError(f"{type(self).__name__} wraps a Driver, got {inner!r}")
        self.inner = inner
        self.kind = inner.kind
        self.device = inner.device
        self.granularity = inner.granularity
        self.max_reservation_bytes = inner.max_reservation_bytes
        self.supports_graphs = inner.supports_graphs
        self.collective_device = inner.collective_device
        self.gpudirect_rdma = inner.gpudirect_rdma

    def _reserve(self, size: int) -> int:
        return self.inner._reserve(size)

    def _free_reservation(self, address: int, size: int) -> None:
        self.inner._free_reservation(address, size)

    def _create(self, size: int) -> Chunk:
        return self.inner._create(size)

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

    def _zero(self, address: int, size: int) -> None:
        self.inner._zero(address, size)

    def _copy(self, destination: int, source: int, size: int) -> None:
        self.inner._copy(destination, source, size)

    def _map_new_chunks(self, runs, created, give_back, zero_after) -> None:
        # Through this wrapper's own steps, never the inner driver's loop:
        # a wrapper changes steps, and a loop inside the inner driver would
        # bypass them.
        map_new_chunks_step_by_step(self, runs, created, give_back, zero_after)

    def admit(self, size: int, chunks: int = 1):
        return self.inner.admit(size, chunks)

    def batch(self):
        return self.inner.batch()

    def side_stream(self):
        return self.inner.side_stream()

    def fence(self):
        return self.inner.fence()

    def wait_for(self, fence) -> None:
        self.inner.wait_for(fence)

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

    def rdma_capable_at(self, address: int) -> bool | None:
        return self.inner.rdma_capable_at(address)

    def allocation_range_at(self, address: int) -> tuple[int, int] | None:
        return self.inner.allocation_range_at(address)

    def _export_dma_buf(self, address: int, size: int) -> int:
        return self.inner._export_dma_buf(address, size)

    def view(self, address: int, size: int) -> torch.Tensor:
        return self.inner.view(address, size)

    def usage_witness(self):
        return self.inner.usage_witness()

    def describe(self) -> dict[str, str]:
        return self.inner.describe()

    def capture_graph(self, step, *, warm=None, pool=None):
        return self.inner.capture_graph(step, warm=warm, pool=pool)

    def is_capturing(self) -> bool:
        return self.inner.is_capturing()

    def refuse_partly_backed(self, fd: int, what: str) -> None:
        self.inner.refuse_partly_backed(fd, what)

    def device_identity(self) -> dict:
        return self.inner.device_identity()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"
