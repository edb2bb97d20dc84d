"""Physical memory usage, read from outside the library.

Theory of operation
-------------------
extkv's own `physical_bytes` is bookkeeping; a `UsageProbe` is the check on
it. It reads the witness the device's driver names (`Driver.usage_witness`,
extkv.vmm.witness: the kernel's pages of extkv's memfds on the host, NVML's
reading on a GPU), so a chunk extkv forgot to release, or a mapping it
thinks it dropped, shows up as a difference; this module never asks which
kind of device it reads. `read_outside_torch` subtracts what torch's caching
allocator holds, so tensors a caller allocates through torch do not count.

Readings are absolute; compare them against a baseline taken before the work.
"""

from __future__ import annotations

import torch

from .vmm import driver_for, torch_memory
from .vmm.witness import host_chunk_bytes, open_chunk_fds

__all__ = ["UsageProbe", "host_chunk_bytes", "open_chunk_fds"]


class UsageProbe:
    """Reads physical memory in use on one device, from outside extkv."""

    def __init__(self, device: torch.device | str):
        # The driver first: a GPU's witness lists a process only once it
        # holds a context there, and making it here keeps its cost out of
        # every later reading.
        driver = driver_for(device)
        self.device = driver.device
        self._witness = driver.usage_witness()
        self.source: str = self._witness.source

    @property
    def lazy_growth_step(self) -> int:
        """Bytes by which a reading may grow with nothing allocated, once per
        process and kernel, as the device loads code (0: never)."""
        return self._witness.lazy_growth_step

    @property
    def per_process(self) -> bool:
        """Whether a reading counts this process alone."""
        return self._witness.per_process

    def read(self) -> int:
        """Bytes in use now."""
        return self._witness.read()

    def read_outside_torch(self) -> int:
        """Bytes in use now less what torch's caching allocator holds, so that
        tensors a caller allocates through torch do not count."""
        return self.read() - torch_memory.reserved(self.device)

    def __repr__(self) -> str:
        return f"UsageProbe({self.device}, source={self.source!r})"
