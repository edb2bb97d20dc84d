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
  checks its own (`cuda.check_result`). Everything set up once is the CUDA
  driver's own: its primary context, its chunk properties (pinned device
  memory, exportable as a POSIX fd, what a KV connector needs, so the
  comparison is for the same product), its read-write access descriptor.
  `batch()` is the driver's batch: the context pushed and torch's current
  stream looked up once per store operation, not per call.
- `HostPrimitives`: the host driver itself (memfd + fallocate chunks,
  mmap(MAP_FIXED), mprotect, memset), but for one check: its create makes
  the driver's memfd (`host.create_memfd`) without first reading whether
  the pages fit (`check_room`, which reads /proc/meminfo and each cgroup
  level's limit: 264 us a create on the 2-core CI host, more than a 2 MiB
  memfd's fallocate), a check no raw sequence makes.

Each also probes what its driver can do that decides the fewest calls a
commit takes (`probe_partial_map`, `probe_partial_access`), on real memory,
and says what the driver answered; each probe's reservation and chunk are
taken step by step and given back newest first, whatever the probe found.
`clock_note()` says what a report states about the device's clocks.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator, Union

import torch

from ..errors import DriverError
from . import driver_for
from .base import Chunk, Driver
from .cuda import CudaDriver, check_result
from .host import MAP_FIXED, MAP_SHARED, PROT_NONE, HostDriver, create_memfd
from .witness import nvml, nvml_handle


class CudaPrimitives:
    """CUDA's VMM calls through cuda-python, on the device of `driver`."""

    def __init__(self, driver: CudaDriver):
        self._driver = driver
        self._cu = driver.bindings
        self.device = driver.device
        self.granularity = driver.granularity
        self._prop = driver.chunk_properties
        self._access = driver.read_write_access
        self._stream = driver.current_stream()

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        with self._driver.batch():
            # torch's current stream, as the driver's batch looked it up once:
            # asking torch per call costs microseconds that a 256-segment
            # commit would pay 256 times.
            self._stream = self._driver.current_stream()
            yield

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
        self._driver.synchronize()

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

    def clock_note(self) -> str:
        """Clocks are never pinned by extkv bench (changing a device's
        settings is the machine owner's call); the clocks read now where
        NVML can read them."""
        try:
            handle = nvml_handle(self.device.index)
            api = nvml()
            sm, memory = (api.nvmlDeviceGetClockInfo(handle, kind) for kind in (api.NVML_CLOCK_SM, api.NVML_CLOCK_MEM))
            top = api.nvmlDeviceGetMaxClockInfo(handle, api.NVML_CLOCK_SM)
            reading = f"SM clock {sm} MHz of {top} MHz max, memory clock {memory} MHz"
        except Exception as error:
            reading = f"NVML could not read the clocks ({type(error).__name__}: {error})"
        return f"GPU clocks not pinned (extkv bench changes no device settings); {reading}"


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

    def clock_note(self) -> str:
        return "host CPU: frequency scaling left as the machine has it"


#: What a raw sequence calls: the timed primitives, or any vmm driver.
Primitives = Union[CudaPrimitives, HostPrimitives, Driver]


@contextlib.contextmanager
def _two_granule_chunk(prims: Primitives) -> Iterator[tuple[int, Chunk]]:
    """A two-granule reservation and a two-granule chunk, not mapped, for a
    probe: each step's undo is registered as it succeeds, and all of them
    run newest first when the probe is done or fails."""
    granule = prims.granularity
    with prims.batch(), contextlib.ExitStack() as undo:
        address = prims.reserve(2 * granule)
        undo.callback(prims.free_reservation, address, 2 * granule)
        chunk = prims.create(2 * granule)
        undo.callback(prims.release, chunk)
        yield address, chunk


@functools.lru_cache(maxsize=None)
def primitives_for(device: torch.device | str) -> Primitives:
    """The raw calls for `device`: the host's for cpu, cuda-python's on the
    CUDA driver's context for cuda:N."""
    driver = driver_for(device)
    if isinstance(driver, CudaDriver):
        return CudaPrimitives(driver)
    if isinstance(driver, HostDriver):
        return HostPrimitives(driver.granularity)
    raise ValueError(f"no raw baseline for device {device}; expected cpu or cuda:N")
