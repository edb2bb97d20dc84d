"""The stress workloads' kernels, run once before any usage is compared.

Theory of operation
-------------------
CUDA loads a kernel's module on first use, which grows the process's NVML
reading: a usage check, or a leak baseline, taken before a workload first
ran a kernel reads the module as a leak. `_warm_up_workload_kernels` is
registered with extkv.testing.checks' `warm_up_kernels`, which the harness
runs before every leak baseline and `warmed_probe` before it makes a probe:
once per process and GPU it runs a short walk and a thread round's row
checks on a throwaway cache (on the host, where nothing loads lazily, it
does nothing). The package imports this module, so the registration holds
wherever a workload runs.
"""

from __future__ import annotations

import functools

import torch

from ... import vmm
from ...layout import KVCacheLayout
from ...usage import UsageProbe
from ..checks import register_workload_warm_up
from ..choices import SeededChoices
from ..modelled_cache import ModelledCache
from .base import stress_driver
from .tally import StressTally
from .threads import row_states, write_thread_patterns
from .walk import walk


#: Steps of the walk that runs every kernel once before a GPU's usage is compared.
WARM_UP_STEPS = 200


def _warm_up_workload_kernels(device: torch.device | str) -> None:
    """Registered with `warm_up_kernels`, which the harness runs before every
    leak baseline, so no test is the first to load these kernels."""
    device = vmm.canonical_device(device)
    if device.type == "cuda":
        _walk_once(device)


@functools.lru_cache(maxsize=None)
def _walk_once(device: torch.device) -> None:
    """Once per process and GPU: a short walk and a thread round's row checks
    on a throwaway cache, usage unchecked."""
    driven = ModelledCache(stress_driver(device), UsageProbe(device), "full", KVCacheLayout.LBHNC)
    driven.usage_checks = False
    try:
        walk(driven, SeededChoices(0), StressTally(), steps=WARM_UP_STEPS, full_check_every=4)
        if driven.model.mapped and driven.model.committed:
            write_thread_patterns(driven.cache)
            row_states(driven.cache)
    finally:
        driven.free()


register_workload_warm_up(_warm_up_workload_kernels)
