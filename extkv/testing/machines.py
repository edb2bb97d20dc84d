"""Hypothesis state machines over ExtensibleTensor and ExtensibleKVCache,
each driven beside its plain-Python model (extkv.testing.models).

Theory of operation
-------------------
A machine owns one real object on a real driver (the conformance suite passes
a `PoisoningDriver`, a stress run may wrap it further) and its model. Every
rule calls the real operation and applies the same operation to the model,
with a `note()` naming the call so a failing example reads as a script; after
every step the machine's invariant holds the object against the model, the
driver's read-back and the usage probe.

`tensor_machine` resizes, writes, defragments, shrinks (keeping contents)
and releases segments, a release also with an unmap failing part way; without a known poison byte its
resizes always zero. `cache_machine` drives a `ModelledCache`
(extkv.testing.modelled_cache): each rule is one of its operations, with
arguments Hypothesis draws (`DrawnChoices`). `endurance_machine` adds the
rest of a cache's life: block reads, exports to a peer, free and recreate,
and CUDA graphs. `commit_ahead_machine` runs a cache beside its commit-ahead
worker (extkv.ahead), a concurrent actor whose progress the model predicts
once the worker is idle.

The suites build machines with `tensor_machine(...)` / `cache_machine(...)` /
`endurance_machine(...)` and run them with
`hypothesis.stateful.run_state_machine_as_test`.
"""

from __future__ import annotations

import collections
import threading

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ..cache import ExtensibleKVCache
from ..errors import DriverError
from ..layout import KVCacheLayout
from ..tensor import ExtensibleTensor
from ..usage import UsageProbe
from ..vmm import Driver, FaultInjectingDriver
from .checks import (
    check_committed_blocks_mapped,
    check_mapped_as_a_shrink_keeps,
    check_readback_matches_bookkeeping,
    check_usage_matches,
    read_back_granules,
    readback_one_chunk_per_segment,
)
from .choices import DrawnChoices
from .configs import config_for
from .modelled_cache import ModelledCache, capacity_for
from .models import (
    CacheModel,
    TensorModel,
    check_cache_blocks,
    check_addresses_fixed,
    check_tensor_contents,
    check_tensor_physical_bytes,
    check_tensor_sizes,
)

# -- the tensor -----------------------------------------------------------------
#: Segment capacities of the tensor machine, in granules. Three segments:
#: segment 1 starts mid-granule, so granules are shared and growth starts
#: inside mapped granules. One segment (ExtensibleTensor plans its growth on
#: a path of its own) that ends mid-granule.
TENSOR_MACHINE_SEGMENTS = {"three-segments": (5 / 2, 3 / 2, 3), "one-segment": (7 / 2,)}


def tensor_machine(driver: Driver, probe: UsageProbe, fresh_byte: int | None = None, segments: str = "three-segments"):
    """A state machine over one ExtensibleTensor on `driver`, its segments
    one of `TENSOR_MACHINE_SEGMENTS`. `fresh_byte`: what every new chunk of
    `driver` holds (a PoisoningDriver's pattern), or None if unknown."""
    granule = driver.granularity
    capacities = [int(granule * granules) for granules in TENSOR_MACHINE_SEGMENTS[segments]]

    class ExtensibleTensorMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.baseline = probe.read_outside_torch()
            self.faulty = FaultInjectingDriver(driver)
            self.tensor = ExtensibleTensor(sum(capacities), device=self.faulty, segment_capacities=capacities)
            self.model = TensorModel(capacities, granule, fresh_byte)
            self.base = self.tensor.base

        @rule(data=st.data())
        def grow(self, data):
            sizes = [
                data.draw(st.integers(size, capacity), label=f"size[{i}]")
                for i, (size, capacity) in enumerate(zip(self.model.sizes, capacities))
            ]
            zero_new = True if fresh_byte is None else data.draw(st.booleans(), label="zero_new")
            note(f"resize_segments_({sizes}, zero_new={zero_new})")
            self.tensor.resize_segments_(sizes, zero_new=zero_new)
            self.model.grow(sizes, zero_new)

        @precondition(lambda self: any(self.model.sizes))
        @rule(data=st.data(), value=st.integers(1, 255))
        def write(self, data, value):
            segment = data.draw(st.sampled_from([i for i, s in enumerate(self.model.sizes) if s]), label="segment")
            length = self.model.sizes[segment]
            start = data.draw(st.integers(0, length - 1), label="start")
            end = data.draw(st.integers(start + 1, length), label="end")
            note(f"segment_view({segment})[{start}:{end}].fill_({value})")
            self.tensor.segment_view(segment)[start:end].fill_(value)
            offset = self.model.offsets[segment]
            self.model.write(offset + start, offset + end, value)

        @precondition(lambda self: any(self.model.sizes))
        @rule(data=st.data())
        def defragment(self, data):
            segment = data.draw(st.sampled_from([i for i, s in enumerate(self.model.sizes) if s]), label="segment")
            note(f"defragment_segment_({segment})")
            self.tensor.defragment_segment_(segment)
            one = readback_one_chunk_per_segment(self.tensor, self.model.sizes)[segment]
            assert one, f"segment {segment} spans several chunks after defragment_segment_, read back"

        @precondition(lambda self: any(self.model.sizes))
        @rule(data=st.data())
        def shrink(self, data):
            sizes = [data.draw(st.integers(0, size), label=f"size[{i}]") for i, size in enumerate(self.model.sizes)]
            note(f"shrink_segments_({sizes})")
            predicted = self.tensor.physical_bytes_after_shrink(sizes)
            self.tensor.shrink_segments_(sizes)
            # What stays mapped, checked before the model takes it from the driver.
            read_back = read_back_granules(self.tensor)
            check_mapped_as_a_shrink_keeps(self.tensor, sizes, read_back)
            assert self.tensor.physical_bytes == predicted, (
                f"physical_bytes {self.tensor.physical_bytes} after the shrink, physical_bytes_after_shrink said {predicted}")
            self.model.shrink(sizes, frozenset(index // 2 for index, chunk in enumerate(read_back) if chunk is not None))

        @rule()
        def release(self):
            note("release_physical()")
            self.tensor.release_physical()
            self.model.release()

        @precondition(lambda self: self.tensor.num_physical_chunks > 1)
        @rule(data=st.data())
        def release_failing_part_way(self, data):
            # An unmap that fails leaves it and the chunks above it mapped over
            # the gap the released ones leave, and owes no release.
            chunks = self.tensor.num_physical_chunks
            nth = data.draw(st.integers(2, chunks), label="failing unmap")
            note(f"release_physical() with unmap call {nth} of {chunks} failing")
            self.faulty.fail_in("unmap", nth)
            try:
                self.tensor.release_physical()
            except DriverError:
                pass
            else:
                raise AssertionError(f"unmap call {nth} of {chunks} chunks never came")
            # Which granules stay depends on how the tensor cut its chunks,
            # which the model does not know: it takes them from the driver.
            read_back = read_back_granules(self.tensor)
            self.model.release(frozenset(index // 2 for index, chunk in enumerate(read_back) if chunk is not None))

        @invariant()
        def holds_what_the_model_says(self):
            check_tensor_sizes(self.tensor, self.model)
            check_addresses_fixed(self.tensor, self.model.offsets, self.base)
            # What is mapped before any byte is read: a committed byte with
            # nothing behind it fails here rather than faulting the reader.
            read_back = read_back_granules(self.tensor)
            check_tensor_physical_bytes(self.tensor, self.model, read_back)
            check_readback_matches_bookkeeping(self.tensor, read_back)
            check_tensor_contents(self.tensor, self.model)
            check_usage_matches(probe, self.baseline, [self.tensor])

        def teardown(self):
            self.tensor.free()

    return ExtensibleTensorMachine


# -- the KV cache ---------------------------------------------------------------
#: (config kind, layout) pairs the cache machine is meant for: shared
#: granules (unpadded LBHNC), two strides (mixed), one segment (BLHNC).
CACHE_MACHINE_CASES = [("full", KVCacheLayout.LBHNC), ("mixed", KVCacheLayout.LBNHC), ("full", KVCacheLayout.BLHNC)]


def machine_rule(operation: str):
    """A Hypothesis rule that runs `ModelledCache.<operation>` with drawn
    arguments, when its precondition holds."""

    def run(self, data):
        getattr(self.driven, operation)(DrawnChoices(data))

    run.__name__ = operation
    return precondition(lambda self: self.driven.can(operation))(rule(data=st.data())(run))


def cache_machine(
    driver: Driver,
    probe: UsageProbe,
    kind: str,
    layout: KVCacheLayout,
    capacity: int | None = None,
    *,
    operations: collections.Counter | None = None,
    checks: collections.Counter | None = None,
):
    """A state machine over one ExtensibleKVCache of `config_for(kind, layout,
    capacity)` on `driver` (a `ModelledCache`); `capacity` defaults to
    `capacity_for(...)`. Rules: growing, at-or-below, shrinking (discarding
    or keeping contents) and defragmenting commits, release, recommit, block
    writes; every invariant after every step. `operations` / `checks` count
    what ran."""

    class ExtensibleKVCacheMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.driven = ModelledCache(
                driver, probe, kind, layout, capacity, operations=operations, checks=checks
            )

        commit_grow = machine_rule("commit_grow")
        commit_at_or_below = machine_rule("commit_at_or_below")
        shrink = machine_rule("shrink")
        shrink_preserving = machine_rule("shrink_preserving")
        defragment = machine_rule("defragment")
        release = machine_rule("release")
        recommit = machine_rule("recommit")
        write_block = machine_rule("write_block")

        @invariant()
        def holds_what_the_model_says(self):
            self.driven.check_everything()

        def teardown(self):
            self.driven.free()

    return ExtensibleKVCacheMachine


def endurance_machine(
    driver: Driver,
    probe: UsageProbe,
    kind: str,
    layout: KVCacheLayout,
    capacity: int | None = None,
    *,
    operations: collections.Counter | None = None,
    checks: collections.Counter | None = None,
):
    """`cache_machine` with the rest of a cache's life: blocks read back,
    exports to a peer compared by digest, free and recreate, and on CUDA
    graphs captured over blocks committed later and replayed."""
    base = cache_machine(driver, probe, kind, layout, capacity, operations=operations, checks=checks)

    class EnduranceMachine(base):
        read_block = machine_rule("read_block")
        export_to_peer = machine_rule("export_to_peer")
        free_and_recreate = machine_rule("free_and_recreate")
        capture_graph = machine_rule("capture_graph")
        replay_graphs = machine_rule("replay_graphs")

    return EnduranceMachine


# -- the KV cache beside its commit-ahead worker ---------------------------------
#: Windows the commit-ahead machine switches between (0: off).
AHEAD_WINDOWS = (0, 1, 3, 16, 64)
#: Seconds the machine waits for the worker to reach the window the model expects.
AHEAD_PATIENCE_S = 30.0


def commit_ahead_machine(driver: Driver, probe: UsageProbe, layout: KVCacheLayout = KVCacheLayout.LBHNC):
    """A state machine over one ExtensibleKVCache with its commit-ahead worker
    (extkv.ahead) as a concurrent actor: rules commit, shrink (discarding
    or keeping contents), defragment (preserving), release, recommit, write
    blocks and change the window while the worker grows. The model keeps the committed count, the grown
    count the worker must reach once idle (the committed count plus the
    window, capped by the capacity; never less than before), and each
    written block's byte. After every step, once the worker has reached
    that count: the counts, every committed block mapped as the driver
    reads it back (awake), every grown block's bytes (written ones as
    written, every other one zero over poison), the driver's read-back, the
    footprint (exact, or after a preserving shrink every chunk holding a
    grown byte) and the usage probe."""
    kind = "full"
    capacity = capacity_for(kind, layout, driver.granularity)
    blocks = st.integers(0, capacity + capacity // 4)

    class CommitAheadMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.baseline = probe.read_outside_torch()
            self.cache = ExtensibleKVCache(config_for(kind, layout, capacity), driver, layout)
            self.committed = self.grown = self.window = 0
            self.asleep = False
            #: Whether a preserving shrink may have kept chunks straddling its
            #: end since the last release or discarding shrink.
            self.straddled = False
            # Only its block values: the counts above are this machine's.
            self.model = CacheModel(capacity, self.cache.segment_offsets, self.cache.segment_strides, driver.granularity)
            self.values = self.model.values

        def _settle(self) -> None:
            """The grown count the worker must reach, and wait for it."""
            if not self.asleep and self.window:
                self.grown = max(self.grown, min(self.committed + self.window, capacity))
            if not self.cache.settle_commit_ahead(AHEAD_PATIENCE_S):
                raise AssertionError(f"the worker never went idle: grown {self.cache.grown_blocks} of {self.grown} blocks")

        @precondition(lambda self: not self.asleep)
        @rule(n=blocks)
        def commit(self, n):
            note(f"commit({n})")
            self.cache.commit(n)
            self.committed = max(self.committed, min(n, capacity))
            self.grown = max(self.grown, self.committed)

        @precondition(lambda self: not self.asleep)
        @rule(data=st.data())
        def shrink(self, data):
            n = data.draw(st.integers(0, self.committed), label="num_blocks")
            note(f"commit({n}, shrink=True)")
            self.cache.commit(n, shrink=True)
            if n < self.committed or self.grown > n:  # blocks mapped past n go too
                self.committed = self.grown = n
                self.values.clear()
                self.straddled = False

        @rule(data=st.data())
        def shrink_preserving(self, data):
            n = data.draw(st.integers(0, self.committed), label="num_blocks")
            note(f"commit({n}, shrink=True, preserve_contents=True)")
            self.cache.commit(n, shrink=True, preserve_contents=True)
            self.committed = n
            if not self.asleep:  # asleep, only the count drops
                self.grown, self.straddled = n, True
            for block in [block for block in self.values if block >= n]:
                del self.values[block]

        @precondition(lambda self: not self.asleep)
        @rule(n=blocks)
        def defragment_preserving(self, n):
            note(f"commit({n}, defragment=True, preserve_contents=True)")
            self.cache.commit(n, defragment=True, preserve_contents=True)
            self.committed = max(self.committed, min(n, capacity))
            self.grown = max(self.grown, self.committed)

        @precondition(lambda self: not self.asleep)
        @rule()
        def release(self):
            note("release_physical()")
            self.cache.release_physical()
            self.asleep, self.grown, self.straddled = True, 0, False
            self.values.clear()

        @precondition(lambda self: self.asleep)
        @rule()
        def recommit(self):
            note("recommit()")
            self.cache.recommit()
            self.asleep, self.grown = False, self.committed

        @rule(window=st.sampled_from(AHEAD_WINDOWS))
        def change_window(self, window):
            note(f"commit_ahead({window})")
            self.cache.commit_ahead(window)
            self.window = window

        @precondition(lambda self: not self.asleep and self.committed)
        @rule(data=st.data(), value=st.integers(1, 255))
        def write_block(self, data, value):
            block = data.draw(st.integers(0, self.committed - 1), label="block")
            note(f"every row of block {block} filled with {value}")
            for segment, stride in enumerate(self.cache.segment_strides):
                self.cache.buffer.segment_view(segment)[block * stride : (block + 1) * stride].fill_(value)
            self.values[block] = value

        @invariant()
        def holds_what_the_model_says(self):
            self._settle()
            cache = self.cache
            with cache.buffer.lock:
                assert cache.num_committed_blocks == self.committed, f"committed {cache.num_committed_blocks}, model {self.committed}"
                assert cache.grown_blocks == self.grown, f"grown {cache.grown_blocks}, model {self.grown}"
                footprint = cache.physical_bytes_for(self.grown) if self.grown else 0
                if self.straddled:
                    # Chunks a preserving shrink kept whole may reach past the
                    # grown blocks; each must still hold one of their bytes.
                    check_mapped_as_a_shrink_keeps(cache.buffer, cache.buffer.segment_sizes)
                    assert cache.physical_bytes >= footprint, f"physical_bytes {cache.physical_bytes}, a prefix of {self.grown} blocks maps {footprint}"
                else:
                    assert cache.physical_bytes == footprint, f"physical_bytes {cache.physical_bytes}, a prefix of {self.grown} blocks maps {footprint}"
                if not self.asleep:
                    check_committed_blocks_mapped(cache)
                check_cache_blocks(cache, self.model, 0, self.grown, "grown blocks")
                check_readback_matches_bookkeeping(cache.buffer)
                check_usage_matches(probe, self.baseline, [cache.buffer])

        def teardown(self):
            self.cache.free()
            assert not [t for t in threading.enumerate() if t.name == "extkv-commit-ahead"], "free left the worker running"

    return CommitAheadMachine
