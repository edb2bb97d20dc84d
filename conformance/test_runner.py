"""The runner lifecycle on a real model: CUDA graphs replayed over blocks
committed after capture, the whole lifecycle end to end against a runner that
preallocated everything, sleep/wake measured outside extkv, weight updates."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from extkv.runner import (
    ReferenceModelRunner,
    TinyDecoderConfig,
    WeightUpdateMemoryError,
    ensure_kv_cache_blocks,
    extend_kv_cache,
    kv_cache_lent_for_weight_update,
    max_layer_reload_bytes,
    num_committable_kv_blocks,
    registers_kv_cache_memory,
)
from extkv.usage import device_memory_info

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
    assert all(kv_cache.buffer.segments_backed_by_one_chunk(sizes))
    assert all(torch.equal(a, b) for a, b in zip(contents, cache_contents(runner)))
    assert_graph_matches_eager(runner, first_block)

    # Sleep and wake: same addresses, fresh zeroed pages; the graphs still hold.
    runner.sleep()
    assert kv_cache.physical_bytes == 0
    runner.wake()
    assert all(int(c.count_nonzero()) == 0 for c in cache_contents(runner))
    assert_graph_matches_eager(runner, first_block)


def generate(runner: ReferenceModelRunner, first_block: int, steps: int, *, use_graph: bool) -> torch.Tensor:
    sequences = Sequences(runner, 4, first_block, seed=7)
    return torch.stack([sequences.step(use_graph=use_graph) for _ in range(steps)])


def test_lifecycle_end_to_end_matches_a_preallocated_runner(device, usage, runners):
    use_graphs = device.type == "cuda"
    baseline = usage.read_outside_torch()
    init_free, _ = device_memory_info(device)

    plain = runners(device, CAPACITY, extensible=False)
    plain.allocate_kv_cache()
    expected = generate(plain, first_block=32, steps=24, use_graph=False)

    runner = runners(device, CAPACITY)
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
    assert usage.read_outside_torch() - baseline == kv_cache.physical_bytes

    served = generate(runner, first_block=32, steps=24, use_graph=use_graphs)
    assert torch.equal(served, expected)

    held = kv_cache.physical_bytes
    runner.sleep()
    assert usage.read_outside_torch() - baseline == 0  # the memory really went back
    runner.wake()
    assert usage.read_outside_torch() - baseline == held == kv_cache.physical_bytes
    assert all(int(c.count_nonzero()) == 0 for c in cache_contents(runner))
    assert torch.equal(generate(runner, first_block=32, steps=24, use_graph=use_graphs), expected)


def test_extend_shrinks_to_the_measured_budget(device, runners):
    runner = runners(device, CAPACITY)
    runner.allocate_kv_cache()
    ensure_kv_cache_blocks(runner, CAPACITY)
    extend_kv_cache(runner, runner.allocated_config, 40)
    kv_cache = runner.extensible_kv_cache
    assert kv_cache.num_committed_blocks == 40 and kv_cache.physical_bytes == kv_cache.physical_bytes_for(40)
    assert all(view.untyped_storage().nbytes() == 40 * view.stride(0) * view.element_size() for view in runner.kv_caches)
    assert not registers_kv_cache_memory(runner)


def new_weights(runner: ReferenceModelRunner, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(p.shape, generator=generator).to(p.dtype) for name, p in runner.model.state_dict().items()}


def test_weight_update_with_enough_free_memory_keeps_the_cache(device, runners):
    runner = runners(device, CAPACITY)
    runner.allocate_kv_cache()
    ensure_kv_cache_blocks(runner, 64)
    kv_cache = runner.extensible_kv_cache
    kv_cache.buffer.segment_view(0).fill_(9)
    weights = new_weights(runner, seed=5)
    runner.update_weights(weights, reclaimable=False, fail_if_short=True)
    assert all(torch.equal(p.cpu(), weights[n]) for n, p in runner.model.state_dict().items())
    assert kv_cache.num_committed_blocks == 64 and bool((kv_cache.buffer.segment_view(0) == 9).all())


class HugeLayerModel(nn.Module):
    """Describes a layer larger than the whole device without allocating it
    (meta parameters): what a weight update would need cannot be free."""

    def __init__(self, total_bytes: int):
        super().__init__()
        self.layer = nn.Linear(1, total_bytes // 4, bias=False, device="meta")


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
        assert kv_cache.physical_bytes == 0 and usage.read_outside_torch() == baseline
        assert kv_cache.torch_memory_limit is None  # the cap is lifted for the update
    assert kv_cache.physical_bytes == held and usage.read_outside_torch() - baseline == held
    assert kv_cache.num_committed_blocks == CAPACITY
    assert int(kv_cache.buffer.segment_view(0).count_nonzero()) == 0  # recommitted zeroed
    assert [v.data_ptr() for v in runner.kv_caches] == pointers
    assert kv_cache.torch_memory_limit == 1 << 40


def test_weight_update_that_cannot_fit_fails_before_changing_anything(device, runners):
    runner = runners(device, CAPACITY)
    runner.allocate_kv_cache()
    ensure_kv_cache_blocks(runner, 16)
    kv_cache = runner.extensible_kv_cache
    _, total = device_memory_info(device)
    huge = HugeLayerModel(total)
    before = {n: p.clone() for n, p in huge.state_dict().items()}
    with pytest.raises(WeightUpdateMemoryError, match="largest layer alone"):
        with kv_cache_lent_for_weight_update(kv_cache, huge, reclaimable=False, fail_if_short=True):
            pytest.fail("the update must not start")
    assert kv_cache.physical_bytes == kv_cache.physical_bytes_for(16)
    assert set(before) == set(huge.state_dict())


@pytest.mark.gpu
def test_weight_update_on_a_full_gpu_borrows_the_cache(runners):
    """The real thing: fill the GPU until the model's next layer cannot be
    staged, then update every weight with the KV cache lent."""
    # Layers of ~130 MB, so that what torch keeps cached (a few MB) cannot
    # cover the update by itself.
    runner = runners("cuda", 16384, config=TinyDecoderConfig(hidden_size=2048))
    runner.allocate_kv_cache()
    ensure_kv_cache_blocks(runner, 16384)
    kv_cache = runner.extensible_kv_cache
    needed = 2 * max_layer_reload_bytes(runner.model)
    assert kv_cache.physical_bytes > 2 * needed
    kv_cache.buffer.segment_view(0).fill_(5)
    torch.cuda.empty_cache()
    hogs = fill_gpu_until_free_is(needed // 2)
    weights = new_weights(runner, seed=11)
    try:
        cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
        assert torch.cuda.mem_get_info()[0] + cached < needed  # what the lending decision reads
        runner.update_weights(weights, reclaimable=True, fail_if_short=True)
    finally:
        hogs.clear()
        torch.cuda.empty_cache()
    # Checked with the GPU no longer full: the checks allocate too.
    assert all(torch.equal(p.cpu(), weights[n]) for n, p in runner.model.state_dict().items())
    assert kv_cache.physical_bytes == kv_cache.physical_bytes_for(16384)
    assert int(kv_cache.buffer.segment_view(0).count_nonzero()) == 0  # lent, then recommitted zeroed


def fill_gpu_until_free_is(target: int) -> list[torch.Tensor]:
    """Allocate through torch until the GPU has about `target` bytes free."""
    granule, hogs = 2 << 20, []
    while (excess := torch.cuda.mem_get_info()[0] - target) >= 2 * granule:
        size = min(excess - granule, 8 << 30) // granule * granule
        hogs.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
    return hogs
