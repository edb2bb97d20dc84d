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

Beside threads that grow the cache and shrink it keeping contents, a reader
that takes no lock reads the blocks no shrink goes below, and finds them
whole every time (in a child process: a read of memory a defective shrink
unmapped is a signal there, not the end of the suite).

Contents are compared as numbers (counts of mismatching rows), never printed.
"""

from __future__ import annotations

import threading

import pytest

from extkv import KVCacheLayout
from extkv.testing.checks import check_readback_matches_bookkeeping, check_usage_matches
from extkv.testing.stress import StressTally, thread_rounds
from extkv.testing.stress.threads import COMMITTER_CALLS, reader_beside_preserving_shrinks_in_child

pytestmark = pytest.mark.invariant(7)

THREADS = 8
ROUNDS = 8  # 8 threads x 8 rounds x 16 calls = 1,024 operations


@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.BLHNC], ids=lambda layout: layout.name)
def test_threads_mixing_operations_keep_the_cache_consistent(device, layout):
    """The rounds and their checks are extkv.testing.stress.thread_rounds,
    which the nightly stress run drives for minutes: here eight rounds."""
    tally = StressTally()
    assert thread_rounds(device, layout, tally, seed=7, rounds=ROUNDS, threads=THREADS) == ROUNDS
    operations = sum(count for name, count in tally.operations.items() if name.startswith("thread: "))
    assert operations >= 1000, f"{operations} operations ran in {ROUNDS} rounds"
    assert not tally.failures


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


@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.BLHNC], ids=lambda layout: layout.name)
def test_a_reader_finds_the_kept_blocks_whole_while_threads_grow_and_shrink_keeping_contents(device, layout):
    code, counts = reader_beside_preserving_shrinks_in_child(device, layout, seed=11)
    assert code == 0 and counts is not None, f"the child exited with {code} and sent {counts}"
    assert counts["problems"] == [], counts["problems"]
    assert counts["wrong reads"] == 0, f"{counts['wrong reads']} of {counts['reads']} reads found a kept block changed"
    assert counts["reads"] >= COMMITTER_CALLS and counts["preserving shrink"] > 0 and counts["grow"] > 0, counts
