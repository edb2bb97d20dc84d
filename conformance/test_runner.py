"""The runner lifecycle on a real model: CUDA graphs replayed over blocks
committed after capture, the whole lifecycle end to end against a runner that
preallocated everything, sleep/wake measured outside extkv, weight updates."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from torch import nn

from extkv import DriverError, FaultInjectingDriver, KVCacheLayout, OutOfMemoryError, StateError, driver_for
from extkv.connector import KVConnector, SegmentExportConnector
from extkv.reference_model import ReferenceModelRunner, TinyDecoderConfig
from extkv.runner import (
    WeightUpdateMemoryError,
    ensure_kv_cache_blocks,
    extend_kv_cache,
    kv_cache_lent_for_weight_update,
    max_layer_reload_bytes,
    num_committable_kv_blocks,
    registers_kv_cache_memory,
)
from extkv.testing.checks import check_readback_matches_bookkeeping, check_usage_matches
from extkv.testing.configs import config_for, fill_segments
from extkv.testing.exclusive import Inconclusive, until_conclusive
from extkv.testing.readings import InjectedReadingsDriver
from extkv.vmm import device_memory_info
from extkv.vmm.wrapping import WrappingDriver

CAPACITY = 256
BATCHES = [1, 2, 4]


@pytest.fixture(autouse=True)
def exact_float32():
    """Graph and eager must agree bit for bit; TF32 would still agree, but
    the plain-runner comparison should not depend on it."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


@pytest.fixture
def runners():
    made: list[ReferenceModelRunner] = []

    def make(*args, **kwargs) -> ReferenceModelRunner:
        runner = ReferenceModelRunner(*args, **kwargs)
        made.append(runner)
        return runner

    yield make
    for runner in made:
        runner.free()


class Sequences:
    """A batch of sequences whose blocks start at `first_block`, so a test can
    place them on blocks that were not committed when graphs were captured."""

    def __init__(self, runner: ReferenceModelRunner, batch: int, first_block: int, seed: int = 1):
        c = runner.config
        self.runner = runner
        self.block_tables = (
            torch.arange(batch * c.max_blocks_per_seq, device=runner.device).view(batch, c.max_blocks_per_seq)
            + first_block
        )
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, c.vocab_size, (batch,), generator=generator).to(runner.device)
        self.length = 0

    def step(self, *, use_graph: bool = False) -> torch.Tensor:
        """Decode the current tokens at the next position; feed back argmax."""
        batch = self.tokens.shape[0]
        positions = torch.full((batch,), self.length, dtype=torch.int64, device=self.runner.device)
        logits = self.runner.decode(self.tokens, positions, self.block_tables, positions + 1, use_graph=use_graph)
        self.tokens = logits.argmax(-1)
        self.length += 1
        return logits


def cache_contents(runner: ReferenceModelRunner) -> list[torch.Tensor]:
    buffer = runner.extensible_kv_cache.buffer
    return [buffer.segment_view(i).clone() for i in range(len(buffer.segment_sizes))]


def restore_contents(runner: ReferenceModelRunner, contents: list[torch.Tensor]) -> None:
    buffer = runner.extensible_kv_cache.buffer
    for i, content in enumerate(contents):
        buffer.segment_view(i).copy_(content)


def assert_graph_matches_eager(runner: ReferenceModelRunner, first_block: int, prompt: int = 20) -> None:
    """For every captured batch size: prefill eagerly, then one decode step by
    eager execution and by graph replay from the same cache state; logits and
    the cache afterwards must be identical bit for bit."""
    for batch in BATCHES:
        sequences = Sequences(runner, batch, first_block)
        for _ in range(prompt):
            sequences.step()
        before, tokens, length = cache_contents(runner), sequences.tokens.clone(), sequences.length
        eager = sequences.step()
        after_eager = cache_contents(runner)
        restore_contents(runner, before)
        sequences.tokens, sequences.length = tokens, length
        replayed = sequences.step(use_graph=True)
        assert torch.equal(eager, replayed), f"batch {batch}: graph logits differ from eager"
        assert all(torch.equal(a, b) for a, b in zip(after_eager, cache_contents(runner))), f"batch {batch}: cache differs"
        assert bool(torch.isfinite(eager).all())


@pytest.mark.invariant(2)
@pytest.mark.cuda_graphs
def test_graphs_captured_before_growth_replay_on_new_blocks(runners):
    runner = runners("cuda", CAPACITY)
    runner.allocate_kv_cache()
    ensure_kv_cache_blocks(runner, 8)
    runner.capture_cuda_graphs(BATCHES)
    kv_cache = runner.extensible_kv_cache
    # The first block past every granule mapped at capture: the sequences
    # below live on pages that did not exist when the graphs were captured.
    first_block = -(-kv_cache.buffer.granularity // min(kv_cache.segment_strides))
    for offset, stride in zip(kv_cache.segment_offsets, kv_cache.segment_strides):
        assert kv_cache.buffer.driver.chunk_at(kv_cache.buffer.base + offset + first_block * stride) is None
    extend_kv_cache(runner, runner.allocated_config, CAPACITY)
    assert_graph_matches_eager(runner, first_block)

    # Growth left two chunks per segment; a content-preserving defragment
    # moves every segment onto one chunk.
    sizes = kv_cache.buffer.segment_sizes
    assert not all(kv_cache.buffer.segments_backed_by_one_chunk(sizes))
    contents = cache_contents(runner)
    kv_cache.commit(CAPACITY, defragment=True, preserve_contents=True)
    one_chunk = kv_cache.buffer.segments_backed_by_one_chunk(sizes)
    assert all(one_chunk), f"segments backed by one chunk after the defragmenting extend: {one_chunk}"
    kept = [torch.equal(a, b) for a, b in zip(contents, cache_contents(runner))]
    assert all(kept), f"layers whose contents the defragmentation changed: {[i for i, k in enumerate(kept) if not k]}"
    assert_graph_matches_eager(runner, first_block)

    # Sleep and wake: same addresses, fresh zeroed pages; the graphs still hold.
    runner.sleep()
    assert kv_cache.physical_bytes == 0
    runner.wake()
    nonzero = [int(c.count_nonzero()) for c in cache_contents(runner)]
    assert nonzero == [0] * len(nonzero), f"non-zero bytes per layer after recommit: {nonzero}"
    assert_graph_matches_eager(runner, first_block)


def generate(runner: ReferenceModelRunner, first_block: int, steps: int, *, use_graph: bool) -> torch.Tensor:
    sequences = Sequences(runner, 4, first_block, seed=7)
    return torch.stack([sequences.step(use_graph=use_graph) for _ in range(steps)])


#: Free memory the lifecycle test's runner reads at every step: ample for
#: its cache, whatever the machine has free (the test never reads that).
LIFECYCLE_FREE_BYTES = 4 << 30


@pytest.mark.invariant(1, 4, 5)
def test_lifecycle_end_to_end_matches_a_preallocated_runner(device, usage, runners):
    """The runner sizes its cache from readings the test sets
    (`InjectedReadingsDriver`: every chunk, mapping and byte real), so what
    other processes do to the machine's free memory decides nothing."""
    use_graphs = device.type == "cuda"
    baseline = usage.read_outside_torch()
    real = driver_for(device)
    total = real.memory_info()[1]  # the machine's size, which no other process moves
    init_free = min(LIFECYCLE_FREE_BYTES, total // 2)
    readings = InjectedReadingsDriver(real, free=init_free, total=total)

    plain = runners(device, CAPACITY, extensible=False)
    plain.allocate_kv_cache()
    expected = generate(plain, first_block=32, steps=24, use_graph=False)

    runner = runners(device, CAPACITY, driver=readings)
    kv_cache = runner.extensible_kv_cache
    runner.profile_run(max_batch=max(BATCHES))
    runner.allocate_kv_cache()
    assert kv_cache.num_committed_blocks == 1
    warm = runner.warmup(BATCHES)
    assert warm == num_committable_kv_blocks(runner) == kv_cache.warmup_committable_blocks >= 1
    if use_graphs:
        runner.capture_cuda_graphs(BATCHES)
    num_blocks = runner.measure_and_extend(init_free_memory=init_free, requested_memory=init_free)
    assert num_blocks == CAPACITY == kv_cache.num_committed_blocks  # memory is ample: all of it
    assert runner.kv_cache_config.num_blocks == CAPACITY
    assert kv_cache.torch_memory_limit is not None
    check_usage_matches(usage, baseline, [kv_cache.buffer])

    served = generate(runner, first_block=32, steps=24, use_graph=use_graphs)
    assert torch.equal(served, expected)

    held = kv_cache.physical_bytes
    pointers = [view.data_ptr() for view in runner.kv_caches]
    runner.sleep()
    check_usage_matches(usage, baseline, [])  # the memory really went back
    runner.wake()
    assert held == kv_cache.physical_bytes
    check_usage_matches(usage, baseline, [kv_cache.buffer])
    assert [view.data_ptr() for view in runner.kv_caches] == pointers, "sleep/wake moved a layer's view"
    nonzero = [int(c.count_nonzero()) for c in cache_contents(runner)]
    assert nonzero == [0] * len(nonzero), f"non-zero bytes per layer after recommit: {nonzero}"
    assert torch.equal(generate(runner, first_block=32, steps=24, use_graph=use_graphs), expected)


@pytest.mark.invariant(3, 5)
def test_extend_shrinks_to_the_measured_budget(device, usage, runners):
    runner = runners(device, CAPACITY)
    baseline = usage.read_outside_torch()  # the model is loaded; the cache holds address space only
    runner.allocate_kv_cache()
    ensure_kv_cache_blocks(runner, CAPACITY)
    extend_kv_cache(runner, runner.allocated_config, 40)
    kv_cache = runner.extensible_kv_cache
    assert kv_cache.num_committed_blocks == 40 and kv_cache.physical_bytes == kv_cache.physical_bytes_for(40)
    check_usage_matches(usage, baseline, [kv_cache.buffer])
    storages = [view.untyped_storage().nbytes() for view in runner.kv_caches]
    expected = [40 * view.stride(0) * view.element_size() for view in runner.kv_caches]
    assert storages == expected, f"view storages {storages} bytes, 40 committed blocks span {expected}"
    assert not registers_kv_cache_memory(runner)


def new_weights(runner: ReferenceModelRunner, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(p.shape, generator=generator).to(p.dtype) for name, p in runner.model.state_dict().items()}


@pytest.mark.invariant(1)
def test_weight_update_with_enough_free_memory_keeps_the_cache(device, runners):
    runner = runners(device, CAPACITY)
    runner.allocate_kv_cache()
    ensure_kv_cache_blocks(runner, 64)
    kv_cache = runner.extensible_kv_cache
    kv_cache.buffer.segment_view(0).fill_(9)
    weights = new_weights(runner, seed=5)
    runner.update_weights(weights, reclaimable=False, fail_if_short=True)
    stale = [n for n, p in runner.model.state_dict().items() if not torch.equal(p.cpu(), weights[n])]
    assert not stale, f"parameters the update did not load: {stale}"
    assert kv_cache.num_committed_blocks == 64 and bool((kv_cache.buffer.segment_view(0) == 9).all())


class HugeLayerModel(nn.Module):
    """Describes a layer larger than the whole device without allocating it
    (meta parameters): what a weight update would need cannot be free."""

    def __init__(self, total_bytes: int):
        super().__init__()
        self.layer = nn.Linear(1, total_bytes // 4, bias=False, device="meta")


@pytest.mark.invariant(1, 4, 5)
def test_weight_update_borrows_a_reclaimable_cache_and_recommits_it(device, usage, runners):
    runner = runners(device, CAPACITY)
    runner.allocate_kv_cache()
    ensure_kv_cache_blocks(runner, CAPACITY)
    kv_cache = runner.extensible_kv_cache
    baseline = usage.read_outside_torch() - kv_cache.physical_bytes
    held = kv_cache.physical_bytes
    kv_cache.set_torch_memory_limit(1 << 40)
    _, total = device_memory_info(device)
    huge = HugeLayerModel(total)
    assert max_layer_reload_bytes(huge) >= total
    pointers = [v.data_ptr() for v in runner.kv_caches]
    kv_cache.buffer.segment_view(0).fill_(3)
    with kv_cache_lent_for_weight_update(kv_cache, huge, reclaimable=True, fail_if_short=True):
        assert kv_cache.physical_bytes == 0
        check_usage_matches(usage, baseline, [])
        assert kv_cache.torch_memory_limit is None  # the cap is lifted for the update
    assert kv_cache.physical_bytes == held
    check_usage_matches(usage, baseline, [kv_cache.buffer])
    assert kv_cache.num_committed_blocks == CAPACITY
    assert int(kv_cache.buffer.segment_view(0).count_nonzero()) == 0  # recommitted zeroed
    assert [v.data_ptr() for v in runner.kv_caches] == pointers
    assert kv_cache.torch_memory_limit == 1 << 40


@pytest.mark.invariant(6)
def test_weight_update_that_cannot_fit_fails_before_changing_anything(device, runners):
    runner = runners(device, CAPACITY)
    runner.allocate_kv_cache()
    ensure_kv_cache_blocks(runner, 16)
    kv_cache = runner.extensible_kv_cache
    _, total = device_memory_info(device)
    huge = HugeLayerModel(total)
    written = fill_segments(kv_cache, seed=5)
    chunks = kv_cache.buffer.mapped_chunks
    kv_cache.set_torch_memory_limit(1 << 40)
    with pytest.raises(WeightUpdateMemoryError, match="largest layer alone"):
        with kv_cache_lent_for_weight_update(kv_cache, huge, reclaimable=False, fail_if_short=True):
            pytest.fail("the update must not start")
    assert kv_cache.buffer.mapped_chunks == chunks, "a refused update must not remap the cache"
    kept = [torch.equal(kv_cache.buffer.segment_view(i), w) for i, w in enumerate(written)]
    assert all(kept), f"segments whose bytes the refused update changed: {[i for i, k in enumerate(kept) if not k]}"
    assert kv_cache.torch_memory_limit == 1 << 40, "a refused update must leave torch's cap alone"


class RecordedReadings(WrappingDriver):
    """`inner`, recording what each memory reading left a torch allocation:
    free memory plus torch's cached, unused blocks (what the lending
    decision compares), at the moment extkv read it."""

    def __init__(self, inner):
        super().__init__(inner)
        self.for_torch: list[int] = []

    def memory_info(self) -> tuple[int, int]:
        free, total = self.inner.memory_info()
        self.for_torch.append(free + torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device))
        return free, total


@pytest.mark.invariant(4, 5)
@pytest.mark.gpu
@pytest.mark.exclusive  # fills the GPU until a layer cannot be staged
def test_weight_update_on_a_full_gpu_borrows_the_cache(runners):
    """The real thing: fill the GPU until the model's next layer cannot be
    staged, then update every weight with the KV cache lent. Other jobs on
    the GPU may free or take memory meanwhile: the lending decision is
    judged by the reading extkv took (`RecordedReadings`), and an attempt
    another job decided is inconclusive and made again
    (extkv.testing.exclusive)."""
    # Layers of ~130 MB, so that what torch keeps cached (a few MB) cannot
    # cover the update by itself.
    readings = RecordedReadings(driver_for("cuda"))
    runner = runners("cuda", 16384, config=TinyDecoderConfig(hidden_size=2048), driver=readings)
    runner.allocate_kv_cache()
    ensure_kv_cache_blocks(runner, 16384)
    kv_cache = runner.extensible_kv_cache
    needed = 2 * max_layer_reload_bytes(runner.model)
    assert kv_cache.physical_bytes > 2 * needed
    weights = new_weights(runner, seed=11)
    try:
        until_conclusive(lambda: update_on_a_full_gpu(runner, readings, weights, needed))
    except Inconclusive as why:
        pytest.skip(f"inconclusive on this machine: {why}")
    # Checked with the GPU no longer full: the checks allocate too.
    stale = [n for n, p in runner.model.state_dict().items() if not torch.equal(p.cpu(), weights[n])]
    assert not stale, f"parameters the update did not load: {stale}"
    assert kv_cache.physical_bytes == kv_cache.physical_bytes_for(16384)


def update_on_a_full_gpu(runner, readings: RecordedReadings, weights, needed: int) -> None:
    """One attempt: the cache patterned, the GPU filled to about half of
    what the update needs, the update made; it must have lent the cache
    (recommitted zeroed), unless the reading it decided on saw the room
    another job freed. Out-of-memory beside the full GPU is another job
    taking the room the lent cache left; the cache is then checked whole."""
    kv_cache = runner.extensible_kv_cache
    kv_cache.buffer.segment_view(0).fill_(5)
    torch.cuda.empty_cache()
    hogs = fill_gpu_until_free_is(needed // 2)
    readings.for_torch.clear()
    try:
        runner.update_weights(weights, reclaimable=True, fail_if_short=True)
    except (torch.OutOfMemoryError, OutOfMemoryError) as error:
        hogs.clear()
        torch.cuda.empty_cache()
        if kv_cache.is_asleep:  # lent, and its recommit met the job too
            kv_cache.recommit()
        check_readback_matches_bookkeeping(kv_cache.buffer)
        assert kv_cache.physical_bytes == kv_cache.physical_bytes_for(16384)
        raise Inconclusive(f"the update beside the full GPU met out-of-memory: another job took the room ({error})") from error
    finally:
        hogs.clear()
        torch.cuda.empty_cache()
    decided_on = readings.for_torch[0]  # the lending decision's reading, the update's first
    lent = int(kv_cache.buffer.segment_view(0).count_nonzero()) == 0  # lent, then recommitted zeroed
    if not lent:
        assert decided_on >= needed, f"not lent, though extkv read {decided_on} bytes for torch, less than the {needed} needed"
        raise Inconclusive(f"another job freed memory before the decision: {decided_on} bytes for torch, {needed} needed")


def fill_gpu_until_free_is(target: int) -> list[torch.Tensor]:
    """Allocate through torch until the GPU has about `target` bytes free,
    in pieces of at most 8 GiB. A piece the device refuses (another job took
    the memory after the reading) halves the largest piece, down to a
    granule: the fill then stops, and the attempt's reading says so."""
    granule, largest, hogs = 2 << 20, 8 << 30, []
    while (excess := torch.cuda.mem_get_info()[0] - target) >= 2 * granule:
        size = min(excess - granule, largest) // granule * granule
        try:
            hogs.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError:
            if largest <= granule:
                break
            largest //= 2
    return hogs


# -- the committed geometry, argument checks, and every way out of a lend ------
class RecordingConnector:
    """A KVConnector that records what the runner hands it. It is the
    runner's behaviour under test; `fail_restore` makes `restore_kv_caches`
    raise the way a connector in the wrong state does."""

    def __init__(self, *, registers_kv_cache_memory: bool = False, fail_restore: bool = False):
        self.registers_kv_cache_memory = registers_kv_cache_memory
        self.fail_restore = fail_restore
        self.calls: list[tuple] = []

    def register_kv_caches(self, kv_cache, *, kv_cache_config=None) -> None:
        self.calls.append(("register", kv_cache, kv_cache_config))

    def unregister_kv_caches(self) -> None:
        self.calls.append(("unregister",))

    def restore_kv_caches(self) -> None:
        self.calls.append(("restore",))
        if self.fail_restore:
            raise StateError("restore_kv_caches() is not allowed: the RecordingConnector is closed")

    def close(self) -> None:
        self.calls.append(("close",))

    @property
    def operations(self) -> list[str]:
        return [call[0] for call in self.calls]


@pytest.mark.invariant(1)
@pytest.mark.parametrize("registers", [False, True], ids=["plain-connector", "registering-connector"])
def test_extend_hands_the_connector_the_committed_geometry(device, runners, registers):
    connector = RecordingConnector(registers_kv_cache_memory=registers)
    assert isinstance(connector, KVConnector)
    runner = runners(device, CAPACITY, connector=connector)
    runner.allocate_kv_cache()
    ensure_kv_cache_blocks(runner, 8)
    kv_cache, allocated, layout = runner.extensible_kv_cache, runner.allocated_config, runner.kv_cache_layout
    extend_kv_cache(runner, allocated, 40)

    # Unregistered before the commit remapped the memory, registered after.
    assert connector.operations == ["unregister", "register"]
    _, registered, given = connector.calls[-1]
    assert registered is kv_cache
    assert given.num_blocks == 40 == kv_cache.num_committed_blocks
    assert given.kv_cache_tensors == kv_cache.committed_kv_cache_tensors(allocated, layout, 40)
    assert given.kv_cache_tensors != allocated.kv_cache_tensors
    assert given.kv_cache_groups == allocated.kv_cache_groups
    # The committed placements are where the rebuilt views really are.
    views = dict(zip(runner.layer_names, runner.kv_caches))
    for tensor in given.kv_cache_tensors:
        for index, name in enumerate(tensor.layers):
            view = views[name]
            start = view.data_ptr() - view.untyped_storage().data_ptr()
            assert start == tensor.layer_offset(index)
            assert view.stride(0) * view.element_size() == tensor.block_stride
    # The runner's config keeps the allocated placements (views are located
    # from them) with the committed count; the caller's config is untouched.
    assert runner.kv_cache_config.num_blocks == 40
    assert runner.kv_cache_config.kv_cache_tensors == allocated.kv_cache_tensors
    assert allocated.num_blocks == CAPACITY


@pytest.mark.invariant(1, 6)
def test_extend_past_the_capacity_describes_what_was_committed(device, runners):
    connector = RecordingConnector()
    runner = runners(device, CAPACITY, connector=connector)
    runner.allocate_kv_cache()
    kv_cache = runner.extensible_kv_cache
    extend_kv_cache(runner, runner.allocated_config, CAPACITY + 100)
    _, _, given = connector.calls[-1]
    assert given.num_blocks == CAPACITY == kv_cache.num_committed_blocks == runner.kv_cache_config.num_blocks
    assert given.kv_cache_tensors == kv_cache.committed_kv_cache_tensors(
        runner.allocated_config, runner.kv_cache_layout, CAPACITY
    )


@pytest.mark.invariant(1)
def test_extend_registers_a_segment_export_connector_with_the_committed_config(device, runners):
    connector = SegmentExportConnector()
    try:
        runner = runners(device, CAPACITY, connector=connector)
        runner.allocate_kv_cache()
        extend_kv_cache(runner, runner.allocated_config, 40)
        kv_cache = runner.extensible_kv_cache
        assert connector.is_registered
        assert connector.kv_cache_config.num_blocks == 40
        assert connector.kv_cache_config.kv_cache_tensors == kv_cache.committed_kv_cache_tensors(
            runner.allocated_config, runner.kv_cache_layout, 40
        )
    finally:
        connector.close()


@pytest.mark.invariant(6)
@pytest.mark.parametrize("num_blocks", [-1, 0, None, True, 2.0, "40"], ids=repr)
def test_extend_refuses_a_bad_block_count_before_logging_or_changing_anything(device, runners, caplog, num_blocks):
    connector = RecordingConnector()
    runner = runners(device, CAPACITY, connector=connector)
    runner.allocate_kv_cache()
    ensure_kv_cache_blocks(runner, 16)
    kv_cache = runner.extensible_kv_cache
    config, pointers = runner.kv_cache_config, [view.data_ptr() for view in runner.kv_caches]
    caplog.set_level(logging.DEBUG, logger="extkv")
    with pytest.raises(ValueError, match=r"num_blocks must be .*got " + re.escape(repr(num_blocks))):
        extend_kv_cache(runner, runner.allocated_config, num_blocks)
    assert [record.getMessage() for record in caplog.records] == []
    assert kv_cache.num_committed_blocks == 16 and kv_cache.physical_bytes == kv_cache.physical_bytes_for(16)
    assert runner.kv_cache_config is config and [view.data_ptr() for view in runner.kv_caches] == pointers
    assert connector.calls == []


NOT_RUNNERS = [None, "runner", object(), nn.Linear(1, 1)]


@pytest.mark.invariant(6)
@pytest.mark.parametrize("not_a_runner", NOT_RUNNERS, ids=["None", "str", "object", "module"])
@pytest.mark.parametrize(
    "call",
    [
        lambda runner: registers_kv_cache_memory(runner),
        lambda runner: num_committable_kv_blocks(runner),
        lambda runner: ensure_kv_cache_blocks(runner, 4),
        lambda runner: extend_kv_cache(runner, config_for("full", KVCacheLayout.LBHNC), 4),
    ],
    ids=["registers_kv_cache_memory", "num_committable_kv_blocks", "ensure_kv_cache_blocks", "extend_kv_cache"],
)
def test_lifecycle_functions_refuse_what_is_not_a_runner(call, not_a_runner):
    expected = r"needs a model runner \(the Runner protocol\), got " + re.escape(repr(not_a_runner))
    with pytest.raises(ValueError, match=expected):
        call(not_a_runner)


@pytest.mark.invariant(6)
def test_lifecycle_functions_refuse_a_runner_with_a_bad_cache_or_connector(device, runners):
    runner = runners(device, CAPACITY)
    runner.allocate_kv_cache()
    kv_cache = runner.extensible_kv_cache
    runner.kv_connector = "connector"
    with pytest.raises(ValueError, match="runner.kv_connector must be a KVConnector .* or None, got 'connector'"):
        registers_kv_cache_memory(runner)
    runner.kv_connector = RecordingConnector(registers_kv_cache_memory="yes")
    with pytest.raises(ValueError, match="RecordingConnector.registers_kv_cache_memory must be a bool"):
        registers_kv_cache_memory(runner)
    with pytest.raises(ValueError, match="registers_kv_cache_memory must be a bool"):
        extend_kv_cache(runner, runner.allocated_config, 40)
    assert runner.kv_connector.calls == [] and kv_cache.num_committed_blocks == 1
    runner.kv_connector = None
    runner.extensible_kv_cache = "cache"
    try:
        with pytest.raises(ValueError, match="runner.extensible_kv_cache must be an ExtensibleKVCache or None, got 'c"):
            ensure_kv_cache_blocks(runner, 8)
    finally:
        runner.extensible_kv_cache = kv_cache


@pytest.mark.invariant(6)
def test_extend_refuses_a_config_or_runner_it_cannot_extend(device, runners):
    connector = RecordingConnector()
    runner = runners(device, CAPACITY, connector=connector)
    runner.allocate_kv_cache()
    ensure_kv_cache_blocks(runner, 16)
    kv_cache = runner.extensible_kv_cache
    with pytest.raises(ValueError, match="kv_cache_config must be the KVCacheConfig the cache was allocated from, got No"):
        extend_kv_cache(runner, None, 40)
    other = config_for("full", KVCacheLayout.LBHNC)
    with pytest.raises(ValueError, match="kv_cache_config does not describe this cache's allocation"):
        extend_kv_cache(runner, other, 40)
    assert connector.calls == [] and kv_cache.num_committed_blocks == 16

    plain = runners(device, CAPACITY, extensible=False)
    plain.allocate_kv_cache()
    with pytest.raises(StateError, match="runner.extensible_kv_cache is None"):
        extend_kv_cache(plain, plain.allocated_config, 40)
    with pytest.raises(ValueError, match="num_blocks must be an int >= 0"):
        ensure_kv_cache_blocks(plain, -1)  # a plain cache ignores the count, but not a wrong one

    runner.free()
    with pytest.raises(StateError, match="extend_kv_cache: the extensible KV cache was freed"):
        extend_kv_cache(runner, runner.allocated_config, 40)
    with pytest.raises(StateError, match="the extensible KV cache was freed"):
        ensure_kv_cache_blocks(runner, 8)
    with pytest.raises(StateError, match="the extensible KV cache was freed"):
        num_committable_kv_blocks(runner)
    assert connector.calls == []


@pytest.mark.invariant(6)
def test_reference_runner_refuses_bad_arguments(device, runners):
    for kwargs, message in [
        ({"capacity_blocks": 0}, "capacity_blocks must be an int >= 1"),
        ({"capacity_blocks": True}, "capacity_blocks must be an int >= 1"),
        ({"capacity_blocks": "256"}, "capacity_blocks must be an int >= 1"),
        ({"extensible": "no"}, "extensible must be a bool"),
        ({"config": None}, "config must be a TinyDecoderConfig, got None"),
        ({"layout": "LBHNC"}, "attention reads LBHNC pages, got layout 'LBHNC'"),
        ({"connector": object()}, "connector must be a KVConnector"),
        ({"driver": "cpu"}, "driver must be a Driver of "),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            runners(device, **{"capacity_blocks": CAPACITY, **kwargs})
    runner = runners(device, CAPACITY)
    with pytest.raises(ValueError, match="max_batch must be an int >= 1"):
        runner.profile_run(0)
    runner.allocate_kv_cache()
    with pytest.raises(ValueError, match=re.escape("batch_sizes[1] must be an int >= 1")):
        runner.warmup([1, 0])
    with pytest.raises(ValueError, match="batch_sizes must be a list of ints"):
        runner.warmup(4)
    assert runner.num_committed_blocks == 1  # refused before committing anything
    plain = runners(device, CAPACITY, extensible=False)
    plain.allocate_kv_cache()
    with pytest.raises(StateError, match="needs an extensible KV cache; this runner preallocated a plain one"):
        plain.sleep()


@pytest.mark.invariant(6)
def test_reference_runner_refuses_calls_its_stage_does_not_allow(device, runners):
    """Stages as data: each call outside its stages names itself and the
    stage, and changes nothing; a legal call moves the runner on."""
    runner = runners(device, CAPACITY)
    refused = {
        "created (no KV cache allocated yet)": [
            ("warmup", lambda: runner.warmup(BATCHES)),
            ("measure_and_extend", lambda: runner.measure_and_extend(init_free_memory=0, requested_memory=0)),
            ("sleep", runner.sleep),
            ("wake", runner.wake),
        ],
        "allocated": [("profile_run", lambda: runner.profile_run(1)), ("allocate_kv_cache", runner.allocate_kv_cache),
                      ("wake", runner.wake)],
        "asleep (KV cache memory released)": [("warmup", lambda: runner.warmup(BATCHES)), ("sleep", runner.sleep),
                                              ("allocate_kv_cache", runner.allocate_kv_cache)],
        "freed": [("allocate_kv_cache", runner.allocate_kv_cache), ("wake", runner.wake),
                  ("update_weights", lambda: runner.update_weights({}, reclaimable=False, fail_if_short=False))],
    }
    advance = {
        "created (no KV cache allocated yet)": runner.allocate_kv_cache,
        "allocated": runner.sleep,
        "asleep (KV cache memory released)": runner.free,
        "freed": runner.free,  # idempotent
    }
    for stage, calls in refused.items():
        committed = runner.num_committed_blocks if stage != "freed" else None
        for name, call in calls:
            with pytest.raises(StateError, match=re.escape(f"ReferenceModelRunner.{name}() is not allowed: the runner is {stage}")):
                call()
        if committed is not None:
            assert runner.num_committed_blocks == committed, f"a refused call in stage {stage!r} changed the cache"
        advance[stage]()


@pytest.mark.invariant(6)
def test_weight_update_refuses_bad_arguments_before_changing_anything(device, runners):
    runner = runners(device, CAPACITY)
    runner.allocate_kv_cache()
    ensure_kv_cache_blocks(runner, CAPACITY)
    kv_cache = runner.extensible_kv_cache
    kv_cache.set_torch_memory_limit(1 << 40)
    huge = HugeLayerModel(device_memory_info(device)[1])  # would be lent
    held = kv_cache.physical_bytes
    good = {"reclaimable": True, "fail_if_short": True}
    for cache in (kv_cache, None):
        for args, kwargs, message in [
            (("x", huge), good, "kv_cache must be an ExtensibleKVCache or None (a standard cache), got 'x'"),
            ((cache, "model"), good, "model must be a torch.nn.Module, got 'model'"),
            ((cache, huge), {**good, "reclaimable": "yes"}, "reclaimable must be a bool (True or False), got 'yes'"),
            ((cache, huge), {**good, "fail_if_short": 1}, "fail_if_short must be a bool (True or False), got 1"),
            ((cache, huge), {**good, "connector": "c"}, "connector must be a KVConnector"),
        ]:
            # Refused at the call, before the context is entered.
            with pytest.raises(ValueError, match=re.escape(message)):
                kv_cache_lent_for_weight_update(*args, **kwargs)
    assert kv_cache.physical_bytes == held and kv_cache.torch_memory_limit == 1 << 40
    with pytest.raises(ValueError, match="model must be a torch.nn.Module, got None"):
        max_layer_reload_bytes(None)
    runner.free()
    with pytest.raises(StateError, match="kv_cache_lent_for_weight_update: the extensible KV cache was freed"):
        kv_cache_lent_for_weight_update(kv_cache, huge, **good)


def lendable_runner(runners, device, **kwargs):
    """A runner whose full cache a weight update of `HugeLayerModel` must
    borrow, with torch's memory capped."""
    runner = runners(device, CAPACITY, **kwargs)
    runner.allocate_kv_cache()
    ensure_kv_cache_blocks(runner, CAPACITY)
    runner.extensible_kv_cache.set_torch_memory_limit(1 << 40)
    return runner, HugeLayerModel(device_memory_info(device)[1])


@pytest.mark.invariant(5, 6)
@pytest.mark.parametrize("connector_kind", ["unregistered-segment-export", "failing-restore"])
def test_weight_update_puts_the_torch_cap_back_when_the_connector_cannot_restore(device, runners, connector_kind):
    if connector_kind == "unregistered-segment-export":
        connector = SegmentExportConnector()  # never registered: restore_kv_caches() is refused
    else:
        connector = RecordingConnector(fail_restore=True)
    runner, huge = lendable_runner(runners, device)
    kv_cache = runner.extensible_kv_cache
    held = kv_cache.physical_bytes
    with pytest.raises(StateError, match="restore_kv_caches"):
        with kv_cache_lent_for_weight_update(kv_cache, huge, reclaimable=True, fail_if_short=True, connector=connector):
            assert kv_cache.physical_bytes == 0 and kv_cache.torch_memory_limit is None  # lent, cap lifted
    assert kv_cache.torch_memory_limit == 1 << 40
    assert kv_cache.physical_bytes == held  # recommitted before the restore failed
    connector.close()


@pytest.mark.invariant(5, 6)
def test_weight_update_puts_the_torch_cap_back_when_the_body_raises(device, runners):
    connector = RecordingConnector()
    runner, huge = lendable_runner(runners, device, connector=connector)
    kv_cache = runner.extensible_kv_cache
    held = kv_cache.physical_bytes
    with pytest.raises(RuntimeError, match="the update failed"):
        with kv_cache_lent_for_weight_update(kv_cache, huge, reclaimable=True, fail_if_short=True, connector=connector):
            assert kv_cache.physical_bytes == 0
            raise RuntimeError("the update failed")
    assert kv_cache.torch_memory_limit == 1 << 40
    assert kv_cache.physical_bytes == held and connector.operations == ["unregister", "restore"]


@pytest.mark.invariant(6)
def test_weight_update_puts_the_torch_cap_back_when_the_recommit_fails(device, build):
    faulty = FaultInjectingDriver(driver_for(device))
    kv_cache = build.cache_for("padded", KVCacheLayout.LBHNC, device=faulty)
    connector = RecordingConnector()
    kv_cache.commit(64)
    kv_cache.set_torch_memory_limit(1 << 40)
    huge = HugeLayerModel(device_memory_info(device)[1])
    with pytest.raises(DriverError, match="injected fault"):
        with kv_cache_lent_for_weight_update(kv_cache, huge, reclaimable=True, fail_if_short=True, connector=connector):
            assert kv_cache.physical_bytes == 0
            faulty.fail_in("map")
    assert kv_cache.torch_memory_limit == 1 << 40
    # The memory is not back, so the connector was not restored over it.
    assert connector.operations == ["unregister"]


@pytest.mark.invariant(4)
def test_weight_update_leaves_an_asleep_cache_asleep_and_untouched(device, build):
    """A cache still asleep after a wake that failed part way, some of its
    chunks mapped: the update neither lends nor wakes it (a recommit after
    the update would map its blocks behind the back of whoever put it to
    sleep, who completes the wake)."""
    faulty = FaultInjectingDriver(driver_for(device))
    kv_cache = build.cache_for("padded", KVCacheLayout.LBHNC, device=faulty)
    connector = RecordingConnector()
    kv_cache.commit(64)
    kv_cache.release_physical()
    faulty.fail_in("map", 2)
    with pytest.raises(DriverError, match="injected fault"):
        kv_cache.recommit()
    held = kv_cache.physical_bytes
    assert kv_cache.is_asleep and held > 0, f"asleep {kv_cache.is_asleep}, {held} bytes mapped"
    huge = HugeLayerModel(device_memory_info(device)[1])
    with kv_cache_lent_for_weight_update(kv_cache, huge, reclaimable=True, fail_if_short=True, connector=connector):
        assert kv_cache.physical_bytes == held, "an asleep cache was lent"
    assert kv_cache.is_asleep, "the update woke a cache someone else put to sleep"
    assert kv_cache.physical_bytes == held and kv_cache.num_committed_blocks == 64
    assert connector.operations == []
    kv_cache.recommit()  # whoever put it to sleep completes the wake
    assert not kv_cache.is_asleep and kv_cache.physical_bytes == kv_cache.physical_bytes_for(64)


@pytest.mark.invariant(6)
def test_weight_update_with_a_closed_connector_fails_before_lending(device, runners):
    connector = SegmentExportConnector()
    connector.close()
    runner, huge = lendable_runner(runners, device)
    kv_cache = runner.extensible_kv_cache
    held = kv_cache.physical_bytes
    with pytest.raises(StateError, match="closed"):
        with kv_cache_lent_for_weight_update(kv_cache, huge, reclaimable=True, fail_if_short=True, connector=connector):
            pytest.fail("the update must not start")
    assert kv_cache.physical_bytes == held and kv_cache.torch_memory_limit == 1 << 40
