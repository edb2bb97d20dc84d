"""Commit-ahead (extkv.ahead): a background worker keeps blocks mapped and
zeroed past what the engine committed.

Every test runs the worker for real, on the host driver and on each CUDA
device, over a poisoning driver so that zeroing is checked over non-zero
memory. The worker's progress is waited for by polling its counts with a
deadline (it runs on its own thread); a count that never comes fails with
the counts it reached.
"""

from __future__ import annotations

import errno
import os
import random
import signal
import threading
import time

import pytest
import torch

from extkv import KVCacheLayout
from extkv.ahead import BackgroundGrowthError
from extkv.errors import DriverError, StateError
from extkv.reference_model import ReferenceModelRunner
from extkv.testing.checks import (
    check_all_equal,
    check_mapped_as_a_shrink_keeps,
    check_readback_matches_bookkeeping,
    check_usage_matches,
    warm_up_kernels,
)
from extkv.testing.configs import config_for
from extkv.vmm import FaultInjectingDriver, PoisoningDriver, driver_for
from extkv.vmm.late import LateZeroingDriver
from extkv.vmm.wrapping import WrappingDriver

LAYOUT = KVCacheLayout.LBHNC
CAPACITY = 700
#: Seconds a test waits for the worker to reach a count.
PATIENCE_S = 30.0


def until(condition, what: str) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"after {PATIENCE_S} s: {what}")
        time.sleep(0.005)


def workers() -> list[str]:
    return [thread.name for thread in threading.enumerate() if thread.name == "extkv-commit-ahead"]


@pytest.fixture
def poisoned(device):
    return PoisoningDriver(driver_for(device))


def cache_over(build, driver, committed: int = 10):
    cache = build.cache(config_for("full", LAYOUT, CAPACITY), LAYOUT, device=driver)
    cache.commit(committed)
    return cache


def expect_zero_blocks(cache, first: int, end: int) -> None:
    for segment, stride in enumerate(cache.segment_strides):
        check_all_equal(cache.buffer.segment_view(segment)[first * stride : end * stride], 0, f"segment {segment}, blocks {first}-{end}")


@pytest.mark.invariant(1, 4, 5)
def test_the_window_is_grown_in_the_background_and_a_commit_inside_it_maps_nothing(build, poisoned, usage):
    baseline = usage.read_outside_torch()
    faults = FaultInjectingDriver(poisoned)
    cache = cache_over(build, faults)
    base = cache.buffer.base
    cache.commit_ahead(200, step_blocks=32)
    until(lambda: cache.grown_blocks == 210, f"grown {cache.grown_blocks} of 10 + 200 blocks")
    assert cache.num_committed_blocks == 10, "the worker counted blocks the engine did not commit"
    assert cache.commit_ahead_steps == 7, cache.commit_ahead_steps  # ceil(200 / 32)
    creates = faults.calls["create"]
    cache.commit(150)
    assert faults.calls["create"] == creates, "a commit inside the window created chunks"
    assert cache.num_committed_blocks == 150 and cache.buffer.base == base
    expect_zero_blocks(cache, 10, 150)
    until(lambda: cache.grown_blocks == 350, f"grown {cache.grown_blocks} after commit(150), window 200")
    check_usage_matches(usage, baseline, [cache.buffer])
    assert cache.buffer.base == base


@pytest.mark.invariant(7)
def test_a_commit_inside_the_window_never_waits_for_the_reservation_lock(build, poisoned):
    """Another thread holds the reservation's lock (as a long step or a
    commit would): a commit of ready blocks returns meanwhile; one past them
    waits until the lock is let go."""
    cache = cache_over(build, poisoned)
    cache.commit_ahead(100)
    until(lambda: cache.grown_blocks == 110, f"grown {cache.grown_blocks} of 110")
    holding, release, released = threading.Event(), threading.Event(), threading.Event()

    def hold() -> None:
        with cache.buffer.lock:
            holding.set()
            release.wait(PATIENCE_S)
        released.set()

    holder = threading.Thread(target=hold)
    holder.start()
    holding.wait(PATIENCE_S)
    try:
        cache.commit(90)
        assert not released.is_set() and cache.num_committed_blocks == 90, "a ready commit waited for the lock"
        past = threading.Thread(target=cache.commit, args=(200,))
        past.start()
        past.join(0.2)
        assert past.is_alive(), "a commit past the ready blocks ran while another thread held the lock"
    finally:
        release.set()
        holder.join()
    past.join(PATIENCE_S)
    assert cache.num_committed_blocks == 200


@pytest.mark.invariant(1, 4)
def test_a_commit_past_the_window_grows_itself_and_the_window_follows(build, poisoned):
    cache = cache_over(build, poisoned)
    cache.commit_ahead(50, max_blocks=400)
    until(lambda: cache.grown_blocks == 60, f"grown {cache.grown_blocks} of 60")
    cache.commit(300)
    assert cache.num_committed_blocks == 300 and cache.grown_blocks >= 300
    expect_zero_blocks(cache, 10, 300)
    until(lambda: cache.grown_blocks == 350, f"grown {cache.grown_blocks} of 350")
    cache.commit(390)
    assert cache.settle_commit_ahead(PATIENCE_S), f"the worker never went idle: grown {cache.grown_blocks}"
    assert cache.grown_blocks == 400, f"grown {cache.grown_blocks} once idle: max_blocks is 400"


@pytest.mark.invariant(3, 4, 5)
def test_shrink_release_recommit_and_free_meet_the_worker(build, poisoned, usage):
    baseline = usage.read_outside_torch()
    cache = cache_over(build, poisoned, committed=100)
    cache.commit_ahead(100)
    until(lambda: cache.grown_blocks == 200, f"grown {cache.grown_blocks} of 200")
    cache.recommit()  # awake, past the committed blocks: maps nothing, drops nothing
    assert cache.grown_blocks == 200 and cache.num_committed_blocks == 100
    cache.commit(40, shrink=True)
    assert cache.num_committed_blocks == 40
    until(lambda: cache.grown_blocks == 140, f"after the shrink: grown {cache.grown_blocks} of 140")
    cache.release_physical()
    time.sleep(0.1)
    assert cache.physical_bytes == 0 and cache.grown_blocks == 0, "the worker grew while the cache sleeps"
    check_usage_matches(usage, baseline, [cache.buffer])
    cache.recommit()
    expect_zero_blocks(cache, 0, 40)
    until(lambda: cache.grown_blocks == 140, f"after the wake: grown {cache.grown_blocks} of 140")
    cache.commit(140, defragment=True)
    assert all(cache.buffer.segments_backed_by_one_chunk(cache.buffer.segment_sizes)) or cache.grown_blocks > 140
    cache.free()
    assert workers() == [], "free left the worker running"
    check_usage_matches(usage, baseline, [])


#: Blocks of one granule of each segment of config_for("full") (8 KiB
#: blocks, 2 MiB granules): a step this long maps a new chunk per segment.
GRANULE_BLOCKS = 256


@pytest.mark.invariant(4, 5)
def test_a_release_while_the_worker_grows_stops_it_until_the_wake(build, poisoned, usage):
    """One block a step, so the release lands while steps are still due."""
    baseline = usage.read_outside_torch()
    cache = cache_over(build, poisoned)
    cache.commit_ahead(600, step_blocks=1)
    until(lambda: cache.grown_blocks > 20, f"grown {cache.grown_blocks}")
    cache.release_physical()
    assert cache.grown_blocks < 610, "the worker finished before the release: the test needs a longer window"
    time.sleep(0.2)
    assert cache.grown_blocks == 0 and cache.physical_bytes == 0, f"the worker grew {cache.grown_blocks} blocks in sleep"
    check_usage_matches(usage, baseline, [cache.buffer])
    cache.recommit()
    until(lambda: cache.grown_blocks == 610, f"after the wake: grown {cache.grown_blocks} of 610")
    expect_zero_blocks(cache, 0, 610)


@pytest.mark.invariant(3, 4, 5)
def test_blocks_a_stopped_worker_left_are_counted_later_and_a_shrink_releases_them(build, poisoned, usage):
    baseline = usage.read_outside_torch()
    faults = FaultInjectingDriver(poisoned)
    cache = cache_over(build, faults)
    cache.commit_ahead(300, step_blocks=GRANULE_BLOCKS)
    until(lambda: cache.grown_blocks == 310, f"grown {cache.grown_blocks} of 310")
    cache.commit_ahead(0)
    assert workers() == [] and cache.grown_blocks == 310, "turning commit-ahead off dropped what it grew"
    creates = faults.calls["create"]
    cache.commit(300)
    assert faults.calls["create"] == creates and cache.num_committed_blocks == 300, "the worker's blocks were mapped again"
    expect_zero_blocks(cache, 10, 300)
    cache.commit(300, shrink=True)
    assert cache.grown_blocks == 300 and cache.physical_bytes == cache.physical_bytes_for(300)
    check_usage_matches(usage, baseline, [cache.buffer])
    cache.commit(400)  # past what was left: grows
    assert cache.grown_blocks == 400
    expect_zero_blocks(cache, 300, 400)


def fill_blocks(cache, first: int, end: int, value) -> None:
    """Every byte of blocks [first, end) of every segment, mapped: `value`,
    or for None block b's own never-zero byte, b % 251 + 1."""
    for segment, stride in enumerate(cache.segment_strides):
        rows = cache.buffer.segment_view(segment)[first * stride : end * stride].view(end - first, stride)
        if value is None:
            rows.copy_((torch.arange(first, end, device=rows.device) % 251 + 1).to(torch.uint8)[:, None].expand_as(rows))
        else:
            rows.fill_(value)


@pytest.mark.invariant(1, 3, 5)
def test_a_preserving_shrink_beside_the_worker_keeps_the_blocks_and_releases_what_it_grew(build, poisoned, usage):
    """The worker's blocks past the new count go with the rest of the chunks
    holding no kept byte, the kept blocks hold their bytes, and the window
    the worker grows again reads zero, over what its blocks held before."""
    baseline = usage.read_outside_torch()
    cache = cache_over(build, poisoned, committed=300)
    cache.commit_ahead(200, step_blocks=64)
    until(lambda: cache.grown_blocks == 500, f"grown {cache.grown_blocks} of 500")
    assert cache.settle_commit_ahead(PATIENCE_S)
    fill_blocks(cache, 0, 120, None)
    fill_blocks(cache, 120, 500, 0x77)  # what the shrink drops, in kept chunks too
    cache.commit_ahead(0)
    predicted = cache.physical_bytes_after_shrink(120)
    cache.commit(120, shrink=True, preserve_contents=True)
    assert cache.num_committed_blocks == cache.grown_blocks == 120
    assert cache.physical_bytes == predicted < cache.physical_bytes_for(500)
    check_mapped_as_a_shrink_keeps(cache.buffer, cache.buffer.segment_sizes)
    check_usage_matches(usage, baseline, [cache.buffer])
    cache.commit_ahead(200, step_blocks=64)
    cache.commit(200)
    cache.commit(150, shrink=True, preserve_contents=True)  # the worker on: its blocks past 150 go too
    until(lambda: cache.grown_blocks == 350, f"after the shrink: grown {cache.grown_blocks} of 350")
    assert cache.settle_commit_ahead(PATIENCE_S) and cache.num_committed_blocks == 150
    for segment, stride in enumerate(cache.segment_strides):
        rows = cache.buffer.segment_view(segment)[: 120 * stride].view(120, stride)
        wrong = int((rows != (torch.arange(120, device=rows.device) % 251 + 1).to(torch.uint8)[:, None]).any(dim=1).sum())
        assert wrong == 0, f"segment {segment}: {wrong} of the 120 kept blocks changed"
    expect_zero_blocks(cache, 120, 350)
    check_readback_matches_bookkeeping(cache.buffer)
    check_mapped_as_a_shrink_keeps(cache.buffer, cache.buffer.segment_sizes)
    check_usage_matches(usage, baseline, [cache.buffer])


@pytest.mark.invariant(4, 5)
def test_a_worker_started_while_the_cache_sleeps_waits_for_the_wake(build, poisoned):
    cache = cache_over(build, poisoned, committed=40)
    cache.release_physical()
    cache.commit_ahead(50)
    time.sleep(0.2)
    assert cache.grown_blocks == 0 and cache.physical_bytes == 0, f"the worker grew {cache.grown_blocks} blocks in sleep"
    cache.recommit()
    until(lambda: cache.grown_blocks == 90, f"after the wake: grown {cache.grown_blocks} of 90")
    expect_zero_blocks(cache, 0, 90)


@pytest.mark.invariant(5, 6)
def test_a_failed_background_step_is_raised_once_by_the_next_commit_and_changes_nothing(build, poisoned):
    faults = FaultInjectingDriver(poisoned)
    cache = cache_over(build, faults)
    # Each step of a granule's blocks maps one chunk in each of 3 segments:
    # the 4th map is the second step's first.
    faults.fail_in("map", 4)
    cache.commit_ahead(600, step_blocks=GRANULE_BLOCKS)
    until(lambda: faults.fired, "the planned fault never fired")
    with cache.buffer.lock:  # the failed step is over, its error kept, once the worker lets go
        grown = cache.grown_blocks
    assert grown == 10 + GRANULE_BLOCKS, f"the failed step changed the buffer: grown {grown}"
    with pytest.raises(BackgroundGrowthError, match="injected fault") as raised:
        cache.commit(25)
    assert cache.num_committed_blocks == 10 and cache.grown_blocks == grown, "the commit that raised changed the cache"
    assert raised.value.__cause__ is not None
    cache.commit(25)
    until(lambda: cache.grown_blocks == 625, f"after the retry: grown {cache.grown_blocks} of 625")
    expect_zero_blocks(cache, 10, 625)


@pytest.mark.invariant(5, 6)
@pytest.mark.parametrize("step", ["create", "map", "set_access"])
def test_every_driver_step_of_a_background_growth_rolls_back_when_it_fails(build, poisoned, usage, step):
    """The worker's first step fails in its first `step`: the buffer is as
    before (the driver's read-back agrees, the witness too), the next commit
    raises and changes nothing, and the one after completes the window over
    zeroed memory."""
    baseline = usage.read_outside_torch()
    faults = FaultInjectingDriver(poisoned)
    cache = cache_over(build, faults)
    faults.fail_in(step, 1)
    cache.commit_ahead(300, step_blocks=GRANULE_BLOCKS)
    until(lambda: faults.fired, f"the planned {step} fault never fired")
    with cache.buffer.lock:  # the failed step is over once the worker lets go
        assert cache.grown_blocks == 10, f"a failed {step} left grown {cache.grown_blocks}"
        check_readback_matches_bookkeeping(cache.buffer)
        check_usage_matches(usage, baseline, [cache.buffer])
    with pytest.raises(BackgroundGrowthError, match=rf"{step} \(injected fault"):
        cache.commit(20)
    assert cache.num_committed_blocks == 10
    cache.commit(20)
    until(lambda: cache.grown_blocks == 320, f"after the retry: grown {cache.grown_blocks} of 320")
    expect_zero_blocks(cache, 10, 320)
    check_readback_matches_bookkeeping(cache.buffer)
    check_usage_matches(usage, baseline, [cache.buffer])


@pytest.mark.invariant(5, 7)
def test_threads_committing_shrinking_and_sleeping_beside_the_worker_keep_the_cache_consistent(build, poisoned, usage):
    """Four threads commit, shrink, release and recommit at random while the
    worker grows; after each round, once the threads are done and the
    worker idle, the counts hold: grown at least committed, the driver's
    read-back as the bookkeeping, the witness as physical_bytes."""
    baseline = usage.read_outside_torch()
    cache = cache_over(build, poisoned)
    cache.commit_ahead(64, step_blocks=16)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(40):
                roll = rng.random()
                if roll < 0.6:
                    cache.commit(rng.randint(0, CAPACITY))
                elif roll < 0.75:
                    cache.commit(rng.randint(0, CAPACITY // 2), shrink=True)
                elif roll < 0.85:
                    cache.release_physical()
                else:
                    cache.recommit()
        except BaseException as error:  # collected: a thread's failure fails the test
            errors.append(error)

    for round_ in range(3):
        threads = [threading.Thread(target=work, args=(round_ * 10 + i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors
        cache.recommit()  # wakes it if the last thread left it asleep; awake, maps nothing
        until(lambda: cache.grown_blocks == min(cache.num_committed_blocks + 64, CAPACITY),
              f"round {round_}: grown {cache.grown_blocks}, committed {cache.num_committed_blocks}")
        with cache.buffer.lock:
            assert cache.grown_blocks >= cache.num_committed_blocks
            check_readback_matches_bookkeeping(cache.buffer)
            check_usage_matches(usage, baseline, [cache.buffer])
    cache.free()
    assert workers() == []


class _OutOfMemoryForGood(FaultInjectingDriver):
    """Its injected out-of-memory faults are final: no framework cache to
    return first. Over CUDA the tensor would empty torch's cache and retry
    the create once, and the retry, past the planned fault, succeeds."""

    def reclaim_cache(self) -> bool:
        return False


@pytest.mark.invariant(5)
def test_background_out_of_memory_stops_the_worker_silently_until_the_next_commit(build, poisoned):
    faults = _OutOfMemoryForGood(poisoned, out_of_memory=True)
    cache = cache_over(build, faults)
    faults.fail_in("create", 1)
    cache.commit_ahead(400, step_blocks=GRANULE_BLOCKS)
    until(lambda: faults.fired, "the planned fault never fired")
    assert cache.settle_commit_ahead(PATIENCE_S), "the worker never went idle after the out-of-memory"
    assert cache.grown_blocks == 10, f"grown {cache.grown_blocks}"
    cache.commit(11)  # raises nothing: the engine never asked for those blocks
    until(lambda: cache.grown_blocks == 411, f"after the next commit: grown {cache.grown_blocks} of 411")


class _Pool(WrappingDriver):
    """Free memory as a pool of `pool` bytes less what was created through
    this driver: a reading the test sets (a real one moves with the rest of
    the machine), which falls as the cache grows, as a device's does."""

    def __init__(self, inner, pool: int):
        super().__init__(inner)
        self.pool, self.held = pool, 0

    def _create(self, size: int):
        chunk = super()._create(size)
        self.held += chunk.size
        return chunk

    def _release(self, chunk) -> None:
        super()._release(chunk)
        self.held -= chunk.size

    def memory_info(self) -> tuple[int, int]:
        return self.pool - self.held, 128 << 30


@pytest.mark.invariant(5)
def test_the_worker_never_grows_into_the_headroom(build, poisoned):
    """The worker stops where `committable_blocks()` does, and grows on
    once more memory is free."""
    pool = _Pool(poisoned, 0)
    cache = cache_over(build, pool)
    # A headroom of 4 GiB keeps 4 + 3 GiB free (sizing.committable_bytes):
    # the pool leaves the cache three more granules.
    cache.reserved_headroom_bytes = 4 << 30
    granule = cache.buffer.granularity
    pool.pool = pool.held + (7 << 30) + 3 * granule
    allowed = cache.committable_blocks()  # constant as the cache grows: free falls as it maps
    assert 10 < allowed < 500, f"committable {allowed}: the pool leaves no test"
    cache.commit_ahead(500)
    assert cache.settle_commit_ahead(PATIENCE_S), f"the worker never went idle: grown {cache.grown_blocks}"
    assert cache.grown_blocks == allowed, f"grown {cache.grown_blocks} blocks; committable {allowed}"
    pool.pool += granule
    more = cache.committable_blocks()
    assert allowed < more < 511, f"committable {more} after {allowed}: the pool leaves no test"
    cache.commit(11)  # wakes the worker, which reads again
    assert cache.settle_commit_ahead(PATIENCE_S), f"the worker never went idle: grown {cache.grown_blocks}"
    assert cache.grown_blocks == more, f"grown {cache.grown_blocks} of {more} once memory allows"


class _CountedReads(WrappingDriver):
    """Counts the commit-ahead worker's reads of free memory."""

    def __init__(self, inner):
        super().__init__(inner)
        self.worker_reads = 0

    def memory_info(self) -> tuple[int, int]:
        if threading.current_thread().name == "extkv-commit-ahead":
            self.worker_reads += 1
        return super().memory_info()


@pytest.mark.invariant(5)
def test_the_worker_reads_free_memory_once_per_wake_not_per_step(build, poisoned):
    """A read of the device's free memory per step cost the engine's steps
    on the GPU (extkv.ahead): the worker reads its ceiling at the first step
    of a wake and keeps it for the steps that follow, and a wake reads again."""
    counted = _CountedReads(poisoned)
    cache = cache_over(build, counted)
    cache.commit_ahead(100, step_blocks=10)
    assert cache.settle_commit_ahead(PATIENCE_S), f"the worker never went idle: grown {cache.grown_blocks}"
    assert cache.commit_ahead_steps >= 10, f"{cache.commit_ahead_steps} steps: the window needs ten"
    assert counted.worker_reads == 1, f"{counted.worker_reads} reads of free memory over one wake's steps"
    cache.commit(30)  # a commit of new blocks wakes the worker: 20 blocks, two steps
    assert cache.settle_commit_ahead(PATIENCE_S), f"the worker never went idle: grown {cache.grown_blocks}"
    assert cache.grown_blocks == 130, f"grown {cache.grown_blocks} blocks; the window ends at 130"
    assert counted.worker_reads == 2, f"{counted.worker_reads} reads after a second wake; expected 2"
    cache.free()


@pytest.mark.invariant(7)
def test_a_forked_child_frees_its_copy_without_touching_the_parents_worker(build):
    """Forked while the worker steps one block at a time: the child's copy
    of the cache frees at once (it has no worker of its own to stop), and
    the parent's worker goes on growing."""
    cache = cache_over(build, driver_for("cpu"))
    cache.commit_ahead(CAPACITY, step_blocks=1)
    until(lambda: cache.grown_blocks > 20, f"grown {cache.grown_blocks}")
    child = os.fork()
    if child == 0:
        code = 1
        try:
            signal.alarm(10)  # a child stuck in free is a failure, not a hang
            cache.free()
            code = 0 if cache.is_freed else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"the child's free exited {os.waitstatus_to_exitcode(status)}"
    until(lambda: cache.grown_blocks == CAPACITY, f"the parent's worker stopped at {cache.grown_blocks}")


@pytest.mark.invariant(6)
@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ({"window_blocks": -1}, "window_blocks"),
        ({"window_blocks": 10, "max_blocks": 0}, "max_blocks"),
        ({"window_blocks": 10, "max_blocks": CAPACITY + 1}, "max_blocks"),
        ({"window_blocks": 10, "step_blocks": 0}, "step_blocks"),
        ({"window_blocks": True}, "window_blocks"),
    ],
)
def test_bad_policy_numbers_are_refused_and_start_nothing(build, poisoned, arguments, expected):
    cache = cache_over(build, poisoned)
    with pytest.raises(ValueError, match=expected):
        cache.commit_ahead(**arguments)
    assert workers() == [] and cache.commit_ahead_steps == 0 and cache.grown_blocks == 10


@pytest.mark.invariant(6)
def test_commit_ahead_on_a_freed_cache_is_refused(build, poisoned):
    cache = cache_over(build, poisoned)
    cache.free()
    with pytest.raises(Exception, match="commit_ahead"):
        cache.commit_ahead(10)
    assert workers() == []


# -- a model decoding beside the worker ---------------------------------------------------
#: The runner's blocks are 16 KiB per layer, 128 to a granule: a sequence on
#: blocks from 126 crosses into the second granule of every layer at its
#: 33rd token.
FIRST_BLOCK = 126
DECODE_STEPS = 48


def decode_committing(runner: ReferenceModelRunner, *, use_graph: bool) -> torch.Tensor:
    """Greedy decode of one sequence on blocks FIRST_BLOCK on, committing
    the block of each position just before the step that writes it, as an
    engine does; the logits of every step."""
    c = runner.config
    # Entries past the sequence's blocks point at the null block, as the
    # attention gathers every entry.
    table = torch.zeros((1, c.max_blocks_per_seq), dtype=torch.int64, device=runner.device)
    token = torch.tensor([7], device=runner.device)
    kv_cache = runner.extensible_kv_cache
    seen = []
    for length in range(DECODE_STEPS):
        chunk = length // c.block_size
        if kv_cache is not None:
            kv_cache.commit(FIRST_BLOCK + chunk + 1)
        table[0, chunk] = FIRST_BLOCK + chunk
        position = torch.tensor([length], device=runner.device)
        logits = runner.decode(token, position, table, position + 1, use_graph=use_graph)
        token = logits.argmax(-1)
        seen.append(logits)
    return torch.stack(seen)


@pytest.mark.invariant(1, 5)
def test_a_model_decodes_beside_the_worker_as_on_memory_allocated_up_front(device, usage):
    """The reference model decodes while commit-ahead grows the cache under
    it (on a GPU by replaying graphs captured before any growth): its logits
    equal those of a runner whose cache was allocated whole, bit for bit;
    the layers' views never move; the witness agrees with physical_bytes."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    plain = ReferenceModelRunner(device, 256, extensible=False)
    runner = ReferenceModelRunner(device, 256)
    try:
        plain.allocate_kv_cache()
        expected = decode_committing(plain, use_graph=False)
        baseline = usage.read_outside_torch()
        runner.allocate_kv_cache()
        use_graph = device.type == "cuda"
        if use_graph:
            runner.capture_cuda_graphs([1])
        kv_cache = runner.extensible_kv_cache
        kv_cache.commit(FIRST_BLOCK)
        pointers = [view.data_ptr() for view in runner.kv_caches]
        mapped = kv_cache.physical_bytes
        kv_cache.commit_ahead(4, step_blocks=2)
        served = decode_committing(runner, use_graph=use_graph)
        assert torch.equal(served, expected), "logits beside the worker differ from the preallocated runner's"
        assert kv_cache.physical_bytes > mapped, "nothing was mapped during the decode"
        assert kv_cache.commit_ahead_steps > 0, "the worker made no step"
        assert [view.data_ptr() for view in runner.kv_caches] == pointers, "a layer's view moved"
        check_usage_matches(usage, baseline, [kv_cache.buffer])
    finally:
        runner.free()
        plain.free()
        torch.backends.cuda.matmul.allow_tf32 = previous
    assert workers() == []


# -- the worker beside the caller's locks, free, forks and errors around its steps ------
class _ObservedLock:
    """The reservation's real lock, which tells the test when the worker
    asks for it: so a test can act while the worker waits for a lock the
    test holds, with no sleep."""

    def __init__(self, real):
        self.real = real
        self.worker_waits = threading.Event()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if threading.current_thread().name == "extkv-commit-ahead":
            self.worker_waits.set()
        return self.real.acquire(blocking, timeout)

    def release(self) -> None:
        self.real.release()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()


def finishes(call, what: str) -> None:
    """Run `call` on a thread of its own; a call that never returns (a
    deadlock) fails the test instead of hanging it."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as error:  # collected: raised below
            errors.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(PATIENCE_S)
    assert not thread.is_alive(), f"{what} never returned: a deadlock"
    if errors:
        raise errors[0]


@pytest.mark.invariant(7)
@pytest.mark.parametrize("stop", ["free", "commit_ahead(0)"])
def test_stopping_the_worker_under_the_callers_lock_returns_and_leaves_no_worker(build, poisoned, stop):
    """`buffer.lock` is re-entrant for callers: one that holds it, while the
    worker waits for it, may free the cache or turn commit-ahead off."""
    cache = cache_over(build, poisoned)
    observed = cache.buffer.lock = _ObservedLock(cache.buffer.lock)
    cache.commit_ahead(100, step_blocks=10)
    assert cache.settle_commit_ahead(PATIENCE_S)

    def stop_holding_the_lock() -> None:
        with cache.buffer.lock:
            observed.worker_waits.clear()
            cache.commit(50)  # counted without the lock; wakes the worker, which asks for it
            assert observed.worker_waits.wait(PATIENCE_S), "the worker never asked for the lock"
            cache.free() if stop == "free" else cache.commit_ahead(0)

    finishes(stop_holding_the_lock, f"{stop} under the caller's lock")
    assert workers() == [], f"workers alive after {stop}: {workers()}"
    assert cache.commit_ahead_window == 0
    cache.free()


@pytest.mark.invariant(7)
def test_a_commit_of_no_new_blocks_leaves_the_worker_asleep(build, poisoned):
    """An engine commits its count before every step; only a commit that
    counts new blocks moves the window. The settled worker is not woken by
    commits that count none (it never asks for the reservation's lock), and
    is by the next one that counts a new block."""
    cache = cache_over(build, poisoned)
    observed = cache.buffer.lock = _ObservedLock(cache.buffer.lock)
    cache.commit_ahead(100, step_blocks=10)
    assert cache.settle_commit_ahead(PATIENCE_S)
    observed.worker_waits.clear()
    for _ in range(20):
        cache.commit(10)
    assert cache.settle_commit_ahead(PATIENCE_S)
    assert not observed.worker_waits.is_set(), "a commit of no new blocks woke the worker, which asked for the lock"
    cache.commit(11)
    assert observed.worker_waits.wait(PATIENCE_S), "a commit of a new block never woke the worker"
    assert cache.settle_commit_ahead(PATIENCE_S)
    cache.free()


class _HeldStep(WrappingDriver):
    """Holds the commit-ahead worker inside its next map until `go` is set:
    a step in flight while other threads turn the worker off and on."""

    def __init__(self, inner):
        super().__init__(inner)
        self.inside, self.go = threading.Event(), threading.Event()

    def _map(self, address: int, chunk) -> None:
        if threading.current_thread().name == "extkv-commit-ahead" and not self.go.is_set():
            self.inside.set()
            self.go.wait(PATIENCE_S)
        super()._map(address, chunk)


@pytest.mark.invariant(7)
def test_commit_ahead_racing_free_and_itself_leaves_no_worker_after_free(build, poisoned):
    """With a step in flight, threads change the worker's window and free
    the cache, all called before the step ends: whatever the order, a cache
    has at most one worker, and none once free() has returned."""
    for trial in range(20):
        held = _HeldStep(poisoned)
        cache = cache_over(build, held)
        cache.commit_ahead(CAPACITY, step_blocks=1)
        assert held.inside.wait(PATIENCE_S), "the worker never stepped"
        refused: list[BaseException] = []
        calling = [threading.Event() for _ in range(3)]

        def turn_on(window: int, called: threading.Event) -> None:
            called.set()
            try:
                cache.commit_ahead(window, step_blocks=1)
            except StateError as error:  # freed first: refused
                refused.append(error)

        def free(called: threading.Event) -> None:
            called.set()
            cache.free()

        threads = [threading.Thread(target=turn_on, args=(w, c)) for w, c in zip((50, 100), calling)]
        threads.append(threading.Thread(target=free, args=(calling[2],)))
        for thread in threads:
            thread.start()
        for called in calling:
            assert called.wait(PATIENCE_S)
        held.go.set()
        for thread in threads:
            thread.join(PATIENCE_S)
        assert not any(thread.is_alive() for thread in threads), f"trial {trial}: a call never returned"
        assert cache.is_freed and workers() == [], f"trial {trial}: workers alive after free: {workers()}"
        assert all("not allowed on a freed cache" in str(error) for error in refused), refused


@pytest.mark.invariant(6, 7)
def test_a_commit_inside_the_window_is_refused_where_a_locked_commit_is(build, poisoned):
    """The count without the lock checks what the locked commit checks: a
    freed cache and a broken one refuse a commit of blocks the worker had
    ready, and nothing changes."""
    freed = cache_over(build, poisoned)
    freed.commit_ahead(100)
    assert freed.settle_commit_ahead(PATIENCE_S)
    freed.free()
    with pytest.raises(StateError, match="not allowed on a freed cache"):
        freed.commit(50)

    faults = FaultInjectingDriver(poisoned)
    broken = cache_over(build, faults)
    broken.commit_ahead(100, max_blocks=110)
    assert broken.settle_commit_ahead(PATIENCE_S) and broken.grown_blocks == 110
    # A locked commit past the window whose access grant fails, and the
    # unmap that would undo it too: the buffer breaks.
    faults.fail_in("set_access", 1)
    faults.fail_in("unmap", 1)
    with pytest.raises(DriverError, match="injected fault"):
        broken.commit(600)
    assert broken.is_broken
    with pytest.raises(StateError, match="not allowed on a broken cache"):
        broken.commit(50)
    assert broken.num_committed_blocks == 10, f"a refused commit counted: {broken.num_committed_blocks}"
    broken.free()
    assert workers() == []


@pytest.mark.invariant(6, 7)
def test_a_forked_childs_copy_refuses_a_commit_inside_the_window_and_commits_its_own_cache(build):
    """Forked while the worker runs: the child's copy refuses a commit of
    blocks the parent's worker had ready (they are the parent's, and not
    mapped in the child), and a cache the child makes commits as usual."""
    cache = cache_over(build, driver_for("cpu"))
    cache.commit_ahead(100)
    assert cache.settle_commit_ahead(PATIENCE_S) and cache.grown_blocks == 110
    child = os.fork()
    if child == 0:
        code = 1
        try:
            signal.alarm(60)  # a child stuck is a failure, not a hang
            try:
                cache.commit(50)
                code = 2  # counted blocks it does not have
            except StateError:
                own = cache_over(build, driver_for("cpu"))
                own.commit(40)
                code = 0 if own.num_committed_blocks == 40 and cache.num_committed_blocks == 10 else 3
                own.free()
            cache.free()
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"the child exited {os.waitstatus_to_exitcode(status)}"
    cache.commit(50)
    assert cache.num_committed_blocks == 50
    cache.free()


class _FailingReading(WrappingDriver):
    """`memory_info()` fails the next `failures` times, as a process out of
    descriptors fails to read /proc/meminfo: an error outside any step."""

    def __init__(self, inner):
        super().__init__(inner)
        self.failures = 0

    def memory_info(self) -> tuple[int, int]:
        if self.failures:
            self.failures -= 1
            raise OSError(errno.EMFILE, "Too many open files (injected)")
        return self.inner.memory_info()


@pytest.mark.invariant(4, 7)
def test_a_settled_window_reads_zero_however_late_the_device_zeroes(build, poisoned):
    """Settling orders the caller's next work after the worker's zeroing,
    which ran on a stream of its own: each zeroing is held back on the
    device, so a read not ordered after it sees the poison. The read's
    kernels are loaded first: a kernel's first launch waits for the work
    queued before it, and would order the read by itself."""
    warm_up_kernels(poisoned.device)
    late = LateZeroingDriver(poisoned)
    cache = cache_over(build, late)
    late.synchronize()  # only the worker's zeroing runs late, not the first commit's
    cache.commit_ahead(100, step_blocks=50)
    assert cache.settle_commit_ahead(PATIENCE_S) and cache.grown_blocks == 110, f"grown {cache.grown_blocks} of 110"
    expect_zero_blocks(cache, 10, 110)
    assert late.held > 0 or late.kind != "cuda", "no zeroing was held back: the test proved nothing"
    cache.free()


@pytest.mark.invariant(4, 7)
def test_a_commit_inside_the_window_reads_zero_however_late_the_device_zeroes(build, poisoned):
    """A commit counted inside the window, the worker's zeroing still queued
    on its own stream: the caller's next work waits for it."""
    warm_up_kernels(poisoned.device)  # as above: no first launch orders the read
    late = LateZeroingDriver(poisoned)
    cache = cache_over(build, late)
    late.synchronize()  # only the worker's zeroing runs late, not the first commit's
    cache.commit_ahead(100, step_blocks=50)
    until(lambda: cache.grown_blocks == 110, f"grown {cache.grown_blocks} of 110")
    cache.commit(110)
    expect_zero_blocks(cache, 10, 110)
    cache.free()


@pytest.mark.invariant(5, 6)
def test_an_error_around_a_step_is_kept_and_the_worker_lives_on(build, poisoned):
    """The worker's reading of free memory fails: the next commit raises it,
    the one after runs, and the worker, still alive, grows the window."""
    reading = _FailingReading(poisoned)
    cache = cache_over(build, reading)
    reading.failures = 1
    cache.commit_ahead(100)
    assert cache.settle_commit_ahead(PATIENCE_S)
    assert workers() == ["extkv-commit-ahead"], "the worker's thread ended"
    assert cache.grown_blocks == 10, f"grown {cache.grown_blocks} past a failed reading"
    with pytest.raises(BackgroundGrowthError, match="Too many open files") as raised:
        cache.commit(20)
    assert cache.num_committed_blocks == 10 and isinstance(raised.value.__cause__, OSError)
    cache.commit(20)
    assert cache.settle_commit_ahead(PATIENCE_S)
    assert cache.grown_blocks == 120, f"after the retry: grown {cache.grown_blocks} of 120"
    expect_zero_blocks(cache, 10, 120)
    cache.free()
