"""What extkv is measured against: raw driver sequences and peer strategies.

Theory of operation
-------------------
Every benchmark figure is extkv's time divided by the time of something that
does the same work without extkv. This module holds all of those somethings,
and with them every line of device-specific benchmark code (CUDA, Linux,
torch's CUDA allocator, CUDA graphs); the measuring engine
(extkv.testing.benchmarking) never asks which device it runs on.

Two layers:

- `Primitives`: the driver's calls and nothing else, no bookkeeping, no
  checks but the call's status. `CudaPrimitives` calls cuda-python directly
  (cuMemAddressReserve, cuMemCreate, cuMemMap, cuMemSetAccess,
  cuMemsetD8Async, cuMemcpyDtoDAsync, cuMemUnmap, cuMemRelease), with the
  device's primary context pushed once per store operation rather than once
  per call, and chunks created with the same properties extkv's CudaDriver
  uses (pinned device memory, exportable as a POSIX fd: what a KV connector
  needs, so the comparison is for the same product). `HostPrimitives` is the
  same protocol on Linux: memfd_create + fallocate, mmap(MAP_FIXED),
  mprotect, memset. Calls that queue device work (fill, copy) run inside
  `active()`, which on CUDA also reads torch's current stream once.

- `Store`s: one contender's memory for a KV geometry, given as the per-block
  stride of each segment and a capacity in blocks. Segment i commits
  `blocks * strides[i]` bytes; every store zeroes exactly the bytes a commit
  adds, so each does the work extkv's commit does. Verbs: `open` (untimed
  setup: reserve or allocate), `grow(blocks)`, `shrink(blocks)`,
  `defragment(preserve)`, `release`, `recommit`, `capture`/`replay` (a CUDA
  graph that reads the committed bytes), `close`. A store that has no such
  verb raises `Unsupported`, and a store that cannot run on a device says
  why in `unsupported_reason`: the benchmark reports it as not run, with
  that reason, instead of dropping it.

The stores:

| store | strategy |
|---|---|
| `RawStore` | the best raw sequence: per segment, interleaved, create, map, grant access, zero; one chunk per segment per commit; each segment at a granule-aligned offset of one reservation (so a segment smaller than a granule maps a whole one, where extkv's neighbours share it) |
| `GranuleStore` | one handle per granule (kvcached / vAttention): create, map, grant access per 2 MiB, then zero |
| `PlainStore` | memset of the same bytes on one plain torch allocation: the physical floor of a zeroing commit |
| `CopyStore` | device copy of the same bytes between two plain allocations: the floor of a preserving move |
| `UpfrontStore` | one up-front allocation of everything, zeroed at once (cannot grow) |
| `AllocCopyStore` | growth by allocate + copy + zero, freeing the old buffer (moves addresses, 2x peak) |
| `ExpandableStore` | torch's `expandable_segments:True` allocator: each commit allocates its new bytes as a tensor; release is del + empty_cache; needs a process started with that setting |
| `TmsStore` | torch_memory_saver: one allocation in its region; release is `pause`, recommit is `resume` + zero (resume does not zero) |

Every store zeroes with the device's own memset (`Primitives.zero`:
cuMemsetD8Async, memset on the host), the call extkv and the raw sequence
zero with, so that a ratio measures a strategy and not a zeroing kernel:
torch's `zero_` is a fill kernel, 27% slower on the H200 (32 GiB in 10.2 ms,
3.37 TB/s, against 7.46 ms, 4.62 TB/s, for cuMemsetD8Async on the same
allocation), and a floor measured with it was one that commits beat. The
copy floor copies with the driver's copy (cuMemcpyDtoDAsync), as extkv's
defragment does.

`RawStore.defragment(preserve=True)` is the raw floor of a preserving
defragment: per segment create one chunk, map it in one scratch reservation
and copy the segment into it; one synchronize for all; then per segment
unmap the old chunks and map the new one in their place. It holds the whole
copy at once (twice the memory, where extkv moves one segment at a time):
it is the create + device copy floor the target is stated against.
"""

from __future__ import annotations

import abc
import contextlib
import ctypes
import errno
import functools
import os
from typing import Any, ClassVar, Iterator, Sequence

import torch

from ..errors import DriverError
from . import torch_memory
from .dlpack import uint8_view

#: memfd name of the host baseline's chunks; not extkv's chunk name, so the
#: harness's chunk accounting never counts them.
RAW_MEMFD_NAME = "bench-raw"

#: Setting a process needs for `ExpandableStore`.
EXPANDABLE_SEGMENTS_SETTING = "expandable_segments:True"
#: Environment of each special process a store needs (`Store.process`).
PROCESS_ENVIRONMENT: dict[str, dict[str, str]] = {
    "expandable": {"PYTORCH_CUDA_ALLOC_CONF": EXPANDABLE_SEGMENTS_SETTING},
    "tms": {},
}


class Unsupported(Exception):
    """This contender cannot do this here; the message says why."""


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# -- primitives ------------------------------------------------------------------
class Primitives(abc.ABC):
    """The raw calls of one device's virtual-memory protocol."""

    device: torch.device
    granularity: int

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Make the device current for a batch of calls."""
        yield

    @abc.abstractmethod
    def reserve(self, size: int) -> int: ...

    @abc.abstractmethod
    def free(self, address: int, size: int) -> None: ...

    @abc.abstractmethod
    def create(self, size: int) -> Any: ...

    @abc.abstractmethod
    def map(self, address: int, size: int, handle: Any) -> None: ...

    @abc.abstractmethod
    def set_access(self, address: int, size: int) -> None: ...

    @abc.abstractmethod
    def fill(self, address: int, size: int, value: int) -> None:
        """Set every byte of the range to `value` (queued on the device)."""

    def zero(self, address: int, size: int) -> None:
        self.fill(address, size, 0)

    @abc.abstractmethod
    def access(self, address: int) -> str:
        """The access the driver or kernel reports at `address`, read back:
        "rw", "r" or "none"."""

    @abc.abstractmethod
    def copy(self, destination: int, source: int, size: int) -> None: ...

    @abc.abstractmethod
    def unmap(self, address: int, size: int) -> None: ...

    @abc.abstractmethod
    def release(self, handle: Any) -> None: ...

    @abc.abstractmethod
    def synchronize(self) -> None: ...

    def probe_partial_map(self) -> tuple[bool | None, str]:
        """Whether this driver maps part of a chunk (one granule of a
        two-granule chunk, from an offset), tried on real memory, and what
        it answered; (None, why) where the protocol has no such call.
        Where it cannot, every range a commit adds needs a chunk of its own:
        the fewest driver calls a geometry allows are one create per segment
        per commit."""
        return None, f"{type(self).__name__} has no mapping from an offset"

    def probe_partial_access(self) -> tuple[bool | None, str]:
        """Whether this driver grants access over part of a mapped chunk (the
        second granule of a two-granule chunk mapped whole), tried on real
        memory, and what it answered; (None, why) where the protocol has no
        such call. Where it cannot, no byte of a chunk can be zeroed before
        all of it is created, mapped and granted: a segment committed in one
        chunk starts zeroing only then."""
        return None, f"{type(self).__name__} has no access grant over part of a chunk"

    @contextlib.contextmanager
    def _two_granule_chunk(self) -> Iterator[tuple[int, Any]]:
        """A two-granule reservation and a two-granule chunk, not mapped, for
        a probe; the chunk is released and the reservation freed after."""
        granule = self.granularity
        with self.active():
            address = self.reserve(2 * granule)
            try:
                handle = self.create(2 * granule)
                try:
                    yield address, handle
                finally:
                    self.release(handle)
            finally:
                self.free(address, 2 * granule)


def _cuda_checked(call: str, result, *, size: int | None = None, address: int | None = None):
    from cuda.bindings import driver as cu

    status, *values = result
    if status != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(status)
        name = name.decode() if isinstance(name, bytes) else str(status)
        raise DriverError(call, int(status), name, size=size, address=address)
    return values[0] if len(values) == 1 else None


class CudaPrimitives(Primitives):
    """CUDA's VMM calls through cuda-python, on one device."""

    def __init__(self, device: torch.device):
        from cuda.bindings import driver as cu

        self._cu = cu
        index = torch.cuda.current_device() if device.index is None else device.index
        self.device = torch.device("cuda", index)
        torch.cuda.init()  # torch owns the primary context; share it
        _cuda_checked("cuInit", cu.cuInit(0))
        cu_device = _cuda_checked("cuDeviceGet", cu.cuDeviceGet(index))
        self._context = _cuda_checked("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(cu_device))
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = index
        prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self._prop = prop
        minimum = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        self.granularity = int(_cuda_checked("cuMemGetAllocationGranularity", cu.cuMemGetAllocationGranularity(prop, minimum)))
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = index
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = [access]
        self._stream = cu.CUstream(torch.cuda.current_stream(self.device).cuda_stream)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        cu = self._cu
        _cuda_checked("cuCtxPushCurrent", cu.cuCtxPushCurrent(self._context))
        # torch's current stream, read once per batch: asking torch per call
        # costs microseconds that a 256-segment commit would pay 256 times.
        self._stream = cu.CUstream(torch.cuda.current_stream(self.device).cuda_stream)
        try:
            yield
        finally:
            _cuda_checked("cuCtxPopCurrent", cu.cuCtxPopCurrent())

    def reserve(self, size: int) -> int:
        return int(_cuda_checked("cuMemAddressReserve", self._cu.cuMemAddressReserve(size, self.granularity, 0, 0), size=size))

    def free(self, address: int, size: int) -> None:
        _cuda_checked("cuMemAddressFree", self._cu.cuMemAddressFree(address, size), size=size, address=address)

    def create(self, size: int):
        return _cuda_checked("cuMemCreate", self._cu.cuMemCreate(size, self._prop, 0), size=size)

    def map(self, address: int, size: int, handle) -> None:
        _cuda_checked("cuMemMap", self._cu.cuMemMap(address, size, 0, handle, 0), size=size, address=address)

    def set_access(self, address: int, size: int) -> None:
        _cuda_checked("cuMemSetAccess", self._cu.cuMemSetAccess(address, size, self._access, 1), size=size, address=address)

    def fill(self, address: int, size: int, value: int) -> None:
        _cuda_checked(
            "cuMemsetD8Async", self._cu.cuMemsetD8Async(address, value, size, self._stream), size=size, address=address
        )

    def access(self, address: int) -> str:
        status, flags = self._cu.cuMemGetAccess(self._access[0].location, address)
        if status != self._cu.CUresult.CUDA_SUCCESS:
            return "none"
        return {int(self._cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE): "rw",
                int(self._cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ): "r"}.get(int(flags), "none")

    def copy(self, destination: int, source: int, size: int) -> None:
        _cuda_checked(
            "cuMemcpyDtoDAsync",
            self._cu.cuMemcpyDtoDAsync(destination, source, size, self._stream),
            size=size,
            address=destination,
        )

    def unmap(self, address: int, size: int) -> None:
        _cuda_checked("cuMemUnmap", self._cu.cuMemUnmap(address, size), size=size, address=address)

    def probe_partial_map(self) -> tuple[bool | None, str]:
        cu, granule = self._cu, self.granularity
        with self._two_granule_chunk() as (address, handle):
            status = cu.cuMemMap(address, granule, granule, handle, 0)[0]
            if status == cu.CUresult.CUDA_SUCCESS:
                self.unmap(address, granule)
        return status == cu.CUresult.CUDA_SUCCESS, f"cuMemMap of a two-granule chunk's second granule: {status.name}"

    def probe_partial_access(self) -> tuple[bool | None, str]:
        cu, granule = self._cu, self.granularity
        with self._two_granule_chunk() as (address, handle):
            self.map(address, 2 * granule, handle)
            try:
                status = cu.cuMemSetAccess(address + granule, granule, self._access, 1)[0]
            finally:
                self.unmap(address, 2 * granule)
        return (status == cu.CUresult.CUDA_SUCCESS,
                f"cuMemSetAccess of the second granule of a two-granule chunk mapped whole: {status.name}")

    def release(self, handle) -> None:
        _cuda_checked("cuMemRelease", self._cu.cuMemRelease(handle))

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


_PROT_NONE, _PROT_READ, _PROT_WRITE = 0x0, 0x1, 0x2
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS, _MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _host_failed(call: str, size: int, address: int | None) -> DriverError:
    code = ctypes.get_errno()
    return DriverError(call, code, errno.errorcode.get(code, "E?"), size=size, address=address, detail=os.strerror(code))


class HostPrimitives(Primitives):
    """The same protocol on Linux virtual memory: memfd chunks."""

    def __init__(self, granularity: int = 2 << 20):
        self.device = torch.device("cpu")
        self.granularity = granularity

    def _mmap(self, call: str, address: int | None, size: int, prot: int, flags: int, fd: int = -1, offset: int = 0) -> int:
        result = _libc.mmap(address, size, prot, flags, fd, offset)
        if result is None or result == _MAP_FAILED:
            raise _host_failed(call, size, address)
        return result

    def reserve(self, size: int) -> int:
        padded = size + self.granularity
        raw = self._mmap("mmap(PROT_NONE) reserve", None, padded, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE)
        base = _round_up(raw, self.granularity)
        if base > raw:
            _libc.munmap(raw, base - raw)
        if raw + padded > base + size:
            _libc.munmap(base + size, raw + padded - base - size)
        return base

    def free(self, address: int, size: int) -> None:
        if _libc.munmap(address, size) != 0:
            raise _host_failed("munmap", size, address)

    def create(self, size: int) -> int:
        fd = os.memfd_create(RAW_MEMFD_NAME, os.MFD_CLOEXEC)
        try:
            # fallocate, not ftruncate: pages allocated in one call, then
            # touched by the zero, beat pages allocated one fault at a time
            # (190 vs 220 ms for 256 MiB on the 2-core CI machine).
            os.posix_fallocate(fd, 0, size)
        except OSError:
            os.close(fd)
            raise
        return fd

    def map(self, address: int, size: int, handle: int) -> None:
        self._mmap("mmap(MAP_FIXED, memfd)", address, size, _PROT_NONE, _MAP_SHARED | _MAP_FIXED, handle)

    def set_access(self, address: int, size: int) -> None:
        if _libc.mprotect(address, size, _PROT_READ | _PROT_WRITE) != 0:
            raise _host_failed("mprotect(PROT_READ|PROT_WRITE)", size, address)

    def fill(self, address: int, size: int, value: int) -> None:
        ctypes.memset(address, value, size)

    def access(self, address: int) -> str:
        with open("/proc/self/maps") as maps:
            for line in maps:
                span, permissions = line.split()[:2]
                start, end = (int(part, 16) for part in span.split("-"))
                if start <= address < end:
                    return {"rw": "rw", "r-": "r"}.get(permissions[:2], "none")
        return "none"

    def copy(self, destination: int, source: int, size: int) -> None:
        ctypes.memmove(destination, source, size)

    def unmap(self, address: int, size: int) -> None:
        # PROT_NONE anonymous memory over the range keeps the reservation whole.
        self._mmap(
            "mmap(PROT_NONE) unmap", address, size, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED
        )

    def release(self, handle: int) -> None:
        os.close(handle)

    def synchronize(self) -> None:
        """Host calls are synchronous."""

    def probe_partial_map(self) -> tuple[bool | None, str]:
        granule = self.granularity
        with self._two_granule_chunk() as (address, handle):
            try:
                self._mmap("mmap(MAP_FIXED, memfd, offset)", address, granule, _PROT_NONE, _MAP_SHARED | _MAP_FIXED,
                           handle, granule)
            except DriverError as error:
                return False, f"mmap of a two-granule memfd's second granule: {error}"
        return True, "mmap of a two-granule memfd's second granule: mapped"

    def probe_partial_access(self) -> tuple[bool | None, str]:
        granule = self.granularity
        with self._two_granule_chunk() as (address, handle):
            self.map(address, 2 * granule, handle)
            try:
                self.set_access(address + granule, granule)
            except DriverError as error:
                return False, f"mprotect of the second granule of a two-granule memfd mapped whole: {error}"
            finally:
                self.unmap(address, 2 * granule)
        return True, "mprotect of the second granule of a two-granule memfd mapped whole: granted"


class PoisoningPrimitives(Primitives):
    """`inner` with every created chunk filled with `pattern` before it is
    returned (through `inner`'s own calls: scratch reserve, map, access,
    fill, unmap), so that a byte a sequence forgets to zero reads as the
    pattern. Tests of the baselines run on it: fresh chunks read zero on the
    host and on the H200 whether or not anyone zeroes them."""

    def __init__(self, inner: Primitives, pattern: int):
        if not 0 < pattern < 256:
            raise ValueError(f"pattern must be a non-zero byte (1..255), got {pattern!r}")
        self.inner, self.pattern = inner, pattern
        self.device, self.granularity = inner.device, inner.granularity

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        with self.inner.active():
            yield

    def create(self, size: int) -> Any:
        inner = self.inner
        handle = inner.create(size)
        scratch = inner.reserve(size)
        inner.map(scratch, size, handle)
        inner.set_access(scratch, size)
        inner.fill(scratch, size, self.pattern)
        inner.synchronize()
        inner.unmap(scratch, size)
        inner.free(scratch, size)
        return handle

    def reserve(self, size: int) -> int:
        return self.inner.reserve(size)

    def free(self, address: int, size: int) -> None:
        self.inner.free(address, size)

    def map(self, address: int, size: int, handle: Any) -> None:
        self.inner.map(address, size, handle)

    def set_access(self, address: int, size: int) -> None:
        self.inner.set_access(address, size)

    def fill(self, address: int, size: int, value: int) -> None:
        self.inner.fill(address, size, value)

    def access(self, address: int) -> str:
        return self.inner.access(address)

    def copy(self, destination: int, source: int, size: int) -> None:
        self.inner.copy(destination, source, size)

    def unmap(self, address: int, size: int) -> None:
        self.inner.unmap(address, size)

    def release(self, handle: Any) -> None:
        self.inner.release(handle)

    def synchronize(self) -> None:
        self.inner.synchronize()


@functools.lru_cache(maxsize=None)
def primitives_for(device: torch.device) -> Primitives:
    """The raw calls for `device` (cpu: Linux; cuda:N: cuda-python)."""
    device = torch.device(device)
    if device.type == "cpu":
        return HostPrimitives()
    if device.type == "cuda":
        return CudaPrimitives(device)
    raise ValueError(f"no raw baseline for device {device}; expected cpu or cuda:N")


def synchronize(device: torch.device) -> None:
    """Wait for queued work on `device` (nothing to wait for on the host)."""
    primitives_for(torch.device(device)).synchronize()


# -- CUDA graphs ----------------------------------------------------------------
class CapturedRead:
    """A CUDA graph that reads every byte of `views` (a sum per view, as int64)."""

    def __init__(self, views: Sequence[torch.Tensor]):
        device = views[0].device
        if device.type != "cuda":
            raise Unsupported(f"CUDA graphs need a CUDA device, the memory is on {device}")
        odd = [v.numel() for v in views if v.numel() % 8]
        if odd:
            raise ValueError(f"views must hold a multiple of 8 bytes to be read as int64, got sizes {odd}")
        words = [v.view(torch.int64) for v in views]
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # kernels loaded outside the capture
            for word in words:
                word.sum()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.sums = [word.sum() for word in words]

    def replay(self, times: int) -> None:
        for _ in range(times):
            self.graph.replay()


# -- stores ---------------------------------------------------------------------
class Store(abc.ABC):
    """One contender's memory for a KV geometry.

    `strides[i]` is segment i's bytes per block, `capacity_blocks` the most
    blocks it holds. `blocks` is the committed count.
    """

    #: Human words for the report.
    what: ClassVar[str] = ""
    #: The process a store needs: "main", or a named special process.
    process: ClassVar[str] = "main"

    def __init__(self, device: torch.device, strides: Sequence[int], capacity_blocks: int):
        self.device = torch.device(device)
        self.strides = [int(s) for s in strides]
        if not self.strides or min(self.strides) <= 0:
            raise ValueError(f"strides must be positive bytes per block, one per segment, got {strides!r}")
        if capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be an int >= 1, got {capacity_blocks!r}")
        self.capacity_blocks = capacity_blocks
        self.blocks = 0
        self._released_blocks = 0
        self._captured: CapturedRead | None = None

    @classmethod
    def unsupported_reason(cls, device: torch.device) -> str | None:
        """Why this store cannot run on `device` in this process, or None."""
        return None

    @property
    def bytes_per_block(self) -> int:
        return sum(self.strides)

    def open(self) -> None:
        """Untimed setup before the first commit."""

    def grow(self, blocks: int) -> None:
        raise Unsupported(f"{type(self).__name__} has no grow")

    def shrink(self, blocks: int) -> None:
        raise Unsupported(f"{type(self).__name__} has no shrink")

    def defragment(self, preserve: bool) -> None:
        raise Unsupported(f"{type(self).__name__} has no defragment")

    def release(self) -> None:
        raise Unsupported(f"{type(self).__name__} has no release")

    def recommit(self) -> None:
        raise Unsupported(f"{type(self).__name__} has no recommit")

    def views(self) -> list[torch.Tensor]:
        """uint8 tensors over the committed bytes (one per segment, or one)."""
        raise Unsupported(f"{type(self).__name__} has no views")

    def capture(self) -> None:
        """Capture a CUDA graph reading the committed bytes as they are now."""
        self._captured = CapturedRead(self.views())

    def replay(self, times: int) -> None:
        if self._captured is None:
            raise RuntimeError("replay() before capture()")
        self._captured.replay(times)

    def synchronize(self) -> None:
        synchronize(self.device)

    def driver_cpu_seconds(self) -> float | None:
        """CPU seconds this store's calls have spent inside the driver so far,
        where it counts them (extkv does); None where it does not."""
        return None

    def close(self) -> None:
        """Give everything back (untimed)."""
        self._captured = None


class RawStore(Store):
    """The best raw driver sequence: one chunk per segment per commit."""

    what = "raw driver sequence: per segment create, map, set access, zero; one chunk per segment"

    def __init__(self, device, strides, capacity_blocks, primitives: Primitives | None = None):
        super().__init__(device, strides, capacity_blocks)
        #: The device's raw calls; tests pass PoisoningPrimitives.
        self.prims = primitives or primitives_for(self.device)
        g = self.prims.granularity
        self.offsets, end = [], 0
        for stride in self.strides:
            self.offsets.append(end)
            end += _round_up(stride * capacity_blocks, g)
        self.reserved_bytes = end
        self.base: int | None = None
        self._sizes = [0] * len(self.strides)
        self._mapped = [0] * len(self.strides)
        #: Per segment: (address, size, handle) of each mapped chunk.
        self.chunks: list[list[tuple[int, int, Any]]] = [[] for _ in self.strides]

    def open(self) -> None:
        with self.prims.active():
            self.base = self.prims.reserve(self.reserved_bytes)

    def _chunk_bytes(self, size: int) -> int:
        """Bytes per chunk when `size` new bytes are mapped: all in one."""
        return size

    def _map_new(self, segment: int, address: int, size: int) -> None:
        prims, step = self.prims, self._chunk_bytes(size)
        for start in range(address, address + size, step):
            handle = prims.create(step)
            prims.map(start, step, handle)
            prims.set_access(start, step)
            self.chunks[segment].append((start, step, handle))

    def grow(self, blocks: int) -> None:
        prims, g = self.prims, self.prims.granularity
        with prims.active():
            for i, stride in enumerate(self.strides):
                old, new = self._sizes[i], blocks * stride
                if new <= old:
                    continue
                start = self.base + self.offsets[i]
                wanted = _round_up(new, g)
                if wanted > self._mapped[i]:
                    self._map_new(i, start + self._mapped[i], wanted - self._mapped[i])
                    self._mapped[i] = wanted
                prims.zero(start + old, new - old)
                self._sizes[i] = new
        self.blocks = max(self.blocks, blocks)

    def release(self) -> None:
        prims = self.prims
        with prims.active():
            prims.synchronize()
            for chunks in self.chunks:
                for address, size, handle in chunks:
                    prims.unmap(address, size)
                    prims.release(handle)
                chunks.clear()
        self._sizes = [0] * len(self.strides)
        self._mapped = [0] * len(self.strides)
        self._released_blocks, self.blocks = self.blocks, 0

    def recommit(self) -> None:
        self.grow(self._released_blocks)

    def shrink(self, blocks: int) -> None:
        self.release()
        self.grow(blocks)

    def defragment(self, preserve: bool) -> None:
        """Make every segment one chunk; a segment that is one already
        stays as it is, as extkv's does."""
        fragmented = [len(chunks) > 1 for chunks in self.chunks]
        if not any(fragmented):
            return
        blocks = self.blocks
        if not preserve:
            self.release()
            self.grow(blocks)
            return
        prims = self.prims
        total = sum(size for size, moves in zip(self._mapped, fragmented) if moves)
        with prims.active():
            scratch = prims.reserve(total)
            moved: list[tuple[int, int, Any] | None] = []
            offset = 0
            for i, size in enumerate(self._mapped):
                if not fragmented[i]:
                    moved.append(None)
                    continue
                handle = prims.create(size)
                prims.map(scratch + offset, size, handle)
                prims.set_access(scratch + offset, size)
                prims.copy(scratch + offset, self.base + self.offsets[i], size)
                moved.append((scratch + offset, size, handle))
                offset += size
            prims.synchronize()
            for i, new in enumerate(moved):
                if new is None:
                    continue
                _, size, handle = new
                for address, old_size, old_handle in self.chunks[i]:
                    prims.unmap(address, old_size)
                    prims.release(old_handle)
                start = self.base + self.offsets[i]
                prims.map(start, size, handle)
                prims.set_access(start, size)
                self.chunks[i] = [(start, size, handle)]
            for new in moved:
                if new is not None:
                    prims.unmap(new[0], new[1])
            prims.free(scratch, total)

    def views(self) -> list[torch.Tensor]:
        return [uint8_view(self.base + offset, size, self.device) for offset, size in zip(self.offsets, self._sizes)]

    def close(self) -> None:
        super().close()
        if self.base is None:
            return
        self.release()
        with self.prims.active():
            self.prims.free(self.base, self.reserved_bytes)
        self.base = None


class GranuleStore(RawStore):
    """One handle per granule, as page-based designs (kvcached, vAttention) map."""

    what = "one handle per 2 MiB granule (kvcached / vAttention strategy): create, map, set access per granule"

    def _chunk_bytes(self, size: int) -> int:
        return self.prims.granularity


class _TorchStore(Store):
    """Stores on plain torch allocations; their memory goes back to the
    driver when they close, so the next contender starts from the same
    state. They zero through `prims`, the device's own memset."""

    def __init__(self, device, strides, capacity_blocks, primitives: Primitives | None = None):
        super().__init__(device, strides, capacity_blocks)
        #: The device's raw calls; tests pass wrappers that record them.
        self.prims = primitives or primitives_for(self.device)

    def _total(self, blocks: int) -> int:
        return blocks * self.bytes_per_block

    def _zero(self, *pieces: torch.Tensor) -> None:
        """Zero each contiguous uint8 tensor in `pieces` with the device's
        memset, queued on torch's current stream."""
        prims = self.prims
        with prims.active():
            for piece in pieces:
                if piece.numel():
                    prims.zero(piece.data_ptr(), piece.numel())

    def close(self) -> None:
        super().close()
        self._drop()
        torch_memory.release_cached(self.device)

    def _drop(self) -> None:
        """Forget every tensor this store holds."""


class PlainStore(_TorchStore):
    """memset of the same bytes on one plain allocation: the floor."""

    what = "memset (the driver's, as extkv zeroes) of the same bytes on a plain allocation"

    def open(self) -> None:
        # Written once, untimed, so that host pages exist before the timed
        # zero as device memory does: the floor is the write alone.
        self.buffer = torch.empty(self._total(self.capacity_blocks), dtype=torch.uint8, device=self.device).fill_(0xA5)

    def grow(self, blocks: int) -> None:
        old, new = self._total(self.blocks), self._total(blocks)
        if new > old:
            self._zero(self.buffer[old:new])
        self.blocks = max(self.blocks, blocks)

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
            with self.prims.active():
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


class TmsStore(_TorchStore):
    """torch_memory_saver: pause unmaps and releases, resume maps again
    (without zeroing: the store zeroes after resume, as extkv's recommit does)."""

    what = "torch_memory_saver 0.0.10: allocation in its region; release = pause, recommit = resume + zero"
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

    def grow(self, blocks: int) -> None:
        old, new = self._total(self.blocks), self._total(blocks)
        if new > old:
            self._zero(self.buffer[old:new])
        self.blocks = max(self.blocks, blocks)

    def release(self) -> None:
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


# -- facts for the report ---------------------------------------------------------
def clock_note(device: torch.device) -> str:
    """What the report says about clocks: never pinned by extkv bench
    (changing a device's settings is the machine owner's call), with the
    clocks read now where NVML can read them."""
    device = torch.device(device)
    if device.type != "cuda":
        return "host CPU: frequency scaling left as the machine has it"
    try:
        import pynvml

        pynvml.nvmlInitWithFlags(0)
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        sm, memory = (pynvml.nvmlDeviceGetClockInfo(handle, kind) for kind in (pynvml.NVML_CLOCK_SM, pynvml.NVML_CLOCK_MEM))
        top = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM)
        reading = f"SM clock {sm} MHz of {top} MHz max, memory clock {memory} MHz"
    except Exception as error:
        reading = f"NVML could not read the clocks ({type(error).__name__}: {error})"
    return f"GPU clocks not pinned (extkv bench changes no device settings); {reading}"
