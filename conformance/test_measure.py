"""Sizing with live caches against memory readings the test chooses.

`test_sizing.py` checks the pure arithmetic; here a real cache with a
committed prefix is sized through `committable_blocks`,
`measure_kv_cache_blocks` and the weight-update context, with the driver's
memory readings injected (`InjectedReadingsDriver`: every chunk is real, only
`memory_info()` answers what the test set), so every expected number is
computed by hand in the table beside it.

The geometry makes hand computation easy: two layers of 64 KiB pages, each
layer region on its own granules (LBHNC, padded), so n blocks map
``2 * ceil(n / 32)`` granules of 2 MiB: 32 blocks are 4 MiB, and a budget of
B bytes (a multiple of 4 MiB) holds ``B / 4 MiB * 32`` blocks. Torch has no
caching allocator on the host, so it reserves 0 bytes there.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from extkv import (
    ExtensibleKVCache,
    FullAttentionSpec,
    KVCacheGroupSpec,
    KVCacheLayout,
    WeightUpdateMemoryError,
    build_kv_cache_config,
    kv_cache_lent_for_weight_update,
    measure_kv_cache_blocks,
    pad_kv_cache_segments,
)
from extkv.testing.readings import InjectedReadingsDriver
from extkv.vmm import driver_for

pytestmark = pytest.mark.invariant(5)

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
TOTAL = 141 * GiB
LAYOUT = KVCacheLayout.LBHNC
PAGE = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)  # 64 KiB


@pytest.fixture
def sized_cache():
    """A host cache of `capacity` blocks over injected readings, freed after."""
    made = []

    def make(capacity: int, committed: int, *, free: int, headroom: int = 0) -> tuple[ExtensibleKVCache, InjectedReadingsDriver]:
        driver = InjectedReadingsDriver(driver_for("cpu"), free=free, total=TOTAL)
        groups = [KVCacheGroupSpec(layer_names=["l0", "l1"], kv_cache_spec=PAGE)]
        config = pad_kv_cache_segments(build_kv_cache_config(groups, capacity, LAYOUT), LAYOUT, driver.granularity)
        kv_cache = ExtensibleKVCache(config, driver, LAYOUT)
        made.append(kv_cache)
        assert kv_cache.segment_strides == [64 * KiB, 64 * KiB], "the hand computations assume two 64 KiB segments"
        kv_cache.commit(committed)
        kv_cache.reserved_headroom_bytes = headroom
        return kv_cache, driver

    yield make
    for kv_cache in made:
        kv_cache.free()


# (free, committed blocks, reserved headroom) -> blocks committable now.
COMMITTABLE = [
    # headroom 20 GiB + 8 MiB; reserve max(4 GiB, 10%) = 4 GiB; margin
    # max(1 GiB, 3 GiB) = 3 GiB; budget 13 GiB + 8 MiB = 3,330 x 4 MiB.
    ((20 * GiB, 64, 4 * GiB), 3_330 * 32),
    # Budget below what is committed: never below the committed count.
    ((1 * GiB, 64, 0), 64),
    # headroom 30 GiB; reserve 3 GiB; margin 2.25 GiB; 24.75 GiB = 6,336 x
    # 4 MiB = 202,752 blocks, past the 200,000 of capacity.
    ((30 * GiB, 0, 0), 200_000),
]


@pytest.mark.parametrize("readings, expected", COMMITTABLE, ids=["prefix-and-peak", "below-committed", "capacity"])
def test_committable_blocks_with_a_committed_prefix(sized_cache, readings, expected):
    free, committed, headroom = readings
    kv_cache, _ = sized_cache(200_000, committed, free=free, headroom=headroom)
    assert kv_cache.physical_bytes == -(-committed // 32) * 4 * MiB
    assert kv_cache.committable_blocks() == expected


# (init free, free, requested, committed blocks, peak, IPC reserve) ->
# (blocks, torch cap). Torch reserves nothing on the host, so the cap is
# what stays free after the extend less the 256 MiB non-torch reserve.
MEASURED = [
    # engine took 60 GiB - 8 MiB; request limit 30 GiB + 8 MiB; device limit
    # 40 GiB + 8 MiB - 3 GiB; less the 4 GiB peak: 26 GiB + 8 MiB = 6,658 x
    # 4 MiB. Growth 26 GiB; cap 40 - 26 GiB - 256 MiB.
    ((100 * GiB, 40 * GiB, 90 * GiB, 64, 4 * GiB, 0), (6_658 * 32, 14 * GiB - 256 * MiB)),
    # The same with 1 GiB for IPC: 25 GiB + 8 MiB for blocks, growth 25 GiB,
    # cap 40 - 25 - 1 GiB - 256 MiB.
    ((100 * GiB, 40 * GiB, 90 * GiB, 64, 4 * GiB, GiB), (6_402 * 32, 14 * GiB - 256 * MiB)),
    # A request 8 MiB short of what the engine and the 16 MiB prefix hold:
    # the budget is 8 MiB (64 blocks), the extend frees 8 MiB, and the cap
    # grows by it (signed growth): 40 GiB + 8 MiB - 256 MiB.
    ((100 * GiB, 40 * GiB, 60 * GiB - 8 * MiB, 128, 0, 0), (64, 40 * GiB + 8 * MiB - 256 * MiB)),
    # Nothing free beyond the margin: no blocks; torch may grow into what is
    # free less the non-torch reserve.
    ((100 * GiB, 512 * MiB, 100 * GiB, 0, 0, 0), (0, 256 * MiB)),
]


@pytest.mark.parametrize(
    "readings, expected", MEASURED, ids=["request-binds", "ipc-reserve", "shrinking-extend", "device-binds"]
)
def test_measure_kv_cache_blocks_against_hand_computed_values(sized_cache, readings, expected):
    init_free, free, requested, committed, peak, ipc = readings
    kv_cache, _ = sized_cache(300_000, committed, free=free, headroom=peak)
    num_blocks = measure_kv_cache_blocks(
        kv_cache, "cpu", init_free_memory=init_free, requested_memory=requested, ipc_reserve_bytes=ipc
    )
    assert (num_blocks, kv_cache.torch_memory_limit) == expected
    assert kv_cache.num_committed_blocks == committed, "measuring must not commit"


class OneLayer(nn.Module):
    """A model whose largest layer is exactly `layer_bytes` of parameters."""

    def __init__(self, layer_bytes: int):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(layer_bytes // 4, 1, bias=False), nn.Linear(16, 1, bias=False)])


LAYER = 16 * MiB


@pytest.mark.parametrize(
    "free, reclaimable, fail_if_short, outcome",
    [
        (2 * LAYER, False, True, "kept"),  # exactly the peak (two copies of a layer) fits
        (3 * LAYER // 2, True, True, "lent"),  # between 1x and 2x: short, and the cache may be lent
        (3 * LAYER // 2, False, True, "kept, warned"),  # short, not reclaimable: one layer fits, so warn
        (LAYER // 2, False, True, "refused"),  # not even one layer fits
        (LAYER // 2, False, False, "kept, warned"),
    ],
)
def test_weight_update_decides_by_the_peak_and_restores_the_cap(sized_cache, caplog, free, reclaimable, fail_if_short, outcome):
    kv_cache, driver = sized_cache(1_000, 100, free=free)
    kv_cache.set_torch_memory_limit(5 * GiB)
    model = OneLayer(LAYER)
    committed = kv_cache.physical_bytes
    inside = []
    caplog.set_level(logging.WARNING, logger="extkv.runner")
    if outcome == "refused":
        with pytest.raises(WeightUpdateMemoryError, match="needs about 0.03 GiB"):
            with kv_cache_lent_for_weight_update(kv_cache, model, reclaimable=reclaimable, fail_if_short=fail_if_short):
                inside.append("entered")
        assert inside == [], "a refused update must fail before its body runs"
    else:
        with kv_cache_lent_for_weight_update(kv_cache, model, reclaimable=reclaimable, fail_if_short=fail_if_short):
            inside.append((kv_cache.physical_bytes, kv_cache.torch_memory_limit))
        lent = outcome == "lent"
        assert inside == [(0 if lent else committed, None)], f"inside the context: {inside}, expected {outcome}"
        warned = any("layer by layer" in record.getMessage() for record in caplog.records)
        assert warned == outcome.endswith("warned"), f"warning logged: {warned}, expected for {outcome!r}"
    assert kv_cache.torch_memory_limit == 5 * GiB, "the cap must come back on every path"
    assert kv_cache.physical_bytes == committed and kv_cache.num_committed_blocks == 100


def test_weight_update_restores_the_cap_when_its_body_fails(sized_cache):
    kv_cache, _ = sized_cache(1_000, 100, free=3 * LAYER // 2)
    kv_cache.set_torch_memory_limit(5 * GiB)
    with pytest.raises(KeyError, match="missing weight"):
        with kv_cache_lent_for_weight_update(kv_cache, OneLayer(LAYER), reclaimable=True, fail_if_short=True):
            raise KeyError("missing weight")
    assert kv_cache.torch_memory_limit == 5 * GiB
    assert kv_cache.physical_bytes == kv_cache.physical_bytes_for(100), "a lent cache is recommitted on the way out"
