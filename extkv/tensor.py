"""ExtensibleTensor: one fixed reservation whose segments grow in place.

Theory of operation
-------------------
At construction the tensor reserves address space once, rounded up to the
driver's granularity; the base address then never changes until `free()`. The
reservation is cut into segments, each with a capacity, laid end to end. A
segment's *committed size* is the prefix of it that is backed by physical
memory and readable.

Physical memory is tracked per granule. `resize_segments_` grows segments: it
collects the granules the new sizes need that are not mapped yet (a granule
shared by two neighbouring segments is mapped once), merges them into maximal
runs, and backs each run with one chunk: per-chunk driver cost dominates a
commit, so one chunk per run, never one per granule. Each run is one small
transaction (create, map, grant access) that undoes its own steps if a later
step fails. Runs finished before a failure stay mapped, recorded and
accessible, and the committed sizes stay as they were, so the tensor is
consistent and a retry maps only what is still missing.

With `zero_new`, exactly the new logical bytes are zeroed on the current
stream, interleaved with mapping so the device zeroes one run while the CPU
maps the next.

`defragment_segment_` moves one segment onto a single chunk at the same
address and keeps every byte: the new chunk is filled through a scratch mapping,
then swapped in for the old chunks. Only the chunks touching that segment are
duplicated at any moment, so the transient extra memory is one segment (plus
any chunk it shares with a neighbour), not the whole tensor.

`release_physical` synchronizes the device, then unmaps and releases every
chunk; addresses stay reserved, so views and captured CUDA graphs keep valid
pointers that read again once memory is recommitted.

Lifecycle, as data: every public operation names the states it is legal in
(`_LEGAL_IN`); anything else raises `StateError` and changes nothing.
"""

from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .errors import OutOfMemoryError, StateError, require_non_negative_int
from .vmm import Chunk, Driver, driver_for


class _State(enum.Enum):
    LIVE = "live"
    FREED = "freed"


_LEGAL_IN: dict[str, frozenset[_State]] = {
    "resize_segments_": frozenset({_State.LIVE}),
    "release_physical": frozenset({_State.LIVE}),
    "full_view": frozenset({_State.LIVE}),
    "segment_view": frozenset({_State.LIVE}),
    "segments_backed_by_one_chunk": frozenset({_State.LIVE}),
    "defragment_segment_": frozenset({_State.LIVE}),
    "free": frozenset({_State.LIVE, _State.FREED}),
}


@dataclass(frozen=True)
class MappedChunk:
    """A chunk and where it is mapped: granules [first_granule, first_granule+num_granules)."""

    chunk: Chunk
    address: int
    first_granule: int
    num_granules: int


class _Undo:
    """Undo steps of one multi-step driver sequence, run in reverse on failure."""

    def __init__(self) -> None:
        self._steps: list[Callable[[], None]] = []

    def push(self, step: Callable[[], None]) -> None:
        self._steps.append(step)

    def __enter__(self) -> "_Undo":
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        if error is None:
            return
        for step in reversed(self._steps):
            try:
                step()
            except Exception as undo_error:  # keep undoing; report on the original error
                if hasattr(error, "add_note"):  # Python >= 3.11
                    error.add_note(f"while undoing: {undo_error}")


class ExtensibleTensor:
    """A reservation of `size` bytes split into segments that commit on demand.

    `device` is a torch device (cpu: host driver; cuda:N: CUDA driver), None for
    the default (CUDA if usable, else host), or a `Driver` instance.
    `segment_capacities` must sum to `size`; default is one segment of `size`.
    """

    def __init__(
        self,
        size: int,
        device: torch.device | str | int | Driver | None = None,
        segment_capacities: Sequence[int] | None = None,
    ):
        size = require_non_negative_int("size", size)
        if segment_capacities is None:
            capacities = [size]
        else:
            capacities = [require_non_negative_int(f"segment_capacities[{i}]", c) for i, c in enumerate(segment_capacities)]
            if not capacities:
                raise ValueError("segment_capacities must name at least one segment")
            if sum(capacities) != size:
                raise ValueError(f"segment_capacities sum to {sum(capacities)} bytes, expected size={size}")
        self._driver = driver_for(device)
        self.size = size
        self.segment_capacities = capacities
        offsets, end = [], 0
        for capacity in capacities:
            offsets.append(end)
            end += capacity
        self.segment_offsets = offsets
        granule = self._driver.granularity
        self.reserved_bytes = -(-max(size, 1) // granule) * granule
        self.base = self._driver.reserve(self.reserved_bytes)
        self._state = _State.LIVE
        self._sizes = [0] * len(capacities)
        self._owner: list[MappedChunk | None] = [None] * (self.reserved_bytes // granule)
        self._chunks: dict[int, MappedChunk] = {}  # by first granule
        self._unreleased: list[Chunk] = []  # unmapped, but their release failed

    # -- read-only facts ------------------------------------------------------
    @property
    def driver(self) -> Driver:
        return self._driver

    @property
    def device(self) -> torch.device:
        return self._driver.device

    @property
    def granularity(self) -> int:
        return self._driver.granularity

    @property
    def segment_sizes(self) -> list[int]:
        """Committed bytes of each segment."""
        return list(self._sizes)

    @property
    def physical_bytes(self) -> int:
        """Mapped bytes: mapped granules times the granularity."""
        return sum(m.num_granules for m in self._chunks.values()) * self.granularity

    @property
    def num_physical_chunks(self) -> int:
        return len(self._chunks)

    @property
    def mapped_chunks(self) -> list[MappedChunk]:
        """Every mapped chunk, in address order."""
        return [self._chunks[first] for first in sorted(self._chunks)]

    @property
    def is_freed(self) -> bool:
        return self._state is _State.FREED

    def __repr__(self) -> str:
        return (
            f"ExtensibleTensor(size={self.size}, device={self.device}, base={self.base:#x}, "
            f"segments={len(self._sizes)}, physical_bytes={self.physical_bytes}, state={self._state.value})"
        )

    # -- views ------------------------------------------------------------------
    def full_view(self) -> torch.Tensor:
        """uint8 tensor over the whole allocation [base, base+size)."""
        self._require("full_view")
        return self._driver.view(self.base, self.size)

    def segment_view(self, index: int) -> torch.Tensor:
        """uint8 tensor over segment `index`'s committed bytes; its storage is
        exactly that long, so consumers that size by storage see no more."""
        self._require("segment_view")
        self._check_segment_index(index)
        return self._driver.view(self.base + self.segment_offsets[index], self._sizes[index])

    def _check_segment_index(self, index) -> None:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(self._sizes):
            raise IndexError(f"segment index {index!r} out of range: the tensor has {len(self._sizes)} segment(s)")

    # -- growth -----------------------------------------------------------------
    def resize_segments_(self, sizes: Sequence[int], zero_new: bool = False) -> None:
        """Grow each segment to `sizes[i]` committed bytes (grow-only).

        Maps only granules not mapped yet, one chunk per maximal run. With
        `zero_new`, zeroes exactly the bytes that become committed.
        """
        self._require("resize_segments_")
        sizes = self._validated_sizes(sizes, grow_only=True)
        runs = self._unmapped_runs(sizes)
        new_ranges = [
            (self.base + offset + old, self.base + offset + new)
            for offset, old, new in zip(self.segment_offsets, self._sizes, sizes)
            if new > old
        ]
        zeroed_up_to = self.base
        granule = self.granularity
        for first, count in runs:
            self._map_run(first, count)
            if zero_new:
                run_end = self.base + (first + count) * granule
                self._zero(new_ranges, zeroed_up_to, run_end)
                zeroed_up_to = run_end
        if zero_new:
            self._zero(new_ranges, zeroed_up_to, self.base + self.reserved_bytes)
        self._sizes = sizes

    def _validated_sizes(self, sizes: Sequence[int], *, grow_only: bool) -> list[int]:
        try:
            sizes = list(sizes)
        except TypeError:
            raise ValueError(f"sizes must be a sequence of ints, one per segment, got {sizes!r}") from None
        if len(sizes) != len(self._sizes):
            raise ValueError(f"expected {len(self._sizes)} segment size(s), got {len(sizes)}: {sizes}")
        for i, (size, capacity) in enumerate(zip(sizes, self.segment_capacities)):
            require_non_negative_int(f"sizes[{i}]", size)
            if size > capacity:
                raise ValueError(f"sizes[{i}] = {size} exceeds segment {i}'s capacity of {capacity} bytes")
            if grow_only and size < self._sizes[i]:
                raise ValueError(
                    f"sizes[{i}] = {size} would shrink segment {i} from {self._sizes[i]} bytes; "
                    "resize_segments_ only grows (release_physical, then grow, to shrink)"
                )
        return sizes

    def _granule_span(self, offset: int, size: int) -> range:
        """Granules covering bytes [offset, offset+size) of the allocation."""
        if size == 0:
            return range(0)
        granule = self.granularity
        return range(offset // granule, -(-(offset + size) // granule))

    def _unmapped_runs(self, sizes: list[int]) -> list[tuple[int, int]]:
        """Maximal runs (first granule, count) of granules `sizes` need that are unmapped."""
        needed = sorted(
            {
                index
                for offset, old, new in zip(self.segment_offsets, self._sizes, sizes)
                if new > old
                for index in self._granule_span(offset + old, new - old)
                if self._owner[index] is None
            }
        )
        runs: list[tuple[int, int]] = []
        for index in needed:
            if runs and runs[-1][0] + runs[-1][1] == index:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((index, 1))
        return runs

    def _map_run(self, first: int, count: int) -> None:
        """Back granules [first, first+count) with one new chunk: create, map,
        grant access, each step undone if a later one fails."""
        size = count * self.granularity
        address = self.base + first * self.granularity
        with _Undo() as undo:
            chunk = self._new_chunk_mapped_at(address, size, undo)
        self._record(MappedChunk(chunk=chunk, address=address, first_granule=first, num_granules=count))

    def _record(self, mapped: MappedChunk) -> None:
        self._chunks[mapped.first_granule] = mapped
        self._owner[mapped.first_granule : mapped.first_granule + mapped.num_granules] = [mapped] * mapped.num_granules

    def _new_chunk_mapped_at(self, address: int, size: int, undo: _Undo) -> Chunk:
        """Create a chunk, map it at `address` and grant access, registering
        the undo of each step."""
        driver = self._driver
        chunk = self._create_chunk(size)
        undo.push(lambda: driver.release(chunk))
        driver.map(address, chunk)
        undo.push(lambda: driver.unmap(address, size))
        driver.set_access(address, size)
        return chunk

    def _create_chunk(self, size: int) -> Chunk:
        try:
            return self._driver.create(size)
        except OutOfMemoryError as error:
            # Memory torch's caching allocator holds but does not use may be
            # exactly what this chunk needs: return it and try once more.
            if not self._driver.reclaim_cache():
                raise
            try:
                return self._driver.create(size)
            except OutOfMemoryError as retry_error:
                raise retry_error from error

    def _zero(self, ranges: list[tuple[int, int]], start: int, end: int) -> None:
        """Zero the parts of `ranges` (absolute addresses) inside [start, end)."""
        for range_start, range_end in ranges:
            low, high = max(range_start, start), min(range_end, end)
            if low < high:
                self._driver.view(low, high - low).zero_()

    def segments_backed_by_one_chunk(self, sizes: Sequence[int]) -> list[bool]:
        """For each segment, whether its first `sizes[i]` bytes are mapped and
        all lie in one chunk (an empty prefix counts as backed)."""
        self._require("segments_backed_by_one_chunk")
        sizes = self._validated_sizes(sizes, grow_only=False)
        result = []
        for offset, size in zip(self.segment_offsets, sizes):
            owners = {id(self._owner[index]) if self._owner[index] else None for index in self._granule_span(offset, size)}
            result.append(size == 0 or (len(owners) == 1 and None not in owners))
        return result

    # -- content-preserving defragmentation ----------------------------------
    def defragment_segment_(self, index: int) -> bool:
        """Back segment `index`'s committed bytes with one chunk, keeping every
        mapped byte at its address. Returns False when it already was.

        The chunks overlapping the segment are replaced together by one new
        chunk spanning them all (a chunk shared with a neighbouring segment
        moves with it). Steps: reserve scratch address space, create the
        chunk and map it there, copy, synchronize, unmap the old chunks, map the new one
        in their place; each step is undone if a later one fails, so a failure
        leaves the old mapping and its contents in place.
        """
        self._require("defragment_segment_")
        self._check_segment_index(index)
        size = self._sizes[index]
        if self.segments_backed_by_one_chunk([size if i == index else 0 for i in range(len(self._sizes))])[index]:
            return False
        span = self._granule_span(self.segment_offsets[index], size)
        old = sorted({id(m): m for m in (self._owner[g] for g in span)}.values(), key=lambda m: m.first_granule)
        first = old[0].first_granule
        count = old[-1].first_granule + old[-1].num_granules - first
        nbytes = count * self.granularity
        address = self.base + first * self.granularity
        driver = self._driver
        with _Undo() as undo:
            scratch = driver.reserve(nbytes)
            undo.push(lambda: driver.free_reservation(scratch, nbytes))
            chunk = self._new_chunk_mapped_at(scratch, nbytes, undo)
            driver.view(scratch, nbytes).copy_(driver.view(address, nbytes))
            driver.synchronize()
            for mapped in old:
                driver.unmap(mapped.address, mapped.chunk.size)
                undo.push(lambda m=mapped: (driver.map(m.address, m.chunk), driver.set_access(m.address, m.chunk.size)))
            driver.map(address, chunk)
            undo.push(lambda: driver.unmap(address, nbytes))
            driver.set_access(address, nbytes)
        # Past this point the new mapping is in place; what is left is cleanup.
        for mapped in old:
            del self._chunks[mapped.first_granule]
        self._record(MappedChunk(chunk=chunk, address=address, first_granule=first, num_granules=count))
        self._unreleased.extend(m.chunk for m in old)
        self._release_unreleased()
        driver.unmap(scratch, nbytes)
        driver.free_reservation(scratch, nbytes)
        return True

    # -- release ----------------------------------------------------------------
    def release_physical(self) -> None:
        """Unmap and release every chunk after synchronizing the device.

        Committed sizes become 0; the reservation, base and views stay. If a
        driver step fails, what was released stays released and a retry
        continues with the rest.
        """
        self._require("release_physical")
        self._sizes = [0] * len(self._sizes)
        self._release_unreleased()
        if not self._chunks:
            return
        # Kernels still queued may touch these pages; unmapping under them is
        # an illegal-address fault.
        self._driver.synchronize()
        for first in sorted(self._chunks):
            mapped = self._chunks[first]
            self._driver.unmap(mapped.address, mapped.chunk.size)
            del self._chunks[first]
            self._owner[first : first + mapped.num_granules] = [None] * mapped.num_granules
            self._unreleased.append(mapped.chunk)
            self._release_unreleased()

    def _release_unreleased(self) -> None:
        while self._unreleased:
            self._driver.release(self._unreleased[-1])
            self._unreleased.pop()

    def free(self) -> None:
        """Release everything, the reservation included. Idempotent; views must
        not be used afterwards."""
        self._require("free")
        if self._state is _State.FREED:
            return
        self.release_physical()
        self._driver.free_reservation(self.base, self.reserved_bytes)
        self._state = _State.FREED

    def __enter__(self) -> "ExtensibleTensor":
        return self

    def __exit__(self, *exc_info) -> None:
        self.free()

    def __del__(self) -> None:
        # Freeing here could unmap memory under views that outlive this object,
        # so a forgotten free() is reported, not fixed.
        if getattr(self, "_state", _State.FREED) is _State.LIVE:
            try:
                warnings.warn(f"{self!r} was never freed; call free()", ResourceWarning, stacklevel=2)
            except Exception:
                pass

    def _require(self, operation: str) -> None:
        if self._state not in _LEGAL_IN[operation]:
            raise StateError(f"{operation}() is not allowed on a {self._state.value} ExtensibleTensor")
