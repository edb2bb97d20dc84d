"""The driver interface: the only seam between extkv and a virtual-memory system.

Theory of operation
-------------------
A driver offers the five steps of the virtual-memory protocol that CUDA's VMM
API and Linux share: reserve address space, create a physical chunk, map the
chunk at a fixed address inside a reservation, grant read/write access, and
the reverse steps (unmap, release the chunk, free the reservation). Nothing in a
driver knows about segments, blocks or KV caches.

Public methods here do the bookkeeping every driver needs (live reservation and
chunk counts, which the test harness uses to prove nothing leaks) and delegate
the real work to `_`-prefixed methods that concrete drivers implement. A
wrapper such as the fault injector delegates to the public methods of the
driver it wraps, so counts stay with the real driver.

`zero` and `copy` work on mapped memory in order with the device's current
stream (a kernel launch on CUDA, a memset/memmove on the host) without
building a tensor per range: a commit zeroes one range per new run, and a
tensor view per range cost more than the memset it wraps. `zero_ranges`
zeroes many ranges in one call, each as a `zero` step (what a wrapper sees
of the ranges a commit zeroes in memory mapped before). `batch()` holds
whatever per-call setup a driver needs (CUDA: its context pushed, the current
stream looked up) across the many calls of one operation.

`chunk_at(address)` reads back, from the driver or kernel, which chunk backs an
address; it never consults bookkeeping, so tests can check bookkeeping with it.
`access_at(address)` reads back, the same way, what access a mapping grants
(`READ_WRITE`, `READ_ONLY`, `NO_ACCESS`, None where nothing is mapped), so
that a read-only mapping is proven read-only rather than assumed. A driver
without such a read-back raises `NotImplementedError` there.

Chunks cross process boundaries as POSIX file descriptors: `export_fd` gives
a new descriptor the caller owns, `import_fd` turns a descriptor another
process exported into a chunk of this driver. An imported chunk is an ordinary
chunk from then on: it counts as live and goes back with `release()`.

What an RDMA stack needs to register GPU memory is read back the same way:
`gpudirect_rdma` says whether the driver creates its chunks GPUDirect RDMA
capable (None where the memory is no GPU's), `rdma_capable_at(address)`
whether the chunk mapped there is, `allocation_range_at(address)` the one
chunk's mapping that holds the address (what a registration of it finds),
and `export_dma_buf(address, size)` a dma-buf over a mapped range, which a
NIC registers.
"""

from __future__ import annotations

import abc
import collections
import contextlib
import threading
from typing import Callable, ContextManager, Hashable, Iterable, NamedTuple, Sequence

import torch

from .. import validate
from ..errors import ExtkvError

# How many reservations and chunks are alive, per driver kind ("host", "cuda").
# Read by the test harness after every test.
_live_lock = threading.Lock()
live_reservations: collections.Counter[str] = collections.Counter()
live_chunks: collections.Counter[str] = collections.Counter()


#: What `Driver.access_at` reads back for a mapped address.
READ_WRITE = "read-write"
READ_ONLY = "read-only"
NO_ACCESS = "no access"


def count_live_chunks(kind: str, change: int) -> None:
    """Record chunks a driver of `kind` made (positive) or gave back (negative)."""
    with _live_lock:
        live_chunks[kind] += change


class Chunk(NamedTuple):
    """One physical allocation, immutable.

    `handle` is what the driver needs to map or release it (a CUDA allocation
    handle, or a memfd file descriptor). A tuple, not a frozen dataclass:
    a commit makes thousands, and a tuple is several times cheaper to build.
    """

    handle: int
    size: int


#: A reusable context manager that does nothing: the batch of a driver
#: that keeps no per-call setup.
_NO_SETUP = contextlib.nullcontext()


def format_granularity(granularity: int) -> str:
    """"2 MiB" for whole MiB, else the byte count."""
    return f"{granularity >> 20} MiB" if granularity % (1 << 20) == 0 else f"{granularity} bytes"


class Driver(abc.ABC):
    """A virtual-memory system for one device."""

    #: "host" or "cuda": which family this driver belongs to.
    kind: str
    device: torch.device
    #: Size and alignment unit of every reservation, chunk and mapping.
    granularity: int
    #: Largest reservation worth asking for: x86-64 and aarch64 give user
    #: space 47 bits of address, and a GPU's unified address space is no wider.
    max_reservation_bytes: int = 1 << 47

    # -- reservations -------------------------------------------------------
    def reserve(self, size: int) -> int:
        """Reserve `size` bytes of address space (a multiple of the granularity)."""
        self._check_granular("reserve", size)
        address = self._reserve(size)
        with _live_lock:
            live_reservations[self.kind] += 1
        return address

    def free_reservation(self, address: int, size: int) -> None:
        self._free_reservation(address, size)
        with _live_lock:
            live_reservations[self.kind] -= 1

    # -- chunks --------------------------------------------------------------
    def create(self, size: int) -> Chunk:
        """Create a physical chunk of `size` bytes (a multiple of the granularity)."""
        self._check_granular("create", size)
        chunk = self._create(size)
        count_live_chunks(self.kind, 1)
        return chunk

    def release(self, chunk: Chunk) -> None:
        self._release(chunk)
        count_live_chunks(self.kind, -1)

    # -- sharing chunks between processes --------------------------------------
    def export_fd(self, chunk: Chunk, *, writable: bool = False) -> int:
        """A new file descriptor for `chunk` that another process can import
        (`import_fd`), read-only unless `writable` where the driver can say so
        (a host memfd can; a CUDA handle carries no access mode). The caller
        owns it and must close it; the chunk stays this process's to release."""
        return self._export_fd(chunk, validate.flag("writable", writable))

    def import_fd(self, fd: int, size: int) -> Chunk:
        """A chunk of `size` bytes (a multiple of the granularity) over the
        memory another process exported as `fd`.

        `fd` stays the caller's to close (the chunk holds its own reference);
        the chunk counts as live until `release()`, like a created one.
        """
        fd = validate.integer("import_fd: fd", fd, what="a file descriptor")
        self._check_granular("import_fd", size)
        chunk = self._import_fd(fd, size)
        count_live_chunks(self.kind, 1)
        return chunk

    # -- mappings ------------------------------------------------------------
    def map(self, address: int, chunk: Chunk) -> None:
        """Map the whole of `chunk` at `address`; not yet accessible."""
        self._map(address, chunk)

    def set_access(self, address: int, size: int, *, writable: bool = True) -> None:
        """Make `[address, address+size)` readable, and writable unless told
        otherwise (a peer's view of a read-only export); the range may span
        several mapped chunks but must be wholly mapped."""
        self._set_access(address, size, validate.flag("writable", writable))

    def unmap(self, address: int, size: int) -> None:
        """Unmap one whole chunk's mapping. Callers synchronize first."""
        self._unmap(address, size)

    # -- work on mapped memory ---------------------------------------------------
    def zero(self, address: int, size: int) -> None:
        """Fill the mapped, writable `[address, address+size)` with zeros, in
        order with the device's current stream."""
        self._zero(address, size)

    def zero_ranges(self, ranges: Iterable[tuple[int, int]]) -> None:
        """`zero(address, size)` for each `(address, size)` of `ranges`, in
        order (a commit of many segments zeroes one range per segment)."""
        for address, size in ranges:
            self.zero(address, size)

    def copy(self, destination: int, source: int, size: int) -> None:
        """Copy `size` bytes between two mapped ranges that do not overlap, in
        order with the device's current stream."""
        self._copy(destination, source, size)

    def batch(self) -> contextlib.AbstractContextManager[None]:
        """Keep per-call setup across the calls made inside; re-entrant, and
        only for the calling thread. Drivers that need none do nothing."""
        return _NO_SETUP

    # -- a commit's steps, as one call -------------------------------------------
    def map_new_chunks(
        self,
        runs: Sequence[tuple[int, int, Sequence[tuple[int, int]]]],
        created: list[Chunk],
        give_back: Callable[[Chunk], object],
        zero_after: Sequence[tuple[int, int]] = (),
    ) -> None:
        """For each `(address, size, zero)` of `runs`, in order: create a chunk
        of `size` bytes, map it at `address`, make it writable, then zero the
        `(address, size)` ranges of `zero` (mapped and writable by then).
        Once every run stands, zero the ranges of `zero_after` (mapped before
        the call). One call does a whole commit: a driver keeps its per-call
        setup across it, as in `batch()`.

        Each chunk is appended to `created` once its run is mapped and
        writable, so after a failure `created` holds exactly the runs that
        stand. The failing run's own steps are undone before the error
        propagates, its chunk handed to `give_back` (which releases it, or
        keeps it for a later retry).
        """
        granule, largest = self.granularity, self.max_reservation_bytes
        for _, size, _ in runs:
            if type(size) is not int or not 0 < size <= largest or size % granule:
                self._check_granular("map_new_chunks", size)
        with self.admit(sum(size for _, size, _ in runs), len(runs)):
            self._map_new_chunks(runs, created, give_back, zero_after)

    def admit(self, size: int, chunks: int = 1) -> ContextManager[None]:
        """A commit about to create `chunks` chunks of `size` new bytes in
        all: a driver that can tell beforehand that they will not fit raises
        here (OutOfMemoryError for memory, DriverError for another limit),
        before the first create; the block runs the creates. The CUDA driver
        learns it from each cuMemCreate, so by default this admits all."""
        return contextlib.nullcontext()

    # -- ordering work between threads -------------------------------------------
    def side_stream(self) -> ContextManager[None]:
        """Queue the device work of the calling thread inside (zeroing, copies)
        on a stream of its own, apart from the engine's: a background growth
        zeroes there while the engine's kernels run. A driver whose work is
        synchronous (the host's) needs none and does nothing."""
        return _NO_SETUP

    def fence(self) -> object | None:
        """A mark after the device work queued so far on the calling thread's
        current stream; None where that work is already done (the host's)."""
        return None

    def wait_for(self, fence: object | None) -> None:
        """Make work queued later on the calling thread's current stream wait
        until `fence` (from `fence()`, on any thread) has passed."""

    # -- what the device offers besides memory -----------------------------------
    #: Whether work on the device can be captured once and replayed
    #: (`capture_graph`): CUDA graphs; the host runs work as it is called.
    supports_graphs: bool = False
    #: The GPU a collective over this driver's memory reduces on, where the
    #: backend reduces GPU tensors only; None where the memory is on no GPU
    #: (the process's current GPU carries it then).
    collective_device: torch.device | None = None

    def capture_graph(
        self, step: Callable[[], object], *, warm: Callable[[], object] | None = None, pool: object = None
    ) -> tuple[object, object]:
        """`(graph, what step returned)`: `step()` captured on the device,
        replayed by `graph.replay()`, its memory pool `graph.pool()` to share
        with a later capture (`pool`). `warm()` (default `step`) runs first
        on a side stream, so that kernels load outside the capture. A driver
        whose device has no graphs raises ExtkvError."""
        raise ExtkvError(f"{self!r} captures no graphs: its device runs work as it is called")

    def is_capturing(self) -> bool:
        """Whether the calling thread's current stream is capturing a graph."""
        return False

    def refuse_partly_backed(self, fd: int, what: str) -> None:
        """Raise ValueError naming `what` where the memory behind `fd`, an
        imported descriptor, is not all allocated: reading it would
        allocate the rest in the importing process. Device memory exists
        once created, so by default nothing is refused."""

    def device_identity(self) -> dict:
        """The device as another process finds it: `type`, `index`, and
        the GPU's `uuid` (None where the device has none)."""
        return {"type": self.device.type, "index": self.device.index, "uuid": None}

    def device_key(self) -> str:
        """The name services of a whole device know it by: "host" where it
        has no UUID, else "GPU-<uuid>", as NVML and nvidia-smi write it
        (torch gives the bare UUID); what the budget daemon's
        `open_device` takes."""
        uuid = self.device_identity()["uuid"]
        if uuid is None:
            return "host"
        return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"

    # -- what an RDMA stack registers --------------------------------------------
    #: Whether chunks are created GPUDirect RDMA capable, so that a NIC can
    #: register them: True where the GPU supports it with VMM, False where
    #: it does not, None where the memory is no GPU's (the host's).
    gpudirect_rdma: bool | None = None

    def rdma_capable_at(self, address: int) -> bool | None:
        """Whether the chunk mapped at `address` is GPUDirect RDMA capable,
        read back from the driver; None where nothing is mapped, or where
        the memory is no GPU's and the question does not apply."""
        raise NotImplementedError(f"{type(self).__name__} does not read back whether its chunks are RDMA capable")

    def allocation_range_at(self, address: int) -> tuple[int, int] | None:
        """`(start, size)` of the mapping of the one chunk that holds
        `address`, read back from the driver: the allocation an RDMA stack
        finds behind the address when it registers it. None where nothing
        is mapped."""
        raise NotImplementedError(f"{type(self).__name__} does not read back the allocation behind an address")

    def export_dma_buf(self, address: int, size: int) -> int:
        """A new dma-buf file descriptor over the mapped `[address,
        address+size)`, both multiples of the granularity: what a NIC
        registers (`ibv_reg_dmabuf_mr`). The caller owns it and must close
        it; its size (`lseek(fd, 0, SEEK_END)`) is `size`."""
        address = validate.integer("export_dma_buf: address", address, what="an address")
        self._check_granular("export_dma_buf", size)
        if address % self.granularity:
            raise ValueError(
                f"export_dma_buf: address {address:#x} is not a multiple of the granularity {self.granularity}"
            )
        return self._export_dma_buf(address, size)

    def _export_dma_buf(self, address: int, size: int) -> int:
        # Not abstract: a driver whose memory no NIC registers says so when asked.
        raise NotImplementedError(f"{type(self).__name__} exports no dma-buf")

    # -- everything else -----------------------------------------------------
    @abc.abstractmethod
    def synchronize(self) -> None:
        """Wait until no queued work can still touch memory about to be unmapped."""

    @abc.abstractmethod
    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device's physical memory now, as the
        driver or kernel reports them: what sizing decisions start from."""

    @abc.abstractmethod
    def reclaim_cache(self) -> bool:
        """Return cached memory of the framework to the driver, so that a failed
        create may succeed when retried. False where there is nothing to reclaim."""

    @abc.abstractmethod
    def chunk_at(self, address: int) -> Hashable | None:
        """Identity of the chunk mapped at `address`, read back from the driver
        or kernel; None where nothing is mapped."""

    def chunks_at(self, addresses: Iterable[int]) -> list[Hashable | None]:
        """`chunk_at` for many addresses; equal results mean the same chunk."""
        return [self.chunk_at(address) for address in addresses]

    def access_at(self, address: int) -> str | None:
        """Access the mapping at `address` grants this process's device,
        read back from the driver or kernel: `READ_WRITE`, `READ_ONLY` or
        `NO_ACCESS`; None where nothing is mapped."""
        return self.accesses_at([address])[0]

    def accesses_at(self, addresses: Iterable[int]) -> list[str | None]:
        """`access_at` for many addresses."""
        return [self._access_at(address) for address in addresses]

    def _access_at(self, address: int) -> str | None:
        # Not abstract: a driver (or a wrapper) that cannot read access back
        # says so when asked, and nothing else about it changes.
        raise NotImplementedError(f"{type(self).__name__} does not read back the access of its mappings")

    @abc.abstractmethod
    def view(self, address: int, size: int) -> torch.Tensor:
        """A uint8 tensor over `[address, address+size)` that owns nothing."""

    @abc.abstractmethod
    def usage_witness(self):
        """What reads this device's physical usage from outside extkv
        (extkv.vmm.witness): `source`, `per_process`, `lazy_growth_step` and `read()`."""

    @abc.abstractmethod
    def describe(self) -> dict[str, str]:
        """Facts for report headers: device name, driver version, granularity."""

    # -- to implement ----------------------------------------------------------
    @abc.abstractmethod
    def _reserve(self, size: int) -> int: ...

    @abc.abstractmethod
    def _free_reservation(self, address: int, size: int) -> None: ...

    @abc.abstractmethod
    def _create(self, size: int) -> Chunk: ...

    @abc.abstractmethod
    def _release(self, chunk: Chunk) -> None: ...

    @abc.abstractmethod
    def _export_fd(self, chunk: Chunk, writable: bool) -> int: ...

    @abc.abstractmethod
    def _import_fd(self, fd: int, size: int) -> Chunk: ...

    @abc.abstractmethod
    def _map(self, address: int, chunk: Chunk) -> None: ...

    @abc.abstractmethod
    def _set_access(self, address: int, size: int, writable: bool) -> None: ...

    @abc.abstractmethod
    def _unmap(self, address: int, size: int) -> None: ...

    @abc.abstractmethod
    def _zero(self, address: int, size: int) -> None: ...

    @abc.abstractmethod
    def _copy(self, destination: int, source: int, size: int) -> None: ...

    @abc.abstractmethod
    def _map_new_chunks(
        self, runs, created: list[Chunk], give_back: Callable[[Chunk], object], zero_after: Sequence[tuple[int, int]]
    ) -> None:
        """Step by step (`transaction.map_new_chunks_step_by_step`), or in one
        loop where the driver's steps cost less that way."""

    def _check_granular(self, call: str, size: int) -> None:
        # Checked here, before any C call: ctypes and cuda-python truncate an
        # over-wide size silently, which would reserve or map the wrong range.
        if type(size) is not int or not 0 < size <= self.max_reservation_bytes or size % self.granularity:
            raise ValueError(
                f"{call}: size {size!r} is not a positive multiple of the "
                f"granularity {self.granularity} of at most {self.max_reservation_bytes} bytes"
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device}, granularity={self.granularity})"
