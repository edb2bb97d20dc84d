"""SleepController: vLLM's sleep/wake_up and torch_memory_saver's
pause/resume over extkv caches and tensors, on the host driver and each GPU.

Every test runs over `PoisoningDriver` (each chunk it creates reads 0xA5
before extkv sees it), so a woken byte that reads zero was zeroed by extkv,
and a kept byte that reads its pattern was copied back, not left over.
Physical memory is read from outside extkv (NVML / memfd pages) before a
sleep, asleep and awake; addresses are compared across every sleep and wake.
Failures report counts of wrong bytes, never a view's contents.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading

import pytest
import torch

from extkv import (
    DriverError,
    ExtensibleKVCache,
    FaultInjectingDriver,
    KVCacheConfig,
    KVCacheLayout,
    SleepController,
    StateError,
)
from extkv.sleep import WHILE_ASLEEP, TagState
from extkv.testing.asleep import SCENARIOS, check_wakes_as_promised, scenarios_of
from extkv.testing.checks import (
    check_all_equal,
    check_readback_matches_bookkeeping,
    check_unchanged,
    check_usage_matches,
    snapshot,
)
from extkv.testing.configs import CAPACITY, config_for
from extkv.testing.ctrl_c import python_handles_ctrl_c
from extkv.vmm import PoisoningDriver, driver_for

POISON = 0xA5
BLOCKS = 300


@pytest.fixture
def poisoned(device) -> PoisoningDriver:
    return PoisoningDriver(driver_for(device), POISON)


def fill(buffer, seed: int) -> list[torch.Tensor]:
    """A distinct, never-zero, never-poison pattern over each segment's
    committed bytes; copies of what was written."""
    patterns = []
    for i, size in enumerate(buffer.segment_sizes):
        view = buffer.segment_view(i)
        period = ((torch.arange(241, dtype=torch.int32) * 7 + seed + 31 * i) % 160 + 1).to(torch.uint8)  # 1..160
        view.copy_(period.to(view.device).repeat(-(-size // 241))[:size])
        patterns.append(view.clone())
    return patterns


def expect_patterns(buffer, patterns: list[torch.Tensor], what: str) -> None:
    assert buffer.segment_sizes == [p.numel() for p in patterns], f"{what}: sizes {buffer.segment_sizes}"
    for i, pattern in enumerate(patterns):
        check_all_equal(buffer.segment_view(i), pattern, f"{what}: segment {i}")


def expect_zero(buffer, sizes: list[int], what: str) -> None:
    assert buffer.segment_sizes == sizes, f"{what}: sizes {buffer.segment_sizes}, expected {sizes}"
    for i in range(len(sizes)):
        check_all_equal(buffer.segment_view(i), 0, f"{what}: segment {i}")


def addresses(target, kind: str = "full") -> list[int]:
    """The base and each segment's address; for a block-compact cache of
    config `kind`, every committed layer view's `data_ptr` too."""
    if not isinstance(target, ExtensibleKVCache):
        return [target.base, *(target.base + offset for offset in target.segment_offsets)]
    config = config_for(kind, target.layout)
    views = target.committed_views(
        KVCacheConfig(target.num_committed_blocks, config.kv_cache_tensors, config.kv_cache_groups), target.layout
    )
    return [*addresses(target.buffer), *(view.data_ptr() for view in (views or {}).values())]


def kv_cache(build, driver, kind: str = "full", layout: KVCacheLayout = KVCacheLayout.LBHNC, blocks: int = BLOCKS):
    cache = build.cache(config_for(kind, layout), layout, device=driver)
    cache.commit(blocks)
    return cache


def weights(build, driver):
    """A plain tensor of three segments, committed ragged (not on granules)."""
    granule = driver.granularity
    tensor = build.tensor(6 * granule, device=driver, segment_capacities=[2 * granule] * 3)
    tensor.resize_segments_([granule + 1234, 2 * granule, 77], zero_new=True)
    return tensor


def buffers(*targets) -> list:
    return [t.buffer if isinstance(t, ExtensibleKVCache) else t for t in targets]


# -- the levels -----------------------------------------------------------------
@pytest.mark.invariant(1, 4, 5)
def test_sleep_level_2_releases_every_tag_and_wakes_zeroed_at_the_same_addresses(case, build, poisoned, usage):
    """Level 2 discards everything, `offload=True` included: the memory goes
    back (read outside extkv), and the wake maps fresh poisoned chunks that
    read zero, at the addresses every view had."""
    baseline = usage.read_outside_torch()
    kind, layout, _ = case
    kv, w = kv_cache(build, poisoned, kind, layout), weights(build, poisoned)
    engine = SleepController()
    engine.register(kv)
    engine.register(w, tag="weights", offload=True)
    fill(kv.buffer, seed=1)
    fill(w, seed=2)
    sizes = [b.segment_sizes for b in buffers(kv, w)]
    before = [addresses(kv, kind), addresses(w)]
    physical = kv.physical_bytes_for(BLOCKS)
    engine.sleep(level=2)
    assert engine.is_sleeping and engine.states == {"kv_cache": TagState.ASLEEP, "weights": TagState.ASLEEP}
    assert kv.physical_bytes == w.physical_bytes == 0 and engine.offloaded_bytes == 0
    check_usage_matches(usage, baseline, buffers(kv, w))  # nothing above the baseline
    created = poisoned.poisoned_chunks
    engine.wake_up()
    assert not engine.is_sleeping and engine.states == {"kv_cache": "awake", "weights": "awake"}
    assert poisoned.poisoned_chunks > created, "the wake created no poisoned chunk: the test proves nothing"
    assert kv.num_committed_blocks == BLOCKS and kv.physical_bytes == physical
    check_usage_matches(usage, baseline, buffers(kv, w))
    for target, size, what in ((kv.buffer, sizes[0], "KV cache"), (w, sizes[1], "weights")):
        expect_zero(target, size, f"{what} after level 2")
    assert [addresses(kv, kind), addresses(w)] == before


@pytest.mark.invariant(1, 4, 5)
def test_sleep_level_1_keeps_offloaded_bytes_exactly_and_discards_the_rest(case, build, poisoned, usage):
    """Level 1: a registration with `offload=True` (weights, and here a KV
    cache too) comes back byte for byte over fresh poisoned chunks; a KV
    cache registered as vLLM's is discarded and wakes zeroed. Host copies
    hold exactly the committed bytes while asleep, and none after."""
    baseline = usage.read_outside_torch()
    kind, layout, _ = case
    discarded, kept = kv_cache(build, poisoned, kind, layout), kv_cache(build, poisoned, kind, layout)
    w = weights(build, poisoned)
    engine = SleepController()
    engine.register(discarded)
    engine.register(kept, tag="prefix_cache", offload=True)
    engine.register(w, tag="weights", offload=True)
    fill(discarded.buffer, seed=3)
    kept_patterns, weight_patterns = fill(kept.buffer, seed=4), fill(w, seed=5)
    before = [addresses(t, kind) for t in (discarded, kept, w)]
    engine.sleep(level=1)
    assert all(b.physical_bytes == 0 for b in buffers(discarded, kept, w))
    check_usage_matches(usage, baseline, buffers(discarded, kept, w))
    assert engine.offloaded_bytes == sum(map(torch.Tensor.numel, kept_patterns + weight_patterns))
    created = poisoned.poisoned_chunks
    engine.wake_up()
    assert poisoned.poisoned_chunks > created
    expect_patterns(kept.buffer, kept_patterns, "offloaded KV cache")
    expect_patterns(w, weight_patterns, "offloaded weights")
    expect_zero(discarded.buffer, kept.buffer.segment_sizes, "discarded KV cache")
    assert engine.offloaded_bytes == 0 and not engine.is_sleeping
    check_usage_matches(usage, baseline, buffers(discarded, kept, w))
    assert [addresses(t, kind) for t in (discarded, kept, w)] == before


@pytest.mark.invariant(4, 5)
def test_wake_up_wakes_only_the_tags_named(build, poisoned, usage):
    """vLLM's RLHF weight update: sleep at level 2, wake the weights alone
    and load new ones while the KV cache still holds no memory, then wake
    the KV cache. `is_sleeping` stays true until every tag is awake."""
    baseline = usage.read_outside_torch()
    kv, w = kv_cache(build, poisoned), weights(build, poisoned)
    engine = SleepController()
    engine.register(kv)
    engine.register(w, tag="weights")
    engine.sleep(level=2)
    engine.wake_up(tags=["weights"])
    assert engine.states == {"kv_cache": "asleep", "weights": "awake"} and engine.is_sleeping
    assert kv.physical_bytes == 0 and w.physical_bytes > 0
    check_usage_matches(usage, baseline, buffers(kv, w))
    new_weights = fill(w, seed=6)  # the update writes into woken, zeroed weights
    engine.wake_up(tags=["kv_cache"])
    assert not engine.is_sleeping and kv.physical_bytes == kv.physical_bytes_for(BLOCKS)
    expect_patterns(w, new_weights, "weights written between the two wakes")
    expect_zero(kv.buffer, [BLOCKS * s for s in kv.segment_strides], "KV cache woken second")
    check_usage_matches(usage, baseline, buffers(kv, w))


@pytest.mark.invariant(1, 4)
def test_sleeping_a_sleeping_tag_or_waking_an_awake_one_is_a_no_op(build, poisoned, caplog):
    """As in vLLM: a second sleep, even at level 2, discards nothing the
    first kept; a wake of an awake tag maps and zeroes nothing. Each says
    so in a warning."""
    kv, w = kv_cache(build, poisoned), weights(build, poisoned)
    engine = SleepController()
    engine.register(kv)
    engine.register(w, tag="weights", offload=True)
    patterns = fill(w, seed=7)
    engine.sleep(level=1)
    kept = engine.offloaded_bytes
    with caplog.at_level(logging.WARNING, logger="extkv.sleep"):
        engine.sleep(level=2)
    assert "asleep already" in caplog.text and engine.offloaded_bytes == kept
    engine.wake_up()
    expect_patterns(w, patterns, "weights after a second, level-2 sleep")
    kv_patterns = fill(kv.buffer, seed=8)
    states = [snapshot(kv), snapshot(w)]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="extkv.sleep"):
        engine.wake_up()
        engine.wake_up(tags=["kv_cache", "weights"])
    assert caplog.text.count("awake already") == 2
    check_unchanged(kv, states[0])
    check_unchanged(w, states[1])
    expect_patterns(kv.buffer, kv_patterns, "KV cache after waking it awake")


# -- torch_memory_saver's words ---------------------------------------------------
@pytest.mark.invariant(1, 4, 5)
def test_pause_and_resume_one_tag_or_every_tag(build, poisoned, usage):
    """`pause(tag)` releases that tag alone and leaves the others' bytes
    and chunks as they were; `pause()` releases every tag; `resume` brings
    back what `offload=True` kept, and zeroed pages for the rest."""
    baseline = usage.read_outside_torch()
    kv, w = kv_cache(build, poisoned), weights(build, poisoned)
    engine = SleepController()
    engine.register(kv)
    engine.register(w, tag="weights", offload=True)
    fill(kv.buffer, seed=9)
    patterns = fill(w, seed=10)
    untouched = snapshot(kv)
    engine.pause("weights")
    assert engine.states == {"kv_cache": "awake", "weights": "asleep"} and w.physical_bytes == 0
    check_unchanged(kv, untouched)
    check_usage_matches(usage, baseline, buffers(kv, w))
    engine.resume("weights")
    expect_patterns(w, patterns, "weights resumed alone")
    check_unchanged(kv, untouched)
    pointers = [addresses(kv), addresses(w)]
    engine.pause()
    assert kv.physical_bytes == w.physical_bytes == 0
    check_usage_matches(usage, baseline, buffers(kv, w))
    engine.resume()
    expect_patterns(w, patterns, "weights resumed with every tag")
    expect_zero(kv.buffer, [BLOCKS * s for s in kv.segment_strides], "KV cache resumed")
    check_usage_matches(usage, baseline, buffers(kv, w))
    assert [addresses(kv), addresses(w)] == pointers


@pytest.mark.invariant(6)
def test_pausing_a_paused_tag_or_resuming_an_awake_one_raises_and_changes_nothing(build, poisoned):
    """As torch_memory_saver refuses (it exits the process): a StateError
    naming the tag and its state, and no tag or object moved, also when
    the call names every tag and only one of them is in the wrong state."""
    kv, w = kv_cache(build, poisoned), weights(build, poisoned)
    engine = SleepController()
    engine.register(kv)
    engine.register(w, tag="weights", offload=True)
    fill(kv.buffer, seed=11)
    with pytest.raises(StateError, match="tag 'kv_cache' is awake; nothing was changed"):
        engine.resume("kv_cache")
    engine.pause("weights")
    states, kv_before, held = engine.states, snapshot(kv), engine.offloaded_bytes
    for refused, match in ((lambda: engine.pause("weights"), "tag 'weights' is asleep"),
                           (engine.pause, "tag 'weights' is asleep"),
                           (engine.resume, "tag 'kv_cache' is awake")):
        with pytest.raises(StateError, match=match):
            refused()
        assert engine.states == states and engine.offloaded_bytes == held
        check_unchanged(kv, kv_before)
    assert w.physical_bytes == 0


@pytest.mark.invariant(6)
def test_bad_input_is_a_value_error_naming_it_and_changes_nothing(build, poisoned):
    kv, w = kv_cache(build, poisoned), weights(build, poisoned)
    other = weights(build, poisoned)
    engine = SleepController()
    engine.register(kv)
    engine.register(w, tag="weights", offload=True)
    engine.pause("weights")  # one tag asleep, so a half-done wake would show
    states, kept = engine.states, engine.offloaded_bytes
    before = {"kv": snapshot(kv), "other": snapshot(other)}
    bad_calls = [
        (lambda: engine.sleep(level=3), r"level must be an int >= 1 and <= 2 \(1 or 2: vLLM's sleep levels.*got 3"),
        (lambda: engine.sleep(level=0), r"level must be .*level 0, pausing the scheduler, is the engine's\), got 0"),
        (lambda: engine.sleep(level=True), "level must be an int .*got True"),
        (lambda: engine.sleep(level=1.0), "level must be an int .*got 1.0"),
        (lambda: engine.sleep(level="1"), "level must be an int .*got '1'"),
        (lambda: engine.wake_up(tags=["weights", "kv"]),
         r"wake_up: tag 'kv' is not registered; registered tags: \['kv_cache', 'weights'\]"),
        (lambda: engine.wake_up(tags="weights"), r"tags must be a list of tag names.*did you mean \['weights'\]"),
        (lambda: engine.wake_up(tags=[]), "tags must name at least one tag"),
        (lambda: engine.wake_up(tags=[3]), "a tag must be a non-empty str, got 3"),
        (lambda: engine.pause("weight"), "pause: tag 'weight' is not registered"),
        (lambda: engine.resume("kv"), "resume: tag 'kv' is not registered"),
        (lambda: engine.state("kv"), "state: tag 'kv' is not registered"),
        (lambda: engine.register(kv.buffer.segment_view(0)), r"ExtensibleTensor, got a torch.Tensor of shape \(\d+,\)"),
        (lambda: engine.register("a cache"), "ExtensibleTensor, got 'a cache'"),
        (lambda: engine.register(kv, tag="again"), "is registered already: it, under tag 'kv_cache'"),
        (lambda: engine.register(kv.buffer), "the ExtensibleKVCache that owns its reservation, under tag 'kv_cache'"),
        (lambda: engine.register(other, tag=""), "register: a tag must be a non-empty str, got ''"),
        (lambda: engine.register(other, tag=None), "register: a tag must be a non-empty str, got None"),
        (lambda: engine.register(other, offload=1), "offload must be a bool.*got 1"),
        (lambda: engine.unregister(other), "unregister: ExtensibleTensor.* is not registered here"),
    ]
    for call, match in bad_calls:
        with pytest.raises(ValueError, match=match):
            call()
        assert engine.states == states and engine.offloaded_bytes == kept, f"{match}: the controller changed"
        check_unchanged(kv, before["kv"])
        check_unchanged(other, before["other"])
        assert w.physical_bytes == 0, f"{match}: the sleeping tag woke"


@pytest.mark.invariant(6)
def test_a_registration_that_cannot_move_is_refused_before_anything_changes(build, poisoned):
    """A freed cache refuses every operation, so a word that would move it
    raises before the first copy or release, naming it; registering into a
    sleeping tag, or unregistering a sleeping object, is refused too."""
    first, second = kv_cache(build, poisoned), kv_cache(build, poisoned)
    engine = SleepController()
    engine.register(first, offload=True)
    engine.register(second)
    fill(first.buffer, seed=12)
    before = snapshot(first)
    second.free()
    for word in (engine.sleep, engine.pause):
        with pytest.raises(StateError, match="ExtensibleKVCache registered under tag 'kv_cache' is freed; unregister"):
            word()
        check_unchanged(first, before)
        assert engine.offloaded_bytes == 0 and engine.state("kv_cache") == "awake"
    engine.unregister(second)
    engine.sleep()
    third = kv_cache(build, poisoned)
    with pytest.raises(StateError, match="register: tag 'kv_cache' is asleep; register while it is awake"):
        engine.register(third)
    with pytest.raises(StateError, match="unregister: .* is asleep under tag 'kv_cache'; wake it first"):
        engine.unregister(first)
    assert engine.tags == ["kv_cache"] and third.physical_bytes > 0
    engine.wake_up()
    expect_patterns(first.buffer, before.contents, "the live cache")


# -- failures part way ------------------------------------------------------------
def fragmented_cache(build, driver):
    """A cache over several chunks per segment, so a release can fail between two."""
    cache = kv_cache(build, driver, blocks=100)
    cache.commit(300)
    cache.commit(CAPACITY)
    return cache


@pytest.mark.invariant(4, 5)
def test_a_sleep_or_wake_that_fails_part_way_is_completed_by_calling_it_again(build, poisoned, usage):
    """A release that fails in the second cache leaves its tag partly
    asleep: the first cache released, the second partly, the copies kept.
    Sleeping again releases the rest and copies nothing twice. A wake whose
    create fails in the second cache leaves the first awake; waking again
    completes it, and every kept byte is back, every other zero. (The fault
    is a plain driver error: on CUDA an out-of-memory create is retried once
    after torch's cache is returned, which test_tensor proves.)"""
    baseline = usage.read_outside_torch()
    faulty = FaultInjectingDriver(poisoned)
    first, second = kv_cache(build, poisoned, blocks=CAPACITY), fragmented_cache(build, faulty)
    w = weights(build, poisoned)
    engine = SleepController()
    engine.register(first, offload=True)
    engine.register(second, offload=True)
    engine.register(w, tag="weights")
    patterns = [fill(first.buffer, seed=13), fill(second.buffer, seed=14)]
    assert second.buffer.num_physical_chunks > 1
    faulty.fail_in("release", 2)
    with pytest.raises(DriverError, match="injected fault"):
        engine.sleep(level=1)
    assert engine.states == {"kv_cache": "partly asleep", "weights": "awake"} and engine.is_sleeping
    assert first.physical_bytes == 0 and 0 < second.physical_bytes < second.physical_bytes_for(CAPACITY)
    held = engine.offloaded_bytes
    assert held == sum(p.numel() for segments in patterns for p in segments)
    # No usage check here: the chunk whose release failed is unmapped, so
    # unbooked, but still holds its pages until the retry releases it.
    engine.sleep(level=1)
    assert engine.states == {"kv_cache": "asleep", "weights": "asleep"} and engine.offloaded_bytes == held
    check_usage_matches(usage, baseline, buffers(first, second, w))
    faulty.fail_in("create", 1)
    with pytest.raises(DriverError, match="injected fault"):
        engine.wake_up()
    assert engine.states == {"kv_cache": "partly asleep", "weights": "asleep"}
    expect_patterns(first.buffer, patterns[0], "the cache woken before the failure")
    check_usage_matches(usage, baseline, buffers(first, second, w))
    engine.wake_up()
    assert not engine.is_sleeping and engine.offloaded_bytes == 0
    check_readback_matches_bookkeeping(second.buffer)
    expect_patterns(second.buffer, patterns[1], "the cache whose release and recommit failed")
    expect_zero(w, [w.granularity + 1234, 2 * w.granularity, 77], "weights, discarded")
    check_usage_matches(usage, baseline, buffers(first, second, w))


@pytest.mark.invariant(6)
def test_host_memory_running_out_for_a_copy_changes_nothing(build, poisoned, monkeypatch):
    """Every copy is taken before the first release: when host memory runs
    out copying the second registration, the first is still mapped and
    whole, no copy is held and every tag is awake."""
    kv, w = kv_cache(build, poisoned), weights(build, poisoned)
    engine = SleepController()
    engine.register(kv, offload=True)
    engine.register(w, tag="weights", offload=True)
    fill(kv.buffer, seed=15)
    fill(w, seed=16)
    before = [snapshot(kv), snapshot(w)]
    empty, calls = torch.empty, []

    def host_memory_runs_out(*args, **kwargs):
        calls.append(args)
        if len(calls) > len(kv.buffer.segment_sizes):  # the first copy of the second registration
            raise MemoryError("host memory exhausted (injected)")
        return empty(*args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(torch, "empty", host_memory_runs_out)
        with pytest.raises(MemoryError, match="injected"):
            engine.sleep(level=1)
    assert engine.states == {"kv_cache": "awake", "weights": "awake"} and engine.offloaded_bytes == 0
    check_unchanged(kv, before[0])
    check_unchanged(w, before[1])


# -- threads ----------------------------------------------------------------------
@pytest.fixture
def fine_thread_switches():
    """Python threads take turns every 0.1 ms instead of every 5 ms. An
    operation makes dozens of system calls, and after each its thread waits
    for the GIL held by a thread that never blocks (a reader polling the
    states): at 5 ms a wait, one pause of a tag takes about 0.1 s and holds
    the machine's commit lock for most of it against every other process's
    commit. Operations and reads interleave no less often than at 5 ms."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    yield
    sys.setswitchinterval(interval)


@pytest.mark.invariant(7)
@pytest.mark.usefixtures("fine_thread_switches")
def test_threads_pausing_and_resuming_their_own_tags_keep_every_tag_whole(build, poisoned, usage):
    """Four threads pause and resume a tag each, twenty times, while a fifth
    reads the states: each operation runs whole, one after another, so every
    kept byte is back, every tag awake and the memory as booked."""
    baseline = usage.read_outside_torch()
    engine = SleepController()
    tensors = [weights(build, poisoned) for _ in range(4)]
    for index, tensor in enumerate(tensors):
        engine.register(tensor, tag=f"t{index}", offload=True)
    patterns = [fill(tensor, seed=20 + index) for index, tensor in enumerate(tensors)]
    errors: list[BaseException] = []
    done = threading.Event()

    def cycle(tag: str) -> None:
        try:
            for _ in range(20):
                engine.pause(tag)
                engine.resume(tag)
        except Exception as error:  # reported by the main thread
            errors.append(error)

    def read() -> None:
        while not done.is_set():
            try:
                assert set(engine.states.values()) <= set(TagState)
            except Exception as error:
                errors.append(error)
                return

    workers = [threading.Thread(target=cycle, args=(f"t{i}",)) for i in range(4)]
    reader = threading.Thread(target=read)
    reader.start()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    done.set()
    reader.join()
    assert not errors, f"{len(errors)} thread(s) failed, first: {errors[0]!r}"
    assert not engine.is_sleeping and engine.offloaded_bytes == 0
    for index, tensor in enumerate(tensors):
        expect_patterns(tensor, patterns[index], f"tensor {index} after 20 pauses")
        check_readback_matches_bookkeeping(tensor)
    check_usage_matches(usage, baseline, tensors)


@pytest.mark.invariant(7)
@pytest.mark.long
def test_threads_fighting_over_one_tag_see_whole_operations_in_turn(build, poisoned, usage):
    """Four threads pause and resume every tag at once. One at a time, each
    call finds the state the previous one left: it moves the tag or raises
    StateError having changed nothing, so the calls that succeeded
    alternate, pause first, and the kept bytes survive them all."""
    baseline = usage.read_outside_torch()
    kv, w = kv_cache(build, poisoned), weights(build, poisoned)
    engine = SleepController()
    engine.register(kv, offload=True)
    engine.register(w, tag="weights", offload=True)
    patterns = [fill(kv.buffer, seed=30), fill(w, seed=31)]
    moved: list[str] = []
    errors: list[BaseException] = []

    def fight(seed: int) -> None:
        try:
            for step in range(30):
                word = "pause" if (seed + step) % 2 else "resume"
                try:
                    getattr(engine, word)()
                except StateError:
                    continue
                moved.append(word)  # inside no lock: the order of appends is not the order of calls
        except Exception as error:  # reported by the main thread
            errors.append(error)

    workers = [threading.Thread(target=fight, args=(seed,)) for seed in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert not errors, f"{len(errors)} thread(s) failed, first: {errors[0]!r}"
    pauses, resumes = moved.count("pause"), moved.count("resume")
    assert pauses - resumes in (0, 1), f"{pauses} pauses and {resumes} resumes succeeded: two ran as one"
    assert engine.state("kv_cache") == engine.state("weights") == ("asleep" if pauses > resumes else "awake")
    if pauses > resumes:
        engine.resume()
    expect_patterns(kv.buffer, patterns[0], "KV cache after the fight")
    expect_patterns(w, patterns[1], "weights after the fight")
    check_usage_matches(usage, baseline, buffers(kv, w))


# -- locks held by callers, and Ctrl-C ----------------------------------------------
#: Seconds a test waits for a thread before calling it stuck: a safety net, never the synchronization.
SAFETY_S = 30.0


@contextlib.contextmanager
def noticing_a_take_of(lock, noticed: threading.Event):
    """Sets `noticed` when the calling thread calls `lock`'s `acquire` or
    `__enter__` (a profile hook of this thread alone; the call goes on):
    from then on the thread is inside an operation that wants the lock."""

    def hook(frame, event, arg):
        if event == "c_call" and getattr(arg, "__self__", None) is lock and arg.__name__ in ("acquire", "__enter__"):
            noticed.set()

    previous = sys.getprofile()
    sys.setprofile(hook)
    try:
        yield
    finally:
        sys.setprofile(previous)


@pytest.mark.invariant(7)
def test_a_thread_holding_a_cache_lock_reads_the_states_while_a_sleep_waits_for_that_lock(poisoned):
    """A scheduler thread holds the cache's lock (re-entrant, for callers to
    hold) and asks the controller where its tags stand while another thread's
    sleep waits for that lock: reads never wait behind an operation, so both
    finish; the read sees the state before the sleep, which runs once the
    lock is let go. (The cache is freed here only once both threads ended:
    a deadlock would hold its lock for good.)"""
    kv = ExtensibleKVCache(config_for("full", KVCacheLayout.LBHNC), poisoned, KVCacheLayout.LBHNC)
    kv.commit(BLOCKS)
    engine = SleepController()
    engine.register(kv, offload=True)
    patterns = fill(kv.buffer, seed=40)
    holding, sleep_wants_the_lock = threading.Event(), threading.Event()
    seen, errors = {}, []

    def scheduler() -> None:
        try:
            with kv.buffer.lock:
                holding.set()
                assert sleep_wants_the_lock.wait(SAFETY_S), "the sleep never asked for the cache's lock"
                seen.update(state=engine.state("kv_cache"), states=engine.states, sleeping=engine.is_sleeping,
                            offloaded=engine.offloaded_bytes, text=repr(engine))
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    def sleeper() -> None:
        try:
            assert holding.wait(SAFETY_S), "the scheduler never took the cache's lock"
            with noticing_a_take_of(kv.buffer.lock, sleep_wants_the_lock):
                engine.sleep(level=1)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=scheduler, daemon=True), threading.Thread(target=sleeper, daemon=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(SAFETY_S)
    stuck = [thread.name for thread in threads if thread.is_alive()]
    assert not stuck, f"after {SAFETY_S} s, threads {stuck} still wait: the read and the sleep deadlocked"
    try:
        assert not errors, f"{len(errors)} thread(s) failed, first: {errors[0]!r}"
        assert seen == {"state": TagState.AWAKE, "states": {"kv_cache": TagState.AWAKE}, "sleeping": False,
                        "offloaded": 0, "text": "SleepController(kv_cache: awake (1))"}, seen
        assert engine.state("kv_cache") == "asleep" and kv.physical_bytes == 0
        engine.wake_up()
        expect_patterns(kv.buffer, patterns, "the cache slept once the scheduler let go")
    finally:
        kv.free()


@pytest.mark.invariant(6)
def test_ctrl_c_ends_a_sleep_waiting_for_a_cache_lock_and_changes_nothing(build, poisoned):
    """Another thread holds the cache's lock; the main thread's sleep waits
    for it; SIGINT, sent once the sleep wants the lock, raises
    KeyboardInterrupt out of the sleep while the lock is still held, and
    every tag, byte and copy is as before: the controller then sleeps and
    wakes as ever."""
    kv, w = kv_cache(build, poisoned), weights(build, poisoned)
    engine = SleepController()
    engine.register(kv, offload=True)
    engine.register(w, tag="weights", offload=True)
    patterns = [fill(kv.buffer, seed=41), fill(w, seed=42)]
    holding, sleep_wants_the_lock, interrupted = threading.Event(), threading.Event(), threading.Event()
    gave_up = []

    def holder() -> None:
        with kv.buffer.lock:
            holding.set()
            if sleep_wants_the_lock.wait(SAFETY_S):
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            if not interrupted.wait(SAFETY_S):
                gave_up.append("the lock, still waited for")

    thread = threading.Thread(target=holder, daemon=True)
    try:
        thread.start()
        assert holding.wait(SAFETY_S), "the holder never took the cache's lock"
        with python_handles_ctrl_c(), pytest.raises(KeyboardInterrupt):
            with noticing_a_take_of(kv.buffer.lock, sleep_wants_the_lock):
                engine.sleep(level=1)
    finally:
        interrupted.set()
        thread.join(SAFETY_S)
    assert sleep_wants_the_lock.is_set(), "the sleep never asked for the cache's lock: the test proves nothing"
    assert not gave_up, f"Ctrl-C did not end the sleep's wait: after {SAFETY_S} s the holder let go of {gave_up[0]}"
    assert engine.states == {"kv_cache": "awake", "weights": "awake"} and engine.offloaded_bytes == 0
    expect_patterns(kv.buffer, patterns[0], "KV cache after the interrupted sleep")
    expect_patterns(w, patterns[1], "weights after the interrupted sleep")
    engine.sleep(level=1)
    engine.wake_up()
    expect_patterns(kv.buffer, patterns[0], "KV cache slept after the interrupt")


# -- commit-ahead -------------------------------------------------------------------
def cache_mapped_ahead(build, driver, committed: int = 100, ahead: int = 64):
    """A cache of `committed` blocks with commit-ahead on and its worker
    idle, `ahead` blocks mapped and zeroed past them."""
    cache = kv_cache(build, driver, blocks=committed)
    cache.commit_ahead(ahead)
    assert cache.settle_commit_ahead(60), "the worker never went idle"
    assert cache.num_committed_blocks == committed and cache.grown_blocks == committed + ahead
    return cache


def fill_committed(cache, seed: int) -> list[torch.Tensor]:
    """`fill`'s pattern over each segment's committed blocks only; copies."""
    patterns = []
    for i, stride in enumerate(cache.segment_strides):
        view = cache.buffer.segment_view(i)[: cache.num_committed_blocks * stride]
        period = ((torch.arange(241, dtype=torch.int32) * 7 + seed + 31 * i) % 160 + 1).to(torch.uint8)
        view.copy_(period.to(view.device).repeat(-(-view.numel() // 241))[: view.numel()])
        patterns.append(view.clone())
    return patterns


def expect_committed(cache, patterns: list[torch.Tensor], what: str) -> None:
    for i, pattern in enumerate(patterns):
        check_all_equal(cache.buffer.segment_view(i)[: pattern.numel()], pattern, f"{what}: segment {i}")


@pytest.mark.invariant(1, 4)
def test_an_offloaded_cache_with_blocks_mapped_ahead_wakes_with_every_committed_byte(build, poisoned):
    """With commit-ahead on, blocks are mapped past the committed ones. The
    copy keeps the committed bytes, which are the contents; the wake maps
    the committed blocks and writes every byte back, and the tag wakes whole
    and can be unregistered."""
    kv = cache_mapped_ahead(build, poisoned)
    patterns = fill_committed(kv, seed=43)
    engine = SleepController()
    engine.register(kv, offload=True)
    engine.sleep(level=1)
    assert kv.physical_bytes == 0 and engine.offloaded_bytes == 100 * kv.bytes_per_block
    engine.wake_up()
    assert engine.states == {"kv_cache": "awake"} and engine.offloaded_bytes == 0
    assert kv.num_committed_blocks == 100
    expect_committed(kv, patterns, "committed blocks after the wake")
    engine.unregister(kv)


@pytest.mark.invariant(4)
def test_a_failed_wake_of_an_offloaded_cache_with_blocks_mapped_ahead_completes_when_called_again(build, poisoned):
    """A wake whose recommit fails (a map refused) leaves the tag sleeping
    and the copy held; the next wake completes it, every committed byte back."""
    faulty = FaultInjectingDriver(poisoned)
    kv = cache_mapped_ahead(build, faulty)
    patterns = fill_committed(kv, seed=44)
    engine = SleepController()
    engine.register(kv, offload=True)
    engine.sleep(level=1)
    held = engine.offloaded_bytes
    faulty.fail_in("map", 1)
    with pytest.raises(DriverError, match="injected fault"):
        engine.wake_up()
    assert faulty.fired and engine.is_sleeping and engine.offloaded_bytes == held
    engine.wake_up()
    assert engine.states == {"kv_cache": "awake"} and engine.offloaded_bytes == 0
    with kv.buffer.lock:  # awake, the worker maps again: read back between its steps
        check_readback_matches_bookkeeping(kv.buffer)
    expect_committed(kv, patterns, "committed blocks after the second wake")
    engine.unregister(kv)


@pytest.mark.invariant(4, 7)
def test_no_commit_is_counted_between_an_offloaded_sleeps_copy_and_its_release(build, poisoned):
    """A scheduler thread commits blocks the worker has ready while the
    controller's sleep has copied the cache and not yet released it: the
    commit waits for the sleep to end (the copy would lack the blocks it
    counted), and the wake brings back the committed bytes of the copy."""
    kv = cache_mapped_ahead(build, poisoned)
    patterns = fill_committed(kv, seed=45)
    engine = SleepController()
    engine.register(kv, offload=True)
    copied, committing, counted = threading.Event(), threading.Event(), threading.Event()

    def hook(frame, event, arg):
        if event == "return" and frame.f_code.co_name == "copy_out" and not copied.is_set():
            copied.set()
            assert committing.wait(60), "the scheduler thread never committed"
            # A commit counted without the lock returns at once; one that
            # waits for the sleep's lock does not return before the release.
            counted.wait(1.0)

    def schedule() -> None:
        assert copied.wait(60)
        committing.set()
        kv.commit(130)
        counted.set()

    scheduler = threading.Thread(target=schedule)
    scheduler.start()
    previous = sys.getprofile()
    sys.setprofile(hook)
    try:
        engine.sleep(level=1)
        counted_during_the_sleep = counted.is_set()
    finally:
        sys.setprofile(previous)
    scheduler.join(60)
    assert not counted_during_the_sleep, "a commit was counted between the sleep's copy and its release"
    assert engine.offloaded_bytes == 100 * kv.bytes_per_block
    engine.wake_up()
    expect_committed(kv, patterns, "committed blocks after the wake")


# -- operations on a sleeping, offloaded cache ------------------------------------------
#: A layer-outermost layout (three segments, apart) and a block-outermost one (one segment).
ASLEEP_LAYOUTS = [KVCacheLayout.LBHNC, KVCacheLayout.BLHNC]


@pytest.mark.invariant(1, 4)
@pytest.mark.parametrize("layout", ASLEEP_LAYOUTS, ids=lambda layout: layout.name)
@pytest.mark.parametrize("row", list(WHILE_ASLEEP))
def test_an_offloaded_cache_changed_while_asleep_wakes_as_its_row_says(device, row, layout):
    """Each operation a KV cache allows while its offloaded registration
    sleeps, in a child (extkv.testing.asleep: a write past the committed
    bytes kills its process): the wake writes back exactly the blocks the
    row of WHILE_ASLEEP keeps, every other committed byte reads zero over
    poison, no pattern byte is read past the committed ones, the tag is
    awake and no host copy is held."""
    names = scenarios_of(row)
    assert names, f"WHILE_ASLEEP's row {row!r} has no scenario in extkv.testing.asleep"
    check_wakes_as_promised(device, layout, names)


@pytest.mark.invariant(1, 4, 7)
@pytest.mark.parametrize("layout", ASLEEP_LAYOUTS, ids=lambda layout: layout.name)
def test_a_worker_growing_at_the_sleep_then_a_shrink_while_asleep_wakes_with_the_kept_blocks(device, layout):
    """A commit-ahead worker is mapping blocks past the committed ones when
    the cache is put to sleep; a shrink keeping contents follows while it
    sleeps. The wake maps the kept blocks and writes them back, the worker
    grows on past them, zeroed, and nothing of the copy lands there."""
    name = "worker running, then preserving shrink"
    assert SCENARIOS[name].worker_running
    check_wakes_as_promised(device, layout, [name])


@pytest.mark.invariant(1, 4, 7)
@pytest.mark.parametrize("layout", ASLEEP_LAYOUTS, ids=lambda layout: layout.name)
def test_a_shrink_racing_the_wake_from_a_thread_ends_the_same_either_way(device, layout):
    """A scheduler thread shrinks keeping contents while the main thread
    wakes, both released by one barrier: before the wake, the wake writes
    the kept blocks back; after it, the awake shrink keeps them. Either
    way they hold their bytes and a growth back reads zero past them."""
    check_wakes_as_promised(device, layout, ["preserving shrink beside the wake"])


@pytest.mark.invariant(1, 4)
def test_an_offloaded_tensor_grown_while_asleep_wakes_grown_with_its_copy_back(build, poisoned):
    """A plain tensor grown while its tag sleeps (the growth maps it
    again): the wake keeps the grown sizes, never shrinking them, writes
    the copy back within the sizes it had at the sleep, and the bytes the
    growth added read zero."""
    w = weights(build, poisoned)
    engine = SleepController()
    engine.register(w, tag="weights", offload=True)
    patterns = fill(w, seed=46)
    slept = w.segment_sizes
    engine.sleep(level=1)
    grown = [2 * w.granularity] * 3
    w.resize_segments_(grown, zero_new=True)
    engine.wake_up()
    assert engine.states == {"weights": "awake"} and engine.offloaded_bytes == 0
    assert w.segment_sizes == grown, f"sizes {w.segment_sizes} after the wake, grown to {grown}"
    for i, (size, pattern) in enumerate(zip(slept, patterns)):
        check_all_equal(w.segment_view(i)[:size], pattern, f"segment {i}'s bytes at the sleep")
        check_all_equal(w.segment_view(i)[size:], 0, f"segment {i}'s bytes grown while asleep")
