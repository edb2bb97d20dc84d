"""Invariant 7: a KV cache may be driven from several threads at once.

Eight threads share one cache and call its state-changing operations in
random interleavings, as an engine's scheduler, weight loader and sleep
endpoint would. Between rounds the threads are joined and everything is
checked against the driver's or kernel's read-back and against what the
operations of the round allow, whatever order they ran in:

- *preserving* rounds mix growing commits, commits at or below the committed
  count and content-preserving defragmentation: every block committed before
  the round keeps its pattern, every block committed during it reads zero.
- *mixed* rounds add shrinking commits, discarding defragmentation, release
  and recommit: every committed block is either its whole pattern or all
  zero, and the committed count is one the round asked for.

Contents are compared as numbers (counts of mismatching rows), never printed.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from extkv import ExtensibleKVCache, KVCacheLayout
from extkv.testing.checks import check_readback_matches_bookkeeping, check_usage_matches

pytestmark = pytest.mark.invariant(7)

THREADS = 8
ROUNDS = 8
OPERATIONS_PER_THREAD = 16  # 8 threads x 8 rounds x 16 = 1,024 operations
CAPACITY = 600


def _pattern(kv_cache: ExtensibleKVCache, segment: int, num_blocks: int) -> torch.Tensor:
    """Never-zero byte per (block, segment): row b of segment s holds one value."""
    blocks = torch.arange(num_blocks, dtype=torch.int32, device=kv_cache.buffer.device)
    return ((blocks * 7 + 31 * segment) % 251 + 1).to(torch.uint8)


def _rows(kv_cache: ExtensibleKVCache, segment: int) -> torch.Tensor:
    stride = kv_cache.segment_strides[segment]
    return kv_cache.buffer.segment_view(segment)[: kv_cache.num_committed_blocks * stride].view(-1, stride)


def write_patterns(kv_cache: ExtensibleKVCache) -> None:
    for segment in range(len(kv_cache.segment_strides)):
        rows = _rows(kv_cache, segment)
        rows.copy_(_pattern(kv_cache, segment, rows.shape[0])[:, None].expand_as(rows))


def row_states(kv_cache: ExtensibleKVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """Per committed block, whether every segment's row is its whole pattern,
    and whether every segment's row is all zero."""
    n = kv_cache.num_committed_blocks
    patterned = torch.ones(n, dtype=torch.bool, device=kv_cache.buffer.device)
    zero = torch.ones_like(patterned)
    for segment in range(len(kv_cache.segment_strides)):
        rows = _rows(kv_cache, segment)
        patterned &= (rows == _pattern(kv_cache, segment, n)[:, None]).all(dim=1)
        zero &= (rows == 0).all(dim=1)
    return patterned, zero


def run_round(kv_cache: ExtensibleKVCache, operations, seed: int) -> list[BaseException]:
    """Run OPERATIONS_PER_THREAD random picks of `operations` on each of
    THREADS threads, started together; return what they raised."""
    errors: list[BaseException] = []
    start = threading.Barrier(THREADS)

    def work(thread: int) -> None:
        rng = random.Random(seed * 1000 + thread)
        start.wait()
        try:
            for _ in range(OPERATIONS_PER_THREAD):
                rng.choice(operations)(rng)
        except BaseException as error:  # reported by the test, not lost in the thread
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,), name=f"extkv-worker-{i}") for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def check_consistent(kv_cache: ExtensibleKVCache, usage, baseline: int) -> None:
    """Bookkeeping agrees with the read-back, the footprint with the count,
    and usage read outside extkv with the footprint."""
    buffer = kv_cache.buffer
    check_readback_matches_bookkeeping(buffer)
    check_usage_matches(usage, baseline, [buffer])
    committed = [kv_cache.num_committed_blocks * stride for stride in kv_cache.segment_strides]
    if buffer.segment_sizes == [0] * len(committed) and buffer.physical_bytes == 0:
        return  # released; the count is kept for recommit
    assert buffer.segment_sizes == committed, f"segment sizes {buffer.segment_sizes}, count says {committed}"
    assert buffer.physical_bytes == kv_cache.physical_bytes_for(kv_cache.num_committed_blocks)


@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.BLHNC], ids=lambda layout: layout.name)
def test_threads_mixing_operations_keep_the_cache_consistent(build, usage, layout):
    baseline = usage.read_outside_torch()
    kv_cache = build.cache_for("full", layout, CAPACITY)
    requested: set[int] = set()
    lock = threading.Lock()

    def asked(n: int) -> int:
        with lock:
            requested.add(n)
        return n

    def target(rng: random.Random) -> int:
        return asked(rng.randrange(1, CAPACITY + 1))

    def at_or_below(rng: random.Random) -> int:
        # At or below the count read now; another thread may shrink the
        # cache before this commit runs, which then grows it to this count.
        return asked(rng.randrange(0, kv_cache.num_committed_blocks + 1))

    preserving = [
        lambda rng: kv_cache.commit(target(rng)),
        lambda rng: kv_cache.commit(at_or_below(rng)),
        lambda rng: kv_cache.commit(target(rng), defragment=True, preserve_contents=True),
        lambda rng: kv_cache.commit(kv_cache.num_committed_blocks, defragment=True, preserve_contents=True),
        lambda rng: (kv_cache.physical_bytes, kv_cache.buffer.mapped_chunks, kv_cache.committable_blocks()),
    ]
    mixed = preserving[:3] + [
        lambda rng: kv_cache.commit(target(rng), shrink=True),
        lambda rng: kv_cache.commit(target(rng), defragment=True),
        lambda rng: kv_cache.release_physical(),
        lambda rng: kv_cache.recommit(),
    ]
    operations_run = mismatched_blocks = 0
    kv_cache.commit(50)
    for round_number in range(ROUNDS):
        preserving_round = round_number % 2 == 0
        if kv_cache.buffer.physical_bytes == 0:
            kv_cache.recommit()
        write_patterns(kv_cache)
        before = kv_cache.num_committed_blocks
        requested.clear()
        errors = run_round(kv_cache, preserving if preserving_round else mixed, seed=round_number)
        operations_run += THREADS * OPERATIONS_PER_THREAD
        assert not errors, f"round {round_number}: {len(errors)} operation(s) raised, first: {errors[0]!r}"
        check_consistent(kv_cache, usage, baseline)
        if kv_cache.buffer.physical_bytes == 0:
            continue  # released last: nothing readable until recommit
        patterned, zero = row_states(kv_cache)
        n = kv_cache.num_committed_blocks
        if preserving_round:
            assert n == max([before, *requested]), f"{n} blocks committed; the round asked for at most {max(requested)}"
            mismatched_blocks += int((~patterned[: min(before, n)]).sum()) + int((~zero[before:]).sum())
        else:
            assert n == before or n in requested, f"{n} blocks committed, a count nobody asked for"
            mismatched_blocks += int((~(patterned | zero)).sum())
        assert mismatched_blocks == 0, f"round {round_number}: {mismatched_blocks} block(s) hold neither what the model says"
    kv_cache.free()
    assert operations_run >= 1000
    check_usage_matches(usage, baseline, [])


def test_threads_committing_one_tensor_map_each_granule_once(build, usage):
    """The defect first seen: two threads growing one tensor at once both
    mapped the same granules, leaking a chunk and desynchronizing bookkeeping."""
    baseline = usage.read_outside_torch()
    tensor = build.tensor(64 * (2 << 20), segment_capacities=[32 * (2 << 20)] * 2)
    granule = tensor.granularity
    for trial in range(20):
        barrier = threading.Barrier(THREADS)
        errors: list[BaseException] = []

        def grow(thread: int) -> None:
            barrier.wait()
            try:
                size = (thread % 4 + 1) * 4 * granule + trial
                tensor.resize_segments_([max(size, tensor.segment_sizes[0]), max(size, tensor.segment_sizes[1])])
            except ValueError:
                pass  # another thread grew past this size first: a shrink request, refused
            except BaseException as error:
                errors.append(error)

        threads = [threading.Thread(target=grow, args=(i,)) for i in range(THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, f"trial {trial}: {errors[0]!r}"
        check_readback_matches_bookkeeping(tensor)
        check_usage_matches(usage, baseline, [tensor])
        tensor.release_physical()
