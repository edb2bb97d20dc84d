"""Zeroing, proven over poisoned memory (invariants 1, 3 and 4).

Fresh memfd pages, and on the H200 fresh CUDA chunks, read zero whether or
not extkv zeroes them, so every test here runs over `PoisoningDriver`: each
chunk it creates is filled with 0xA5 before extkv sees it. A byte extkv
forgets to zero then reads 0xA5, and a byte it zeroes that it should have
left alone (a neighbour's, or one mapped but not committed) loses its 0xA5.

The contract checked, in the tensor's words: `zero_new` zeroes exactly the
new *logical* bytes, wherever they lie: in a granule mapped by this call,
in one mapped earlier for this segment's tail, or in one shared with the
neighbouring segment. Bytes mapped but not committed keep what they hold.
The cache builds on that: new blocks, recommitted, shrunk and discarding-
defragmented blocks read zero; preserving defragmentation moves every mapped
byte, poison included, and zeroes nothing.

Failures report counts of wrong bytes and where, never a view's contents.
"""

from __future__ import annotations

import pytest
import torch

from extkv import DriverError, FaultInjectingDriver, KVCacheLayout
from extkv.testing.checks import (
    check_all_equal,
    check_readback_matches_bookkeeping,
    check_usage_matches,
    readback_one_chunk_per_segment,
)
from extkv.testing.configs import CAPACITY, config_for, fill_segments
from extkv.vmm import PoisoningDriver, driver_for

POISON = 0xA5


@pytest.fixture
def poisoned(device) -> PoisoningDriver:
    return PoisoningDriver(driver_for(device), POISON)


@pytest.fixture
def granule(poisoned) -> int:
    return poisoned.granularity


def expect_bytes(tensor, start: int, end: int, value: int, what: str) -> None:
    """Bytes [start, end) of the reservation all equal `value`."""
    check_all_equal(tensor.full_view()[start:end], value, f"{what} [{start:#x}, {end:#x})")


# -- the tensor ---------------------------------------------------------------
@pytest.mark.invariant(1)
def test_a_run_cut_into_chunks_is_zeroed_in_every_chunk(build, poisoned, granule):
    """Zeroing walks the chunks a cut run becomes, each as it is mapped: every
    new byte reads zero, and the uncommitted tail of each segment keeps the poison."""
    capacities = [2 * granule] * 4
    t = build.tensor(sum(capacities), device=poisoned, segment_capacities=capacities)
    t.pipelined_chunk_bytes = granule
    sizes = [2 * granule - 100] * 4
    t.resize_segments_(sizes, zero_new=True)
    assert t.num_physical_chunks == 4, f"{t.num_physical_chunks} chunks for 4 aligned segments"
    for i, size in enumerate(sizes):
        start = t.segment_offsets[i]
        expect_bytes(t, start, start + size, 0, f"segment {i}'s new bytes")
        expect_bytes(t, start + size, start + capacities[i], POISON, f"segment {i}'s mapped, uncommitted tail")


@pytest.mark.invariant(1)
def test_without_zero_new_the_poison_shows(build, poisoned, granule):
    """The driver really poisons, and extkv zeroes nothing it was not asked
    to: every mapped byte reads 0xA5."""
    t = build.tensor(4 * granule, device=poisoned, segment_capacities=[3 * granule, granule])
    t.resize_segments_([granule + 100, 10])
    assert poisoned.poisoned_chunks == t.num_physical_chunks == 2, (
        f"{poisoned.poisoned_chunks} chunks poisoned, {t.num_physical_chunks} mapped"
    )
    expect_bytes(t, 0, 2 * granule, POISON, "segment 0's granules")
    expect_bytes(t, 3 * granule, 4 * granule, POISON, "segment 1's granule")


@pytest.mark.invariant(1)
def test_zero_new_zeroes_new_bytes_in_fresh_and_already_mapped_granules(build, poisoned, granule):
    """Growth that starts mid-granule: the rest of that granule was mapped by
    the previous resize and holds poison; the new committed bytes there are
    zeroed, the bytes past the new size keep their poison."""
    t = build.tensor(3 * granule, device=poisoned)
    t.resize_segments_([100], zero_new=True)
    expect_bytes(t, 0, 100, 0, "first 100 committed bytes")
    expect_bytes(t, 100, granule, POISON, "mapped, uncommitted rest of granule 0")
    t.segment_view(0).fill_(0x11)
    # Maps nothing: the new bytes lie in granule 0, mapped already.
    t.resize_segments_([5000], zero_new=True)
    expect_bytes(t, 0, 100, 0x11, "bytes committed before")
    expect_bytes(t, 100, 5000, 0, "new bytes in a granule mapped by an earlier resize")
    expect_bytes(t, 5000, granule, POISON, "uncommitted rest of granule 0")
    # Half in granule 0 (mapped), half in granule 1 (mapped now).
    t.resize_segments_([granule + 300], zero_new=True)
    expect_bytes(t, 0, 100, 0x11, "bytes committed first")
    expect_bytes(t, 100, granule + 300, 0, "new bytes across the granule boundary")
    expect_bytes(t, granule + 300, 2 * granule, POISON, "uncommitted rest of granule 1")


@pytest.mark.invariant(1)
def test_zero_new_in_a_shared_granule_leaves_the_neighbours_bytes(build, poisoned, granule):
    """Segment 1 starts in the middle of granule 1, which segment 0's growth
    mapped. Segment 1 growing there zeroes its own new bytes only: segment
    0's committed bytes keep their values, its uncommitted ones their poison."""
    half, quarter = granule // 2, granule // 4
    t = build.tensor(3 * granule, device=poisoned, segment_capacities=[granule + half, granule + half])
    t.resize_segments_([granule + quarter, 0], zero_new=True)
    t.segment_view(0).fill_(0x11)
    chunks = t.num_physical_chunks
    t.resize_segments_([granule + quarter, quarter], zero_new=True)
    assert t.num_physical_chunks == chunks, f"{t.num_physical_chunks - chunks} chunk(s) mapped for a mapped granule"
    expect_bytes(t, 0, granule + quarter, 0x11, "segment 0's committed bytes")
    expect_bytes(t, granule + quarter, granule + half, POISON, "segment 0's uncommitted tail in the shared granule")
    expect_bytes(t, granule + half, granule + half + quarter, 0, "segment 1's new bytes")
    expect_bytes(t, granule + half + quarter, 2 * granule, POISON, "segment 1's uncommitted bytes in granule 1")
    # Both grow: segment 0 inside the shared granule, segment 1 into granule 2.
    t.segment_view(1).fill_(0x22)
    t.resize_segments_([granule + half, granule + half], zero_new=True)
    expect_bytes(t, 0, granule + quarter, 0x11, "segment 0's old bytes")
    expect_bytes(t, granule + quarter, granule + half, 0, "segment 0's new bytes in the shared granule")
    expect_bytes(t, granule + half, granule + half + quarter, 0x22, "segment 1's old bytes")
    expect_bytes(t, granule + half + quarter, 3 * granule, 0, "segment 1's new bytes")


@pytest.mark.invariant(1)
def test_zero_new_reaches_new_bytes_after_the_last_new_run(build, poisoned, granule):
    """Runs are zeroed as they are mapped; bytes growing into mapped granules
    past the last new run are zeroed too. Segment 1 maps granule 1 (the only
    run); segment 2 grows inside granule 3, mapped earlier."""
    half = granule // 2
    t = build.tensor(4 * granule, device=poisoned, segment_capacities=[granule, granule + half, granule + half])
    t.resize_segments_([10, 0, granule], zero_new=True)  # granules 0, 2, 3
    t.resize_segments_([10, granule, granule + 100], zero_new=True)
    expect_bytes(t, 10, granule, POISON, "segment 0's uncommitted bytes")
    expect_bytes(t, granule, 2 * granule, 0, "segment 1's new bytes (the new run)")
    expect_bytes(t, 2 * granule, granule * 5 // 2, POISON, "segment 1's uncommitted bytes in granule 2")
    expect_bytes(t, granule * 7 // 2, granule * 7 // 2 + 100, 0, "segment 2's new bytes past the last run")
    expect_bytes(t, granule * 7 // 2 + 100, 4 * granule, POISON, "segment 2's uncommitted bytes")


@pytest.mark.invariant(1)
def test_zero_new_between_runs(build, poisoned, granule):
    """Three runs with new bytes in mapped granules before, between and
    after them, all in one resize."""
    t = build.tensor(9 * granule, device=poisoned, segment_capacities=[3 * granule] * 3)
    t.resize_segments_([granule // 2] * 3, zero_new=True)
    for i in range(3):
        t.segment_view(i).fill_(0x30 + i)
    t.resize_segments_([3 * granule - 1] * 3, zero_new=True)
    for i in range(3):
        start = 3 * i * granule
        expect_bytes(t, start, start + granule // 2, 0x30 + i, f"segment {i}'s old bytes")
        expect_bytes(t, start + granule // 2, start + 3 * granule - 1, 0, f"segment {i}'s new bytes")
        expect_bytes(t, start + 3 * granule - 1, start + 3 * granule, POISON, f"segment {i}'s last, uncommitted byte")


@pytest.mark.invariant(4)
def test_release_then_regrow_zeroes_fresh_chunks(build, poisoned, granule):
    t = build.tensor(4 * granule, device=poisoned, segment_capacities=[2 * granule, 2 * granule])
    t.resize_segments_([2 * granule, granule + 7], zero_new=True)
    t.full_view()[: 3 * granule + 7].fill_(0x33)
    created = poisoned.poisoned_chunks
    t.release_physical()
    t.resize_segments_([2 * granule, granule + 7], zero_new=True)
    assert poisoned.poisoned_chunks > created, "regrowth created no poisoned chunk"
    expect_bytes(t, 0, 3 * granule + 7, 0, "recommitted bytes")
    expect_bytes(t, 3 * granule + 7, 4 * granule, POISON, "segment 1's uncommitted bytes")


# -- the cache ----------------------------------------------------------------
@pytest.fixture
def cache(case, build, poisoned):
    _, layout, config = case
    return build.cache(config, layout, device=poisoned)


def segment_count(kv_cache) -> int:
    return len(kv_cache.segment_strides)


def expect_kept_then_zero(kv_cache, patterns: list[torch.Tensor], what: str) -> None:
    """Each segment starts with its pattern and is zero after it."""
    for i, pattern in enumerate(patterns):
        view = kv_cache.buffer.segment_view(i)
        check_all_equal(view[: pattern.numel()], pattern, f"{what}: segment {i}'s kept blocks")
        check_all_equal(view[pattern.numel() :], 0, f"{what}: segment {i}'s new blocks")


def expect_all_zero(kv_cache, what: str) -> None:
    for i in range(segment_count(kv_cache)):
        check_all_equal(kv_cache.buffer.segment_view(i), 0, f"{what}: segment {i}")


def fragment(kv_cache, n: int = CAPACITY // 2) -> None:
    """Commit 1 block, then n: every segment whose prefix crosses a granule
    then spans two chunks."""
    kv_cache.commit(1)
    kv_cache.commit(n)
    sizes = [n * stride for stride in kv_cache.segment_strides]
    assert not all(readback_one_chunk_per_segment(kv_cache.buffer, sizes)), "commit(1) then commit(n) fragmented nothing"


@pytest.mark.invariant(1)
def test_commit_new_blocks_read_zero(cache, poisoned, usage):
    baseline = usage.read_outside_torch()
    cache.commit(1)
    patterns = fill_segments(cache, seed=1)
    for target in (37, 333, 520, CAPACITY):
        cache.commit(target)
        expect_kept_then_zero(cache, patterns, f"commit({target})")
        check_usage_matches(usage, baseline, [cache.buffer])
        patterns = fill_segments(cache, seed=target)
    assert poisoned.poisoned_bytes == cache.physical_bytes, (
        f"{poisoned.poisoned_bytes} bytes poisoned, {cache.physical_bytes} mapped by growth alone"
    )


@pytest.mark.invariant(4)
def test_recommit_after_release_reads_zero(cache, poisoned, usage):
    baseline = usage.read_outside_torch()
    cache.commit(200)
    fill_segments(cache, seed=2)
    cache.release_physical()
    created = poisoned.poisoned_chunks
    cache.recommit()
    assert poisoned.poisoned_chunks > created, "recommit created no poisoned chunk"
    assert cache.physical_bytes == cache.physical_bytes_for(200)
    expect_all_zero(cache, "recommit")
    check_usage_matches(usage, baseline, [cache.buffer])


@pytest.mark.invariant(4)
def test_recommit_after_a_release_that_failed_part_way_reads_zero(case, build, poisoned, usage):
    """A sleep whose release fails part way leaves some chunks mapped; the
    wake must map the rest and zero every committed byte."""
    baseline = usage.read_outside_torch()
    faulty = FaultInjectingDriver(poisoned)
    _, layout, config = case
    cache = build.cache(config, layout, device=faulty)
    cache.commit(100)
    cache.commit(300)
    cache.commit(CAPACITY)  # several chunks per segment, so a release can fail between two
    fill_segments(cache, seed=3)
    faulty.fail_in("release", 2)
    with pytest.raises(DriverError, match="injected fault"):
        cache.release_physical()
    assert 0 < cache.physical_bytes < cache.physical_bytes_for(CAPACITY), "the failure left nothing mapped"
    cache.recommit()
    assert cache.physical_bytes == cache.physical_bytes_for(CAPACITY)
    check_readback_matches_bookkeeping(cache.buffer)
    expect_all_zero(cache, "recommit after a release that failed part way")
    cache.release_physical()
    check_usage_matches(usage, baseline, [cache.buffer])


@pytest.mark.invariant(3)
def test_shrink_reads_zero(cache, usage):
    baseline = usage.read_outside_torch()
    cache.commit(CAPACITY)
    fill_segments(cache, seed=4)
    cache.commit(37, shrink=True)
    assert cache.num_committed_blocks == 37 and cache.physical_bytes == cache.physical_bytes_for(37)
    expect_all_zero(cache, "shrink to 37")
    check_usage_matches(usage, baseline, [cache.buffer])


@pytest.mark.invariant(3)
def test_discarding_defragment_reads_zero(cache, usage):
    baseline = usage.read_outside_torch()
    n = CAPACITY // 2
    fragment(cache, n)
    fill_segments(cache, seed=5)
    cache.commit(n, defragment=True)
    sizes = [n * s for s in cache.segment_strides]
    assert readback_one_chunk_per_segment(cache.buffer, sizes) == [True] * len(sizes)
    expect_all_zero(cache, "discarding defragment")
    check_usage_matches(usage, baseline, [cache.buffer])


@pytest.mark.invariant(3)
def test_preserving_defragment_moves_every_mapped_byte_and_zeroes_nothing(cache, usage):
    """Committed bytes keep their values, and mapped bytes past the committed
    blocks keep their poison: the defragmentation copies, it does not zero."""
    baseline = usage.read_outside_torch()
    n = CAPACITY // 2
    fragment(cache, n)
    fill_segments(cache, seed=6)
    driver = cache.buffer.driver
    mapped = [(m.address, driver.view(m.address, m.chunk.size).clone()) for m in cache.buffer.mapped_chunks]
    poison_before = sum(int((copy == POISON).count_nonzero()) for _, copy in mapped)
    assert poison_before > 0, "no mapped byte holds poison: the test proves nothing"
    physical = cache.physical_bytes
    cache.commit(n, defragment=True, preserve_contents=True)
    assert cache.physical_bytes == physical, f"physical bytes {physical} -> {cache.physical_bytes}"
    for address, copy in mapped:
        check_all_equal(driver.view(address, copy.numel()), copy, f"mapped bytes at {address:#x}")
    check_readback_matches_bookkeeping(cache.buffer)
    check_usage_matches(usage, baseline, [cache.buffer])


@pytest.mark.invariant(1, 3)
@pytest.mark.parametrize("preserve", [False, True], ids=["discarding", "preserving"])
def test_defragment_that_also_grows(cache, usage, preserve):
    """`commit(m, defragment=True)` from a fragmented n < m: every segment ends
    on one chunk (read back from the driver or kernel), the kept blocks keep
    their bytes when preserving, and everything else reads zero."""
    baseline = usage.read_outside_torch()
    n, m = CAPACITY // 2, CAPACITY
    fragment(cache, n)
    patterns = fill_segments(cache, seed=7)
    cache.commit(m, defragment=True, preserve_contents=preserve)
    sizes = [m * s for s in cache.segment_strides]
    assert cache.num_committed_blocks == m
    one_chunk = readback_one_chunk_per_segment(cache.buffer, sizes)
    assert one_chunk == [True] * len(sizes), f"segments backed by one chunk, read back: {one_chunk}"
    assert cache.physical_bytes == cache.physical_bytes_for(m)
    if preserve:
        expect_kept_then_zero(cache, patterns, f"commit({m}, defragment=True, preserve_contents=True)")
    else:
        expect_all_zero(cache, f"commit({m}, defragment=True)")
    check_readback_matches_bookkeeping(cache.buffer)
    check_usage_matches(usage, baseline, [cache.buffer])


@pytest.mark.invariant(1)
@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.LBNHC], ids=lambda layout: layout.name)
def test_growth_in_a_shared_granule_keeps_the_neighbour_segment(build, poisoned, layout):
    """Unpadded layer-outermost segments share granules: growing one layer's
    blocks into a granule that holds the previous layer's committed blocks
    zeroes the new blocks only."""
    kv_cache = build.cache(config_for("full", layout), layout, device=poisoned)
    granule = poisoned.granularity
    offsets, strides = kv_cache.segment_offsets, kv_cache.segment_strides
    shared = [i for i in range(1, len(offsets)) if offsets[i] % granule]
    assert shared, f"segment offsets {offsets} all start on a granule: no granule is shared"
    # Blocks that put segment 0's committed end inside segment 1's first granule.
    first = (offsets[1] // granule * granule) // strides[0] + 1
    kv_cache.commit(first)
    patterns = fill_segments(kv_cache, seed=8)
    kv_cache.commit(first + 20)
    expect_kept_then_zero(kv_cache, patterns, f"commit({first} -> {first + 20})")
