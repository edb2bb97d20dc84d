"""Hypothesis state machines for ExtensibleTensor and ExtensibleKVCache, each
driven beside a plain-Python model of what it must hold.

Theory of operation
-------------------
A machine owns one real object on a real driver (the conformance suite passes
a `PoisoningDriver`, a stress run may wrap it further) and a model that knows
nothing of chunks or drivers: committed sizes, the bytes each position must
hold, and which granules must be mapped, computed with its own arithmetic.
Every rule calls the real operation and applies the same operation to the
model, with a `note()` naming the call so a failing example reads as a
script. After every step the machine's invariant runs the named checks below:
addresses fixed, sizes, contents (including zero where the model says zero,
which over poisoned memory proves extkv zeroed it), physical bytes against
the model, the driver's read-back and the usage probe.

The tensor model holds every *mapped* byte, not only committed ones: fresh
chunks hold the driver's poison byte, so a resize that zeroes a neighbour's
bytes or an uncommitted tail is caught as surely as one that zeroes too
little. Without a known poison byte (`fresh_byte=None`) only committed bytes
are compared, and resizes always zero.

The cache model holds one byte per committed block (every row of a block,
in every segment, is written with one value), and the number of leading
blocks whose segments must each be one chunk: known after a defragmentation,
a shrink, or growth from nothing mapped, and read back from the driver to
check. Whether a defragmenting commit finds its prefix fragmented, which
decides what it discards, is read back from the driver before the call, never
from the cache's bookkeeping.

The cache's operations live once, in `ModelledCache`: each takes its
arguments from a `Choices` (`DrawnChoices`: Hypothesis draws them and shrinks
a failure; `SeededChoices`: a seeded `random.Random`, for endurance runs of
many thousand steps that Hypothesis's per-step cost would slow down), runs
the real call, updates the model and checks what the call alone could break.
A Hypothesis machine checks everything after every step; an endurance walk
(extkv.testing.stress) checks everything every K steps. `PRECONDITIONS`
says, as data, when each operation may run. Beyond commits, shrinks,
defragmentation, release and recommit, `endurance_machine` exports the
segments to a peer and compares digests, frees and recreates the cache, and
on CUDA captures graphs over blocks committed later and replays them.
Content differences are `ContentMismatch` and leftovers `LeakFound`, so a
stress run can count them apart from other failures.

The suites build machines with `tensor_machine(...)` / `cache_machine(...)` /
`endurance_machine(...)` and run them with
`hypothesis.stateful.run_state_machine_as_test`.
"""

from __future__ import annotations

import abc
import collections
import gc
import random
import socket
from dataclasses import dataclass
from typing import Callable

import torch
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ..cache import ExtensibleKVCache
from ..connector import SegmentExportConnector, SegmentNotContiguousError
from ..errors import DriverError, OutOfMemoryError
from ..layout import KVCacheLayout, kv_cache_segments
from ..peer import import_segments, sha256_hex
from ..tensor import ExtensibleTensor
from ..usage import UsageProbe
from ..vmm import Driver, FaultInjectingDriver, live_chunks, live_reservations
from .checks import (
    check_readback_matches_bookkeeping,
    check_unchanged,
    check_usage_matches,
    read_back_granules,
    read_back_granules_and_one_chunk_per_segment,
    readback_one_chunk_per_segment,
    snapshot,
)
from .configs import config_for


def granule_span(offset: int, size: int, granule: int) -> range:
    """Granules that bytes [offset, offset+size) touch."""
    return range(offset // granule, -(-(offset + size) // granule)) if size else range(0)


def readback_physical_bytes(tensor: ExtensibleTensor, read_back: list) -> int:
    """Mapped bytes as the driver or kernel reads them back (`read_back` from
    `read_back_granules`): granules whose first byte something backs, times
    the granularity."""
    return sum(identity is not None for identity in read_back[::2]) * tensor.granularity


def _mismatches(actual: torch.Tensor, expected: torch.Tensor) -> int:
    expected = expected.to(actual.device)
    # torch.equal is a fast comparison; counting is only for the message.
    return 0 if torch.equal(actual, expected) else int((actual != expected).count_nonzero())


# -- the tensor -----------------------------------------------------------------
class TensorModel:
    """What an ExtensibleTensor must hold, in plain Python: committed bytes per
    segment, and the bytes of every mapped granule."""

    def __init__(self, capacities: list[int], granule: int, fresh_byte: int | None):
        self.capacities = capacities
        self.granule = granule
        self.fresh_byte = fresh_byte
        self.offsets = [sum(capacities[:i]) for i in range(len(capacities))]
        self.sizes = [0] * len(capacities)
        #: granule index -> its bytes (fresh_byte, or 0 standing for "unknown"
        #: when fresh memory is not known).
        self.memory: dict[int, bytearray] = {}

    def grow(self, sizes: list[int], zero_new: bool) -> None:
        for i, size in enumerate(sizes):
            old = self.sizes[i]
            if size <= old:
                continue
            for index in granule_span(self.offsets[i] + old, size - old, self.granule):
                if index not in self.memory:
                    self.memory[index] = bytearray([self.fresh_byte or 0]) * self.granule
            if zero_new:
                self.write(self.offsets[i] + old, self.offsets[i] + size, 0)
            self.sizes[i] = size

    def write(self, start: int, end: int, value: int) -> None:
        """Bytes [start, end) of the reservation, all mapped, become `value`."""
        g = self.granule
        while start < end:
            index, within = divmod(start, g)
            stop = min(end, (index + 1) * g)
            self.memory[index][within : within + stop - start] = bytes([value]) * (stop - start)
            start = stop

    def read(self, start: int, end: int) -> bytes:
        """Bytes [start, end) of the reservation, all mapped."""
        g = self.granule
        pieces = []
        for index in range(start // g, -(-end // g)):
            low, high = max(start, index * g) - index * g, min(end, (index + 1) * g) - index * g
            pieces.append(bytes(self.memory[index][low:high]))
        return b"".join(pieces)

    def release(self, kept: frozenset[int] = frozenset()) -> None:
        """Nothing committed; the `kept` granules (a release that failed part
        way left them mapped) keep their bytes."""
        self.sizes = [0] * len(self.capacities)
        self.memory = {index: data for index, data in self.memory.items() if index in kept}


#: Segment capacities of the tensor machine, in granules. Three segments:
#: segment 1 starts mid-granule, so granules are shared and growth starts
#: inside mapped granules. One segment (ExtensibleTensor plans its growth on
#: a path of its own) that ends mid-granule.
TENSOR_MACHINE_SEGMENTS = {"three-segments": (5 / 2, 3 / 2, 3), "one-segment": (7 / 2,)}


def tensor_machine(driver: Driver, probe: UsageProbe, fresh_byte: int | None = None, segments: str = "three-segments"):
    """A state machine over one ExtensibleTensor on `driver`, its segments
    one of `TENSOR_MACHINE_SEGMENTS`. `fresh_byte`: what every new chunk of
    `driver` holds (a PoisoningDriver's pattern), or None if unknown."""
    granule = driver.granularity
    capacities = [int(granule * granules) for granules in TENSOR_MACHINE_SEGMENTS[segments]]

    class ExtensibleTensorMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.baseline = probe.read_outside_torch()
            self.faulty = FaultInjectingDriver(driver)
            self.tensor = ExtensibleTensor(sum(capacities), device=self.faulty, segment_capacities=capacities)
            self.model = TensorModel(capacities, granule, fresh_byte)
            self.base = self.tensor.base

        @rule(data=st.data())
        def grow(self, data):
            sizes = [
                data.draw(st.integers(size, capacity), label=f"size[{i}]")
                for i, (size, capacity) in enumerate(zip(self.model.sizes, capacities))
            ]
            zero_new = True if fresh_byte is None else data.draw(st.booleans(), label="zero_new")
            note(f"resize_segments_({sizes}, zero_new={zero_new})")
            self.tensor.resize_segments_(sizes, zero_new=zero_new)
            self.model.grow(sizes, zero_new)

        @precondition(lambda self: any(self.model.sizes))
        @rule(data=st.data(), value=st.integers(1, 255))
        def write(self, data, value):
            segment = data.draw(st.sampled_from([i for i, s in enumerate(self.model.sizes) if s]), label="segment")
            length = self.model.sizes[segment]
            start = data.draw(st.integers(0, length - 1), label="start")
            end = data.draw(st.integers(start + 1, length), label="end")
            note(f"segment_view({segment})[{start}:{end}].fill_({value})")
            self.tensor.segment_view(segment)[start:end].fill_(value)
            offset = self.model.offsets[segment]
            self.model.write(offset + start, offset + end, value)

        @precondition(lambda self: any(self.model.sizes))
        @rule(data=st.data())
        def defragment(self, data):
            segment = data.draw(st.sampled_from([i for i, s in enumerate(self.model.sizes) if s]), label="segment")
            note(f"defragment_segment_({segment})")
            self.tensor.defragment_segment_(segment)
            one = readback_one_chunk_per_segment(self.tensor, self.model.sizes)[segment]
            assert one, f"segment {segment} spans several chunks after defragment_segment_, read back"

        @rule()
        def release(self):
            note("release_physical()")
            self.tensor.release_physical()
            self.model.release()

        @precondition(lambda self: self.tensor.num_physical_chunks > 1)
        @rule(data=st.data())
        def release_failing_part_way(self, data):
            # An unmap that fails leaves it and the chunks above it mapped over
            # the gap the released ones leave, and owes no release.
            chunks = self.tensor.num_physical_chunks
            nth = data.draw(st.integers(2, chunks), label="failing unmap")
            note(f"release_physical() with unmap call {nth} of {chunks} failing")
            self.faulty.fail_in("unmap", nth)
            try:
                self.tensor.release_physical()
            except DriverError:
                pass
            else:
                raise AssertionError(f"unmap call {nth} of {chunks} chunks never came")
            # Which granules stay depends on how the tensor cut its chunks,
            # which the model does not know: it takes them from the driver.
            read_back = read_back_granules(self.tensor)
            self.model.release(frozenset(index // 2 for index, chunk in enumerate(read_back) if chunk is not None))

        @invariant()
        def holds_what_the_model_says(self):
            check_tensor_sizes(self.tensor, self.model)
            check_addresses_fixed(self.tensor, self.model.offsets, self.base)
            # What is mapped before any byte is read: a committed byte with
            # nothing behind it fails here rather than faulting the reader.
            read_back = read_back_granules(self.tensor)
            check_tensor_physical_bytes(self.tensor, self.model, read_back)
            check_readback_matches_bookkeeping(self.tensor, read_back)
            check_tensor_contents(self.tensor, self.model)
            check_usage_matches(probe, self.baseline, [self.tensor])

        def teardown(self):
            self.tensor.free()

    return ExtensibleTensorMachine


def check_tensor_sizes(tensor: ExtensibleTensor, model: TensorModel) -> None:
    assert tensor.segment_sizes == model.sizes, f"segment sizes {tensor.segment_sizes}, model {model.sizes}"


def check_addresses_fixed(tensor: ExtensibleTensor, offsets: list[int], base: int) -> None:
    """The base, the full view and every committed segment view sit where
    they sat at the start: `base`, and `base + offsets[i]` for segment i."""
    assert tensor.base == base, f"base moved from {base:#x} to {tensor.base:#x}"
    assert tensor.full_view().data_ptr() == base, f"full view at {tensor.full_view().data_ptr():#x}, base {base:#x}"
    for i, offset in enumerate(offsets):
        view = tensor.segment_view(i)
        if view.numel():
            assert view.data_ptr() == base + offset, f"segment {i} at {view.data_ptr():#x}, expected {base + offset:#x}"


def check_tensor_contents(tensor: ExtensibleTensor, model: TensorModel) -> None:
    """Committed bytes as the model says; with a known poison byte, every
    mapped byte too."""
    for i, (offset, size) in enumerate(zip(model.offsets, model.sizes)):
        if size:
            expected = torch.frombuffer(bytearray(model.read(offset, offset + size)), dtype=torch.uint8)
            wrong = _mismatches(tensor.segment_view(i), expected)
            assert wrong == 0, f"segment {i}: {wrong} of {size} committed bytes differ from the model"
    if model.fresh_byte is None:
        return
    g = model.granule
    for index, content in sorted(model.memory.items()):
        wrong = _mismatches(tensor.driver.view(tensor.base + index * g, g), torch.frombuffer(content, dtype=torch.uint8))
        assert wrong == 0, f"granule {index}: {wrong} of {g} mapped bytes differ from the model"


def check_tensor_physical_bytes(tensor: ExtensibleTensor, model: TensorModel, read_back: list) -> None:
    expected = len(model.memory) * model.granule
    assert tensor.physical_bytes == expected, f"physical_bytes {tensor.physical_bytes}, model {expected}"
    read_back = readback_physical_bytes(tensor, read_back)
    assert read_back == expected, f"driver reads back {read_back} mapped bytes, model {expected}"


# -- the KV cache ---------------------------------------------------------------
class CacheModel:
    """What an ExtensibleKVCache must hold, in plain Python."""

    def __init__(self, capacity: int, offsets: list[int], strides: list[int], granule: int):
        self.capacity = capacity
        self.offsets = offsets
        self.strides = strides
        self.granule = granule
        self.committed = 0
        #: False after release_physical until something maps again.
        self.mapped = True
        #: block -> the byte every row of it holds; absent blocks read zero.
        self.values: dict[int, int] = {}
        #: Leading blocks whose segments must each be backed by one chunk.
        self.one_chunk_blocks = 0

    def sizes(self, num_blocks: int) -> list[int]:
        return [num_blocks * stride for stride in self.strides]

    def block_values(self, num_blocks: int) -> torch.Tensor:
        """The byte each of the first `num_blocks` blocks holds (uint8, on the CPU)."""
        values = torch.zeros(num_blocks, dtype=torch.uint8)
        for block, value in self.values.items():
            if block < num_blocks:
                values[block] = value
        return values

    def physical_bytes(self) -> int:
        if not self.mapped:
            return 0
        granules = {
            index
            for offset, size in zip(self.offsets, self.sizes(self.committed))
            for index in granule_span(offset, size, self.granule)
        }
        return len(granules) * self.granule

    def grow(self, num_blocks: int) -> None:
        """A commit past the committed count: maps and zeroes the new blocks
        (every block, after a release). From nothing mapped, each segment is
        one run of granules, so one chunk."""
        if num_blocks <= self.committed:
            return
        if not self.mapped or self.committed == 0:
            self.one_chunk_blocks = num_blocks
        self.committed = num_blocks
        self.mapped = True

    def remap(self) -> None:
        """recommit() after a release: every committed block, fresh and zero."""
        self.mapped = True
        self.one_chunk_blocks = self.committed

    def discard(self, num_blocks: int) -> None:
        """Release everything, then commit `num_blocks` fresh blocks."""
        self.release()
        self.committed = 0
        self.mapped = True
        self.grow(num_blocks)

    def release(self) -> None:
        self.mapped = False
        self.values.clear()
        self.one_chunk_blocks = 0


#: (config kind, layout) pairs the cache machine is meant for: shared
#: granules (unpadded LBHNC), two strides (mixed), one segment (BLHNC).
CACHE_MACHINE_CASES = [("full", KVCacheLayout.LBHNC), ("mixed", KVCacheLayout.LBNHC), ("full", KVCacheLayout.BLHNC)]


def capacity_for(kind: str, layout: KVCacheLayout, granule: int) -> int:
    """A block count whose smallest segment spans about two and a half
    granules and ends inside one: commits cross granules, fragment, and
    segments of unpadded layer-outermost layouts share granules."""
    _, strides = kv_cache_segments(config_for(kind, layout, 1), layout)
    return (5 * granule) // (2 * min(strides)) | 1


class ContentMismatch(AssertionError):
    """Bytes of the cache (or of a peer's import of it) differ from what the
    model says they hold."""


class LeakFound(AssertionError):
    """A reservation, chunk or physical byte outlived the cache that held it."""


# -- where an operation's arguments come from ---------------------------------------
class Choices(abc.ABC):
    """The arguments of each operation, and a place for notes that make a
    failing run read as a script."""

    @abc.abstractmethod
    def integer(self, low: int, high: int, label: str) -> int: ...

    @abc.abstractmethod
    def boolean(self, label: str) -> bool: ...

    @abc.abstractmethod
    def note(self, text: str) -> None: ...


class DrawnChoices(Choices):
    """Arguments drawn by Hypothesis (so they shrink); notes go into its report."""

    def __init__(self, data):
        self.data = data

    def integer(self, low: int, high: int, label: str) -> int:
        return self.data.draw(st.integers(low, high), label=label)

    def boolean(self, label: str) -> bool:
        return self.data.draw(st.booleans(), label=label)

    def note(self, text: str) -> None:
        note(text)


class SeededChoices(Choices):
    """Arguments from a `random.Random(seed)`: the same seed replays the same
    run. The last `remembered` notes are kept, numbered by `step`, so a
    failure names the steps that led to it."""

    def __init__(self, seed: int, remembered: int = 64):
        self.seed = seed
        self.random = random.Random(seed)
        self.recent: collections.deque[str] = collections.deque(maxlen=remembered)
        self.step = 0

    def integer(self, low: int, high: int, label: str) -> int:
        return self.random.randint(low, high)

    def boolean(self, label: str) -> bool:
        return self.random.random() < 0.5

    def note(self, text: str) -> None:
        self.recent.append(f"step {self.step}: {text}")


# -- one cache driven beside its model ------------------------------------------------
@dataclass
class CapturedGraph:
    """A CUDA graph captured over `block` (maybe not committed at capture):
    replayed, it copies the block's row of each segment into `rows` and adds
    one to every byte of the block."""

    block: int
    graph: object  # torch.cuda.CUDAGraph
    rows: list[torch.Tensor]


#: When each operation of `ModelledCache` may run, given the model.
PRECONDITIONS: dict[str, Callable[["ModelledCache"], bool]] = {
    "commit_grow": lambda driven: driven.model.committed < driven.capacity,
    "commit_at_or_below": lambda driven: True,
    "shrink": lambda driven: driven.model.committed > 0,
    "defragment": lambda driven: True,
    "release": lambda driven: True,
    "recommit": lambda driven: True,
    "write_block": lambda driven: driven.model.mapped and driven.model.committed > 0,
    "read_block": lambda driven: driven.model.mapped and driven.model.committed > 0,
    "export_to_peer": lambda driven: driven.model.mapped and driven.model.committed > 0,
    "free_and_recreate": lambda driven: True,
    "capture_graph": lambda driven: driven.graphs_possible,
    "replay_graphs": lambda driven: any(driven.graph_replayable(graph) for graph in driven.graphs),
}

#: Graphs kept at once; capturing another drops the oldest.
MAX_GRAPHS = 4
#: Seconds an in-process peer waits on its socket before giving up.
PEER_TIMEOUT_S = 60.0


class ModelledCache:
    """One ExtensibleKVCache of `config_for(kind, layout, capacity)` on
    `driver`, driven beside its `CacheModel`.

    Each operation takes its arguments from a `Choices`, calls the real cache,
    applies the call to the model and runs the checks that this operation
    alone could break: counts and sizes, and the bytes it touched (new blocks
    zero, a written block as written). With `thorough` set, "touches nothing"
    is proven against a full `snapshot` instead of the mapped chunk objects;
    `check_everything()` is the full invariant (every byte, the driver's
    read-back, the usage probe). `operations` and `checks` count, by name,
    the operations that completed and the checks that passed.
    """

    def __init__(
        self,
        driver: Driver,
        probe: UsageProbe,
        kind: str,
        layout: KVCacheLayout,
        capacity: int | None = None,
        *,
        operations: collections.Counter | None = None,
        checks: collections.Counter | None = None,
    ):
        self.driver = driver
        self.probe = probe
        self.layout = layout
        self.capacity = capacity_for(kind, layout, driver.granularity) if capacity is None else capacity
        self.config = config_for(kind, layout, self.capacity)
        self.operations = collections.Counter() if operations is None else operations
        self.checks = collections.Counter() if checks is None else checks
        self.thorough = True
        #: Called with the `OutOfMemoryError` a commit met (real memory
        #: pressure); once it returns, the same call is made again. None:
        #: the error propagates.
        self.on_out_of_memory: Callable[[OutOfMemoryError], None] | None = None
        #: Whether the full check compares the usage probe: not while another
        #: process uses a device whose probe reads device-wide.
        self.usage_checks = True
        #: Whether a thorough "touches nothing" copies every committed byte
        #: (`snapshot`), and whether bytes are compared on the device: neither
        #: beside a process that leaves the device nearly full, where a
        #: comparison's temporary could meet torch's out-of-memory.
        self.snapshot_checks = True
        self.compare_on_host = False
        self.graphs: list[CapturedGraph] = []
        self.baseline = probe.read_outside_torch()
        self.live_before = (live_reservations[driver.kind], live_chunks[driver.kind])
        self.create()

    def create(self) -> None:
        self.cache = ExtensibleKVCache(self.config, self.driver, self.layout)
        self.model = CacheModel(self.capacity, self.cache.segment_offsets, self.cache.segment_strides, self.driver.granularity)
        self.base = self.cache.buffer.base

    def can(self, operation: str) -> bool:
        return PRECONDITIONS[operation](self)

    def ran(self, operation: str) -> None:
        self.operations[operation] += 1

    def checked(self, check: str) -> None:
        self.checks[check] += 1

    def call(self, operation: Callable[[], object]) -> None:
        """Make a real call that may create memory; an `OutOfMemoryError` goes
        to `on_out_of_memory`, then the call is made again."""
        while True:
            try:
                operation()
                return
            except OutOfMemoryError as error:
                if self.on_out_of_memory is None:
                    raise
                self.on_out_of_memory(error)

    # -- operations -------------------------------------------------------------
    def commit_grow(self, choose: Choices) -> None:
        model = self.model
        n = choose.integer(model.committed + 1, self.capacity + self.capacity // 4, "num_blocks")
        choose.note(f"commit({n})" + ("  # past capacity: clamped" if n > self.capacity else ""))
        unchanged_up_to = model.committed if model.mapped else 0
        self.call(lambda: self.cache.commit(n))
        model.grow(min(n, self.capacity))
        self.ran("commit (grow)")
        self.check_counts()
        self.check_blocks(unchanged_up_to, model.committed, "new blocks of a growing commit")

    def commit_at_or_below(self, choose: Choices) -> None:
        n = choose.integer(0, self.model.committed, "num_blocks")
        choose.note(f"commit({n})  # at or below {self.model.committed}: touches nothing")
        self.touching_nothing(lambda: self.cache.commit(n))
        self.ran("commit (at or below)")
        self.check_counts()

    def shrink(self, choose: Choices) -> None:
        model = self.model
        n = choose.integer(0, model.committed, "num_blocks")
        choose.note(f"commit({n}, shrink=True)")
        self.call(lambda: self.cache.commit(n, shrink=True))
        self.ran("commit (shrink)")
        if n < model.committed:
            model.discard(n)
            self.check_blocks(0, n, "blocks after a shrink")
        self.check_counts()

    def defragment(self, choose: Choices) -> None:
        model = self.model
        n = choose.integer(0, self.capacity + self.capacity // 4, "num_blocks")
        preserve = choose.boolean("preserve_contents")
        target = min(n, self.capacity)
        fragmented = not self.prefix_is_one_chunk(target)
        choose.note(f"commit({n}, defragment=True, preserve_contents={preserve})  # prefix fragmented: {fragmented}")
        unchanged_up_to = model.committed if model.mapped else 0
        self.call(lambda: self.cache.commit(n, defragment=True, preserve_contents=preserve))
        self.ran(f"commit (defragment, {'preserving' if preserve else 'discarding'})")
        if fragmented and not preserve:
            model.discard(target)
            unchanged_up_to = 0
        else:
            model.grow(target)
            if model.mapped:
                # Preserving a fragmented prefix moves every committed byte
                # of every segment onto one chunk; otherwise the prefix was
                # one chunk already and growth inside it maps nothing.
                model.one_chunk_blocks = model.committed if fragmented else max(model.one_chunk_blocks, target)
        self.check_counts()
        check_cache_one_chunk_per_segment(self.cache, model)
        self.checked("one chunk per segment, read back, after a defragment")
        if model.mapped:
            self.check_blocks(unchanged_up_to, model.committed, "blocks a defragmenting commit added or discarded")

    def release(self, choose: Choices) -> None:
        choose.note("release_physical()")
        self.cache.release_physical()
        self.model.release()
        self.ran("release_physical")
        self.check_counts()

    def recommit(self, choose: Choices) -> None:
        choose.note("recommit()")
        if self.model.mapped:
            self.touching_nothing(self.cache.recommit)
        else:
            self.call(self.cache.recommit)
            self.model.remap()
            self.check_blocks(0, self.model.committed, "recommitted blocks")
        self.ran("recommit")
        self.check_counts()

    def write_block(self, choose: Choices) -> None:
        block = choose.integer(0, self.model.committed - 1, "block")
        value = choose.integer(1, 255, "value")
        choose.note(f"block {block}: every row filled with {value}")
        for segment, stride in enumerate(self.model.strides):
            self.cache.buffer.segment_view(segment)[block * stride : (block + 1) * stride].fill_(value)
        self.model.values[block] = value
        self.ran("write a block")
        self.check_blocks(block, block + 1, "a block just written")

    def read_block(self, choose: Choices) -> None:
        block = choose.integer(0, self.model.committed - 1, "block")
        choose.note(f"read block {block}")
        self.ran("read a block")
        self.check_blocks(block, block + 1, "a block read back")

    def export_to_peer(self, choose: Choices) -> None:
        """Export the committed segments through a socket and import them as
        a peer does (extkv.peer); the peer's digests must be the model's. A
        fragmented cache must be refused instead, naming the segments."""
        buffer = self.cache.buffer
        fragmented = not all(readback_one_chunk_per_segment(buffer, buffer.segment_sizes))
        choose.note(f"export to a peer  # fragmented, read back: {fragmented}")
        connector = SegmentExportConnector()
        try:
            if fragmented:
                try:
                    connector.register_kv_caches(self.cache)
                except SegmentNotContiguousError:
                    self.ran("export (refused: fragmented)")
                    return
                raise AssertionError("register_kv_caches accepted segments the driver reads back as several chunks")
            connector.register_kv_caches(self.cache)
            sender, receiver = socket.socketpair()
            with sender, receiver:
                connector.export_to(sender)
                with import_segments(receiver, timeout=PEER_TIMEOUT_S) as imported:
                    digests = imported.digests()
        finally:
            connector.close()
        expected = self.expected_digests()
        wrong = [i for i, (got, want) in enumerate(zip(digests, expected)) if got != want]
        if wrong or len(digests) != len(expected):
            raise ContentMismatch(f"the peer's digests of segments {wrong} differ from the model's ({len(digests)} segments imported)")
        self.ran("export to a peer and compare digests")
        self.checked("peer's digests equal the model's")

    def free_and_recreate(self, choose: Choices) -> None:
        choose.note("free(), then a new cache")
        self.free()
        self.ran("free")
        self.check_nothing_left()
        self.create()
        self.ran("create")
        self.check_counts()

    @property
    def graphs_possible(self) -> bool:
        # Graph capture is a CUDA feature; on the host this rule never runs.
        return self.driver.kind == "cuda"

    def graph_replayable(self, graph: CapturedGraph) -> bool:
        """Replaying reads and writes the block: only while it is mapped."""
        return self.model.mapped and graph.block < self.model.committed

    def capture_graph(self, choose: Choices) -> None:
        """Capture a graph over a block that may not be committed yet; it is
        replayed once the block is (invariant 2)."""
        import torch.cuda

        block = choose.integer(0, self.capacity - 1, "block")
        choose.note(f"capture a CUDA graph over block {block}  # committed: {block < self.model.committed}")
        device = self.driver.device
        strides = self.model.strides
        addresses = [self.base + offset + block * stride for offset, stride in zip(self.model.offsets, strides)]
        views = [self.driver.view(address, stride) for address, stride in zip(addresses, strides)]
        rows = [torch.empty(stride, dtype=torch.uint8, device=device) for stride in strides]
        # Kernels only, no copy_: a captured memcpy node is checked against
        # the memory it reads when captured, and the block may be unmapped
        # then (cudaErrorInvalidValue on the H200); a kernel reads only when
        # replayed. The same kernels run once eagerly on scratch memory: CUDA
        # loads modules lazily, and loading one inside a capture fails.
        for row in rows:
            scratch = torch.zeros_like(row)
            row.zero_().add_(scratch)
            scratch.add_(1)
        torch.cuda.synchronize(device)
        self.drop_graphs(keep=MAX_GRAPHS - 1)
        before = self.probe.read_outside_torch()
        graph = torch.cuda.CUDAGraph()
        # thread_local: a sampler thread's driver calls must not break the capture.
        with torch.cuda.device(device), torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for view, row in zip(views, rows):
                row.zero_().add_(view)
                view.add_(1)
        torch.cuda.synchronize(device)
        # A graph's own memory is the CUDA driver's, not extkv's: whatever the
        # capture added leaves the baseline of the usage check.
        self.baseline += self.probe.read_outside_torch() - before
        self.graphs.append(CapturedGraph(block, graph, rows))
        self.ran("capture a CUDA graph")

    def replay_graphs(self, choose: Choices) -> None:
        """Replay every graph whose block is mapped now; each must read the
        block as the model says (eager execution's answer) and add one."""
        import torch.cuda

        for graph in self.graphs:
            if not self.graph_replayable(graph):
                continue
            choose.note(f"replay the CUDA graph over block {graph.block}")
            expected = self.model.values.get(graph.block, 0)
            graph.graph.replay()
            torch.cuda.synchronize(self.driver.device)
            for segment, row in enumerate(graph.rows):
                wrong = int((row != expected).count_nonzero())
                if wrong:
                    raise ContentMismatch(
                        f"CUDA graph over block {graph.block}: {wrong} of {row.numel()} bytes read in segment "
                        f"{segment} differ from {expected}, the block's value"
                    )
            value = (expected + 1) % 256
            if value:
                self.model.values[graph.block] = value
            else:
                self.model.values.pop(graph.block, None)
            self.ran("replay a CUDA graph")
            self.checked("graph replay read the model's bytes")
            self.check_blocks(graph.block, graph.block + 1, "a block a graph replay wrote")

    def drop_graphs(self, keep: int = 0) -> None:
        """Destroy all but the newest `keep` graphs."""
        if len(self.graphs) <= keep:
            return
        before = self.probe.read_outside_torch()
        self.graphs = self.graphs[len(self.graphs) - keep :]
        gc.collect()
        self.baseline += self.probe.read_outside_torch() - before

    def free(self) -> None:
        # A graph's pointers would reach whatever the freed reservation's
        # address space holds next.
        self.drop_graphs()
        self.cache.free()

    # -- checks -------------------------------------------------------------------
    def touching_nothing(self, call: Callable[[], object]) -> None:
        """Make `call`, which must change nothing: proven against a full
        snapshot when thorough, else by the mapped chunk objects and sizes."""
        if self.thorough and self.snapshot_checks:
            before = snapshot(self.cache)
            call()
            check_unchanged(self.cache, before)
            self.checked("unchanged: snapshot of chunks, read-back and bytes")
        else:
            chunks, sizes = self.cache.buffer.mapped_chunks, self.cache.buffer.segment_sizes
            call()
            check_same_mapping(self.cache, chunks, sizes)
            self.checked("unchanged: mapped chunk objects and sizes")

    def prefix_is_one_chunk(self, num_blocks: int) -> bool:
        return all(readback_one_chunk_per_segment(self.cache.buffer, self.model.sizes(num_blocks)))

    def check_counts(self) -> None:
        """Committed count, segment sizes and physical bytes as the model says
        (bookkeeping only: cheap enough for every step)."""
        check_cache_committed(self.cache, self.model)
        expected = self.model.physical_bytes()
        assert self.cache.physical_bytes == expected, f"physical_bytes {self.cache.physical_bytes}, model {expected}"
        self.checked("committed count, segment sizes, physical_bytes")

    def check_blocks(self, first: int, end: int, what: str) -> None:
        if end > first:
            check_cache_blocks(self.cache, self.model, first, end, what, on_host=self.compare_on_host)
            self.checked("bytes of the blocks an operation touched")

    def check_everything(self) -> None:
        cache, model = self.cache, self.model
        check_addresses_fixed(cache.buffer, cache.segment_offsets, self.base)
        check_cache_committed(cache, model)
        if model.mapped:
            check_cache_blocks(cache, model, 0, model.committed, "committed blocks", on_host=self.compare_on_host)
        # The granules' read-back and the one-chunk probes in one read.
        read_back, one_chunk = read_back_granules_and_one_chunk_per_segment(
            cache.buffer, model.sizes(model.one_chunk_blocks) if model.mapped else []
        )
        check_cache_physical_bytes(cache, model, read_back)
        check_cache_one_chunk_per_segment(cache, model, one_chunk)
        check_readback_matches_bookkeeping(cache.buffer, read_back)
        if self.usage_checks:
            check_usage_matches(self.probe, self.baseline, [cache.buffer])
        self.checked("everything: addresses, every byte, read-back, one chunk, usage probe")

    def check_mapping(self) -> None:
        """What must hold even between a refused call and its retry: the
        driver's read-back partitions the reservation as the bookkeeping
        does, and the usage probe agrees with `physical_bytes`."""
        check_readback_matches_bookkeeping(self.cache.buffer)
        if self.usage_checks:
            check_usage_matches(self.probe, self.baseline, [self.cache.buffer])
        self.checked("mapping consistent after a refused call: read-back, usage probe")

    def check_nothing_left(self) -> None:
        """After free(): the driver's live counts and the usage probe are back
        where they were before the first cache."""
        live = (live_reservations[self.driver.kind], live_chunks[self.driver.kind])
        if live != self.live_before:
            raise LeakFound(f"live (reservations, chunks) {self.live_before} before, {live} after free()")
        measured = self.probe.read_outside_torch() - self.baseline if self.usage_checks else 0
        if measured:
            raise LeakFound(f"{self.probe.source}: {measured} bytes above the baseline after free()")
        self.checked("nothing left after free: live counts, usage probe")

    def expected_digests(self) -> list[str]:
        """sha256 of each segment's committed bytes, from the model alone."""
        expected = self.model.block_values(self.model.committed)
        return [
            sha256_hex(expected[:, None].expand(self.model.committed, stride)) for stride in self.model.strides
        ]


def check_same_mapping(kv_cache: ExtensibleKVCache, chunks: list, sizes: list[int]) -> None:
    """The cheap form of "touched nothing": the same mapped chunk objects and
    the same segment sizes as before."""
    now = kv_cache.buffer.mapped_chunks
    assert len(now) == len(chunks) and all(a is b for a, b in zip(now, chunks)), (
        f"mapped chunks replaced: {len(chunks)} before, {len(now)} now"
    )
    assert kv_cache.buffer.segment_sizes == sizes, f"segment sizes {sizes} -> {kv_cache.buffer.segment_sizes}"


def machine_rule(operation: str):
    """A Hypothesis rule that runs `ModelledCache.<operation>` with drawn
    arguments, when its precondition holds."""

    def run(self, data):
        getattr(self.driven, operation)(DrawnChoices(data))

    run.__name__ = operation
    return precondition(lambda self: self.driven.can(operation))(rule(data=st.data())(run))


def cache_machine(
    driver: Driver,
    probe: UsageProbe,
    kind: str,
    layout: KVCacheLayout,
    capacity: int | None = None,
    *,
    operations: collections.Counter | None = None,
    checks: collections.Counter | None = None,
):
    """A state machine over one ExtensibleKVCache of `config_for(kind, layout,
    capacity)` on `driver` (a `ModelledCache`); `capacity` defaults to
    `capacity_for(...)`. Rules: growing, at-or-below, shrinking and
    defragmenting commits, release, recommit, block writes; every invariant
    after every step. `operations` / `checks` count what ran."""

    class ExtensibleKVCacheMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.driven = ModelledCache(
                driver, probe, kind, layout, capacity, operations=operations, checks=checks
            )

        commit_grow = machine_rule("commit_grow")
        commit_at_or_below = machine_rule("commit_at_or_below")
        shrink = machine_rule("shrink")
        defragment = machine_rule("defragment")
        release = machine_rule("release")
        recommit = machine_rule("recommit")
        write_block = machine_rule("write_block")

        @invariant()
        def holds_what_the_model_says(self):
            self.driven.check_everything()

        def teardown(self):
            self.driven.free()

    return ExtensibleKVCacheMachine


def endurance_machine(
    driver: Driver,
    probe: UsageProbe,
    kind: str,
    layout: KVCacheLayout,
    capacity: int | None = None,
    *,
    operations: collections.Counter | None = None,
    checks: collections.Counter | None = None,
):
    """`cache_machine` with the rest of a cache's life: blocks read back,
    exports to a peer compared by digest, free and recreate, and on CUDA
    graphs captured over blocks committed later and replayed."""
    base = cache_machine(driver, probe, kind, layout, capacity, operations=operations, checks=checks)

    class EnduranceMachine(base):
        read_block = machine_rule("read_block")
        export_to_peer = machine_rule("export_to_peer")
        free_and_recreate = machine_rule("free_and_recreate")
        capture_graph = machine_rule("capture_graph")
        replay_graphs = machine_rule("replay_graphs")

    return EnduranceMachine


def check_cache_committed(kv_cache: ExtensibleKVCache, model: CacheModel) -> None:
    assert kv_cache.num_committed_blocks == model.committed, (
        f"{kv_cache.num_committed_blocks} blocks committed, model {model.committed}"
    )
    expected = model.sizes(model.committed) if model.mapped else model.sizes(0)
    sizes = kv_cache.buffer.segment_sizes
    assert sizes == expected, f"segment sizes {sizes}, model {expected}"


#: Bytes of a segment compared at once: a comparison on a GPU allocates a
#: temporary as large as what it compares, and a stress run may leave the
#: device nearly full.
COMPARE_BYTES = 32 << 20


def check_cache_blocks(
    kv_cache: ExtensibleKVCache, model: CacheModel, first: int, end: int, what: str, *, on_host: bool = False
) -> None:
    """Blocks [first, end) hold the model's value in every row of every
    segment (zero where nothing was written); a difference is a
    `ContentMismatch` that counts the blocks, never prints bytes. `on_host`
    compares copies in host memory, taking no device memory at all."""
    values = model.block_values(end).to("cpu" if on_host else kv_cache.buffer.device)
    for segment, stride in enumerate(model.strides):
        view = kv_cache.buffer.segment_view(segment)
        step = max(COMPARE_BYTES // stride, 1)
        wrong_rows = zero_rows = 0
        for low in range(first, end, step):
            high = min(low + step, end)
            rows = view[low * stride : high * stride].view(high - low, stride)
            rows = rows.cpu() if on_host else rows
            expected = values[low:high, None]
            if torch.equal(rows, expected.expand(high - low, stride)):
                continue
            wrong = (rows != expected).any(dim=1)
            wrong_rows += int(wrong.count_nonzero())
            zero_rows += int((wrong & (expected[:, 0] == 0)).count_nonzero())
        if wrong_rows:
            raise ContentMismatch(
                f"{what}: segment {segment}: {wrong_rows} of {end - first} blocks from block {first} differ from "
                f"the model, {zero_rows} of them should read zero"
            )


def check_cache_physical_bytes(kv_cache: ExtensibleKVCache, model: CacheModel, read_back: list) -> None:
    expected = model.physical_bytes()
    assert kv_cache.physical_bytes == expected, f"physical_bytes {kv_cache.physical_bytes}, model {expected}"
    read_back = readback_physical_bytes(kv_cache.buffer, read_back)
    assert read_back == expected, f"driver reads back {read_back} mapped bytes, model {expected}"
    if model.mapped:
        booked = kv_cache.physical_bytes_for(model.committed)
        assert booked == expected, f"physical_bytes_for({model.committed}) = {booked}, model {expected}"


def check_cache_one_chunk_per_segment(kv_cache: ExtensibleKVCache, model: CacheModel, one: list[bool] | None = None) -> None:
    """`one`: `readback_one_chunk_per_segment` of the model's one-chunk
    prefix, read back just before, to spare a second read."""
    if not model.mapped or model.one_chunk_blocks == 0:
        return
    if one is None:
        one = readback_one_chunk_per_segment(kv_cache.buffer, model.sizes(model.one_chunk_blocks))
    assert all(one), f"after the last defragment, shrink or fresh commit of {model.one_chunk_blocks} blocks: one chunk per segment, read back: {one}"
