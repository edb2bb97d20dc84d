"""Virtual-memory drivers: the only code in extkv that talks to CUDA or Linux.

`driver_for(device)` picks the driver: `cpu` gives the host driver (Linux
virtual memory), `cuda:N` the CUDA driver for device N, and a `Driver`
instance (a host driver with another granularity, a fault injector) is used
as given.
"""

from __future__ import annotations

import functools

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
    "live_chunks",
    "live_reservations",
    "undo_failed",
]
