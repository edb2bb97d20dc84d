"""The device a budget daemon serves: its key, its memory, and what each engine holds there, read from outside.

Theory of operation
-------------------
A daemon never asks an engine what it holds when the answer decides
anything: it reads it from outside the engine, as the kernel or the GPU
counts it, so an engine that dies or claims a release it did not make
cannot move the ledger by its word alone.

- Host (`HostDevice`): key "host"; total memory is /proc/meminfo's
  MemTotal; a process holds the pages of the extkv memfds it reaches
  (extkv.memfds, from /proc/PID). Those die with the process, so once its
  pidfd says it exited, it holds nothing (`freed_at_exit`), whatever
  process later takes its pid. The reading is of chunks alone
  (`reads_chunks_only`), so it also decides a live engine's claimed
  releases; a process that maps another's exported chunks reads them as
  its own, so there it errs toward counting too much.
- GPU (`NvmlDevice`): key the GPU's UUID, which names it in every process
  whatever CUDA_VISIBLE_DEVICES renumbers; total memory and per-process
  used memory are NVML's. NVML only: the daemon creates no CUDA context,
  so it costs no device memory and no CUDA start-up. A GPU's memory goes
  when the driver tears the process's context down, which it does in its
  own time after the exit: the reading decides, not the exit. NVML's
  per-process reading counts all the process holds on the GPU (its CUDA
  context, torch's allocations), not the KV cache alone: it decides at the
  lease's end, never a live engine's claimed release.

Each also reads several processes in one call (`read_pieces`), each
process's reading in pieces that keep their identity from one reading to
the next, so that readings taken apart in time can be matched (the budget
stress's outside sampler, extkv.testing.stress.budget_sampler): on the
host each memfd is a piece, keyed by its file, the processes read one
after another; NVML reads no finer than a process, so there the piece is
the process's whole reading, keyed by its pid, and all of them come from
one listing of the GPU's processes (of each kind, compute and graphics).

`open_device("host" | "cuda:N" | "GPU-<uuid>")` picks one. `cuda:N` counts
as CUDA does under CUDA_VISIBLE_DEVICES (an entry of it a UUID or an NVML
index) and in PCI bus order otherwise (CUDA_DEVICE_ORDER=PCI_BUS_ID, as
NVML counts); on a machine of unlike GPUs, CUDA's default order may differ,
so there name the GPU by UUID.
"""

from __future__ import annotations

import os
import re
from typing import Hashable, Iterable

from ..memfds import host_chunks

#: What a process holds, read from outside, piece by piece: bytes by a key
#: that names the same piece in every reading (see the theory).
Pieces = dict[Hashable, int]


def _total(pieces: Pieces | None) -> int | None:
    return None if pieces is None else sum(pieces.values())


class HostDevice:
    key = "host"
    freed_at_exit = True
    reads_chunks_only = True

    def __init__(self):
        self.name = "host"
        self.total_bytes = _mem_total()

    def read_process(self, pid: int) -> int | None:
        """Bytes of extkv memfds process `pid` reaches; 0 for a process that
        is gone; None where the kernel will not say (another uid's, or an
        undumpable process)."""
        return _total(self.read_pieces([pid])[pid])

    def read_pieces(self, pids: Iterable[int]) -> dict[int, Pieces | None]:
        """Per process of `pids`, read one after another: the extkv memfds
        it reaches, by file ((device, inode), extkv.memfds.host_chunks); {}
        for a process that is gone; None where the kernel will not say."""
        pieces: dict[int, Pieces | None] = {}
        for pid in pids:
            try:
                pieces[pid] = host_chunks(pid)
            except (FileNotFoundError, ProcessLookupError):
                pieces[pid] = {}
            except PermissionError:
                pieces[pid] = None
        return pieces

    def __repr__(self) -> str:
        return "HostDevice()"


def _mem_total() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemTotal line")


class NvmlDevice:
    freed_at_exit = False
    reads_chunks_only = False

    def __init__(self, handle, api):
        self._handle = handle
        self._api = api
        uuid = api.nvmlDeviceGetUUID(handle)
        self.key = uuid.decode() if isinstance(uuid, bytes) else uuid
        name = api.nvmlDeviceGetName(handle)
        self.name = f"{name.decode() if isinstance(name, bytes) else name} {self.key}"
        self.total_bytes = int(api.nvmlDeviceGetMemoryInfo(handle).total)

    def read_process(self, pid: int) -> int | None:
        """NVML's used memory of process `pid` on this GPU (compute and
        graphics), 0 where NVML lists no such process; None where NVML
        cannot list processes, or does not count their memory."""
        return _total(self.read_pieces([pid])[pid])

    def read_pieces(self, pids: Iterable[int]) -> dict[int, Pieces | None]:
        """Per process of `pids`, from one listing of the GPU's processes
        (compute and graphics): its used memory as one piece, keyed
        ("process", pid); {} for a process NVML does not list; None for
        every one where NVML cannot list processes, or does not count their
        memory."""
        api = self._api
        used = dict.fromkeys(pids, 0)
        for listing in (api.nvmlDeviceGetComputeRunningProcesses, api.nvmlDeviceGetGraphicsRunningProcesses):
            try:
                processes = listing(self._handle)
            except api.NVMLError:
                return dict.fromkeys(used)
            for process in processes:
                if process.pid in used:
                    if not isinstance(process.usedGpuMemory, int):
                        # NVML_VALUE_NOT_AVAILABLE: the driver does not count per process.
                        return dict.fromkeys(used)
                    used[process.pid] += process.usedGpuMemory
        return {pid: {("process", pid): nbytes} if nbytes else {} for pid, nbytes in used.items()}

    def __repr__(self) -> str:
        return f"NvmlDevice({self.key})"


def _nvml():
    try:
        import pynvml
    except ImportError as error:
        raise OSError(f"a GPU's budget needs NVML (the nvidia-ml-py package): {error}") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        raise OSError(f"NVML cannot start (no NVIDIA driver?): {error}") from None
    return pynvml


def open_device(spec: str) -> HostDevice | NvmlDevice:
    """The device `spec` names: "host", "cuda" (cuda:0), "cuda:N" or a GPU's
    UUID ("GPU-..."). ValueError for a spec of no such form, OSError where
    NVML is missing or has no such GPU."""
    if spec == "host":
        return HostDevice()
    if spec.startswith("GPU-"):
        api = _nvml()
        try:
            return NvmlDevice(api.nvmlDeviceGetHandleByUUID(spec), api)
        except api.NVMLError as error:
            raise OSError(f"NVML has no GPU {spec!r}: {error}") from None
    found = re.fullmatch(r"cuda(?::(\d+))?", spec)
    if found is None:
        raise ValueError(f"device must be 'host', 'cuda:N' or a GPU's UUID 'GPU-...', got {spec!r}")
    index = int(found.group(1) or 0)
    api = _nvml()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        entry = str(index)
    else:
        # CUDA takes the entries up to the first it cannot use; a UUID
        # entry names the GPU itself, a number NVML's index of it.
        entries = [entry.strip() for entry in visible.split(",") if entry.strip()]
        if index >= len(entries):
            raise OSError(f"{spec} is past the {len(entries)} GPU(s) CUDA_VISIBLE_DEVICES={visible!r} shows")
        entry = entries[index]
    try:
        if entry.startswith("GPU-"):
            handle = api.nvmlDeviceGetHandleByUUID(entry)
        elif entry.isdigit():
            handle = api.nvmlDeviceGetHandleByIndex(int(entry))
        else:
            raise OSError(f"{spec} is CUDA_VISIBLE_DEVICES entry {entry!r}, which names no GPU by index or UUID "
                          "(a MIG instance has no budget of its own here); name the GPU by UUID")
    except api.NVMLError as error:
        raise OSError(f"NVML has no GPU for {spec} (entry {entry!r}): {error}") from None
    return NvmlDevice(handle, api)
