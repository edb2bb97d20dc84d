"""Invariant 2 over every layout and every way memory changes under a
captured graph: a decode step (extkv.testing.graphs.PagedStep) is captured
while only the first blocks are committed, the cache then grows inline,
grows through commit-ahead, defragments keeping its contents, shrinks and
regrows, or sleeps and wakes, and the step, moved by its captured block
table onto blocks that had nothing mapped at capture, replays as eager
execution runs, bit for bit: outputs and committed bytes. Three kinds of
graph: a raw CUDA graph of paged writes and gathered sums, the same with
scaled_dot_product_attention over the gathered K/V, and torch.compile's
mode="reduce-overhead" (CUDA graph trees) of the step.

The block tables name committed blocks only: a replay that reached an
unmapped block would be an illegal address and end the process, so each
check asks the driver first that every byte of them is mapped
(extkv.testing.graphs.ReplayCheck).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from extkv import ExtensibleKVCache, KVCacheConfig, KVCacheLayout, SleepController, driver_for
from extkv.testing.configs import FULL
from extkv.testing.graphs import (
    PagedStep,
    ReplayCheck,
    aligned_full_config,
    blocks_with_mapped_bytes,
    capture,
    committed_bytes,
    first_unmapped_block,
    reservation_views,
    segments_on_one_chunk,
    separately_stored,
)

pytestmark = [pytest.mark.invariant(2), pytest.mark.cuda_graphs]

DEVICE = torch.device("cuda:0")
BATCH, BLOCKS_PER_SEQ = 2, 2
#: Blocks committed at capture: the null block and the blocks the capture's table names.
CAPTURED = 1 + BATCH * BLOCKS_PER_SEQ
CAPTURE_ROWS = [[1, 2], [3, 4]]
#: Blocks the changes commit past the first one unmapped at capture, at most.
SPARE = 16
#: One layout for the compiled step: each change compiles nothing new then.
COMPILED_LAYOUT = KVCacheLayout.LBHNC


def rows_from(first: int) -> list[list[int]]:
    """Two sequences over a block committed at capture and three from `first` on."""
    return [[2, first], [first + 1, first + 2]]


@dataclass
class Scene:
    """A cache, the block numbers a change works with, and the check of a
    step captured over the cache before the change."""

    cache: ExtensibleKVCache
    config: KVCacheConfig
    views: dict[str, torch.Tensor]
    first: int   # the first block with nothing mapped at capture
    grown: int   # what a change grows to first; it may go 4 blocks further
    check: ReplayCheck | None = None
    checks_made: int = 0

    def replays(self, rows: list[list[int]], when: str) -> None:
        self.checks_made += 1
        self.check.check(rows, seed=self.checks_made, when=when)


def scene(build, layout: KVCacheLayout) -> Scene:
    """A cache of `layout` with CAPTURED blocks committed, every segment on
    granules of its own, and SPARE blocks of room past the first block that
    has nothing mapped."""
    config = aligned_full_config(layout, driver_for(DEVICE).granularity, CAPTURED, SPARE)
    cache = build.cache(config, layout, device=DEVICE)
    cache.allocate(cache.size)
    cache.commit(CAPTURED)
    first = first_unmapped_block(cache, CAPTURED)
    made = Scene(cache, config, reservation_views(cache, config), first, first + SPARE // 2)
    mapped = blocks_with_mapped_bytes(cache, range(first, made.grown + 4))
    assert not mapped, f"blocks {mapped} have bytes mapped at capture; the replays would prove nothing about growth"
    return made


# -- the changes, each with the checks it makes ----------------------------------------
def grow(scene: Scene) -> None:
    scene.cache.commit(scene.grown)
    scene.replays(rows_from(scene.first), "after growth")
    scene.cache.commit(scene.grown + 4)
    scene.replays(rows_from(scene.grown), "after a second growth")


def commit_ahead(scene: Scene) -> None:
    cache = scene.cache
    cache.commit_ahead(scene.grown + 4 - CAPTURED)
    cache.commit(scene.grown)
    scene.replays(rows_from(scene.first), "after a commit inside the commit-ahead window")
    cache.commit(scene.grown + 4)
    scene.replays(rows_from(scene.grown), "after a second commit inside the window")
    cache.commit_ahead(0)


def defragment(scene: Scene) -> None:
    cache = scene.cache
    cache.commit(scene.grown)
    scene.replays(rows_from(scene.first), "after growth")
    split = segments_on_one_chunk(cache)
    assert not all(split), f"growth left every segment on one chunk ({split}): a defragment would move nothing"
    scene.check.fill(seed=7)
    kept = committed_bytes(cache)
    cache.commit(scene.grown, defragment=True, preserve_contents=True)
    one_chunk = segments_on_one_chunk(cache)
    assert all(one_chunk), f"segments on one chunk after the defragment, as the driver reads it back: {one_chunk}"
    changed = [i for i, (a, b) in enumerate(zip(kept, committed_bytes(cache))) if not torch.equal(a, b)]
    assert not changed, f"segments whose committed bytes the preserving defragment changed: {changed}"
    scene.replays(rows_from(scene.first), "after a preserving defragment")


def shrink_and_regrow(scene: Scene) -> None:
    cache = scene.cache
    cache.commit(scene.grown)
    scene.replays(rows_from(scene.first), "after growth")
    cache.commit(CAPTURED, shrink=True)
    still = blocks_with_mapped_bytes(cache, range(scene.first, scene.grown))
    assert cache.num_committed_blocks == CAPTURED and not still, (
        f"after commit({CAPTURED}, shrink=True): {cache.num_committed_blocks} blocks committed, "
        f"blocks {still} still mapped")
    scene.replays(CAPTURE_ROWS, "after shrinking to the blocks committed at capture")
    cache.commit(scene.grown)
    scene.replays(rows_from(scene.first), "after regrowing")


def sleep_and_wake(scene: Scene) -> None:
    cache = scene.cache
    cache.commit(scene.grown)
    scene.replays(rows_from(scene.first), "after growth")
    cache.release_physical()
    still = blocks_with_mapped_bytes(cache, [0, *range(scene.first, scene.grown)])
    assert cache.physical_bytes == 0 and not still, (
        f"after release_physical: {cache.physical_bytes} bytes held, blocks {still} still mapped")
    cache.recommit()
    nonzero = [int(segment.count_nonzero()) for segment in committed_bytes(cache)]
    assert not any(nonzero), f"non-zero committed bytes per segment after recommit: {nonzero}"
    scene.replays(rows_from(scene.first), "after release_physical and recommit")

    engine = SleepController()
    engine.register(cache, offload=True)
    scene.check.fill(seed=11)
    kept = committed_bytes(cache)
    engine.sleep(level=1)
    assert cache.physical_bytes == 0, f"SleepController.sleep(level=1) left {cache.physical_bytes} bytes mapped"
    engine.wake_up()
    changed = [i for i, (a, b) in enumerate(zip(kept, committed_bytes(cache))) if not torch.equal(a, b)]
    assert not changed, f"segments whose committed bytes an offloaded sleep and wake changed: {changed}"
    scene.replays(rows_from(scene.first), "after SleepController sleep(level=1) and wake_up, offloaded")


CHANGES = {
    "grow": grow,
    "commit_ahead": commit_ahead,
    "defragment": defragment,
    "shrink_and_regrow": shrink_and_regrow,
    "sleep_and_wake": sleep_and_wake,
}


# -- the tests ---------------------------------------------------------------------------
@pytest.mark.parametrize("attention", [False, True], ids=["gather", "sdpa"])
@pytest.mark.parametrize("change", CHANGES)
@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda layout: layout.name)
def test_a_graph_captured_before_a_change_replays_after_it(build, layout, change, attention):
    """A raw CUDA graph of the step (gathered sums, or attention over the
    gathered K/V) replays after the change as eager execution runs."""
    made = scene(build, layout)
    step = PagedStep(made.views, FULL, BATCH, BLOCKS_PER_SEQ, attend=attention)
    step.point_at(CAPTURE_ROWS, seed=0)
    made.check = ReplayCheck(made.cache, made.config, step, made.views, capture(step))
    CHANGES[change](made)


@pytest.fixture
def graph_captures(monkeypatch) -> list[int]:
    """[captures begun]: every CUDA graph capture goes through
    torch.cuda.CUDAGraph.capture_begin, torch.compile's graph trees' too."""
    begun = [0]
    begin = torch.cuda.CUDAGraph.capture_begin

    def counted(self, *args, **kwargs):
        begun[0] += 1
        return begin(self, *args, **kwargs)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", counted)
    return begun


def cudagraph_skips() -> int:
    """torch.compile's count of functions it ran without CUDA graphs."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]


@pytest.mark.parametrize("change", CHANGES)
@pytest.mark.long
def test_a_compiled_step_captured_before_a_change_replays_after_it(build, change, graph_captures):
    """torch.compile(mode="reduce-overhead") records the step's graph in its
    first calls; after the change no call recompiles, records or runs
    without a graph, so every check's replay is of a graph recorded before
    the change."""
    made = scene(build, COMPILED_LAYOUT)
    held = separately_stored(made.views, made.cache.buffer.driver)
    step = PagedStep(held, FULL, BATCH, BLOCKS_PER_SEQ, attend=False)
    step.point_at(CAPTURE_ROWS, seed=0)
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True, dynamic=False)

    def replay() -> torch.Tensor:
        torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():
            return compiled().clone()

    skips = cudagraph_skips()
    for _ in range(2):  # the first call may warm up, the second records (or replays a graph at these addresses)
        replay()
    made.check = ReplayCheck(made.cache, made.config, step, held, replay)
    recorded = graph_captures[0]
    with torch._dynamo.config.patch(error_on_recompile=True):
        CHANGES[change](made)
    assert graph_captures[0] == recorded, (
        f"{graph_captures[0] - recorded} graphs captured after the change: a replay was a new recording")
    assert cudagraph_skips() == skips, (
        f"torch.compile ran the step without CUDA graphs {cudagraph_skips() - skips} times")
