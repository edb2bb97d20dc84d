"""What every stress workload runs on: the driver under its caches, a usage
probe that sees only extkv, and the bound on every wait.

Theory of operation
-------------------
A stress cache lives on poisoned memory (`PoisoningDriver`: each new chunk
is filled with a non-zero byte), so every zero it reads is one extkv wrote.
Under the poison: on the host the host driver with `HOST_STRESS_GRANULE`,
small enough that segments still span and share several granules while a
step moves few bytes; on a GPU the device's CUDA driver with its own
granule. CUDA loads a kernel's module on first use, which grows the
process's NVML reading, so a workload's usage probe is made only once every
kernel the workloads run has run (`warmed_probe`; extkv.testing.stress.warm_up
registers those kernels). Every wait for a child process's line, or for
memory to return, is bounded by CHILD_TIMEOUT_S.
"""

from __future__ import annotations

import torch

from ... import vmm
from ...usage import UsageProbe
from ...vmm import Driver, HostDriver, PoisoningDriver, driver_for
from ..checks import warm_up_kernels


#: Host granule of stress caches: segments still span and share several
#: granules, at a thirty-second of the bytes a 2 MiB granule moves. CUDA
#: keeps its own granule.
HOST_STRESS_GRANULE = 64 << 10
#: Bounds on a wait for a child process's line, or for memory to return.
CHILD_TIMEOUT_S = 120.0


def plain_stress_driver(device: torch.device | str) -> Driver:
    """The driver under a stress cache's poison: the host driver with
    `HOST_STRESS_GRANULE`, or the device's CUDA driver."""
    device = torch.device(device)
    return HostDriver(HOST_STRESS_GRANULE) if device.type == "cpu" else driver_for(device)


def stress_driver(device: torch.device | str) -> Driver:
    """What stress caches run on: poisoned memory (so zeroing is extkv's),
    over `plain_stress_driver`."""
    return PoisoningDriver(plain_stress_driver(device))


def warmed_probe(device: torch.device | str) -> UsageProbe:
    """The usage probe of `device`, once every kernel the workloads run has
    run: CUDA loads a kernel's module on first use, which grows the process's
    NVML reading, and a usage check must see only extkv."""
    device = vmm.canonical_device(device)
    warm_up_kernels(device)
    return UsageProbe(device)
