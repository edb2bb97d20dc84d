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
`Transaction` (extkv.vmm: create, map, grant access) that undoes its own
steps if a later step fails. Runs finished before a failure stay mapped,
recorded and accessible, and the committed sizes stay as they were, so the
tensor is consistent and a retry maps only what is still missing.

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

Cleanup that cannot be undone (releasing chunks a defragmentation replaced,
unmapping and freeing its scratch reservation) is recorded before it is tried.
A step that fails stays recorded and is retried by the next `release_physical`
or `free`, so no path leaves a chunk, mapping or reservation behind. A chunk
whose release fails while a transaction is undone joins the same record
(extkv.vmm.UnreleasedChunks).

Threads: every state-changing operation holds the tensor's `lock` (one
re-entrant lock per reservation) from its first check to its last driver call,
so operations from several threads run one after another and each sees the
state the previous one left. Reads are not blocked by a long commit: committed
sizes and mapped chunks are replaced, never edited in place, so a reader sees
the state before or after an operation, never half of one. A view taken while
another thread releases memory reads unmapped pages, as it would from one
thread: ordering release against use is the caller's job.

Lifecycle, as data: every public operation names the states it is legal in
(`_LEGAL_IN`); anything else raises `StateError` and changes nothing.
"""

from __future__ import annotations

import enum
import functools
import threading
import warnings
from dataclasses import dataclass
from typing import Sequence

import torch

from . import validate
from .errors import OutOfMemoryError, StateError
from .vmm import Chunk, Driver, Transaction, UnreleasedChunks, driver_for


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


def _operation(method):
    """Run `method` holding the tensor's lock, once its state allows it."""
    name = method.__name__

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self.lock:
            self._require(name)
            return method(self, *args, **kwargs)

    return locked


class ReservationView(torch.Tensor):
    """The uint8 tensor `full_view` returns: a plain tensor in every use, but
    its repr reads no element, since most of a reservation is unmapped and
    reading there kills the process. Operations on it return plain tensors."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"ReservationView({self.numel()} bytes at {self.data_ptr():#x}, device={self.device})"


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
        driver = driver_for(device)
        # Bounded before any driver call: a size past the address space would
        # otherwise reach C truncated.
        limit = driver.max_reservation_bytes
        size = validate.integer("size", size, maximum=limit)
        if segment_capacities is None:
            capacities = [size]
        else:
            capacities = [
                validate.integer(f"segment_capacities[{i}]", c, maximum=limit)
                for i, c in enumerate(segment_capacities)
            ]
            if not capacities:
                raise ValueError("segment_capacities must name at least one segment")
            if sum(capacities) != size:
                raise ValueError(f"segment_capacities sum to {sum(capacities)} bytes, expected size={size}")
        self._driver = driver
        #: Held by every state-changing operation; re-entrant, so a caller
        #: may hold it around several operations that must not interleave.
        self.lock = threading.RLock()
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
        self._unreleased = UnreleasedChunks(driver)  # unmapped, not yet released
        # Scratch reservations of defragmentation not yet freed: (address,
        # size, whether the new chunk is still mapped there).
        self._scratch: list[tuple[int, int, bool]] = []

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
        return sorted(self._chunks.values(), key=lambda mapped: mapped.first_granule)

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
        """uint8 tensor over the whole allocation [base, base+size).

        Most of it may be unmapped: reading there faults (SIGSEGV on the host,
        an illegal address on a GPU). Its repr names the range and reads
        nothing, but views derived from it are plain tensors whose repr reads
        every element, so never print one that reaches uncommitted blocks."""
        self._require("full_view")
        return self._driver.view(self.base, self.size).as_subclass(ReservationView)

    def segment_view(self, index: int) -> torch.Tensor:
        """uint8 tensor over segment `index`'s committed bytes; its storage is
        exactly that long, so consumers that size by storage see no more."""
        self._require("segment_view")
        index = self._checked_segment_index(index)
        return self._driver.view(self.base + self.segment_offsets[index], self._sizes[index])

    def _checked_segment_index(self, index) -> int:
        try:
            return validate.integer("segment index", index, maximum=len(self._sizes) - 1)
        except ValueError as error:
            raise IndexError(f"{error}: the tensor has {len(self._sizes)} segment(s)") from None

    # -- growth -----------------------------------------------------------------
    @_operation
    def resize_segments_(self, sizes: Sequence[int], zero_new: bool = False) -> None:
        """Grow each segment to `sizes[i]` committed bytes (grow-only).

        Maps only granules not mapped yet, one chunk per maximal run. With
        `zero_new`, zeroes exactly the bytes that become committed.
        """
        zero_new = validate.flag("zero_new", zero_new)
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
        checked = []
        for i, (size, capacity) in enumerate(zip(sizes, self.segment_capacities)):
            size = validate.integer(f"sizes[{i}]", size)
            if size > capacity:
                raise ValueError(f"sizes[{i}] = {size} exceeds segment {i}'s capacity of {capacity} bytes")
            if grow_only and size < self._sizes[i]:
                raise ValueError(
                    f"sizes[{i}] = {size} would shrink segment {i} from {self._sizes[i]} bytes; "
                    "resize_segments_ only grows (release_physical, then grow, to shrink)"
                )
            checked.append(size)
        return checked

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
        with Transaction() as transaction:
            chunk = self._new_chunk_mapped_at(address, size, transaction)
        self._publish(added=[MappedChunk(chunk=chunk, address=address, first_granule=first, num_granules=count)])

    def _publish(self, *, added: Sequence[MappedChunk] = (), removed: Sequence[MappedChunk] = ()) -> None:
        """Record a change of mapping. `_chunks` is replaced, never edited, so
        a reader in another thread iterates a whole state."""
        chunks = dict(self._chunks)
        for mapped in removed:
            del chunks[mapped.first_granule]
            self._owner[mapped.first_granule : mapped.first_granule + mapped.num_granules] = [None] * mapped.num_granules
        for mapped in added:
            chunks[mapped.first_granule] = mapped
            self._owner[mapped.first_granule : mapped.first_granule + mapped.num_granules] = [mapped] * mapped.num_granules
        self._chunks = chunks

    def _new_chunk_mapped_at(self, address: int, size: int, transaction: Transaction) -> Chunk:
        """Create a chunk, map it at `address` and grant access, registering
        the undo of each step with `transaction`."""
        driver = self._driver
        chunk = self._create_chunk(size)
        transaction.push(lambda: self._unreleased.release(chunk))
        driver.map(address, chunk)
        transaction.push(lambda: driver.unmap(address, size))
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

    @_operation
    def segments_backed_by_one_chunk(self, sizes: Sequence[int]) -> list[bool]:
        """For each segment, whether its first `sizes[i]` bytes are mapped and
        all lie in one chunk (an empty prefix counts as backed)."""
        sizes = self._validated_sizes(sizes, grow_only=False)
        return [self._backed_by_one_chunk(offset, size) for offset, size in zip(self.segment_offsets, sizes)]

    def _backed_by_one_chunk(self, offset: int, size: int) -> bool:
        owners = {id(self._owner[index]) if self._owner[index] else None for index in self._granule_span(offset, size)}
        return size == 0 or (len(owners) == 1 and None not in owners)

    # -- content-preserving defragmentation ----------------------------------
    @_operation
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
        index = self._checked_segment_index(index)
        offset, size = self.segment_offsets[index], self._sizes[index]
        if self._backed_by_one_chunk(offset, size):
            return False
        span = self._granule_span(offset, size)
        old = sorted({id(m): m for m in (self._owner[g] for g in span)}.values(), key=lambda m: m.first_granule)
        first = old[0].first_granule
        count = old[-1].first_granule + old[-1].num_granules - first
        nbytes = count * self.granularity
        address = self.base + first * self.granularity
        driver = self._driver
        with Transaction() as transaction:
            scratch = driver.reserve(nbytes)
            transaction.push(lambda: driver.free_reservation(scratch, nbytes))
            chunk = self._new_chunk_mapped_at(scratch, nbytes, transaction)
            driver.view(scratch, nbytes).copy_(driver.view(address, nbytes))
            driver.synchronize()
            for mapped in old:
                driver.unmap(mapped.address, mapped.chunk.size)
                transaction.push(
                    lambda m=mapped: (driver.map(m.address, m.chunk), driver.set_access(m.address, m.chunk.size))
                )
            driver.map(address, chunk)
            transaction.push(lambda: driver.unmap(address, nbytes))
            driver.set_access(address, nbytes)
        # The new mapping is in place. What is left cannot be undone, only
        # finished: record it all first, so a failing step is retried later.
        self._publish(
            removed=old, added=[MappedChunk(chunk=chunk, address=address, first_granule=first, num_granules=count)]
        )
        self._unreleased.keep(m.chunk for m in old)
        self._scratch.append((scratch, nbytes, True))
        self._finish_cleanup()
        return True

    # -- release ----------------------------------------------------------------
    @_operation
    def release_physical(self) -> None:
        """Unmap and release every chunk after synchronizing the device.

        Committed sizes become 0; the reservation, base and views stay. If a
        driver step fails, what was released stays released and a retry
        continues with the rest.
        """
        self._sizes = [0] * len(self._sizes)
        self._finish_cleanup()
        if not self._chunks:
            return
        # Kernels still queued may touch these pages; unmapping under them is
        # an illegal-address fault.
        self._driver.synchronize()
        unmapped: list[MappedChunk] = []
        try:
            for mapped in self.mapped_chunks:
                self._driver.unmap(mapped.address, mapped.chunk.size)
                unmapped.append(mapped)
        finally:
            self._publish(removed=unmapped)
            self._unreleased.keep(mapped.chunk for mapped in unmapped)
        self._unreleased.retry()

    def _free_scratch(self) -> None:
        while self._scratch:
            address, size, mapped = self._scratch[-1]
            if mapped:
                self._driver.unmap(address, size)
                self._scratch[-1] = (address, size, False)
            self._driver.free_reservation(address, size)
            self._scratch.pop()

    def _finish_cleanup(self) -> None:
        """Release recorded chunks and free recorded scratch reservations,
        trying both even if one fails; the first failure is raised."""
        failure: Exception | None = None
        for step in (self._unreleased.retry, self._free_scratch):
            try:
                step()
            except Exception as error:
                failure = failure or error
        if failure is not None:
            raise failure

    @_operation
    def free(self) -> None:
        """Release everything, the reservation included. Idempotent; views must
        not be used afterwards."""
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
