"""Whether the memory a child process held came back once it is gone.

Theory of operation
-------------------
On the host a chunk is a memfd, and the kernel frees its pages once no
process reaches it by descriptor or mapping: `host_memfds_of` lists the
extkv memfds a process reaches (from /proc/PID/fd and /proc/PID/maps), and
an empty `processes_reaching` is the memory come back. On a GPU, NVML
counts what each process holds (`nvml_process_used`, by the GPU's UUID,
since NVML numbers GPUs physically and CUDA_VISIBLE_DEVICES renumbers
them): `wait_for_process_gpu_memory` waits for one of the test's processes
to drop out of NVML's list (the driver tore its context down, and all it
held with it) or to fall back to what it held before. Only the test's own
processes are read: the whole device's used memory moves with every other
job on it, so comparing it before and after says nothing about extkv.
Where NVML lists none of this machine's processes (a PID namespace hides
them), there is nothing per process to read, and the caller says so.
"""

from __future__ import annotations

import os
import time

import torch

from ... import vmm
from ...vmm.witness import nvml, nvml_handle
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


def nvml_process_used(device: torch.device, pid: int) -> int | None:
    """What NVML counts for process `pid` on the GPU; None when it lists no
    such process (gone, or hidden by a PID namespace)."""
    handle = nvml_handle(vmm.driver_for(device).device.index)
    for process in nvml().nvmlDeviceGetComputeRunningProcesses(handle):
        if process.pid == pid and isinstance(process.usedGpuMemory, int):
            return int(process.usedGpuMemory)
    return None


#: What the test's own process may hold on a GPU past what it held before a
#: child ran, once the child is gone: its CUDA context grows a little as it
#: loads kernels.
GPU_RETURN_TOLERANCE = 64 << 20


def wait_for_process_gpu_memory(device: torch.device, pid: int, most: int | None, what: str, timeout_s: float) -> None:
    """NVML's reading of process `pid` on the GPU falls to `most` bytes or
    below, or (`most` None) NVML no longer lists the process, within
    `timeout_s`: the driver tears a context down in its own time, longer on
    a busy machine, so the wait is a net, not a bound on that time."""
    deadline = time.monotonic() + timeout_s
    while (used := nvml_process_used(device, pid)) is not None and (most is None or used > most):
        if time.monotonic() > deadline:
            wanted = "no longer listed" if most is None else f"at most {most} bytes"
            raise LeakFound(f"{what}: NVML still reads {used} bytes for process {pid} on {device} after {timeout_s} s, expected {wanted}")
        time.sleep(0.1)
