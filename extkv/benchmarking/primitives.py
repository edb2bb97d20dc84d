"""The raw calls of each device: what a raw driver sequence is made of.

Theory of operation
-------------------
A raw sequence (extkv.benchmarking.raw) does a commit's work with the
driver's calls and nothing else: no bookkeeping, no checks but each call's
status. It makes its calls through the subset of a vmm `Driver`'s public
API that such work needs: `batch()`, `reserve`, `free_reservation`,
`create` (a `Chunk`), `map(address, chunk)`, `set_access`, `zero`, `copy`,
`unmap`, `release(chunk)`, `synchronize`. So any vmm driver runs it as well
(a `PoisoningDriver`, whose every new chunk is filled with a pattern, proves
in the tests that a sequence zeroes what it claims); `primitives_for(device)`
gives the calls the benchmarks time:

- `CudaPrimitives`: one cuda-python call per step (cuMemAddressReserve,
  cuMemCreate, cuMemMap, cuMemSetAccess, cuMemsetD8Async,
  cuMemcpyDtoDAsync, cuMemUnmap, cuMemRelease), checked as the CUDA driver
  checks its own (`vmm.cuda.check_result`), with chunks of the CUDA
  driver's properties (`vmm.cuda.allocation_prop`: pinned device memory,
  exportable as a POSIX fd, what a KV connector needs, so the comparison is
  for the same product). `batch()` pushes the device's primary context and
  reads torch's current stream once per store operation rather than per
  call.
- `HostPrimitives`: the host driver itself (memfd + fallocate chunks,
  mmap(MAP_FIXED), mprotect, memset), but for one check: its create makes
  the driver's memfd (`vmm.host.create_memfd`) without first reading
  whether the pages fit (`check_room`, which reads /proc/meminfo and each
  cgroup level's limit: 264 us a create on the 2-core CI host, more than a
  2 MiB memfd's fallocate), a check no raw sequence makes.

Each also probes what its driver can do that decides the fewest calls a
commit takes (`probe_partial_map`, `probe_partial_access`), on real memory,
and says what the driver answered. This module and the stores are the
benchmarks' only device-specific code (CUDA, Linux, torch's CUDA
allocator, CUDA graphs); the engine never asks which device it runs on.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator, Union

import torch

from ..errors import DriverError
from ..vmm.base import Chunk, Driver
from ..vmm.cuda import allocation_granularity, allocation_prop, check_result
from ..vmm.host import MAP_FIXED, MAP_SHARED, PROT_NONE, HostDriver, create_memfd


class CudaPrimitives:
    """CUDA's VMM calls through cuda-python, on one device."""

    def __init__(self, device: torch.device):
        from cuda.bindings import driver as cu

        self._cu = cu
        index = torch.cuda.current_device() if device.index is None else device.index
        self.device = torch.device("cuda", index)
        torch.cuda.init()  # torch owns the primary context; share it
        check_result("cuInit", cu.cuInit(0))
        cu_device = check_result("cuDeviceGet", cu.cuDeviceGet(index))
        self._context = check_result("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(cu_device))
        self._prop = allocation_prop(index)
        self.granularity = allocation_granularity(self._prop)
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = index
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = [access]
        self._stream = cu.CUstream(torch.cuda.current_stream(self.device).cuda_stream)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        cu = self._cu
        check_result("cuCtxPushCurrent", cu.cuCtxPushCurrent(self._context))
        # torch's current stream, read once per batch: asking torch per call
        # costs microseconds that a 256-segment commit would pay 256 times.
        self._stream = cu.CUstream(torch.cuda.current_stream(self.device).cuda_stream)
        try:
            yield
        finally:
            check_result("cuCtxPopCurrent", cu.cuCtxPopCurrent())

    def reserve(self, size: int) -> int:
        return int(check_result("cuMemAddressReserve", self._cu.cuMemAddressReserve(size, self.granularity, 0, 0), size=size))

    def free_reservation(self, address: int, size: int) -> None:
        check_result("cuMemAddressFree", self._cu.cuMemAddressFree(address, size), size=size, address=address)

    def create(self, size: int) -> Chunk:
        # The handle as the bindings return it: they map and release it so.
        return Chunk(check_result("cuMemCreate", self._cu.cuMemCreate(size, self._prop, 0), size=size), size)

    def map(self, address: int, chunk: Chunk) -> None:
        check_result("cuMemMap", self._cu.cuMemMap(address, chunk.size, 0, chunk.handle, 0), size=chunk.size,
                     address=address)

    def set_access(self, address: int, size: int) -> None:
        check_result("cuMemSetAccess", self._cu.cuMemSetAccess(address, size, self._access, 1), size=size, address=address)

    def zero(self, address: int, size: int) -> None:
        check_result(
            "cuMemsetD8Async", self._cu.cuMemsetD8Async(address, 0, size, self._stream), size=size, address=address
        )

    def copy(self, destination: int, source: int, size: int) -> None:
        check_result(
            "cuMemcpyDtoDAsync",
            self._cu.cuMemcpyDtoDAsync(destination, source, size, self._stream),
            size=size,
            address=destination,
        )

    def unmap(self, address: int, size: int) -> None:
        check_result("cuMemUnmap", self._cu.cuMemUnmap(address, size), size=size, address=address)

    def release(self, chunk: Chunk) -> None:
        check_result("cuMemRelease", self._cu.cuMemRelease(chunk.handle))

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def probe_partial_map(self) -> tuple[bool | None, str]:
        """Whether this driver maps part of a chunk (one granule of a
        two-granule chunk, from an offset), tried on real memory, and what
        it answered. Where it cannot, every range a commit adds needs a
        chunk of its own: the fewest driver calls a geometry allows are one
        create per segment per commit."""
        cu, granule = self._cu, self.granularity
        with _two_granule_chunk(self) as (address, chunk):
            status = cu.cuMemMap(address, granule, granule, chunk.handle, 0)[0]
            if status == cu.CUresult.CUDA_SUCCESS:
                self.unmap(address, granule)
        return status == cu.CUresult.CUDA_SUCCESS, f"cuMemMap of a two-granule chunk's second granule: {status.name}"

    def probe_partial_access(self) -> tuple[bool | None, str]:
        """Whether this driver grants access over part of a mapped chunk (the
        second granule of a two-granule chunk mapped whole), tried on real
        memory, and what it answered. Where it cannot, no byte of a chunk
        can be zeroed before all of it is created, mapped and granted: a
        segment committed in one chunk starts zeroing only then."""
        cu, granule = self._cu, self.granularity
        with _two_granule_chunk(self) as (address, chunk):
            self.map(address, chunk)
            try:
                status = cu.cuMemSetAccess(address + granule, granule, self._access, 1)[0]
            finally:
                self.unmap(address, 2 * granule)
        return (status == cu.CUresult.CUDA_SUCCESS,
                f"cuMemSetAccess of the second granule of a two-granule chunk mapped whole: {status.name}")


class HostPrimitives(HostDriver):
    """The host driver's own steps, its create without the room check."""

    def _create(self, size: int) -> Chunk:
        return Chunk(handle=create_memfd(size), size=size)

    def probe_partial_map(self) -> tuple[bool | None, str]:
        """As `CudaPrimitives.probe_partial_map`, with mmap at an offset of the memfd."""
        granule = self.granularity
        with _two_granule_chunk(self) as (address, chunk):
            try:
                self._mmap("mmap(MAP_FIXED, memfd, offset)", address, granule, PROT_NONE, MAP_SHARED | MAP_FIXED,
                           chunk.handle, granule)
            except DriverError as error:
                return False, f"mmap of a two-granule memfd's second granule: {error}"
        return True, "mmap of a two-granule memfd's second granule: mapped"

    def probe_partial_access(self) -> tuple[bool | None, str]:
        """As `CudaPrimitives.probe_partial_access`, with mprotect."""
        granule = self.granularity
        with _two_granule_chunk(self) as (address, chunk):
            self.map(address, chunk)
            try:
                self.set_access(address + granule, granule)
            except DriverError as error:
                return False, f"mprotect of the second granule of a two-granule memfd mapped whole: {error}"
            finally:
                self.unmap(address, 2 * granule)
        return True, "mprotect of the second granule of a two-granule memfd mapped whole: granted"


#: What a raw sequence calls: the timed primitives, or any vmm driver.
Primitives = Union[CudaPrimitives, Driver]


@contextlib.contextmanager
def _two_granule_chunk(prims: Primitives) -> Iterator[tuple[int, Chunk]]:
    """A two-granule reservation and a two-granule chunk, not mapped, for a
    probe; the chunk is released and the reservation freed after."""
    granule = prims.granularity
    with prims.batch():
        address = prims.reserve(2 * granule)
        try:
            chunk = prims.create(2 * granule)
            try:
                yield address, chunk
            finally:
                prims.release(chunk)
        finally:
            prims.free_reservation(address, 2 * granule)


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
