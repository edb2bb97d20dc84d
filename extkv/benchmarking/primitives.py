"""The raw calls the benchmarks time, and the device questions they ask.

Theory of operation
-------------------
A raw sequence (extkv.benchmarking.raw) runs on `primitives_for(device)`:
each device's raw driver calls, written in extkv.vmm.primitives beside the
drivers (no benchmark module calls a driver or asks which device it runs
on), or on any vmm driver a test passes. `synchronize` and `clock_note`
ask those primitives, so the stores and the engine stay device-blind.
"""

from __future__ import annotations

import torch

from ..vmm.primitives import Primitives, primitives_for

__all__ = ["Primitives", "clock_note", "primitives_for", "synchronize"]


def synchronize(device: torch.device) -> None:
    """Wait for queued work on `device` (nothing to wait for on the host)."""
    primitives_for(torch.device(device)).synchronize()


def clock_note(device: torch.device) -> str:
    """What the report says about `device`'s clocks: never pinned by extkv
    bench, with the clocks read now where they can be read."""
    return primitives_for(torch.device(device)).clock_note()
