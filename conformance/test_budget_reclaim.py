"""The reference runner gives memory back when the shared KV budget asks.

A runner under a real daemon (extkv.testing.budget) over the host driver
holds requests whose blocks carry a known pattern in every layer.
`on_reclaim(target)` frees at least the target: free blocks first, then
requests preempted newest first; the survivors' blocks move below the new
top, their contents byte-identical in every layer, the chunks holding the
blocks below it stay mapped (a shrink keeping contents, which may keep a
chunk straddling the top whole: the top is chosen past it), and the
daemon's ledger holds exactly the cache's physical bytes. A target it cannot free is
answered 0 with nothing changed. A full round: engine B's reserve waits,
the daemon asks engine A, A's runner frees, B is granted.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from extkv import ExtensibleKVCache, KVCacheLayout
from extkv.budget.client import BudgetClient
from extkv.reference_model import ReferenceModelRunner, TinyDecoderConfig
from extkv.testing.budget import served_daemon
from extkv.testing.checks import check_committed_blocks_mapped, check_unchanged, snapshot
from extkv.testing.configs import config_for
from extkv.vmm import HostDriver

pytestmark = pytest.mark.budget_proof("reclaim")

#: Seconds a client waits for the daemon.
TIMEOUT_S = 60
#: A granule of 4 blocks per layer (a block of a layer is 16 KiB), so block
#: counts, not 2 MiB granules, decide the footprint.
GRANULE = 64 << 10
CAPACITY = 64
CONFIG = TinyDecoderConfig()


@contextlib.contextmanager
def runner_under(client: BudgetClient):
    runner = ReferenceModelRunner("cpu", CAPACITY, config=CONFIG, driver=HostDriver(GRANULE), budget=client)
    try:
        runner.allocate_kv_cache()
        yield runner
    finally:
        runner.free()


def fill_request(runner: ReferenceModelRunner, request_id: int) -> list[torch.Tensor]:
    """Write a pattern of its own over every layer's blocks of the request;
    return copies of what was written, one per layer."""
    blocks = runner.request_blocks(request_id)
    written = []
    for layer, view in enumerate(runner.kv_caches):
        generator = torch.Generator().manual_seed(1000 * request_id + layer)
        pattern = torch.randn(view[blocks].shape, generator=generator)
        view[blocks] = pattern
        written.append(pattern)
    return written


def check_contents(runner: ReferenceModelRunner, written: dict[int, list[torch.Tensor]]) -> None:
    # Read back from the driver first: a block a shrink left unmapped fails here, not as a fault of the read.
    check_committed_blocks_mapped(runner.extensible_kv_cache)
    for request_id, layers in written.items():
        blocks = runner.request_blocks(request_id)
        for layer, (view, expected) in enumerate(zip(runner.kv_caches, layers)):
            assert torch.equal(view[blocks], expected), (
                f"request {request_id}'s blocks {blocks} in layer {layer} do not hold what was written")


def held(client: BudgetClient) -> int:
    """What the daemon's ledger holds for the first engine to connect: the runner's, in every test."""
    return client.report()["engines"][0]["held"]


def requests_with_holes(runner: ReferenceModelRunner, sizes: dict[int, int], finished: list[int]):
    """Add requests of `sizes` blocks in order, fill them, finish `finished`."""
    written = {}
    for request_id, num_blocks in sizes.items():
        runner.add_request(request_id, num_blocks)
        written[request_id] = fill_request(runner, request_id)
    for request_id in finished:
        runner.finish_request(request_id)
        del written[request_id]
    return written


@pytest.mark.invariant(1)
@pytest.mark.invariant(5)
def test_a_reclaim_frees_free_blocks_first_and_moves_live_ones_down_intact():
    with served_daemon(1 << 30) as served, BudgetClient(served.path, timeout=TIMEOUT_S) as client, \
            runner_under(client) as runner:
        # Blocks 1-8 request 1 (finished: a hole), 9-16 request 2, 17-24 request 3.
        written = requests_with_holes(runner, {1: 8, 2: 8, 3: 8}, finished=[1])
        kv_cache = runner.extensible_kv_cache
        # Keep 20 blocks, granules whole: 20-24 of request 3 move into the hole.
        before, target = kv_cache.physical_bytes, kv_cache.physical_bytes - kv_cache.physical_bytes_for(20)
        chunks = kv_cache.buffer.mapped_chunks  # held: a freed object's id may be reused
        freed = runner.on_reclaim(target)
        assert freed == before - kv_cache.physical_bytes >= target, (freed, before, kv_cache.physical_bytes)
        remapped = [m.first_granule for m in kv_cache.buffer.mapped_chunks if not any(m is c for c in chunks)]
        assert remapped == [], f"chunks at granules {remapped} were mapped anew: the shrink did not keep the blocks below"
        assert runner.preempted == [] and runner.running_requests == [2, 3]
        assert kv_cache.num_committed_blocks == 20
        assert runner.request_blocks(2) == list(range(9, 17)), "a block below the top moved"
        moved = [17, 18, 19, 1, 2, 3, 4, 5]
        assert runner.request_blocks(3) == moved, "request 3's blocks above the top did not move into the hole"
        table = runner.block_tables([2, 3])
        assert table[1, :8].tolist() == moved and table[1, 8:].eq(runner.NULL_BLOCK).all()
        check_contents(runner, written)
        assert held(client) == kv_cache.physical_bytes


@pytest.mark.invariant(1)
@pytest.mark.invariant(5)
def test_a_reclaim_below_a_chunk_straddling_the_top_still_frees_the_target():
    """A shrink keeping contents keeps a chunk that holds a block below the
    top whole: the top must be chosen by the footprint after such a shrink.
    One commit mapped blocks 1-16 (granules 1-4 of every layer) as one chunk
    per layer; keeping 5 blocks would keep that chunk, so the runner keeps 4."""
    with served_daemon(1 << 30) as served, BudgetClient(served.path, timeout=TIMEOUT_S) as client, \
            runner_under(client) as runner:
        written = requests_with_holes(runner, {1: 16}, finished=[1])
        written.update(requests_with_holes(runner, {2: 2}, finished=[]))
        kv_cache = runner.extensible_kv_cache
        before = kv_cache.physical_bytes
        target = before - kv_cache.physical_bytes_for(5)
        assert kv_cache.physical_bytes_after_shrink(5) == before, "no chunk straddles block 5: nothing to prove"
        assert kv_cache.blocks_kept_within(before - target) == 4
        freed = runner.on_reclaim(target)
        assert freed == before - kv_cache.physical_bytes >= target, (freed, target, before, kv_cache.physical_bytes)
        assert kv_cache.num_committed_blocks == 4 and kv_cache.physical_bytes == kv_cache.physical_bytes_for(4)
        assert runner.preempted == [] and runner.request_blocks(2) == [1, 2]
        check_contents(runner, written)
        assert held(client) == kv_cache.physical_bytes


@pytest.mark.invariant(1)
@pytest.mark.invariant(5)
def test_a_reclaim_preempts_the_newest_requests_only_as_far_as_it_must():
    with served_daemon(1 << 30) as served, BudgetClient(served.path, timeout=TIMEOUT_S) as client, \
            runner_under(client) as runner:
        written = requests_with_holes(runner, {1: 4, 2: 4, 3: 4, 4: 4, 5: 4}, finished=[2])
        kv_cache = runner.extensible_kv_cache
        before = kv_cache.physical_bytes
        target = before - kv_cache.physical_bytes_for(12)  # room for 2 requests beside the null block
        freed = runner.on_reclaim(target)
        assert freed >= target and freed == before - kv_cache.physical_bytes
        assert runner.preempted == [5, 4], "not the newest requests, newest first"
        assert runner.running_requests == [1, 3]
        del written[4], written[5]
        assert all(block < 12 for request_id in (1, 3) for block in runner.request_blocks(request_id))
        check_contents(runner, written)
        assert held(client) == kv_cache.physical_bytes
        runner.add_request(6, 4)  # the runner serves on, growing again
        assert held(client) == kv_cache.physical_bytes


@pytest.mark.invariant(1)
@pytest.mark.invariant(5)
def test_a_reclaim_it_cannot_free_is_answered_0_and_changes_nothing():
    with served_daemon(1 << 30) as served, BudgetClient(served.path, timeout=TIMEOUT_S) as client, \
            runner_under(client) as runner:
        written = requests_with_holes(runner, {1: 8, 2: 8}, finished=[])
        kv_cache = runner.extensible_kv_cache
        state = snapshot(kv_cache)
        impossible = kv_cache.physical_bytes - kv_cache.physical_bytes_for(1) + 1
        assert runner.on_reclaim(impossible) == 0
        check_unchanged(kv_cache, state)
        assert runner.preempted == [] and runner.request_blocks(1) == list(range(1, 9))
        check_contents(runner, written)
        assert held(client) == kv_cache.physical_bytes


@pytest.mark.invariant(1)
@pytest.mark.invariant(5)
def test_the_daemon_reclaims_from_a_runner_and_grants_the_engine_that_waited():
    """Engine A's runner holds most of the budget; engine B's commit waits
    while the daemon asks A; A's on_reclaim frees; B is granted."""
    budget = 4 << 20
    with served_daemon(budget) as served, BudgetClient(served.path, timeout=TIMEOUT_S) as client_a, \
            runner_under(client_a) as runner:
        written = requests_with_holes(runner, {i: 12 for i in range(1, 6)}, finished=[1, 3])  # 61 blocks: 3 MiB
        kv_cache = runner.extensible_kv_cache
        held_by_a = kv_cache.physical_bytes
        with BudgetClient(served.path, timeout=TIMEOUT_S) as client_b:
            layout = KVCacheLayout.BLHNC
            engine_b = ExtensibleKVCache(config_for("full", layout), HostDriver(GRANULE), layout, budget=client_b)
            try:
                # 2 MiB, past the 1 MiB left: the daemon asks A for 1 MiB, A's fair share being 2 MiB.
                blocks_b = (2 << 20) // engine_b.bytes_per_block
                assert engine_b.physical_bytes_for(blocks_b) > budget - held_by_a
                engine_b.commit(blocks_b)
                assert engine_b.num_committed_blocks == blocks_b
                # B's grant came from bytes A's handler returned, under A's
                # runner lock: holding it, the handler has ended.
                with runner.lock:
                    assert kv_cache.physical_bytes < held_by_a, "A gave nothing back, yet B was granted"
                    report = sorted(engine["held"] for engine in client_b.report()["engines"])
                    assert report == sorted([kv_cache.physical_bytes, engine_b.physical_bytes]), report
                    assert kv_cache.physical_bytes + engine_b.physical_bytes <= budget
            finally:
                engine_b.free()
        assert held(client_a) == kv_cache.physical_bytes
        survivors = runner.running_requests
        check_contents(runner, {request_id: written[request_id] for request_id in survivors})
        assert set(survivors) | set(runner.preempted) == {2, 4, 5}
