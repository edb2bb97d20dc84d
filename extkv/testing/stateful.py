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

The suites build machines with `tensor_machine(...)` / `cache_machine(...)`
and run them with `hypothesis.stateful.run_state_machine_as_test`.
"""

from __future__ import annotations

import torch
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ..cache import ExtensibleKVCache
from ..layout import KVCacheLayout, kv_cache_segments
from ..tensor import ExtensibleTensor
from ..usage import UsageProbe
from ..vmm import Driver
from .checks import (
    check_readback_matches_bookkeeping,
    check_unchanged,
    check_usage_matches,
    read_back_granules,
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

    def release(self) -> None:
        self.sizes = [0] * len(self.capacities)
        self.memory = {}


def tensor_machine(driver: Driver, probe: UsageProbe, fresh_byte: int | None = None):
    """A state machine over one ExtensibleTensor of three segments on `driver`.
    `fresh_byte`: what every new chunk of `driver` holds (a PoisoningDriver's
    pattern), or None if unknown."""
    granule = driver.granularity
    # Segment 1 starts mid-granule, so granules are shared and growth starts
    # inside mapped granules.
    capacities = [granule * 5 // 2, granule * 3 // 2, 3 * granule]

    class ExtensibleTensorMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.baseline = probe.read_outside_torch()
            self.tensor = ExtensibleTensor(sum(capacities), device=driver, segment_capacities=capacities)
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

        @invariant()
        def holds_what_the_model_says(self):
            check_tensor_sizes(self.tensor, self.model)
            check_addresses_fixed(self.tensor, self.model.offsets, self.base)
            check_tensor_contents(self.tensor, self.model)
            read_back = read_back_granules(self.tensor)
            check_tensor_physical_bytes(self.tensor, self.model, read_back)
            check_readback_matches_bookkeeping(self.tensor, read_back)
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


def cache_machine(driver: Driver, probe: UsageProbe, kind: str, layout: KVCacheLayout, capacity: int | None = None):
    """A state machine over one ExtensibleKVCache of `config_for(kind, layout,
    capacity)` on `driver`; `capacity` defaults to `capacity_for(...)`."""
    granule = driver.granularity
    capacity = capacity_for(kind, layout, granule) if capacity is None else capacity
    config = config_for(kind, layout, capacity)
    blocks = st.integers(0, capacity + capacity // 4)  # past capacity: clamped

    class ExtensibleKVCacheMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.baseline = probe.read_outside_torch()
            self.cache = ExtensibleKVCache(config, driver, layout)
            self.model = CacheModel(capacity, self.cache.segment_offsets, self.cache.segment_strides, granule)
            self.base = self.cache.buffer.base

        def _prefix_is_one_chunk(self, num_blocks: int) -> bool:
            return all(readback_one_chunk_per_segment(self.cache.buffer, self.model.sizes(num_blocks)))

        @precondition(lambda self: self.model.committed < capacity)
        @rule(data=st.data())
        def commit_grow(self, data):
            n = data.draw(st.integers(self.model.committed + 1, capacity + capacity // 4), label="num_blocks")
            note(f"commit({n})")
            self.cache.commit(n)
            self.model.grow(min(n, capacity))

        @rule(data=st.data())
        def commit_at_or_below(self, data):
            n = data.draw(st.integers(0, self.model.committed), label="num_blocks")
            note(f"commit({n})  # at or below {self.model.committed}: touches nothing")
            before = snapshot(self.cache)
            self.cache.commit(n)
            check_unchanged(self.cache, before)

        @precondition(lambda self: self.model.committed > 0)
        @rule(data=st.data())
        def shrink(self, data):
            n = data.draw(st.integers(0, self.model.committed), label="num_blocks")
            note(f"commit({n}, shrink=True)")
            self.cache.commit(n, shrink=True)
            if n < self.model.committed:
                self.model.discard(n)

        @rule(n=blocks, preserve=st.booleans())
        def defragment(self, n, preserve):
            target = min(n, capacity)
            fragmented = not self._prefix_is_one_chunk(target)
            note(f"commit({n}, defragment=True, preserve_contents={preserve})  # prefix fragmented: {fragmented}")
            self.cache.commit(n, defragment=True, preserve_contents=preserve)
            model = self.model
            if fragmented and not preserve:
                model.discard(target)
                return
            model.grow(target)
            if model.mapped:
                # Preserving a fragmented prefix moves every committed byte
                # of every segment onto one chunk; otherwise the prefix was
                # one chunk already and growth inside it maps nothing.
                model.one_chunk_blocks = model.committed if fragmented else max(model.one_chunk_blocks, target)

        @rule()
        def release(self):
            note("release_physical()")
            self.cache.release_physical()
            self.model.release()

        @rule()
        def recommit(self):
            note("recommit()")
            if self.model.mapped:
                before = snapshot(self.cache)
                self.cache.recommit()
                check_unchanged(self.cache, before)
                return
            self.cache.recommit()
            self.model.remap()

        @precondition(lambda self: self.model.mapped and self.model.committed > 0)
        @rule(data=st.data(), value=st.integers(1, 255))
        def write_block(self, data, value):
            block = data.draw(st.integers(0, self.model.committed - 1), label="block")
            note(f"block {block}: every row filled with {value}")
            for segment, stride in enumerate(self.model.strides):
                self.cache.buffer.segment_view(segment)[block * stride : (block + 1) * stride].fill_(value)
            self.model.values[block] = value

        @invariant()
        def holds_what_the_model_says(self):
            check_addresses_fixed(self.cache.buffer, self.cache.segment_offsets, self.base)
            check_cache_committed(self.cache, self.model)
            check_cache_contents(self.cache, self.model)
            read_back = read_back_granules(self.cache.buffer)
            check_cache_physical_bytes(self.cache, self.model, read_back)
            check_cache_one_chunk_per_segment(self.cache, self.model)
            check_readback_matches_bookkeeping(self.cache.buffer, read_back)
            check_usage_matches(probe, self.baseline, [self.cache.buffer])

        def teardown(self):
            self.cache.free()

    return ExtensibleKVCacheMachine


def check_cache_committed(kv_cache: ExtensibleKVCache, model: CacheModel) -> None:
    assert kv_cache.num_committed_blocks == model.committed, (
        f"{kv_cache.num_committed_blocks} blocks committed, model {model.committed}"
    )
    expected = model.sizes(model.committed) if model.mapped else model.sizes(0)
    sizes = kv_cache.buffer.segment_sizes
    assert sizes == expected, f"segment sizes {sizes}, model {expected}"


def check_cache_contents(kv_cache: ExtensibleKVCache, model: CacheModel) -> None:
    """Every committed row holds its block's value; unwritten blocks read zero."""
    n = model.committed
    if not model.mapped or n == 0:
        return
    expected = torch.zeros(n, dtype=torch.uint8)
    for block, value in model.values.items():
        expected[block] = value
    expected = expected.to(kv_cache.buffer.device)
    for segment, stride in enumerate(model.strides):
        view = kv_cache.buffer.segment_view(segment)
        if torch.equal(view, expected.repeat_interleave(stride)):
            continue
        wrong = (view.view(n, stride) != expected[:, None]).any(dim=1)
        wrong_rows, zero_rows = int(wrong.count_nonzero()), int((wrong & (expected == 0)).count_nonzero())
        assert wrong_rows == 0, (
            f"segment {segment}: {wrong_rows} of {n} blocks differ from the model, "
            f"{zero_rows} of them should read zero"
        )


def check_cache_physical_bytes(kv_cache: ExtensibleKVCache, model: CacheModel, read_back: list) -> None:
    expected = model.physical_bytes()
    assert kv_cache.physical_bytes == expected, f"physical_bytes {kv_cache.physical_bytes}, model {expected}"
    read_back = readback_physical_bytes(kv_cache.buffer, read_back)
    assert read_back == expected, f"driver reads back {read_back} mapped bytes, model {expected}"
    if model.mapped:
        booked = kv_cache.physical_bytes_for(model.committed)
        assert booked == expected, f"physical_bytes_for({model.committed}) = {booked}, model {expected}"


def check_cache_one_chunk_per_segment(kv_cache: ExtensibleKVCache, model: CacheModel) -> None:
    if not model.mapped or model.one_chunk_blocks == 0:
        return
    one = readback_one_chunk_per_segment(kv_cache.buffer, model.sizes(model.one_chunk_blocks))
    assert all(one), f"after the last defragment, shrink or fresh commit of {model.one_chunk_blocks} blocks: one chunk per segment, read back: {one}"
