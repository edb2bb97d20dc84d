"""Whether the memory a child process held came back once it is gone.

Theory of operation
-------------------
On the host a chunk is a memfd, and the kernel frees its pages once no
process reaches it by descriptor or mapping: `host_memfds_of` lists the
extkv memfds a process reaches (from /proc/PID/fd and /proc/PID/maps), and
an empty `processes_reaching` is the memory come back. On a GPU, NVML
counts what each process holds and what the whole device uses
(`nvml_process_used`, `nvml_used`, by the GPU's UUID, since NVML numbers
GPUs physically and CUDA_VISIBLE_DEVICES renumbers them);
`wait_for_gpu_memory` waits for the device's used memory to return to what
it was before a child ran.
"""

from __future__ import annotations

import functools
import os
import time

import torch

from ... import vmm
from ..models import LeakFound


def host_memfds_of(pid: int) -> dict[tuple[int, int], int]:
    """extkv chunks (memfds) process `pid` reaches by descriptor or mapping:
    (device, inode) -> bytes the kernel holds for each (0 where only a
    mapping reaches it)."""
    held: dict[tuple[int, int], int] = {}
    link = f"/memfd:{vmm.MEMFD_NAME}"
    for fd in _listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(link):
                status = os.stat(f"/proc/{pid}/fd/{fd}")
                held[(status.st_dev, status.st_ino)] = status.st_blocks * 512
        except OSError:
            continue
    for key in _mapped_memfds(pid, link):
        held.setdefault(key, 0)
    return held


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:  # the process is gone
        return []


def _mapped_memfds(pid: int, link: str) -> set[tuple[int, int]]:
    found = set()
    try:
        with open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith(link):
                    major, minor = (int(part, 16) for part in fields[3].split(":"))
                    found.add((os.makedev(major, minor), int(fields[4])))
    except OSError:
        pass
    return found


def processes_reaching(memfds: set[tuple[int, int]]) -> dict[int, int]:
    """Processes that still reach any of `memfds` ((device, inode) pairs), by
    descriptor or mapping: pid -> how many. The kernel frees a memfd's pages
    once nothing reaches it, so an empty answer is the memory come back."""
    reaching: dict[int, int] = {}
    for name in _listdir("/proc"):
        if name.isdigit():
            count = len(memfds & set(host_memfds_of(int(name))))
            if count:
                reaching[int(name)] = count
    return reaching


@functools.lru_cache(maxsize=None)
def nvml_handle(device: torch.device):
    """NVML's handle for a CUDA device (by UUID: NVML numbers GPUs physically,
    CUDA_VISIBLE_DEVICES renumbers them)."""
    import pynvml

    pynvml.nvmlInit()
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")


def nvml_used(device: torch.device) -> int:
    """Memory in use on the whole GPU, as NVML reports it."""
    import pynvml

    return int(pynvml.nvmlDeviceGetMemoryInfo(nvml_handle(device)).used)


def nvml_process_used(device: torch.device, pid: int) -> int | None:
    """What NVML counts for process `pid` on the GPU; None when it lists no
    such process (gone, or hidden by a PID namespace)."""
    import pynvml

    for process in pynvml.nvmlDeviceGetComputeRunningProcesses(nvml_handle(device)):
        if process.pid == pid and isinstance(process.usedGpuMemory, int):
            return int(process.usedGpuMemory)
    return None


#: What a GPU's used memory may differ from before a child ran, once it is
#: gone: this process's own CUDA context grows a little as it loads kernels.
GPU_RETURN_TOLERANCE = 64 << 20


def wait_for_gpu_memory(device: torch.device, before: int, what: str, timeout_s: float = 30.0) -> None:
    """NVML's used memory of the GPU returns to `before` (within
    GPU_RETURN_TOLERANCE) within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (used := nvml_used(device)) > before + GPU_RETURN_TOLERANCE:
        if time.monotonic() > deadline:
            raise LeakFound(f"{what}: NVML reads {used} bytes used on {device}, {used - before} more than before, after {timeout_s} s")
        time.sleep(0.1)
