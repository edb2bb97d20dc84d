"""ExtensibleKVCache: a KV cache whose blocks are committed on demand.

Theory of operation
-------------------
The cache reserves address space for `kv_cache_config.num_blocks` blocks (its
capacity) in one `ExtensibleTensor` and commits a prefix of blocks: committing
n blocks backs the first `n * stride` bytes of every *segment*. Which segments a
config has depends on the layout (`kv_cache_segments`): one per layer region
for block-compact layer-outermost layouts, equal slices of one block stride
otherwise. Blocks never move, so views and captured CUDA graphs over the
reservation stay valid while the committed prefix grows.

The committed count only grows, except on request:

- `commit(n)` grows to n blocks (clamped to capacity) and zeroes the new ones;
  a commit at or below the committed count touches nothing, because engines
  re-run warmup while the cache holds live data.
- `commit(n, shrink=True)` below the committed count remaps a smaller prefix:
  contents are discarded and the physical footprint becomes exactly
  `physical_bytes_for(n)`. With `preserve_contents=True` it shrinks from the
  top instead (`ExtensibleTensor.shrink_segments_`): blocks [0, n) keep
  their bytes and mappings, every chunk holding none of them is released,
  and a chunk straddling a segment's new end stays whole
  (`physical_bytes_after_shrink(n)`); what an engine answering a reclaim of
  the shared budget uses, since it creates nothing and copies nothing.
- `commit(n, defragment=True)` makes every segment one physical chunk (what
  RDMA registration needs). Like the reference, it discards contents; with
  `preserve_contents=True` it instead moves one segment at a time onto a single
  chunk at the same address and keeps every byte.
- `release_physical()` / `recommit()`: sleep and wake; the recommitted pages
  read as zero.
- `commit_ahead(window)`: a background worker keeps up to `window` blocks
  mapped and zeroed past the committed count (`grown_blocks`), so a commit
  inside it makes no driver call and takes no reservation lock
  (extkv.ahead says how it meets every other operation).

The committed count has one owner, this module, and one lock: every write
holds the cache's count lock (a commit-ahead count holds only that one; a
locked operation takes it inside the reservation's). A commit is either
counted there, when the worker has the blocks ready, or made under the
reservation's lock.

The count also says which contents survive: only an operation that drops
contents lowers it (a preserving shrink to n, to n; a discarding shrink or
defragment, and free, to 0 before anything else), and a growth zeroes
only the blocks past it. So the fewest blocks committed since a moment are
the blocks whose bytes no operation has dropped since then: a
`ContentsWatch` (`watch_contents()`) reads exactly that, for a holder of a
copy taken at that moment (extkv.sleep's offload writes back that many
blocks at a wake). `release_physical` lowers nothing: its pages come back
zeroed at `recommit`, which is the sleeper's to restore, and the count
stays. The buffer's `release_count` answers another question, whether any
mapped contents went (a sleep's own release bumps it, and a shrink while
asleep, which unmaps nothing, does not), and cannot say how many blocks
survive.

Lifecycle, as data: `_LEGAL_IN` names the states each public operation is
legal in; on a freed cache every operation raises `StateError` naming it, and
nothing changes. A cache whose buffer broke (a failed step's undo failed
too: see extkv.tensor) is broken: every operation but `free` raises before
it changes anything, and `free` gives back what the driver shows. Every
state-changing operation holds the buffer's lock (the one `ExtensibleTensor`
lock of the reservation), so threads take turns, and defers signal
handlers until it returns, as the buffer's operations do.

The memory arithmetic lives in `extkv.sizing`; this module only applies it to
live readings of free memory.
"""

from __future__ import annotations

import bisect
import contextlib
import enum
import functools
import gc
import logging
import os
import threading
import weakref
from dataclasses import dataclass, replace

import torch

from . import validate
from .ahead import DEFAULT_STEP_BYTES, CommitAhead
from .budget.client import AbandonableReserves, BudgetClient
from .budget.driver import BudgetedDriver, budgeted
from .deferred_signals import deferred_signals
from .errors import StateError
from .layout import (
    KVCacheConfig,
    KVCacheLayout,
    KVCacheSpec,
    KVCacheTensor,
    create_kv_cache_views,
    kv_cache_segments,
    layer_kernel_block_size,
    layer_spec_for_tensor,
)
from .sizing import (
    blocks_within,
    committable_bytes,
    measure_kv_cache_bytes,
    segment_physical_bytes,
    torch_memory_limit_bytes,
)
from .tensor import ExtensibleTensor
from .vmm import Driver, canonical_device, torch_memory

logger = logging.getLogger(__name__)
_DEFERRED_SIGNALS = deferred_signals()

#: Every cache made in this process, so that a forked child can drop what
#: it inherited of their commit-ahead workers.
_CACHES: "weakref.WeakSet[ExtensibleKVCache]" = weakref.WeakSet()


def _forget_workers_after_fork() -> None:
    """In a forked child: a parent's worker thread is not there, and a count
    lock one of the parent's threads held at the fork would never be
    released. The child's copies only free (their buffers are inherited)."""
    for cache in list(_CACHES):
        cache._count_lock = threading.Lock()
        cache._worker_reserves = AbandonableReserves()
        cache._ahead = None


os.register_at_fork(after_in_child=_forget_workers_after_fork)

GiB = float(1 << 30)


class ContentsWatch:
    """Of the blocks committed when it was made (`watch_contents()`), how
    many still hold their contents: `kept_blocks`, the fewest blocks
    committed since then. A shrink keeping contents to n lowers it to n, a
    discarding shrink or defragment (and `free`) to 0; a growth, a release
    for sleep and its recommit leave it. The cache lowers every live watch
    under its count lock as it lowers the count; a watch ends when dropped."""

    __slots__ = ("kept_blocks", "__weakref__")

    def __init__(self, kept_blocks: int):
        self.kept_blocks = kept_blocks

    def __repr__(self) -> str:
        return f"ContentsWatch(kept_blocks={self.kept_blocks})"


class _State(enum.Enum):
    LIVE = "live"
    #: Read from the buffer (`is_broken`), never stored: only `free` is legal.
    BROKEN = "broken"
    #: Read from the buffer (`is_inherited`): a forked child's copy; only `free`.
    INHERITED = "inherited"
    FREED = "freed"


_EVERY_STATE = frozenset(_State)
_LEGAL_IN: dict[str, frozenset[_State]] = {
    "allocate": frozenset({_State.LIVE}),
    "commit": frozenset({_State.LIVE}),
    "release_physical": frozenset({_State.LIVE}),
    "recommit": frozenset({_State.LIVE}),
    "physical_bytes_for": frozenset({_State.LIVE}),
    "physical_bytes_after_shrink": frozenset({_State.LIVE}),
    "blocks_within": frozenset({_State.LIVE}),
    "blocks_kept_within": frozenset({_State.LIVE}),
    "committable_blocks": frozenset({_State.LIVE}),
    "committed_views": frozenset({_State.LIVE}),
    "committed_kv_cache_tensors": frozenset({_State.LIVE}),
    "set_torch_memory_limit": frozenset({_State.LIVE}),
    "commit_ahead": frozenset({_State.LIVE}),
    "watch_contents": frozenset({_State.LIVE}),
    "free": _EVERY_STATE,
}


def _operation(method):
    """Run `method` holding the buffer's lock, once the cache's state allows
    it, with signal handlers deferred until it returns."""
    name = method.__name__.lstrip("_")  # `_commit` is commit's locked part
    # A tuple, not the set: `in` on a tuple finds the member by identity,
    # without hashing the enum in Python (a commit passes here twice).
    legal_in = tuple(_LEGAL_IN[name])

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with _DEFERRED_SIGNALS, self.buffer.lock:
            state = self._state
            if state is _State.LIVE and (self.buffer.is_broken or self.buffer.is_inherited):
                # The buffer's, not states of the cache's own.
                state = _State.BROKEN if self.buffer.is_broken else _State.INHERITED
            if state not in legal_in:
                article = "an" if state is _State.INHERITED else "a"
                raise StateError(f"ExtensibleKVCache.{name}() is not allowed on {article} {state.value} cache")
            return method(self, *args, **kwargs)

    return locked


def _giving_up_the_worker_s_reserve(operation):
    """Applied outside `@_operation`, for one that stops, pauses or replaces
    the commit-ahead worker (free, commit_ahead, release_physical): its wait
    for the reservation's lock gives up a step's reserve
    (`ExtensibleKVCache.worker_reserve_given_up`)."""

    @functools.wraps(operation)
    def before_the_worker(self, *args, **kwargs):
        if self._ahead is None:
            # No worker to give up (a release is timed against the raw
            # sequence). One a racing `commit_ahead` starts now is stopped
            # or paused by this operation all the same, after its step.
            return operation(self, *args, **kwargs)
        with _DEFERRED_SIGNALS:
            with self.worker_reserve_given_up():
                self.buffer.lock.acquire()
            try:
                return operation(self, *args, **kwargs)  # takes the lock again: it is re-entrant
            finally:
                self.buffer.lock.release()

    return before_the_worker


@dataclass(frozen=True)
class _PlacedLayer:
    """One layer of a config: its group and spec, the shared tensor it lives
    in, and where its page of block 0 starts in the allocation."""

    name: str
    group_id: int
    spec: KVCacheSpec
    tensor: KVCacheTensor
    start: int


def _placed_layers(kv_cache_config: KVCacheConfig) -> list[_PlacedLayer]:
    placed = []
    for tensor in kv_cache_config.kv_cache_tensors:
        group_id, spec = layer_spec_for_tensor(kv_cache_config, tensor)
        placed += [
            _PlacedLayer(name, group_id, spec, tensor, tensor.layer_offset(index)) for index, name in enumerate(tensor.layers)
        ]
    return placed


def _check_config_and_layout(kv_cache_config, layout) -> None:
    if not isinstance(kv_cache_config, KVCacheConfig):
        raise ValueError(f"kv_cache_config must be a KVCacheConfig, got {kv_cache_config!r}")
    if not isinstance(layout, KVCacheLayout):
        raise ValueError(f"layout must be a KVCacheLayout (e.g. KVCacheLayout.LBHNC), got {layout!r}")


def _block_count(num_blocks) -> int:
    return validate.integer("num_blocks", num_blocks, what="a block count")


class ExtensibleKVCache:
    """Growable backing allocation for the KV cache of `kv_cache_config`.

    `budget`: an extkv.budget.BudgetClient whose grant covers every
    physical create of this cache (default: the client of the daemon
    EXTKV_BUDGET names, if set); a create it denies raises BudgetDeniedError,
    an OutOfMemoryError, before anything changes."""

    # Sizing state, set by the lifecycle as it learns more; these defaults
    # hold until then.
    #: What a commit before the final sizing must leave free: the activation
    #: peak warmup is about to reach, as profiled.
    reserved_headroom_bytes: int = 0
    #: What every rank agreed warmup may commit (the least committable).
    warmup_committable_blocks: int = 0
    #: The byte cap put on torch's allocator once the cache is sized; None: uncapped.
    torch_memory_limit: int | None = None
    #: What `commit_ahead` starts (extkv.ahead).
    _Worker = CommitAhead

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        device: torch.device | str | Driver | None,
        layout: KVCacheLayout,
        *,
        budget: BudgetClient | None = None,
    ):
        _check_config_and_layout(kv_cache_config, layout)
        # Every physical create asks the shared budget first, where one is given or EXTKV_BUDGET names one.
        device = budgeted(device, budget)
        if not kv_cache_config.kv_cache_tensors:
            raise ValueError("kv_cache_config has no kv_cache_tensors; the cache needs at least one")
        self.capacity_blocks = validate.integer("kv_cache_config.num_blocks", kv_cache_config.num_blocks, minimum=1)
        self.segment_offsets, self.segment_strides = kv_cache_segments(kv_cache_config, layout)
        self.size = kv_cache_config.kv_cache_tensors[0].size
        self.layout = layout
        self.bytes_per_block = sum(self.segment_strides)
        #: Guards `_committed` and the commit-ahead worker's counts (extkv.ahead).
        self._count_lock = threading.Lock()
        self._committed = 0
        #: Blocks this cache's own growth mapped and zeroed (its commits and
        #: its commit-ahead worker's steps): a commit counts blocks up to
        #: here without mapping. 0 once anything remaps or releases them.
        self._zeroed_through = 0
        #: The commit-ahead worker while commit-ahead is on (`commit_ahead`).
        self._ahead: CommitAhead | None = None
        #: What every worker of this cache reserves under, so that an
        #: operation gives up a step's reserve whichever worker made it.
        self._worker_reserves = AbandonableReserves()
        #: Live `ContentsWatch`es, lowered with the count (count lock held).
        self._watches: "weakref.WeakSet[ContentsWatch]" = weakref.WeakSet()
        self._asleep = False
        _CACHES.add(self)
        ends = self.segment_offsets[1:] + [self.size]
        try:
            with _DEFERRED_SIGNALS:  # a signal before the assignment would leak the buffer
                self.buffer = ExtensibleTensor(
                    self.size,
                    device=device,
                    segment_capacities=[end - start for start, end in zip(self.segment_offsets, ends)],
                    segment_strides=self.segment_strides,
                )
                self._state = _State.LIVE
        except BaseException:
            # A handler deferred to the end raised: the caller never gets
            # this cache, so it must not keep the buffer.
            if getattr(self, "_state", None) is _State.LIVE:
                self.free()
            raise

    # -- committing -----------------------------------------------------------
    @_operation
    def allocate(self, size: int) -> torch.Tensor:
        """Allocator hook for an engine's KV cache allocation: commits only the
        null block and returns the whole reservation."""
        if validate.integer("size", size, what="bytes") != self.size:
            raise ValueError(f"allocate({size!r}): this cache backs exactly {self.size} bytes")
        self.commit(1)
        return self.buffer.full_view()

    def commit(
        self,
        num_blocks: int,
        defragment: bool = False,
        shrink: bool = False,
        *,
        preserve_contents: bool = False,
    ) -> None:
        """Back the first `num_blocks` blocks (clamped to capacity); new blocks
        read as zero.

        Grow-only unless `shrink`, which drops the blocks from `num_blocks`
        on, and those a commit-ahead worker grew past it. By default (the
        reference's contract) a shrink remaps a smaller prefix: contents
        are discarded and the footprint is exactly
        `physical_bytes_for(num_blocks)`. With `preserve_contents`, blocks
        [0, num_blocks) keep their bytes and stay mapped, and after a device
        synchronize every chunk holding no byte of them is unmapped and
        released; a chunk holding some stays mapped whole (an unmap takes
        whole mappings), so the footprint is
        `physical_bytes_after_shrink(num_blocks)`: `physical_bytes_for`
        plus the rest of each chunk straddling a segment's new end. It
        creates nothing; a later commit zeroes the blocks it commits again.
        Asleep, it lowers the count and maps nothing (a recommit maps the
        blocks kept, zeroed, as any wake).

        `defragment` backs each segment with one chunk; it discards contents
        unless `preserve_contents`, which moves one segment at a time and
        keeps every byte. With `shrink` too, the preserving shrink runs
        first, then the preserving defragment of what stays. Flags must be
        bools; `preserve_contents` alone raises before anything changes. A
        discarding shrink or defragment whose release fails part way leaves
        no blocks committed, a preserving shrink `num_blocks`; calling it
        again completes it. With commit-ahead on, a plain commit of blocks
        the worker has ready counts them without the reservation's lock.
        """
        ahead = self._ahead
        if (ahead is not None and type(num_blocks) is int and 0 <= num_blocks <= ahead.ready and defragment is False
                and shrink is False and preserve_contents is False and self._count_ready(num_blocks)):
            return
        self._commit(num_blocks, defragment, shrink, preserve_contents=preserve_contents)

    def _count_ready(self, num_blocks: int) -> bool:
        """Count `num_blocks` committed without the reservation's lock if
        the commit-ahead worker has them ready, ordering the caller's stream
        after their zeroing; False: the caller takes the locked path (not
        ready, or withdrawn since the caller looked)."""
        with _DEFERRED_SIGNALS, self._count_lock:
            ahead = self._ahead
            # A buffer breaks under the reservation's lock (a failed undo, in
            # a step or a locked operation), whatever ready says then.
            if ahead is None or num_blocks > ahead.ready or self.buffer.is_broken:
                return False
            if num_blocks > self._committed:
                self.buffer.driver.wait_for(ahead.fence)
                self._committed = num_blocks
                ahead.wake()  # the window moved: restore it
            return True

    @_operation
    def _commit(self, num_blocks: int, defragment: bool, shrink: bool, *, preserve_contents: bool) -> None:
        if type(num_blocks) is not int or num_blocks < 0:
            num_blocks = _block_count(num_blocks)  # raises, or an int from an index-like value
        num_blocks = min(num_blocks, self.capacity_blocks)
        ahead = self._ahead
        if ahead is not None:
            ahead.raise_kept_error()  # a background failure, before anything changes
        if defragment is False and shrink is False and preserve_contents is False:
            # The call an engine makes on every step, without the flag checks
            # and plans below, and without a log line (the runner logs
            # growth): on a small commit each Python call between two driver
            # calls runs on CPU caches the driver's work left cold, and a few
            # of them cost as much as a driver step.
            if num_blocks > self._committed:
                if num_blocks > self._zeroed_through:
                    self._grow_zeroed(num_blocks)
                    if self._asleep:
                        self._wake_counted()
                elif ahead is not None:
                    # The worker grew them: its zeroing is ordered before
                    # the caller's later kernels. (A stopped worker's ran
                    # before the stop returned.)
                    self.buffer.driver.wait_for(ahead.fence)
                self._count(num_blocks)
            return
        if ahead is None:
            return self._remapping_commit(num_blocks, defragment, shrink, preserve_contents)
        ahead.withdraw()  # what follows may unmap or move mapped blocks
        try:
            self._remapping_commit(num_blocks, defragment, shrink, preserve_contents)
        finally:
            ahead.restore(self._zeroed_through)

    def _wake_counted(self) -> None:
        """A commit mapped every committed block of a released cache: it is
        awake, as after `recommit`."""
        self._asleep = False
        if self._ahead is not None:
            self._ahead.resume(self._zeroed_through)

    def _grow_zeroed(self, num_blocks: int) -> None:
        """Map and zero blocks up to `num_blocks`; reservation lock held."""
        self.buffer.grow_blocks_(num_blocks, True)
        self._zeroed_through = num_blocks

    def _count(self, num_blocks: int) -> None:
        """A locked commit made `num_blocks` committed (grow-only: a count
        raised meanwhile without the lock stays); the worker, if any, is
        told what is grown now."""
        ahead = self._ahead
        if ahead is None:
            # No count without the lock runs while commit-ahead is off: the
            # reservation's lock, held here, is the only writer's.
            self._committed = num_blocks
            return
        with self._count_lock:
            if num_blocks > self._committed:
                self._committed = num_blocks
        ahead.published(self._zeroed_through)

    def _uncount(self) -> None:
        """No block committed, before a release that remaps them; reservation
        lock held and, with commit-ahead on, ready withdrawn."""
        self._lower_count(0)

    def _lower_count(self, num_blocks: int) -> None:
        """The count drops to `num_blocks` (at most the committed ones): the
        only way it drops, so every watch learns of each drop of contents."""
        with self._count_lock:
            self._committed = num_blocks
            for watch in self._watches:
                if num_blocks < watch.kept_blocks:
                    watch.kept_blocks = num_blocks

    @_operation
    def watch_contents(self) -> ContentsWatch:
        """A `ContentsWatch` from now: the blocks committed now, lowered by
        every operation that drops contents until it is dropped. For code
        that keeps a copy of the committed blocks across operations it does
        not make (a sleep's offload): what it may write back of the copy."""
        with self._count_lock:
            watch = ContentsWatch(self._committed)
            self._watches.add(watch)
        return watch

    @property
    def num_committed_blocks(self) -> int:
        """Blocks committed: what views, committed tensors and block ids cover."""
        return self._committed

    def _remapping_commit(self, num_blocks: int, defragment, shrink, preserve_contents) -> None:
        """A commit with flags: checked, then a release where the result must
        be remapped, then the growth left as a plain commit."""
        defragment = validate.flag("defragment", defragment)
        shrink = validate.flag("shrink", shrink)
        preserve_contents = validate.flag("preserve_contents", preserve_contents)
        if preserve_contents and not (defragment or shrink):
            raise ValueError("preserve_contents=True only applies with shrink=True or defragment=True")
        if shrink and preserve_contents:
            return self._preserving_shrink(num_blocks, defragment)
        # The prefix of `num_blocks`, and the blocks a commit-ahead worker
        # mapped past the committed ones: chunks of their own, which a
        # registration of the buffer covers.
        past = self.grown_blocks if self.grown_blocks > self._committed else 0
        fragmented = defragment and not all(
            self.buffer.segments_backed_by_one_chunk(self._sizes_for(max(num_blocks, past))))
        # A shrink that failed in its release left no blocks committed and
        # some chunks mapped: calling it again releases those too. (Chunks a
        # failed growth left mapped past committed blocks are no reason to
        # discard the blocks.)
        owed = self.num_committed_blocks == 0 and self.buffer.physical_bytes > 0
        # Blocks a commit-ahead worker mapped past `num_blocks` go too: after
        # a shrink the footprint is exactly physical_bytes_for(num_blocks).
        shrinking = shrink and (num_blocks < self._committed or owed or self.grown_blocks > num_blocks)
        if shrinking or (fragmented and not preserve_contents):
            # Before the release: it zeroes the buffer's sizes even when a
            # driver step fails part way, and a count left above them would
            # make the next commit of fewer blocks map nothing.
            self._uncount()
            self._zeroed_through = 0
            self.buffer.release_physical()
            self.commit(num_blocks)  # the growth left is a plain commit
            if self._asleep:  # of no blocks: every committed block is mapped all the same
                self._wake_counted()
        else:
            self.commit(num_blocks)
        if fragmented and preserve_contents:
            self.buffer.defragment_segments_()
        if shrinking or fragmented:
            logger.debug("KV cache at %s after commit(%d).", self, num_blocks)

    def _preserving_shrink(self, num_blocks: int, defragment: bool) -> None:
        """`commit(n, shrink=True, preserve_contents=True)`, flags checked:
        a count above the committed one is a plain commit first; then the
        count drops and the buffer releases every chunk that holds no byte
        of the first n blocks (the worker's blocks past n among them).
        Count and sizes drop before any driver step, so a release that
        fails part way leaves n blocks committed and mapped, and the same
        call again releases the rest. Asleep, nothing is mapped to keep:
        the count drops and the cache stays asleep. With `defragment`, the
        preserving defragment of what stays follows."""
        if num_blocks > self._committed:
            self.commit(num_blocks)  # maps and zeroes, and wakes a sleeping cache, as any growth
        else:
            self._lower_count(num_blocks)
        self._zeroed_through = min(self._zeroed_through, num_blocks)
        self.buffer.shrink_segments_(self._kept_sizes(num_blocks))
        if defragment and not all(self.buffer.segments_backed_by_one_chunk(self.buffer.segment_sizes)):
            self.buffer.defragment_segments_()
        logger.debug("KV cache at %s after commit(%d, shrink=True, preserve_contents=True).", self, num_blocks)

    @_operation
    def physical_bytes_after_shrink(self, num_blocks: int) -> int:
        """Bytes mapped once `commit(num_blocks, shrink=True,
        preserve_contents=True)` has run, for `num_blocks` at most the
        committed ones, read from the chunks mapped now: the chunks holding
        a byte of the first `num_blocks` blocks of some segment stay whole,
        every other one goes. At least `physical_bytes_for(num_blocks)`,
        and more by the rest of each chunk that straddles a segment's new
        end; 0 while asleep."""
        num_blocks = validate.integer("num_blocks", num_blocks, maximum=self._committed,
                                      what="a block count, at most the committed ones")
        return self._bytes_after_shrink(num_blocks)

    def _bytes_after_shrink(self, num_blocks: int) -> int:
        return self.buffer.physical_bytes_after_shrink(self._kept_sizes(num_blocks))

    def _kept_sizes(self, num_blocks: int) -> list[int]:
        """Each segment's bytes a preserving shrink to `num_blocks` keeps:
        its first `num_blocks` blocks as far as they are mapped (none while
        asleep, or where the buffer was released under the cache)."""
        return [min(num_blocks * stride, size) for stride, size in zip(self.segment_strides, self.buffer.segment_sizes)]

    @_operation
    def blocks_kept_within(self, num_bytes: int) -> int:
        """Most blocks, at most the committed ones, that a preserving shrink
        to them leaves within `num_bytes` mapped: the largest n whose
        `physical_bytes_after_shrink(n)` is at most `num_bytes` (0 keeps
        nothing mapped, so there always is one). What an engine answering
        a reclaim of the shared budget shrinks to."""
        num_bytes = validate.integer("num_bytes", num_bytes, what="bytes")
        # The footprint after a preserving shrink grows with n and is at
        # least physical_bytes_for(n): bisect below what blocks_within allows.
        low, high = 0, min(self.blocks_within(num_bytes), self._committed)
        while low < high:
            middle = (low + high + 1) // 2
            if self._bytes_after_shrink(middle) <= num_bytes:
                low = middle
            else:
                high = middle - 1
        return low

    @property
    def grown_blocks(self) -> int:
        """Blocks mapped and zeroed: the committed ones (0 while asleep), and
        those a commit-ahead worker grew past them."""
        return self.buffer.segment_sizes[0] // self.segment_strides[0]

    @property
    def is_asleep(self) -> bool:
        """From `release_physical` until `recommit`."""
        return self._asleep

    @property
    def is_live(self) -> bool:
        """Neither freed nor broken: operations are legal."""
        return self._state is _State.LIVE and not self.buffer.is_broken and not self.buffer.is_inherited

    @_giving_up_the_worker_s_reserve
    @_operation
    def commit_ahead(self, window_blocks: int, *, max_blocks: int | None = None, step_blocks: int | None = None) -> None:
        """Keep up to `window_blocks` blocks mapped and zeroed past the
        committed ones, grown by a background worker (extkv.ahead), never
        past `max_blocks` (default: the capacity) nor what
        `committable_blocks()` allows (under a shared budget: what the
        budget grants, waiting while it reclaims), in steps of at most
        `step_blocks` (default: DEFAULT_STEP_BYTES of blocks). 0 turns it
        off: the worker is stopped and joined before this returns, also when
        called under `buffer.lock`, giving up a reserve its step waits on
        rather than waiting for the daemon; the blocks it grew stay mapped
        until a shrink, a defragment or a release. Off by default. A new
        window replaces the worker: a cache has at most one."""
        window_blocks = validate.integer("window_blocks", window_blocks, what="blocks")
        max_blocks = self.capacity_blocks if max_blocks is None else validate.integer(
            "max_blocks", max_blocks, minimum=1, maximum=self.capacity_blocks, what="blocks")
        step_blocks = max(1, DEFAULT_STEP_BYTES // self.bytes_per_block) if step_blocks is None else validate.integer(
            "step_blocks", step_blocks, minimum=1, what="blocks")
        self._stop_commit_ahead()
        if window_blocks:
            self._ahead = self._Worker(self, window_blocks, max_blocks, step_blocks, count_lock=self._count_lock,
                                       grow=self._grow_zeroed, zeroed=self._zeroed_through,
                                       ceiling=self._ahead_ceiling_blocks, reserves=self._worker_reserves)

    def worker_reserve_given_up(self) -> contextlib.AbstractContextManager:
        """While inside, a reserve the commit-ahead worker's step waits on
        (holding `buffer.lock` while the budget daemon reclaims from other
        engines) is given up, and the worker's next ones are refused
        (extkv.ahead). For a caller about to wait for `buffer.lock` in order
        to stop or pause the worker, which has no use for the daemon's
        answer: free, commit_ahead, release_physical and a SleepController's
        sleep. Leave it once the lock is held: no step runs then, and a
        worker started or resumed later must reserve again."""
        return self._worker_reserves.abandoned()

    def _stop_commit_ahead(self) -> None:  # reservation lock held
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.stop()

    @contextlib.contextmanager
    def commits_locked(self):
        """While inside, with `buffer.lock` held, no commit lands: commit-ahead's
        count without the reservation's lock is withdrawn, so every commit
        waits for that lock. For work that must see the committed blocks
        stay put across several steps (a sleep's copy, then its release)."""
        ahead = self._ahead
        if ahead is None:
            yield
            return
        ahead.withdraw()
        try:
            yield
        finally:
            ahead.restore(self._zeroed_through)

    @property
    def commit_ahead_window(self) -> int:
        """Blocks the commit-ahead worker keeps ahead of the committed ones (0: off)."""
        ahead = self._ahead
        return 0 if ahead is None else ahead.window_blocks

    @property
    def commit_ahead_steps(self) -> int:
        """Steps the commit-ahead worker made since it was turned on (0 when off)."""
        ahead = self._ahead
        return 0 if ahead is None else ahead.steps

    def settle_commit_ahead(self, timeout: float | None = None) -> bool:
        """Wait until the commit-ahead worker has nothing left to do: its
        window is grown, or it is paused (asleep), idle after running out of
        memory, or holding an error for the next commit. True then, or when
        commit-ahead is off; False if `timeout` seconds passed first. For an
        engine that wants the window grown before it times a step, and for
        tests that check what the worker did. Once settled, work the caller
        queues later on its current stream runs after the worker's zeroing
        (which ran on a stream of its own), so a read of the window sees it."""
        ahead = self._ahead
        if ahead is None:
            return True
        if not ahead.settle(timeout):
            return False
        with self._count_lock:
            fence = ahead.fence
        self.buffer.driver.wait_for(fence)
        return True

    def _sizes_for(self, num_blocks: int) -> list[int]:
        return list(map(num_blocks.__mul__, self.segment_strides))

    @_giving_up_the_worker_s_reserve
    @_operation
    def release_physical(self) -> None:
        """Drop the physical pages for sleep; addresses and views stay valid.
        A commit-ahead worker pauses until `recommit`, or until a commit
        past the committed blocks, which maps them all and so wakes the
        cache as a recommit would."""
        self._asleep = True
        self._zeroed_through = 0
        if self._ahead is not None:
            self._ahead.pause()
        self.buffer.release_physical()

    @_operation
    def recommit(self) -> None:
        """Map fresh zeroed pages for the blocks committed before release.
        The committed count is kept throughout, so a recommit that fails
        half way is completed by calling it again."""
        # Awake with commit-ahead on, the buffer holds blocks past the
        # committed ones: growing to those maps nothing.
        self._grow_zeroed(max(self._committed, self.grown_blocks))
        self._asleep = False
        if self._ahead is not None:
            self._ahead.resume(self._zeroed_through)

    # -- sizes ------------------------------------------------------------------
    @property
    def physical_bytes(self) -> int:
        """Physically mapped bytes, granule rounding included."""
        return self.buffer.physical_bytes

    @_operation
    def physical_bytes_for(self, num_blocks: int) -> int:
        """Bytes a commit of `num_blocks` maps: the granules every segment's
        committed prefix touches, a granule shared by two segments once."""
        num_blocks = min(_block_count(num_blocks), self.capacity_blocks)
        return segment_physical_bytes(num_blocks, self.segment_strides, self.buffer.granularity, self.segment_offsets)

    @_operation
    def blocks_within(self, num_bytes: int) -> int:
        """Most blocks whose physical footprint fits in `num_bytes`."""
        return blocks_within(
            num_bytes, self.segment_strides, self.buffer.granularity, self.capacity_blocks, self.segment_offsets
        )

    @_operation
    def committable_blocks(self) -> int:
        """Blocks committable now without eating into warmup's headroom (see
        `sizing.committable_bytes`); never below the committed count. Under
        a shared budget (`budget=`), what the budget grants now without a
        wait, beside what the cache holds: the budget is the KV caches'
        alone, so no warmup reserve comes out of it, and the device's free
        memory is never read, so engines sizing at once cannot race on it."""
        driver = self.buffer.driver
        if isinstance(driver, BudgetedDriver):
            return max(self.blocks_within(self.physical_bytes + driver.client.headroom()), self.num_committed_blocks)
        free_memory, _ = driver.memory_info()
        budget = committable_bytes(free_memory, self.physical_bytes, self.reserved_headroom_bytes)
        return max(self.blocks_within(budget), self.num_committed_blocks)

    def _ahead_ceiling_blocks(self) -> int:
        """The most blocks the commit-ahead worker grows toward. Unbudgeted,
        `committable_blocks()`: a commit ahead never eats into warmup's
        headroom. Under a shared budget, the capacity: each step reserves its
        bytes as any create does, so the reserve may wait while the daemon
        reclaims from engines above their shares, or be denied, which idles
        the worker until the next commit of new blocks. The reclaim is then
        waited for beside the engine's steps, not by the commit that reaches
        past the window (what the budget grants without a wait is nothing
        while an idle engine keeps its finished KV)."""
        if isinstance(self.buffer.driver, BudgetedDriver):
            return self.capacity_blocks
        return self.committable_blocks()

    # -- views ------------------------------------------------------------------
    def _locate(self, start: int) -> tuple[int, int]:
        """Segment index of allocation byte `start`, and its offset in it."""
        segment = bisect.bisect_right(self.segment_offsets, start) - 1
        return segment, start - self.segment_offsets[segment]

    @_operation
    def committed_views(
        self, kv_cache_config: KVCacheConfig, layout: KVCacheLayout, kernel_block_sizes: list[int] | None = None
    ) -> dict[str, torch.Tensor] | None:
        """Per-layer views whose storage spans exactly the committed blocks of
        their segment, at the reservation's addresses (connectors size memory
        by `untyped_storage().nbytes()`). None for layouts whose layers span
        several segments. `kv_cache_config.num_blocks` must equal the
        committed count."""
        _check_config_and_layout(kv_cache_config, layout)
        if not layout.is_block_compact:
            return None
        if kv_cache_config.num_blocks != self.num_committed_blocks:
            raise ValueError(
                f"kv_cache_config.num_blocks is {kv_cache_config.num_blocks}, but "
                f"{self.num_committed_blocks} blocks are committed; views describe the committed blocks"
            )
        return {
            layer.name: self._committed_view(layer, kv_cache_config.num_blocks, layout, kernel_block_sizes)
            for layer in _placed_layers(kv_cache_config)
        }

    def _committed_view(
        self, layer: _PlacedLayer, num_blocks: int, layout: KVCacheLayout, kernel_block_sizes: list[int] | None
    ) -> torch.Tensor:
        if not layer.spec.has_layer_views:
            # Such a layer lays itself out over raw bytes; it keeps the whole
            # reservation, as it got at allocation.
            return self.buffer.full_view()
        segment, offset_in_segment = self._locate(layer.start)
        only_this_layer = replace(layer.tensor, layers=[layer.name], offset=offset_in_segment)
        (view,) = create_kv_cache_views(
            self.buffer.segment_view(segment),  # storage: the committed bytes of this segment, no more
            layer.spec,
            num_blocks,
            layout,
            only_this_layer,
            kernel_block_size=layer_kernel_block_size(layer.group_id, kernel_block_sizes),
        )
        return view

    @_operation
    def committed_kv_cache_tensors(
        self, kv_cache_config: KVCacheConfig, layout: KVCacheLayout, num_blocks: int
    ) -> list[KVCacheTensor]:
        """Placements matching `committed_views` for `num_blocks` blocks.

        `size` is the committed total. Block-outermost layouts commit one
        prefix of the allocation, so capacity placements still hold. Under
        layer-outermost layouts each layer's view has its own storage over its
        committed prefix, described as a one-layer tensor at the start of it.
        """
        _check_config_and_layout(kv_cache_config, layout)
        # Past the capacity a placement would describe memory past the reservation.
        num_blocks = validate.integer("num_blocks", num_blocks, maximum=self.capacity_blocks, what="a block count")
        size = num_blocks * self.bytes_per_block
        if layout.is_block_outermost:
            return [replace(tensor, size=size) for tensor in kv_cache_config.kv_cache_tensors]
        return [self._committed_tensor(layer, num_blocks, size) for layer in _placed_layers(kv_cache_config)]

    def _committed_tensor(self, layer: _PlacedLayer, num_blocks: int, size: int) -> KVCacheTensor:
        # A layer without views keeps the whole reservation as its storage,
        # so its place is counted from the allocation's start, not a segment's.
        offset = self._locate(layer.start)[1] if layer.spec.has_layer_views else layer.start
        block_stride = layer.tensor.block_stride
        return KVCacheTensor(
            size=size, layers=[layer.name], layer_stride=num_blocks * block_stride, block_stride=block_stride, offset=offset
        )

    # -- torch's allocator and teardown ---------------------------------------
    @_operation
    def set_torch_memory_limit(self, num_bytes: int | None) -> None:
        """Cap what torch's caching allocator reserves on this device, or lift
        the cap (None). At the cap torch frees cached blocks before growing,
        instead of taking memory the cache or others need."""
        if num_bytes is not None:
            num_bytes = validate.integer("torch memory limit", num_bytes, what="bytes, or None to lift it")
        self._apply_torch_memory_limit(num_bytes)

    def _apply_torch_memory_limit(self, num_bytes: int | None) -> None:
        """`set_torch_memory_limit` past its checks: `free` lifts the cap in
        every state it is legal in, a broken cache's included."""
        _, total = self.buffer.driver.memory_info()
        capped = torch_memory.set_cap(self.buffer.device, num_bytes, total)
        self.torch_memory_limit = num_bytes  # recorded once torch took it: a refusal changes nothing
        if not capped:
            logger.info(
                "Torch has no memory cap for %s; recorded a limit of %s bytes only.", self.buffer.device, num_bytes
            )

    @_giving_up_the_worker_s_reserve
    @_operation
    def free(self) -> None:
        """Release everything. Lifts torch's cap: the process may start another
        engine, which must not inherit it. A commit-ahead worker is stopped
        and joined first, also when called under `buffer.lock`, giving up a
        reserve its step waits on. Idempotent."""
        if self._state is _State.FREED:
            return
        self._stop_commit_ahead()
        if self.torch_memory_limit is not None and not self.buffer.is_inherited:
            self._apply_torch_memory_limit(None)
        self.buffer.free()
        self._uncount()
        self._state = _State.FREED

    @property
    def is_broken(self) -> bool:
        """Whether its buffer is broken (see extkv.tensor): only `free` is legal."""
        return self.buffer.is_broken

    @property
    def is_freed(self) -> bool:
        return self._state is _State.FREED

    def __repr__(self) -> str:
        return (
            f"ExtensibleKVCache({self.num_committed_blocks}/{self.capacity_blocks} blocks, "
            f"{len(self.segment_strides)} segments, {self.physical_bytes / GiB:.2f} GiB physical, "
            f"{self.buffer.device})"
        )


def measure_kv_cache_blocks(
    kv_cache: ExtensibleKVCache,
    device: torch.device | str,
    *,
    init_free_memory: int,
    requested_memory: int,
    ipc_reserve_bytes: int = 0,
) -> int:
    """How many blocks the cache gets once warmup is over; also caps torch.

    The reading is taken with torch's cache returned to the device, since
    blocks torch cached during warmup need not fit what the first real steps
    allocate. `sizing.measure_kv_cache_bytes` turns it into a budget that keeps
    the cache's `reserved_headroom_bytes` and a margin free; `ipc_reserve_bytes`
    (multimodal IPC, in engines that use it) comes off the budget. Torch may
    then reserve what it holds plus what stays free once the cache has its
    final size, less KV_CACHE_NON_TORCH_RESERVE_BYTES for memory taken
    outside torch (`sizing.torch_memory_limit_bytes`).

    Under a shared budget (`budget=`) the cache gets what the budget grants
    it now without a wait, beside what it holds (`committable_blocks`), and
    neither `requested_memory` nor the device's free memory is read: engines
    sizing at once would each count the same free bytes. Torch is not capped
    then; the operator's budget is the KV caches' alone and must leave the
    engines' weights and activations room on the device.
    """
    if not isinstance(kv_cache, ExtensibleKVCache):
        raise ValueError(f"measure_kv_cache_blocks needs an ExtensibleKVCache, got {kv_cache!r}")
    if kv_cache.is_freed:
        raise StateError("measure_kv_cache_blocks() is not allowed on a freed ExtensibleKVCache")
    device = _cache_device(kv_cache, device)
    ipc_reserve_bytes = validate.integer("ipc_reserve_bytes", ipc_reserve_bytes, what="bytes")
    if isinstance(kv_cache.buffer.driver, BudgetedDriver):
        num_blocks = kv_cache.committable_blocks()
        logger.info("KV cache sized by its shared budget: %d blocks (%.2f GiB).",
                    num_blocks, num_blocks * kv_cache.bytes_per_block / GiB)
        return num_blocks
    gc.collect()  # dropped tensors not yet collected still pin torch's blocks
    torch_memory.release_cached(device)
    free_memory, _ = kv_cache.buffer.driver.memory_info()
    committed = kv_cache.physical_bytes
    budget = measure_kv_cache_bytes(
        init_free_memory=init_free_memory,
        free_memory=free_memory,
        committed_bytes=committed,
        requested_memory=requested_memory,
        transient_peak_bytes=kv_cache.reserved_headroom_bytes,
    )
    for_ipc = min(ipc_reserve_bytes, budget)
    num_blocks = kv_cache.blocks_within(budget - for_ipc)
    cap = torch_memory_limit_bytes(
        free_memory=free_memory,
        memory_reserved=torch_memory.reserved(device),
        # Negative when the budget is below what warmup committed: the shrink
        # hands that memory back, and torch may use it.
        kv_growth_bytes=kv_cache.physical_bytes_for(num_blocks) - committed,
        ipc_reserve_bytes=for_ipc,
    )
    kv_cache.set_torch_memory_limit(cap)
    logger.info(
        "KV cache sized after warmup: %d blocks (%.2f GiB) of a %.2f GiB request; %.2f GiB free with %.2f GiB "
        "committed and %.2f GiB kept for transients; torch capped at %.2f GiB.",
        num_blocks,
        num_blocks * kv_cache.bytes_per_block / GiB,
        requested_memory / GiB,
        free_memory / GiB,
        committed / GiB,
        kv_cache.reserved_headroom_bytes / GiB,
        cap / GiB,
    )
    return num_blocks


def _cache_device(kv_cache: ExtensibleKVCache, device) -> torch.device:
    """`device`, which must name the one the cache lives on: readings of
    another device would size this cache wrongly."""
    try:
        device = canonical_device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be a torch device, got {device!r}") from None
    if device != kv_cache.buffer.device:
        raise ValueError(f"device {device} is not the KV cache's device {kv_cache.buffer.device}")
    return device
