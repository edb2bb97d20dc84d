"""What an RDMA stack (UCX, NIXL, Mooncake) needs to register a KV cache's
segments, read back from the driver on each GPU.

Theory of operation
-------------------
A NIC registers GPU memory created GPUDirect RDMA capable: without the flag
the registration of a VMM mapping fails. So on a GPU that supports the flag
with VMM (CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED; the
`gpudirect_rdma` marker skips elsewhere, naming the attribute), every chunk
behind every committed segment reads CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE
= 1 after growth, after a preserving defragment and after release and
recommit: each granule of each segment is asked (`Driver.rdma_capable_at`),
so every chunk is.

One registration per segment needs one allocation behind the segment's
range, which is what a defragment gives (invariant 3). On a GPU that exports
dma-bufs (`dma_buf` marker), a defragmented segment reads back as one
allocation spanning exactly its committed bytes (`Driver.allocation_range_at`,
cuMemGetAddressRange: the one chunk's mapping, which UCX sizes a
registration by), one chunk at every granule, and exports as one dma-buf of
exactly those bytes (`Driver.export_dma_buf`; its size is what
`lseek(fd, 0, SEEK_END)` reports, the way dma-buf tells its size). Before
the defragment the same read-back finds the first of the segment's three
chunks only, so the check tells one allocation from several.

The cache's layer regions are padded to start on granules and every commit
is of a block count at which each segment ends on a granule, so a segment's
committed bytes are whole granules of its own: exactly what its chunk spans.
Segments keep unmapped room past their committed blocks, so no run of a
commit or recommit spans two segments.

The host driver's memory is no GPU's: there the read-backs say that the
question does not apply, and an export of a dma-buf is refused, after bad
input is refused the same way as on a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

from extkv import ExtensibleKVCache, FaultInjectingDriver, driver_for
from extkv.layout import KVCacheLayout, granule_block_alignment, kv_cache_segments, pad_kv_cache_segments
from extkv.testing.checks import check_unchanged, granule_probes, readback_one_chunk_per_segment, snapshot
from extkv.testing.configs import config_for, fill_segments

DEVICE = torch.device("cuda:0")
LAYOUT = KVCacheLayout.LBHNC
#: Commits grow each segment by one granule-aligned step at a time, to this many steps.
STEPS = 3


def rdma_cache(build) -> tuple[ExtensibleKVCache, int]:
    """A cache on DEVICE whose segments start on granules, with room for
    STEPS + 1 steps, and its step: the fewest blocks at which every segment
    ends on a granule."""
    granule = driver_for(DEVICE).granularity
    _, strides = kv_cache_segments(config_for("full", LAYOUT, 1), LAYOUT)
    step = granule_block_alignment(strides, granule)
    config = pad_kv_cache_segments(config_for("full", LAYOUT, (STEPS + 1) * step), LAYOUT, granule)
    return build.cache(config, LAYOUT, device=DEVICE), step


def grow_in_steps(cache: ExtensibleKVCache, step: int) -> list[int]:
    """Commit one step at a time, each segment gaining one chunk per commit;
    return each segment's committed bytes."""
    for steps in range(1, STEPS + 1):
        cache.commit(steps * step)
    sizes = [STEPS * step * stride for stride in cache.segment_strides]
    assert readback_one_chunk_per_segment(cache.buffer, sizes) == [False] * len(sizes), "growth left no segment fragmented"
    return sizes


def segment_starts(cache: ExtensibleKVCache) -> list[int]:
    return [cache.buffer.base + offset for offset in cache.segment_offsets]


def check_rdma_capable(cache: ExtensibleKVCache, when: str) -> None:
    """Every granule of every committed segment reads back GPUDirect RDMA
    capable from the driver, so every chunk behind them does."""
    driver, granule, committed = cache.buffer.driver, cache.buffer.granularity, cache.num_committed_blocks
    probes = [
        (segment, address)
        for segment, (start, stride) in enumerate(zip(segment_starts(cache), cache.segment_strides))
        for address in granule_probes(start, start + committed * stride, granule)
    ]
    assert probes, f"{when}: no committed byte to ask about"
    answers = [driver.rdma_capable_at(address) for _, address in probes]
    wrong = [(segment, address, answer) for (segment, address), answer in zip(probes, answers) if answer is not True]
    assert not wrong, (
        f"{when}: {len(wrong)} of {len(probes)} probed addresses of committed segments are not read back GPUDirect "
        "RDMA capable; first: " + ", ".join(f"segment {s} at {a:#x} reads {r!r}" for s, a, r in wrong[:3])
    )


@pytest.mark.invariant(3)
@pytest.mark.gpudirect_rdma
def test_every_chunk_of_every_committed_segment_is_gpudirect_rdma_capable(build):
    cache, step = rdma_cache(build)
    assert cache.buffer.driver.gpudirect_rdma is True
    sizes = grow_in_steps(cache, step)
    check_rdma_capable(cache, "after growth")
    cache.commit(STEPS * step, defragment=True, preserve_contents=True)
    assert readback_one_chunk_per_segment(cache.buffer, sizes) == [True] * len(sizes)
    check_rdma_capable(cache, "after a preserving defragment")
    cache.release_physical()
    cache.recommit()
    check_rdma_capable(cache, "after release and recommit")


@pytest.mark.invariant(3)
@pytest.mark.dma_buf
def test_a_defragmented_segment_exports_as_one_dma_buf_of_exactly_its_bytes(build):
    cache, step = rdma_cache(build)
    driver, granule = cache.buffer.driver, cache.buffer.granularity
    sizes = grow_in_steps(cache, step)
    starts = segment_starts(cache)
    first_chunks = [(start, step * stride) for start, stride in zip(starts, cache.segment_strides)]
    assert [driver.allocation_range_at(start) for start in starts] == first_chunks, "before the defragment"
    patterns = fill_segments(cache, seed=3)
    cache.commit(STEPS * step, defragment=True, preserve_contents=True)
    for segment, (start, size, pattern) in enumerate(zip(starts, sizes, patterns)):
        assert size % granule == 0, f"segment {segment}: {size} committed bytes are not whole granules"
        ends = [driver.allocation_range_at(address) for address in (start, start + size - 1)]
        assert ends == [(start, size)] * 2, f"segment {segment}: allocation read back at its ends {ends}"
        chunks = set(driver.chunks_at(granule_probes(start, start + size, granule)))
        assert len(chunks) == 1 and None not in chunks, f"segment {segment}: chunks read back {chunks}"
        fd = driver.export_dma_buf(start, size)
        try:
            exported = os.lseek(fd, 0, os.SEEK_END)
        finally:
            os.close(fd)
        assert exported == size, f"segment {segment}: dma-buf of {exported} bytes over {size} committed bytes"
        assert torch.equal(cache.buffer.segment_view(segment), pattern), f"segment {segment} changed"


@pytest.mark.invariant(6)
def test_the_host_driver_claims_no_gpudirect_rdma_and_exports_no_dma_buf(build):
    driver = driver_for("cpu")
    granule = driver.granularity
    tensor = build.tensor(2 * granule, device=driver)
    tensor.resize_segments_([2 * granule])
    wrapped = FaultInjectingDriver(driver)
    assert driver.gpudirect_rdma is None and wrapped.gpudirect_rdma is None
    assert driver.rdma_capable_at(tensor.base) is None and wrapped.rdma_capable_at(tensor.base) is None
    assert "gpudirect_rdma" not in driver.describe()
    before = snapshot(tensor)
    for address, size, wrong in [
        (tensor.base, granule + 1, f"size {granule + 1} is not a positive multiple of the granularity"),
        (tensor.base, 0, "size 0 is not a positive multiple"),
        (tensor.base + 4096, granule, f"address {tensor.base + 4096:#x} is not a multiple of the granularity"),
        (float(tensor.base), granule, "export_dma_buf: address must be an int"),
    ]:
        with pytest.raises(ValueError, match=wrong):
            driver.export_dma_buf(address, size)
    for exporter in (driver, wrapped):
        with pytest.raises(NotImplementedError, match="exports no dma-buf"):
            exporter.export_dma_buf(tensor.base, granule)
    check_unchanged(tensor, before)
