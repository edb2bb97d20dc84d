"""Hypothesis state machines (extkv.testing.machines) drive a real
ExtensibleTensor and a real ExtensibleKVCache beside plain-Python models,
over poisoned memory, checking every invariant after each step.

On the host the driver uses 64 KiB granules: segments still span several
granules and share them, at a thirty-second of the bytes a 2 MiB granule
moves, so each run takes seconds. CUDA keeps its own 2 MiB granule.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis.stateful import run_state_machine_as_test

from extkv.testing.machines import (
    CACHE_MACHINE_CASES,
    TENSOR_MACHINE_SEGMENTS,
    cache_machine,
    commit_ahead_machine,
    tensor_machine,
)
from extkv.vmm import HostDriver, PoisoningDriver, driver_for, host_commits

POISON = 0xA5
HOST_GRANULE = 64 << 10


@pytest.fixture(autouse=True)
def commit_lock_of_its_own(monkeypatch, tmp_path):
    """A machine commit lock of the test's own on the host: a machine commits
    at nearly every step, and on the shared lock each commit met while
    another process (another test worker) commits waits 20 ms a try. What
    that lock keeps apart across processes is test_host_locks.py's to prove."""
    monkeypatch.setattr(host_commits, "COMMITS_LOCK_PATH", str(tmp_path / "commits.lock"))


def poisoned_driver(device: torch.device) -> PoisoningDriver:
    inner = HostDriver(HOST_GRANULE) if device.type == "cpu" else driver_for(device)
    return PoisoningDriver(inner, POISON)


@pytest.mark.invariant(1, 4, 5)
@pytest.mark.parametrize("segments", TENSOR_MACHINE_SEGMENTS)
@pytest.mark.long
def test_tensor_state_machine(device, usage, segments):
    run_state_machine_as_test(tensor_machine(poisoned_driver(device), usage, fresh_byte=POISON, segments=segments))


@pytest.mark.invariant(1, 3, 4, 5)
@pytest.mark.parametrize("kind, layout", CACHE_MACHINE_CASES, ids=[f"{k}-{l.name}" for k, l in CACHE_MACHINE_CASES])
@pytest.mark.long
def test_kv_cache_state_machine(device, usage, kind, layout):
    run_state_machine_as_test(cache_machine(poisoned_driver(device), usage, kind, layout))


@pytest.mark.invariant(1, 4, 5, 7)
@pytest.mark.long
def test_kv_cache_state_machine_beside_the_commit_ahead_worker(device, usage):
    run_state_machine_as_test(commit_ahead_machine(poisoned_driver(device), usage))
