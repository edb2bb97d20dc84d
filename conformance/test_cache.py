"""ExtensibleKVCache conformance on every layout, MLA, mixed-stride and padded
configs, on the host driver and each CUDA device. Physical usage is read from
outside extkv after every step. Caches come from the `build` fixture, freed
even when a test fails. Zeroing over poisoned memory is in test_zeroing."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from extkv import KV_CACHE_NON_TORCH_RESERVE_BYTES, DriverError, FaultInjectingDriver, StateError, measure_kv_cache_blocks
from extkv.cache import ExtensibleKVCache
from extkv.layout import (
    KVCacheConfig,
    KVCacheLayout,
    KVCacheTensor,
    create_kv_cache_views,
    granule_block_alignment,
    layer_spec_for_tensor,
)
from extkv.testing.checks import (
    read_back_granules,
    check_all_equal,
    check_mapped_as_a_shrink_keeps,
    check_readback_matches_bookkeeping,
    check_unchanged,
    check_usage_matches,
    readback_one_chunk_per_segment,
    snapshot,
)
from extkv.testing.configs import CAPACITY, GRANULE, config_for, fill_segments
from extkv.testing.readings import InjectedReadingsDriver
from extkv.vmm import PoisoningDriver, driver_for, live_chunks

@pytest.fixture
def cache(case, build, device):
    _, layout, config = case
    return build.cache(config, layout, device=device)


def block_addresses(view: torch.Tensor, block: int) -> torch.Tensor:
    """Address of every byte of `view[block]`, from its shape and strides
    alone: nothing is read."""
    page = view[block]
    offsets = torch.zeros((), dtype=torch.int64)
    for size, stride in zip(page.shape, page.stride()):
        offsets = offsets[..., None] + torch.arange(size, dtype=torch.int64) * stride
    starts = page.data_ptr() + offsets.flatten() * page.element_size()
    return (starts[:, None] + torch.arange(page.element_size())).flatten()


def outside_committed(kv_cache, addresses: torch.Tensor, num_blocks: int) -> int:
    """How many of `addresses` lie outside the bytes `num_blocks` commits."""
    inside = torch.zeros(addresses.shape, dtype=torch.bool)
    for offset, stride in zip(kv_cache.segment_offsets, kv_cache.segment_strides):
        start = kv_cache.buffer.base + offset
        inside |= (addresses >= start) & (addresses < start + num_blocks * stride)
    return int((~inside).count_nonzero())


@pytest.mark.invariant(1)
def test_segment_geometry(case, cache):
    kind, layout, config = case
    strides = cache.segment_strides
    assert cache.bytes_per_block == sum(strides)
    assert cache.segment_offsets[0] == 0 and cache.segment_offsets == sorted(cache.segment_offsets)
    assert sum(cache.buffer.segment_capacities) == config.kv_cache_tensors[0].size
    for offset, stride, capacity in zip(cache.segment_offsets, strides, cache.buffer.segment_capacities):
        assert capacity >= CAPACITY * stride  # padding only adds room
    num_layers = sum(len(t.layers) for t in config.kv_cache_tensors)
    if layout.is_block_outermost or not layout.is_block_compact:
        assert len(set(strides)) == 1
    else:
        # one segment per layer region (aliasing groups share regions)
        assert len(strides) == len({t.layer_offset(i) for t in config.kv_cache_tensors for i in range(len(t.layers))})
    if kind == "padded" and layout is KVCacheLayout.LBHNC:
        assert all(offset % GRANULE == 0 for offset in cache.segment_offsets), (
            f"padded segment offsets {cache.segment_offsets} are not all multiples of {GRANULE}"
        )
    if kind == "mixed":
        assert len(set(strides)) == 2
    # Committing n blocks backs every byte of block n-1 of every layer's view
    # (as built over the whole reservation), and no byte of block n.
    full = cache.buffer.full_view()
    views = [
        view
        for tensor in config.kv_cache_tensors
        for view in create_kv_cache_views(full, layer_spec_for_tensor(config, tensor)[1], CAPACITY, layout, tensor)
    ]
    assert len(views) == num_layers, f"{len(views)} layer views for {num_layers} layers"
    for n in (1, 37, CAPACITY - 1):
        for layer, view in enumerate(views):
            last = outside_committed(cache, block_addresses(view, n - 1), n)
            assert last == 0, f"commit({n}): {last} bytes of layer {layer}'s block {n - 1} are not committed"
            beyond = block_addresses(view, n)
            uncommitted = outside_committed(cache, beyond, n)
            assert uncommitted == beyond.numel(), (
                f"commit({n}): {beyond.numel() - uncommitted} bytes of layer {layer}'s block {n}, not committed, lie in committed memory"
            )


@pytest.mark.invariant(5)
def test_allocate_commits_only_the_null_block(cache, usage):
    baseline = usage.read_outside_torch()
    full = cache.allocate(cache.size)
    assert cache.num_committed_blocks == 1
    assert full.data_ptr() == cache.buffer.base and full.numel() == cache.size
    assert cache.physical_bytes == cache.physical_bytes_for(1)
    check_usage_matches(usage, baseline, [cache.buffer])
    with pytest.raises(ValueError, match=f"backs exactly {cache.size} bytes"):
        cache.allocate(cache.size + 1)


@pytest.mark.invariant(1, 5)
def test_addresses_fixed_contents_kept_new_blocks_zero(cache, usage):
    baseline = usage.read_outside_torch()
    cache.commit(5)
    base = cache.buffer.base
    pointers = [cache.buffer.segment_view(i).data_ptr() for i in range(len(cache.segment_strides))]
    patterns = fill_segments(cache, seed=3)
    for target in (6, 100, 333, CAPACITY):
        cache.commit(target)
        assert cache.num_committed_blocks == target and cache.buffer.base == base
        for i, (pattern, stride) in enumerate(zip(patterns, cache.segment_strides)):
            view = cache.buffer.segment_view(i)
            assert view.data_ptr() == pointers[i]
            assert view.numel() == target * stride
            check_all_equal(view[: pattern.numel()], pattern, f"commit({target}): segment {i}'s kept blocks")
            check_all_equal(view[pattern.numel() :], 0, f"commit({target}): segment {i}'s new blocks")
        assert cache.physical_bytes == cache.physical_bytes_for(target)
        check_usage_matches(usage, baseline, [cache.buffer])
        patterns = fill_segments(cache, seed=target)


@pytest.mark.invariant(1)
def test_commit_at_or_below_committed_touches_nothing(cache):
    cache.commit(50)
    fill_segments(cache, seed=1)
    before = snapshot(cache)
    for n in (50, 10, 0):
        cache.commit(n)
        check_unchanged(cache, before)


@pytest.mark.invariant(6)
def test_commit_clamps_to_capacity(cache):
    cache.commit(CAPACITY * 10)
    assert cache.num_committed_blocks == CAPACITY
    assert cache.physical_bytes_for(CAPACITY * 10) == cache.physical_bytes_for(CAPACITY) == cache.physical_bytes


@pytest.mark.invariant(3, 5)
def test_shrink_remaps_to_exactly_physical_bytes_for(cache, usage):
    baseline = usage.read_outside_torch()
    cache.commit(CAPACITY)
    fill_segments(cache, seed=9)
    for n in (400, 37, 1):
        cache.commit(n, shrink=True)
        assert cache.num_committed_blocks == n
        assert cache.physical_bytes == cache.physical_bytes_for(n)
        check_usage_matches(usage, baseline, [cache.buffer])
        for i in range(len(cache.segment_strides)):
            check_all_equal(cache.buffer.segment_view(i), 0, f"shrink to {n}: segment {i}")


def footprint_read_back(kv_cache, num_blocks: int) -> tuple[int, int, int]:
    """From the driver's read-back alone: the bytes of the chunks that hold
    a byte of the first `num_blocks` blocks of some segment (what a
    preserving shrink to `num_blocks` keeps mapped), the bytes of the
    granules those bytes touch (the least it may), and how many chunks hold
    none of them (what it releases)."""
    buffer, g = kv_cache.buffer, kv_cache.buffer.granularity
    kept = {index for offset, stride in zip(kv_cache.segment_offsets, kv_cache.segment_strides) if num_blocks
            for index in range(offset // g, -(-(offset + num_blocks * stride) // g))}
    read_back = read_back_granules(buffer)
    granules_of: dict = {}
    for index in range(len(read_back) // 2):
        if read_back[2 * index] is not None:
            granules_of.setdefault(read_back[2 * index], set()).add(index)
    holding = [granules for granules in granules_of.values() if granules & kept]
    return sum(len(granules) * g for granules in holding), len(kept) * g, len(granules_of) - len(holding)


@pytest.mark.invariant(1, 3, 5)
def test_a_preserving_shrink_keeps_every_byte_below_and_releases_every_chunk_above(case, build, device, usage):
    """Grown in four commits (chunks straddle the shrinks' ends) over poison,
    filled with a never-zero pattern, shrunk step by step: the kept blocks
    hold their bytes at their addresses, the footprint is exactly the
    chunks holding a kept byte as the driver reads them back, predicted by
    physical_bytes_after_shrink, and what regrowth commits again reads zero."""
    _, layout, config = case
    baseline, kind = usage.read_outside_torch(), driver_for(device).kind
    cache = build.cache(config, layout, device=PoisoningDriver(driver_for(device)))
    for n in (1, 50, 200, CAPACITY):
        cache.commit(n)
    patterns = fill_segments(cache, seed=21)
    pointers = [cache.buffer.segment_view(i).data_ptr() for i in range(len(patterns))]
    for n in (CAPACITY - 1, 400, 137, 37, 1, 0):
        predicted = cache.physical_bytes_after_shrink(n)
        expected, least, dropped = footprint_read_back(cache, n)
        assert predicted == expected, f"shrink to {n}: physical_bytes_after_shrink says {predicted}, the read-back {expected}"
        assert least == cache.physical_bytes_for(n) <= predicted
        chunks, releases = live_chunks[kind], cache.buffer.release_count
        cache.commit(n, shrink=True, preserve_contents=True)
        assert cache.num_committed_blocks == n and cache.buffer.segment_sizes == [n * s for s in cache.segment_strides]
        assert cache.physical_bytes == predicted, f"shrink to {n}: {cache.physical_bytes} bytes mapped, predicted {predicted}"
        assert live_chunks[kind] == chunks - dropped, f"shrink to {n}: {chunks - live_chunks[kind]} chunks released, {dropped} expected"
        assert cache.buffer.release_count == releases + 1
        check_mapped_as_a_shrink_keeps(cache.buffer, cache.buffer.segment_sizes)
        check_readback_matches_bookkeeping(cache.buffer)
        check_usage_matches(usage, baseline, [cache.buffer])
        for i, (pattern, stride) in enumerate(zip(patterns, cache.segment_strides)):
            view = cache.buffer.segment_view(i)
            assert n == 0 or view.data_ptr() == pointers[i], f"segment {i} moved"
            check_all_equal(view, pattern[: n * stride], f"shrink to {n}: segment {i}'s kept blocks")
    assert cache.physical_bytes == 0
    cache.commit(1)
    patterns = fill_segments(cache, seed=22)
    cache.commit(300)
    fill_segments(cache, seed=23)  # what the shrink drops lies in the kept chunk too
    cache.commit(100, shrink=True, preserve_contents=True)
    cache.commit(CAPACITY)
    for i, stride in enumerate(cache.segment_strides):
        view = cache.buffer.segment_view(i)
        check_all_equal(view[100 * stride :], 0, f"segment {i}'s blocks committed again after the shrink")
    check_usage_matches(usage, baseline, [cache.buffer])


@pytest.mark.invariant(1, 3, 5)
def test_a_preserving_shrink_that_defragments_keeps_the_bytes_on_one_chunk_per_segment(case, build, device, usage):
    baseline = usage.read_outside_torch()
    cache = build.cache(case[2], case[1], device=device)
    n = fragment(cache)
    cache.commit(CAPACITY)
    patterns = fill_segments(cache, seed=31)
    target = max(n - 3, 1)
    cache.commit(target, defragment=True, shrink=True, preserve_contents=True)
    sizes = cache.buffer.segment_sizes
    assert cache.num_committed_blocks == target and sizes == [target * s for s in cache.segment_strides]
    assert readback_one_chunk_per_segment(cache.buffer, sizes) == [True] * len(sizes)
    for i, (pattern, size) in enumerate(zip(patterns, sizes)):
        check_all_equal(cache.buffer.segment_view(i), pattern[:size], f"segment {i}'s kept blocks")
    check_mapped_as_a_shrink_keeps(cache.buffer, sizes)
    check_readback_matches_bookkeeping(cache.buffer)
    check_usage_matches(usage, baseline, [cache.buffer])


@pytest.mark.invariant(1, 4, 5)
def test_a_preserving_shrink_while_asleep_lowers_the_count_and_maps_nothing(build, device, usage):
    """Asleep, nothing is mapped to keep: the count drops, the cache stays
    asleep, and the wake maps the blocks kept, zeroed over poison, as any
    wake. A shrink above the count is a growth, and wakes it as one."""
    baseline = usage.read_outside_torch()
    poisoned = PoisoningDriver(driver_for(device))
    cache = build.cache(config_for("full", KVCacheLayout.LBHNC), KVCacheLayout.LBHNC, device=poisoned)
    cache.commit(300)
    fill_segments(cache, seed=41)
    cache.release_physical()
    creates = poisoned.poisoned_chunks
    cache.commit(120, shrink=True, preserve_contents=True)
    assert cache.is_asleep and cache.num_committed_blocks == 120 and cache.physical_bytes == 0
    assert poisoned.poisoned_chunks == creates, "the shrink of a sleeping cache created memory"
    check_usage_matches(usage, baseline, [cache.buffer])
    cache.recommit()
    assert not cache.is_asleep and cache.physical_bytes == cache.physical_bytes_for(120)
    for i in range(len(cache.segment_strides)):
        check_all_equal(cache.buffer.segment_view(i), 0, f"segment {i} woken after the shrink")
    cache.release_physical()
    cache.commit(200, shrink=True, preserve_contents=True)
    assert not cache.is_asleep and cache.num_committed_blocks == 200
    assert cache.physical_bytes == cache.physical_bytes_for(200)
    for i in range(len(cache.segment_strides)):
        check_all_equal(cache.buffer.segment_view(i), 0, f"segment {i} grown by the shrink above the count")
    check_usage_matches(usage, baseline, [cache.buffer])


@pytest.mark.invariant(1, 5)
@pytest.mark.parametrize("step, call", [("unmap", 2), ("release", 1)])
def test_a_preserving_shrink_failing_part_way_keeps_its_blocks_and_completes_when_called_again(build, device, usage, step, call):
    baseline = usage.read_outside_torch()
    faulty = FaultInjectingDriver(driver_for(device))
    cache = build.cache_for("full", KVCacheLayout.LBHNC, device=faulty)
    for n in (1, 100, 300, CAPACITY):
        cache.commit(n)
    patterns = fill_segments(cache, seed=51)
    predicted = cache.physical_bytes_after_shrink(50)
    faulty.fail_in(step, call)
    with pytest.raises(DriverError, match="injected fault"):
        cache.commit(50, shrink=True, preserve_contents=True)
    assert cache.num_committed_blocks == 50 and cache.buffer.segment_sizes == [50 * s for s in cache.segment_strides]
    check_readback_matches_bookkeeping(cache.buffer)
    for i, (pattern, stride) in enumerate(zip(patterns, cache.segment_strides)):
        check_all_equal(cache.buffer.segment_view(i), pattern[: 50 * stride], f"segment {i} after a failed shrink")
    cache.commit(50, shrink=True, preserve_contents=True)
    assert cache.physical_bytes == predicted
    check_mapped_as_a_shrink_keeps(cache.buffer, cache.buffer.segment_sizes)
    check_usage_matches(usage, baseline, [cache.buffer])


@pytest.mark.invariant(6)
def test_a_forked_childs_copy_refuses_a_preserving_shrink(build, device):
    """A child's copy maps none of its parent's memory: the shrink is
    refused there, naming why, and the parent's blocks are untouched."""
    cache = build.cache_for("full", KVCacheLayout.LBHNC, device=device)
    cache.commit(200)
    patterns = fill_segments(cache, seed=61)
    reading, writing = os.pipe()
    child = os.fork()
    if child == 0:
        code = 1
        try:
            os.close(reading)
            signal.alarm(10)  # a child stuck is a failure, not a hang
            try:
                cache.commit(100, shrink=True, preserve_contents=True)
                answer = "the shrink ran"
            except StateError as error:
                answer = f"StateError: {error}"
            os.write(writing, answer.encode())
            code = 0
        finally:
            os._exit(code)
    os.close(writing)
    with os.fdopen(reading, "rb") as pipe:
        answer = pipe.read().decode()
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"the child exited {os.waitstatus_to_exitcode(status)}: {answer}"
    assert answer == "StateError: ExtensibleKVCache.commit() is not allowed on an inherited cache", answer
    assert cache.num_committed_blocks == 200
    for i, pattern in enumerate(patterns):
        check_all_equal(cache.buffer.segment_view(i), pattern, f"the parent's segment {i}")


def fragment(cache) -> int:
    """Commit so that segments span two chunks; return the block count."""
    alignment = granule_block_alignment(cache.segment_strides, cache.buffer.granularity)
    n = min(alignment + 1, CAPACITY)
    cache.commit(1)
    cache.commit(n)
    one_chunk = readback_one_chunk_per_segment(cache.buffer, [n * s for s in cache.segment_strides])
    assert not all(one_chunk), f"commit(1) then commit({n}) left every segment on one chunk: {one_chunk}"
    return n


@pytest.mark.invariant(3, 5)
def test_defragment_discarding_leaves_one_chunk_per_segment(cache, usage):
    baseline = usage.read_outside_torch()
    n = fragment(cache)
    sizes = [n * s for s in cache.segment_strides]
    cache.commit(n, defragment=True)
    assert readback_one_chunk_per_segment(cache.buffer, sizes) == [True] * len(sizes)
    assert cache.buffer.segments_backed_by_one_chunk(sizes) == [True] * len(sizes)
    assert cache.num_committed_blocks == n
    check_readback_matches_bookkeeping(cache.buffer)
    check_usage_matches(usage, baseline, [cache.buffer])


@pytest.mark.invariant(1, 3, 5)
def test_defragment_preserving_keeps_every_byte(cache, usage):
    baseline = usage.read_outside_torch()
    n = fragment(cache)
    sizes = [n * s for s in cache.segment_strides]
    patterns = fill_segments(cache, seed=5)
    pointers = [cache.buffer.segment_view(i).data_ptr() for i in range(len(sizes))]
    cache.commit(n, defragment=True, preserve_contents=True)
    assert readback_one_chunk_per_segment(cache.buffer, sizes) == [True] * len(sizes)
    for i, pattern in enumerate(patterns):
        view = cache.buffer.segment_view(i)
        assert view.data_ptr() == pointers[i], f"segment {i} moved from {pointers[i]:#x} to {view.data_ptr():#x}"
        check_all_equal(view, pattern, f"segment {i} after the preserving defragment")
    check_readback_matches_bookkeeping(cache.buffer)
    check_usage_matches(usage, baseline, [cache.buffer])
    # Growing and defragmenting in one call keeps the old blocks and zeroes the new.
    cache.commit(min(2 * n, CAPACITY), defragment=True, preserve_contents=True)
    for i, pattern in enumerate(patterns):
        view = cache.buffer.segment_view(i)
        check_all_equal(view[: pattern.numel()], pattern, f"segment {i}'s kept blocks")
        check_all_equal(view[pattern.numel() :], 0, f"segment {i}'s new blocks")
    check_usage_matches(usage, baseline, [cache.buffer])


@pytest.mark.invariant(1, 4, 5)
def test_release_and_recommit_zero_at_same_addresses(cache, usage):
    baseline = usage.read_outside_torch()
    cache.commit(200)
    fill_segments(cache, seed=2)
    pointers = [cache.buffer.segment_view(i).data_ptr() for i in range(len(cache.segment_strides))]
    cache.release_physical()
    assert cache.physical_bytes == 0
    check_usage_matches(usage, baseline, [cache.buffer])
    cache.recommit()
    assert cache.num_committed_blocks == 200 and cache.physical_bytes == cache.physical_bytes_for(200)
    for i, pointer in enumerate(pointers):
        view = cache.buffer.segment_view(i)
        assert view.data_ptr() == pointer, f"segment {i} moved from {pointer:#x} to {view.data_ptr():#x}"
        check_all_equal(view, 0, f"segment {i} recommitted")
    check_usage_matches(usage, baseline, [cache.buffer])


@pytest.mark.invariant(1)
@pytest.mark.parametrize("committed_blocks", [123, "capacity"])
def test_committed_views_and_tensors_agree_with_the_reservation(case, cache, committed_blocks):
    """Per-layer views and placements describe the same bytes, the first and
    the last committed block of every layer within its segment's committed
    storage, also with every block committed (where a placement that
    counted from the capacity, or a layer's region past its segment, would
    reach the next layer's memory or past the reservation)."""
    _, layout, config = case
    n = cache.capacity_blocks if committed_blocks == "capacity" else committed_blocks
    cache.commit(n)
    committed = KVCacheConfig(num_blocks=n, kv_cache_tensors=config.kv_cache_tensors, kv_cache_groups=config.kv_cache_groups)
    views = cache.committed_views(committed, layout)
    if not layout.is_block_compact:
        assert views is None
        return
    placements = cache.committed_kv_cache_tensors(committed, layout, n)
    sizes = [p.size for p in placements]
    assert all(size == n * cache.bytes_per_block for size in sizes), f"placement sizes {sizes}, expected {n * cache.bytes_per_block}"
    where = {name: (p, i) for p in placements for i, name in enumerate(p.layers)}
    assert set(where) == set(views)
    full = cache.buffer.full_view()
    for name, view in views.items():
        placement, index = where[name]
        storage = view.untyped_storage()
        storage_start = storage.data_ptr() - cache.buffer.base
        assert storage_start in cache.segment_offsets
        segment = cache.segment_offsets.index(storage_start)
        assert storage.nbytes() == n * cache.segment_strides[segment]  # exactly the committed blocks
        for block in (0, n - 1):
            # Write one block through the view; find it where the placement says.
            page = view[block].view(torch.uint8)
            start = placement.offset + index * placement.layer_stride + block * placement.block_stride
            assert 0 <= start and start + page.numel() <= storage.nbytes(), (
                f"layer {name}'s block {block} placed at bytes {start}-{start + page.numel()} of a storage of "
                f"{storage.nbytes()} committed bytes"
            )
            page.fill_(0xC3)
            start += storage_start
            check_all_equal(full[start : start + page.numel()], 0xC3, f"layer {name}'s block {block} where its placement says")
            written = sum(int(cache.buffer.segment_view(i).count_nonzero()) for i in range(len(cache.segment_strides)))
            assert written == page.numel(), f"layer {name}'s block {block}: {written} bytes written, {page.numel()} expected"
            page.zero_()


@pytest.mark.invariant(6)
def test_committed_views_refuse_a_stale_block_count(case, cache):
    """Block-compact layouts refuse a count other than the committed one;
    the others have no per-segment views at all and answer None, stale count
    or not."""
    _, layout, config = case
    cache.commit(10)
    current, stale = (
        KVCacheConfig(num_blocks=n, kv_cache_tensors=config.kv_cache_tensors, kv_cache_groups=config.kv_cache_groups)
        for n in (10, 11)
    )
    before = snapshot(cache)
    if layout.is_block_compact:
        with pytest.raises(ValueError, match="11.*10 blocks are committed"):
            cache.committed_views(stale, layout)
        views = cache.committed_views(current, layout)
        assert views is not None and len(views) == sum(len(t.layers) for t in config.kv_cache_tensors)
    else:
        assert cache.committed_views(stale, layout) is None
        assert cache.committed_views(current, layout) is None
    check_unchanged(cache, before)


@pytest.mark.invariant(5)
@given(num_bytes=st.integers(-(1 << 20), 80 << 20))
def test_blocks_within_is_the_largest_fit(num_bytes):
    config = config_for("mixed", KVCacheLayout.LBHNC)
    kv_cache = ExtensibleKVCache(config, "cpu", KVCacheLayout.LBHNC)
    try:
        k = kv_cache.blocks_within(num_bytes)
        assert 0 <= k <= CAPACITY
        if k > 0:
            assert kv_cache.physical_bytes_for(k) <= num_bytes
        if k < CAPACITY:
            assert kv_cache.physical_bytes_for(k + 1) > num_bytes
    finally:
        kv_cache.free()


@pytest.mark.invariant(5)
@given(a=st.integers(0, CAPACITY), b=st.integers(0, CAPACITY))
def test_physical_bytes_for_is_monotone_and_granular(a, b):
    kv_cache = ExtensibleKVCache(config_for("full", KVCacheLayout.LBNHC), "cpu", KVCacheLayout.LBNHC)
    try:
        low, high = sorted((a, b))
        assert kv_cache.physical_bytes_for(low) <= kv_cache.physical_bytes_for(high)
        assert kv_cache.physical_bytes_for(high) % kv_cache.buffer.granularity == 0
        assert kv_cache.physical_bytes_for(high) >= high * kv_cache.bytes_per_block
    finally:
        kv_cache.free()


@pytest.mark.invariant(6)
def test_invalid_configs_raise_value_errors_naming_the_problem(device):
    good = config_for("full", KVCacheLayout.LBHNC)
    bad = [
        (KVCacheConfig(num_blocks=10, kv_cache_tensors=[], kv_cache_groups=good.kv_cache_groups), "no kv_cache_tensors"),
        (KVCacheConfig(num_blocks=0, kv_cache_tensors=good.kv_cache_tensors, kv_cache_groups=good.kv_cache_groups), "num_blocks"),
        (
            KVCacheConfig(
                num_blocks=CAPACITY,
                kv_cache_tensors=[KVCacheTensor(size=100, layers=["x"], layer_stride=0, block_stride=7)],
                kv_cache_groups=good.kv_cache_groups,
            ),
            "not a whole number",
        ),
        (
            KVCacheConfig(
                num_blocks=CAPACITY,
                kv_cache_tensors=[
                    KVCacheTensor(size=CAPACITY * 8192 * 2, layers=["a"], layer_stride=0, block_stride=8192),
                    KVCacheTensor(size=CAPACITY * 8192 * 2, layers=["b"], layer_stride=0, block_stride=4096),
                ],
                kv_cache_groups=good.kv_cache_groups,
            ),
            "block strides",
        ),
    ]
    from extkv.vmm import live_reservations

    before = {k: v for k, v in live_reservations.items() if v}
    for config, message in bad:
        with pytest.raises(ValueError, match=message):
            ExtensibleKVCache(config, device, KVCacheLayout.BLHNC if "whole" in message else KVCacheLayout.LBHNC)
    assert {k: v for k, v in live_reservations.items() if v} == before


@pytest.mark.invariant(6)
def test_invalid_calls_raise_and_change_nothing(cache):
    cache.commit(20)
    fill_segments(cache, seed=12)
    before = snapshot(cache)
    for call, message in [
        (lambda: cache.commit(-1), r"num_blocks must be an int >= 0 \(a block count\), got -1"),
        (lambda: cache.commit(2.5), r"num_blocks must be an int >= 0 \(a block count\), got 2.5"),
        (lambda: cache.commit(30, preserve_contents=True), "only applies with shrink=True or defragment=True"),
        (lambda: cache.commit(30, shrink="yes"), r"shrink must be a bool \(True or False\), got 'yes'"),
        (lambda: cache.physical_bytes_for(-3), "num_blocks must be an int >= 0"),
        (lambda: cache.blocks_within(1.5), "num_bytes must be an int"),
        (lambda: cache.set_torch_memory_limit(-5), "torch memory limit must be an int >= 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            call()
        check_unchanged(cache, before)


@pytest.mark.invariant(6)
def test_a_commit_never_shrinks_a_buffer_grown_behind_the_caches_back(cache):
    """A plain commit skips the buffer's argument checks (its sizes are
    valid by construction), not the buffer's grow-only rule."""
    cache.commit(2)
    cache.buffer.resize_segments_([4 * stride for stride in cache.segment_strides])
    fill_segments(cache, seed=5)
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"sizes\[0\] = \d+ would shrink segment 0"):
        cache.commit(3)
    check_unchanged(cache, before)


def _cuda_fractions() -> list[float] | None:
    """torch's per-process memory fraction of every GPU, where CUDA is up."""
    if not torch.cuda.is_initialized():
        return None
    return [torch.cuda.get_per_process_memory_fraction(i) for i in range(torch.cuda.device_count())]


@pytest.mark.invariant(5)
def test_torch_memory_limit_is_set_and_lifted(cache, device):
    """On CUDA the cap is torch's own: its per-process fraction says so, and
    an allocation past it fails until the cap is lifted. On the host torch
    has no cap: the limit is recorded, and nothing else changes."""
    limit = 1 << 30
    if device.type != "cuda":
        before, fractions = snapshot(cache.buffer), _cuda_fractions()
        cache.set_torch_memory_limit(limit)
        assert cache.torch_memory_limit == limit
        check_unchanged(cache.buffer, before)
        assert _cuda_fractions() == fractions, f"GPU memory fractions {fractions} -> {_cuda_fractions()}"
        cache.set_torch_memory_limit(None)
        assert cache.torch_memory_limit is None
        check_unchanged(cache.buffer, before)
        return
    torch.cuda.empty_cache()
    _, total = torch.cuda.mem_get_info(device)
    past_the_cap = limit + (256 << 20)
    cache.set_torch_memory_limit(limit)
    assert cache.torch_memory_limit == limit
    capped = torch.cuda.get_per_process_memory_fraction(device) * total
    assert abs(capped - limit) < 1 << 20, f"torch caps at {capped:.0f} bytes, the limit is {limit}"
    with pytest.raises(torch.cuda.OutOfMemoryError):
        torch.empty(past_the_cap, dtype=torch.uint8, device=device)
    cache.set_torch_memory_limit(None)
    assert cache.torch_memory_limit is None
    fraction = torch.cuda.get_per_process_memory_fraction(device)
    assert fraction == 1.0, f"torch's memory fraction is {fraction} after lifting the cap"
    allocated = torch.empty(past_the_cap, dtype=torch.uint8, device=device)  # fits once lifted
    assert allocated.numel() == past_the_cap
    del allocated
    torch.cuda.empty_cache()


@pytest.mark.invariant(4, 5)
def test_recommit_that_fails_half_way_is_completed_by_calling_it_again(build, device, usage):
    baseline = usage.read_outside_torch()
    faulty = FaultInjectingDriver(driver_for(device))
    kv_cache = build.cache_for("full", KVCacheLayout.LBHNC, device=faulty)
    kv_cache.commit(100)  # three runs of granules: granule 0, 2-3 and 5
    kv_cache.release_physical()
    faulty.fail_in("map", 2)
    with pytest.raises(DriverError, match="injected fault"):
        kv_cache.recommit()
    assert 0 < kv_cache.physical_bytes < kv_cache.physical_bytes_for(100)
    assert kv_cache.num_committed_blocks == 100
    kv_cache.recommit()
    assert kv_cache.buffer.segment_sizes == [100 * s for s in kv_cache.segment_strides]
    assert kv_cache.physical_bytes == kv_cache.physical_bytes_for(100)
    check_readback_matches_bookkeeping(kv_cache.buffer)
    check_usage_matches(usage, baseline, [kv_cache.buffer])


@pytest.mark.invariant(5)
def test_a_commit_whose_undo_fails_leaves_a_cache_that_only_frees_and_frees_everything(build, device, usage):
    """A run's access grant fails, and so does the unmap that would undo it:
    the run stays mapped where nothing records it. Every call but free is
    then refused before it changes anything, and free leaves nothing
    behind."""
    baseline = usage.read_outside_torch()
    faulty = FaultInjectingDriver(driver_for(device))
    kv_cache = build.cache_for("full", KVCacheLayout.LBHNC, device=faulty)
    kv_cache.commit(100)
    kv_cache.set_torch_memory_limit(1 << 40)  # as sizing does after warm-up; free lifts it
    faulty.fail_in("set_access", 1)
    faulty.fail_in("unmap", 1)
    with pytest.raises(DriverError, match="injected fault") as raised:
        kv_cache.commit(700)
    assert any("is now broken" in note for note in raised.value.__notes__), raised.value.__notes__
    assert kv_cache.is_broken
    count = kv_cache.num_committed_blocks
    for operation in (lambda: kv_cache.commit(700), kv_cache.release_physical, lambda: kv_cache.commit(50, shrink=True),
                      kv_cache.recommit, kv_cache.committed_views):
        with pytest.raises(StateError, match=r"is not allowed on a broken cache"):
            operation()
    assert kv_cache.num_committed_blocks == count == 100, "a refused call changed the count"
    kv_cache.free()
    assert kv_cache.is_freed and kv_cache.torch_memory_limit is None
    check_usage_matches(usage, baseline, [])


@pytest.mark.invariant(3, 5)
@pytest.mark.parametrize("follow_up", ["a plain commit", "the same call"])
@pytest.mark.parametrize("options", [{"shrink": True}, {"defragment": True}])
def test_a_discarding_commit_whose_release_fails_leaves_a_count_the_next_commit_meets(
    build, device, usage, options, follow_up
):
    """Shrinking and discarding defragments release first; a release that
    fails part way leaves nothing committed, so the next commit maps all it
    needs rather than trusting the count from before, and the same call
    again completes what failed."""
    baseline = usage.read_outside_torch()
    faulty = FaultInjectingDriver(driver_for(device))
    kv_cache = build.cache_for("full", KVCacheLayout.LBHNC, device=faulty)
    kv_cache.commit(100)
    kv_cache.commit(700)  # two chunks per segment: fragmented, and a release can fail between them
    target = 300 if options.get("shrink") else 700
    faulty.fail_in("release", 2)
    with pytest.raises(DriverError, match="injected fault"):
        kv_cache.commit(target, **options)
    assert kv_cache.num_committed_blocks == 0 and kv_cache.buffer.segment_sizes == [0] * len(kv_cache.segment_strides)
    if follow_up == "a plain commit":
        kv_cache.commit(300)
        assert kv_cache.buffer.segment_sizes == [300 * s for s in kv_cache.segment_strides]
        kv_cache.release_physical()  # gives back what the failure left mapped, too
    else:
        kv_cache.commit(target, **options)
        assert kv_cache.num_committed_blocks == target
        assert kv_cache.physical_bytes == kv_cache.physical_bytes_for(target)
        if options.get("defragment"):
            sizes = [target * s for s in kv_cache.segment_strides]
            assert all(readback_one_chunk_per_segment(kv_cache.buffer, sizes)), "segments on several chunks, read back"
    check_readback_matches_bookkeeping(kv_cache.buffer)
    check_usage_matches(usage, baseline, [kv_cache.buffer])


@pytest.mark.invariant(1)
def test_a_shrink_at_or_above_the_count_after_a_failed_growth_keeps_the_blocks(build, device):
    """A growth that fails part way leaves runs mapped past the committed
    blocks; a later commit with shrink=True that does not go below the count
    is a growth, and keeps them."""
    faulty = FaultInjectingDriver(driver_for(device))
    kv_cache = build.cache_for("full", KVCacheLayout.LBHNC, device=faulty)
    kv_cache.commit(150)
    written = fill_segments(kv_cache, seed=9)
    faulty.fail_in("create", 2)
    with pytest.raises(DriverError, match="injected fault"):
        kv_cache.commit(700)
    assert kv_cache.physical_bytes > kv_cache.physical_bytes_for(150), "the failed growth left nothing mapped"
    kv_cache.commit(273, shrink=True)
    assert kv_cache.num_committed_blocks == 273
    check_readback_matches_bookkeeping(kv_cache.buffer)
    kept = [torch.equal(kv_cache.buffer.segment_view(i)[: w.numel()], w) for i, w in enumerate(written)]
    assert all(kept), f"segments whose 150 committed blocks the growth lost: {[i for i, k in enumerate(kept) if not k]}"


@pytest.mark.invariant(5)
def test_torch_cap_grows_by_what_a_shrinking_extend_frees(build, device):
    """The reference subtracts the signed growth: when the measured budget is
    below what warmup committed, the shrink frees memory that torch may use,
    so the cap sits that much above free memory less the non-torch reserve.
    The chunks are real; the free memory sizing reads is the test's
    (`InjectedReadingsDriver`), so the cap is exact whatever else runs."""
    layout = KVCacheLayout.LBHNC
    real = driver_for(device)
    _, total = real.memory_info()
    free = total // 4
    kv_cache = build.cache_for("padded", layout, 20_000, device=InjectedReadingsDriver(real, free=free, total=total))
    kv_cache.commit(kv_cache.blocks_within(512 << 20))
    committed = kv_cache.physical_bytes
    assert committed >= 500 << 20
    # Nothing is requested and 1 GiB went elsewhere since init: the budget
    # is zero blocks, so the extend would free all that is committed.
    num_blocks = measure_kv_cache_blocks(kv_cache, device, init_free_memory=free + committed + (1 << 30), requested_memory=0)
    assert num_blocks == 0
    reserved = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
    unsigned_cap = reserved + free - KV_CACHE_NON_TORCH_RESERVE_BYTES
    assert kv_cache.torch_memory_limit == unsigned_cap + committed
