"""The outside witness: what the kernel or the GPU says a driver's memory holds.

Theory of operation
-------------------
extkv's own `physical_bytes` is bookkeeping; a witness is the check on it.
It asks the operating system or the GPU's management library what is really
held, so a chunk extkv forgot to release, or a mapping it thinks it dropped,
shows up as a difference. Each driver names its witness
(`Driver.usage_witness()`), so nothing above extkv.vmm asks which kind of
device it runs on.

- Host (`MemfdPages`): every chunk is a memfd named `extkv-chunk`; the
  kernel reports the pages a file really holds (`st_blocks`). The witness
  sums them over every such file the process still reaches, each file once
  (extkv.memfds, which reads any process's, torch-free, for the budget
  daemon too).
- CUDA (`NvmlUsage`): NVML's per-process used memory for this process on
  the device. Where NVML cannot list this process (a PID namespace hides it,
  or the driver does not report per-process usage), it falls back to the
  device-wide used memory and says so in `source`; that reading includes
  other processes.

Readings are absolute; compare them against a baseline taken before the work.
"""

from __future__ import annotations

import functools
import os

import torch

from ..memfds import MEMFD_NAME, host_chunk_bytes, open_chunk_fds

__all__ = ["MEMFD_NAME", "MemfdPages", "NvmlUsage", "host_chunk_bytes", "nvml", "nvml_handle", "open_chunk_fds"]

class MemfdPages:
    """The host driver's witness: the kernel's pages of extkv's memfds."""

    source = "memfd pages (/proc/self/fd and /proc/self/maps, st_blocks)"
    per_process = True
    #: Nothing but chunks counts here, so the reading never grows by itself.
    lazy_growth_step = 0

    def read(self) -> int:
        return host_chunk_bytes()


@functools.lru_cache(maxsize=None)
def nvml():
    """pynvml, initialized once per process."""
    import pynvml

    pynvml.nvmlInit()
    return pynvml


def nvml_handle(index: int):
    """NVML's handle of CUDA device `index`. NVML numbers GPUs physically;
    CUDA_VISIBLE_DEVICES renumbers them for CUDA. The UUID is the same in
    both worlds."""
    uuid = str(torch.cuda.get_device_properties(index).uuid)
    if not uuid.startswith("GPU-"):
        uuid = f"GPU-{uuid}"
    return nvml().nvmlDeviceGetHandleByUUID(uuid)


class NvmlUsage:
    """The CUDA driver's witness: NVML's reading for this process on one GPU."""

    #: The reading includes the context, which grows by itself in steps of
    #: this many bytes as CUDA loads a kernel's module at its first launch in
    #: the process: 784334848 -> 786432000 bytes on an H100 (driver
    #: 580.159.04), in the test that first ran a GEMM of a new shape.
    lazy_growth_step = 2 << 20

    def __init__(self, index: int):
        self._handle = nvml_handle(index)
        self.per_process = self._process_usage() is not None
        self.source = (
            "NVML per-process used memory" if self.per_process
            else "NVML device-wide used memory (this process is not in NVML's process list)"
        )

    def _process_usage(self) -> int | None:
        api = nvml()
        try:
            processes = api.nvmlDeviceGetComputeRunningProcesses(self._handle)
        except api.NVMLError:
            return None
        for process in processes:
            if process.pid == os.getpid() and isinstance(process.usedGpuMemory, int):
                return process.usedGpuMemory
        return None

    def read(self) -> int:
        if self.per_process:
            # A process with no CUDA work left may drop out of the list.
            used = self._process_usage()
            return 0 if used is None else used
        return nvml().nvmlDeviceGetMemoryInfo(self._handle).used
