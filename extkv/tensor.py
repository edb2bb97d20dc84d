"""ExtensibleTensor: one fixed reservation whose segments grow in place.

Theory of operation
-------------------
At construction the tensor reserves address space once, rounded up to the
driver's granularity; the base address then never changes until `free()`. The
reservation is cut into segments, each with a capacity, laid end to end. A
segment's *committed size* is the prefix of it that is backed by physical
memory and readable.

Physical memory is tracked as runs, not granules: the mapped chunks in
address order (`_Mapping`, bisected by first granule), so every question a
resize, a defragmentation or a connector asks costs O(log chunks + chunks
touched), whatever the number of granules; a change that adds or removes a
few chunks among many places each by bisection and copies the rest as
slices, so a cache grown in many small commits runs no Python per chunk it
already holds. `resize_segments_` grows segments:
the granule spans the new sizes need are merged in one pass over the
segments (a granule shared by two neighbouring segments is needed once), the
mapped chunks are subtracted from them, and each maximal unmapped run is
backed by one chunk: per-chunk driver cost dominates a commit, so one chunk
per run, never one per granule. One exception, for overlap: a run that spans
several whole segments is cut at granule-aligned segment boundaries into
chunks of at least `pipelined_chunk_bytes` (1 GiB by default), so the device
zeroes one chunk while the CPU creates and maps the next; one chunk of 32 GiB
would make the device wait for its whole creation first. A cut never falls
inside a segment, so each segment a commit maps whole still lies in one
chunk. A run takes three driver steps (create, map, grant access); the
tensor plans every run and hands the plan to the driver in one call
(`Driver.map_new_chunks`), which undoes the steps of the run a failure hits
and reports the runs finished before it. Those stay mapped, recorded and
accessible, and the committed sizes stay as they were, so the tensor is
consistent and a retry maps only what is still missing. A one-segment
tensor needs no planner while its mapped granules are one gapless prefix
covering its committed bytes, as every change but one leaves them (a
shrink keeping contents leaves it longer than the committed bytes, and
releases from the top): a growth then maps at most one run, from where
the mapping ends. The exception is a release that fails part way, which
leaves the chunks above the failure mapped over a gap; while a gap
remains, growth goes through the planner, which maps it.

With `zero_new`, exactly the new logical bytes are zeroed on the current
stream, interleaved with mapping: each run carries the new bytes below its
end not zeroed yet, so the device zeroes one run while the CPU maps the
next. The new byte ranges and the runs are both in address order, so one
merge walk plans them (`_runs_with_zeroing`): one driver memset per new
range per run it crosses, no tensor built per range; new bytes in granules
mapped before are zeroed once every run stands. The whole commit is one
driver call (`Driver.map_new_chunks`: one CUDA context push, one stream
lookup): on a small commit, each Python call between two driver calls runs
on CPU caches the driver's work left cold, and costs as much as a step.

`defragment_segments_` moves segments onto a single chunk each at the same
addresses and keeps every byte: each segment's chunks are copied into a new
chunk through a scratch mapping, then the new chunk is swapped in for the old
ones. Segments are moved in batches of at most `DEFRAGMENT_BATCH_BYTES`
(or one segment, if larger) through one scratch reservation reused for every
batch, with one synchronize per batch: a swap unmaps the old chunks, so the
copies out of them must be finished first, but copies of different segments
of one batch never depend on each other, so one wait covers them all. The
chunks a batch replaced are released while the next batch's copies run
(releasing costs about as much as copying, so neither waits for the other),
and the transient extra memory is at most two batches, not the whole tensor.
A segment that shares a chunk with its neighbour moves together with it.

`release_physical` synchronizes the device, then unmaps each chunk and
releases it at once; addresses stay reserved, so views and captured CUDA
graphs keep valid pointers that read again once memory is recommitted.
`shrink_segments_` is a release from the top that keeps what stays
committed: the sizes drop first, then every chunk holding no byte below
any segment's new size is unmapped and released, highest first. A chunk
holding some stays mapped whole (an unmap takes whole mappings only), and
a later growth zeroes the bytes of it that become committed again, as
`zero_new` zeroes every new logical byte, mapped before or not.

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

Signals: every state-changing operation, and the constructor from its
reserve on, runs with Python's signal handlers deferred
(extkv.deferred_signals): a handler that raises (Ctrl-C, a timeout, a
SIGTERM handler) runs once the operation has completed or failed cleanly,
never between a driver step and its bookkeeping. A constructor whose
deferred handler raises frees what it reserved, since the caller never
receives the object.

Lifecycle, as data: every public operation names the states it is legal in
(`_LEGAL_IN`); anything else raises `StateError` and changes nothing. A
tensor is live until `free`, or broken: when a failed step's undo fails too
(two driver failures in one operation), the driver may map what the
bookkeeping does not record, or not map what it does, and no further step
could be trusted. The error says so, every operation but `free` is refused,
and `free` unmaps what the driver shows mapped in the reservation rather
than what the bookkeeping says (cuMemUnmap takes only a whole range that is
mapped, and a mapping nobody recorded would outlive the reservation).
"""

from __future__ import annotations

import bisect
import enum
import functools
import operator
import os
import threading
import warnings
import weakref
from typing import NamedTuple, Sequence

import torch

from . import validate
from .deferred_signals import deferred_signals
from .errors import OutOfMemoryError, StateError
from .vmm import Chunk, Driver, Transaction, UnreleasedChunks, driver_for, undo_failed


_DEFERRED_SIGNALS = deferred_signals()


class _State(enum.Enum):
    LIVE = "live"
    #: A step's undo failed: the bookkeeping no longer says what the driver maps.
    BROKEN = "broken"
    #: The copy a forked child holds: none of the memory is mapped there.
    INHERITED = "inherited"
    FREED = "freed"


_LEGAL_IN: dict[str, frozenset[_State]] = {
    "resize_segments_": frozenset({_State.LIVE}),
    "grow_blocks_": frozenset({_State.LIVE}),
    "release_physical": frozenset({_State.LIVE}),
    "shrink_segments_": frozenset({_State.LIVE}),
    "physical_bytes_after_shrink": frozenset({_State.LIVE}),
    "full_view": frozenset({_State.LIVE}),
    "segment_view": frozenset({_State.LIVE}),
    "segments_backed_by_one_chunk": frozenset({_State.LIVE}),
    "defragment_segment_": frozenset({_State.LIVE}),
    "defragment_segments_": frozenset({_State.LIVE}),
    "free": frozenset({_State.LIVE, _State.BROKEN, _State.INHERITED, _State.FREED}),
}

#: Every tensor not yet freed, so that a forked child can mark its copies inherited.
_TENSORS: "weakref.WeakSet[ExtensibleTensor]" = weakref.WeakSet()


def _inherit_after_fork() -> None:
    """In a forked child: no tensor of the parent is the child's. Its chunks
    are not mapped there (the drivers see to that: MADV_DONTFORK on the
    host, and CUDA does not survive a fork), and a lock another thread held
    at the fork would never be released in the child."""
    for tensor in list(_TENSORS):
        if tensor._state in (_State.LIVE, _State.BROKEN):
            tensor._state = _State.INHERITED
            tensor.lock = threading.RLock()


os.register_at_fork(after_in_child=_inherit_after_fork)


class MappedChunk(NamedTuple):
    """A chunk and where it is mapped: granules [first_granule, first_granule+num_granules).

    Immutable; a tuple because a commit makes one per chunk, thousands per
    call, and a frozen dataclass costs several times as much to build."""

    chunk: Chunk
    address: int
    first_granule: int
    num_granules: int

    @property
    def end_granule(self) -> int:
        return self.first_granule + self.num_granules


#: Smallest chunk a run spanning several segments is cut into: zeroing 1 GiB
#: (~0.3 ms on an H200) outlasts creating and mapping the next chunk (~0.1
#: ms), so the device never waits for the CPU after the first chunk.
PIPELINED_CHUNK_BYTES = 1 << 30


#: Bytes moved per batch of a content-preserving defragmentation (a larger
#: segment is moved alone); at most two batches are extra memory at once.
#: The copies of one batch share one synchronize, and 1 GiB of copies
#: (~0.5 ms on an H200) hides its latency.
DEFRAGMENT_BATCH_BYTES = 1 << 30


_FIRST_GRANULE = operator.attrgetter("first_granule")
_NUM_GRANULES = operator.attrgetter("num_granules")


#: A change adding (removing) k chunks among more than this many times k
#: mapped ones splices them in (cuts them out) by bisection, `_spliced`
#: (`_without`), rather than sorting (filtering): those call Python code on
#: every chunk mapped, and a cache grown in many small commits of many
#: segments maps thousands (on the host, 256 chunks into 16,128: 0.82 ms
#: sorted, 0.29 ms spliced; into 256: 0.07 ms sorted, 0.14 ms spliced).
_SPLICE_FROM = 8


def _spliced(chunks: list[MappedChunk], starts: list[int], added: Sequence[MappedChunk]) -> tuple[list, list]:
    """`chunks` (with their `starts`) and `added`, both in address order,
    merged: each added chunk lands where a bisect of `starts` puts it, and
    the runs of mapped chunks between are copied as slices, without a
    Python call per mapped chunk."""
    merged, merged_starts, done, count = [], [], 0, len(chunks)
    for mapped in added:
        at = bisect.bisect_right(starts, mapped.first_granule, done, count)
        merged += chunks[done:at]
        merged.append(mapped)
        merged_starts += starts[done:at]
        merged_starts.append(mapped.first_granule)
        done = at
    merged += chunks[done:]
    merged_starts += starts[done:]
    return merged, merged_starts


def _without(chunks: list[MappedChunk], starts: list[int], removed: Sequence[MappedChunk]) -> tuple[list, list]:
    """`chunks` (with their `starts`) less `removed`, every one of which is
    among them: no two mapped chunks start on one granule, so a bisect finds
    each, and the runs kept between are copied as slices."""
    kept, kept_starts, done = [], [], 0
    for at in sorted(bisect.bisect_left(starts, mapped.first_granule) for mapped in removed):
        kept += chunks[done:at]
        kept_starts += starts[done:at]
        done = at + 1
    kept += chunks[done:]
    kept_starts += starts[done:]
    return kept, kept_starts


class _Mapping:
    """Mapped chunks in address order. A change builds a new `_Mapping`, so
    a reader holding one sees a whole state.

    Growth at the end, the common change, appends to the lists the newest
    mapping shares with the one before it instead of copying them (a commit
    of one block into a cache of thousands of chunks must not copy them
    all): each mapping reads only its own first `count` entries, so an older
    one never sees what was appended after it. Every other change builds new
    lists with C-level copies, and sorts or splices only."""

    __slots__ = ("_chunks", "_starts", "count", "granules", "end_granule")

    def __init__(self, chunks: list[MappedChunk] | None = None, starts: list[int] | None = None, granules: int = 0):
        self._chunks = [] if chunks is None else chunks
        self._starts = [] if starts is None else starts  # first granule of each chunk, for bisect
        self.count = count = len(self._chunks)
        self.granules = granules
        #: The granule after the highest mapped one (0 when nothing is).
        self.end_granule = self._chunks[count - 1].first_granule + self._chunks[count - 1].num_granules if count else 0

    @property
    def chunks(self) -> list[MappedChunk]:
        """A copy of this state's chunks, in address order."""
        return self._chunks[: self.count]

    def changed(self, *, added: Sequence[MappedChunk] = (), removed: Sequence[MappedChunk] = ()) -> "_Mapping":
        chunks, starts, granules = self._chunks, self._starts, self.granules
        if len(chunks) != self.count:  # a newer mapping appended already: never share
            chunks, starts = chunks[: self.count], starts[: self.count]
        if removed:
            if len(chunks) > _SPLICE_FROM * len(removed):  # a defragmentation's batch among many
                chunks, starts = _without(chunks, starts, removed)
            else:
                gone = set(map(id, removed))
                chunks = [mapped for mapped in chunks if id(mapped) not in gone]
                starts = list(map(_FIRST_GRANULE, chunks))
            granules -= sum(map(_NUM_GRANULES, removed))
        if added:
            if len(added) > 1:
                added = sorted(added, key=_FIRST_GRANULE)
            granules += sum(map(_NUM_GRANULES, added))
            if not chunks or chunks[-1].first_granule < added[0].first_granule:
                chunks.extend(added)
                starts.extend(map(_FIRST_GRANULE, added))
            elif len(chunks) > _SPLICE_FROM * len(added):
                chunks, starts = _spliced(chunks, starts, added)
            else:
                # Two sorted runs: Timsort merges them in linear time.
                chunks = sorted(chunks + list(added), key=_FIRST_GRANULE)
                starts = list(map(_FIRST_GRANULE, chunks))
        return _Mapping(chunks, starts, granules)

    def appended(self, mapped: MappedChunk) -> "_Mapping":
        """`changed(added=[mapped])` for a chunk past every mapped one."""
        chunks, starts = self._chunks, self._starts
        if len(chunks) != self.count:  # a newer mapping appended already: never share
            chunks, starts = chunks[: self.count], starts[: self.count]
        chunks.append(mapped)
        starts.append(mapped.first_granule)
        return _Mapping(chunks, starts, self.granules + mapped.num_granules)

    def _first_ending_after(self, first: int) -> int:
        """Index of the first chunk that maps granule `first` or a later one."""
        index = bisect.bisect_right(self._starts, first, 0, self.count) - 1
        if index < 0 or self._chunks[index].end_granule <= first:
            index += 1
        return index

    def overlapping(self, first: int, end: int) -> list[MappedChunk]:
        """Chunks that map any granule of [first, end), in address order."""
        chunks, count, index = self._chunks, self.count, self._first_ending_after(first)
        found = []
        while index < count and chunks[index].first_granule < end:
            found.append(chunks[index])
            index += 1
        return found

    def gaps(self, spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """Unmapped runs (first granule, count) inside the granule spans
        [first, end) of `spans` (disjoint, in address order), in address
        order. One bisect per span, then only the chunks inside it."""
        chunks, starts, count, bisect_right, runs = self._chunks, self._starts, self.count, bisect.bisect_right, []
        mapped_to = self.end_granule
        for first, end in spans:
            if first >= mapped_to:  # past everything mapped: growth at the end, the common case
                runs.append((first, end - first))
                continue
            # From the last chunk starting at or before `first`: it may cover it.
            index, at = max(bisect_right(starts, first, 0, count) - 1, 0), first
            while index < count:
                mapped = chunks[index]
                mapped_first = mapped.first_granule
                if mapped_first >= end:
                    break
                if mapped_first > at:
                    runs.append((at, mapped_first - at))
                mapped_end = mapped_first + mapped.num_granules
                if mapped_end > at:
                    at = mapped_end
                    if at >= end:
                        break
                index += 1
            if at < end:
                runs.append((at, end - at))
        return runs


def _runs_with_zeroing(
    runs: list[tuple[int, int]], ranges: Sequence[tuple[int, int]], base: int, granule: int
) -> tuple[list[tuple[int, int, list[tuple[int, int]]]], list[tuple[int, int]]]:
    """The plan of a commit: each run (first granule, count) as `(address,
    bytes, what to zero once it is mapped)`, where what to zero is the part
    of the byte ranges `ranges` (absolute, disjoint, in address order) below
    the run's end not given to an earlier run; and what is left of `ranges`
    after the last run (in granules mapped before the commit). One merge
    walk: each range is visited once over all runs, O(ranges + runs)."""
    plan, index, done_to, count = [], 0, 0, len(ranges)
    for first, granules in runs:
        address, size = base + first * granule, granules * granule
        end, zero = address + size, []
        while index < count:
            low, high = ranges[index]
            if low < done_to:
                low = done_to
            if low >= end:
                break
            top = high if high < end else end
            zero.append((low, top - low))
            done_to = top
            if top < high:
                break
            index += 1
        plan.append((address, size, zero))
    rest = [(low, high - low) for low, high in ranges[index:count]]
    if rest and done_to > rest[0][0]:  # the first range left was partly given to the last run
        rest[0] = (done_to, ranges[index][1] - done_to)
    return plan, rest


def _checked_strides(strides: Sequence[int], capacities: list[int]) -> list[int]:
    try:
        strides = list(strides)
    except TypeError:
        raise ValueError(f"segment_strides must be a sequence of ints, one per segment, got {strides!r}") from None
    if len(strides) != len(capacities):
        raise ValueError(f"segment_strides has {len(strides)} entries, expected one per segment ({len(capacities)})")
    checked = [validate.integer(f"segment_strides[{i}]", stride, what="bytes per block") for i, stride in enumerate(strides)]
    for i, (stride, capacity) in enumerate(zip(checked, capacities)):
        if stride > capacity:
            raise ValueError(f"segment_strides[{i}] = {stride} exceeds segment {i}'s capacity of {capacity} bytes")
    return checked


def _merged(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """(address, size) ranges, overlapping or touching ones merged, in address order."""
    merged: list[list[int]] = []
    for address, size in sorted(spans):
        if merged and address <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], address + size)
        else:
            merged.append([address, address + size])
    return [(low, high - low) for low, high in merged]


def _operation(method):
    """Run `method` holding the tensor's lock, once its state allows it, with
    signal handlers deferred until it returns (see extkv.deferred_signals)."""
    name = method.__name__
    # A tuple, not the set: `in` on a tuple finds the member by identity,
    # without hashing the enum in Python (a commit passes here twice).
    legal_in = tuple(_LEGAL_IN[name])

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with _DEFERRED_SIGNALS, self.lock:
            if self._state not in legal_in:
                self._require(name)  # raises, naming the state
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
    `segment_strides`, one per segment, makes the segments grow in blocks:
    `grow_blocks_(n)` grows segment i to `n * segment_strides[i]` bytes.
    """

    def __init__(
        self,
        size: int,
        device: torch.device | str | int | Driver | None = None,
        segment_capacities: Sequence[int] | None = None,
        segment_strides: Sequence[int] | None = None,
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
        strides = None if segment_strides is None else _checked_strides(segment_strides, capacities)
        self._driver = driver
        #: Bytes per block of each segment (None: no blocks), and the most
        #: blocks every segment holds.
        self.segment_strides = strides
        self.capacity_blocks = None if strides is None else min(
            (capacity // stride for capacity, stride in zip(capacities, strides) if stride), default=0)
        #: Held by every state-changing operation; re-entrant, so a caller
        #: may hold it around several operations that must not interleave.
        self.lock = threading.RLock()
        #: Releases that unmapped something (`release_physical`, and every
        #: shrink or discarding defragment of a cache, which go through it)
        #: and shrinks of committed bytes (`shrink_segments_`): two readings
        #: differ once contents were dropped, even if memory has been mapped
        #: again since. Code that keeps state about the contents (the
        #: transformers cache) compares it.
        self.release_count = 0
        self.size = size
        self.segment_capacities = capacities
        offsets, end = [], 0
        for capacity in capacities:
            offsets.append(end)
            end += capacity
        self.segment_offsets = offsets
        granule = self._driver.granularity
        #: Granules where a segment starts on a granule boundary: the only
        #: places a run may be cut (see `pipelined_chunk_bytes`).
        self._aligned_segment_starts = [offset // granule for offset in offsets[1:] if offset % granule == 0]
        self._pipelined_chunk_bytes = PIPELINED_CHUNK_BYTES
        self.reserved_bytes = -(-max(size, 1) // granule) * granule
        self._sizes = [0] * len(capacities)
        self._no_sizes = (0,) * len(capacities)
        self._mapping = _Mapping()
        self._unreleased = UnreleasedChunks(driver)  # unmapped, not yet released
        # Defragmentation's scratch reservations not yet freed, and the
        # mappings in them not yet unmapped: (address, size) each.
        self._scratch: list[tuple[int, int]] = []
        self._scratch_mappings: list[tuple[int, int]] = []
        #: Set when the tensor breaks: see `_break_if_undo_failed`.
        self._unrecorded_spans: list[tuple[int, int]] = []
        try:
            with _DEFERRED_SIGNALS:  # a signal between reserve and its record would leak the reservation
                self.base = self._driver.reserve(self.reserved_bytes)
                self._state = _State.LIVE
                _TENSORS.add(self)
        except BaseException:
            # A handler deferred to the end raised: the caller never gets
            # this tensor, so it must not keep the reservation.
            if getattr(self, "_state", None) is _State.LIVE:
                self.free()
            raise

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
    def pipelined_chunk_bytes(self) -> int:
        """A run spanning several segments is cut into chunks of at least
        this many bytes at segment starts, so zeroing overlaps mapping."""
        return self._pipelined_chunk_bytes

    @pipelined_chunk_bytes.setter
    def pipelined_chunk_bytes(self, value: int) -> None:
        self._pipelined_chunk_bytes = validate.integer("pipelined_chunk_bytes", value, minimum=1)

    @property
    def physical_bytes(self) -> int:
        """Mapped bytes: mapped granules times the granularity."""
        return self._mapping.granules * self.granularity

    @property
    def num_physical_chunks(self) -> int:
        return self._mapping.count

    @property
    def mapped_chunks(self) -> list[MappedChunk]:
        """Every mapped chunk, in address order."""
        return self._mapping.chunks

    def mapped_chunk_at(self, address: int) -> MappedChunk | None:
        """The mapped chunk whose range holds `address`, from bookkeeping; None
        where nothing is mapped (or outside the reservation)."""
        granule = (address - self.base) // self.granularity
        found = self._mapping.overlapping(granule, granule + 1) if 0 <= address - self.base < self.reserved_bytes else []
        return found[0] if found else None

    @property
    def is_broken(self) -> bool:
        """Whether a failed step's undo failed too (see the module's theory):
        only `free` is legal."""
        return self._state is _State.BROKEN

    @property
    def is_inherited(self) -> bool:
        """Whether this is a forked child's copy of its parent's tensor:
        only `free` is legal, and frees nothing of the parent's."""
        return self._state is _State.INHERITED

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

        Maps only granules not mapped yet, one chunk per maximal run (cut at
        segment starts past `pipelined_chunk_bytes`). With `zero_new`, zeroes
        exactly the bytes that become committed.
        """
        self._grow(self._validated_sizes(sizes, grow_only=True), validate.flag("zero_new", zero_new))

    @_operation
    def grow_blocks_(self, num_blocks: int, zero_new: bool = False) -> None:
        """Grow every segment to `num_blocks` blocks: segment i to
        `num_blocks * segment_strides[i]` bytes (grow-only, as
        `resize_segments_`). The sizes are built here from one checked
        count, so a commit of many segments pays no check per segment: on a
        small commit the checks would cost as much as the driver's work."""
        if self.segment_strides is None:
            raise ValueError("grow_blocks_ needs segment_strides, given when the tensor was made")
        if type(num_blocks) is not int or not 0 <= num_blocks <= self.capacity_blocks:
            num_blocks = validate.integer("num_blocks", num_blocks, maximum=self.capacity_blocks, what="a block count")
        self._grow(list(map(num_blocks.__mul__, self.segment_strides)), validate.flag("zero_new", zero_new))

    def _grow(self, sizes: list[int], zero_new: bool) -> None:
        """`resize_segments_` past its argument checks, for a caller that
        built `sizes` itself: a list of ints, one per segment, each at most
        its segment's capacity. A size below the committed one still raises."""
        mapping = self._mapping
        if len(sizes) == 1 and mapping.granules == mapping.end_granule:  # a gapless prefix: see the module's theory
            return self._grow_one_segment(sizes[0], zero_new)
        growing, spans = self._new_ranges(sizes)
        runs = self._unmapped_runs(spans)
        # Each run's new bytes are zeroed as soon as it is mapped, so the
        # device zeroes one run while the CPU maps the next.
        plan, zero_in_mapped = _runs_with_zeroing(runs, growing if zero_new else (), self.base, self._driver.granularity)
        created: list[Chunk] = []
        if plan or zero_in_mapped:
            try:
                self._map_new_chunks(plan, zero_in_mapped, created)
            finally:
                # Runs mapped before a failure stay mapped: record them.
                if created:
                    self._publish(
                        added=[
                            MappedChunk(chunk, plan[i][0], runs[i][0], runs[i][1]) for i, chunk in enumerate(created)
                        ]
                    )
        self._sizes = sizes

    def _grow_one_segment(self, new: int, zero_new: bool) -> None:
        """`_grow` of a one-segment tensor, planned and recorded in place: the
        general path's lists and merge walks cost a few microseconds more,
        which is the whole margin a one-shot commit of tens of MiB has over
        its driver calls. For a tensor whose mapped granules are one
        gapless prefix covering its committed bytes (a growth maps at most
        one run, never cut, whole or not at all), the one run to map starts
        where the mapping ends."""
        old = self._sizes[0]
        if new <= old:
            if new < old:
                self._validated_sizes([new], grow_only=True)  # raises, naming the segment
            return
        granule, mapping = self._driver.granularity, self._mapping
        start, end = mapping.end_granule, -(-new // granule)
        low = self.base + self.segment_offsets[0] + old
        zero = [(low, new - old)] if zero_new else []
        if start < end:
            address = self.base + start * granule
            plan, zero_after = [(address, (end - start) * granule, zero)], ()
        else:
            plan, zero_after = (), zero
        created: list[Chunk] = []
        try:
            if plan or zero_after:
                self._map_new_chunks(plan, zero_after, created)
        finally:
            if created:
                self._mapping = mapping.appended(MappedChunk(created[0], address, start, end - start))
        self._sizes = [new]

    def _map_new_chunks(self, plan: Sequence, zero_after: Sequence[tuple[int, int]], created: list[Chunk]) -> None:
        driver, give_back = self._driver, self._unreleased.release
        try:
            try:
                driver.map_new_chunks(plan, created, give_back, zero_after)
            except OutOfMemoryError as error:
                # Memory torch's caching allocator holds but does not use may be
                # exactly what the failed run needs: return it and try once more
                # from that run.
                if undo_failed(error) or not driver.reclaim_cache():
                    raise
                try:
                    driver.map_new_chunks(plan[len(created):], created, give_back, zero_after)
                except OutOfMemoryError as retry_error:
                    raise retry_error from error
        except BaseException as error:
            self._break_if_undo_failed(error, [(address, size) for address, size, _ in plan])
            raise

    def _break_if_undo_failed(self, error: BaseException, spans: Sequence[tuple[int, int]] = ()) -> None:
        """After an undo step failed, the driver may map what the bookkeeping
        does not record (an unmap that failed) or not map what it records (a
        remap that failed): the tensor is broken, and only `free` is legal.
        `spans`: the (address, size) ranges the failed operation mapped
        outside the recorded chunks; with those, the recorded chunks and the
        scratch reservations they are all `free` must read back, since every
        earlier failure left the bookkeeping true."""
        if undo_failed(error) and self._state is not _State.BROKEN:
            self._unrecorded_spans = list(spans)
            self._state = _State.BROKEN
            if hasattr(error, "add_note"):  # Python >= 3.11
                error.add_note(
                    f"{self!r} is now broken: an undo step failed, so its bookkeeping no longer matches the "
                    f"driver; only free() is allowed, and it unmaps what the driver shows mapped"
                )

    def _validated_sizes(self, sizes: Sequence[int], *, grow_only: bool = False, shrink_only: bool = False) -> list[int]:
        try:
            sizes = list(sizes)
        except TypeError:
            raise ValueError(f"sizes must be a sequence of ints, one per segment, got {sizes!r}") from None
        if len(sizes) != len(self._sizes):
            raise ValueError(f"expected {len(self._sizes)} segment size(s), got {len(sizes)}: {sizes}")
        # The common case in one pass, no message built: a commit checks
        # every segment, and naming each one would cost more than the check.
        floors = self._sizes if grow_only else self._no_sizes
        ceilings = self._sizes if shrink_only else self.segment_capacities
        for size, floor, ceiling in zip(sizes, floors, ceilings):
            if type(size) is not int or not floor <= size <= ceiling:
                break
        else:
            return sizes
        checked = []
        for i, (size, capacity) in enumerate(zip(sizes, self.segment_capacities)):
            size = validate.integer(f"sizes[{i}]", size)
            if size > capacity:
                raise ValueError(f"sizes[{i}] = {size} exceeds segment {i}'s capacity of {capacity} bytes")
            if grow_only and size < self._sizes[i]:
                raise ValueError(
                    f"sizes[{i}] = {size} would shrink segment {i} from {self._sizes[i]} bytes; "
                    "resize_segments_ only grows (shrink_segments_, or release_physical then grow, to shrink)"
                )
            if shrink_only and size > self._sizes[i]:
                raise ValueError(
                    f"sizes[{i}] = {size} would grow segment {i} from {self._sizes[i]} committed bytes; "
                    "shrink_segments_ only shrinks (resize_segments_ grows)"
                )
            checked.append(size)
        return checked

    def _granule_span(self, offset: int, size: int) -> tuple[int, int]:
        """Granules [first, end) covering bytes [offset, offset+size) of the
        allocation; empty (first == end) for no bytes."""
        granule = self.granularity
        if size == 0:
            return offset // granule, offset // granule
        return offset // granule, -(-(offset + size) // granule)

    def _new_ranges(self, sizes: list[int]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """What growing to `sizes` adds, in address order: the new bytes of
        each growing segment (absolute), and the granule spans [first, end)
        they need, merged where neighbouring segments share a granule or touch."""
        base, granule = self.base, self._driver.granularity
        growing, spans, span_first, span_end = [], [], 0, -1
        for offset, old, new in zip(self.segment_offsets, self._sizes, sizes):
            if new < old:
                self._validated_sizes(sizes, grow_only=True)  # raises, naming the segment
            if new > old:
                low, high = offset + old, offset + new
                growing.append((base + low, base + high))
                first, end = low // granule, -(-high // granule)
                if first <= span_end:
                    if end > span_end:
                        span_end = end
                else:
                    if span_end >= 0:
                        spans.append((span_first, span_end))
                    span_first, span_end = first, end
        if span_end >= 0:
            spans.append((span_first, span_end))
        return growing, spans

    def _unmapped_runs(self, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Maximal runs (first granule, count) of unmapped granules inside
        the granule `spans` (in address order), cut by `_cut`."""
        runs = self._mapping.gaps(spans)
        starts = self._aligned_segment_starts
        if not starts:  # one segment, or none starts on a granule: nothing to cut at
            return runs
        # Runs and starts are both in address order: one walk finds the few
        # runs that hold a segment start (a commit of every segment makes a
        # run per segment, each inside its own segment).
        pieces, at, last = [], 0, len(starts)
        for first, count in runs:
            while at < last and starts[at] <= first:
                at += 1
            if at < last and starts[at] < first + count:
                pieces += self._cut(first, count)
            else:
                pieces.append((first, count))
        return pieces

    def _cut(self, first: int, count: int) -> list[tuple[int, int]]:
        """Run [first, first+count) cut at aligned segment starts into pieces
        of at least `pipelined_chunk_bytes` (the last may be smaller)."""
        starts = self._aligned_segment_starts
        end = first + count
        at = bisect.bisect_right(starts, first)
        if at == len(starts) or starts[at] >= end:
            return [(first, count)]  # inside one segment: never cut
        least = -(-self._pipelined_chunk_bytes // self.granularity)
        pieces, piece_start = [], first
        while at < len(starts) and starts[at] < end:
            if starts[at] - piece_start >= least:
                pieces.append((piece_start, starts[at] - piece_start))
                piece_start = starts[at]
            at += 1
        pieces.append((piece_start, end - piece_start))
        return pieces

    def _publish(self, *, added: Sequence[MappedChunk] = (), removed: Sequence[MappedChunk] = ()) -> None:
        """Record a change of mapping; the mapping is replaced, never edited,
        so a reader in another thread sees a whole state."""
        self._mapping = self._mapping.changed(added=added, removed=removed)

    def _new_chunk_mapped_at(self, address: int, size: int, transaction: Transaction) -> Chunk:
        """A new chunk mapped writable at `address` (the commit path, for one
        run), the undo of each step registered with `transaction`."""
        created: list[Chunk] = []
        self._map_new_chunks([(address, size, ())], [], created)
        (chunk,) = created
        transaction.push(self._unreleased.release, chunk)
        transaction.push(self._driver.unmap, address, size)
        return chunk

    @_operation
    def segments_backed_by_one_chunk(self, sizes: Sequence[int]) -> list[bool]:
        """For each segment, whether its first `sizes[i]` bytes are mapped and
        all lie in one chunk (an empty prefix counts as backed)."""
        sizes = self._validated_sizes(sizes)
        return [self._backed_by_one_chunk(offset, size) for offset, size in zip(self.segment_offsets, sizes)]

    def _backed_by_one_chunk(self, offset: int, size: int) -> bool:
        if size == 0:
            return True
        first, end = self._granule_span(offset, size)
        chunks = self._mapping.overlapping(first, end)
        return len(chunks) == 1 and chunks[0].first_granule <= first and chunks[0].end_granule >= end

    # -- content-preserving defragmentation ----------------------------------
    @_operation
    def defragment_segment_(self, index: int) -> bool:
        """Back segment `index`'s committed bytes with one chunk, keeping every
        mapped byte at its address. Returns False when it already was."""
        return self._defragment([self._checked_segment_index(index)])[0]

    @_operation
    def defragment_segments_(
        self, indices: Sequence[int] | None = None, *, batch_bytes: int = DEFRAGMENT_BATCH_BYTES
    ) -> list[bool]:
        """`defragment_segment_` for each of `indices` (default: every
        segment), in batches of at most `batch_bytes` of moved chunks (a
        larger group moves alone); returns for each whether it moved.

        The chunks overlapping a segment are replaced together by one new
        chunk spanning them all (a chunk shared with a neighbouring segment
        moves with it). Per batch: create the new chunks and map them in a
        scratch reservation, copy, synchronize, unmap the old chunks, map the
        new ones in their place; each step is undone if a later one fails, so
        a failure leaves that batch's old mapping and contents in place, and
        the batches before it moved.
        """
        if indices is None:
            indices = range(len(self._sizes))
        try:
            indices = list(indices)
        except TypeError:
            raise ValueError(f"indices must be a sequence of segment indices, got {indices!r}") from None
        checked = [self._checked_segment_index(index) for index in indices]
        return self._defragment(checked, validate.integer("batch_bytes", batch_bytes, minimum=1))

    def _defragment(self, indices: list[int], batch_bytes: int = DEFRAGMENT_BATCH_BYTES) -> list[bool]:
        moved = {index: False for index in indices}
        groups: list[list[MappedChunk]] = []  # old chunks that become one new chunk
        for index in sorted(moved):
            offset, size = self.segment_offsets[index], self._sizes[index]
            if self._backed_by_one_chunk(offset, size):
                continue
            moved[index] = True
            old = self._mapping.overlapping(*self._granule_span(offset, size))
            if groups and old[0].first_granule < groups[-1][-1].end_granule:
                groups[-1].extend(old[1:])  # shares its first chunk with the previous segment's group
            else:
                groups.append(old)
        if groups:
            self._move_groups(groups, batch_bytes)
        return [moved[index] for index in indices]

    def _move_groups(self, groups: list[list[MappedChunk]], batch_bytes: int) -> None:
        granule = self.granularity
        batches: list[list[list[MappedChunk]]] = []
        filled = 0
        for group in groups:
            nbytes = (group[-1].end_granule - group[0].first_granule) * granule
            if not batches or filled + nbytes > batch_bytes:
                batches.append([])
                filled = 0
            batches[-1].append(group)
            filled += nbytes
        scratch_bytes = max(
            sum((group[-1].end_granule - group[0].first_granule) * granule for group in batch) for batch in batches
        )
        driver = self._driver
        with driver.batch():
            scratch = driver.reserve(scratch_bytes)
            self._scratch.append((scratch, scratch_bytes))
            try:
                for batch in batches:
                    self._move_batch(batch, scratch)
            except BaseException as error:
                self._break_if_undo_failed(error)
                # A failed cleanup step is not retried at once (it stays
                # recorded for release_physical or free). What the batch
                # before replaced is owed a release, and an idle scratch
                # reservation holds no memory: both can go now. A broken
                # tensor's scratch may hold a mapping nothing records: it
                # stays for free, which reads what the driver maps there.
                try:
                    self._unreleased.retry()
                except Exception:
                    pass  # still recorded
                if not self._scratch_mappings and self._state is not _State.BROKEN:
                    try:
                        self._free_scratch()
                    except Exception:
                        pass  # still recorded
                raise
            self._finish_cleanup()

    def _move_batch(self, groups: list[list[MappedChunk]], scratch: int) -> None:
        driver = self._driver
        granule = self.granularity
        moves: list[tuple[list[MappedChunk], MappedChunk, int]] = []  # old chunks, new chunk, its scratch address
        with Transaction() as transaction:
            at = scratch
            for group in groups:
                first = group[0].first_granule
                count = group[-1].end_granule - first
                nbytes, target = count * granule, self.base + first * granule
                chunk = self._new_chunk_mapped_at(at, nbytes, transaction)
                driver.copy(at, target, nbytes)
                # Undone before the unmaps registered above: the copy may still run.
                transaction.push(driver.synchronize)
                moves.append((group, MappedChunk(chunk=chunk, address=target, first_granule=first, num_granules=count), at))
                at += nbytes
            # While the device copies, release what the batch before replaced
            # (unmapped already, and recorded, so a refusal loses nothing).
            self._unreleased.retry()
            # The swap unmaps what the copies read.
            driver.synchronize()
            for group, new, _ in moves:
                for mapped in group:
                    driver.unmap(mapped.address, mapped.chunk.size)
                    transaction.push(self._remap, mapped)
                driver.map(new.address, new.chunk)
                transaction.push(driver.unmap, new.address, new.chunk.size)
                driver.set_access(new.address, new.chunk.size)
        # The new mappings are in place. What is left cannot be undone, only
        # finished: record it all first, so a failing step is retried later.
        old = [mapped for group, _, _ in moves for mapped in group]
        self._publish(removed=old, added=[new for _, new, _ in moves])
        self._unreleased.keep(mapped.chunk for mapped in old)
        self._scratch_mappings.extend((at, new.chunk.size) for _, new, at in moves)
        self._unmap_scratch()
        # The replaced chunks are released during the next batch's copies,
        # or by the cleanup after the last batch.

    def _remap(self, mapped: MappedChunk) -> None:
        """Put an unmapped chunk back where it was, accessible (a swap's undo)."""
        self._driver.map(mapped.address, mapped.chunk)
        self._driver.set_access(mapped.address, mapped.chunk.size)

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
        if not self._mapping.count:
            return
        # Counted before the first unmap: a release that fails part way has
        # already taken some contents.
        self.release_count += 1
        # Kernels still queued may touch these pages; unmapping under them is
        # an illegal-address fault.
        self._driver.synchronize()
        # Each chunk is released as soon as it is unmapped, as the raw
        # sequence does, rather than after every unmap: the driver state a
        # release leaves outlasts the allocations after it (on the H200, the
        # raw sequence's 8-step growth of 64 GiB read 17.5 ms at best when
        # the release two rounds before was its own, 19.9 ms when it was
        # extkv's unmap-all-then-release), and the memory goes back sooner.
        self._unmap_and_release(self._mapping.chunks)

    def _unmap_and_release(self, chunks: Sequence[MappedChunk]) -> None:
        """Unmap each of `chunks` in the order given and release it at once
        (see release_physical); what was unmapped is recorded as gone even
        when a step fails, and a chunk whose release fails is kept for a
        retry."""
        unmapped: list[MappedChunk] = []
        with self._driver.batch():
            try:
                for mapped in chunks:
                    self._driver.unmap(mapped.address, mapped.chunk.size)
                    unmapped.append(mapped)
                    self._unreleased.release(mapped.chunk)  # kept for a retry if the driver refuses
            finally:
                self._publish(removed=unmapped)

    # -- shrink from the top, keeping contents ---------------------------------------
    @_operation
    def shrink_segments_(self, sizes: Sequence[int]) -> None:
        """Shrink each segment to `sizes[i]` committed bytes (shrink-only),
        keeping every byte below the new sizes mapped at its address.

        After a synchronize, every chunk that holds no byte of any segment's
        first `sizes[i]` bytes is unmapped and released; a chunk that holds
        some stays mapped whole (an unmap takes whole mappings only), so the
        mapped granules afterwards are exactly those of the chunks holding
        kept bytes (`physical_bytes_after_shrink`). A later growth with
        `zero_new` zeroes the bytes that become committed again, mapped or
        not. The sizes change first: if a driver step fails part way, what
        was released stays released and recorded, and a call with the same
        sizes releases the rest.
        """
        sizes = self._validated_sizes(sizes, shrink_only=True)
        if sizes != self._sizes:
            # Committed bytes were dropped: readers of the count know their
            # contents may be gone, as after a release.
            self.release_count += 1
            self._sizes = sizes
        self._finish_cleanup()
        dropped = self._chunks_holding_none_of(sizes)
        if not dropped:
            return
        # Kernels still queued may touch these pages (see release_physical).
        self._driver.synchronize()
        # From the top down: a one-segment tensor keeps one gapless prefix
        # mapped even when a step fails part way (its growth then needs no
        # planner; see the module's theory).
        self._unmap_and_release(dropped[::-1])

    @_operation
    def physical_bytes_after_shrink(self, sizes: Sequence[int]) -> int:
        """`physical_bytes` once `shrink_segments_(sizes)` has run: the bytes
        of the mapped chunks that hold a byte of some segment's first
        `sizes[i]` bytes (shrink-only sizes, as there)."""
        sizes = self._validated_sizes(sizes, shrink_only=True)
        dropped = self._chunks_holding_none_of(sizes)
        return self.physical_bytes - sum(mapped.chunk.size for mapped in dropped)

    def _chunks_holding_none_of(self, sizes: list[int]) -> list[MappedChunk]:
        """The mapped chunks, in address order, that hold no byte of the
        first `sizes[i]` bytes of any segment i: those lying wholly in a gap
        between the granule spans those bytes need (or above the last). One
        bisect per gap, then only the chunks inside it."""
        mapping = self._mapping
        kept: list[list[int]] = []  # granule spans [first, end), merged where they touch
        for offset, size in zip(self.segment_offsets, sizes):
            if size:
                first, end = self._granule_span(offset, size)
                if kept and first <= kept[-1][1]:
                    kept[-1][1] = max(kept[-1][1], end)
                else:
                    kept.append([first, end])
        dropped: list[MappedChunk] = []
        low = 0
        for first, end in [*kept, [mapping.end_granule, mapping.end_granule]]:
            if first > low:
                dropped += [mapped for mapped in mapping.overlapping(low, first)
                            if mapped.first_granule >= low and mapped.end_granule <= first]
            low = max(low, end)
        return dropped

    def _unmap_scratch(self) -> None:
        while self._scratch_mappings:
            self._driver.unmap(*self._scratch_mappings[-1])
            self._scratch_mappings.pop()

    def _free_scratch(self) -> None:
        self._unmap_scratch()
        while self._scratch:
            self._driver.free_reservation(*self._scratch[-1])
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
        if self._state is _State.INHERITED:
            # The parent's to free: the child maps none of it, and the
            # descriptors it inherited name /dev/null (see extkv.vmm.host).
            self._state = _State.FREED
            return
        if self._state is _State.BROKEN:
            self._release_what_the_driver_maps()
        else:
            self.release_physical()
        self._driver.free_reservation(self.base, self.reserved_bytes)
        self._state = _State.FREED
        _TENSORS.discard(self)

    def _release_what_the_driver_maps(self) -> None:
        """`free`'s release for a broken tensor, whose bookkeeping cannot be
        trusted: every mapping the driver shows in the reservation and in
        any scratch reservation a defragment left is unmapped, one run per
        chunk, then every chunk the tensor holds is released. A step that
        fails is raised after the rest were tried; what is left stays
        recorded for the next `free`."""
        driver, granule = self._driver, self.granularity
        failure: Exception | None = None
        # Only where something can be mapped: reading every granule of a
        # 256 GiB reservation back took 1 s on the host.
        spans = [(mapped.address, mapped.chunk.size) for mapped in self._mapping.chunks]
        spans += self._unrecorded_spans
        # Kernels still queued may touch these pages (see release_physical).
        driver.synchronize()
        with driver.batch():
            for base, size in [*_merged(spans), *self._scratch]:
                addresses = range(base, base + size, granule)
                owners = driver.chunks_at(addresses)
                start = 0
                for index in range(1, len(owners) + 1):
                    if index < len(owners) and owners[index] == owners[start]:
                        continue
                    if owners[start] is not None:
                        try:
                            driver.unmap(addresses[start], (index - start) * granule)
                        except Exception as error:
                            failure = failure or error
                    start = index
        # What the driver shows is what is mapped: a mapping whose unmap just
        # failed is read again by the next free, recorded or not.
        self._scratch_mappings.clear()
        held = self._mapping.chunks
        self._unreleased.keep(mapped.chunk for mapped in held)
        self._publish(removed=held)
        try:
            self._finish_cleanup()
        except Exception as error:
            failure = failure or error
        if failure is not None:
            raise failure

    def __enter__(self) -> "ExtensibleTensor":
        return self

    def __exit__(self, *exc_info) -> None:
        self.free()

    def __del__(self) -> None:
        # Freeing here could unmap memory under views that outlive this object,
        # so a forgotten free() is reported, not fixed.
        if getattr(self, "_state", _State.FREED) is not _State.FREED:
            try:
                warnings.warn(f"{self!r} was never freed; call free()", ResourceWarning, stacklevel=2)
            except Exception:
                pass

    def _require(self, operation: str) -> None:
        if self._state is _State.INHERITED and operation != "free":
            raise StateError(
                f"{operation}() is not allowed on an ExtensibleTensor inherited by a forked child (pid "
                f"{os.getpid()}): its memory is the parent's and not mapped here; only free() is allowed"
            )
        if self._state not in _LEGAL_IN[operation]:
            raise StateError(f"{operation}() is not allowed on a {self._state.value} ExtensibleTensor")
