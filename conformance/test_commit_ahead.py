"""Commit-ahead (extkv.ahead): a background worker keeps blocks mapped and
zeroed past what the engine committed.

Every test runs the worker for real, on the host driver and on each CUDA
device, over a poisoning driver so that zeroing is checked over non-zero
memory. The worker's progress is waited for by polling its counts with a
deadline (it runs on its own thread); a count that never comes fails with
the counts it reached.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest
import torch

from extkv import KVCacheLayout
from extkv.ahead import BackgroundGrowthError
from extkv.reference_model import ReferenceModelRunner
from extkv.testing.checks import check_all_equal, check_readback_matches_bookkeeping, check_usage_matches
from extkv.testing.configs import config_for
from extkv.vmm import FaultInjectingDriver, PoisoningDriver, driver_for

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
    until(lambda: cache.grown_blocks == 400, f"grown {cache.grown_blocks}: max_blocks is 400")
    time.sleep(0.05)
    assert cache.grown_blocks == 400, f"the worker grew past max_blocks: {cache.grown_blocks}"


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
    time.sleep(0.05)
    assert cache.grown_blocks == 10, f"grown {cache.grown_blocks}"
    cache.commit(11)  # raises nothing: the engine never asked for those blocks
    until(lambda: cache.grown_blocks == 411, f"after the next commit: grown {cache.grown_blocks} of 411")


@pytest.mark.invariant(5)
def test_the_worker_never_grows_into_the_headroom(build, poisoned):
    cache = cache_over(build, poisoned)
    free, _ = cache.buffer.driver.memory_info()
    # Leave room for about 30 more blocks past what is mapped.
    cache.reserved_headroom_bytes = max(0, free - 30 * cache.bytes_per_block)
    allowed = cache.committable_blocks()
    cache.commit_ahead(500)
    time.sleep(0.3)
    assert cache.grown_blocks <= max(allowed, cache.committable_blocks()) + 1, (
        f"grown {cache.grown_blocks} blocks; committable {allowed} before, {cache.committable_blocks()} now"
    )


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
