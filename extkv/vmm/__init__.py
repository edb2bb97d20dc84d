"""Virtual-memory drivers: the only code in extkv that talks to CUDA or Linux.

`driver_for(device)` picks the driver: `cpu` gives the host driver (Linux
virtual memory), `cuda:N` the CUDA driver for device N, and a `Driver`
instance (a host driver with another granularity, a fault injector) is used
as given. `driver_for_import` picks the one that imports what another
process's driver exported, from the kind, granularity and device identity
that driver announced; `finest_driver_for` the driver whose granule is the
smallest the device's memory allows (one page on the host). Nothing above
this package asks which kind of device it runs on: what differs between
devices is a `Driver` method or property.
"""

from __future__ import annotations

import functools
import os
from typing import Sequence

import torch

from .base import Chunk, Driver, live_chunks, live_reservations
from .faults import FAULTABLE_STEPS, FaultInjectingDriver
from .host import DEFAULT_HOST_GRANULARITY, HostDriver
from .poison import PoisoningDriver
from .transaction import Transaction, UnreleasedChunks, undo_failed
from .witness import MEMFD_NAME



def cuda_usable() -> bool:
    """Whether the CUDA driver can run here: torch sees a GPU and cuda-python imports."""
    if not torch.cuda.is_available():
        return False
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def _default_host_driver() -> HostDriver:
    return HostDriver()


@functools.lru_cache(maxsize=None)
def _cuda_driver(index: int) -> Driver:
    from .cuda import CudaDriver

    return CudaDriver(torch.device("cuda", index))


def canonical_device(device: torch.device | str | int) -> torch.device:
    """`device` with its index made explicit ("cuda" is the current GPU), so
    that two names of one device compare equal."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def device_memory_info(device: torch.device | str | int | Driver | None = None) -> tuple[int, int]:
    """(free, total) bytes of `device`'s memory, as its driver reports them."""
    return driver_for(device).memory_info()


def driver_for(device: torch.device | str | int | Driver | None = None) -> Driver:
    """The driver for `device`. None means the current CUDA device when CUDA is
    usable, else the host."""
    if isinstance(device, Driver):
        return device
    if device is None:
        device = torch.device("cuda") if cuda_usable() else torch.device("cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device {device!r} is not a torch device, index or Driver: {error}") from None
    if device.type == "cpu":
        return _default_host_driver()
    if device.type == "cuda":
        if not cuda_usable():
            raise ValueError(
                f"device {device} needs CUDA, but torch sees no GPU or cuda-python (cuda-bindings) is missing"
            )
        index = torch.cuda.current_device() if device.index is None else device.index
        return _cuda_driver(index)
    raise ValueError(f"device {device} is not supported: expected cpu (host driver) or cuda:N")


def reduction_device(backend: str, reduces: Sequence[str], device: torch.device | str | None = None) -> torch.device:
    """The device of the tensor that collective `backend`, which reduces
    tensors of the device types `reduces`, takes: the host wherever it
    reduces host tensors (no device synchronization then); otherwise
    `device`, which must be a GPU (None: the current one)."""
    if "cpu" in reduces:
        return torch.device("cpu")
    if "cuda" not in reduces:
        raise ValueError(f"backend {backend!r} reduces neither CPU nor CUDA tensors; extkv cannot reduce on it")
    if device is None:
        if not torch.cuda.is_available():
            raise ValueError(f"backend {backend!r} reduces CUDA tensors only, but torch sees no CUDA device")
        return torch.device("cuda", torch.cuda.current_device())
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device {device!r} is not a torch device: {error}") from None
    if device.type != "cuda":
        raise ValueError(f"backend {backend!r} reduces CUDA tensors only; device {device} cannot carry the reduction")
    if device.index is None:
        # NCCL binds a communicator to one device: name it, as the current one.
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def finest_driver_for(device: torch.device | str | int) -> Driver:
    """The driver of `device` at the finest granule its memory allows: on
    the host a driver of one page (the default host driver's 2 MiB stands
    in for a GPU's granule), on a GPU its own, whose granule is CUDA's
    minimum already. For work whose sizes are counted in granules, so that
    the host's run stays small while a GPU's scales with its granule."""
    device = canonical_device(device)
    if device.type == "cpu":
        return HostDriver(os.sysconf("SC_PAGE_SIZE"))
    return driver_for(device)


def driver_for_import(kind: str, granularity: int, device: dict, driver: Driver | None = None) -> Driver:
    """The driver that imports chunks another process's driver exported:
    that driver's `kind` ("host" or "cuda") and `granularity`, on the device
    it described (`Driver.device_identity()`). `driver` is used where given,
    if it matches; otherwise this process's driver of that device."""
    if driver is not None:
        if driver.kind != kind or driver.granularity != granularity:
            raise ValueError(
                f"driver {driver!r} cannot import chunks of a {kind} driver with granularity {granularity}"
            )
        return driver
    if kind == "host":
        default = _default_host_driver()
        # Chunk sizes are multiples of the exporter's granularity, not
        # necessarily of this process's default.
        return default if default.granularity == granularity else HostDriver(granularity)
    if kind == "cuda":
        driver = driver_for(_local_cuda_device(device))
        if driver.granularity != granularity:
            raise ValueError(
                f"exporter's granularity {granularity} differs from {driver.granularity} on {driver.device}"
            )
        return driver
    raise ValueError(f"header names driver kind {kind!r}; expected 'host' or 'cuda'")


def _local_cuda_device(device: dict) -> torch.device:
    """This process's index for the exporter's GPU."""
    if not cuda_usable():
        raise ValueError("the segments live on a GPU, but this process cannot use CUDA (no GPU or no cuda-python)")
    uuid = device.get("uuid")
    if uuid is None:
        return torch.device("cuda", device.get("index") or 0)
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return torch.device("cuda", index)
    raise ValueError(
        f"the exporter's GPU {uuid} is not visible to this process "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
    )


__all__ = [
    "Chunk",
    "DEFAULT_HOST_GRANULARITY",
    "Driver",
    "FAULTABLE_STEPS",
    "FaultInjectingDriver",
    "HostDriver",
    "MEMFD_NAME",
    "Transaction",
    "UnreleasedChunks",
    "canonical_device",
    "cuda_usable",
    "device_memory_info",
    "driver_for",
    "driver_for_import",
    "finest_driver_for",
    "live_chunks",
    "live_reservations",
    "reduction_device",
    "undo_failed",
]
