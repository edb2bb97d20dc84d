"""The KV cache memory arithmetic, on made-up numbers: pure, no device."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extkv import sizing
from extkv.sizing import (
    KV_CACHE_MARGIN_FLOOR_BYTES,
    KV_CACHE_MARGIN_FRACTION,
    KV_CACHE_NON_TORCH_RESERVE_BYTES,
    KV_CACHE_WARMUP_RESERVE_FRACTION,
    WEIGHT_UPDATE_PEAK_LAYER_FACTOR,
    blocks_within,
    committable_bytes,
    measure_kv_cache_bytes,
    segment_physical_bytes,
    torch_memory_limit_bytes,
    weight_update_peak_bytes,
)

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


@pytest.mark.invariant(5)
def test_constants():
    assert KV_CACHE_MARGIN_FLOOR_BYTES == GiB
    assert KV_CACHE_MARGIN_FRACTION == 0.75
    assert KV_CACHE_WARMUP_RESERVE_FRACTION == 0.1
    assert KV_CACHE_NON_TORCH_RESERVE_BYTES == 256 * MiB
    assert WEIGHT_UPDATE_PEAK_LAYER_FACTOR == 2
    assert sizing.__doc__ is not None and "Worked example" in sizing.__doc__


# --------------------------------------------------------------------------
# measure_kv_cache_bytes
#
# used = init_free - free - committed; headroom = free + committed;
# margin = max(floor, int(peak * fraction));
# result = max(min(requested - used, headroom - margin) - peak, 0)

MEASURE_CASES = [
    # (init_free, free, committed, requested, peak, expected)
    # used 140-40-2=98, headroom 42, margin max(1, 3)=3:
    # min(126-98=28, 42-3=39)=28, -4 peak -> 24 GiB (the docstring example)
    (140 * GiB, 40 * GiB, 2 * GiB, 126 * GiB, 4 * GiB, 24 * GiB),
    # same, all memory requested: min(140-98=42, 39)=39, -4 -> 35 GiB
    (140 * GiB, 40 * GiB, 2 * GiB, 140 * GiB, 4 * GiB, 35 * GiB),
    # no peak: used 80-30=50, headroom 30, margin 1 (floor): min(72-50=22, 29)=22
    (80 * GiB, 30 * GiB, 0, 72 * GiB, 0, 22 * GiB),
    # peak under the floor: margin max(1, 0.75)=1; min(80-50=30, 29)=29, -1 -> 28
    (80 * GiB, 30 * GiB, 0, 80 * GiB, 1 * GiB, 28 * GiB),
    # engine already over budget: used 70, min(60-70=-10, 9) < 0 -> 0
    (80 * GiB, 10 * GiB, 0, 60 * GiB, 0, 0),
    # headroom below the margin: min(512 MiB, 512 MiB - 1 GiB) < 0 -> 0
    (80 * GiB, 512 * MiB, 0, 80 * GiB, 0, 0),
    # big committed prefix: used 100-10-50=40, headroom 60, margin max(1, 1.5)=1.5:
    # min(95-40=55, 60-1.5=58.5)=55, -2 -> 53 GiB
    (100 * GiB, 10 * GiB, 50 * GiB, 95 * GiB, 2 * GiB, 53 * GiB),
    # memory freed since init: used 40-50=-10, headroom 50, margin 1:
    # min(36+10=46, 49)=46 GiB
    (40 * GiB, 50 * GiB, 0, 36 * GiB, 0, 46 * GiB),
    # peak 3 GiB: used 50, margin int(2.25 GiB); headroom binds:
    # min(100-50=50, 50-2.25=47.75)=47.75, -3 peak
    (100 * GiB, 50 * GiB, 0, 100 * GiB, 3 * GiB, 50 * GiB - int(2.25 * GiB) - 3 * GiB),
]


@pytest.mark.invariant(5)
@pytest.mark.parametrize("init_free, free, committed, requested, peak, expected", MEASURE_CASES)
def test_measure_kv_cache_bytes_table(init_free, free, committed, requested, peak, expected):
    got = measure_kv_cache_bytes(
        init_free_memory=init_free,
        free_memory=free,
        committed_bytes=committed,
        requested_memory=requested,
        transient_peak_bytes=peak,
    )
    assert got == expected


@pytest.mark.invariant(5)
def test_measure_kv_cache_bytes_custom_margin():
    # floor 0, fraction 0: no margin; min(10-0, 10-0)=10, -1 peak -> 9 GiB
    common = dict(init_free_memory=10 * GiB, free_memory=10 * GiB, committed_bytes=0,
                  requested_memory=10 * GiB, transient_peak_bytes=GiB)
    assert measure_kv_cache_bytes(**common, margin_floor_bytes=0, margin_fraction=0) == 9 * GiB
    # peak 3 B, fraction 0.75 -> margin int(2.25) = 2 B: min(100, 100-2)=98, -3 -> 95
    assert measure_kv_cache_bytes(
        init_free_memory=100, free_memory=100, committed_bytes=0, requested_memory=100,
        transient_peak_bytes=3, margin_floor_bytes=0,
    ) == 95
    # fraction 2: margin = 2 GiB: min(10, 10-2)=8, -1 -> 7 GiB
    assert measure_kv_cache_bytes(**common, margin_fraction=2) == 7 * GiB


@pytest.mark.invariant(6)
def test_measure_kv_cache_bytes_keywords_only():
    with pytest.raises(TypeError):
        measure_kv_cache_bytes(1, 1, 0, 1)  # type: ignore[misc]


memory = st.integers(0, 200 * GiB)


@pytest.mark.invariant(5)
@settings(max_examples=300, deadline=None)
@given(init_free=memory, free=memory, committed=memory, requested=memory, peak=st.integers(0, 20 * GiB))
def test_measure_kv_cache_bytes_properties(init_free, free, committed, requested, peak):
    args = dict(init_free_memory=init_free, free_memory=free, committed_bytes=committed,
                requested_memory=requested, transient_peak_bytes=peak)
    got = measure_kv_cache_bytes(**args)
    used = init_free - free - committed
    headroom = free + committed
    margin = max(GiB, int(peak * 0.75))
    assert got >= 0
    if got > 0:
        # What stays free after the cache holds `got` covers peak and margin...
        assert headroom - got >= peak + margin
        # ...and the engine plus the cache plus the peak stay within the request.
        assert used + got + peak <= requested
    # The margin never cuts a request that already leaves it free.
    if requested - used <= headroom - margin:
        assert got == max(requested - used - peak, 0)
    # More free memory, all else equal, never gives the cache less.
    more_free = dict(args, free_memory=free + GiB, init_free_memory=init_free + GiB)
    assert measure_kv_cache_bytes(**more_free) >= got
    # Asking for more never gives less.
    assert measure_kv_cache_bytes(**dict(args, requested_memory=requested + GiB)) >= got


@pytest.mark.invariant(6)
@pytest.mark.parametrize(
    "override, match",
    [
        (dict(init_free_memory=-1), "init_free_memory must be an int >= 0, got -1"),
        (dict(free_memory=-5), "free_memory must be an int >= 0, got -5"),
        (dict(committed_bytes=-1), "committed_bytes must be an int >= 0, got -1"),
        (dict(requested_memory=-1), "requested_memory must be an int >= 0, got -1"),
        (dict(transient_peak_bytes=-1), "transient_peak_bytes must be an int >= 0, got -1"),
        (dict(margin_floor_bytes=-1), "margin_floor_bytes must be an int >= 0, got -1"),
        (dict(margin_fraction=-0.5), "margin_fraction must be finite and >= 0, got -0.5"),
        (dict(margin_fraction=math.nan), "margin_fraction must be finite and >= 0, got nan"),
        (dict(margin_fraction=math.inf), "margin_fraction must be finite and >= 0, got inf"),
        (dict(margin_fraction="0.75"), "margin_fraction must be a real number, got '0.75'"),
        (dict(free_memory=1.5), "free_memory must be an int >= 0, got 1.5"),
        (dict(free_memory=None), "free_memory must be an int >= 0, got None"),
        (dict(committed_bytes=True), "committed_bytes must be an int >= 0, got True"),
    ],
)
def test_measure_kv_cache_bytes_invalid_input_raises(override, match):
    args = dict(init_free_memory=GiB, free_memory=GiB, committed_bytes=0, requested_memory=GiB)
    with pytest.raises(ValueError, match=match):
        measure_kv_cache_bytes(**{**args, **override})


# --------------------------------------------------------------------------
# committable_bytes
#
# headroom = free + physical; reserve = max(reserved, int(headroom * 0.1));
# margin = max(1 GiB, int(reserve * 0.75)); budget = headroom - margin - reserve

COMMITTABLE_CASES = [
    # (free, physical, reserved_headroom, expected)
    # headroom 42 GiB = 45097156608; reserve = int(4509715660.8) = 4509715660
    # (> 4 GiB); margin = int(3382286745.0) = 3382286745;
    # 45097156608 - 3382286745 - 4509715660 = 37205154203 (34.65 GiB)
    (40 * GiB, 2 * GiB, 4 * GiB, 37205154203),
    # headroom 10 GiB; reserve max(4, 1)=4; margin max(1, 3)=3; 10-3-4 = 3 GiB
    (10 * GiB, 0, 4 * GiB, 3 * GiB),
    # headroom 8 GiB = 8589934592; reserve int(858993459.2) = 858993459;
    # margin max(1 GiB, 644245094) = 1 GiB; 8589934592 - 1073741824 - 858993459
    (8 * GiB, 0, 0, 6657199309),
    # headroom 1 GiB; reserve 107374182; margin 1 GiB; negative -> 0
    (1 * GiB, 0, 0, 0),
    # all committed: headroom 20 GiB = 21474836480; reserve 2147483648;
    # margin 1610612736; 21474836480 - 1610612736 - 2147483648 = 17716740096
    (0, 20 * GiB, 0, 17716740096),
]


@pytest.mark.invariant(5)
@pytest.mark.parametrize("free, physical, reserved, expected", COMMITTABLE_CASES)
def test_committable_bytes_table(free, physical, reserved, expected):
    assert committable_bytes(free, physical, reserved) == expected


@pytest.mark.invariant(5)
def test_committable_bytes_custom_fractions():
    # reserve max(0, int(100 * 0.5)) = 50; margin max(0, int(50 * 0.5)) = 25; 100-25-50
    assert committable_bytes(100, 0, 0, warmup_reserve_fraction=0.5,
                             margin_floor_bytes=0, margin_fraction=0.5) == 25


@pytest.mark.invariant(5)
@settings(max_examples=300, deadline=None)
@given(free=memory, physical=memory, reserved=st.integers(0, 40 * GiB))
def test_committable_bytes_properties(free, physical, reserved):
    got = committable_bytes(free, physical, reserved)
    headroom = free + physical
    assert 0 <= got <= headroom
    if got > 0:
        # Warmup keeps at least the profiled peak and the 1 GiB floor free.
        assert headroom - got >= reserved + GiB
        assert headroom - got >= int(headroom * 0.1)
    # A larger profiled peak never lets warmup commit more.
    assert committable_bytes(free, physical, reserved + GiB) <= got
    # Memory already held by the cache counts as headroom, like free memory.
    assert committable_bytes(free + physical, 0, reserved) == got


@pytest.mark.invariant(6)
@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((-1, 0, 0), {}, "free_memory must be an int >= 0, got -1"),
        ((0, -1, 0), {}, "physical_bytes must be an int >= 0, got -1"),
        ((0, 0, -1), {}, "reserved_headroom_bytes must be an int >= 0, got -1"),
        ((0, 0, 0), dict(warmup_reserve_fraction=1.5), r"warmup_reserve_fraction must be in \[0, 1\], got 1.5"),
        ((0, 0, 0), dict(warmup_reserve_fraction=-0.1), r"warmup_reserve_fraction must be in \[0, 1\]"),
        ((0, 0, 0), dict(margin_floor_bytes=-1), "margin_floor_bytes must be an int >= 0, got -1"),
        ((0, 0, 0), dict(margin_fraction=-1), "margin_fraction must be finite and >= 0, got -1"),
        ((0.5, 0, 0), {}, "free_memory must be an int >= 0, got 0.5"),
    ],
)
def test_committable_bytes_invalid_input_raises(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        committable_bytes(*args, **kwargs)


# --------------------------------------------------------------------------
# Physical footprint of a commit, and blocks within a budget


@pytest.mark.invariant(5)
def test_segment_physical_bytes():
    g = 2 * MiB
    assert segment_physical_bytes(0, [64 * KiB, 96 * KiB], g) == 0
    # 3 * 64 KiB -> one granule; 3 * 96 KiB -> one granule
    assert segment_physical_bytes(3, [64 * KiB, 96 * KiB], g) == 4 * MiB
    assert segment_physical_bytes(32, [64 * KiB], g) == 2 * MiB  # exactly one granule
    assert segment_physical_bytes(33, [64 * KiB], g) == 4 * MiB  # one block over
    assert segment_physical_bytes(5, [4 * MiB] * 3, g) == 60 * MiB


@pytest.mark.invariant(5)
def test_blocks_within():
    strides, g = [64 * KiB, 96 * KiB], 2 * MiB
    # 4 MiB is one granule per segment: 96 KiB * n <= 2 MiB -> n <= 21
    assert blocks_within(4 * MiB, strides, g, 1000) == 21
    assert segment_physical_bytes(21, strides, g) == 4 * MiB
    assert segment_physical_bytes(22, strides, g) > 4 * MiB
    assert blocks_within(4 * MiB - 1, strides, g, 1000) == 0  # cannot map both granules
    assert blocks_within(10**15, strides, g, 1000) == 1000  # capped by capacity
    assert blocks_within(-5, strides, g, 1000) == 0
    assert blocks_within(0, strides, g, 1000) == 0


@pytest.mark.invariant(5)
@settings(max_examples=300, deadline=None)
@given(
    num_bytes=st.integers(-MiB, 64 * MiB),
    strides=st.lists(st.integers(1, 512 * KiB), min_size=1, max_size=4),
    granule=st.sampled_from([4 * KiB, 64 * KiB, 2 * MiB]),
    capacity=st.integers(0, 3000),
)
def test_blocks_within_matches_linear_search(num_bytes, strides, granule, capacity):
    got = blocks_within(num_bytes, strides, granule, capacity)
    # The straightforward answer: walk down from the byte bound.
    expected = max(min(num_bytes // sum(strides), capacity), 0)
    while expected > 0 and segment_physical_bytes(expected, strides, granule) > num_bytes:
        expected -= 1
    assert got == expected
    assert 0 <= got <= capacity
    if got < capacity:
        assert segment_physical_bytes(got + 1, strides, granule) > num_bytes


@pytest.mark.invariant(6)
@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: segment_physical_bytes(-1, [64], 2 * MiB), "num_blocks must be an int >= 0, got -1"),
        (lambda: segment_physical_bytes(1, [], 2 * MiB), "strides must hold at least one"),
        (lambda: segment_physical_bytes(1, [64, -2], 2 * MiB), r"strides\[1\] must be an int >= 1, got -2"),
        (lambda: segment_physical_bytes(1, [64], 0), "granule must be an int >= 1, got 0"),
        (lambda: segment_physical_bytes(1, [64.0], 2 * MiB), r"strides\[0\] must be an int >= 1, got 64.0"),
        (lambda: blocks_within(1.0, [64], 2 * MiB, 10), "num_bytes must be an int, got 1.0"),
        (lambda: blocks_within(10, [64], 2 * MiB, -1), "capacity_blocks must be an int >= 0, got -1"),
        (lambda: blocks_within(10, [64], "2M", 1), "granule must be an int >= 1, got '2M'"),
    ],
)
def test_footprint_invalid_input_raises(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --------------------------------------------------------------------------
# Torch's cap and the weight-update peak


@pytest.mark.invariant(5, 6)
def test_torch_memory_limit_bytes():
    # left free = 10 - 6 growth - 1 IPC - 0.25 non-torch = 2.75 GiB; cap 5 + 2.75
    assert torch_memory_limit_bytes(
        free_memory=10 * GiB, memory_reserved=5 * GiB, kv_growth_bytes=6 * GiB,
        ipc_reserve_bytes=GiB,
    ) == 5 * GiB + 10 * GiB - 6 * GiB - GiB - 256 * MiB
    # Growth eats everything free: torch keeps what it holds, no more.
    assert torch_memory_limit_bytes(
        free_memory=GiB, memory_reserved=5 * GiB, kv_growth_bytes=2 * GiB
    ) == 5 * GiB
    # The non-torch reserve is an argument.
    assert torch_memory_limit_bytes(
        free_memory=GiB, memory_reserved=0, kv_growth_bytes=0, non_torch_reserve_bytes=0
    ) == GiB
    # A shrinking extend frees memory torch may grow into (the reference
    # subtracts the signed growth).
    assert torch_memory_limit_bytes(
        free_memory=GiB, memory_reserved=0, kv_growth_bytes=-2 * GiB, non_torch_reserve_bytes=0
    ) == 3 * GiB
    with pytest.raises(ValueError, match="kv_growth_bytes must be an int, got 1.5"):
        torch_memory_limit_bytes(free_memory=0, memory_reserved=0, kv_growth_bytes=1.5)
    with pytest.raises(ValueError, match="memory_reserved must be an int >= 0, got None"):
        torch_memory_limit_bytes(free_memory=0, memory_reserved=None, kv_growth_bytes=0)


@pytest.mark.invariant(5, 6)
def test_weight_update_peak_bytes():
    assert weight_update_peak_bytes(3 * GiB) == 6 * GiB
    assert weight_update_peak_bytes(0) == 0
    with pytest.raises(ValueError, match="largest_layer_bytes must be an int >= 0, got -1"):
        weight_update_peak_bytes(-1)


@pytest.mark.invariant(5, 6)
def test_segment_physical_bytes_counts_shared_granules_once():
    g = 2 * MiB
    # Two segments of 1.5 granules end to end share granule 1.
    strides, offsets = [3 * MiB // 4], [0, 3 * MiB]
    assert segment_physical_bytes(4, strides * 2, g) == 8 * MiB  # each rounded alone
    assert segment_physical_bytes(4, strides * 2, g, offsets) == 6 * MiB  # granule 1 once
    assert segment_physical_bytes(1, strides * 2, g, offsets) == 4 * MiB  # granules 0 and 1, apart
    assert blocks_within(6 * MiB, strides * 2, g, 4, offsets) == 4
    assert blocks_within(6 * MiB, strides * 2, g, 4) == 2
    with pytest.raises(ValueError, match="ascending, one per stride"):
        segment_physical_bytes(1, strides * 2, g, [3 * MiB, 0])
