"""Every contender of the benchmarks, and the cases each runs in.

Theory of operation
-------------------
Every benchmark figure is extkv's time divided by the time of something
that does the same work without extkv: a contender, a `Store`
(extkv.benchmarking.store) of its own that commits, releases and
defragments its way. `CONTENDERS` names them, with their role: extkv the
subject, the baselines (the floors a target is stated against), the peers
(other designs). `HEADLINE_CONTENDERS` says who runs in each operation on
the headline geometries and `FLOORS` who runs in the scaling series: a new
contender is a store here, a row of `CONTENDERS`, its name in the rows of
the operations it runs in, and its test.

| contender | store | strategy |
|---|---|---|
| extkv, extkv_grown | `ExtkvStore` | extkv's `ExtensibleKVCache` through its public API (extkv_grown: the graph replayed after the cache grew) |
| raw | `RawStore` | the best raw driver sequence (extkv.benchmarking.raw): per segment create, map, grant access, zero; one chunk per segment per commit |
| per_granule | `GranuleStore` | one handle per granule (kvcached / vAttention): create, map, grant access per 2 MiB, then zero |
| memset | `PlainStore` | memset of the same bytes on one plain torch allocation: the physical floor of a zeroing commit |
| copy | `CopyStore` | device copy of the same bytes between two plain allocations: the floor of a preserving move |
| upfront | `UpfrontStore` | one up-front allocation of everything, zeroed at once (cannot grow) |
| allocate_copy | `AllocCopyStore` | growth by allocate + copy + zero, freeing the old buffer (moves addresses, 2x peak) |
| expandable | `ExpandableStore` | torch's `expandable_segments:True` allocator: each commit allocates its new bytes as a tensor; release is del + empty_cache; needs a process started with that setting |
| tms | `TmsStore` | torch_memory_saver: one allocation in its region; release is a device synchronize then `pause` (its pause does not synchronize), recommit is `resume` + zero (resume does not zero) |

Every store zeroes with the device's own memset (`zero` of the raw calls:
cuMemsetD8Async, memset on the host), the call extkv and the raw sequence
zero with, so that a ratio measures a strategy and not a zeroing kernel:
torch's `zero_` is a fill kernel, 27% slower on the H200 (32 GiB in 10.2 ms,
3.37 TB/s, against 7.46 ms, 4.62 TB/s, for cuMemsetD8Async on the same
allocation), and a floor measured with it was one that commits beat. The
copy floor copies with the driver's copy (cuMemcpyDtoDAsync), as extkv's
defragment does.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from ..cache import ExtensibleKVCache
from ..layout import kv_cache_segments
from ..vmm import driver_for, torch_memory
from .clocks import ClockedRawStore, DriverClock
from .geometry import Geometry
from .primitives import Primitives, primitives_for
from .raw import GranuleStore, RawStore
from .store import Store, Unsupported

#: Setting a process needs for `ExpandableStore`.
EXPANDABLE_SEGMENTS_SETTING = "expandable_segments:True"
#: Environment of each special process a store needs (`Store.process`).
PROCESS_ENVIRONMENT: dict[str, dict[str, str]] = {
    "expandable": {"PYTORCH_CUDA_ALLOC_CONF": EXPANDABLE_SEGMENTS_SETTING},
    "tms": {},
}


class _TorchStore(Store):
    """Stores on plain torch allocations; their memory goes back to the
    driver when they close, so the next contender starts from the same
    state. They zero through `prims`, the device's own memset."""

    def __init__(self, device, strides, capacity_blocks, primitives: Primitives | None = None):
        super().__init__(device, strides, capacity_blocks)
        #: The device's raw calls; tests pass a driver that records them.
        self.prims = primitives or primitives_for(self.device)

    def _total(self, blocks: int) -> int:
        return blocks * self.bytes_per_block

    def _zero(self, *pieces: torch.Tensor) -> None:
        """Zero each contiguous uint8 tensor in `pieces` with the device's
        memset, queued on torch's current stream."""
        prims = self.prims
        with prims.batch():
            for piece in pieces:
                if piece.numel():
                    prims.zero(piece.data_ptr(), piece.numel())

    def close(self) -> None:
        super().close()
        self._drop()
        torch_memory.release_cached(self.device)

    def _drop(self) -> None:
        """Forget every tensor this store holds."""


class _OneBufferStore(_TorchStore):
    """One allocation of the whole capacity, made by `open`; growing zeroes
    the bytes of the newly committed blocks in it."""

    def grow(self, blocks: int) -> None:
        old, new = self._total(self.blocks), self._total(blocks)
        if new > old:
            self._zero(self.buffer[old:new])
        self.blocks = max(self.blocks, blocks)


class PlainStore(_OneBufferStore):
    """memset of the same bytes on one plain allocation: the floor."""

    what = "memset (the driver's, as extkv zeroes) of the same bytes on a plain allocation"

    def open(self) -> None:
        # Written once, untimed, so that host pages exist before the timed
        # zero as device memory does: the floor is the write alone.
        self.buffer = torch.empty(self._total(self.capacity_blocks), dtype=torch.uint8, device=self.device).fill_(0xA5)

    def release(self) -> None:
        """A memset keeps its memory; only the committed count goes."""
        self._released_blocks, self.blocks = self.blocks, 0

    def recommit(self) -> None:
        self.grow(self._released_blocks)

    def views(self) -> list[torch.Tensor]:
        return [self.buffer[: self._total(self.blocks)]]

    def _drop(self) -> None:
        self.buffer = None


class CopyStore(_TorchStore):
    """Device copy of the committed bytes between two plain allocations."""

    what = "device copy (the driver's, as extkv copies) of the same bytes between plain allocations"

    def open(self) -> None:
        total = self._total(self.capacity_blocks)
        self.source = torch.full((total,), 0xA5, dtype=torch.uint8, device=self.device)
        self.target = torch.zeros(total, dtype=torch.uint8, device=self.device)  # pages exist before the copy

    def grow(self, blocks: int) -> None:
        self.blocks = max(self.blocks, blocks)

    def defragment(self, preserve: bool) -> None:
        if not preserve:
            raise Unsupported("a copy baseline only stands for a preserving defragment")
        total = self._total(self.blocks)
        if total:
            with self.prims.batch():
                self.prims.copy(self.target.data_ptr(), self.source.data_ptr(), total)

    def _drop(self) -> None:
        self.source = self.target = None


class UpfrontStore(_TorchStore):
    """One up-front allocation of everything, zeroed; it cannot grow."""

    what = "one up-front allocation (all bytes allocated and zeroed at once; cannot grow)"

    def grow(self, blocks: int) -> None:
        if self.blocks:
            raise Unsupported("an up-front allocation cannot grow")
        self.buffer = torch.empty(self._total(blocks), dtype=torch.uint8, device=self.device)
        self._zero(self.buffer)
        self.blocks = blocks

    def _drop(self) -> None:
        self.buffer = None


class AllocCopyStore(_TorchStore):
    """Growth by a new allocation, a copy of each segment's old bytes, zeroed
    new bytes, and freeing the old buffer (addresses move)."""

    what = "allocate + copy growth (new buffer, copy each segment, zero new bytes, free old)"

    def open(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8, device=self.device)

    def grow(self, blocks: int) -> None:
        if blocks <= self.blocks:
            return
        old_blocks, old = self.blocks, self.buffer
        new = torch.empty(self._total(blocks), dtype=torch.uint8, device=self.device)
        old_at = new_at = 0
        fresh = []
        for stride in self.strides:
            kept, size = old_blocks * stride, blocks * stride
            if kept:
                new[new_at : new_at + kept].copy_(old[old_at : old_at + kept])
            fresh.append(new[new_at + kept : new_at + size])
            old_at, new_at = old_at + kept, new_at + size
        self._zero(*fresh)
        self.buffer, self.blocks = new, blocks
        del old

    def views(self) -> list[torch.Tensor]:
        return [self.buffer]

    def _drop(self) -> None:
        self.buffer = None


class ExpandableStore(_TorchStore):
    """torch's expandable segments: each commit allocates its new bytes."""

    what = "torch expandable_segments:True (each commit allocates its new bytes, zeroed; release = del + empty_cache)"
    process = "expandable"

    @classmethod
    def unsupported_reason(cls, device: torch.device) -> str | None:
        if torch.device(device).type != "cuda":
            return "expandable_segments is a setting of torch's CUDA caching allocator; there is no GPU here"
        return None

    def open(self) -> None:
        if EXPANDABLE_SEGMENTS_SETTING not in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
            raise Unsupported(f"needs a process started with PYTORCH_CUDA_ALLOC_CONF={EXPANDABLE_SEGMENTS_SETTING}")
        self.pieces: list[torch.Tensor] = []

    def grow(self, blocks: int) -> None:
        if blocks > self.blocks:
            piece = torch.empty(self._total(blocks - self.blocks), dtype=torch.uint8, device=self.device)
            self._zero(piece)
            self.pieces.append(piece)
            self.blocks = blocks

    def release(self) -> None:
        self.pieces = []
        torch_memory.release_cached(self.device)
        self.blocks = 0

    def _drop(self) -> None:
        self.pieces = []


def torch_memory_saver_problem() -> str | None:
    """Why torch_memory_saver cannot be used in this process, or None."""
    try:
        from torch_memory_saver import torch_memory_saver  # noqa: F401
    except Exception as error:  # an ImportError, or a binary that does not load
        return f"torch_memory_saver is not importable here: {type(error).__name__}: {error}"
    return None


@functools.lru_cache(maxsize=None)
def _memory_saver():
    """torch_memory_saver's singleton with its in-process allocator hook
    (the default, "preload", needs LD_PRELOAD set before the process
    starts); the hook can be chosen once per process, hence the cache."""
    from torch_memory_saver import torch_memory_saver

    torch_memory_saver.hook_mode = "torch"
    return torch_memory_saver


class TmsStore(_OneBufferStore):
    """torch_memory_saver: pause unmaps and releases, resume maps again
    (without zeroing: the store zeroes after resume, as extkv's recommit does).
    Its 0.0.10 `pause()` unmaps without synchronizing the device (its
    `free()` synchronizes): work still queued on the buffer, the store's own
    zeroing included, then faults ("illegal memory access"). So the store
    synchronizes before it pauses, as extkv's release does before it unmaps,
    and the synchronization is timed with the release."""

    what = ("torch_memory_saver 0.0.10: allocation in its region; release = synchronize + pause (its pause does "
            "not synchronize), recommit = resume + zero")
    process = "tms"

    @classmethod
    def unsupported_reason(cls, device: torch.device) -> str | None:
        if torch.device(device).type != "cuda":
            return "torch_memory_saver manages CUDA memory only; there is no GPU here"
        return torch_memory_saver_problem()

    def open(self) -> None:
        self.saver = _memory_saver()
        self.paused = False
        with self.saver.region():
            self.buffer = torch.empty(self._total(self.capacity_blocks), dtype=torch.uint8, device=self.device)

    def release(self) -> None:
        torch.cuda.synchronize(self.device)
        self.saver.pause()
        self.paused = True
        self._released_blocks, self.blocks = self.blocks, 0

    def recommit(self) -> None:
        self.saver.resume()
        self.paused = False
        self.grow(self._released_blocks)

    def _drop(self) -> None:
        if getattr(self, "paused", False):
            self.saver.resume()
            self.paused = False
        self.buffer = None


class ExtkvStore(Store):
    """extkv's ExtensibleKVCache, driven through its public API."""

    what = "extkv: ExtensibleKVCache (commit, shrink, defragment, release_physical, recommit)"

    def __init__(self, device: torch.device, geometry: Geometry, capacity_blocks: int, *, clocked: bool = False):
        self.geometry = geometry
        self.config = geometry.config(capacity_blocks)
        super().__init__(device, list(kv_cache_segments(self.config, geometry.layout)[1]), capacity_blocks)
        self.cache: ExtensibleKVCache | None = None
        #: With the driver's steps timed (`DriverClock`), for extkv's own CPU
        #: time; a clocked round is never a timed one (see `interleave`).
        self.clocked = clocked
        self.clock: DriverClock | None = None

    def open(self) -> None:
        driver = driver_for(self.device)
        if self.clocked:
            self.clock = driver = DriverClock(driver)
        self.cache = ExtensibleKVCache(self.config, driver, self.geometry.layout)

    def driver_cpu_seconds(self) -> float | None:
        return None if self.clock is None else self.clock.cpu_seconds

    def grow(self, blocks: int) -> None:
        self.cache.commit(blocks)
        self.blocks = self.cache.num_committed_blocks

    def shrink(self, blocks: int) -> None:
        self.cache.commit(blocks, shrink=True)
        self.blocks = self.cache.num_committed_blocks

    def defragment(self, preserve: bool) -> None:
        self.cache.commit(self.cache.num_committed_blocks, defragment=True, preserve_contents=preserve)

    def release(self) -> None:
        self.cache.release_physical()

    def recommit(self) -> None:
        self.cache.recommit()

    def views(self) -> list[torch.Tensor]:
        return [self.cache.buffer.segment_view(i) for i in range(len(self.strides))]

    def synchronize(self) -> None:
        self.cache.buffer.driver.synchronize()

    def close(self) -> None:
        super().close()
        if self.cache is not None:
            self.cache.free()
            self.cache = None


@dataclass(frozen=True)
class Contender:
    """Who does the work: `role` is subject (extkv), baseline (the floors a
    target is stated against) or peer (other designs)."""

    name: str
    role: str
    store: type[Store]
    what: str = ""
    #: Rounds are capped at the profile's `costly_rounds` (a slow peer).
    costly: bool = False
    #: Replay only: the cache grows to all blocks after the graph is captured.
    grown_after_capture: bool = False

    @property
    def process(self) -> str:
        return self.store.process

    def describe(self) -> str:
        return self.what or self.store.what

    def make(self, device: torch.device, geometry: Geometry, capacity_blocks: int, *, clocked: bool = False) -> Store:
        if self.store is ExtkvStore:
            return ExtkvStore(device, geometry, capacity_blocks, clocked=clocked)
        if clocked and self.store is RawStore:
            return ClockedRawStore(device, geometry.strides(), capacity_blocks)
        return self.store(device, geometry.strides(), capacity_blocks)


CONTENDERS: dict[str, Contender] = {
    c.name: c
    for c in [
        Contender("extkv", "subject", ExtkvStore),
        Contender(
            "extkv_grown",
            "subject",
            ExtkvStore,
            what="extkv, the graph replayed after the cache grew from N/8 to N blocks in 7 commits",
            grown_after_capture=True,
        ),
        Contender("raw", "baseline", RawStore),
        Contender("memset", "baseline", PlainStore),
        Contender("copy", "baseline", CopyStore),
        Contender("per_granule", "peer", GranuleStore, costly=True),
        Contender("upfront", "peer", UpfrontStore),
        # A round of 32 GiB costs it 0.2 s in 8 steps and 3 s in 64 on the
        # H200, against milliseconds for extkv: uncapped, it took a quarter
        # to a third of each headline growth's seconds there and left the
        # 64-step growths 3 rounds of extkv and the raw sequence.
        Contender("allocate_copy", "peer", AllocCopyStore, costly=True),
        Contender("expandable", "peer", ExpandableStore),
        Contender("tms", "peer", TmsStore),
    ]
}

#: Contenders of an operation where a case names no others (scaling series).
FLOORS = {
    "commit": ("extkv", "raw", "memset"),
    "grow8": ("extkv", "raw", "memset"),
    "release": ("extkv", "raw"),
    "recommit": ("extkv", "raw", "memset"),
    "defrag_preserve": ("extkv", "raw", "copy"),
}

#: Who runs in each operation on the headline geometries: extkv first and
#: the raw sequence, its yardstick, second (`round_order` trades the first
#: two places every other pass), then the floors and peers.
HEADLINE_CONTENDERS: dict[str, tuple[str, ...]] = {
    "commit": ("extkv", "raw", "memset", "upfront", "per_granule", "expandable"),
    "grow8": ("extkv", "raw", "memset", "per_granule", "allocate_copy", "expandable"),
    "recommit": ("extkv", "raw", "memset", "tms"),
    "release": ("extkv", "raw", "per_granule", "tms", "expandable"),
    "defrag_preserve": FLOORS["defrag_preserve"],
    "grow64": ("extkv", "raw", "memset", "allocate_copy"),
    "shrink": ("extkv", "raw"),
    "defrag_discard": ("extkv", "raw"),
    "per_block": ("extkv", "raw", "memset"),
    "replay": ("extkv", "extkv_grown", "memset"),
}
