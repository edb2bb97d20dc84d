"""One ExtensibleKVCache driven beside its `CacheModel`: every operation of
the cache machines and the endurance walks, written once.

Theory of operation
-------------------
Each operation checks only what it alone could break; `check_everything()`
is the full invariant, which a Hypothesis machine (extkv.testing.machines)
runs after every step and an endurance walk (extkv.testing.stress) every K
steps. `PRECONDITIONS` says, as data, when each operation may run. Beyond
commits, shrinks (discarding or keeping contents), defragmentation,
release, recommit and block writes, the
cache exports its segments to a peer and compares digests, is freed and
recreated, and on CUDA captures graphs over blocks committed later and
replays them. Whether a defragmenting commit finds its prefix fragmented,
which decides what it discards, is read back from the driver before the
call, never from the cache's bookkeeping.
"""

from __future__ import annotations

import collections
import gc
import socket
from dataclasses import dataclass
from typing import Callable

import torch

from ..cache import ExtensibleKVCache
from ..connector import SegmentExportConnector, SegmentNotContiguousError
from ..errors import OutOfMemoryError
from ..layout import KVCacheLayout, kv_cache_segments
from ..peer import import_segments, sha256_hex
from ..usage import UsageProbe
from ..vmm import Driver, live_chunks, live_reservations
from .checks import (
    check_committed_blocks_mapped,
    check_mapped_as_a_shrink_keeps,
    check_readback_matches_bookkeeping,
    check_unchanged,
    check_usage_matches,
    read_back_granules,
    read_back_granules_and_one_chunk_per_segment,
    readback_one_chunk_per_segment,
    snapshot,
)
from .choices import Choices
from .configs import config_for
from .models import (
    CacheModel,
    ContentMismatch,
    LeakFound,
    check_addresses_fixed,
    check_cache_blocks,
    check_cache_committed,
    check_cache_one_chunk_per_segment,
    check_cache_physical_bytes,
)


def capacity_for(kind: str, layout: KVCacheLayout, granule: int) -> int:
    """A block count whose smallest segment spans about two and a half
    granules and ends inside one: commits cross granules, fragment, and
    segments of unpadded layer-outermost layouts share granules."""
    _, strides = kv_cache_segments(config_for(kind, layout, 1), layout)
    return (5 * granule) // (2 * min(strides)) | 1


@dataclass
class CapturedGraph:
    """A CUDA graph captured over `block` (maybe not committed at capture):
    replayed, it copies the block's row of each segment into `rows` and adds
    one to every byte of the block."""

    block: int
    graph: object  # torch.cuda.CUDAGraph
    rows: list[torch.Tensor]


#: When each operation of `ModelledCache` may run, given the model.
PRECONDITIONS: dict[str, Callable[["ModelledCache"], bool]] = {
    "commit_grow": lambda driven: driven.model.committed < driven.capacity,
    "commit_at_or_below": lambda driven: True,
    "shrink": lambda driven: driven.model.committed > 0,
    "shrink_preserving": lambda driven: driven.model.committed > 0,
    "defragment": lambda driven: True,
    "release": lambda driven: True,
    "recommit": lambda driven: True,
    "write_block": lambda driven: driven.model.mapped and driven.model.committed > 0,
    "read_block": lambda driven: driven.model.mapped and driven.model.committed > 0,
    "export_to_peer": lambda driven: driven.model.mapped and driven.model.committed > 0,
    "free_and_recreate": lambda driven: True,
    "capture_graph": lambda driven: driven.graphs_possible,
    "replay_graphs": lambda driven: any(driven.graph_replayable(graph) for graph in driven.graphs),
}

#: Graphs kept at once; capturing another drops the oldest.
MAX_GRAPHS = 4
#: Seconds an in-process peer waits on its socket before giving up.
PEER_TIMEOUT_S = 60.0


class ModelledCache:
    """One ExtensibleKVCache of `config_for(kind, layout, capacity)` on
    `driver`, driven beside its `CacheModel`.

    Each operation takes its arguments from a `Choices`, calls the real cache,
    applies the call to the model and runs the checks that this operation
    alone could break: counts and sizes, and the bytes it touched (new blocks
    zero, a written block as written). With `thorough` set, "touches nothing"
    is proven against a full `snapshot` instead of the mapped chunk objects;
    `check_everything()` is the full invariant (every byte, the driver's
    read-back, the usage probe). `operations` and `checks` count, by name,
    the operations that completed and the checks that passed.
    """

    def __init__(
        self,
        driver: Driver,
        probe: UsageProbe,
        kind: str,
        layout: KVCacheLayout,
        capacity: int | None = None,
        *,
        operations: collections.Counter | None = None,
        checks: collections.Counter | None = None,
    ):
        self.driver = driver
        self.probe = probe
        self.layout = layout
        self.capacity = capacity_for(kind, layout, driver.granularity) if capacity is None else capacity
        self.config = config_for(kind, layout, self.capacity)
        self.operations = collections.Counter() if operations is None else operations
        self.checks = collections.Counter() if checks is None else checks
        self.thorough = True
        #: Called with the `OutOfMemoryError` a commit met (real memory
        #: pressure); once it returns, the same call is made again. None:
        #: the error propagates.
        self.on_out_of_memory: Callable[[OutOfMemoryError], None] | None = None
        #: Whether the full check compares the usage probe: not while another
        #: process uses a device whose probe reads device-wide.
        self.usage_checks = True
        #: Whether a thorough "touches nothing" copies every committed byte
        #: (`snapshot`), and whether bytes are compared on the device: neither
        #: beside a process that leaves the device nearly full, where a
        #: comparison's temporary could meet torch's out-of-memory.
        self.snapshot_checks = True
        self.compare_on_host = False
        self.graphs: list[CapturedGraph] = []
        self.baseline = probe.read_outside_torch()
        self.live_before = (live_reservations[driver.kind], live_chunks[driver.kind])
        self.create()

    def create(self) -> None:
        self.cache = ExtensibleKVCache(self.config, self.driver, self.layout)
        self.model = CacheModel(self.capacity, self.cache.segment_offsets, self.cache.segment_strides, self.driver.granularity)
        self.base = self.cache.buffer.base

    def can(self, operation: str) -> bool:
        return PRECONDITIONS[operation](self)

    def ran(self, operation: str) -> None:
        self.operations[operation] += 1

    def checked(self, check: str) -> None:
        self.checks[check] += 1

    def call(self, operation: Callable[[], object]) -> None:
        """Make a real call that may create memory; an `OutOfMemoryError` goes
        to `on_out_of_memory`, then the call is made again."""
        while True:
            try:
                operation()
                return
            except OutOfMemoryError as error:
                if self.on_out_of_memory is None:
                    raise
                self.on_out_of_memory(error)

    # -- operations -------------------------------------------------------------
    def commit_grow(self, choose: Choices) -> None:
        model = self.model
        n = choose.integer(model.committed + 1, self.capacity + self.capacity // 4, "num_blocks")
        choose.note(f"commit({n})" + ("  # past capacity: clamped" if n > self.capacity else ""))
        unchanged_up_to = model.committed if model.mapped else 0
        self.call(lambda: self.cache.commit(n))
        model.grow(min(n, self.capacity))
        self.ran("commit (grow)")
        self.check_counts()
        self.check_blocks(unchanged_up_to, model.committed, "new blocks of a growing commit")

    def commit_at_or_below(self, choose: Choices) -> None:
        n = choose.integer(0, self.model.committed, "num_blocks")
        choose.note(f"commit({n})  # at or below {self.model.committed}: touches nothing")
        self.touching_nothing(lambda: self.cache.commit(n))
        self.ran("commit (at or below)")
        self.check_counts()

    def shrink(self, choose: Choices) -> None:
        model = self.model
        n = choose.integer(0, model.committed, "num_blocks")
        choose.note(f"commit({n}, shrink=True)")
        self.call(lambda: self.cache.commit(n, shrink=True))
        self.ran("commit (shrink)")
        if n < model.committed:
            model.discard(n)
            self.check_blocks(0, n, "blocks after a shrink")
        self.check_counts()

    def shrink_preserving(self, choose: Choices) -> None:
        """A shrink keeping contents: blocks below keep their bytes, every
        chunk left holds a kept byte (read back), and the footprint is what
        `physical_bytes_after_shrink` said before it. Asleep, only the count
        drops."""
        model, buffer = self.model, self.cache.buffer
        n = choose.integer(0, model.committed, "num_blocks")
        choose.note(f"commit({n}, shrink=True, preserve_contents=True)")
        predicted = self.cache.physical_bytes_after_shrink(n)
        self.call(lambda: self.cache.commit(n, shrink=True, preserve_contents=True))
        self.ran("commit (shrink, preserving)")
        read_back = read_back_granules(buffer)
        check_mapped_as_a_shrink_keeps(buffer, buffer.segment_sizes, read_back)
        assert self.cache.physical_bytes == predicted, (
            f"physical_bytes {self.cache.physical_bytes} after a preserving shrink to {n}, predicted {predicted}")
        model.shrink_keeping(n, frozenset(index // 2 for index, chunk in enumerate(read_back) if chunk is not None))
        self.checked("a preserving shrink kept exactly the chunks holding kept bytes, read back")
        self.check_counts()
        if model.mapped:
            self.check_blocks(0, n, "blocks a preserving shrink kept")

    def defragment(self, choose: Choices) -> None:
        model = self.model
        n = choose.integer(0, self.capacity + self.capacity // 4, "num_blocks")
        preserve = choose.boolean("preserve_contents")
        target = min(n, self.capacity)
        fragmented = not self.prefix_is_one_chunk(target)
        choose.note(f"commit({n}, defragment=True, preserve_contents={preserve})  # prefix fragmented: {fragmented}")
        unchanged_up_to = model.committed if model.mapped else 0
        self.call(lambda: self.cache.commit(n, defragment=True, preserve_contents=preserve))
        self.ran(f"commit (defragment, {'preserving' if preserve else 'discarding'})")
        if fragmented and not preserve:
            model.discard(target)
            unchanged_up_to = 0
        else:
            model.grow(target)
            if model.mapped:
                # Preserving a fragmented prefix moves every committed byte
                # of every segment onto one chunk; otherwise the prefix was
                # one chunk already and growth inside it maps nothing.
                model.one_chunk_blocks = model.committed if fragmented else max(model.one_chunk_blocks, target)
        self.check_counts()
        check_cache_one_chunk_per_segment(self.cache, model)
        self.checked("one chunk per segment, read back, after a defragment")
        if model.mapped:
            self.check_blocks(unchanged_up_to, model.committed, "blocks a defragmenting commit added or discarded")

    def release(self, choose: Choices) -> None:
        choose.note("release_physical()")
        self.cache.release_physical()
        self.model.release()
        self.ran("release_physical")
        self.check_counts()

    def recommit(self, choose: Choices) -> None:
        choose.note("recommit()")
        if self.model.mapped:
            self.touching_nothing(self.cache.recommit)
        else:
            self.call(self.cache.recommit)
            self.model.remap()
            self.check_blocks(0, self.model.committed, "recommitted blocks")
        self.ran("recommit")
        self.check_counts()

    def write_block(self, choose: Choices) -> None:
        block = choose.integer(0, self.model.committed - 1, "block")
        value = choose.integer(1, 255, "value")
        choose.note(f"block {block}: every row filled with {value}")
        for segment, stride in enumerate(self.model.strides):
            self.cache.buffer.segment_view(segment)[block * stride : (block + 1) * stride].fill_(value)
        self.model.values[block] = value
        self.ran("write a block")
        self.check_blocks(block, block + 1, "a block just written")

    def read_block(self, choose: Choices) -> None:
        block = choose.integer(0, self.model.committed - 1, "block")
        choose.note(f"read block {block}")
        self.ran("read a block")
        self.check_blocks(block, block + 1, "a block read back")

    def export_to_peer(self, choose: Choices) -> None:
        """Export the committed segments through a socket and import them as
        a peer does (extkv.peer); the peer's digests must be the model's. A
        fragmented cache must be refused instead, naming the segments."""
        buffer = self.cache.buffer
        fragmented = not all(readback_one_chunk_per_segment(buffer, buffer.segment_sizes))
        choose.note(f"export to a peer  # fragmented, read back: {fragmented}")
        connector = SegmentExportConnector()
        try:
            if fragmented:
                try:
                    connector.register_kv_caches(self.cache)
                except SegmentNotContiguousError:
                    self.ran("export (refused: fragmented)")
                    return
                raise AssertionError("register_kv_caches accepted segments the driver reads back as several chunks")
            connector.register_kv_caches(self.cache)
            sender, receiver = socket.socketpair()
            with sender, receiver:
                connector.export_to(sender)
                with import_segments(receiver, timeout=PEER_TIMEOUT_S) as imported:
                    digests = imported.digests()
        finally:
            connector.close()
        expected = self.expected_digests()
        wrong = [i for i, (got, want) in enumerate(zip(digests, expected)) if got != want]
        if wrong or len(digests) != len(expected):
            raise ContentMismatch(f"the peer's digests of segments {wrong} differ from the model's ({len(digests)} segments imported)")
        self.ran("export to a peer and compare digests")
        self.checked("peer's digests equal the model's")

    def free_and_recreate(self, choose: Choices) -> None:
        choose.note("free(), then a new cache")
        self.free()
        self.ran("free")
        self.check_nothing_left()
        self.create()
        self.ran("create")
        self.check_counts()

    @property
    def graphs_possible(self) -> bool:
        # Graph capture is a CUDA feature; on the host this rule never runs.
        return self.driver.kind == "cuda"

    def graph_replayable(self, graph: CapturedGraph) -> bool:
        """Replaying reads and writes the block: only while it is mapped."""
        return self.model.mapped and graph.block < self.model.committed

    def capture_graph(self, choose: Choices) -> None:
        """Capture a graph over a block that may not be committed yet; it is
        replayed once the block is (invariant 2)."""
        import torch.cuda

        block = choose.integer(0, self.capacity - 1, "block")
        choose.note(f"capture a CUDA graph over block {block}  # committed: {block < self.model.committed}")
        device = self.driver.device
        strides = self.model.strides
        addresses = [self.base + offset + block * stride for offset, stride in zip(self.model.offsets, strides)]
        views = [self.driver.view(address, stride) for address, stride in zip(addresses, strides)]
        rows = [torch.empty(stride, dtype=torch.uint8, device=device) for stride in strides]
        # Kernels only, no copy_: a captured memcpy node is checked against
        # the memory it reads when captured, and the block may be unmapped
        # then (cudaErrorInvalidValue on the H200); a kernel reads only when
        # replayed. The same kernels run once eagerly on scratch memory: CUDA
        # loads modules lazily, and loading one inside a capture fails.
        for row in rows:
            scratch = torch.zeros_like(row)
            row.zero_().add_(scratch)
            scratch.add_(1)
        torch.cuda.synchronize(device)
        self.drop_graphs(keep=MAX_GRAPHS - 1)
        before = self.probe.read_outside_torch()
        graph = torch.cuda.CUDAGraph()
        # thread_local: a sampler thread's driver calls must not break the capture.
        with torch.cuda.device(device), torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for view, row in zip(views, rows):
                row.zero_().add_(view)
                view.add_(1)
        torch.cuda.synchronize(device)
        # A graph's own memory is the CUDA driver's, not extkv's: whatever the
        # capture added leaves the baseline of the usage check.
        self.baseline += self.probe.read_outside_torch() - before
        self.graphs.append(CapturedGraph(block, graph, rows))
        self.ran("capture a CUDA graph")

    def replay_graphs(self, choose: Choices) -> None:
        """Replay every graph whose block is mapped now; each must read the
        block as the model says (eager execution's answer) and add one."""
        import torch.cuda

        for graph in self.graphs:
            if not self.graph_replayable(graph):
                continue
            choose.note(f"replay the CUDA graph over block {graph.block}")
            expected = self.model.values.get(graph.block, 0)
            graph.graph.replay()
            torch.cuda.synchronize(self.driver.device)
            for segment, row in enumerate(graph.rows):
                wrong = int((row != expected).count_nonzero())
                if wrong:
                    raise ContentMismatch(
                        f"CUDA graph over block {graph.block}: {wrong} of {row.numel()} bytes read in segment "
                        f"{segment} differ from {expected}, the block's value"
                    )
            value = (expected + 1) % 256
            if value:
                self.model.values[graph.block] = value
            else:
                self.model.values.pop(graph.block, None)
            self.ran("replay a CUDA graph")
            self.checked("graph replay read the model's bytes")
            self.check_blocks(graph.block, graph.block + 1, "a block a graph replay wrote")

    def drop_graphs(self, keep: int = 0) -> None:
        """Destroy all but the newest `keep` graphs."""
        if len(self.graphs) <= keep:
            return
        before = self.probe.read_outside_torch()
        self.graphs = self.graphs[len(self.graphs) - keep :]
        gc.collect()
        self.baseline += self.probe.read_outside_torch() - before

    def free(self) -> None:
        # A graph's pointers would reach whatever the freed reservation's
        # address space holds next.
        self.drop_graphs()
        self.cache.free()

    # -- checks -------------------------------------------------------------------
    def touching_nothing(self, call: Callable[[], object]) -> None:
        """Make `call`, which must change nothing: proven against a full
        snapshot when thorough, else by the mapped chunk objects and sizes."""
        if self.thorough and self.snapshot_checks:
            before = snapshot(self.cache)
            call()
            check_unchanged(self.cache, before)
            self.checked("unchanged: snapshot of chunks, read-back and bytes")
        else:
            chunks, sizes = self.cache.buffer.mapped_chunks, self.cache.buffer.segment_sizes
            call()
            check_same_mapping(self.cache, chunks, sizes)
            self.checked("unchanged: mapped chunk objects and sizes")

    def prefix_is_one_chunk(self, num_blocks: int) -> bool:
        return all(readback_one_chunk_per_segment(self.cache.buffer, self.model.sizes(num_blocks)))

    def check_counts(self) -> None:
        """Committed count, segment sizes and physical bytes as the model says
        (bookkeeping only: cheap enough for every step)."""
        check_cache_committed(self.cache, self.model)
        expected = self.model.physical_bytes()
        assert self.cache.physical_bytes == expected, f"physical_bytes {self.cache.physical_bytes}, model {expected}"
        self.checked("committed count, segment sizes, physical_bytes")

    def check_blocks(self, first: int, end: int, what: str) -> None:
        if end > first:
            check_cache_blocks(self.cache, self.model, first, end, what, on_host=self.compare_on_host)
            self.checked("bytes of the blocks an operation touched")

    def check_everything(self) -> None:
        cache, model = self.cache, self.model
        check_addresses_fixed(cache.buffer, cache.segment_offsets, self.base)
        check_cache_committed(cache, model)
        # The granules' read-back and the one-chunk probes in one read.
        read_back, one_chunk = read_back_granules_and_one_chunk_per_segment(
            cache.buffer, model.sizes(model.one_chunk_blocks) if model.mapped else []
        )
        if model.mapped:
            check_committed_blocks_mapped(cache, read_back)
            check_cache_blocks(cache, model, 0, model.committed, "committed blocks", on_host=self.compare_on_host)
        check_cache_physical_bytes(cache, model, read_back)
        check_cache_one_chunk_per_segment(cache, model, one_chunk)
        check_readback_matches_bookkeeping(cache.buffer, read_back)
        if self.usage_checks:
            check_usage_matches(self.probe, self.baseline, [cache.buffer])
        self.checked("everything: addresses, every byte, read-back, one chunk, usage probe")

    def check_mapping(self) -> None:
        """What must hold even between a refused call and its retry: the
        driver's read-back partitions the reservation as the bookkeeping
        does, and the usage probe agrees with `physical_bytes`."""
        check_readback_matches_bookkeeping(self.cache.buffer)
        if self.usage_checks:
            check_usage_matches(self.probe, self.baseline, [self.cache.buffer])
        self.checked("mapping consistent after a refused call: read-back, usage probe")

    def check_nothing_left(self) -> None:
        """After free(): the driver's live counts and the usage probe are back
        where they were before the first cache."""
        live = (live_reservations[self.driver.kind], live_chunks[self.driver.kind])
        if live != self.live_before:
            raise LeakFound(f"live (reservations, chunks) {self.live_before} before, {live} after free()")
        measured = self.probe.read_outside_torch() - self.baseline if self.usage_checks else 0
        if measured:
            raise LeakFound(f"{self.probe.source}: {measured} bytes above the baseline after free()")
        self.checked("nothing left after free: live counts, usage probe")

    def expected_digests(self) -> list[str]:
        """sha256 of each segment's committed bytes, from the model alone."""
        expected = self.model.block_values(self.model.committed)
        return [
            sha256_hex(expected[:, None].expand(self.model.committed, stride)) for stride in self.model.strides
        ]


def check_same_mapping(kv_cache: ExtensibleKVCache, chunks: list, sizes: list[int]) -> None:
    """The cheap form of "touched nothing": the same mapped chunk objects and
    the same segment sizes as before."""
    now = kv_cache.buffer.mapped_chunks
    assert len(now) == len(chunks) and all(a is b for a, b in zip(now, chunks)), (
        f"mapped chunks replaced: {len(chunks)} before, {len(now)} now"
    )
    assert kv_cache.buffer.segment_sizes == sizes, f"segment sizes {sizes} -> {kv_cache.buffer.segment_sizes}"
