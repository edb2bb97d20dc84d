"""Several threads mixing operations on one cache.

Theory of operation
-------------------
`thread_rounds` runs rounds of THREADS threads, each making
OPERATIONS_PER_THREAD random calls on one shared cache over poisoned memory.
Before a round every committed block is written with its pattern (one
never-zero byte per block and segment); after it the threads are joined and
the cache checked against what any interleaving of the round's calls
allows: in *preserving* rounds blocks committed before keep their pattern,
new ones read zero and the count is the largest asked; in *mixed* rounds
every block is its whole pattern or all zero and the count is one some call
asked for. Each round also checks the driver's read-back and the usage
probe. The least episode is LEAST_THREAD_ROUNDS rounds, a preserving and a
mixed one.

`reader_beside_preserving_shrinks` runs a reader that takes no lock beside
threads that grow the cache and shrink it keeping contents above a floor
of blocks: the floor's bytes must stay mapped and intact throughout.
"""

from __future__ import annotations

import contextlib
import random
import threading

import torch

from ...cache import ExtensibleKVCache
from ...layout import KVCacheLayout
from ...vmm import PoisoningDriver, driver_for
from ..checks import check_mapped_as_a_shrink_keeps, check_readback_matches_bookkeeping
from ..children import one_report
from ..configs import config_for
from ..modelled_cache import capacity_for
from ..models import ContentMismatch, LeakFound
from .base import stress_driver, warmed_probe
from .bounds import Floor
from .tally import StressTally


THREADS = 8
OPERATIONS_PER_THREAD = 16
#: A thread workload's least episode: one preserving and one mixed round.
LEAST_THREAD_ROUNDS = 2


def thread_pattern(kv_cache: ExtensibleKVCache, segment: int, num_blocks: int) -> torch.Tensor:
    """Never-zero byte per (block, segment): row b of segment s holds one value."""
    blocks = torch.arange(num_blocks, dtype=torch.int32, device=kv_cache.buffer.device)
    return ((blocks * 7 + 31 * segment) % 251 + 1).to(torch.uint8)


def committed_rows(kv_cache: ExtensibleKVCache, segment: int) -> torch.Tensor:
    stride = kv_cache.segment_strides[segment]
    return kv_cache.buffer.segment_view(segment)[: kv_cache.num_committed_blocks * stride].view(-1, stride)


def write_thread_patterns(kv_cache: ExtensibleKVCache) -> None:
    for segment in range(len(kv_cache.segment_strides)):
        rows = committed_rows(kv_cache, segment)
        rows.copy_(thread_pattern(kv_cache, segment, rows.shape[0])[:, None].expand_as(rows))


def row_states(kv_cache: ExtensibleKVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """Per committed block: whether every segment's row is its whole
    pattern, and whether every segment's row is all zero."""
    n = kv_cache.num_committed_blocks
    patterned = torch.ones(n, dtype=torch.bool, device=kv_cache.buffer.device)
    zero = torch.ones_like(patterned)
    for segment in range(len(kv_cache.segment_strides)):
        rows = committed_rows(kv_cache, segment)
        patterned &= (rows == thread_pattern(kv_cache, segment, n)[:, None]).all(dim=1)
        zero &= (rows == 0).all(dim=1)
    return patterned, zero


def thread_rounds(
    device: torch.device | str,
    layout: KVCacheLayout,
    tally: StressTally,
    *,
    seed: int,
    until: float | None = None,
    rounds: int | None = None,
    threads: int = THREADS,
    per_thread: int = OPERATIONS_PER_THREAD,
) -> int:
    """Rounds of `threads` threads, each making `per_thread` random calls on
    one shared cache (over poisoned memory), until `until` or for `rounds`.
    Between rounds the threads are joined and checked against what any
    interleaving of the round's calls allows: in *preserving* rounds
    (growing, at-or-below and content-preserving defragmenting commits)
    blocks committed before keep their pattern and new ones read zero and the
    count is the largest asked; in *mixed* rounds (also shrinks, discarding
    defragments, release, recommit) every block is its whole pattern or all
    zero and the count is one some call asked for. Each round also checks
    the driver's read-back and the usage probe. `until` is a floor for
    LEAST_THREAD_ROUNDS rounds. Returns the rounds run."""
    if until is None and rounds is None:
        raise ValueError("thread_rounds needs a bound: until= or rounds=")
    device = torch.device(device)
    probe = warmed_probe(device)
    baseline = probe.read_outside_torch()
    driver = stress_driver(device)
    capacity = 8 * capacity_for("full", layout, driver.granularity)
    kv_cache = ExtensibleKVCache(config_for("full", layout, capacity), driver, layout)
    requested: set[int] = set()
    lock = threading.Lock()
    tally.seeds.append(seed)
    tally.settings["threads"] = threads

    def asked(n: int) -> int:
        with lock:
            requested.add(n)
        return n

    def target(rng: random.Random) -> int:
        return asked(rng.randrange(1, capacity + 1))

    def at_or_below(rng: random.Random) -> int:
        # Another thread may shrink the cache before this commit runs, which
        # then grows it to this count: recorded as asked.
        return asked(rng.randrange(0, kv_cache.num_committed_blocks + 1))

    preserving = {
        "commit (grow)": lambda rng: kv_cache.commit(target(rng)),
        "commit (at or below)": lambda rng: kv_cache.commit(at_or_below(rng)),
        "commit (defragment, preserving)": lambda rng: kv_cache.commit(target(rng), defragment=True, preserve_contents=True),
        "read sizes and chunks": lambda rng: (kv_cache.physical_bytes, kv_cache.buffer.mapped_chunks, kv_cache.committable_blocks()),
    }
    mixed = {
        **{name: preserving[name] for name in ("commit (grow)", "commit (at or below)", "commit (defragment, preserving)")},
        "commit (shrink)": lambda rng: kv_cache.commit(target(rng), shrink=True),
        "commit (defragment, discarding)": lambda rng: kv_cache.commit(target(rng), defragment=True),
        "release_physical": lambda rng: kv_cache.release_physical(),
        "recommit": lambda rng: kv_cache.recommit(),
    }

    def run_round(operations: dict, round_seed: int) -> list[BaseException]:
        errors: list[BaseException] = []
        start = threading.Barrier(threads)
        names = list(operations)

        def work(thread: int) -> None:
            rng = random.Random(round_seed * 1000 + thread)
            start.wait()
            try:
                for _ in range(per_thread):
                    name = rng.choice(names)
                    operations[name](rng)
                    with lock:
                        tally.operations[f"thread: {name}"] += 1
            except BaseException as error:  # reported by the round, not lost in the thread
                errors.append(error)

        workers = [threading.Thread(target=work, args=(i,), name=f"extkv-stress-{i}") for i in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        return errors

    number = 0
    # The least: a preserving and a mixed round.
    floor = Floor(until, lambda: number >= LEAST_THREAD_ROUNDS)
    try:
        kv_cache.commit(capacity // 8)
        while (rounds is None or number < rounds) and floor.more():
            preserving_round = number % 2 == 0
            if kv_cache.buffer.physical_bytes == 0:
                kv_cache.recommit()
            write_thread_patterns(kv_cache)
            before = kv_cache.num_committed_blocks
            requested.clear()
            round_seed = seed * 100_003 + number
            errors = run_round(preserving if preserving_round else mixed, round_seed)
            where = f"thread round {number} (seed {seed}, round seed {round_seed}, {'preserving' if preserving_round else 'mixed'})"
            if errors:
                raise AssertionError(f"{where}: {len(errors)} call(s) raised, first: {errors[0]!r}") from errors[0]
            check_readback_matches_bookkeeping(kv_cache.buffer)
            measured = probe.read_outside_torch() - baseline
            if measured != kv_cache.physical_bytes:
                raise LeakFound(f"{where}: {probe.source} reads {measured} bytes, the cache maps {kv_cache.physical_bytes}")
            tally.checks["after a thread round: read-back, usage probe"] += 1
            number += 1
            if kv_cache.buffer.physical_bytes == 0:
                continue  # released last: nothing readable until recommit
            n = kv_cache.num_committed_blocks
            assert kv_cache.buffer.segment_sizes == [n * s for s in kv_cache.segment_strides], f"{where}: sizes disagree with the count {n}"
            assert kv_cache.physical_bytes == kv_cache.physical_bytes_for(n), f"{where}: footprint disagrees with the count {n}"
            patterned, zero = row_states(kv_cache)
            if preserving_round:
                assert n == max([before, *requested]), f"{where}: {n} blocks committed, the round asked for at most {max(requested)}"
                wrong = int((~patterned[: min(before, n)]).sum()) + int((~zero[before:]).sum())
            else:
                assert n == before or n in requested, f"{where}: {n} blocks committed, a count nobody asked for"
                wrong = int((~(patterned | zero)).sum())
            if wrong:
                raise ContentMismatch(f"{where}: {wrong} block(s) hold neither what the round allows")
            tally.checks["after a thread round: every block as any interleaving allows"] += 1
            tally.observe_physical(kv_cache.physical_bytes)
    except Exception as error:
        tally.fail(error, f"seed {seed}, round {number}")
        raise
    finally:
        kv_cache.free()
    measured = probe.read_outside_torch() - baseline
    if measured:
        error = LeakFound(f"{probe.source}: {measured} bytes above baseline after the threads' cache was freed")
        tally.fail(error)
        raise error
    floor.close(tally, f"thread rounds ({layout.name})", f"{number} rounds (a preserving and a mixed one)")
    return number


#: Blocks the reader of `reader_beside_preserving_shrinks` reads, which no
#: shrink there goes below; and how many calls each committer makes.
KEPT_FLOOR_BLOCKS = 64
COMMITTER_CALLS = 64


def reader_beside_preserving_shrinks(device: torch.device | str, layout: KVCacheLayout, *, seed: int,
                                     committers: int = 2, calls: int = COMMITTER_CALLS) -> dict:
    """A reader that never takes the reservation's lock, beside threads that
    grow the cache and shrink it keeping contents, never below
    KEPT_FLOOR_BLOCKS: the reader reads those blocks of every segment over
    and over while the others run, and each read must find every byte as
    written (on the host, a read of memory a defective shrink unmapped ends
    the process: run it in a child). Once all are joined, the read-back
    shows every committed granule mapped and no chunk holding no committed
    byte, the footprint is what `physical_bytes_after_shrink` says, the
    blocks above the floor read zero over poison, and the usage probe
    agrees. Returns the counts: reads, wrong reads, calls by kind, and the
    first problems."""
    device = torch.device(device)
    probe = warmed_probe(device)
    baseline = probe.read_outside_torch()
    driver = PoisoningDriver(driver_for(device))
    capacity = 4 * capacity_for("full", layout, driver.granularity)
    floor = min(KEPT_FLOOR_BLOCKS, capacity // 4)
    kv_cache = ExtensibleKVCache(config_for("full", layout, capacity), driver, layout)
    counts: dict = {"reads": 0, "wrong reads": 0, "grow": 0, "preserving shrink": 0, "problems": []}
    lock = threading.Lock()
    done = threading.Event()
    try:
        kv_cache.commit(capacity // 2)
        for segment in range(len(kv_cache.segment_strides)):
            rows = committed_rows(kv_cache, segment)[:floor]
            rows.copy_(thread_pattern(kv_cache, segment, floor)[:, None].expand_as(rows))
        expected = [committed_rows(kv_cache, segment)[:floor].clone() for segment in range(len(kv_cache.segment_strides))]
        driver.synchronize()
        start = threading.Barrier(committers + 1)

        def commit(thread: int) -> None:
            rng = random.Random(seed * 1000 + thread)
            start.wait()
            try:
                for _ in range(calls):
                    target = rng.randrange(floor, capacity + 1)
                    if rng.random() < 0.5:
                        kv_cache.commit(target)
                        name = "grow"
                    else:
                        kv_cache.commit(target, shrink=True, preserve_contents=True)
                        name = "preserving shrink"
                    with lock:
                        counts[name] += 1
            except BaseException as error:  # reported, not lost in the thread
                with lock:
                    counts["problems"].append(f"committer {thread}: {type(error).__name__}: {error}")

        def read() -> None:
            start.wait()
            reads = wrong = 0
            # At least as many reads as calls, so the two overlap whatever the scheduler does.
            while not done.is_set() or reads < calls:
                for segment, kept in enumerate(expected):
                    stride = kv_cache.segment_strides[segment]
                    rows = kv_cache.buffer.segment_view(segment)[: floor * stride].view(floor, stride)
                    wrong += 0 if torch.equal(rows, kept) else 1
                reads += 1
            counts["reads"], counts["wrong reads"] = reads, wrong

        workers = [threading.Thread(target=commit, args=(i,), name=f"extkv-stress-{i}") for i in range(committers)]
        reader = threading.Thread(target=read, name="extkv-stress-reader")
        for thread in [*workers, reader]:
            thread.start()
        for thread in workers:
            thread.join()
        done.set()
        reader.join()
        buffer, n = kv_cache.buffer, kv_cache.num_committed_blocks
        check_readback_matches_bookkeeping(buffer)
        check_mapped_as_a_shrink_keeps(buffer, buffer.segment_sizes)
        if buffer.segment_sizes != [n * stride for stride in kv_cache.segment_strides]:
            counts["problems"].append(f"segment sizes {buffer.segment_sizes} disagree with the count {n}")
        if kv_cache.physical_bytes != kv_cache.physical_bytes_after_shrink(n):
            counts["problems"].append(f"{kv_cache.physical_bytes} bytes mapped, physical_bytes_after_shrink({n}) says "
                                      f"{kv_cache.physical_bytes_after_shrink(n)}")
        for segment, kept in enumerate(expected):
            rows = committed_rows(kv_cache, segment)
            if not torch.equal(rows[:floor], kept):
                counts["problems"].append(f"segment {segment}: the {floor} kept blocks changed")
            nonzero = int(rows[floor:].any(dim=1).sum())
            if nonzero:
                counts["problems"].append(f"segment {segment}: {nonzero} of the {n - floor} blocks above the floor "
                                          "are not zero")
        measured = probe.read_outside_torch() - baseline
        if measured != kv_cache.physical_bytes:
            counts["problems"].append(f"{probe.source} reads {measured} bytes, the cache maps {kv_cache.physical_bytes}")
    finally:
        done.set()
        kv_cache.free()
    return counts


def _reader_child(device: str, layout_name: str, seed: int, defect: str | None, sender) -> None:
    from .. import planted

    plant = planted.DEFECTS[defect].make(driver_for(device)) if defect else contextlib.nullcontext()
    with plant:
        counts = reader_beside_preserving_shrinks(device, KVCacheLayout[layout_name], seed=seed)
    sender.send(counts)


def reader_beside_preserving_shrinks_in_child(device: torch.device | str, layout: KVCacheLayout, *, seed: int,
                                              defect: str | None = None, timeout_s: float = 300) -> tuple[int | None, dict | None]:
    """`reader_beside_preserving_shrinks` in a child of the fork server
    (with the planted `defect` staged, a context manager's): its exit code
    (a read of unmapped memory is a signal's, not the end of the caller)
    and its counts (None where it died before sending them)."""
    return one_report(timeout_s, _reader_child, str(device), layout.name, seed, defect)
