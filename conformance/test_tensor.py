"""ExtensibleTensor conformance: every test runs on the host driver and on each
CUDA device (the `device` fixture); physical usage is read from outside extkv.
Tensors come from the `build` fixture, which frees them even when a test fails;
"changes nothing" is checked against a snapshot of chunk objects, the driver's
read-back and the committed bytes (extkv.testing.checks)."""

from __future__ import annotations

import io

import subprocess
import sys
import textwrap

import pytest
import torch

from extkv import DriverError, ExtensibleTensor, FaultInjectingDriver, OutOfMemoryError, StateError
from extkv.testing.checks import (
    check_all_equal,
    check_mapped_as_a_shrink_keeps,
    check_readback_matches_bookkeeping,
    check_unchanged,
    check_usage_matches,
    readback_one_chunk_per_segment,
    snapshot,
)
from extkv.testing.children import fork_server
from extkv.testing.work import python_instructions
from extkv.vmm import HostDriver, PoisoningDriver, driver_for, host_commits, live_chunks, live_reservations
from extkv.usage import open_chunk_fds


@pytest.fixture
def granule(driver) -> int:
    return driver.granularity


def _nonzero(counts) -> dict[str, int]:
    return {kind: count for kind, count in counts.items() if count}


def pattern(n: int, seed: int, device) -> torch.Tensor:
    """Byte i is (i * 131 + seed) % 251 + 1: never zero, and repeating only
    every 251 bytes, so a shift by a granule or a page shows."""
    # The bytes repeat every 251: one period, tiled. Computed over all n in
    # int64 it took 0.2 s per 10 MiB segment (2-core CI host), 4.5 s of the
    # five fragmented-neighbour tests.
    period = (torch.arange(251, dtype=torch.int64) * 131 + seed).remainder(251).add(1).to(torch.uint8)
    return period.repeat(-(-n // 251))[:n].to(device)


@pytest.mark.invariant(1)
def test_base_and_view_addresses_fixed_across_growth(build, granule):
    t = build.tensor(8 * granule, segment_capacities=[4 * granule, 4 * granule])
    base = t.base
    full = t.full_view()
    assert full.data_ptr() == base and full.numel() == 8 * granule
    for step in range(1, 5):
        t.resize_segments_([step * granule - 7, step * granule // 2])
        pointers = [t.base, t.full_view().data_ptr(), t.segment_view(0).data_ptr(), t.segment_view(1).data_ptr()]
        assert pointers == [base, base, base, base + 4 * granule], f"step {step}: {[hex(p) for p in pointers]}"


@pytest.mark.invariant(1)
def test_contents_kept_and_new_bytes_zero(build, granule, device):
    t = build.tensor(6 * granule, segment_capacities=[3 * granule, 3 * granule])
    t.resize_segments_([1000, 10], zero_new=True)
    head = pattern(1000, 1, device)
    t.segment_view(0).copy_(head)
    t.segment_view(1).fill_(0xAB)
    t.resize_segments_([2 * granule + 5, granule], zero_new=True)
    seg0, seg1 = t.segment_view(0), t.segment_view(1)
    check_all_equal(seg0[:1000], head, "segment 0's kept bytes")
    check_all_equal(seg0[1000:], 0, "segment 0's new bytes")
    check_all_equal(seg1[:10], 0xAB, "segment 1's kept bytes")
    check_all_equal(seg1[10:], 0, "segment 1's new bytes")


@pytest.mark.invariant(1)
def test_many_small_growths_and_defragments_keep_bookkeeping_and_bytes(build, granule, device, usage):
    """Once a tensor holds many chunks, a commit's new chunks are spliced in
    among them, and a defragmented segment's chunks cut out, by bisection
    rather than a pass over every chunk: the bookkeeping stays in address
    order and equal to what the driver maps after every step, and every
    byte written stays."""
    segments, steps = 12, 12
    baseline, kind = usage.read_outside_torch(), driver_for(device).kind
    chunks_before = live_chunks[kind]
    t = build.tensor(segments * steps * granule, segment_capacities=[steps * granule] * segments)
    for step in range(1, steps + 1):
        t.resize_segments_([step * granule] * segments, zero_new=True)
        for i in range(segments):
            t.segment_view(i)[(step - 1) * granule :].fill_(16 * i + step)
    starts = [mapped.first_granule for mapped in t.mapped_chunks]
    assert len(starts) == segments * steps and starts == sorted(starts), starts
    check_readback_matches_bookkeeping(t)
    for i in range(segments):
        assert t.defragment_segment_(i)
        check_readback_matches_bookkeeping(t)
    assert readback_one_chunk_per_segment(t, t.segment_sizes) == [True] * segments
    check_usage_matches(usage, baseline, [t])
    for i in range(segments):
        expected = (torch.arange(1, steps + 1, dtype=torch.uint8) + 16 * i).repeat_interleave(granule)
        check_all_equal(t.segment_view(i), expected.to(device), f"segment {i} after growths and a defragment")
    t.free()
    assert live_chunks[kind] == chunks_before, "a chunk the bookkeeping lost was never released"


@pytest.mark.invariant(1)
def test_zero_new_zeroes_exactly_the_new_bytes(build, granule, device):
    """Bytes already mapped but beyond the committed size are not the caller's;
    a resize with zero_new must zero them when they become committed, and must
    leave bytes outside the new range alone."""
    t = build.tensor(2 * granule, segment_capacities=[granule, granule])
    t.resize_segments_([100, 100], zero_new=True)
    full = t.full_view()
    full[: 2 * granule].fill_(0x5A)  # mapped granules, committed or not
    t.resize_segments_([300, 100], zero_new=True)
    check_all_equal(full[:100], 0x5A, "bytes committed before")
    check_all_equal(full[100:300], 0, "new bytes")
    check_all_equal(full[300 : 2 * granule], 0x5A, "bytes past the new sizes")
    t.resize_segments_([400, 100], zero_new=False)
    check_all_equal(full[300:400], 0x5A, "new bytes without zero_new")


@pytest.mark.invariant(5)
def test_shared_granule_is_mapped_once(build, granule):
    half = granule // 2
    t = build.tensor(3 * granule, segment_capacities=[granule + half, granule + half])
    t.resize_segments_([granule + half, granule + half])
    assert t.physical_bytes == 3 * granule
    assert t.num_physical_chunks == 1
    check_readback_matches_bookkeeping(t)


@pytest.mark.invariant(3)
def test_a_run_over_many_segments_is_cut_only_at_aligned_segment_starts(build, granule):
    """A run spanning whole segments becomes chunks of at least
    `pipelined_chunk_bytes`, cut where a segment starts on a granule
    boundary: every segment mapped whole lies in one chunk."""
    half = granule // 2
    # Segments 0-3 start on granule boundaries; 4 and 5 share granule 5.
    capacities = [granule, granule, 2 * granule, granule, granule + half, granule + half]
    t = build.tensor(sum(capacities), segment_capacities=capacities)
    t.pipelined_chunk_bytes = 2 * granule
    t.resize_segments_(capacities)
    assert [(m.first_granule, m.num_granules) for m in t.mapped_chunks] == [(0, 2), (2, 2), (4, 4)]
    assert t.segments_backed_by_one_chunk(capacities) == [True] * len(capacities)
    assert readback_one_chunk_per_segment(t, capacities) == [True] * len(capacities)
    check_readback_matches_bookkeeping(t)


@pytest.mark.invariant(6)
@pytest.mark.parametrize("value", [0, -1, "1", 1.5, True])
def test_pipelined_chunk_bytes_takes_only_a_positive_int(build, granule, value):
    t = build.tensor(2 * granule)
    with pytest.raises(ValueError, match=r"pipelined_chunk_bytes must be an int >= 1, got"):
        t.pipelined_chunk_bytes = value
    assert t.pipelined_chunk_bytes == 1 << 30


@pytest.mark.invariant(3)
def test_a_run_inside_one_segment_is_never_cut(build, granule):
    t = build.tensor(8 * granule, segment_capacities=[6 * granule, 2 * granule])
    t.pipelined_chunk_bytes = granule
    t.resize_segments_([6 * granule, 0])
    assert t.num_physical_chunks == 1


@pytest.mark.invariant(1)
def test_shared_granule_grown_by_second_segment_is_not_remapped(build, granule):
    half = granule // 2
    t = build.tensor(3 * granule, segment_capacities=[granule + half, granule + half])
    t.resize_segments_([granule + 1, 0])  # maps granules 0 and 1
    before = snapshot(t)
    t.resize_segments_([granule + 1, 10])  # segment 1 starts inside granule 1
    assert t.segment_sizes == [granule + 1, 10]
    after = snapshot(t)
    assert after.physical_bytes == 2 * granule, f"physical bytes {after.physical_bytes}"
    assert all(a is b for a, b in zip(after.mapped_chunks, before.mapped_chunks)) and len(after.mapped_chunks) == len(
        before.mapped_chunks
    ), "a mapped granule was remapped"
    assert after.readback == before.readback, "the driver reads back other chunks than before"


@pytest.mark.invariant(3)
def test_one_chunk_per_maximal_run(build, granule):
    t = build.tensor(12 * granule, segment_capacities=[4 * granule] * 3)
    t.resize_segments_([granule, granule, granule])
    assert t.num_physical_chunks == 3  # three separated runs
    t.resize_segments_([4 * granule, granule, granule])
    assert t.num_physical_chunks == 4  # one run of 3 granules added to segment 0
    # segment 0 full and segment 1's new granules are contiguous: one run
    t.resize_segments_([4 * granule, 4 * granule, 3 * granule])
    assert t.num_physical_chunks == 6
    assert t.physical_bytes == 11 * granule
    check_readback_matches_bookkeeping(t)


@pytest.mark.invariant(1)
def test_resize_that_grows_nothing_touches_no_mapping(build, device, granule):
    counting = FaultInjectingDriver(driver_for(device), {})
    t = build.tensor(4 * granule, device=counting, segment_capacities=[2 * granule, 2 * granule])
    t.resize_segments_([granule, 10])
    t.segment_view(0).fill_(0x42)
    calls = dict(counting.calls)
    before = snapshot(t)
    t.resize_segments_([granule, 10], zero_new=True)
    check_unchanged(t, before)
    t.resize_segments_([granule, 100])  # within mapped granules
    assert counting.calls == calls, f"driver calls {calls} -> {counting.calls}"
    assert [m is b for m, b in zip(t.mapped_chunks, before.mapped_chunks)] == [True] * len(before.mapped_chunks)


@pytest.mark.invariant(3)
def test_one_chunk_query_agrees_with_readback(build, granule):
    t = build.tensor(8 * granule, segment_capacities=[4 * granule, 4 * granule])
    t.resize_segments_([granule // 2, 3 * granule])
    t.resize_segments_([3 * granule, 3 * granule + 1])
    for sizes in ([granule // 2, 3 * granule], [3 * granule, 3 * granule + 1], [0, granule], [granule, 0]):
        assert t.segments_backed_by_one_chunk(sizes) == readback_one_chunk_per_segment(t, sizes)
    assert t.segments_backed_by_one_chunk([3 * granule, 3 * granule]) == [False, True]
    assert t.segments_backed_by_one_chunk([3 * granule, 4 * granule]) == [False, False]  # unmapped tail
    check_readback_matches_bookkeeping(t)


@pytest.mark.invariant(1, 4, 5)
def test_release_keeps_addresses_and_recommit_reads_zero(build, granule, device, usage):
    baseline = usage.read_outside_torch()
    t = build.tensor(4 * granule, segment_capacities=[2 * granule, 2 * granule])
    t.resize_segments_([2 * granule, granule], zero_new=True)
    views = [t.full_view(), t.segment_view(0), t.segment_view(1)]
    pointers = [v.data_ptr() for v in views]
    views[0][: 3 * granule].fill_(0xEE)
    check_usage_matches(usage, baseline, [t])
    t.release_physical()
    assert t.physical_bytes == 0 and t.num_physical_chunks == 0 and t.segment_sizes == [0, 0]
    check_usage_matches(usage, baseline, [t])
    check_readback_matches_bookkeeping(t)
    t.resize_segments_([2 * granule, granule], zero_new=True)
    assert [v.data_ptr() for v in views] == pointers
    check_all_equal(views[1], 0, "segment 0 recommitted")
    check_all_equal(views[2], 0, "segment 1 recommitted")
    check_usage_matches(usage, baseline, [t])


@pytest.mark.invariant(5)
def test_usage_equals_physical_bytes_after_every_step(build, granule, usage):
    baseline = usage.read_outside_torch()
    tensors = [build.tensor(6 * granule, segment_capacities=[3 * granule, 3 * granule]), build.tensor(granule)]
    check_usage_matches(usage, baseline, tensors)
    steps = [
        lambda: tensors[0].resize_segments_([100, 0], zero_new=True),
        lambda: tensors[1].resize_segments_([granule]),
        lambda: tensors[0].resize_segments_([3 * granule, granule + 1], zero_new=True),
        lambda: tensors[1].release_physical(),
        lambda: tensors[0].resize_segments_([3 * granule, 3 * granule]),
        lambda: tensors[0].release_physical(),
        lambda: tensors[0].resize_segments_([5, 5], zero_new=True),
        lambda: tensors[1].free(),
        lambda: tensors[0].free(),
    ]
    for step in steps:
        step()
        check_usage_matches(usage, baseline, tensors)  # the last step freed both: back at the baseline


@pytest.mark.invariant(1)
def test_segment_view_storage_spans_exactly_committed_bytes(build, granule):
    t = build.tensor(4 * granule, segment_capacities=[granule, 3 * granule])
    t.resize_segments_([123, granule + 7])
    assert t.segment_view(0).untyped_storage().nbytes() == 123
    assert t.segment_view(1).untyped_storage().nbytes() == granule + 7
    assert t.full_view().untyped_storage().nbytes() == 4 * granule
    assert t.segment_view(0).dtype == torch.uint8


@pytest.mark.invariant(5)
def test_zero_size_tensor_reserves_one_granule(build, granule):
    t = build.tensor(0)
    assert t.reserved_bytes == granule
    t.resize_segments_([0])
    assert t.physical_bytes == 0 and t.segment_view(0).numel() == 0


INVALID_CONSTRUCTIONS = [
    (dict(size=-1), ValueError, "size must be an int >= 0"),
    (dict(size=1.5), ValueError, "size must be an int >= 0"),
    (dict(size=100, segment_capacities=[50, 49]), ValueError, "sum to 99 bytes, expected size=100"),
    (dict(size=100, segment_capacities=[]), ValueError, "at least one segment"),
    (dict(size=100, segment_capacities=[120, -20]), ValueError, r"segment_capacities\[1\]"),
]


@pytest.mark.invariant(6)
@pytest.mark.parametrize("kwargs, error, message", INVALID_CONSTRUCTIONS)
def test_invalid_construction_raises_and_reserves_nothing(device, kwargs, error, message):
    reservations = _nonzero(live_reservations)
    with pytest.raises(error, match=message):
        ExtensibleTensor(device=device, **kwargs)
    assert _nonzero(live_reservations) == reservations


@pytest.mark.invariant(6)
def test_invalid_device_raises():
    with pytest.raises(ValueError, match="not supported"):
        ExtensibleTensor(10, device="meta")
    with pytest.raises(ValueError, match="not a torch device"):
        ExtensibleTensor(10, device="gpu7")


@pytest.mark.invariant(6)
def test_invalid_calls_raise_and_change_nothing(build, granule):
    t = build.tensor(4 * granule, segment_capacities=[2 * granule, 2 * granule])
    t.resize_segments_([granule, 10], zero_new=True)
    t.segment_view(0).fill_(0x61)
    state = snapshot(t)
    calls = [
        (lambda: t.resize_segments_([granule]), ValueError, "expected 2 segment size"),
        (lambda: t.resize_segments_([granule, 10, 0]), ValueError, "expected 2 segment size"),
        (lambda: t.resize_segments_([granule - 1, 10]), ValueError, r"would shrink segment 0"),
        (lambda: t.resize_segments_([granule, 2 * granule + 1]), ValueError, "exceeds segment 1's capacity"),
        (lambda: t.resize_segments_([granule, -1]), ValueError, r"sizes\[1\] must be an int >= 0, got -1"),
        (lambda: t.resize_segments_([granule, 10.0]), ValueError, r"sizes\[1\]"),
        (lambda: t.resize_segments_(5), ValueError, "sequence of ints"),
        (lambda: t.segment_view(2), IndexError, r"segment index must be an int >= 0 and <= 1, got 2: the tensor has 2 segment\(s\)"),
        (lambda: t.segment_view(-1), IndexError, "segment index must be an int >= 0 and <= 1, got -1"),
        (lambda: t.segments_backed_by_one_chunk([1]), ValueError, "expected 2 segment size"),
        (lambda: t.segments_backed_by_one_chunk([0, 3 * granule]), ValueError, "capacity"),
        (lambda: t.shrink_segments_([granule + 1, 10]), ValueError,
         rf"sizes\[0\] = {granule + 1} would grow segment 0 from {granule} committed bytes; shrink_segments_ only shrinks"),
        (lambda: t.shrink_segments_([granule]), ValueError, "expected 2 segment size"),
        (lambda: t.shrink_segments_([granule, -1]), ValueError, r"sizes\[1\] must be an int >= 0, got -1"),
        (lambda: t.shrink_segments_([granule, "5"]), ValueError, r"sizes\[1\]"),
        (lambda: t.physical_bytes_after_shrink([granule, 11]), ValueError, "would grow segment 1 from 10"),
    ]
    for call, error, message in calls:
        with pytest.raises(error, match=message):
            call()
        check_unchanged(t, state)


@pytest.mark.invariant(6)
def test_freed_tensor_refuses_work_and_free_is_idempotent(device, granule):
    t = ExtensibleTensor(granule, device=device)
    t.resize_segments_([10])
    t.free()
    t.free()
    assert t.is_freed
    for call in (lambda: t.resize_segments_([20]), t.full_view, lambda: t.segment_view(0), t.release_physical,
                 lambda: t.shrink_segments_([0]), lambda: t.physical_bytes_after_shrink([0])):
        with pytest.raises(StateError, match="freed ExtensibleTensor"):
            call()


@pytest.mark.invariant(5)
def test_context_manager_frees(device, granule):
    reservations = _nonzero(live_reservations)
    with ExtensibleTensor(granule, device=device) as t:
        t.resize_segments_([granule])
        assert _nonzero(live_reservations) != reservations
    assert t.is_freed and _nonzero(live_reservations) == reservations


RESIZE_STEPS = ("create", "map", "set_access")


@pytest.mark.invariant(5)
@pytest.mark.parametrize("step", RESIZE_STEPS)
@pytest.mark.parametrize("nth", [1, 2, 3])
def test_fault_in_resize_leaves_consistent_tensor_and_retry_completes(build, device, granule, usage, step, nth):
    """Three runs need three chunks; the nth run's `step` fails."""
    baseline = usage.read_outside_torch()
    fds = len(open_chunk_fds())
    faulty = FaultInjectingDriver(driver_for(device))
    t = build.tensor(9 * granule, device=faulty, segment_capacities=[3 * granule] * 3)
    t.resize_segments_([granule // 2] * 3, zero_new=True)  # makes the three runs below separate
    for i in range(3):
        t.segment_view(i).fill_(0x77)
    faulty.fail_in(step, nth)
    target = [3 * granule] * 3
    with pytest.raises(DriverError, match=f"{step} \\(injected fault"):
        t.resize_segments_(target, zero_new=True)
    assert faulty.fired == [(step, faulty.calls[step])]
    # Runs before the failing one stay mapped, recorded and accessible.
    assert t.segment_sizes == [granule // 2] * 3
    assert t.num_physical_chunks == 3 + (nth - 1)
    check_readback_matches_bookkeeping(t)
    check_usage_matches(usage, baseline, [t])
    for mapped in t.mapped_chunks:
        t.driver.view(mapped.address, mapped.chunk.size).add_(0)  # readable and writable
    t.resize_segments_(target, zero_new=True)
    assert t.segment_sizes == target
    assert t.physical_bytes == 9 * granule
    check_readback_matches_bookkeeping(t)
    check_usage_matches(usage, baseline, [t])
    for i in range(3):
        view = t.segment_view(i)
        check_all_equal(view[: granule // 2], 0x77, f"segment {i}'s bytes from before the fault")
        check_all_equal(view[granule // 2 :], 0, f"segment {i}'s new bytes")
    t.free()
    assert len(open_chunk_fds()) == fds


@pytest.mark.invariant(5)
@pytest.mark.parametrize("step", ["unmap", "release"])
def test_fault_in_release_is_retried_without_leaks(build, device, granule, usage, step):
    baseline = usage.read_outside_torch()
    faulty = FaultInjectingDriver(driver_for(device), {step: 2})
    t = build.tensor(6 * granule, device=faulty, segment_capacities=[3 * granule] * 2)
    t.resize_segments_([granule, granule])
    t.resize_segments_([3 * granule, 3 * granule])
    with pytest.raises(DriverError, match=f"{step} \\(injected fault"):
        t.release_physical()
    check_readback_matches_bookkeeping(t)
    assert t.segment_sizes == [0, 0]
    t.release_physical()
    assert t.physical_bytes == 0
    check_usage_matches(usage, baseline, [t])


# -- shrinking from the top, keeping contents -------------------------------------------
def three_commits(t: ExtensibleTensor, granule: int) -> None:
    """Grow both segments of a 7-granule tensor (capacities of 3.5
    granules: they share granule 3) in three commits, then fill every
    committed byte with a never-zero pattern: chunks of several granules,
    one of them shared by the segments."""
    capacity = t.segment_capacities[0]
    for size in (granule // 2, 2 * granule + 100, capacity):
        t.resize_segments_([size, size], zero_new=True)
    for i in range(2):
        t.segment_view(i).copy_(pattern(capacity, i, t.device))


@pytest.mark.invariant(1, 3, 5)
@pytest.mark.parametrize("halves", [(1, 2), (0, 3), (0, 0), (6, 6)],
                         ids=["mid-chunk", "one-segment-emptied", "to-nothing", "inside-kept-chunks"])
def test_shrink_segments_keeps_the_bytes_below_and_releases_every_chunk_holding_none(build, device, granule, usage, halves):
    """Kept bytes stay, bit for bit, at their addresses; the chunks holding
    a kept byte stay mapped whole, every other one is unmapped and released
    (read back from the driver, and from outside extkv); a regrowth zeroes
    the bytes that become committed again, over the pattern left in the
    kept chunks and the poison of new ones."""
    baseline, kind = usage.read_outside_torch(), driver_for(device).kind
    poisoned = PoisoningDriver(driver_for(device))
    capacity = 7 * granule // 2
    t = build.tensor(2 * capacity, device=poisoned, segment_capacities=[capacity, capacity])
    three_commits(t, granule)
    # Half granules, and a few bytes more: new ends inside granules.
    sizes = [half * granule // 2 + 37 * half for half in halves]
    offsets = t.segment_offsets
    kept = {g for offset, size in zip(offsets, sizes) if size for g in range(offset // granule, -(-(offset + size) // granule))}
    before = t.mapped_chunks
    stays = [m for m in before if kept & set(range(m.first_granule, m.end_granule))]
    pointers = [t.segment_view(i).data_ptr() for i in range(2)]
    chunks_alive, releases = live_chunks[kind], t.release_count
    predicted = t.physical_bytes_after_shrink(sizes)
    t.shrink_segments_(sizes)
    assert t.segment_sizes == sizes
    assert len(t.mapped_chunks) == len(stays) and all(a is b for a, b in zip(t.mapped_chunks, stays)), (
        f"chunks (first granule, granules) kept: {[(m.first_granule, m.num_granules) for m in t.mapped_chunks]}, "
        f"expected those holding kept granules {sorted(kept)}: {[(m.first_granule, m.num_granules) for m in stays]}")
    assert t.physical_bytes == predicted == sum(m.chunk.size for m in stays), (t.physical_bytes, predicted)
    assert t.physical_bytes >= len(kept) * granule
    assert live_chunks[kind] == chunks_alive - (len(before) - len(stays))
    assert t.release_count == releases + 1
    check_mapped_as_a_shrink_keeps(t, sizes)
    check_readback_matches_bookkeeping(t)
    check_usage_matches(usage, baseline, [t])
    for i, size in enumerate(sizes):
        if size:
            assert t.segment_view(i).data_ptr() == pointers[i]
        check_all_equal(t.segment_view(i), pattern(capacity, i, device)[:size], f"segment {i}'s kept bytes")
    t.resize_segments_([capacity, capacity], zero_new=True)
    for i, size in enumerate(sizes):
        view = t.segment_view(i)
        check_all_equal(view[:size], pattern(capacity, i, device)[:size], f"segment {i}'s kept bytes after regrowth")
        check_all_equal(view[size:], 0, f"segment {i}'s bytes committed again")
    check_readback_matches_bookkeeping(t)
    check_usage_matches(usage, baseline, [t])


@pytest.mark.invariant(1, 5)
@pytest.mark.parametrize("step, call", [("unmap", 2), ("release", 1), ("release", 2)])
def test_a_shrink_failing_part_way_keeps_what_it_released_and_a_retry_finishes(build, device, granule, usage, step, call):
    """One segment in four chunks, three of them above the kept bytes: they
    go from the top down, so a failure leaves one gapless prefix mapped
    (what the one-segment growth needs), the new size stands, the kept bytes
    stay, and the same call again releases the rest."""
    baseline = usage.read_outside_torch()
    faulty = FaultInjectingDriver(driver_for(device))
    t = build.tensor(8 * granule, device=faulty)
    for size in (granule, 2 * granule, 4 * granule, 8 * granule):
        t.resize_segments_([size], zero_new=True)
    t.segment_view(0).copy_(pattern(8 * granule, 3, device))
    assert t.num_physical_chunks == 4
    faulty.fail_in(step, call)
    with pytest.raises(DriverError, match=f"{step} \\(injected fault"):
        t.shrink_segments_([granule - 1])
    assert t.segment_sizes == [granule - 1]
    mapped = [(m.first_granule, m.num_granules) for m in t.mapped_chunks]
    assert mapped[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(mapped, mapped[1:])), f"a gap: {mapped}"
    assert t.num_physical_chunks == {("unmap", 2): 3, ("release", 1): 3, ("release", 2): 2}[(step, call)], mapped
    check_readback_matches_bookkeeping(t)
    check_all_equal(t.segment_view(0), pattern(granule - 1, 3, device), "the kept bytes after a failed shrink")
    t.shrink_segments_([granule - 1])
    assert [(m.first_granule, m.num_granules) for m in t.mapped_chunks] == [(0, 1)]
    check_mapped_as_a_shrink_keeps(t, [granule - 1])
    check_usage_matches(usage, baseline, [t])
    t.resize_segments_([3 * granule], zero_new=True)
    check_all_equal(t.segment_view(0)[granule - 1 :], 0, "bytes committed again after the retry")
    check_readback_matches_bookkeeping(t)


@pytest.mark.invariant(1)
@pytest.mark.parametrize("step, call", [("release", 1), ("unmap", 2)])
def test_growth_after_a_release_failed_part_way_maps_the_gap_it_left(build, device, granule, step, call):
    """A one-segment tensor released in address order: the failure leaves the
    chunks above it mapped over a gap, which the next growth must map."""
    faulty = FaultInjectingDriver(driver_for(device))
    t = build.tensor(4 * granule, device=faulty)
    t.resize_segments_([2 * granule])
    t.resize_segments_([4 * granule])  # two chunks: granules 0-1 and 2-3
    faulty.fail_in(step, call)
    with pytest.raises(DriverError, match=f"{step} \\(injected fault"):
        t.release_physical()
    assert [(m.first_granule, m.num_granules) for m in t.mapped_chunks] == [(2, 2)], "the chunk above the failure stays"
    t.resize_segments_([3 * granule])
    check_readback_matches_bookkeeping(t)
    committed = range(t.base, t.base + 3 * granule, granule)
    unmapped = [address - t.base for address, chunk in zip(committed, faulty.chunks_at(committed)) if chunk is None]
    assert unmapped == [], f"offsets of committed granules nothing is mapped behind: {unmapped}"
    t.release_physical()  # the retry gives back the chunk the failure kept
    assert t.physical_bytes == 0 and t.mapped_chunks == []


@pytest.mark.invariant(5, 6)
def test_out_of_memory_create_reclaims_cache_and_retries_once(build, device, granule):
    faulty = FaultInjectingDriver(driver_for(device), {"create": 1}, out_of_memory=True)
    t = build.tensor(2 * granule, device=faulty)
    if device.type == "cuda":
        torch.empty(64 << 20, dtype=torch.uint8, device=device)  # dropped at once: cached, unused
        cached = torch.cuda.memory_reserved(device)
        t.resize_segments_([2 * granule], zero_new=True)
        # The 64 MiB torch cached but no longer used went back before the retry.
        assert torch.cuda.memory_reserved(device) <= cached - (64 << 20)
        assert faulty.calls["create"] == 2 and t.physical_bytes == 2 * granule
    else:
        # The host has no framework cache to reclaim: the error surfaces.
        with pytest.raises(OutOfMemoryError, match="INJECTED_OUT_OF_MEMORY"):
            t.resize_segments_([2 * granule])
        assert faulty.calls["create"] == 1 and t.physical_bytes == 0


@pytest.mark.invariant(6)
def test_driver_error_names_call_code_size_and_address(device, granule):
    driver = driver_for(device)
    address = driver.reserve(granule)
    try:
        chunk = driver.create(granule)
        try:
            with pytest.raises(DriverError) as raised:
                driver.map(address + 1, chunk)  # misaligned
            error = raised.value
            assert error.size == granule and error.address == address + 1
            assert hex(error.address) in str(error) and str(granule) in str(error)
            assert error.code_name in str(error) and error.call.split("(")[0] in str(error)
        finally:
            driver.release(chunk)
    finally:
        driver.free_reservation(address, granule)


def _commit_work(driver, segments: int, granules_each: int) -> int:
    """Python bytecode instructions of one zeroing commit that maps
    `segments` segments of `granules_each` granules, on a fresh tensor."""
    g = driver.granularity
    t = ExtensibleTensor(segments * granules_each * g, device=driver, segment_capacities=[granules_each * g] * segments)
    try:
        return python_instructions(lambda: t.resize_segments_([granules_each * g] * segments, zero_new=True))
    finally:
        t.free()


@pytest.fixture
def small_granule_driver(device, monkeypatch, tmp_path):
    """On the host a 4 KiB granule, so a thousand granules are 4 MiB, not 2 GiB,
    and a machine commit lock of the test's own: a count includes every try
    of that lock, and other processes' commits (the other test workers')
    would add tries of theirs."""
    if device.type != "cpu":
        return driver_for(device)
    monkeypatch.setattr(host_commits, "COMMITS_LOCK_PATH", str(tmp_path / "commits.lock"))
    return HostDriver(granularity=4096)


@pytest.mark.invariant(3)
def test_a_commits_python_work_does_not_grow_with_its_granule_count(small_granule_driver):
    _commit_work(small_granule_driver, 1, 1)  # first-use work (imports, caches) is not the commit's
    work = {granules: _commit_work(small_granule_driver, 1, granules) for granules in (1, 16, 1024)}
    assert work[1] == work[16] == work[1024], f"bytecode instructions per commit by granule count: {work}"


@pytest.mark.invariant(3)
def test_a_commits_python_work_grows_linearly_with_its_segment_count(small_granule_driver):
    _commit_work(small_granule_driver, 1, 1)
    work = {segments: _commit_work(small_granule_driver, segments, 1) for segments in (256, 1024)}
    # Four times the segments: four times the per-segment work, plus the
    # same fixed part (so a little under 4x); anything quadratic exceeds it.
    assert work[1024] <= 4 * work[256], f"bytecode instructions per commit by segment count: {work}"


@pytest.mark.invariant(1, 3)
def test_map_new_chunks_maps_each_run_then_zeroes_exactly_its_ranges(driver, granule, device):
    """The one-call commit path of the bare driver (on CUDA its own loop, not
    the step-by-step one wrappers take), with ranges zeroed after the runs in
    memory mapped before: zeroing is checked on a chunk mapped before and
    poisoned, so a range it missed or overran reads as poison."""
    address = driver.reserve(3 * granule)
    earlier = driver.create(granule)
    created: list = []
    try:
        driver.map(address, earlier)
        driver.set_access(address, granule)
        driver.view(address, granule).fill_(0xA5)
        zero = [(address + granule - 8, 8), (address + granule + 5, 7)]
        runs = [(address + granule, granule, zero), (address + 2 * granule, granule, ())]
        driver.map_new_chunks(runs, created, driver.release, zero_after=[(address + 100, 300), (address + 1000, 24)])
        driver.synchronize()
        assert [chunk.size for chunk in created] == [granule, granule]
        backing = driver.chunks_at([address, address + granule, address + 2 * granule])
        assert None not in backing and len(set(backing)) == 3
        expected = torch.full((granule,), 0xA5, dtype=torch.uint8, device=device)
        expected[100:400] = 0
        expected[1000:1024] = 0
        expected[granule - 8 :] = 0
        assert int((driver.view(address, granule) != expected).sum()) == 0
        new = driver.view(address + granule, 2 * granule)
        new.fill_(1)  # writable
        driver.synchronize()
        assert int(new.sum()) == 2 * granule
    finally:
        driver.synchronize()
        for index, chunk in enumerate([earlier, *created]):
            driver.unmap(address + index * granule, granule)
            driver.release(chunk)
        driver.free_reservation(address, 3 * granule)


@pytest.mark.invariant(5, 6)
def test_map_new_chunks_failure_keeps_finished_runs_and_gives_back_the_failing_chunk(driver, granule):
    address = driver.reserve(2 * granule)
    chunks_before = live_chunks[driver.kind]
    created: list = []
    given_back: list = []

    def give_back(chunk):
        given_back.append(chunk)
        driver.release(chunk)

    try:
        with pytest.raises(DriverError) as raised:
            # The second run's address is misaligned: its map fails after its create.
            driver.map_new_chunks([(address, granule, ()), (address + granule + 1, granule, ())], created, give_back)
        assert raised.value.address == address + granule + 1 and raised.value.size == granule
        assert len(created) == 1 and len(given_back) == 1
        assert live_chunks[driver.kind] == chunks_before + 1
        assert driver.chunk_at(address) is not None and driver.chunk_at(address + granule) is None
    finally:
        for chunk in created:
            driver.unmap(address, granule)
            driver.release(chunk)
        driver.free_reservation(address, 2 * granule)
    assert live_chunks[driver.kind] == chunks_before


@pytest.mark.invariant(6)
def test_map_new_chunks_refuses_a_size_off_the_granularity_before_creating_anything(driver, granule):
    address = driver.reserve(2 * granule)
    chunks_before = live_chunks[driver.kind]
    created: list = []
    try:
        with pytest.raises(ValueError, match=f"size {granule + 1} is not a positive multiple of the granularity {granule}"):
            driver.map_new_chunks([(address, granule, ()), (address + granule, granule + 1, ())], created, driver.release)
        assert created == [] and live_chunks[driver.kind] == chunks_before
        assert driver.chunk_at(address) is None
    finally:
        driver.free_reservation(address, 2 * granule)


@pytest.mark.invariant(5)
@pytest.mark.long
def test_create_free_cycles_return_everything_to_baseline(device, granule, usage):
    baseline = usage.read_outside_torch()
    reservations, chunks, fds = _nonzero(live_reservations), _nonzero(live_chunks), len(open_chunk_fds())
    for cycle in range(1000):
        t = ExtensibleTensor(4 * granule, device=device, segment_capacities=[2 * granule, 2 * granule])
        t.resize_segments_([cycle % 3 * granule // 2, granule])
        if cycle % 5 == 0:
            t.release_physical()
        t.free()
    assert _nonzero(live_reservations) == reservations and _nonzero(live_chunks) == chunks
    assert len(open_chunk_fds()) == fds
    check_usage_matches(usage, baseline, [])


@pytest.mark.invariant(6)
@pytest.mark.long
def test_views_survive_interpreter_teardown(device):
    """Views alive at exit are destroyed after Python's modules are gone; their
    deleter must not need the interpreter."""
    script = textwrap.dedent(
        f"""
        import torch
        from extkv import ExtensibleTensor
        t = ExtensibleTensor(3 << 20, device={str(device)!r}, segment_capacities=[1 << 20, 2 << 20])
        t.resize_segments_([1 << 20, 1 << 20], zero_new=True)
        views = [t.full_view(), t.segment_view(0), t.segment_view(1)]
        views[1].fill_(3)
        assert int(views[0][:16].sum()) == 48
        import builtins
        builtins.kept_views = views  # alive until the very end
        t.free()
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def fragmented_tensor(build, driver, granule) -> ExtensibleTensor:
    """Segment 0 spans two chunks (granule 0, granules 1-2); segment 1 one."""
    t = build.tensor(6 * granule, device=driver, segment_capacities=[3 * granule, 3 * granule])
    t.resize_segments_([granule, granule], zero_new=True)
    t.resize_segments_([3 * granule, granule], zero_new=True)
    for i in range(2):
        view = t.segment_view(i)
        view.copy_(pattern(view.numel(), 11 * (i + 1), view.device))
    return t


@pytest.mark.invariant(1, 3, 5)
def test_defragment_segment_keeps_bytes_and_addresses(build, device, granule, usage):
    baseline = usage.read_outside_torch()
    t = fragmented_tensor(build, driver_for(device), granule)
    before = [t.segment_view(i).clone() for i in range(2)]
    pointers = [t.segment_view(i).data_ptr() for i in range(2)]
    assert t.segments_backed_by_one_chunk(t.segment_sizes) == [False, True]
    assert t.defragment_segment_(0) is True
    untouched = snapshot(t)
    assert t.defragment_segment_(1) is False  # already one chunk: untouched
    check_unchanged(t, untouched)
    assert readback_one_chunk_per_segment(t, t.segment_sizes) == [True, True]
    assert t.num_physical_chunks == 2
    assert [t.segment_view(i).data_ptr() for i in range(2)] == pointers
    for i in range(2):
        check_all_equal(t.segment_view(i), before[i], f"segment {i} after defragmenting segment 0")
    check_readback_matches_bookkeeping(t)
    check_usage_matches(usage, baseline, [t])


@pytest.mark.invariant(3, 5)
@pytest.mark.parametrize("step, nth", [("create", 1), ("reserve", 1), ("map", 1), ("set_access", 1), ("unmap", 1), ("unmap", 2), ("map", 2)])
def test_fault_in_defragment_leaves_old_mapping_and_bytes(build, device, granule, usage, step, nth):
    """map #2 fails the final mapping after the old chunks were unmapped: the
    undo maps them back. unmap #2 fails after one old chunk was unmapped.
    Either way the same chunks back the same addresses, with the same bytes."""
    baseline = usage.read_outside_torch()
    faulty = FaultInjectingDriver(driver_for(device))
    t = fragmented_tensor(build, faulty, granule)
    before = snapshot(t)
    faulty.fail_in(step, nth)
    with pytest.raises(DriverError, match="injected fault"):
        t.defragment_segment_(0)
    check_unchanged(t, before)
    check_readback_matches_bookkeeping(t)
    check_usage_matches(usage, baseline, [t])
    assert t.defragment_segment_(0) is True
    for i in range(2):
        check_all_equal(t.segment_view(i), before.contents[i], f"segment {i} after the retried defragment")


@pytest.mark.invariant(5)
@pytest.mark.parametrize("step, nth", [("release", 1), ("release", 2), ("unmap", 3)])
def test_fault_in_defragment_cleanup_is_finished_by_free(build, device, granule, usage, step, nth):
    """Past the swap nothing can be undone, only finished: release #1 and #2
    release the replaced chunks, unmap #3 drops the scratch mapping. A fault
    there leaves the new mapping in place and the leftovers recorded, and
    free() returns every chunk, mapping and reservation."""
    baseline = usage.read_outside_torch()
    reservations, chunks = _nonzero(live_reservations), _nonzero(live_chunks)
    faulty = FaultInjectingDriver(driver_for(device))
    t = fragmented_tensor(build, faulty, granule)
    before = [t.segment_view(i).clone() for i in range(2)]
    faulty.fail_in(step, nth)
    with pytest.raises(DriverError, match="injected fault"):
        t.defragment_segment_(0)
    assert faulty.fired == [(step, faulty.calls[step])]
    assert readback_one_chunk_per_segment(t, t.segment_sizes) == [True, True]
    for i in range(2):
        check_all_equal(t.segment_view(i), before[i], f"segment {i} after a fault in cleanup")
    check_readback_matches_bookkeeping(t)
    t.free()
    assert _nonzero(live_reservations) == reservations and _nonzero(live_chunks) == chunks
    check_usage_matches(usage, baseline, [])


def mapped_runs(t: ExtensibleTensor, driver) -> int:
    """Maximal runs of granules the driver shows backed by one chunk each."""
    owners = driver.chunks_at(range(t.base, t.base + t.reserved_bytes, t.granularity))
    return sum(1 for i, owner in enumerate(owners) if owner is not None and (i == 0 or owners[i - 1] != owner))


def check_broken_until_freed(t: ExtensibleTensor, faulty, error: DriverError, usage, baseline, reservations,
                             chunks, mapped_elsewhere: int = 0) -> None:
    """After an undo step failed: the error says so, every operation but free
    is refused, and free unmaps what the driver shows mapped (not what the
    bookkeeping says: cuMemUnmap takes only a whole range that is mapped)
    and gives back every mapping, chunk and reservation. `mapped_elsewhere`:
    runs a failed undo left mapped outside the reservation (a defragment's
    scratch), which free unmaps too."""
    notes = getattr(error, "__notes__", [])
    assert any(note.startswith("while undoing: ") for note in notes), notes
    assert any("is now broken" in note and "only free() is allowed" in note for note in notes), notes
    for operation in (lambda: t.resize_segments_(list(t.segment_capacities)), t.release_physical, t.full_view,
                      lambda: t.segment_view(0), t.defragment_segments_):
        with pytest.raises(StateError, match="not allowed on a broken ExtensibleTensor"):
            operation()
    runs, unmaps = mapped_runs(t, faulty), faulty.calls["unmap"]
    t.free()
    assert faulty.calls["unmap"] - unmaps == runs + mapped_elsewhere, (faulty.calls["unmap"] - unmaps, runs)
    assert t.is_freed
    assert _nonzero(live_reservations) == reservations and _nonzero(live_chunks) == chunks
    check_usage_matches(usage, baseline, [])


@pytest.mark.invariant(5)
@pytest.mark.parametrize("swap_fault, undo_fault, mapped_elsewhere", [
    (("map", 2), ("set_access", 2), 0),
    (("set_access", 2), ("map", 3), 0),
    (("set_access", 2), ("unmap", 4), 1),
])
def test_a_defragment_whose_undo_fails_breaks_the_tensor_and_free_returns_everything(
    build, device, granule, usage, swap_fault, undo_fault, mapped_elsewhere
):
    """The swap fails after the old chunks were unmapped (map #2 of the new
    chunk, or set_access #2 of it), and the undo fails: to put an old chunk
    back, by its grant of access (set_access #2: the chunk is mapped, not
    accessible) or its map (map #3: the chunk is recorded, not mapped); or
    to unmap the new chunk from the scratch reservation (unmap #4: mapped
    where nothing records it). The tensor refuses every operation but free,
    which unmaps what the driver shows, there too, and leaks nothing."""
    baseline = usage.read_outside_torch()
    reservations, chunks = _nonzero(live_reservations), _nonzero(live_chunks)
    faulty = FaultInjectingDriver(driver_for(device))
    t = fragmented_tensor(build, faulty, granule)
    expected = sorted((step, faulty.calls[step] + nth) for step, nth in (swap_fault, undo_fault))
    faulty.fail_in(*swap_fault)
    faulty.fail_in(*undo_fault)
    with pytest.raises(DriverError, match="injected fault") as raised:
        t.defragment_segment_(0)
    assert sorted(faulty.fired) == expected, faulty.fired
    check_broken_until_freed(t, faulty, raised.value, usage, baseline, reservations, chunks, mapped_elsewhere)


@pytest.mark.invariant(5)
def test_a_growth_whose_undo_fails_breaks_the_tensor_and_free_unmaps_what_the_driver_shows(build, device, granule, usage):
    """set_access #1 fails a growth's run, and the undo's unmap fails too: the
    run's chunk stays mapped where the bookkeeping records nothing. free
    reads the mapping from the driver, so it unmaps it and leaks nothing."""
    baseline = usage.read_outside_torch()
    reservations, chunks = _nonzero(live_reservations), _nonzero(live_chunks)
    faulty = FaultInjectingDriver(driver_for(device))
    t = build.tensor(4 * granule, device=faulty, segment_capacities=[2 * granule, 2 * granule])
    faulty.fail_in("set_access", 1)
    faulty.fail_in("unmap", 1)
    with pytest.raises(DriverError, match="injected fault") as raised:
        t.resize_segments_([2 * granule, 2 * granule])
    assert faulty.fired == [("set_access", 1), ("unmap", 1)], faulty.fired
    assert t.physical_bytes == 0 and faulty.chunk_at(t.base) is not None, "the undo left the run mapped, unrecorded"
    check_broken_until_freed(t, faulty, raised.value, usage, baseline, reservations, chunks)


class CountsReadBack(FaultInjectingDriver):
    """Counts the addresses whose chunk is read back from the real driver."""

    read_back = 0

    def chunks_at(self, addresses):
        addresses = list(addresses)
        self.read_back += len(addresses)
        return super().chunks_at(addresses)


@pytest.mark.invariant(5)
def test_a_broken_tensor_frees_by_reading_back_only_what_can_be_mapped(build, device, granule, usage):
    """A reservation of 2**16 granules, two of them ever mapped: a growth's
    undo fails, and free reads back the recorded chunks and the failed run,
    not every granule (1 s for 256 GiB on the host)."""
    baseline = usage.read_outside_torch()
    reservations, chunks = _nonzero(live_reservations), _nonzero(live_chunks)
    faulty = CountsReadBack(driver_for(device))
    t = build.tensor((1 << 16) * granule, device=faulty, segment_capacities=[granule, ((1 << 16) - 1) * granule])
    t.resize_segments_([granule, 0], zero_new=True)
    faulty.fail_in("set_access", 1)
    faulty.fail_in("unmap", 1)
    with pytest.raises(DriverError, match="injected fault"):
        t.resize_segments_([granule, granule])
    assert t.is_broken and faulty.chunk_at(t.base + granule) is not None, "the undo left the run mapped, unrecorded"
    before = faulty.read_back
    t.free()
    assert faulty.chunk_at(t.base) is None and faulty.chunk_at(t.base + granule) is None, "free left a mapping"
    assert _nonzero(live_reservations) == reservations and _nonzero(live_chunks) == chunks
    check_usage_matches(usage, baseline, [])
    read_back, faulty.read_back = faulty.read_back - before, before
    assert read_back <= 8, f"free read back {read_back} addresses for 2 granules ever mapped"


@pytest.mark.invariant(6)
def test_size_past_the_address_space_is_refused_before_any_call(device):
    before = _nonzero(live_reservations)
    for kwargs in (dict(size=2**64), dict(size=2**64, segment_capacities=[2**64 - 1, 1]), dict(size=1 << 60)):
        with pytest.raises(ValueError, match=r"size must be an int >= 0 and <= \d+, got"):
            ExtensibleTensor(device=device, **kwargs)
    assert _nonzero(live_reservations) == before


def _print_full_view(device: str, granule: int, printed) -> None:
    """A process of its own prints a full view, 63 of its 64 granules
    unmapped, and sends what it printed through the pipe `printed`."""
    text = io.StringIO()
    t = ExtensibleTensor(64 * granule, device=device)
    t.resize_segments_([granule], zero_new=True)
    view = t.full_view()
    print(view, repr(view), f"{view}", [view], file=text)
    t.free()
    printed.send(text.getvalue())


@pytest.mark.invariant(6)
@pytest.mark.long
def test_full_view_repr_reads_nothing(device, granule):
    """The full view spans unmapped pages; printing it must not touch them
    (it killed the process with SIGSEGV on the host)."""
    # In a child of the fork server (extkv.testing.children says why).
    context = fork_server()
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_print_full_view, args=(str(device), granule, sender), daemon=True)
    process.start()
    sender.close()
    try:
        printed = receiver.recv() if receiver.poll(300) else None
    except EOFError:  # it died before sending
        printed = None
    finally:
        process.join(300)
        if process.is_alive():
            process.kill()
            process.join()
        receiver.close()
    assert process.exitcode == 0, f"exit {process.exitcode}"
    assert printed is not None and printed.count(f"ReservationView({64 * granule} bytes at 0x") == 4, printed


def fragmented_neighbours(build, driver, granule) -> ExtensibleTensor:
    """Four segments of 2.5 granules, grown in two steps so that each spans
    two or three chunks; neighbours share a granule (capacities are not
    granule multiples), so some chunks belong to two segments."""
    capacity = 5 * granule // 2
    t = build.tensor(4 * capacity, device=driver, segment_capacities=[capacity] * 4)
    t.resize_segments_([granule // 2] * 4, zero_new=True)
    t.resize_segments_([capacity] * 4, zero_new=True)
    for i in range(4):
        view = t.segment_view(i)
        view.copy_(pattern(view.numel(), 7 * (i + 1), view.device))
    return t


@pytest.mark.invariant(1, 3, 5)
@pytest.mark.parametrize("batch_granules", [1, 3, 1000])
def test_defragment_segments_in_batches_keeps_bytes_and_addresses(build, device, granule, usage, batch_granules):
    """One scratch reservation serves every batch and is freed at the end;
    the result is the same whatever the batch size."""
    baseline = usage.read_outside_torch()
    t = fragmented_neighbours(build, driver_for(device), granule)
    reservations = _nonzero(live_reservations)
    before = [t.segment_view(i).clone() for i in range(4)]
    pointers = [t.segment_view(i).data_ptr() for i in range(4)]
    assert t.segments_backed_by_one_chunk(t.segment_sizes) == [False] * 4
    assert t.defragment_segments_(batch_bytes=batch_granules * granule) == [True] * 4
    assert readback_one_chunk_per_segment(t, t.segment_sizes) == [True] * 4
    assert [t.segment_view(i).data_ptr() for i in range(4)] == pointers
    for i in range(4):
        check_all_equal(t.segment_view(i), before[i], f"segment {i} after defragment_segments_")
    check_readback_matches_bookkeeping(t)
    check_usage_matches(usage, baseline, [t])
    assert _nonzero(live_reservations) == reservations, "the scratch reservation outlived the defragmentation"
    assert t.defragment_segments_([3, 0]) == [False, False]


class _StepLog(FaultInjectingDriver):
    """Fault injection that also logs the order of copies, waits and unmaps."""

    def __init__(self, inner):
        super().__init__(inner)
        self.log: list[str] = []

    def _copy(self, destination, source, size):
        self.log.append("copy")
        super()._copy(destination, source, size)

    def synchronize(self):
        self.log.append("synchronize")
        super().synchronize()

    def _unmap(self, address, size):
        self.log.append("unmap")
        super()._unmap(address, size)

    def _release(self, chunk):
        self.log.append("release")
        super()._release(chunk)


@pytest.mark.invariant(4)
def test_release_gives_each_chunk_back_as_soon_as_it_is_unmapped(build, device, granule):
    """The raw driver sequence's order: what a release leaves in the driver
    outlasts the allocations after it, so benchmark contenders must leave
    the same state (and memory goes back sooner than after every unmap)."""
    logged = _StepLog(driver_for(device))
    t = build.tensor(6 * granule, device=logged, segment_capacities=[3 * granule] * 2)
    for size in (granule, 2 * granule, 3 * granule):
        t.resize_segments_([size, size])
    chunks = t.num_physical_chunks
    assert chunks > 1, chunks
    logged.log.clear()
    t.release_physical()
    assert logged.log == ["synchronize"] + ["unmap", "release"] * chunks, logged.log


@pytest.mark.invariant(3)
def test_a_failure_after_a_copy_was_queued_waits_for_it_before_unmapping(build, device, granule):
    """A copy into the scratch mapping may still run on the device when a
    later step of its batch fails: the undo must wait for the device before
    it unmaps that mapping (on a GPU, unmapping under a running copy faults)."""
    logged = _StepLog(driver_for(device))
    t = fragmented_neighbours(build, logged, granule)
    before = [t.segment_view(i).clone() for i in range(4)]
    logged.fail_in("create", 2)  # the second group's chunk, after the first group's copy
    logged.log.clear()
    with pytest.raises(DriverError, match="injected fault"):
        t.defragment_segments_(batch_bytes=1000 * granule)
    first_copy = logged.log.index("copy")
    after_copy = logged.log[first_copy:]
    assert "unmap" in after_copy, logged.log
    assert "synchronize" in after_copy[: after_copy.index("unmap")], (
        f"the undo unmapped before waiting for the queued copy: {logged.log}"
    )
    check_readback_matches_bookkeeping(t)
    for i in range(4):
        check_all_equal(t.segment_view(i), before[i], f"segment {i} after a fault in the batch")


@pytest.mark.invariant(3, 5)
def test_fault_in_a_later_batch_keeps_earlier_batches_moved_and_a_retry_finishes(build, device, granule, usage):
    baseline = usage.read_outside_torch()
    faulty = FaultInjectingDriver(driver_for(device))
    t = fragmented_neighbours(build, faulty, granule)
    before = [t.segment_view(i).clone() for i in range(4)]
    # Neighbours share chunks, so the four segments form fewer groups; with
    # one group per batch, the second batch's create is the second create.
    faulty.fail_in("create", 2)
    with pytest.raises(DriverError, match="injected fault"):
        t.defragment_segments_(batch_bytes=granule)
    moved = readback_one_chunk_per_segment(t, t.segment_sizes)
    assert moved[0] and not all(moved), f"one chunk per segment after a fault in batch 2, read back: {moved}"
    check_readback_matches_bookkeeping(t)
    for i in range(4):
        check_all_equal(t.segment_view(i), before[i], f"segment {i} after a fault in a later batch")
    check_usage_matches(usage, baseline, [t])
    assert t.defragment_segments_(batch_bytes=granule) == [not one for one in moved]
    assert readback_one_chunk_per_segment(t, t.segment_sizes) == [True] * 4
    for i in range(4):
        check_all_equal(t.segment_view(i), before[i], f"segment {i} after the retry")


@pytest.mark.invariant(6)
@pytest.mark.parametrize(
    "args, kwargs, error, message",
    [
        (([4],), {}, IndexError, r"segment index must be an int >= 0 and <= 3, got 4"),
        (([0, -1],), {}, IndexError, r"segment index must be an int >= 0 and <= 3, got -1"),
        ((7,), {}, ValueError, r"indices must be a sequence of segment indices, got 7"),
        ((), {"batch_bytes": 0}, ValueError, r"batch_bytes must be an int >= 1, got 0"),
        ((), {"batch_bytes": True}, ValueError, r"batch_bytes must be an int >= 1, got True"),
    ],
)
def test_defragment_segments_refuses_bad_arguments_and_changes_nothing(build, device, granule, args, kwargs, error, message):
    t = fragmented_neighbours(build, driver_for(device), granule)
    before = snapshot(t)
    with pytest.raises(error, match=message):
        t.defragment_segments_(*args, **kwargs)
    check_unchanged(t, before)


@pytest.mark.invariant(3)
def test_mapped_chunk_at_names_the_chunk_holding_an_address(build, granule):
    t = build.tensor(4 * granule)
    t.resize_segments_([granule])
    t.resize_segments_([3 * granule])
    first, second = t.mapped_chunks
    assert t.mapped_chunk_at(t.base) is first and t.mapped_chunk_at(t.base + granule - 1) is first
    assert t.mapped_chunk_at(t.base + granule) is second and t.mapped_chunk_at(t.base + 3 * granule - 1) is second
    assert t.mapped_chunk_at(t.base + 3 * granule) is None
    assert t.mapped_chunk_at(t.base - 1) is None and t.mapped_chunk_at(t.base + 4 * granule) is None


@pytest.mark.invariant(1)
def test_driver_zero_and_copy_touch_exactly_their_range(device, driver, granule):
    """Driver.zero, Driver.zero_ranges and Driver.copy, which a commit and a
    defragmentation use in place of tensor views: each writes its ranges and
    nothing beside them (zero_ranges both outside and inside a batch)."""
    size = 2 * granule
    address = driver.reserve(size)
    chunk = driver.create(size)
    try:
        driver.map(address, chunk)
        try:
            driver.set_access(address, size)
            view = driver.view(address, size)
            view.fill_(0xA5)
            driver.zero(address + 100, granule)
            driver.copy(address + granule + 200, address + 50, 100)  # 50 poison bytes, then 50 zeros
            driver.zero_ranges([(address + granule + 1000, 10), (address + granule + 2000, 1)])
            with driver.batch():
                driver.zero_ranges([(address + size - 3, 3)])
            driver.synchronize()
            expected = torch.full((size,), 0xA5, dtype=torch.uint8)
            expected[100 : 100 + granule] = 0
            expected[granule + 200 : granule + 250] = 0xA5
            expected[granule + 250 : granule + 300] = 0
            expected[granule + 1000 : granule + 1010] = 0
            expected[granule + 2000] = 0
            expected[size - 3 :] = 0
            check_all_equal(view, expected.to(device), "bytes after zero and copy")
        finally:
            driver.unmap(address, size)
    finally:
        driver.release(chunk)
        driver.free_reservation(address, size)


@pytest.mark.invariant(1, 6)
def test_grow_blocks_grows_every_segment_by_its_stride_and_refuses_bad_counts(build, granule):
    t = build.tensor(6 * granule, segment_capacities=[4 * granule, 2 * granule], segment_strides=[granule // 2, granule // 4])
    assert t.capacity_blocks == 8
    t.grow_blocks_(3, zero_new=True)
    assert t.segment_sizes == [3 * granule // 2, 3 * granule // 4]
    before = snapshot(t)
    for count, message in ((9, r"num_blocks must be an int >= 0 and <= 8 \(a block count\), got 9"),
                           (True, r"num_blocks must be an int .*, got True"), (-1, r"got -1")):
        with pytest.raises(ValueError, match=message):
            t.grow_blocks_(count)
    with pytest.raises(ValueError, match=r"zero_new must be a bool"):
        t.grow_blocks_(4, zero_new=1)
    with pytest.raises(ValueError, match=r"would shrink segment 0"):
        t.grow_blocks_(2)
    check_unchanged(t, before)
    plain = build.tensor(granule)
    with pytest.raises(ValueError, match="grow_blocks_ needs segment_strides"):
        plain.grow_blocks_(1)


@pytest.mark.invariant(6)
@pytest.mark.parametrize("strides, message", [
    ([1], r"segment_strides has 1 entries, expected one per segment \(2\)"),
    ([1, -1], r"segment_strides\[1\] must be an int >= 0"),
    ([1, True], r"segment_strides\[1\] must be an int >= 0 \(bytes per block\), got True"),
    ([1, 10**12], r"segment_strides\[1\] = 1000000000000 exceeds segment 1's capacity"),
    (5, r"segment_strides must be a sequence of ints"),
])
def test_bad_segment_strides_are_refused_before_any_reservation(device, granule, strides, message):
    before = _nonzero(live_reservations)
    with pytest.raises(ValueError, match=message):
        ExtensibleTensor(2 * granule, device=device, segment_capacities=[granule, granule], segment_strides=strides)
    assert _nonzero(live_reservations) == before
