"""The benchmarks' yardsticks and their arithmetic.

A benchmark is only as honest as its baselines: a raw sequence that zeroed
less than extkv, or mapped less, would make extkv look slow for doing its
job. So each baseline is checked to do exactly the work it claims, over
poisoned memory (fresh chunks read zero on the host and on the H200 whether
or not anyone zeroes them): the raw sequence and one handle per granule map
what a commit needs and no more, grant access, zero exactly the new bytes,
and give everything back; the raw preserving defragment keeps every byte
and leaves one chunk per segment; the torch baselines zero, copy and keep
what they say. Then the engine: contenders interleave in rotated order, and
one that cannot run or fails is recorded with the reason. Then the report's
arithmetic: ratios (also across processes, through pivots) and verdicts.
Finally pytest-benchmark really records the rounds the engine measured,
and `extkv bench` saves them in its storage, where its compare sets two
runs side by side and its regression gate fails a run.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from extkv import vmm
from extkv.cache import ExtensibleKVCache
from extkv.benchmarking import clocks, decode, engine as bench_engine, growth_loop, measure
from extkv.benchmarking.cases import HEADLINE_READINGS, OPERATIONS, PROFILES, Case, catalogue
from extkv.benchmarking.contenders import CONTENDERS, AllocCopyStore, Contender, CopyStore, PlainStore, UpfrontStore
from extkv.benchmarking.engine import Engine
from extkv.benchmarking.geometry import GEOMETRIES
from extkv.benchmarking.measure import interleave
from extkv.benchmarking.playback import PLAYBACK_TIMER
from extkv.benchmarking.primitives import primitives_for
from extkv.benchmarking.raw import GranuleStore, MapOnlyStore, RawStore, ZeroOnlyStore
from extkv.benchmarking.result_files import BENCH_JSON, CASES_FILE
from extkv.benchmarking.results import BenchRun, CaseResult, Entry, carryover, ratio
from extkv.benchmarking.rounds import in_rounds, round_order
from extkv.benchmarking.store import Unsupported
from extkv.benchmarking.targets import (
    HALVES_MIN_ROUNDS, TARGETS, ScalingTarget, Target, evaluate, evaluate_scaling, halves,
)
from extkv.testing.children import python_c
from extkv.testing.checks import check_all_equal
from extkv.usage import open_chunk_fds
from extkv.vmm.base import READ_WRITE
from extkv.vmm.dlpack import uint8_view
from extkv.vmm.poison import PoisoningDriver

#: Every test here checks extkv's own tooling: benchmarks, reports, the command line.
pytestmark = pytest.mark.harness

KiB, MiB = 1 << 10, 1 << 20
POISON = 0xA5
MARK = 0x3C

#: name -> (bytes per block of each segment, capacity in blocks). "three" has
#: segment capacities that are no multiple of a granule.
STORE_GEOMETRIES = {
    "one-segment": ([96 * KiB], 64),
    "three-segments": ([8 * KiB, 12 * KiB, 20 * KiB], 200),
}
#: Block counts grown to, as fractions of the capacity: uneven on purpose.
GROWTH = (0.19, 0.6, 1.0)


def poisoned_store(store_class, device, geometry: str):
    """`store_class` over the device's own driver, every new chunk of it
    filled with POISON (vmm's PoisoningDriver)."""
    strides, capacity = STORE_GEOMETRIES[geometry]
    return store_class(device, strides, capacity, primitives=PoisoningDriver(vmm.driver_for(device), POISON))


def open_raw_fds() -> int:
    """Chunk memfds this process holds: the raw sequence's are the host driver's own."""
    return len(open_chunk_fds())


def granule_chunks(store: RawStore, segment: int) -> list:
    """Which chunk backs each granule of a segment's capacity, read back from
    the driver or kernel (None: unmapped)."""
    g = store.prims.granularity
    start = store.base + store.offsets[segment]
    capacity = store.strides[segment] * store.capacity_blocks
    return vmm.driver_for(store.device).chunks_at([start + i * g for i in range(-(-capacity // g))])


def check_mapped(store: RawStore, segment: int, committed: int) -> int:
    """Granules up to the committed end mapped and writable, none after;
    returns the bytes mapped."""
    g = store.prims.granularity
    mapped = -(-committed // g) * g
    owners = granule_chunks(store, segment)
    used = mapped // g
    assert all(owner is not None for owner in owners[:used]), f"segment {segment}: unmapped granules below {mapped} bytes: {owners}"
    assert all(owner is None for owner in owners[used:]), f"segment {segment}: granules mapped past {mapped} bytes: {owners}"
    start = store.base + store.offsets[segment]
    accesses = vmm.driver_for(store.device).accesses_at(range(start, start + mapped, g))
    for offset, access in zip(range(0, mapped, g), accesses):
        assert access == READ_WRITE, f"segment {segment}: {access} at +{offset}, not read/write access"
    return mapped


def check_segment(store: RawStore, segment: int, committed: int, marked: int) -> None:
    """`check_mapped`; the first `marked` bytes still hold MARK, the rest of
    the committed bytes read zero, and the mapped bytes past them still hold
    the poison."""
    mapped = check_mapped(store, segment, committed)
    view = uint8_view(store.base + store.offsets[segment], mapped, store.device)
    check_all_equal(view[:marked], MARK, f"segment {segment}: bytes committed before this commit")
    check_all_equal(view[marked:committed], 0, f"segment {segment}: bytes this commit added")
    check_all_equal(view[committed:mapped], POISON, f"segment {segment}: mapped bytes past the committed end")


@pytest.mark.parametrize("geometry", sorted(STORE_GEOMETRIES))
@pytest.mark.parametrize("store_class", [RawStore, GranuleStore], ids=["raw", "per_granule"])
def test_raw_sequences_map_grant_and_zero_exactly_the_new_bytes(device, store_class, geometry):
    fds_before = open_raw_fds()
    store = poisoned_store(store_class, device, geometry)
    store.open()
    try:
        previous = [0] * len(store.strides)
        for fraction in GROWTH:
            blocks = max(1, int(store.capacity_blocks * fraction))
            store.grow(blocks)
            store.synchronize()
            assert store.blocks == blocks
            for i, stride in enumerate(store.strides):
                check_segment(store, i, blocks * stride, previous[i])
                owners = [o for o in granule_chunks(store, i) if o is not None]
                if store_class is GranuleStore:
                    assert len(set(owners)) == len(owners), f"segment {i}: a handle backs several granules"
                else:
                    assert len(set(owners)) == len(store.chunks[i]), (
                        f"segment {i}: {len(set(owners))} chunks read back, {len(store.chunks[i])} created"
                    )
                uint8_view(store.base + store.offsets[i], blocks * stride, device).fill_(MARK)
                previous[i] = blocks * stride
            store.synchronize()
        if device.type == "cpu":
            assert open_raw_fds() - fds_before == sum(len(chunks) for chunks in store.chunks)
        store.release()
        assert all(owner is None for i in range(len(store.strides)) for owner in granule_chunks(store, i))
    finally:
        store.close()
    assert open_raw_fds() == fds_before, "the raw store left memfds open"


@pytest.mark.parametrize("geometry", sorted(STORE_GEOMETRIES))
def test_the_driver_calls_alone_map_what_the_raw_sequence_maps_and_zero_nothing(device, geometry):
    store = poisoned_store(MapOnlyStore, device, geometry)
    store.open()
    try:
        for fraction in GROWTH:
            blocks = max(1, int(store.capacity_blocks * fraction))
            store.grow(blocks)
            store.synchronize()
            for i, stride in enumerate(store.strides):
                mapped = check_mapped(store, i, blocks * stride)
                check_all_equal(uint8_view(store.base + store.offsets[i], mapped, device), POISON,
                                f"segment {i}: bytes the driver calls alone mapped")
    finally:
        store.close()


@pytest.mark.parametrize("geometry", sorted(STORE_GEOMETRIES))
def test_the_zeroing_alone_zeroes_exactly_the_new_bytes_of_memory_mapped_at_open(device, geometry):
    store = poisoned_store(ZeroOnlyStore, device, geometry)
    store.open()
    try:
        g = store.prims.granularity
        chunks_at_open = [len(chunks) for chunks in store.chunks]
        previous = [0] * len(store.strides)
        for fraction in GROWTH:
            blocks = max(1, int(store.capacity_blocks * fraction))
            store.grow(blocks)
            store.synchronize()
            for i, stride in enumerate(store.strides):
                whole = -(-store.capacity_blocks * stride // g) * g
                assert all(owner is not None for owner in granule_chunks(store, i)), f"segment {i} not mapped whole"
                view = uint8_view(store.base + store.offsets[i], whole, device)
                check_all_equal(view[:previous[i]], MARK, f"segment {i}: bytes zeroed before this growth")
                check_all_equal(view[previous[i]:blocks * stride], 0, f"segment {i}: bytes this growth added")
                check_all_equal(view[blocks * stride:], POISON, f"segment {i}: bytes past the grown end")
                view[:blocks * stride].fill_(MARK)
                previous[i] = blocks * stride
            store.synchronize()
        assert [len(chunks) for chunks in store.chunks] == chunks_at_open, "the zeroing alone created chunks"
    finally:
        store.close()


def test_the_thread_beside_the_loop_grows_to_each_count_and_its_failure_is_raised(device):
    """The thread grows its store to the last count given, in order; a
    count it could not grow to is raised by `close`, which frees the store
    all the same."""
    fds_before = open_raw_fds()
    store = poisoned_store(ZeroOnlyStore, device, "one-segment")
    store.open()
    grown, grow = [], store.grow
    store.grow = lambda blocks: (grown.append(blocks), grow(blocks))
    beside = growth_loop.Beside(store, device)
    for blocks in (8, 8, 4, 16, 32):  # smaller or equal counts ask nothing
        beside.grow(blocks)
    beside.close()
    assert grown == [8, 16, 32] and not beside.thread.is_alive(), grown
    assert open_raw_fds() == fds_before, "close left the store's chunks"

    store = poisoned_store(MapOnlyStore, device, "one-segment")
    store.open()

    def refused(blocks: int) -> None:
        raise OSError(f"no room for {blocks} blocks")

    store.grow = refused
    beside = growth_loop.Beside(store, device)
    beside.grow(8)
    with pytest.raises(RuntimeError, match="the thread beside the loop failed: OSError.'no room for 8 blocks'"):
        beside.close()
    assert open_raw_fds() == fds_before, "a failed thread's store was not freed"


def test_the_short_switch_interval_mode_grows_ahead_and_gives_the_interval_back(device, monkeypatch):
    """The mode runs commit-ahead's loop with the interval it names, and the
    process's own interval comes back after the round, also when it fails."""
    seen = []
    step = growth_loop.make_step(device)
    monkeypatch.setattr(sys, "setswitchinterval", lambda seconds, set_=sys.setswitchinterval: (seen.append(seconds),
                                                                                              set_(seconds)))
    before = sys.getswitchinterval()
    times = growth_loop.run_mode(growth_loop.SHORT_SWITCH_MODE, device, growth_loop.QUICK_SETTING, step)
    assert len(times) == growth_loop.QUICK_SETTING.steps and sys.getswitchinterval() == before
    assert seen == [growth_loop.SHORT_SWITCH_S, before], seen

    def failing() -> None:
        raise RuntimeError("the step failed")

    with pytest.raises(RuntimeError, match="the step failed"):
        growth_loop.run_mode(growth_loop.SHORT_SWITCH_MODE, device, growth_loop.QUICK_SETTING, failing)
    assert sys.getswitchinterval() == before


def test_raw_sequence_is_one_chunk_per_segment_per_commit(device):
    store = poisoned_store(RawStore, device, "three-segments")
    store.open()
    try:
        for step in range(1, 5):
            store.grow(store.capacity_blocks * step // 4)
        # Each commit that crossed into new granules made one chunk per segment.
        assert [len(chunks) for chunks in store.chunks] == [
            len({-(-store.capacity_blocks * step // 4 * stride // store.prims.granularity) for step in range(1, 5)})
            for stride in store.strides
        ]
    finally:
        store.close()


@pytest.mark.parametrize("geometry", sorted(STORE_GEOMETRIES))
def test_raw_preserving_defragment_keeps_every_byte_on_one_chunk_per_segment(device, geometry):
    store = poisoned_store(RawStore, device, geometry)
    store.open()
    try:
        for step in range(1, 9):
            store.grow(store.capacity_blocks * step // 8)
        assert any(len(chunks) > 1 for chunks in store.chunks), "growth in 8 commits should fragment a segment"
        for i, view in enumerate(store.views()):
            view.copy_(torch.arange(view.numel(), device=device).remainder(251).add(i + 1).to(torch.uint8))
        expected = [view.clone() for view in store.views()]
        store.defragment(preserve=True)
        store.synchronize()
        for i, (view, before) in enumerate(zip(store.views(), expected)):
            check_all_equal(view, before, f"segment {i} after the preserving defragment")
            owners = [o for o in granule_chunks(store, i) if o is not None]
            assert len(set(owners)) == 1 and len(store.chunks[i]) == 1, f"segment {i} is not one chunk: {owners}"
    finally:
        store.close()


def test_raw_shrink_and_recommit_map_exactly_and_read_zero(device):
    store = poisoned_store(RawStore, device, "three-segments")
    store.open()
    try:
        store.grow(store.capacity_blocks)
        for view in store.views():
            view.fill_(MARK)
        half = store.capacity_blocks // 2
        store.shrink(half)
        store.synchronize()
        for i, stride in enumerate(store.strides):
            check_segment(store, i, half * stride, 0)
        store.release()
        store.recommit()
        store.synchronize()
        assert store.blocks == half
        for i, stride in enumerate(store.strides):
            check_segment(store, i, half * stride, 0)
    finally:
        store.close()


@contextlib.contextmanager
def opened(store):
    """`store` opened for the block and closed after it."""
    store.open()
    try:
        yield store
    finally:
        store.close()


def test_torch_baselines_do_the_work_they_stand_for(device):
    strides, capacity = STORE_GEOMETRIES["three-segments"]
    total = sum(strides) * capacity
    with opened(PlainStore(device, strides, capacity)) as plain:
        plain.grow(capacity // 2)
        plain.buffer[: sum(strides) * (capacity // 2)].fill_(MARK)
        plain.grow(capacity)
        check_all_equal(plain.buffer[: sum(strides) * (capacity // 2)], MARK, "memset: bytes committed before")
        check_all_equal(plain.buffer[sum(strides) * (capacity // 2) : total], 0, "memset: new bytes")
    with opened(AllocCopyStore(device, strides, capacity)) as grown:
        grown.grow(capacity // 3)
        kept = grown.buffer.clone().fill_(MARK)
        grown.buffer.copy_(kept)
        grown.grow(capacity)
        at = 0
        for stride in strides:  # each segment: its old bytes first, then zeros
            old, new = stride * (capacity // 3), stride * capacity
            check_all_equal(grown.buffer[at : at + old], MARK, f"allocate-copy: kept bytes of stride {stride}")
            check_all_equal(grown.buffer[at + old : at + new], 0, f"allocate-copy: new bytes of stride {stride}")
            at += new
    with opened(CopyStore(device, strides, capacity)) as copied:
        copied.grow(capacity)
        copied.defragment(preserve=True)
        check_all_equal(copied.target, copied.source, "copy: target after the copy")
    with opened(UpfrontStore(device, strides, capacity)) as upfront:
        upfront.grow(capacity)
        assert upfront.buffer.numel() == total
        check_all_equal(upfront.buffer, 0, "up-front allocation")
        with pytest.raises(Unsupported, match="cannot grow"):
            upfront.grow(capacity)


class RecordingDriver(PoisoningDriver):
    """The device's own driver, with every zero and copy recorded."""

    def __init__(self, device):
        super().__init__(vmm.driver_for(device), POISON)
        self.zeros, self.copies = [], []

    def zero(self, address, size):
        self.zeros.append((address, size))
        super().zero(address, size)

    def copy(self, destination, source, size):
        self.copies.append((destination, source, size))
        super().copy(destination, source, size)


def test_torch_baselines_zero_and_copy_with_the_calls_extkv_uses(device):
    """The floors and peers zero exactly their new bytes with the device's
    memset and copy with its copy, as extkv and the raw sequence do, so a
    ratio against them measures a strategy: torch's zero_ is a fill kernel,
    27% slower than cuMemsetD8Async on the H200."""
    strides, capacity = STORE_GEOMETRIES["three-segments"]
    per_block, half = sum(strides), capacity // 2
    recorder = RecordingDriver(device)
    with opened(PlainStore(device, strides, capacity, primitives=recorder)) as plain:
        plain.grow(half)
        plain.grow(capacity)
        base = plain.buffer.data_ptr()
        assert recorder.zeros == [(base, per_block * half), (base + per_block * half, per_block * (capacity - half))]
    recorder.zeros.clear()
    with opened(AllocCopyStore(device, strides, capacity, primitives=recorder)) as grown:
        grown.grow(half)
        first = [size for _, size in recorder.zeros]
        grown.grow(capacity)
        second = [size for _, size in recorder.zeros[len(first) :]]
        assert first == [stride * half for stride in strides], first
        assert second == [stride * (capacity - half) for stride in strides], second
        base, at = grown.buffer.data_ptr(), 0
        for stride, (address, _) in zip(strides, recorder.zeros[len(first) :]):
            assert address - base == at + stride * half
            at += stride * capacity
    recorder.zeros.clear()
    with opened(UpfrontStore(device, strides, capacity, primitives=recorder)) as upfront:
        upfront.grow(capacity)
        assert recorder.zeros == [(upfront.buffer.data_ptr(), per_block * capacity)]
    with opened(CopyStore(device, strides, capacity, primitives=recorder)) as copied:
        copied.grow(half)
        copied.defragment(preserve=True)
        assert recorder.copies == [(copied.target.data_ptr(), copied.source.data_ptr(), per_block * half)]


# -- the engine ----------------------------------------------------------------------
def tiny_case(op: str, contenders: tuple[str, ...]) -> Case:
    return Case(op, "lbhnc32", 4, 4, contenders)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_round_orders_give_each_contender_every_other_as_predecessor_equally_often(n):
    """A round meets the driver state its predecessor left: over n rounds
    (2n for an odd n) each ordered pair of neighbours occurs equally often."""
    names = [f"contender{i}" for i in range(n)]
    rounds = n if n % 2 == 0 else 2 * n
    orders = [round_order(names, r) for r in range(rounds)]
    assert all(sorted(order) == sorted(names) for order in orders), orders
    neighbours = Counter(pair for order in orders for pair in zip(order, order[1:]))
    assert len(neighbours) == n * (n - 1), neighbours
    assert set(neighbours.values()) == {1 if n % 2 == 0 else 2}, neighbours


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_the_subject_and_its_yardstick_meet_the_same_predecessors_one_and_two_rounds_back(n):
    """Over two passes of the design the first two names see each other's
    predecessors equally often (the other one for itself), but for the
    rounds where the passes meet; without the trade the gap grows with
    every pass."""
    names = [f"contender{i}" for i in range(n)]
    passes = n if n % 2 == 0 else 2 * n
    stream = [name for r in range(2 * passes) for name in round_order(names, r)]
    mirrored = {names[0]: names[1], names[1]: names[0]}
    for lag in (1, 2):
        before = Counter(zip(stream[lag:], stream))
        gap = sum(abs(before[(names[0], p)] - before[(names[1], mirrored.get(p, p))]) for p in names)
        assert gap <= lag, (lag, before)


def test_contenders_interleave_in_round_order(device):
    order: list[str] = []
    names = ("extkv", "raw", "memset")
    results = interleave(
        tiny_case("commit", names), names, device, rounds=3, case_seconds=60.0, costly_rounds=3, order_log=order
    )
    assert order == ["extkv", "raw", "memset", "raw", "memset", "extkv", "memset", "extkv", "raw"]
    for name in names:
        measured = results[name]
        assert measured.status == "measured" and len(measured.wall) == len(measured.cpu) == 3, measured
        assert all(wall > 0 for wall in measured.wall), measured


@pytest.mark.parametrize("op, counted", [("commit", True), ("grow8", False)])
def test_own_cpu_comes_from_a_clocked_round_in_recycled_commits_only(device, op, counted):
    """Timed rounds run on plain drivers (timing each driver step would weigh
    on the ratios); a recycled commit adds a clocked round for the CPU time
    outside driver steps, one reading per round, for extkv and for the raw
    sequence (its yardstick) alone."""
    names = ("extkv", "raw", "memset")
    results = interleave(tiny_case(op, names), names, device, rounds=2, case_seconds=60.0, costly_rounds=2)
    for name in ("extkv", "raw"):
        own = results[name].own_cpu
        assert len(own) == (2 if counted else 0), (name, own)
        assert all(0 <= seconds for seconds in own), (name, own)
    assert results["memset"].own_cpu == []
    for name in ("extkv", "raw"):
        store = CONTENDERS[name].make(device, GEOMETRIES["lbhnc32"], 4)
        assert store.driver_cpu_seconds() is None, f"an unclocked {name} store must not claim to count driver time"


def one_segment_commit(blocks: int) -> Case:
    return Case("commit", "blhnc1", blocks, blocks, ("extkv", "raw", "memset"))


def test_readings_with_evicted_caches_interleave_both_sizes_in_equal_numbers(device):
    """Round r runs every (size, contender) pair once, in row r of the
    Williams design over the pairs, so each size meets the machine the
    other left as often as the other way round."""
    small, large = one_segment_commit(2), one_segment_commit(8)
    order: list[tuple[str, str]] = []
    readings = measure.interleave_evicted(
        (small, large), ("extkv", "raw"), device, rounds=4, case_seconds=600.0, order_log=order
    )
    pairs = [(case.id, name) for case in (small, large) for name in ("extkv", "raw")]
    assert order == [pair for r in range(4) for pair in round_order(pairs, r)], order
    for pair in pairs:
        assert isinstance(readings[pair], list) and len(readings[pair]) == 4, (pair, readings[pair])
        assert all(seconds > 0 for seconds in readings[pair]), (pair, readings[pair])


class _FailingClockedStore(clocks.ClockedRawStore):
    def grow(self, blocks: int) -> None:
        raise RuntimeError("planted failure")


def test_a_pair_that_fails_with_evicted_caches_keeps_its_error_and_leaves_the_rotation(monkeypatch):
    monkeypatch.setitem(CONTENDERS, "broken_baseline", Contender("broken_baseline", "baseline", _FailingClockedStore))
    small, large = one_segment_commit(2), one_segment_commit(4)
    order: list[tuple[str, str]] = []
    readings = measure.interleave_evicted(
        (small, large), ("raw", "broken_baseline"), torch.device("cpu"), rounds=2, case_seconds=600.0, order_log=order
    )
    for case in (small, large):
        error = readings[(case.id, "broken_baseline")]
        assert isinstance(error, RuntimeError) and "planted failure" in str(error), error
        assert len(readings[(case.id, "raw")]) == 2, readings
    assert order.count((small.id, "broken_baseline")) == 1, order


def test_the_engine_reads_both_ends_of_the_byte_series_in_one_interleaved_pass(tmp_path, monkeypatch):
    passes: list[tuple[str, ...]] = []
    real_pass = measure.interleave_evicted

    def counted_pass(cases, *args, **kwargs):
        passes.append(tuple(case.id for case in cases))
        return real_pass(cases, *args, **kwargs)

    monkeypatch.setattr(bench_engine, "interleave_evicted", counted_pass)
    profile = PROFILES["quick"]
    engine = Engine(profile, "cpu", tmp_path, rounds=2, warm=False, log=lambda line: None)
    ends = [case for case in engine.cases if profile.is_bytes_flatness_end(case)]
    assert sorted(case.bytes for case in ends) == [min(profile.byte_series), max(profile.byte_series)], ends
    for case in ends:
        results = engine.measure(case)
        counts = {name: len(results[name].own_cpu_evicted) for name in ("extkv", "raw", "memset")}
        assert counts["memset"] == 0 and counts["extkv"] == counts["raw"] >= 1, (case.id, counts)
    assert passes == [tuple(case.id for case in ends)], passes
    between = next(case for case in engine.cases
                   if case.op == "commit" and case.geometry == "lbhnc32" and case.state == "recycled")
    assert all(m.own_cpu_evicted == [] for m in engine.measure(between).values())


def test_a_step_clock_counts_its_eviction_as_driver_time_not_extkv_time(device):
    """The eviction runs inside each step's time: what it costs must not
    appear as extkv's own CPU time."""
    burn = 0.01

    def evict() -> None:
        start = time.thread_time()
        while time.thread_time() - start < burn:
            pass

    clock = clocks.DriverClock(vmm.driver_for(device))
    clock.evict = evict
    geometry = GEOMETRIES["blhnc1"]
    cache = ExtensibleKVCache(geometry.config(4), clock, geometry.layout)
    gc.disable()  # a full collection (80 ms with torch loaded) would read as extkv's own CPU
    try:
        steps_before, cpu_before = clock.cpu_seconds, time.thread_time()
        cache.commit(4)
        cpu, driver = time.thread_time() - cpu_before, clock.cpu_seconds - steps_before
    finally:
        gc.enable()
        cache.free()
    # A commit takes at least a create, a map, an access grant and a zero.
    assert driver >= 4 * burn, (driver, burn)
    assert cpu - driver < burn, f"own CPU {cpu - driver:.4f} s holds an eviction's {burn} s"


def test_caches_are_evicted_in_the_operations_steps_only(device, monkeypatch):
    """Setup and teardown (reserve, unmap, release, free) are no part of the
    reading: evicting there would only cost time."""
    evictions = []
    monkeypatch.setattr(measure, "cache_evictor", lambda: lambda: evictions.append(1))
    case = Case("commit", "blhnc1", 4, 4, ("extkv", "raw"))
    for name in ("extkv", "raw"):
        evictions.clear()
        measure.time_round(case, CONTENDERS[name], device, clocked=True, evict_caches=True)
        # One run: (batch,) create, map, access grant, zero.
        assert 4 <= len(evictions) <= 6, (name, len(evictions))
    with pytest.raises(ValueError, match="evicting caches needs a clocked store, got PlainStore"):
        measure.time_round(Case("commit", "blhnc1", 4, 4, ("memset",)), CONTENDERS["memset"], device,
                                evict_caches=True)


def test_a_clocked_round_runs_pinned_to_one_cpu_and_lets_go_after():
    allowed = os.sched_getaffinity(0)
    with clocks.pinned_to_this_cpu():
        pinned = os.sched_getaffinity(0)
    assert len(pinned) == 1 and pinned <= allowed, (pinned, allowed)
    assert os.sched_getaffinity(0) == allowed


def test_the_cache_evictor_writes_twice_the_largest_cache_sysfs_states(tmp_path):
    for index, size in enumerate(["48K", "2048K", "307200K"]):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    assert clocks.largest_cpu_cache_bytes(tmp_path) == 300 * MiB
    assert clocks.largest_cpu_cache_bytes(tmp_path / "absent") == clocks.CacheEvictor.FALLBACK_CACHE_BYTES
    evictor = clocks.CacheEvictor(cache_bytes=1 * MiB)
    evictor()
    first = evictor._buffer.raw
    evictor()
    second = evictor._buffer.raw
    assert evictor.size == len(first) == len(second) == 2 * MiB
    assert first.count(first[0]) == second.count(second[0]) == 2 * MiB
    assert first[0] != second[0], "each eviction writes a new value over the whole buffer"


def _held(usage) -> tuple[dict, dict, int]:
    """Reservations and chunks live per driver kind, and the witness's bytes.
    A kind first counted in this process appears with 0: the same as absent."""
    live = lambda counts: {kind: n for kind, n in counts.items() if n}  # noqa: E731
    return live(vmm.live_reservations), live(vmm.live_chunks), usage.read_outside_torch()


def test_the_partial_map_probe_answers_from_the_driver(device, usage):
    """On Linux, mmap maps any part of a memfd; the H200's driver (580,
    CUDA 13.0) answers CUDA_ERROR_NOT_SUPPORTED for part of a chunk. Either
    way the probe names the driver's answer and leaves nothing behind: no
    reservation, no chunk, no byte the witness sees."""
    primitives = primitives_for(device)
    before = _held(usage)
    supported, how = primitives.probe_partial_map()
    assert isinstance(supported, bool) and how, (supported, how)
    if device.type == "cpu":
        assert supported and "mapped" in how, how
    else:
        assert "CUDA_" in how, f"the probe's answer names no CUDA result: {how}"
    assert _held(usage) == before, (before, _held(usage))


def test_the_partial_access_probe_answers_from_the_driver(device, usage):
    """On Linux, mprotect changes any page-aligned part of a mapping; the
    H200's driver answers CUDA_ERROR_INVALID_VALUE for part of a chunk
    mapped whole. Either way the probe leaves nothing mapped or created."""
    primitives = primitives_for(device)
    fds_before = open_raw_fds() if device.type == "cpu" else None
    before = _held(usage)
    supported, how = primitives.probe_partial_access()
    assert isinstance(supported, bool) and how, (supported, how)
    if device.type == "cpu":
        assert supported and how.endswith("granted"), how
        assert open_raw_fds() == fds_before, "the probe's memfd is still open"
    else:
        assert "CUDA_" in how, f"the probe's answer names no CUDA result: {how}"
    assert _held(usage) == before, (before, _held(usage))


def test_headline_readings_take_the_profiles_headline_rounds_unless_rounds_are_given(tmp_path):
    """The headline 8-step growths take more rounds again, and so does every
    case of at most 1 GiB: their least round moves with the rounds drawn."""
    profile = PROFILES["gpu"]
    headline = [case for case in catalogue(profile) if profile.is_headline_reading(case)]
    per_block = GEOMETRIES["mla61"].bytes_per_block
    mla_bytes = profile.headline_bytes // per_block * per_block
    assert sorted((case.op, case.geometry, case.bytes) for case in headline) == sorted(
        {(op, geometry, profile.headline_bytes) for op in ("commit", "grow8", "recommit", "defrag_preserve")
         for geometry in ("blhnc1", "lbhnc32", "lhbnc256")}
        | {(op, "blhnc1", size) for op in ("commit", "grow8") for size in profile.byte_series}
        | {("commit", "lhbnc1024", profile.headline_bytes)}
        | {(op, "mla61", mla_bytes) for op in ("commit", "recommit")}
    )
    assert all(case.state == "recycled" for case in headline), headline
    other = next(case for case in catalogue(profile) if case.op == "release" and case.bytes == 4 << 30)
    small = [case for case in catalogue(profile) if case.bytes <= 1 << 30]
    assert {(case.op, case.bytes) for case in small} == {
        (op, size) for op in ("commit", "grow8", "release") for size in (64 * MiB, 256 * MiB, 1 << 30)
    }
    engine = Engine(profile, "cpu", tmp_path, warm=False, log=lambda line: None)
    growth = [case for case in headline if case.op == "grow8"]
    assert engine.rounds_for(headline[0]) == (profile.headline_rounds, profile.headline_case_seconds) == (21, 20.0)
    assert {engine.rounds_for(case) for case in growth} == {(61, 45.0)}, growth
    assert engine.rounds_for(other) == (profile.rounds, profile.case_seconds)
    # Small commits are headline readings too: their seconds, the small cases' rounds.
    assert {engine.rounds_for(case) for case in small} == {(61, profile.case_seconds), (61, 20.0), (61, 45.0)}
    assert engine.rounds_for(next(case for case in small if case.op == "commit")) == (61, 20.0)
    given = Engine(profile, "cpu", tmp_path, rounds=3, warm=False, log=lambda line: None)
    assert {given.rounds_for(case) for case in [headline[0], growth[0], other, *small]} == {(3, profile.case_seconds)}


def test_the_run_records_whether_its_rounds_were_capped(tmp_path):
    """`--rounds N` drops the profile's rounds for every case alike, so the
    run's facts say so, for the report to judge nothing (extkv.benchmarking.report.not_a_verdict)."""
    for rounds, given in ((None, False), (3, True)):
        engine = Engine(PROFILES["quick"], "cpu", tmp_path / str(rounds), rounds=rounds, warm=False,
                        log=lambda line: None)
        facts = json.loads(engine.finish().read_text())
        assert (facts["rounds"], facts["rounds_given"]) == (rounds or PROFILES["quick"].rounds, given), facts


def test_costly_peers_stop_at_their_round_cap():
    names = ("extkv", "per_granule", "allocate_copy")
    results = interleave(tiny_case("grow8", names), names, torch.device("cpu"), rounds=3, case_seconds=60.0, costly_rounds=1)
    assert [len(results[name].wall) for name in names] == [3, 1, 1]


def test_a_costly_peers_rounds_use_none_of_its_cases_seconds():
    """Where a peer's round takes longer than a case's seconds, charging it
    would leave the others one round; uncharged, they get the rounds their
    own time allows. Times come from a clock the test advances."""
    takes = {"extkv": 1.0, "raw": 1.0, "allocate_copy": 50.0}
    caps = {"extkv": 9, "raw": 9, "allocate_copy": 2}

    def run(charged) -> Counter:
        now, ran = [0.0], Counter()
        rounds = in_rounds(
            list(takes), lambda name: ran[name] < caps[name], rounds=9, case_seconds=8.0, charged=charged,
            clock=lambda: now[0],
        )
        for name in rounds:
            ran[name] += 1
            now[0] += takes[name]
        return ran

    assert run(lambda name: True) == {"extkv": 1, "raw": 1, "allocate_copy": 1}
    assert run(lambda name: name != "allocate_copy") == {"extkv": 5, "raw": 5, "allocate_copy": 2}


class _FailingStore(RawStore):
    def grow(self, blocks: int) -> None:
        raise RuntimeError("planted failure")


def test_contenders_that_cannot_run_or_fail_are_recorded_with_the_reason(monkeypatch):
    monkeypatch.setitem(CONTENDERS, "broken_peer", Contender("broken_peer", "peer", _FailingStore))
    monkeypatch.setitem(CONTENDERS, "broken_baseline", Contender("broken_baseline", "baseline", _FailingStore))
    names = ("extkv", "broken_peer", "broken_baseline", "expandable", "tms")
    results = interleave(tiny_case("commit", names), names, torch.device("cpu"), rounds=2, case_seconds=60.0, costly_rounds=2)
    assert results["extkv"].status == "measured"
    assert (results["broken_peer"].status, results["broken_baseline"].status) == ("not run", "failed")
    assert "planted failure" in results["broken_peer"].reason and "planted failure" in results["broken_baseline"].reason
    for name in ("expandable", "tms"):
        assert results[name].status == "not run" and "no GPU here" in results[name].reason, results[name]
        assert results[name].wall == []


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_every_profile_lays_out_a_runnable_catalogue(profile):
    cases = catalogue(PROFILES[profile])
    assert len({case.id for case in cases}) == len(cases)
    assert cases[0].state == "fresh", "fresh headline commits come first"
    for case in cases:
        assert set(case.contenders) <= set(CONTENDERS), case
        assert case.blocks >= 1 and case.capacity_blocks >= case.blocks, case
        if any(CONTENDERS[name].process != "main" for name in case.contenders):
            assert OPERATIONS[case.op].pivot in case.contenders, case


# -- the report's arithmetic ----------------------------------------------------------------
def result(op: str, entries: dict[str, Entry], *, segment_bytes: int = 1 << 30, **facts) -> CaseResult:
    return CaseResult(
        {"case": f"{op}-x", "op": op, "pivot": OPERATIONS[op].pivot, "contenders": list(entries),
         "smallest_segment_bytes": segment_bytes, "geometry": "blhnc1", "state": "recycled", "segments": 1,
         "bytes": 1 << 30, "order": [], **facts},
        entries,
    )


def entry(name: str, wall: list[float], process: str = "main", pivot: list[float] | None = None, cpu=None) -> Entry:
    return Entry(name, process, wall, cpu or wall, {"contender": "memset", "wall": pivot, "cpu": pivot} if pivot else None)


def test_ratios_use_minima_and_medians_within_a_process():
    case = result("commit", {"extkv": entry("extkv", [3.0, 1.2, 1.5]), "raw": entry("raw", [1.0, 2.0, 1.1])})
    assert ratio(case, "extkv", "raw", "min") == pytest.approx(1.2)
    assert ratio(case, "extkv", "raw", "median") == pytest.approx(1.5 / 1.1)


def test_ratios_across_processes_go_through_each_process_pivot():
    case = result(
        "commit",
        {
            "extkv": entry("extkv", [2.0]),
            "memset": entry("memset", [1.0]),
            # The other process's memset ran at half speed: its peer's 8.0 is 4.0 here.
            "expandable": entry("expandable", [8.0], process="expandable", pivot=[2.0]),
        },
    )
    assert ratio(case, "extkv", "expandable", "min") == pytest.approx(0.5)
    without_pivot = result("commit", {"extkv": entry("extkv", [2.0]), "expandable": entry("expandable", [8.0], process="expandable")})
    assert ratio(without_pivot, "extkv", "expandable", "min") is None


@pytest.mark.parametrize(
    ("target", "value", "met", "words"),
    [
        (Target("t", "t", "", frozenset(), "raw", 1.05), 1.02, True, "met: 1.02x"),
        (Target("t", "t", "", frozenset(), "raw", 1.05), 1.42, False, "missed by 35%: 1.42x"),
        # Two decimals would print the bound itself, met or missed.
        (Target("t", "t", "", frozenset(), "raw", 1.05), 1.0524, False, "missed by 0.2%: 1.052x"),
        (Target("t", "t", "", frozenset(), "raw", 1.05), 1.0486, True, "met: 1.049x"),
        (Target("t", "t", "", frozenset(), "g", 1 / 20, speedup=True), 1 / 40, True, "met: 40.0x faster"),
        (Target("t", "t", "", frozenset(), "g", 1 / 20, speedup=True), 1 / 12, False, "missed: 12.0x faster, 40% short of 20x"),
        (Target("t", "t", "", frozenset(), "b", 1.05, two_sided=True), 0.97, True, "met: 0.970x"),
        (Target("t", "t", "", frozenset(), "b", 1.05, two_sided=True), 0.92, False, "missed: 0.920x, 3.0 points outside +-5%"),
    ],
)
def test_verdicts_say_met_or_by_how_much_missed(target, value, met, words):
    assert target.verdict(value) == (met, words)


def test_targets_apply_only_where_stated():
    by_key = {target.key: target for target in TARGETS}
    small = result("commit", {"extkv": entry("extkv", [1.0]), "memset": entry("memset", [1.0])}, segment_bytes=128 * MiB)
    large = result("commit", {"extkv": entry("extkv", [1.0]), "memset": entry("memset", [1.0])}, segment_bytes=512 * MiB)
    assert not by_key["commit-memset"].applies(small.facts) and by_key["commit-memset"].applies(large.facts)
    run = BenchRun({}, [
        result("release", {"extkv": entry("extkv", [1.3]), "raw": entry("raw", [1.0]), "tms": entry("tms", [9.0])}),
    ])
    rows = {row.target.key: row for row in evaluate(run)}
    assert set(rows) == {"release-raw", "release-tms"}
    assert rows["release-raw"].met is False and rows["release-raw"].ratio_min == pytest.approx(1.3)
    assert rows["release-tms"].met is True


def test_scaling_readings_compare_extkv_cpu_time_and_python_work_at_the_ends_of_a_series():
    def commit(geometry, size, cpu, instructions):
        extkv = entry("extkv", [1.0], cpu=cpu)
        extkv.python_instructions = instructions
        raw = entry("raw", [1.0])
        raw.own_cpu, raw.python_instructions = [c / 4 for c in cpu], 100
        return result("commit", {"extkv": extkv, "raw": raw}, geometry=geometry, bytes=size, case=f"{geometry}-{size}")

    run = BenchRun({}, [commit("blhnc1", 64 * MiB, [0.010, 0.020], 1000), commit("blhnc1", 64 << 30, [0.0105], 1000),
                        commit("lhbnc256", 32 << 30, [0.02], 20_000), commit("lhbnc1024", 32 << 30, [0.1], 80_000)])
    rows = {row.target.key: row for row in evaluate_scaling(run)}
    assert rows["cpu-flat-in-bytes"].value == pytest.approx(1.05) and rows["cpu-flat-in-bytes"].met
    assert rows["cpu-linear-in-segments"].value == pytest.approx(5.0) and rows["cpu-linear-in-segments"].met is False
    assert "the raw sequence's over the same cases: 5.00x" in rows["cpu-linear-in-segments"].words
    assert rows["work-flat-in-bytes"].value == pytest.approx(1.0) and rows["work-flat-in-bytes"].met
    assert rows["work-linear-in-segments"].value == pytest.approx(4.0) and rows["work-linear-in-segments"].met
    assert "(20,000 -> 80,000)" in rows["work-linear-in-segments"].words
    assert "the raw sequence's over the same cases: 1.00x" in rows["work-linear-in-segments"].words
    assert isinstance(rows["cpu-linear-in-segments"].target, ScalingTarget)


def test_flatness_with_evicted_caches_reads_the_evicted_rounds_alone():
    def commit(size, own, evicted):
        extkv = entry("extkv", [1.0])
        extkv.own_cpu, extkv.own_cpu_evicted = own, evicted
        raw = entry("raw", [1.0])
        raw.own_cpu, raw.own_cpu_evicted = [o / 4 for o in own], [e / 4 for e in evicted]
        return result("commit", {"extkv": extkv, "raw": raw}, bytes=size, case=f"blhnc1-{size}")

    run = BenchRun({}, [commit(64 * MiB, [0.010], [0.030, 0.031]), commit(64 << 30, [0.030], [0.0315])])
    rows = {row.target.key: row for row in evaluate_scaling(run)}
    assert rows["cpu-flat-in-bytes"].value == pytest.approx(3.0) and rows["cpu-flat-in-bytes"].met is False
    evicted = rows["cpu-flat-in-bytes-evicted"]
    assert evicted.value == pytest.approx(1.05) and evicted.met, evicted
    assert "the raw sequence's over the same cases: 1.05x" in evicted.words
    without = BenchRun({}, [commit(64 * MiB, [0.010], []), commit(64 << 30, [0.030], [])])
    row = {row.target.key: row for row in evaluate_scaling(without)}["cpu-flat-in-bytes-evicted"]
    assert row.value is None and row.words == "not measured (the run did not count this reading)"


WHOLE_CHUNKS = ("this driver maps a chunk only whole (probe answer), so each segment's new range in each commit takes "
                "a create, a map and an access grant of its own")
WHOLE_GRANTS = ("; it grants access only over a whole chunk (access answer), so the device zeroes no byte of a chunk "
                "before all of it is created, mapped and granted")


@pytest.mark.parametrize("raw_time, supported, access, words", [
    (1.3, False, None, "; the raw sequence alone: 1.30x, with the fewest driver calls the geometry allows: "
                       + WHOLE_CHUNKS),
    (1.3, False, False, "; the raw sequence alone: 1.30x, with the fewest driver calls the geometry allows: "
                        + WHOLE_CHUNKS + WHOLE_GRANTS),
    (1.3, False, True, "; the raw sequence alone: 1.30x, with the fewest driver calls the geometry allows: "
                       + WHOLE_CHUNKS),
    (1.3, True, False, "; the raw sequence alone: 1.30x"),
    (1.1, False, False, "; the raw sequence alone: 1.10x, which meets it"),
])
def test_a_missed_target_says_what_the_raw_sequence_alone_costs(raw_time, supported, access, words):
    case = result("grow8", {"extkv": entry("extkv", [2.0]), "raw": entry("raw", [raw_time]),
                            "memset": entry("memset", [1.0])}, segment_bytes=1 << 30)
    facts = {"partial_map": {"supported": supported, "how": "probe answer"}}
    if access is not None:
        facts["partial_access"] = {"supported": access, "how": "access answer"}
    run = BenchRun(facts, [case])
    row = {row.target.key: row for row in evaluate(run)}["commit-memset"]
    assert row.met is False and row.ratio_min == pytest.approx(2.0)
    assert row.words.startswith("missed by 74%: 2.00x" + words), row.words
    assert ("grants access only" in row.words) == (WHOLE_GRANTS in words), row.words
    assert row.raw_alone == pytest.approx(raw_time)
    raw_row = {row.target.key: row for row in evaluate(run)}["commit-raw"]
    assert raw_row.raw_alone is None, "against the raw sequence itself there is no raw-alone reading"


def test_a_verdict_whose_halves_disagree_says_so():
    # Raw's fast rounds (0.8) fall in the odd half, one in each of the earlier
    # and later halves: the even rounds alone meet the bound.
    case = result("grow8", {"extkv": entry("extkv", [1.00, 1.01, 1.02, 1.00, 1.03, 1.01]),
                            "raw": entry("raw", [1.00, 0.80, 1.00, 0.80, 1.00, 1.02])})
    row = {row.target.key: row for row in evaluate(BenchRun({}, [case]))}["commit-raw"]
    assert row.met is False and row.ratio_min == pytest.approx(1.25)
    assert row.split == (pytest.approx(1.0), pytest.approx(1.25)), row.split
    assert row.words == "missed by 19%: 1.25x; the halves disagree: even rounds 1.00x, odd rounds 1.25x"
    assert halves(case, "extkv", "raw") == row.split


def test_a_verdict_resting_on_rounds_in_a_row_says_so(tmp_path):
    # Raw's two fast rounds come in a row, one in each of the even and odd
    # halves, which both miss; the later half of the rounds alone meets the bound.
    walls = {"extkv": [1.00, 1.01, 1.02, 1.00, 1.03, 1.01], "raw": [1.00, 0.80, 0.80, 1.01, 1.00, 1.02]}
    case = result("grow8", {name: entry(name, wall) for name, wall in walls.items()})
    row = {row.target.key: row for row in evaluate(BenchRun({}, [case]))}["commit-raw"]
    assert row.met is False and row.split is None, row
    assert row.split_in_time == (pytest.approx(1.25), pytest.approx(1.0)), row.split_in_time
    assert row.words == "missed by 19%: 1.25x; the earlier and later rounds disagree: rounds 1-3 1.25x, rounds 4-6 1.00x"
    assert halves(case, "extkv", "raw", in_time=True) == row.split_in_time
    section = one_case_section(tmp_path, ["extkv", "raw"] * 6, walls)
    assert "| 1.25x (MISSED; earlier / later 1.25x / 1.00x) |" in section, section
    assert "- *earlier / later*: " in section and "- *halves*" not in section, section


@pytest.mark.parametrize("extkv, raw, process", [
    ([1.2] * 6, [1.0] * 6, "main"),  # both halves miss: a difference every round repeats
    ([1.2] * 5, [1.0] * 5, "main"),  # too few rounds to split
    ([1.0, 1.2] * 3, [1.0] * 6, "expandable"),  # another process: compared through pivots, not split
])
def test_a_verdict_both_halves_agree_on_or_that_cannot_be_split_names_no_halves(extkv, raw, process):
    case = result("grow8", {"extkv": entry("extkv", extkv), "memset": entry("memset", [1.0] * len(extkv)),
                            "raw": entry("raw", raw, process=process, pivot=[1.0])})
    rows = [row for row in evaluate(BenchRun({}, [case])) if row.target.key == "commit-raw"]
    assert len(rows) == 1 and rows[0].ratio_min == pytest.approx(min(extkv) / min(raw)), rows
    assert rows[0].split is None and rows[0].split_in_time is None and "disagree" not in rows[0].words, rows[0]
    expected = None if len(extkv) < HALVES_MIN_ROUNDS or process != "main" else (1.2, 1.2)
    assert halves(case, "extkv", "raw") == (pytest.approx(expected) if expected else None)


def test_rounds_are_read_by_whose_round_ran_before_them():
    order = ["extkv", "raw", "memset", "raw", "memset", "extkv", "memset", "extkv", "raw", "extkv"]
    # extkv's last round failed: it is in the order, with no time.
    case = result("grow8", {"extkv": entry("extkv", [1.0, 2.0, 3.0]), "raw": entry("raw", [4.0, 5.0, 6.0]),
                            "memset": entry("memset", [7.0, 8.0, 9.0])}, order=order)
    assert carryover(case, 1) == {
        "raw": {"extkv": [4.0, 6.0], "memset": [5.0]},
        "memset": {"raw": [7.0, 8.0], "extkv": [9.0]},
        "extkv": {"memset": [2.0, 3.0]},
    }
    assert carryover(case, 2)["raw"] == {"raw": [5.0], "memset": [6.0]}
    assert carryover(result("grow8", {"extkv": entry("extkv", [1.0])}), 1) == {}, "a run that recorded no order"


def write_one_case_run(run_dir: Path, order, walls, instructions=None, **facts_extra) -> Path:
    """A run directory holding one 1 GiB 8-step growth whose contenders'
    rounds took `walls`, in `order`, as the engine and pytest-benchmark
    write it; `instructions`: contender -> bytecode count of its operation."""
    case_facts = {"case": "grow8-blhnc1-1GiB-recycled", "op": "grow8", "op_what": "growth", "pivot": "memset",
                  "contenders": ["extkv", "raw"], "geometry": "blhnc1", "geometry_what": "g", "segments": 1,
                  "blocks": 8, "capacity_blocks": 8, "bytes": 1 << 30, "smallest_segment_bytes": 1 << 30,
                  "commits": 8, "replays": 0, "state": "recycled", "order": order,
                  "results": {name: {"status": "measured", "reason": ""} for name in walls}}
    facts = {"profile": "gpu", "profile_what": "w", "device": "cuda:0", "device_description": {}, "host": "h",
             "torch": "t", "granularity": 2 * MiB, "rounds": 9, "case_seconds": 8.0, "costly_rounds": 2,
             "elapsed_seconds": 1.0, "budget_seconds": 2.0, "clocks": ["c"], "cpu_time": "thread_time",
             "cases": [case_facts], **facts_extra}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / CASES_FILE).write_text(json.dumps(facts))
    benchmarks = [{"name": f"test_bench[{case_facts['case']}-{name}]",
                   "extra_info": {"case": case_facts["case"], "contender": name, "process": "main", "cpu": wall,
                                  "python_instructions": (instructions or {}).get(name)},
                   "stats": {"data": wall}} for name, wall in walls.items()]
    (run_dir / BENCH_JSON).write_text(json.dumps({"benchmarks": benchmarks}))
    return run_dir


def one_case_section(tmp_path, order, walls, **facts_extra) -> str:
    """The bench section rendered from a run of `write_one_case_run`."""
    from extkv.benchmarking.report import bench_section

    return bench_section(write_one_case_run(tmp_path, order, walls, **facts_extra))


def test_a_missed_commit_raw_target_is_shown_by_what_ran_before(tmp_path):
    section = one_case_section(tmp_path, ["extkv", "raw", "raw", "extkv"],
                               {"extkv": [0.002, 0.003], "raw": [0.001, 0.004]})
    assert ("| commit against the raw driver sequence | grow8 blhnc1 (1 seg) 1GiB recycled | 2 ms / 2.5 ms | "
            "raw 1 ms / 2.5 ms | 2 | 2.00x |") in section, (
        "each target row says how many rounds its minima come from")
    assert "### What ran before each missed commit against the raw driver sequence" in section, section
    assert "| extkv | 1 | - | 3 ms (1) |" in section and "| raw | 1 | 1 ms (1) | 4 ms (1) |" in section, section
    assert "| raw | 2 | 4 ms (1) | - |" in section, section


def test_the_report_says_what_each_contender_that_ran_is_in_its_runs_words(tmp_path):
    """A floor's words, as its run recorded them, say how it was measured."""
    contenders = {name: {"role": "r", "what": f"{name}, as recorded", "process": "main"}
                  for name in ("extkv", "raw", "memset")}
    section = one_case_section(tmp_path, ["extkv", "raw", "raw", "extkv"],
                               {"extkv": [0.002, 0.003], "raw": [0.001, 0.004]}, contenders=contenders)
    assert "- Contenders:\n  - *extkv*: extkv, as recorded\n  - *raw*: raw, as recorded\n" in section, section
    assert "memset, as recorded" not in section, "memset did not run in this case"


@pytest.mark.parametrize("record, partial", [
    ({"exit_status": 2, "interrupted": "SIGINT"}, "INTERRUPTED by SIGINT"),
    ({"exit_status": 3}, "pytest ended with exit status 3"),
    ({"exit_status": 1}, None),
    (None, None),
], ids=["interrupted", "pytest-error", "a-test-failed", "no-run-file"])
def test_a_run_that_did_not_end_on_its_own_is_headed_as_partial(tmp_path, record, partial):
    """What was measured is shown, but under headings that say partial and
    a line before any figure; a run that finished (a failed test included)
    or recorded no bench-run.json reads as complete."""
    from extkv.benchmarking.report import bench_section
    from extkv.benchmarking.result_files import RUN_FILE

    write_one_case_run(tmp_path, ["extkv", "raw"], {"extkv": [0.002], "raw": [0.001]})
    if record is not None:
        (tmp_path / RUN_FILE).write_text(json.dumps(record))
    section = bench_section(tmp_path)
    assert "| grow8 blhnc1 (1 seg) 1GiB recycled | extkv | 2 ms / 2 ms |" in section, "what was measured is shown"
    if partial is None:
        assert section.startswith("## Benchmarks\n\n### ") and "partial" not in section, section
        return
    assert section.startswith(
        f"## Benchmarks ({partial}: partial results)\n\n**{partial} before every case was measured: partial results, "
        "not a complete run.** Cases with a contender measured: 1 of 1;"), section
    for heading in ("### Targets (partial: ", "### Scaling (partial)", "### Every case (partial)"):
        assert heading in section, heading


def test_a_run_interrupted_before_the_engine_wrote_its_cases_says_nothing_was_measured(tmp_path):
    from extkv.benchmarking.report import bench_section
    from extkv.benchmarking.result_files import RUN_FILE

    (tmp_path / RUN_FILE).write_text(json.dumps({"exit_status": -9, "interrupted": "SIGTERM"}))
    assert bench_section(tmp_path) == ("## Benchmarks (INTERRUPTED by SIGTERM: partial results)\n\n**INTERRUPTED by "
                                       "SIGTERM before any case's results were written: nothing measured.**\n")


def test_a_scaling_reading_the_run_did_not_count_says_so():
    run = BenchRun({}, [result("commit", {"extkv": entry("extkv", [1.0])}, geometry=g, bytes=b, case=f"{g}-{b}")
                        for g, b in (("blhnc1", 64 * MiB), ("blhnc1", 64 << 30))])
    row = {row.target.key: row for row in evaluate_scaling(run)}["work-flat-in-bytes"]
    assert row.value is None and row.met is None and row.words == "not measured (the run did not count this reading)"


# -- pytest-benchmark records what the engine measured ----------------------------------------------
RECORDING_TEST = """
from extkv.benchmarking.cases import Case
from extkv.benchmarking.measure import Measurement
from extkv.benchmarking.playback import record

def test_recorded(benchmark):
    record(benchmark, Case("commit", "blhnc1", 2, 2, ("extkv",)), Measurement("extkv", "main", wall=[0.5, 0.25, 0.125], cpu=[0.1, 0.1, 0.1]))
"""


def run_pytest_benchmark(tmp_path: Path, *options: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_recorded.py").write_text(textwrap.dedent(RECORDING_TEST))
    # Run from an xdist worker (extkv check on several GPUs), the child must
    # not count as distributed: pytest-benchmark disables itself there.
    environment = {name: value for name, value in os.environ.items() if not name.startswith("PYTEST_XDIST")}
    arguments = ["-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-c", os.devnull, "--rootdir", str(tmp_path),
                 str(tmp_path / "test_recorded.py"), f"--benchmark-json={tmp_path / 'bench.json'}", *options]
    # In a child of the fork server (extkv.testing.children): a fresh
    # `python -m pytest` spent about 4 s of CPU, half of it importing torch.
    code = f"import sys, pytest; sys.exit(int(pytest.main({arguments!r})))"
    return python_c(code, tmp_path / "pytest", environment)


def test_pytest_benchmark_records_the_measured_rounds(tmp_path):
    finished = run_pytest_benchmark(tmp_path, f"--benchmark-timer={PLAYBACK_TIMER}")
    assert finished.returncode == 0, finished.stdout + finished.stderr
    (recorded,) = json.loads((tmp_path / "bench.json").read_text())["benchmarks"]
    assert recorded["stats"]["data"] == [0.5, 0.25, 0.125]
    assert recorded["extra_info"]["cpu"] == [0.1, 0.1, 0.1] and recorded["extra_info"]["op"] == "commit"
    assert recorded["group"] == "commit-blhnc1-4MiB-recycled"


def test_recording_without_the_playback_clock_is_refused(tmp_path):
    finished = run_pytest_benchmark(tmp_path)
    assert finished.returncode != 0 and "playback clock" in finished.stdout, finished.stdout


# -- run against run: pytest-benchmark's storage, compare and gate -------------------------------
def extkv_bench_quick(tmp_path: Path, run: str, *arguments: str) -> subprocess.CompletedProcess:
    """`extkv bench --quick` on the host driver into tmp_path/RUN, saving into
    tmp_path/storage: its recycled cases only (a fresh case starts a process
    of its own), which are sixty benchmarks."""
    # Not distributed (pytest-benchmark disables itself under xdist), and on
    # the host driver whatever GPUs the machine has.
    environment = {name: value for name, value in os.environ.items() if not name.startswith("PYTEST_XDIST")}
    environment["CUDA_VISIBLE_DEVICES"] = ""
    argv = ["bench", "--quick", "--report-dir", str(tmp_path / run), "--benchmark-storage", str(tmp_path / "storage"),
            "-k", "recycled", *arguments]
    return python_c(f"import sys; from extkv.cli import main; sys.exit(main({argv!r}))", tmp_path / run, environment)


def pytest_benchmark_cli(tmp_path: Path, *arguments: str) -> str:
    """`pytest-benchmark --storage tmp_path/storage ARGUMENTS...`: what it printed."""
    code = ("import sys; from pytest_benchmark.cli import main; "
            f"sys.argv = ['pytest-benchmark', '--storage', {str(tmp_path / 'storage')!r}, *{list(arguments)!r}]; main()")
    # In tmp_path: the command imports a conftest.py of its working directory.
    finished = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    return finished.stdout


def test_runs_share_a_storage_that_compare_sets_side_by_side_and_a_gate_fails_a_run(tmp_path):
    first = extkv_bench_quick(tmp_path, "a")
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    # 0%: no benchmark may read any slower, nor spread any wider, than in the
    # run before; of sixty benchmarks of two noisy rounds, some always do.
    second = extkv_bench_quick(tmp_path, "b", "--benchmark-compare", "--benchmark-compare-fail", "min:0%", "stddev:0%")
    said = second.stdout + second.stderr
    assert second.returncode != 0 and "Performance has regressed" in said, said[-4000:]
    assert (tmp_path / "b" / "summary.md").is_file(), "a run the gate fails is still reported"

    saved = sorted((tmp_path / "storage").glob("*/*.json"))
    assert [path.name for path in saved] == ["0001_a.json", "0002_b.json"], f"the gated run is saved all the same: {saved}"
    names = []
    for run, path in zip("ab", saved):
        stored = {bench["name"]: bench["stats"]["data"] for bench in json.loads(path.read_text())["benchmarks"]}
        cases = json.loads((tmp_path / run / CASES_FILE).read_text())["cases"]
        measured = {f"test_bench[{case['case']}-{name}]": result["wall"] for case in cases
                    for name, result in case["results"].items() if result["status"] == "measured"}
        assert stored == measured, f"{path.name} does not hold the rounds the engine measured in {run}"
        names.append(sorted(stored))
    assert names[0] == names[1] and len(names[0]) >= 40, names

    listed = pytest_benchmark_cli(tmp_path, "list")
    assert [Path(line).name for line in listed.split()] == ["0001_a.json", "0002_b.json"], listed
    compared = pytest_benchmark_cli(tmp_path, "compare", "--group-by=name", "--columns=min")
    for name in names[0]:
        assert f"{name} (0001_a)" in compared and f"{name} (0002_b)" in compared, f"{name} not compared:\n{compared}"


def test_engine_measures_fresh_cases_in_a_new_process_and_records_every_case(tmp_path):
    lines: list[str] = []
    engine = Engine(PROFILES["quick"], "cpu", tmp_path, rounds=2, log=lines.append, warm=False)
    fresh = next(case for case in engine.cases if case.state == "fresh")
    recycled = next(case for case in engine.cases if case.op == "release" and case.state == "recycled")
    for case, rounds in ((fresh, {1}), (recycled, {1, 2})):  # a loaded machine may spend the case's seconds in one
        for name, measured in engine.measure(case).items():
            if CONTENDERS[name].process == "main":
                assert measured.status == "measured" and len(measured.wall) in rounds, measured
    assert {m.process for m in engine.results(fresh).values()} == {"fresh"}
    # One process per contender: a device need hold one store of the case.
    started = [line for line in lines if line.startswith("bench: fresh process")]
    assert len(started) == len(fresh.contenders), (started, fresh.contenders)
    assert any(line.startswith(f"bench [1/{len(engine.cases)}] {fresh.id}") for line in lines), lines
    written = json.loads(engine.finish().read_text())
    assert [case["case"] for case in written["cases"]] == [case.id for case in engine.cases]
    by_id = {case["case"]: case for case in written["cases"]}
    assert by_id[recycled.id]["results"]["extkv"]["wall"] == engine.results(recycled)["extkv"].wall
    order = by_id[recycled.id]["order"]
    for name, measured in engine.results(recycled).items():
        if CONTENDERS[name].process == "main":
            assert order.count(name) == len(measured.wall), (name, order)
    assert by_id[fresh.id]["order"] == [], "a fresh case's rounds run in processes of their own"
    unreached = by_id[engine.cases[-1].id]["results"]
    assert all(r["status"] == "not run" and "not reached" in r["reason"] for r in unreached.values()), unreached


def test_the_rounds_line_names_the_headline_readings_its_run_recorded(tmp_path):
    """A report rendered again later describes the run as it was: which
    cases took the headline rounds, and which peers were costly, come from
    the run's facts."""
    from extkv.benchmarking.report import bench_section

    facts = {
        "profile": "gpu", "profile_what": "w", "device": "cuda:0", "device_description": {}, "host": "h", "torch": "t",
        "granularity": 2 * MiB, "rounds": 9, "case_seconds": 8.0, "costly_rounds": 2, "headline_rounds": 21,
        "headline_case_seconds": 20.0, "elapsed_seconds": 1.0, "budget_seconds": 2.0, "clocks": ["c"],
        "cpu_time": "thread_time", "cases": [],
    }

    def rendered(run_facts: dict) -> str:
        (tmp_path / CASES_FILE).write_text(json.dumps(run_facts))
        return bench_section(tmp_path)

    recorded = rendered({**facts, "headline_readings": HEADLINE_READINGS,
                         "costly_contenders": ["per_granule", "allocate_copy"]})
    assert f"the headline readings ({HEADLINE_READINGS}) <= 21 rounds within 20 s" in recorded
    assert "using none of them; per_granule and allocate_copy <= 2;" in recorded, recorded


# -- pooled runs ------------------------------------------------------------------------------
def test_pooled_runs_read_as_one_run_of_every_round_in_run_order(tmp_path):
    from extkv.benchmarking.report import bench_section
    from extkv.benchmarking.results import load
    from extkv.benchmarking.pool import pool

    # The first run alone reads 1.25x (raw's one fast round), the second
    # 0.80x (extkv's); pooled, each side's least round is 0.8: 1.00x.
    first = write_one_case_run(tmp_path / "a", ["extkv", "raw"] * 6,
                               {"extkv": [1.0] * 6, "raw": [0.8] + [1.0] * 5}, instructions={"extkv": 741})
    second = write_one_case_run(tmp_path / "b", ["raw", "extkv"] * 6,
                                {"extkv": [0.8] + [1.0] * 5, "raw": [1.0] * 6}, instructions={"extkv": 741},
                                elapsed_seconds=3.0)
    pooled = pool([first, second], tmp_path / "pooled")
    run = load(pooled)
    (case,) = run.cases
    assert case.entries["extkv"].wall == [1.0] * 6 + [0.8] + [1.0] * 5
    assert case.entries["raw"].wall == [0.8] + [1.0] * 5 + [1.0] * 6
    assert case.facts["order"] == ["extkv", "raw"] * 6 + ["raw", "extkv"] * 6
    assert run.facts["elapsed_seconds"] == 4.0 and [r["run"] for r in run.facts["pooled_from"]] == ["a", "b"]
    row = {row.target.key: row for row in evaluate(run)}["commit-raw"]
    assert row.met is True and row.ratio_min == pytest.approx(1.0), row
    assert row.split_in_time == (pytest.approx(1.25), pytest.approx(0.8)), "the halves in time set run against run"
    section = bench_section(pooled)
    assert "Pooled (extkv pool): the rounds of 2 runs" in section and "a (1 s), b (3 s)" in section
    assert "differ in elapsed" not in section and "differ in" not in section, "summed facts are no difference"


@pytest.mark.parametrize("change, words", [
    ({"torch": "other"}, "ran on another torch than"),
    ({"profile": "host"}, "ran on another profile than"),
    ({"instructions": {"extkv": 760}}, "measured other code: extkv in grow8-blhnc1-1GiB-recycled ran 760 bytecode "
                                       "instructions there and 741 in a"),
])
def test_runs_of_other_code_or_another_machine_are_not_pooled(tmp_path, change, words):
    from extkv.benchmarking.pool import pool

    walls = {"extkv": [1.0] * 6, "raw": [1.0] * 6}
    first = write_one_case_run(tmp_path / "a", ["extkv", "raw"] * 6, walls, instructions={"extkv": 741})
    second = write_one_case_run(tmp_path / "b", ["extkv", "raw"] * 6, walls,
                                **{"instructions": {"extkv": 741}, **change})
    with pytest.raises(ValueError, match=words):
        pool([first, second], tmp_path / "pooled")
    assert not (tmp_path / "pooled").exists(), "a refused pool writes nothing"


def test_pooling_needs_two_runs_and_a_directory_of_its_own(tmp_path):
    from extkv.benchmarking.pool import pool

    run = write_one_case_run(tmp_path / "a", ["extkv", "raw"], {"extkv": [1.0], "raw": [1.0]})
    with pytest.raises(ValueError, match="needs two or more run directories, got 1"):
        pool([run], tmp_path / "pooled")
    with pytest.raises(ValueError, match="must not be one of the runs pooled"):
        pool([run, run], run)
    with pytest.raises(ValueError, match=r"not a bench run with results \(bench_cases.json and bench.json missing\)"):
        pool([run, tmp_path / "empty"], tmp_path / "pooled")


def test_a_pool_of_a_partial_run_is_headed_as_partial_and_names_it(tmp_path):
    from extkv.benchmarking.pool import pool
    from extkv.benchmarking.report import bench_section
    from extkv.benchmarking.result_files import RUN_FILE

    walls = {"extkv": [1.0] * 6, "raw": [1.0] * 6}
    first, second = (write_one_case_run(tmp_path / name, ["extkv", "raw"] * 6, walls) for name in ("a", "b"))
    (second / RUN_FILE).write_text(json.dumps({"exit_status": 2, "interrupted": "SIGINT"}))
    section = bench_section(pool([first, second], tmp_path / "pooled"))
    assert section.startswith("## Benchmarks (pooled from partial runs (b: INTERRUPTED by SIGINT): partial results)"), (
        section[:200])
    (second / RUN_FILE).write_text(json.dumps({"exit_status": 0}))
    section = bench_section(pool([first, second], tmp_path / "pooled"))
    assert "partial" not in section, "a pool made again of finished runs keeps the earlier pool's partial mark"


def test_extkv_pool_writes_the_pooled_report_or_says_why_not(tmp_path, capsys):
    from extkv.cli import main

    walls = {"extkv": [1.0] * 6, "raw": [1.0] * 6}
    runs = [str(write_one_case_run(tmp_path / name, ["extkv", "raw"] * 6, walls)) for name in ("a", "b")]
    assert main(["pool", str(tmp_path / "pooled"), *runs]) == 0
    assert "Pooled (extkv pool)" in (tmp_path / "pooled" / "summary.md").read_text()
    assert main(["pool", str(tmp_path / "again"), runs[0]]) == 2
    assert "extkv pool: pooling needs two or more run directories, got 1" in capsys.readouterr().err


@pytest.mark.harness
def test_the_growth_loop_commits_an_eighth_then_equal_commits_to_full():
    """The quick setting's schedule, worked by hand: 64 blocks, 24 steps, 7
    commits: an eighth (8 blocks) for the first 3 steps, then 8 more blocks
    every 24 // (7 + 1) = 3 steps, full for the last 3."""
    setting = growth_loop.Setting("blhnc1", 64 << 20, steps=24, growth_commits=7, rounds=1)
    assert growth_loop.schedule(setting, 64) == [8 + 8 * (step // 3) for step in range(24)]
    assert growth_loop.schedule(setting, 64)[-3:] == [64, 64, 64]


def growth_result(modes: tuple[str, ...]) -> dict:
    """A growth-loop result whose mode i has p99 (i + 1) ms and added (i + 1) * 10 ms."""
    rows = {mode: {"p50_s": 1e-3, "p99_s": (i + 1) * 1e-3, "added_s": (i + 1) * 1e-2}
            | ({} if mode in growth_loop.APART_MODES else {"fresh_p50_s": 2e-3, "fresh_p99_s": 4e-3})
            for i, mode in enumerate(modes)}
    return {"setting": {"steps": 600, "geometry": "lbhnc32", "capacity_bytes": 32 << 30, "growth_commits": 28,
                        "rounds": 3},
            "device": "cuda:0", "torch": "2.11", "grown_bytes": 28 << 30, "memset_s": 0.02, "modes": rows}


@pytest.mark.harness
def test_the_growth_section_sets_the_worker_s_halves_beside_the_ahead_row():
    from extkv.benchmarking.growth_report import growth_section

    lines = growth_section(growth_result(growth_loop.MODES + growth_loop.APART_MODES))
    rows = {line.split(" | ")[0].lstrip("| "): line for line in lines if line.startswith("| ") and " ms " in line}
    assert list(rows) == [*growth_loop.MODES, *growth_loop.APART_MODES], rows
    assert rows["ahead"].endswith("| 3.000x | 30.00 ms | 1.50x | 2.000 ms / 4.000 ms |"), rows["ahead"]
    assert rows["beside driver calls"].endswith("| 5.000x | 50.00 ms | 2.50x | not run |"), rows["beside driver calls"]
    assert rows["beside zeroing"].endswith("| 6.000x | 60.00 ms | 3.00x | not run |"), rows["beside zeroing"]
    switch = rows[growth_loop.SHORT_SWITCH_MODE]
    assert switch.endswith("| 7.000x | 70.00 ms | 3.50x | not run |"), switch
    assert any(line.startswith("*beside driver calls* and *beside zeroing*") for line in lines), lines
    assert any(line.startswith(f"*{growth_loop.SHORT_SWITCH_MODE}*") for line in lines), lines
    plain = growth_section(growth_result(growth_loop.MODES))
    assert not any(line.startswith(("*beside", "*ahead,")) for line in plain), plain


@pytest.mark.harness
def test_p99_is_the_nearest_rank():
    assert decode.p99(list(range(1, 101))) == 99
    assert decode.p99(list(range(200, 0, -1))) == 198
    assert decode.p99([0.5]) == 0.5
