"""Broken implementations, planted on purpose: the self-test of the checks.

Theory of operation
-------------------
A certificate is only as good as the checks behind it, and a check that can
never fail proves nothing. This module is a zoo of deliberately broken
implementations, each breaking one promise extkv makes, so that a test can
run the check that guards that promise over it and demand that the check
flags it (conformance/test_planted_defects.py); the same check over the
real, unbroken implementation must pass, or catching proves nothing.

Real parts only: every broken driver is a `WrappingDriver` around a real
driver (host or CUDA), which does all the real work; it changes one step and
leaves the rest alone, so what a check sees is real memory, real mappings
and the kernel's or the driver's own read-back. A broken tensor is an
`ExtensibleTensor` over a real driver that misstates one number (or, while
a defect's context is entered, every tensor's shrink from the top releases
one chunk too many); a broken cache is an `ExtensibleKVCache` over a real
driver whose bookkeeping of its commit-ahead counts slips in one place. Nothing
here knows the device kind: each defect is made of the driver protocol's
own steps, so it runs on the host driver and on each CUDA device alike.

The shared KV budget's defects are its real parts with one step broken: a
`BudgetedDriver` that asks nothing, tells nothing of what it released, or
rejoins a restarted daemon saying it holds nothing, or keeps bytes
granted ahead that it never confirmed; a `Ledger` that admits
past dead bytes, asks engines below their floor or denies a reserve that
creates under way could make room for; a `BudgetDaemon` that
keeps a dead lease's bytes for good, serves every uid or believes a release
an engine claims but did not make; a transformers `ExtensibleCache` that
keeps a finished generation it should give back. Their checks
(extkv.testing.budget, extkv.testing.ledger_machine,
extkv.testing.generating_engines) are those the budget's contract tests
run over the real parts.

Each defect is data, in `DEFECTS`: a name, what it breaks, the checks that
must flag it, and how to make it around a real driver. A defect that keeps
memory past a free (a leak) also remembers what it kept, and `give_back()`
releases it for real, so a test that proves a leak is seen leaves none.

Wrappers that read back access (`accesses_at`) forward it to the driver they
wrap: the read-back is the kernel's or the driver's, never a wrapper's.

To stage a broken driver for a test file run inside pytest (the harness's
per-test leak check, run through pytester in this process), `staged(driver)`
holds it where `staged_driver()` finds it for the length of the run.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from .. import deferred_signals, sleep
from ..ahead import CommitAhead
from ..budget.daemon import BudgetDaemon
from ..budget.driver import BudgetedDriver
from ..budget.ledger import Ledger
from ..cache import ExtensibleKVCache
from ..tensor import ExtensibleTensor
from ..vmm import Driver, PoisoningDriver
from ..vmm.base import Chunk
from ..vmm.wrapping import WrappingDriver


class PlantedDriver(WrappingDriver):
    """A `WrappingDriver` that forwards the access read-back too, and keeps
    nothing by default (`give_back` has nothing to do)."""

    def accesses_at(self, addresses: Iterable[int]) -> list[str | None]:
        return self.inner.accesses_at(addresses)

    def _access_at(self, address: int) -> str | None:
        return self.inner.access_at(address)

    def give_back(self) -> None:
        """Release for real whatever this defect kept past its free."""


# -- zeroing ----------------------------------------------------------------------
class SkipsZeroing(PlantedDriver):
    """Zeroes nothing: every `zero` step (the new bytes of a commit, those of
    a recommit) returns at once. Wrap it around a `PoisoningDriver`, so that
    what is not zeroed reads as the poison, not as the kernel's fresh zeros."""

    def _zero(self, address: int, size: int) -> None:
        pass


class SkipsZeroingInMappedGranules(PlantedDriver):
    """Zeroes nothing a growth commits in granules mapped before it (the
    `zero_ranges` step, a commit's zeroing past its new chunks): after a
    shrink keeping contents, a regrowth inside a chunk it kept whole leaves
    the bytes it commits again as they were."""

    def zero_ranges(self, ranges) -> None:
        pass


# -- mappings ------------------------------------------------------------------------
class MapsEarlierChunkAgain(PlantedDriver):
    """Maps the first chunk it mapped once more wherever a later chunk of the
    same size belongs: one physical granule then backs two addresses, and
    the later chunk is never mapped at all."""

    def __init__(self, inner: Driver):
        super().__init__(inner)
        self._first: Chunk | None = None

    def _map(self, address: int, chunk: Chunk) -> None:
        if self._first is None:
            self._first = chunk
        elif chunk.size == self._first.size and chunk.handle != self._first.handle:
            chunk = self._first
        self.inner._map(address, chunk)

    def _release(self, chunk: Chunk) -> None:
        # A released handle's number may be reused by the next create.
        if self._first is not None and chunk.handle == self._first.handle:
            self._first = None
        self.inner._release(chunk)


class SplitsChunks(PlantedDriver):
    """Backs every chunk of two granules or more by two driver chunks (its
    first granule, and the rest), mapped side by side, while the caller holds
    one `Chunk`: the bookkeeping says one chunk where the driver has two."""

    def __init__(self, inner: Driver):
        super().__init__(inner)
        self._pieces: dict[int, list[Chunk]] = {}  # handle given out -> the driver's chunks
        self._mapped: dict[int, int] = {}  # address -> handle given out

    def _create(self, size: int) -> Chunk:
        if size < 2 * self.granularity:
            return self.inner._create(size)
        head = self.inner._create(self.granularity)
        try:
            tail = self.inner._create(size - self.granularity)
        except BaseException:
            self.inner._release(head)
            raise
        self._pieces[head.handle] = [head, tail]
        return Chunk(head.handle, size)

    def _map(self, address: int, chunk: Chunk) -> None:
        offset = 0
        for piece in self._pieces.get(chunk.handle, [chunk]):
            self.inner._map(address + offset, piece)
            offset += piece.size
        self._mapped[address] = chunk.handle

    def _unmap(self, address: int, size: int) -> None:
        handle = self._mapped.pop(address, None)
        pieces = self._pieces.get(handle) if handle is not None else None
        if pieces is None:
            self.inner._unmap(address, size)
            return
        # One unmap per mapping the driver made, as cuMemUnmap wants.
        offset = 0
        for piece in pieces:
            self.inner._unmap(address + offset, piece.size)
            offset += piece.size

    def _release(self, chunk: Chunk) -> None:
        for piece in self._pieces.pop(chunk.handle, [chunk]):
            self.inner._release(piece)


# -- leaks ---------------------------------------------------------------------------
class KeepsChunksCounted(PlantedDriver):
    """`release` does nothing: the chunk stays alive, and so does its count
    in the driver's live chunks."""

    def __init__(self, inner: Driver):
        super().__init__(inner)
        self.kept: list[Chunk] = []

    def release(self, chunk: Chunk) -> None:
        self.kept.append(chunk)

    def give_back(self) -> None:
        while self.kept:
            # Through the public step: it lowers the live count this
            # wrapper's create raised.
            self.inner.release(self.kept.pop())


class KeepsChunksUncounted(PlantedDriver):
    """The release step does nothing, while the public `release` still counts
    the chunk as gone: only what is measured from outside (memfd pages,
    NVML, open descriptors) still sees it."""

    def __init__(self, inner: Driver):
        super().__init__(inner)
        self.kept: list[Chunk] = []

    def _release(self, chunk: Chunk) -> None:
        self.kept.append(chunk)

    def give_back(self) -> None:
        while self.kept:
            # The step alone: the count went down when this wrapper "released" it.
            self.inner._release(self.kept.pop())


class KeepsReservations(PlantedDriver):
    """`free_reservation` does nothing: the address space stays reserved,
    and counted in the driver's live reservations."""

    def __init__(self, inner: Driver):
        super().__init__(inner)
        self.kept: list[tuple[int, int]] = []

    def free_reservation(self, address: int, size: int) -> None:
        self.kept.append((address, size))

    def give_back(self) -> None:
        while self.kept:
            self.inner.free_reservation(*self.kept.pop())


# -- contents --------------------------------------------------------------------------
class ScribblesOnExport(PlantedDriver):
    """Exporting a chunk changes its first byte (adds 1 to it, through the
    chunk's own mapping): an export, which must change nothing in the
    exporter, changes committed bytes."""

    def __init__(self, inner: Driver):
        super().__init__(inner)
        self._mapped_at: dict[int, int] = {}  # handle -> address of its latest mapping

    def _map(self, address: int, chunk: Chunk) -> None:
        self.inner._map(address, chunk)
        self._mapped_at[chunk.handle] = address

    def _unmap(self, address: int, size: int) -> None:
        self.inner._unmap(address, size)
        for handle in [h for h, mapped in self._mapped_at.items() if mapped == address]:
            del self._mapped_at[handle]

    def _export_fd(self, chunk: Chunk, writable: bool) -> int:
        address = self._mapped_at.get(chunk.handle)
        if address is not None:
            self.inner.view(address, 1).add_(1)
            self.inner.synchronize()
        return self.inner._export_fd(chunk, writable)


# -- access ----------------------------------------------------------------------------
class IgnoresReadOnly(PlantedDriver):
    """Ignores every read-only request: exports are writable descriptors and
    every mapping is granted read-write. Both halves, since on the host the
    kernel refuses write access over a read-only descriptor: as the exporter
    and the importer of one connection, it maps an import told to be
    read-only read-write, on any device."""

    def _export_fd(self, chunk: Chunk, writable: bool) -> int:
        return self.inner._export_fd(chunk, True)

    def _set_access(self, address: int, size: int, writable: bool) -> None:
        self.inner._set_access(address, size, True)


class SecondGranuleWritable(PlantedDriver):
    """Grants a read-only request except for the second granule of each
    range, which it maps read-write (exports are writable descriptors, so
    the host kernel allows it): an import's first and last bytes read back
    read-only, one granule between them is writable."""

    def _export_fd(self, chunk: Chunk, writable: bool) -> int:
        return self.inner._export_fd(chunk, True)

    def _set_access(self, address: int, size: int, writable: bool) -> None:
        self.inner._set_access(address, size, writable)
        g = self.granularity
        if not writable and size > 2 * g:
            self.inner._set_access(address + g, g, True)


# -- bookkeeping of usage -------------------------------------------------------------
class OverReportingTensor(ExtensibleTensor):
    """Says it maps one granule more than it does."""

    @property
    def physical_bytes(self) -> int:
        return ExtensibleTensor.physical_bytes.fget(self) + self.granularity


class UnderReportingTensor(ExtensibleTensor):
    """Says it maps one granule less than it does."""

    @property
    def physical_bytes(self) -> int:
        return ExtensibleTensor.physical_bytes.fget(self) - self.granularity


@contextlib.contextmanager
def shrink_releases_a_kept_chunk() -> Iterator[None]:
    """While entered, every ExtensibleTensor's shrink keeping contents
    (`shrink_segments_`, and `physical_bytes_after_shrink` with it) also
    releases the highest chunk that holds kept bytes: bytes that stay
    committed are left unmapped."""
    real = ExtensibleTensor._chunks_holding_none_of

    def also_the_highest_kept(tensor: ExtensibleTensor, sizes):
        dropped = real(tensor, sizes)
        kept = [mapped for mapped in tensor.mapped_chunks if not any(mapped is gone for gone in dropped)]
        return sorted(dropped + kept[-1:], key=lambda mapped: mapped.first_granule)

    ExtensibleTensor._chunks_holding_none_of = also_the_highest_kept
    try:
        yield
    finally:
        ExtensibleTensor._chunks_holding_none_of = real


@contextlib.contextmanager
def wake_writes_whole_copy() -> Iterator[None]:
    """While entered, a SleepController's wake writes each segment's whole
    offload copy at the segment's address, whatever the cache has kept or
    committed since the sleep: after a shrink while asleep, the copy's bytes
    land past the committed ones, in unmapped memory where the shrink left
    a granule unmapped."""
    real = sleep._Registration.copy_in

    def whole_copy(registration) -> None:
        buffer = registration.buffer
        for index, copy in enumerate(registration.backup.copies):
            if copy.numel():
                buffer.driver.view(buffer.base + buffer.segment_offsets[index], copy.numel()).copy_(copy)

    sleep._Registration.copy_in = whole_copy
    try:
        yield
    finally:
        sleep._Registration.copy_in = real


# -- commit-ahead bookkeeping ----------------------------------------------------------
class PublishesBeforeMapping(CommitAhead):
    """Publishes each step's blocks as ready before it maps them: a step
    that then meets out-of-memory leaves them ready and unmapped, and the
    engine's commit counts them without a driver call."""

    def _step(self, driver) -> bool:
        cache = self.cache
        if cache.is_live and not self._paused and cache.grown_blocks < self._target():
            # Without the count lock: the slip is the order, not the locking.
            self.ready = min(self._target(), cache.grown_blocks + self.step_blocks)
        return super()._step(driver)


class ReadyBeforeMappedCache(ExtensibleKVCache):
    """A cache whose commit-ahead worker is a `PublishesBeforeMapping`."""

    _Worker = PublishesBeforeMapping


class CountsZeroedBeforeMapping(ExtensibleKVCache):
    """Records blocks as mapped and zeroed before it maps them: a growth
    that then meets out-of-memory (a commit's, or a commit-ahead step's)
    leaves the count behind, and a later commit up to it maps nothing."""

    def _grow_zeroed(self, num_blocks: int) -> None:
        self._zeroed_through = num_blocks
        self.buffer.grow_blocks_(num_blocks, True)


class StopsWorkerOnAwakeRecommit(ExtensibleKVCache):
    """`recommit` stops the commit-ahead worker to map without it, and
    starts it again only if the cache was asleep: on an awake cache, where
    a recommit must change nothing, it leaves commit-ahead off."""

    def recommit(self) -> None:
        ahead, asleep = self._ahead, self.is_asleep
        self.commit_ahead(0)
        super().recommit()
        if asleep and ahead is not None:
            self.commit_ahead(ahead.window_blocks, max_blocks=ahead.max_blocks, step_blocks=ahead.step_blocks)


# -- the shared KV budget ---------------------------------------------------------------
class CreatesWithoutGrant(BudgetedDriver):
    """Asks the budget nothing: its admission reserves no bytes and its
    creates look for no reservation, so every chunk is created without a
    grant (and, created outside any admission, is never returned)."""

    def admit(self, size: int, chunks: int = 1):
        return self.inner.admit(size, chunks)

    def _create(self, size: int) -> Chunk:
        return self.inner._create(size)


class _ForgetsReturned:
    """A budget client that forwards every call but `give_back`, the
    driver's report of what it released, which it drops."""

    def __init__(self, client):
        self.client = client

    def __getattr__(self, name: str):
        return getattr(self.client, name)

    def give_back(self, nbytes: int, lease: int) -> None:
        pass


class _KeepsAheadUnconfirmed:
    """A budget client that forwards every call, but settles a grant by
    confirming only what was created while keeping the rest ahead: the
    daemon takes those bytes back, and the engine still creates on them."""

    def __init__(self, client):
        self.client = client

    def __getattr__(self, name: str):
        return getattr(self.client, name)

    def settle_draw(self, ticket: int | None, granted: int, created: int, lease: int) -> None:
        if ticket is None:
            return self.client.settle_draw(ticket, granted, created, lease)
        self.client.confirm(ticket, created)
        self.client.give_back(granted - created, lease)


class KeepsAheadUnconfirmed(BudgetedDriver):
    """Keeps bytes granted ahead that it never confirmed as held: its later
    creates on them are covered by no grant."""

    def __init__(self, inner: Driver, client):
        super().__init__(inner, _KeepsAheadUnconfirmed(client))


class ReleasesUnreturned(BudgetedDriver):
    """Never tells the budget what it released: the `returned` of each
    release is dropped, so the ledger keeps counting bytes no chunk holds."""

    def __init__(self, inner: Driver, client):
        super().__init__(inner, _ForgetsReturned(client))


class RejoinsHoldingNothing(BudgetedDriver):
    """Tells its client it holds nothing: the hello with which the client
    rejoins a daemon that restarted says 0 bytes, so the new ledger counts
    none of the chunks this driver still maps."""

    def held_bytes(self, lease: int) -> int:
        super().held_bytes(lease)  # its releases name the new lease, as the real driver's do
        return 0


class AdmitsPastDeadBytes(Ledger):
    """Counts no dead bytes when it admits a reserve: what an engine that
    died held, which may still be in memory, is granted again at once."""

    def __init__(self, budget: int):
        super().__init__(budget)
        self._admitting = False

    @property
    def dead(self) -> int:
        return 0 if self._admitting else Ledger.dead.fget(self)

    def reserve(self, engine: str, nbytes: int, now: float, ahead: int = 0):
        self._admitting = True
        try:
            return super().reserve(engine, nbytes, now, ahead)
        finally:
            self._admitting = False


class ReclaimsBelowFloor(Ledger):
    """Plans reclaims as if no engine had a floor: an engine may be asked
    to give back bytes below it."""

    def _reclaim_plan(self, asker, nbytes, waiter):
        floors = {name: record.floor for name, record in self._engines.items()}
        for record in self._engines.values():
            record.floor = 0
        try:
            return super()._reclaim_plan(asker, nbytes, waiter)
        finally:
            for name, floor in floors.items():
                self._engines[name].floor = floor


class WaitsWhileAsked(Ledger):
    """Lets an engine that was asked to give back, and has not answered,
    begin a wait of its own: waiting inside a commit, it holds its cache's
    lock and cannot answer, and the wait that asked it misses its deadline."""

    def reserve(self, engine: str, nbytes: int, now: float, ahead: int = 0):
        asked = self._reclaims.pop(engine, None) if isinstance(engine, str) else None
        try:
            return super().reserve(engine, nbytes, now, ahead)
        finally:
            if asked is not None:
                self._reclaims[engine] = asked


class DeniesWhileCreatesSettle(Ledger):
    """Counts no other engine's open ticket as bytes that may come back: a
    reserve made just after another engine's cancel, which the daemon has
    not read yet, is denied for bytes on their way back."""

    def _settling(self, asker: str) -> int:
        return 0


class IgnoresOutsideReadings(Ledger):
    """Takes no outside reading of a dead lease: its dead bytes stay
    counted however gone its memory is."""

    def seen_gone(self, engine: str, outside_bytes: int, now: float) -> None:
        pass


class KeepsDeadLeases(BudgetDaemon):
    """A daemon whose ledger is an `IgnoresOutsideReadings`: what an engine
    held when it died stays counted for good, never granted again."""

    def __init__(self, device, budget: int, **options):
        super().__init__(device, budget, **options)
        self.ledger = IgnoresOutsideReadings(budget)


class IgnoresReadingsOfLiveEngines(Ledger):
    """Takes no outside reading of a live engine: a release it claims is
    believed however much of its memory the reading still shows."""

    def outside_reading(self, engine: str, nbytes: int, now: float) -> int:
        return 0


class BelievesClaimedReleases(BudgetDaemon):
    """A daemon whose ledger is an `IgnoresReadingsOfLiveEngines`: bytes an
    engine says it returned are granted again while it still maps them."""

    def __init__(self, device, budget: int, **options):
        super().__init__(device, budget, **options)
        self.ledger = IgnoresReadingsOfLiveEngines(budget)


class _EveryUid(frozenset):
    """Uids that hold every uid."""

    def __contains__(self, uid: object) -> bool:
        return True


class ServesEveryUid(BudgetDaemon):
    """Reads each peer's uid from the kernel, and finds every uid among
    those it serves: another user's process joins and is served."""

    def __init__(self, device, budget: int, **options):
        super().__init__(device, budget, **options)
        self.allowed_uids = _EveryUid(self.allowed_uids)


@functools.cache
def keeps_finished_generations() -> type:
    """`KeepsFinishedGenerations`: an ExtensibleCache that answers every
    reclaim `cannot` while its generation is finished, where the real one
    gives a finished generation back whole; an engine idling so keeps the
    memory another engine's burst needs. Built at the first call: the
    integration (extkv.integrations.transformers) imports transformers,
    which the rest of this module does without."""
    from ..integrations.transformers import ExtensibleCache

    class KeepsFinishedGenerations(ExtensibleCache):
        #: Between `finish_generation()` and `reset()`.
        finished = False

        def finish_generation(self) -> None:
            with self.lock:
                super().finish_generation()
                self.finished = True

        def reset(self) -> None:
            with self.lock:
                super().reset()
                self.finished = False

        def on_reclaim(self, target_bytes: int) -> int:
            with self.lock:
                return 0 if self.finished else super().on_reclaim(target_bytes)

    return KeepsFinishedGenerations


@contextlib.contextmanager
def signals_not_deferred() -> Iterator[None]:
    """While entered, extkv's operations run with signal handlers free to
    raise between any two of their steps."""
    deferral = deferred_signals._Deferral
    enter, exit_ = deferral.__enter__, deferral.__exit__
    deferral.__enter__ = lambda self: None
    deferral.__exit__ = lambda self, *exc_info: None
    try:
        yield
    finally:
        deferral.__enter__, deferral.__exit__ = enter, exit_


# -- the zoo, as data ------------------------------------------------------------------
@dataclass(frozen=True)
class Defect:
    """One planted defect: `make(real)` builds it around the real driver
    `real`: a driver; for a tensor defect a callable of the tensor's size;
    for a budgeted driver's, a callable of the budget client; a budget
    ledger's or daemon's defect has no driver to break and is the class to
    build in place of the real one (its `make` ignores `real`)."""

    name: str
    breaks: str
    #: The checks that must flag it, by the names they have in extkv.
    caught_by: tuple[str, ...]
    make: Callable[[Driver], object]


def _tensor_over(cls: type[ExtensibleTensor]) -> Callable[[Driver], Callable[[int], ExtensibleTensor]]:
    return lambda real: lambda size: cls(size, device=real)


def _cache_over(cls: type[ExtensibleKVCache]) -> Callable[[Driver], Callable[..., ExtensibleKVCache]]:
    return lambda real: lambda config, layout: cls(config, real, layout)


def _budgeted_over(cls: type[BudgetedDriver]) -> Callable[[Driver], Callable[..., BudgetedDriver]]:
    return lambda real: lambda client: cls(real, client)


DEFECTS: dict[str, Defect] = {
    defect.name: defect
    for defect in (
        Defect(
            "zeroing-skipped",
            "new and recommitted bytes read zero (invariants 1 and 4)",
            ("checks.check_all_equal over the new bytes, on poisoned memory",),
            lambda real: SkipsZeroing(PoisoningDriver(real)),
        ),
        Defect(
            "zeroing-in-mapped-granules-skipped",
            "bytes a growth commits again inside a chunk a preserving shrink kept read zero (invariant 1)",
            ("checks.check_all_equal over the bytes committed again",),
            SkipsZeroingInMappedGranules,
        ),
        Defect(
            "preserving-shrink-releases-a-kept-chunk",
            "a shrink keeping contents keeps every committed byte mapped (invariants 1 and 3)",
            ("checks.check_mapped_as_a_shrink_keeps",
             "stress.threads.reader_beside_preserving_shrinks: the reader's process dies of the read"),
            lambda real: shrink_releases_a_kept_chunk(),
        ),
        Defect(
            "wake-writes-whole-copy",
            "a wake writes back only the offloaded blocks the cache kept while asleep, never past the committed "
            "bytes (invariants 1 and 4)",
            ("testing.asleep.check_wakes_as_promised: pattern bytes read past the committed ones, or the child's "
             "death",),
            lambda real: wake_writes_whole_copy(),
        ),
        Defect(
            "granule-mapped-twice",
            "each bookkept chunk is one driver chunk of its own (invariant 3)",
            ("checks.check_readback_matches_bookkeeping",),
            MapsEarlierChunkAgain,
        ),
        Defect(
            "chunk-split-behind-bookkeeping",
            "one chunk per segment, as read back from the driver (invariant 3)",
            ("checks.readback_one_chunk_per_segment", "checks.check_readback_matches_bookkeeping"),
            SplitsChunks,
        ),
        Defect(
            "chunk-kept-after-free",
            "free returns every chunk (invariant 5)",
            ("harness no_leaks: live chunks",),
            KeepsChunksCounted,
        ),
        Defect(
            "chunk-kept-uncounted",
            "free returns every byte of physical memory (invariant 5)",
            (
                "checks.check_usage_matches after free",
                "harness no_leaks: usage witness (and open memfds on the host)",
                "stress.StressTally: a walk's leak in tally.leaks, through JSON and pooling",
                "stress fault enumeration: bytes above baseline after every attempt, a fault-free one too",
            ),
            KeepsChunksUncounted,
        ),
        Defect(
            "reservation-kept-after-free",
            "free returns the reservation (invariant 5)",
            ("harness no_leaks: live reservations",),
            KeepsReservations,
        ),
        Defect(
            "usage-over-reported",
            "physical_bytes equals the usage measured outside (invariant 5)",
            ("checks.check_usage_matches",),
            _tensor_over(OverReportingTensor),
        ),
        Defect(
            "usage-under-reported",
            "physical_bytes equals the usage measured outside (invariant 5)",
            ("checks.check_usage_matches",),
            _tensor_over(UnderReportingTensor),
        ),
        Defect(
            "byte-changed-by-export",
            "an export changes nothing in the exporter (invariant 8)",
            ("checks.check_unchanged",),
            ScribblesOnExport,
        ),
        Defect(
            "read-only-ignored",
            "an import told to be read-only is mapped read-only (invariant 8)",
            ("checks.check_mapped_read_only",),
            IgnoresReadOnly,
        ),
        Defect(
            "ahead-ready-before-mapped",
            "a commit counts only blocks mapped and zeroed (invariants 1 and 4)",
            ("checks.check_committed_blocks_mapped",),
            _cache_over(ReadyBeforeMappedCache),
        ),
        Defect(
            "zeroed-before-mapped",
            "a commit counts only blocks mapped and zeroed (invariants 1 and 4)",
            ("checks.check_committed_blocks_mapped",),
            _cache_over(CountsZeroedBeforeMapping),
        ),
        Defect(
            "worker-stopped-by-awake-recommit",
            "a recommit of an awake cache changes nothing (invariant 4)",
            ("checks.check_unchanged: the cache's own state",),
            _cache_over(StopsWorkerOnAwakeRecommit),
        ),
        Defect(
            "read-only-but-one-granule",
            "an import told to be read-only is mapped read-only, every granule of it (invariant 8)",
            ("checks.check_mapped_read_only: a probe in every granule",),
            SecondGranuleWritable,
        ),
        Defect(
            "signals-not-deferred",
            "an interrupted operation leaves the object consistent and leaks nothing (invariant 6)",
            ("interrupts.run_interrupted",),
            lambda real: signals_not_deferred(),
        ),
        Defect(
            "budget-create-without-grant",
            "no physical create without a covering grant of the shared budget (invariant 5)",
            ("testing.budget.CoveredCreates: the grant read from the daemon at each create",),
            _budgeted_over(CreatesWithoutGrant),
        ),
        Defect(
            "ahead-unconfirmed",
            "no physical create without a covering grant of the shared budget (invariant 5)",
            ("testing.budget.CoveredCreates: the grant read from the daemon at each create",),
            _budgeted_over(KeepsAheadUnconfirmed),
        ),
        Defect(
            "release-not-returned",
            "the budget's ledger holds exactly what an engine's chunks hold (invariant 5)",
            ("testing.budget.check_ledger_holds",),
            _budgeted_over(ReleasesUnreturned),
        ),
        Defect(
            "rejoin-holds-nothing",
            "a restarted daemon's ledger holds what each engine's chunks hold once it rejoined (invariant 5)",
            ("testing.budget.check_ledger_holds_each_cache: the ledger after the daemon's restart",),
            _budgeted_over(RejoinsHoldingNothing),
        ),
        Defect(
            "admission-forgets-dead-bytes",
            "grants and dead leases' bytes stay within the budget (invariant 5)",
            ("testing.ledger_machine.LedgerMachine: a reserve granted exactly when it fits",),
            lambda real: AdmitsPastDeadBytes,
        ),
        Defect(
            "reclaim-below-floor",
            "no engine is asked to give back bytes below its floor (invariant 5)",
            ("testing.ledger_machine.LedgerMachine: every reclaim leaves its engine at or above its floor",),
            lambda real: ReclaimsBelowFloor,
        ),
        Defect(
            "wait-while-asked",
            "no engine is both asked to give back and waiting on its own reserve (invariant 5)",
            ("testing.ledger_machine.LedgerMachine: no wait begun by an engine asked to give back",),
            lambda real: WaitsWhileAsked,
        ),
        Defect(
            "deny-while-creates-settle",
            "a reserve that creates under way could make room for waits for their settling (invariant 5)",
            ("testing.ledger_machine.LedgerMachine: no denial of a reserve that open tickets alone could make room for",),
            lambda real: DeniesWhileCreatesSettle,
        ),
        Defect(
            "dead-lease-kept",
            "a killed engine's bytes are granted again once seen gone, within 2 s of its exit (invariant 5)",
            ("testing.budget.ledger_settles: the ledger after a SIGKILL",),
            lambda real: KeepsDeadLeases,
        ),
        Defect(
            "uid-unchecked",
            "another uid is refused before anything it sends is read, and changes nothing (invariants 5 and 6)",
            ("testing.budget.check_uid_refused",),
            lambda real: ServesEveryUid,
        ),
        Defect(
            "claimed-release-believed",
            "a release an engine claims but did not make stays counted, as the outside reading shows (invariant 5)",
            ("testing.budget.check_claimed_release_counted",),
            lambda real: BelievesClaimedReleases,
        ),
        Defect(
            "finished-generation-kept",
            "an engine idling with a finished generation gives it back whole when another needs the room, so each of "
            "two engines reaches the budget less the other's floor (invariant 5)",
            ("testing.generating_engines.check_burst: a burst's peak against the budget less the idle engine's floor",),
            lambda real: keeps_finished_generations(),
        ),
    )
}


# -- staging a driver for a pytest run inside a test ---------------------------------------
_staged: list[Driver] = []


@contextlib.contextmanager
def staged(driver: Driver) -> Iterator[Driver]:
    """Hold `driver` where `staged_driver()` finds it, for the block's length."""
    _staged.append(driver)
    try:
        yield driver
    finally:
        _staged.remove(driver)


def staged_driver() -> Driver:
    """The driver of the innermost `staged` block."""
    if not _staged:
        raise LookupError("no driver is staged: run inside `with planted.staged(driver):`")
    return _staged[-1]
