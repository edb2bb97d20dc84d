"""CUDA driver: the virtual-memory protocol on CUDA's VMM API (cuda-python).

Theory of operation
-------------------
Every call into `cuda.bindings.driver` in extkv happens in this module. Each
public step maps to one driver call (`cuMemAddressReserve`, `cuMemCreate`,
`cuMemMap`, `cuMemSetAccess`, `cuMemUnmap`, `cuMemRelease`,
`cuMemAddressFree`), run with the device's primary context pushed, the same
context torch's runtime uses, so addresses are valid for torch kernels.
`zero` and `copy` are `cuMemsetD8Async` and `cuMemcpyDtoDAsync` on torch's
current stream. `batch()` pushes the context once for many calls (a commit
of 256 segments makes over a thousand) and looks the stream up once; the
push is per thread, since a CUDA context is current per thread. A commit
(`map_new_chunks`: its runs, then its new bytes in memory mapped before) is
one loop here, the context pushed and the stream looked up once, each step
one bindings call, rather than the public steps one by one as wrappers take
them.
A failing CUresult becomes a `DriverError` naming the call, the code, the size
and the address.

Chunks are created pinned on the device and exportable as POSIX file
descriptors (`cuMemExportToShareableHandle`), which is what a KV connector
needs to hand a segment to another process; that process turns the descriptor
back into a handle with `cuMemImportFromShareableHandle` (which refuses a
descriptor that is no CUDA allocation) and releases it with `cuMemRelease`
like any other. Unlike a host memfd, such a descriptor carries no access
mode: whoever imports it chooses its own access (`cuMemSetAccess`), so the
exporter cannot make an export read-only. `chunk_at` asks the driver which
allocation backs an address (`cuMemRetainAllocationHandle`) and drops the
extra reference it took. `access_at` first asks the same (nothing mapped
reads None), then `cuMemGetAccess` for this device at that address, whose
flags name the access granted: so an importer's read-only mapping is read
back from the driver, not taken on trust.

What an RDMA stack (UCX, NIXL, Mooncake) needs to register a segment: its
chunks created GPUDirect RDMA capable (`allocFlags.gpuDirectRDMACapable`),
asked for wherever the device attribute
CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED is 1 (read once
per device by `device_offers`, before any context exists), and one chunk
behind the range it registers, which a defragment gives. Both are read
back, never taken from bookkeeping: `rdma_capable_at` is
`cuPointerGetAttribute(IS_GPU_DIRECT_RDMA_CAPABLE)`, `allocation_range_at`
`cuMemGetAddressRange`, the mapping of the one chunk that holds the address
(the stacks size a registration by it), and `export_dma_buf` is
`cuMemGetHandleForAddressRange(DMA_BUF_FD)`, the dma-buf a NIC registers.
Each first asks whether anything is mapped, as `access_at` does.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Callable, Hashable

import torch

from ..errors import DriverError, OutOfMemoryError
from .base import NO_ACCESS, READ_ONLY, READ_WRITE, Chunk, Driver, count_live_chunks, format_granularity
from .transaction import Transaction
from . import torch_memory
from .dlpack import uint8_view
from .witness import NvmlUsage


@functools.lru_cache(maxsize=None)
def _bindings():
    # Imported on first use: importing extkv must work without a GPU driver.
    from cuda.bindings import driver

    return driver


def check_result(call: str, result, *, size: int | None = None, address: int | None = None):
    """Unpack a cuda-python result tuple: None, its one value, or a tuple of
    its values; on a failing CUresult raise DriverError naming `call`, the
    code, the size and the address (OutOfMemoryError for
    CUDA_ERROR_OUT_OF_MEMORY). Every bindings call of this driver is checked
    here, and so are the benchmarks' raw CUDA calls, so that both fail in
    the same words."""
    cu = _bindings()
    status, *values = result
    if status != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(status)
        name = name.decode() if isinstance(name, bytes) else str(status)
        error_type = OutOfMemoryError if status == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY else DriverError
        raise error_type(call, int(status), name, size=size, address=address)
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _posix_fd_handle_type():
    return _bindings().CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


#: What a GPU may offer besides memory that extkv uses, by extkv's name: the
#: device attribute that says whether it does. `gpudirect_rdma`: chunks may
#: be created GPUDirect RDMA capable (`allocFlags.gpuDirectRDMACapable`);
#: `dma_buf`: a mapped range exports as a dma-buf (`export_dma_buf`).
DEVICE_FEATURES = {
    "gpudirect_rdma": "CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED",
    "dma_buf": "CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED",
}


@functools.lru_cache(maxsize=None)
def device_offers(index: int, feature: str) -> bool:
    """Whether CUDA device `index` offers `feature` (a key of
    DEVICE_FEATURES), as its device attribute says: read once per device
    and feature, without creating a context (cuDeviceGetAttribute needs
    cuInit and the device only), so report headers may ask too."""
    if feature not in DEVICE_FEATURES:
        raise ValueError(f"device feature {feature!r} is not one of {sorted(DEVICE_FEATURES)}")
    cu = _bindings()
    attribute = DEVICE_FEATURES[feature]
    check_result("cuInit", cu.cuInit(0))
    device = check_result("cuDeviceGet", cu.cuDeviceGet(index))
    value = check_result(
        f"cuDeviceGetAttribute({attribute})", cu.cuDeviceGetAttribute(getattr(cu.CUdevice_attribute, attribute), device)
    )
    return bool(value)


def allocation_prop(index: int):
    """Pinned device memory on device `index`, exportable as a POSIX fd and,
    where the device supports it with VMM, GPUDirect RDMA capable: the
    properties of every chunk this driver creates (a raw sequence measured
    against it creates its chunks with the same)."""
    cu = _bindings()
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = index
    prop.requestedHandleTypes = _posix_fd_handle_type()
    if device_offers(index, "gpudirect_rdma"):
        # What a NIC's registration of the memory needs: without it an RDMA
        # stack's registration of a VMM mapping fails (UCX: "ibv_reg_mr()
        # failed: Bad address"). Measured on an H200 (driver 580.159.04,
        # cuda-bindings 13): the device attribute reads 1, and a chunk made
        # with the flag reads back CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE
        # = 1, one made without it 0.
        prop.allocFlags.gpuDirectRDMACapable = 1
    return prop


def allocation_granularity(prop) -> int:
    """The minimum granularity of allocations with properties `prop`."""
    cu = _bindings()
    option = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    return int(check_result("cuMemGetAllocationGranularity", cu.cuMemGetAllocationGranularity(prop, option)))


_ALREADY_ACTIVE = contextlib.nullcontext()


def _raw_stream_lookup() -> Callable[[int], int]:
    """`index -> handle of the current stream of device index`. torch's own
    generated kernels read it with `torch._C._cuda_getCurrentRawStream`,
    which builds no Stream object (a tenth of the public lookup's cost, paid
    once per commit); the public call stands in where a build lacks it."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    return lambda index: torch.cuda.current_stream(index).cuda_stream


class _ThreadState(threading.local):
    """Per thread: whether the driver's context is pushed (by an open
    `_active` or `batch`), and the stream `batch` looked up (None outside
    one). Class-level defaults, so that reading them needs no `getattr`."""

    pushed = False
    stream = None


def _push_context(driver: "CudaDriver") -> None:
    result = driver._cu.cuCtxPushCurrent(driver._context)
    result[0] == 0 or check_result("cuCtxPushCurrent", result)
    driver._thread.pushed = True


def _pop_context(driver: "CudaDriver") -> None:
    driver._thread.pushed = False
    result = driver._cu.cuCtxPopCurrent()
    result[0] == 0 or check_result("cuCtxPopCurrent", result)


# Context managers below are classes, not generators: a commit opens one per
# call, and a generator-based one costs several times as much to enter.
class _ContextPushed:
    """The driver's primary context pushed on this thread for the calls inside."""

    __slots__ = ("_driver",)

    def __init__(self, driver: "CudaDriver"):
        self._driver = driver

    def __enter__(self) -> None:
        _push_context(self._driver)

    def __exit__(self, *exc_info) -> None:
        _pop_context(self._driver)


class _Batch:
    """The context pushed (unless this thread has it pushed already) and the
    current stream looked up once, for every call inside (see
    `Driver.batch`); re-entrant per thread."""

    __slots__ = ("_driver", "_pushed", "_outer_stream")

    def __init__(self, driver: "CudaDriver"):
        self._driver = driver

    def __enter__(self) -> None:
        driver = self._driver
        thread = driver._thread
        self._pushed = not thread.pushed
        if self._pushed:
            _push_context(driver)
        self._outer_stream = thread.stream
        if self._outer_stream is None:
            try:
                # As the bindings' own type: an int would be converted on
                # every call that takes it, and a commit makes one per run.
                thread.stream = driver._cu.CUstream(driver._current_stream(driver.device.index))
            except BaseException:
                if self._pushed:
                    _pop_context(driver)
                raise

    def __exit__(self, *exc_info) -> None:
        self._driver._thread.stream = self._outer_stream
        if self._pushed:
            _pop_context(self._driver)


class CudaDriver(Driver):
    """CUDA virtual memory management on one device."""

    kind = "cuda"
    supports_graphs = True

    def __init__(self, device: torch.device):
        if device.type != "cuda":
            raise ValueError(f"CudaDriver needs a cuda device, got {device}")
        index = torch.cuda.current_device() if device.index is None else device.index
        if not 0 <= index < torch.cuda.device_count():
            raise ValueError(
                f"cuda device index {index} is out of range: {torch.cuda.device_count()} device(s) visible"
            )
        self.device = self.collective_device = torch.device("cuda", index)
        self._cu = cu = _bindings()
        # torch's runtime owns the primary context; initializing torch's CUDA
        # state first means we share it rather than create a second one.
        torch.cuda.init()
        check_result("cuInit", cu.cuInit(0))
        self._cu_device = check_result("cuDeviceGet", cu.cuDeviceGet(index))
        self._context = check_result("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(self._cu_device))
        self.gpudirect_rdma = device_offers(index, "gpudirect_rdma")
        self._prop = allocation_prop(index)
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = index
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        read_only = cu.CUmemAccessDesc()
        read_only.location.type = access.location.type
        read_only.location.id = index
        read_only.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ
        self._access = {True: [access], False: [read_only]}
        # Where cuMemGetAccess reads the access back: this device, as granted.
        self._location = cu.CUmemLocation()
        self._location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._location.id = index
        flags = cu.CUmemAccess_flags
        self._access_names = {
            int(flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE): READ_WRITE,
            int(flags.CU_MEM_ACCESS_FLAGS_PROT_READ): READ_ONLY,
            int(flags.CU_MEM_ACCESS_FLAGS_PROT_NONE): NO_ACCESS,
        }
        self.granularity = allocation_granularity(self._prop)
        self._current_stream = _raw_stream_lookup()
        self._thread = _ThreadState()

    # -- what a raw sequence measured against this driver shares with it ------
    @property
    def bindings(self):
        """cuda-python's driver module, as this driver calls it."""
        return self._cu

    @property
    def chunk_properties(self):
        """The CUmemAllocationProp every chunk of this driver is created with."""
        return self._prop

    @property
    def read_write_access(self) -> list:
        """The access descriptors a writable mapping is granted with."""
        return self._access[True]

    def current_stream(self):
        """The stream this thread's work goes on, as the bindings take it:
        the one its open `batch()` looked up, else torch's current one."""
        stream = self._thread.stream
        return self._cu.CUstream(self._current_stream(self.device.index)) if stream is None else stream

    def _active(self) -> contextlib.AbstractContextManager[None]:
        # Inside another `_active` or `batch` of this thread the context is
        # current already; a commit makes thousands of calls, each would
        # otherwise push and pop.
        if self._thread.pushed:
            return _ALREADY_ACTIVE
        return _ContextPushed(self)

    def batch(self) -> contextlib.AbstractContextManager[None]:
        return _Batch(self)

    def _stream(self):
        stream = self._thread.stream
        return self._current_stream(self.device.index) if stream is None else stream

    def _call(self, name: str, function: Callable, *args, size: int | None = None, address: int | None = None):
        """`function(*args)` with the context current, its result checked
        (`_check`). A commit makes four of these per chunk, so the common
        case, the context already pushed by a batch, takes no `with`, and a
        success with at most one value returns before any enum lookup."""
        if self._thread.pushed:
            result = function(*args)
        else:
            with _ContextPushed(self):
                result = function(*args)
        if result[0] == 0 and len(result) <= 2:
            return result[1] if len(result) == 2 else None
        return check_result(name, result, size=size, address=address)

    def _map_new_chunks(self, runs, created: list[Chunk], give_back: Callable[[Chunk], object], zero_after) -> None:
        # The step-by-step sequence (`map_new_chunks_step_by_step`) goes
        # through three layers per step; a commit of 256 segments makes over a
        # thousand steps, and on a small commit every Python call between two
        # driver calls runs on caches the driver's work left cold. Here every
        # step is one bindings call, its result checked inline, and the
        # context and stream of a batch are set up inline for this call.
        thread = self._thread
        pushed_here = not thread.pushed
        if pushed_here:
            _push_context(self)
        try:
            cu = self._cu
            stream = thread.stream
            if stream is None:
                # As the bindings' own type: an int would be converted on
                # every call that takes it.
                stream = cu.CUstream(self._current_stream(self.device.index))
            create, map_, grant, memset = cu.cuMemCreate, cu.cuMemMap, cu.cuMemSetAccess, cu.cuMemsetD8Async
            prop, writable, kind = self._prop, self._access[True], self.kind
            with Transaction() as undo:
                for address, size, zero in runs:
                    result = create(size, prop, 0)
                    result[0] == 0 or check_result("cuMemCreate", result, size=size)
                    chunk = Chunk(int(result[1]), size)
                    count_live_chunks(kind, 1)
                    undo.push(give_back, chunk)
                    # The handle as an int: the bindings take it faster than their own type.
                    result = map_(address, size, 0, chunk.handle, 0)
                    result[0] == 0 or check_result("cuMemMap", result, size=size, address=address)
                    undo.push(self.unmap, address, size)
                    result = grant(address, size, writable, 1)
                    result[0] == 0 or check_result("cuMemSetAccess", result, size=size, address=address)
                    created.append(chunk)
                    undo.settle()
                    for low, count in zero:
                        result = memset(low, 0, count, stream)
                        result[0] == 0 or check_result("cuMemsetD8Async", result, size=count, address=low)
            for low, count in zero_after:
                result = memset(low, 0, count, stream)
                result[0] == 0 or check_result("cuMemsetD8Async", result, size=count, address=low)
        finally:
            if pushed_here:
                _pop_context(self)

    def _zero(self, address: int, size: int) -> None:
        self._call("cuMemsetD8Async", self._cu.cuMemsetD8Async, address, 0, size, self._stream(), size=size, address=address)

    def _copy(self, destination: int, source: int, size: int) -> None:
        self._call(
            "cuMemcpyDtoDAsync",
            self._cu.cuMemcpyDtoDAsync,
            destination,
            source,
            size,
            self._stream(),
            size=size,
            address=destination,
        )

    def _reserve(self, size: int) -> int:
        return int(self._call("cuMemAddressReserve", self._cu.cuMemAddressReserve, size, self.granularity, 0, 0, size=size))

    def _free_reservation(self, address: int, size: int) -> None:
        self._call("cuMemAddressFree", self._cu.cuMemAddressFree, address, size, size=size, address=address)

    def _create(self, size: int) -> Chunk:
        return Chunk(int(self._call("cuMemCreate", self._cu.cuMemCreate, size, self._prop, 0, size=size)), size)

    def _release(self, chunk: Chunk) -> None:
        self._call("cuMemRelease", self._cu.cuMemRelease, chunk.handle, size=chunk.size)

    def _map(self, address: int, chunk: Chunk) -> None:
        self._call("cuMemMap", self._cu.cuMemMap, address, chunk.size, 0, chunk.handle, 0, size=chunk.size, address=address)

    def _set_access(self, address: int, size: int, writable: bool) -> None:
        self._call(
            "cuMemSetAccess", self._cu.cuMemSetAccess, address, size, self._access[writable], 1, size=size, address=address
        )

    def _unmap(self, address: int, size: int) -> None:
        self._call("cuMemUnmap", self._cu.cuMemUnmap, address, size, size=size, address=address)

    def side_stream(self) -> contextlib.AbstractContextManager[None]:
        return torch.cuda.stream(torch.cuda.Stream(self.device))

    def fence(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def wait_for(self, fence: torch.cuda.Event | None) -> None:
        if fence is not None:
            torch.cuda.current_stream(self.device).wait_event(fence)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def capture_graph(self, step, *, warm=None, pool=None):
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # kernels loaded outside the capture
            (step if warm is None else warm)()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            result = step()
        return graph, result

    def is_capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def device_identity(self) -> dict:
        # The UUID, not the index: CUDA_VISIBLE_DEVICES numbers GPUs per process.
        uuid = str(torch.cuda.get_device_properties(self.device).uuid)
        return {"type": self.device.type, "index": self.device.index, "uuid": uuid}

    def memory_info(self) -> tuple[int, int]:
        free, total = self._call("cuMemGetInfo", self._cu.cuMemGetInfo)
        return int(free), int(total)

    def reclaim_cache(self) -> bool:
        return torch_memory.release_cached(self.device)

    def chunk_at(self, address: int) -> Hashable | None:
        cu = _bindings()
        with self._active():
            status, handle = cu.cuMemRetainAllocationHandle(address)
            if status != cu.CUresult.CUDA_SUCCESS:
                return None
            identity = int(handle)
            check_result("cuMemRelease (retained handle)", cu.cuMemRelease(handle), address=address)
        return identity

    def _access_at(self, address: int) -> str | None:
        cu = self._cu
        with self._active():
            # cuMemGetAccess is documented for mapped addresses only: ask
            # first whether anything is mapped, so that an unmapped address
            # reads None, as in chunk_at, rather than as an error.
            if self.chunk_at(address) is None:
                return None
            flags = int(check_result("cuMemGetAccess", cu.cuMemGetAccess(self._location, address), address=address))
        # Flags outside the three a mapping can have fail every comparison.
        return self._access_names.get(flags, f"unknown access flags {flags:#x}")

    def rdma_capable_at(self, address: int) -> bool | None:
        cu = self._cu
        with self._active():
            # As in _access_at: an unmapped address reads None, not an error.
            if self.chunk_at(address) is None:
                return None
            capable = self._call(
                "cuPointerGetAttribute(IS_GPU_DIRECT_RDMA_CAPABLE)",
                cu.cuPointerGetAttribute,
                cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE,
                address,
                address=address,
            )
        return bool(capable)

    def allocation_range_at(self, address: int) -> tuple[int, int] | None:
        with self._active():
            if self.chunk_at(address) is None:
                return None
            # For a VMM mapping cuMemGetAddressRange names the one chunk's
            # mapping that holds the address (the driver API's pointer
            # attributes point to it "to retrieve the size of the mapped
            # region"), while CU_POINTER_ATTRIBUTE_RANGE_START_ADDR and
            # RANGE_SIZE name the whole reservation; UCX sizes the
            # registration of a VMM pointer by the former.
            base, size = self._call("cuMemGetAddressRange", self._cu.cuMemGetAddressRange, address, address=address)
        return int(base), int(size)

    def _export_dma_buf(self, address: int, size: int) -> int:
        # A device whose CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0 answers
        # CUDA_ERROR_NOT_SUPPORTED, raised as a DriverError naming the call.
        cu = self._cu
        fd = self._call(
            "cuMemGetHandleForAddressRange(DMA_BUF_FD)",
            cu.cuMemGetHandleForAddressRange,
            address,
            size,
            cu.CUmemRangeHandleType.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
            0,
            size=size,
            address=address,
        )
        return int(fd)

    def view(self, address: int, size: int) -> torch.Tensor:
        return uint8_view(address, size, self.device)

    def _export_fd(self, chunk: Chunk, writable: bool) -> int:
        # A CUDA shareable handle carries no access mode: `writable` cannot
        # be enforced here, only by the importer's own cuMemSetAccess.
        fd = self._call(
            "cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR)",
            self._cu.cuMemExportToShareableHandle,
            chunk.handle,
            _posix_fd_handle_type(),
            0,
            size=chunk.size,
        )
        return int(fd)

    def _import_fd(self, fd: int, size: int) -> Chunk:
        # cuda-python passes an int osHandle through as the void* the C API
        # expects, which for a POSIX fd is the descriptor's value. The driver
        # takes its own reference: the caller still closes fd.
        handle = self._call(
            f"cuMemImportFromShareableHandle(fd {fd}, POSIX_FILE_DESCRIPTOR)",
            self._cu.cuMemImportFromShareableHandle,
            fd,
            _posix_fd_handle_type(),
            size=size,
        )
        return Chunk(handle=int(handle), size=size)

    def usage_witness(self) -> NvmlUsage:
        return NvmlUsage(self.device.index)

    def describe(self) -> dict[str, str]:
        cu = _bindings()
        version = int(check_result("cuDriverGetVersion", cu.cuDriverGetVersion()))
        return {
            "device": f"{self.device} {torch.cuda.get_device_name(self.device)}",
            "driver": f"CUDA driver API {version // 1000}.{version % 1000 // 10}",
            "granularity": format_granularity(self.granularity),
            "gpudirect_rdma": "on (device supports it with VMM)" if self.gpudirect_rdma else "not supported by this device",
        }


def query_granularity(index: int) -> int:
    """Minimum VMM granularity of CUDA device `index` for this driver's
    chunks, without creating a context (report headers use it in processes
    that run no GPU work)."""
    check_result("cuInit", _bindings().cuInit(0))
    return allocation_granularity(allocation_prop(index))
