"""The memory timeline of a stress run, read from outside extkv.

Theory of operation
-------------------
A thread samples, every `interval_s`, each device's physical memory two
ways: this process's usage (`UsageProbe`: memfd pages on the host, NVML per
process on a GPU) and the whole device's used memory (the kernel's MemTotal
- MemAvailable, or the CUDA driver's total - free). The nightly suite keeps
one timeline per worker for the whole session and writes it beside the
tallies; the report plots it.
"""

from __future__ import annotations

import threading
import time

import torch

from ... import vmm
from ...usage import UsageProbe


class MemoryTimeline:
    """Samples, in a thread, physical memory on each device as seen from
    outside extkv: this process's usage (`UsageProbe`: memfd pages, NVML per
    process) and the device's used memory (the kernel's MemTotal -
    MemAvailable, or the CUDA driver's total - free), every `interval_s`."""

    def __init__(self, devices: list[torch.device], interval_s: float = 0.5):
        self.devices = [torch.device(device) for device in devices]
        self.interval_s = interval_s
        self.probes = {device: UsageProbe(device) for device in self.devices}
        self.start = time.time()
        #: One row per sample: [seconds since start, device, process bytes, device used bytes].
        self.samples: list[list] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="extkv-memory-timeline", daemon=True)

    def __enter__(self) -> "MemoryTimeline":
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        now = round(time.time() - self.start, 3)
        for device, probe in self.probes.items():
            free, total = vmm.device_memory_info(device)
            self.samples.append([now, str(device), probe.read(), total - free])

    def to_json(self) -> dict:
        return {
            "started": self.start,
            "interval_s": self.interval_s,
            "columns": ["seconds", "device", "process_bytes", "device_used_bytes"],
            "sources": {str(device): probe.source for device, probe in self.probes.items()},
            "samples": self.samples,
        }
