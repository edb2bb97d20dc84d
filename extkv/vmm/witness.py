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
  sums them over every such file the process still reaches, each file once:
  through an open descriptor (`/proc/self/fd`) or through a mapping whose
  descriptor was closed (`/proc/self/maps`, the file stat'ed through
  `/proc/self/map_files`). A mapping left behind after its chunk was
  released holds the pages as surely as an open descriptor does.
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

#: Name of every host chunk's memfd, as /proc/self/fd and /proc/self/maps show it.
MEMFD_NAME = "extkv-chunk"
_MEMFD_LINK = f"/memfd:{MEMFD_NAME}"
_MEMFD_LINK_BYTES = _MEMFD_LINK.encode()


def open_chunk_fds() -> list[int]:
    """Descriptors of this process that are extkv host chunks."""
    fds = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed between listdir and readlink
            continue
        if target.startswith(_MEMFD_LINK):
            fds.append(int(name))
    return fds


def host_chunk_bytes() -> int:
    """Bytes of pages the kernel holds for the extkv memfds this process
    reaches by descriptor or by mapping, each file counted once."""
    held: dict[tuple[int, int], int] = {}
    for fd in open_chunk_fds():
        try:
            status = os.stat(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        held[(status.st_dev, status.st_ino)] = status.st_blocks * 512
    mapped_extent: dict[tuple[int, int], int] = {}
    for line in _memfd_mapping_lines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or not fields[5].startswith(_MEMFD_LINK_BYTES):
            continue
        major, minor = (int(part, 16) for part in fields[3].split(b":"))
        key = (os.makedev(major, minor), int(fields[4]))
        if key in held:
            continue
        span = fields[0].decode()
        try:
            held[key] = os.stat(f"/proc/self/map_files/{span}").st_blocks * 512
        except OSError:
            # map_files is closed to this process (older kernels, no
            # CAP_SYS_ADMIN): the mapped extent is what it holds at least.
            start, end = (int(part, 16) for part in span.split("-"))
            mapped_extent[key] = mapped_extent.get(key, 0) + end - start
    return sum(held.values()) + sum(mapped_extent.values())


def _memfd_mapping_lines() -> list[bytes]:
    """The lines of /proc/self/maps that name an extkv memfd. The text is
    searched, not split: of some 400 lines (a process that imported torch)
    none or a few are chunks, and splitting and decoding every line cost
    about a fifth of a read."""
    with open("/proc/self/maps", "rb") as maps:
        text = maps.read()
    lines = []
    found = text.find(_MEMFD_LINK_BYTES)
    while found != -1:
        start = text.rfind(b"\n", 0, found) + 1
        end = text.find(b"\n", found)
        end = len(text) if end == -1 else end
        lines.append(text[start:end])
        found = text.find(_MEMFD_LINK_BYTES, end)
    return lines


class MemfdPages:
    """The host driver's witness: the kernel's pages of extkv's memfds."""

    source = "memfd pages (/proc/self/fd and /proc/self/maps, st_blocks)"
    per_process = True

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
