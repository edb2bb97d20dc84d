"""A decode step captured over a KV cache's reservation, and the check that
its replay after the cache changed does what eager execution does.

Theory of operation
-------------------
A captured CUDA graph holds addresses, not tensors: replayed, its kernels
read and write whatever memory is mapped there by then. An engine captures
its decode step over per-layer views of the whole reservation
(`reservation_views`, as extkv.reference_model does) and moves the step
between blocks by rewriting, in place, device tensors the graph captured:
block tables and write slots. `PagedStep` is such a step, small. Per layer
it writes one token's K and V per sequence into the sequence's last block,
then gathers the K/V of the sequence's blocks through its block table and
sums them (`attend=False`) or runs scaled_dot_product_attention over them
(`attend=True`). Its inputs are buffers, so a graph captures their
addresses and `point_at` moves the step.

A replay touches exactly the blocks its inputs name, and those must be
mapped when it runs: a kernel that reaches an unmapped block is an illegal
address, which ends the process instead of failing a test. `ReplayCheck`
therefore asks the driver first (`blocks_with_unmapped_bytes`) and refuses to
run the step on a block with an unmapped byte, failing with the numbers.

The reference is the same step run eagerly over a plain copy of the
committed bytes (ordinary device memory, laid out like the reservation);
eager execution over the cache and the replay must both match it bit for
bit, outputs and committed bytes after the step. Bit for bit holds across
kernels too: the values are multiples of 1/4 below 8 in magnitude, in
float16, and the sums run in float32, so every partial sum is exact and
inductor's fused, reordered kernels give the bits eager ones do.
(scaled_dot_product_attention's softmax is exact in no order; it is only
ever compared with the same kernels.)

torch.compile. A compiled step must never touch the whole of a view, which
spans unmapped pages, and three ways to write into it would:
- a write through an integer index (`kv[b, 0, t] = x`): AOTAutograd makes it
  a select_scatter over the whole view;
- a write to one of several inputs that share a storage and may overlap
  (the layers of a block-outermost layout interleave): AOTAutograd merges
  them into one "synthetic base", the storage, and scatters into a copy;
- a write inductor compiles into a Triton kernel of its own: before it
  picks among the kernel's configurations, inductor benchmarks them on
  copies of the arguments the kernel mutates, the whole view. On the H200
  (torch 2.11) that step failed with a CUDA error at its first call, and
  ran with torch._inductor.config.triton.autotune_pointwise off.
So the step writes through `write_slots`, an operator of this module that
torch.compile calls as it is on the view it is given (the way engines
write their caches through custom operators), and a compiled step gets
`separately_stored` views: the same elements, each layer on a storage of
its own, which is true to the memory because no two layers share an
element. The step's reads gather by index, and touch only the blocks
named.

Contents are read over committed blocks only (`committed_bytes`): with
commit-ahead on, a worker maps and zeroes blocks past them while a test
reads. Failure messages give counts, indices and values of tensors copied
out of the cache, never a view of the reservation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

from ..cache import ExtensibleKVCache
from ..layout import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheLayout,
    create_kv_cache_views,
    granule_block_alignment,
    kv_cache_segments,
    layer_spec_for_tensor,
    round_up,
)
from ..vmm import Driver
from .configs import config_for

#: Tokens' values are multiples of this: sums of them in float32 are exact.
QUARTER = 4


# -- the cache and its views ------------------------------------------------------
def aligned_full_config(layout: KVCacheLayout, granule: int, committed: int, spare_blocks: int) -> KVCacheConfig:
    """The shared three-layer full-attention config (extkv.testing.configs)
    at the smallest capacity that puts every segment on granules of its
    own (so no segment maps another's blocks) and leaves `spare_blocks`
    past the first block a commit of `committed` blocks leaves unmapped
    (`first_unmapped_block`). Block strides do not depend on the capacity."""
    _, strides = kv_cache_segments(config_for("full", layout, 1), layout)
    first = max(-(-round_up(committed * stride, granule) // stride) for stride in strides)
    return config_for("full", layout, round_up(first + spare_blocks, granule_block_alignment(strides, granule)))


def first_unmapped_block(cache: ExtensibleKVCache, committed: int) -> int:
    """The first block none of whose bytes a commit of `committed` blocks
    maps in its own segment, by the granule arithmetic (a test confirms it
    with the driver: `blocks_with_mapped_bytes`)."""
    granule = cache.buffer.granularity
    return max(
        -(-(round_up(offset + committed * stride, granule) - offset) // stride)
        for offset, stride in zip(cache.segment_offsets, cache.segment_strides)
    )


def reservation_views(cache: ExtensibleKVCache, config: KVCacheConfig) -> dict[str, torch.Tensor]:
    """Per-layer views over the whole capacity, made now from the cache's
    reservation: what an engine captures. Most of what they span may be
    unmapped: never print one or read it whole."""
    full = cache.buffer.full_view()
    views: dict[str, torch.Tensor] = {}
    for tensor in config.kv_cache_tensors:
        _, spec = layer_spec_for_tensor(config, tensor)
        views.update(zip(tensor.layers, create_kv_cache_views(full, spec, config.num_blocks, cache.layout, tensor)))
    return views


def separately_stored(views: dict[str, torch.Tensor], driver: Driver) -> dict[str, torch.Tensor]:
    """The same elements as `views`, each view on a storage of its own over
    exactly the bytes it spans, so that torch.compile sees layers that share
    no storage (see the module's theory)."""
    stored = {}
    for name, view in views.items():
        span = (1 + sum((n - 1) * s for n, s in zip(view.shape, view.stride()))) * view.element_size()
        own = driver.view(view.data_ptr(), span).view(view.dtype)
        stored[name] = own.as_strided(view.shape, view.stride())
    return stored


def committed_bytes(cache: ExtensibleKVCache) -> list[torch.Tensor]:
    """A copy of each segment's committed blocks."""
    n = cache.num_committed_blocks
    return [cache.buffer.segment_view(i)[: n * stride].clone() for i, stride in enumerate(cache.segment_strides)]


def restore_committed(cache: ExtensibleKVCache, saved: Sequence[torch.Tensor]) -> None:
    for i, data in enumerate(saved):
        cache.buffer.segment_view(i)[: data.numel()].copy_(data)


def fill_blocks(views: Iterable[torch.Tensor], num_blocks: int, seed: int) -> None:
    """Blocks [0, num_blocks) of every view: multiples of 1/4 in [-2, 2)."""
    views = list(views)
    generator = torch.Generator(device=views[0].device).manual_seed(seed)
    for view in views:
        part = view[:num_blocks]
        values = torch.randint(-2 * QUARTER, 2 * QUARTER, part.shape, generator=generator, device=part.device)
        part.copy_(values.to(part.dtype) / QUARTER)


def _block_chunks(cache: ExtensibleKVCache, blocks: Sequence[int]) -> list[list]:
    """For each block, the driver's chunk at the first and last byte of the
    block in every segment (None: nothing mapped)."""
    base = cache.buffer.base
    per_block = [
        [base + offset + block * stride + end for offset, stride in zip(cache.segment_offsets, cache.segment_strides)
         for end in (0, stride - 1)]
        for block in blocks
    ]
    found = cache.buffer.driver.chunks_at([address for addresses in per_block for address in addresses])
    width = len(per_block[0]) if per_block else 0
    return [found[i * width:(i + 1) * width] for i in range(len(per_block))]


def blocks_with_unmapped_bytes(cache: ExtensibleKVCache, blocks: Sequence[int]) -> list[int]:
    """Those of `blocks` with a byte in some segment that the driver shows unmapped."""
    return [block for block, chunks in zip(blocks, _block_chunks(cache, blocks)) if None in chunks]


def blocks_with_mapped_bytes(cache: ExtensibleKVCache, blocks: Sequence[int]) -> list[int]:
    """Those of `blocks` with a byte in some segment that the driver shows mapped."""
    return [block for block, chunks in zip(blocks, _block_chunks(cache, blocks)) if any(c is not None for c in chunks)]


def segments_on_one_chunk(cache: ExtensibleKVCache) -> list[bool]:
    """Per segment, whether the driver shows its committed blocks' first and
    last byte in one chunk (a chunk is one contiguous mapping)."""
    base, n = cache.buffer.base, cache.num_committed_blocks
    ends = [a for offset, stride in zip(cache.segment_offsets, cache.segment_strides)
            for a in (base + offset, base + offset + n * stride - 1)]
    found = cache.buffer.driver.chunks_at(ends)
    return [found[i] is not None and found[i] == found[i + 1] for i in range(0, len(found), 2)]


# -- the step ------------------------------------------------------------------------
@torch.library.custom_op("extkv_testing::write_slots", mutates_args=("kv",))
def write_slots(kv: torch.Tensor, blocks: torch.Tensor, k_then_v: torch.Tensor, tokens: torch.Tensor,
                values: torch.Tensor) -> None:
    """kv[blocks, k_then_v, tokens] = values, in place: the step's write, an
    operator torch.compile calls as it is (see the module's theory)."""
    kv.index_put_((blocks, k_then_v, tokens), values)


@write_slots.register_fake
def _write_slots_fake(kv, blocks, k_then_v, tokens, values) -> None:
    return None


class PagedStep(torch.nn.Module):
    """One decode step of `batch` sequences of `blocks_per_seq` blocks over
    the layer `views` (full attention, `spec`). Every input is a buffer:
    a graph captures its address, and `point_at` rewrites it in place."""

    def __init__(self, views: dict[str, torch.Tensor], spec: FullAttentionSpec, batch: int, blocks_per_seq: int,
                 *, attend: bool):
        super().__init__()
        device = next(iter(views.values())).device
        self.num_layers = len(views)
        self.attend = attend
        for layer, view in enumerate(views.values()):
            self.register_buffer(f"kv{layer}", view, persistent=False)
        index = {"dtype": torch.int64, "device": device}
        value = {"dtype": spec.dtype, "device": device}
        self.register_buffer("block_table", torch.zeros(batch, blocks_per_seq, **index), persistent=False)
        self.register_buffer("slot_blocks", torch.zeros(batch, 1, **index), persistent=False)
        self.register_buffer("slot_tokens", torch.zeros(batch, 1, **index), persistent=False)
        self.register_buffer("k_then_v", torch.tensor([[0, 1]], **index), persistent=False)
        self.register_buffer("new_kv", torch.zeros(batch, 2, spec.num_kv_heads, spec.head_size, **value),
                             persistent=False)
        self.register_buffer("query", torch.zeros(batch, spec.num_kv_heads, 1, spec.head_size, **value),
                             persistent=False)

    def point_at(self, rows: Sequence[Sequence[int]], seed: int) -> None:
        """Sequences over the block ids `rows`: sequence i writes token i of
        its last block (so no two write one slot), with new values from
        `seed`, multiples of 1/4 in [2, 6): never a filled value."""
        self.block_table.copy_(torch.tensor(rows))
        self.slot_blocks.copy_(torch.tensor([[row[-1]] for row in rows]))
        self.slot_tokens.copy_(torch.arange(len(rows))[:, None])
        generator = torch.Generator().manual_seed(seed)
        for name, low in (("new_kv", 2), ("query", -2)):
            buffer = getattr(self, name)
            values = torch.randint(low * QUARTER, (low + 4) * QUARTER, buffer.shape, generator=generator)
            buffer.copy_(values.to(buffer.dtype) / QUARTER)

    def forward(self) -> torch.Tensor:
        return self.over([getattr(self, f"kv{layer}") for layer in range(self.num_layers)])

    def over(self, views: Sequence[torch.Tensor]) -> torch.Tensor:
        """The step over `views` in place of the captured ones (eager runs)."""
        outputs = []
        for layer, kv in enumerate(views):
            write_slots(kv, self.slot_blocks, self.k_then_v, self.slot_tokens, self.new_kv + layer)
            gathered = kv[self.block_table]  # (batch, blocks, K/V, tokens, heads, head_size)
            if self.attend:
                keys = gathered[:, :, 0].flatten(1, 2).transpose(1, 2)  # (batch, heads, tokens, head_size)
                values = gathered[:, :, 1].flatten(1, 2).transpose(1, 2)
                outputs.append(F.scaled_dot_product_attention(self.query, keys, values))
            else:
                outputs.append(gathered.float().sum(dim=(1, 3)))
        return torch.stack(outputs)


def capture(step: PagedStep) -> Callable[[], torch.Tensor]:
    """Capture `step` as a CUDA graph (kernels warmed outside the capture,
    as extkv.reference_model does); returns a replay that gives a copy of
    the output."""
    device = step.block_table.device
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream), torch.no_grad():
        step()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"), torch.no_grad():
        output = step()

    def replay() -> torch.Tensor:
        graph.replay()
        return output.clone()

    return replay


# -- the check -----------------------------------------------------------------------
def bit_differences(what: str, expected: torch.Tensor, got: torch.Tensor) -> str | None:
    """None when the two agree bit for bit; else how many elements differ,
    and the first, in numbers."""
    if expected.shape != got.shape or expected.dtype != got.dtype:
        return f"{what}: {tuple(got.shape)} {got.dtype} where {tuple(expected.shape)} {expected.dtype} was expected"
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[expected.element_size()]
    differ = (expected.contiguous().view(bits) != got.contiguous().view(bits)).flatten()
    count = int(differ.sum())
    if not count:
        return None
    first = int(differ.nonzero()[0])
    return (f"{what}: {count} of {differ.numel()} elements differ; the first, flat index {first}, "
            f"is {got.flatten()[first].item()!r} where {expected.flatten()[first].item()!r} was expected")


class ReplayCheck:
    """A step captured over `cache` (its views `captured`, a `replay` of
    it), checked against eager execution wherever a test moves it."""

    def __init__(self, cache: ExtensibleKVCache, config: KVCacheConfig, step: PagedStep,
                 captured: dict[str, torch.Tensor], replay: Callable[[], torch.Tensor]):
        self.cache, self.config, self.step, self.replay = cache, config, step, replay
        self.pointers = {name: view.data_ptr() for name, view in captured.items()}

    def fill(self, seed: int) -> None:
        """Write values over every committed block of every layer."""
        fill_blocks(reservation_views(self.cache, self.config).values(), self.cache.num_committed_blocks, seed)

    def moved_views(self, kind: str) -> list[str]:
        """Layers whose view made now from the cache starts elsewhere than at
        capture: `kind` "reservation", over the whole capacity, or
        "committed", the cache's own committed view (for layouts that have
        one)."""
        cache = self.cache
        if kind == "reservation":
            views = reservation_views(cache, self.config)
        else:
            committed = KVCacheConfig(cache.num_committed_blocks, self.config.kv_cache_tensors,
                                      self.config.kv_cache_groups)
            views = cache.committed_views(committed, cache.layout) or {}
        return [
            f"{kind} view of {name} at {view.data_ptr():#x}, captured at {self.pointers[name]:#x}"
            for name, view in views.items() if view.data_ptr() != self.pointers[name]
        ]

    def check(self, rows: Sequence[Sequence[int]], seed: int, when: str) -> None:
        """Point the step at `rows`, fill the committed blocks, and run it
        three ways from the same bytes: eagerly over a plain copy (the
        reference), eagerly over the cache, and by replay. Outputs and the
        committed bytes after must agree bit for bit."""
        cache = self.cache
        moved = self.moved_views("reservation")
        assert not moved, f"{when}: views moved since capture: " + "; ".join(moved)
        blocks = sorted({block for row in rows for block in row})
        assert blocks[-1] < cache.num_committed_blocks, (
            f"{when}: the step would touch blocks {blocks}, but only {cache.num_committed_blocks} are committed")
        unmapped = blocks_with_unmapped_bytes(cache, blocks)
        assert not unmapped, (
            f"{when}: committed blocks {unmapped} (of {cache.num_committed_blocks}) have bytes the driver shows "
            "unmapped; the step is not run there")
        moved = self.moved_views("committed")
        assert not moved, f"{when}: the cache's committed views are not where the graph's are: " + "; ".join(moved)

        self.step.point_at(rows, seed)
        self.fill(seed)
        before = committed_bytes(cache)
        expected_output, expected_bytes = self._on_plain_copy(before)
        wrote = sum(int((a != b).sum()) for a, b in zip(before, expected_bytes))
        assert wrote, f"{when}: the step wrote no byte of the plain copy; the check would prove nothing"
        with torch.no_grad():
            eager_output = self.step.over(list(reservation_views(cache, self.config).values()))
        eager_bytes = committed_bytes(cache)
        restore_committed(cache, before)
        with torch.no_grad():
            replayed_output = self.replay()
        replayed_bytes = committed_bytes(cache)

        problems = [
            bit_differences(f"{how} output", expected_output, output)
            for how, output in (("eager", eager_output), ("replayed", replayed_output))
        ]
        for how, got in (("eager", eager_bytes), ("replayed", replayed_bytes)):
            for segment, (expected, seen) in enumerate(zip(expected_bytes, got)):
                differ = (expected != seen).nonzero()
                if differ.numel():
                    offset = int(differ[0])
                    stride = cache.segment_strides[segment]
                    problems.append(
                        f"{how} step left {differ.numel()} committed bytes of segment {segment} unlike the plain "
                        f"copy's; the first at byte {offset % stride} of block {offset // stride}")
        problems = [problem for problem in problems if problem]
        assert not problems, f"{when}: " + "; ".join(problems)

    def _on_plain_copy(self, committed: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The step run eagerly over ordinary device memory holding
        `committed` where the reservation holds it: its output, and its
        bytes after, segment by segment."""
        cache = self.cache
        plain = torch.zeros(cache.size, dtype=torch.uint8, device=committed[0].device)
        for offset, data in zip(cache.segment_offsets, committed):
            plain[offset:offset + data.numel()].copy_(data)
        views = []
        for tensor in self.config.kv_cache_tensors:
            _, spec = layer_spec_for_tensor(self.config, tensor)
            views += create_kv_cache_views(plain, spec, self.config.num_blocks, cache.layout, tensor)
        with torch.no_grad():
            output = self.step.over(views)
        return output, [plain[offset:offset + data.numel()].clone()
                        for offset, data in zip(cache.segment_offsets, committed)]

