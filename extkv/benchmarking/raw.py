"""The raw driver sequence: a commit's work in the driver's calls and nothing else.

Theory of operation
-------------------
`RawStore` is what extkv's commit is held against: per segment,
interleaved, create one chunk for the new granules, map it, grant access,
zero the new bytes; one chunk per segment per commit; each segment at a
granule-aligned offset of one reservation (so a segment smaller than a
granule maps a whole one, where extkv's neighbours share it). Release
unmaps and releases every chunk; recommit grows again to the blocks
released; shrink is release and growth to the smaller count.

`RawStore.defragment(preserve=True)` is the raw floor of a preserving
defragment: per segment create one chunk, map it in one scratch reservation
and copy the segment into it; one synchronize for all; then per segment
unmap the old chunks and map the new one in their place. It holds the whole
copy at once (twice the memory, where extkv moves one segment at a time):
it is the create + device copy floor the target is stated against.

`GranuleStore` is the same sequence with one handle per granule, as
page-based designs (kvcached, vAttention) map. `MapOnlyStore` and
`ZeroOnlyStore` are its two halves apart, the driver's calls and the
zeroing, which the growth loop runs beside its steps
(extkv.benchmarking.growth_loop).

The sequence calls `primitives` (extkv.benchmarking.primitives): the timed
raw calls of the device by default, or any vmm driver, so the tests run it
over a `PoisoningDriver` and prove it zeroes exactly the bytes it adds, and
a stress run can run it over a fault injector.
"""

from __future__ import annotations

import torch

from ..vmm.base import Chunk
from ..vmm.dlpack import uint8_view
from .primitives import Primitives, primitives_for
from .store import Store


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class RawStore(Store):
    """The best raw driver sequence: one chunk per segment per commit."""

    what = "raw driver sequence: per segment create, map, set access, zero; one chunk per segment"
    #: Whether growth zeroes the new bytes (MapOnlyStore's does not).
    zeroes_new = True

    def __init__(self, device, strides, capacity_blocks, primitives: Primitives | None = None):
        super().__init__(device, strides, capacity_blocks)
        #: The device's raw calls, or the driver a test passes.
        self.prims = primitives or primitives_for(self.device)
        g = self.prims.granularity
        self.offsets, end = [], 0
        for stride in self.strides:
            self.offsets.append(end)
            end += _round_up(stride * capacity_blocks, g)
        self.reserved_bytes = end
        self.base: int | None = None
        self._sizes = [0] * len(self.strides)
        self._mapped = [0] * len(self.strides)
        #: Per segment: (address, chunk) of each mapped chunk.
        self.chunks: list[list[tuple[int, Chunk]]] = [[] for _ in self.strides]

    def open(self) -> None:
        with self.prims.batch():
            self.base = self.prims.reserve(self.reserved_bytes)

    def _chunk_bytes(self, size: int) -> int:
        """Bytes per chunk when `size` new bytes are mapped: all in one."""
        return size

    def _map_new(self, segment: int, address: int, size: int) -> None:
        prims, step = self.prims, self._chunk_bytes(size)
        for start in range(address, address + size, step):
            chunk = prims.create(step)
            prims.map(start, chunk)
            prims.set_access(start, step)
            self.chunks[segment].append((start, chunk))

    def grow(self, blocks: int) -> None:
        prims, g = self.prims, self.prims.granularity
        with prims.batch():
            for i, stride in enumerate(self.strides):
                old, new = self._sizes[i], blocks * stride
                if new <= old:
                    continue
                start = self.base + self.offsets[i]
                wanted = _round_up(new, g)
                if wanted > self._mapped[i]:
                    self._map_new(i, start + self._mapped[i], wanted - self._mapped[i])
                    self._mapped[i] = wanted
                if self.zeroes_new:
                    prims.zero(start + old, new - old)
                self._sizes[i] = new
        self.blocks = max(self.blocks, blocks)

    def release(self) -> None:
        prims = self.prims
        with prims.batch():
            prims.synchronize()
            for chunks in self.chunks:
                for address, chunk in chunks:
                    prims.unmap(address, chunk.size)
                    prims.release(chunk)
                chunks.clear()
        self._sizes = [0] * len(self.strides)
        self._mapped = [0] * len(self.strides)
        self._released_blocks, self.blocks = self.blocks, 0

    def recommit(self) -> None:
        self.grow(self._released_blocks)

    def shrink(self, blocks: int) -> None:
        self.release()
        self.grow(blocks)

    def defragment(self, preserve: bool) -> None:
        """Make every segment one chunk; a segment that is one already
        stays as it is, as extkv's does."""
        fragmented = [len(chunks) > 1 for chunks in self.chunks]
        if not any(fragmented):
            return
        blocks = self.blocks
        if not preserve:
            self.release()
            self.grow(blocks)
            return
        prims = self.prims
        total = sum(size for size, moves in zip(self._mapped, fragmented) if moves)
        with prims.batch():
            scratch = prims.reserve(total)
            moved: list[tuple[int, Chunk] | None] = []
            offset = 0
            for i, size in enumerate(self._mapped):
                if not fragmented[i]:
                    moved.append(None)
                    continue
                chunk = prims.create(size)
                prims.map(scratch + offset, chunk)
                prims.set_access(scratch + offset, size)
                prims.copy(scratch + offset, self.base + self.offsets[i], size)
                moved.append((scratch + offset, chunk))
                offset += size
            prims.synchronize()
            for i, new in enumerate(moved):
                if new is None:
                    continue
                _, chunk = new
                for address, old in self.chunks[i]:
                    prims.unmap(address, old.size)
                    prims.release(old)
                start = self.base + self.offsets[i]
                prims.map(start, chunk)
                prims.set_access(start, chunk.size)
                self.chunks[i] = [(start, chunk)]
            for new in moved:
                if new is not None:
                    prims.unmap(new[0], new[1].size)
            prims.free_reservation(scratch, total)

    def views(self) -> list[torch.Tensor]:
        return [uint8_view(self.base + offset, size, self.device) for offset, size in zip(self.offsets, self._sizes)]

    def close(self) -> None:
        super().close()
        if self.base is None:
            return
        self.release()
        with self.prims.batch():
            self.prims.free_reservation(self.base, self.reserved_bytes)
        self.base = None


class MapOnlyStore(RawStore):
    """The raw sequence's driver calls alone: growth creates, maps and sets
    access for the new granules, and zeroes nothing."""

    what = "raw driver calls alone: per segment create, map, set access; nothing zeroed"
    zeroes_new = False


class ZeroOnlyStore(RawStore):
    """The raw sequence's zeroing alone: every granule is mapped when the
    store opens, so growth finds nothing to map and zeroes the new bytes of
    each segment."""

    what = "raw zeroing alone: the new bytes of each segment, on memory mapped before"

    def open(self) -> None:
        super().open()
        with self.prims.batch():
            for i, stride in enumerate(self.strides):
                size = _round_up(self.capacity_blocks * stride, self.prims.granularity)
                self._map_new(i, self.base + self.offsets[i], size)
                self._mapped[i] = size


class GranuleStore(RawStore):
    """One handle per granule, as page-based designs (kvcached, vAttention) map."""

    what = "one handle per 2 MiB granule (kvcached / vAttention strategy): create, map, set access per granule"

    def _chunk_bytes(self, size: int) -> int:
        return self.prims.granularity
