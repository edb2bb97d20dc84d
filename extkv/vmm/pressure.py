"""Memory held outside extkv: what a pressure process takes from a device.

Theory of operation
-------------------
A stress run's pressure process (extkv.testing.stress.pressure) holds real
memory of a device so that extkv meets a device that is nearly full. What
real memory is, and how it goes back, is the device's business, so it lives
here beside the drivers; `pressure_memory(device)` gives it:

- `HostPressure`: memfds of `fallocate`d pages (`host.create_memfd`, as a
  chunk is made, so the kernel really gives them), named
  PRESSURE_MEMFD_NAME rather than extkv's chunk name, so that no witness or
  probe counts them as extkv's; closing a descriptor gives its pages back.
- `GpuPressure`: torch allocations on the GPU, through torch's caching
  allocator as an engine's own tensors are; dropping them and emptying the
  allocator's cache gives the memory back to the driver.

Each states the pieces it is taken in (`hold_piece` for a hold, and from
`largest_piece` halved down to `smallest_piece` for a fill): small enough to
leave little unused when the device is nearly full, large enough that a
fill of a 141 GB H200 takes tens of allocations rather than hundreds.
`take(size)` returns a piece, or None where the device has no more.
"""

from __future__ import annotations

import os

import torch

from ..errors import OutOfMemoryError
from . import driver_for
from .cuda import CudaDriver
from .host import HostDriver, create_memfd

#: Name of the pressure process's memfds (not extkv's, so no probe counts them).
PRESSURE_MEMFD_NAME = "extkv-stress-pressure"


class HostPressure:
    """Pages of memfds: a 64 MiB piece is 32 granules of the host driver."""

    hold_piece = smallest_piece = largest_piece = 64 << 20

    def take(self, size: int) -> int | None:
        try:
            return create_memfd(size, PRESSURE_MEMFD_NAME)
        except OutOfMemoryError:
            return None

    def give_back(self, pieces: list) -> None:
        """Close every piece's descriptor; `pieces` is left empty."""
        while pieces:
            os.close(pieces.pop())


class GpuPressure:
    """Torch allocations on one GPU. A fill's pieces are at most 8 GiB:
    on the H200, a fill that asked for the whole gap at once (135.29 GiB of
    139.29 free) was refused, and one that went on with halved pieces after
    that refusal was not given back by a release (the device still read
    4 GiB free 3 s later); pieces of at most 8 GiB come back."""

    hold_piece = smallest_piece = 256 << 20
    largest_piece = 8 << 30

    def __init__(self, device: torch.device):
        self.device = device

    def take(self, size: int) -> torch.Tensor | None:
        try:
            return torch.empty(size, dtype=torch.uint8, device=self.device)
        except torch.OutOfMemoryError:
            return None

    def give_back(self, pieces: list) -> None:
        """Drop every piece and return the allocator's cache to the driver;
        `pieces` is left empty."""
        pieces.clear()
        torch.cuda.empty_cache()


def pressure_memory(device: torch.device | str) -> HostPressure | GpuPressure:
    """How real memory of `device` is held from outside extkv."""
    driver = driver_for(device)
    if isinstance(driver, CudaDriver):
        return GpuPressure(driver.device)
    if isinstance(driver, HostDriver):
        return HostPressure()
    raise ValueError(f"no pressure memory for device {device}; expected cpu or cuda:N")
