"""Every driver step of every public operation, failed: a fault at the 1st,
2nd, ... call of each step (create, map, set access, unmap, release, export,
import, reserve), as a plain failure and as out-of-memory, until the
operation completes without reaching it (extkv.testing.stress.enumerate_faults).

The first scenario (unpadded LBHNC: segments share granules) is enumerated
whole, however long it takes: the test's least episode; the others fill
what is left of the test's share. The report counts the faults and the
(operation, step) pairs, and says when the first scenario alone outlasted
the share.
"""

from __future__ import annotations

import time

import pytest

from extkv.testing.machines import CACHE_MACHINE_CASES
from extkv.testing.stress import HOST_STRESS_GRANULE, OPERATIONS, enumerate_faults, warmed_probe
from extkv.vmm import FAULTABLE_STEPS, HostDriver, driver_for

pytestmark = [pytest.mark.stress, pytest.mark.invariant(5)]


@pytest.mark.stress_weight(2)
def test_every_driver_step_of_every_operation(device, stress):
    real = HostDriver(HOST_STRESS_GRANULE) if device.type == "cpu" else driver_for(device)
    probe = warmed_probe(device)
    tally = stress.tally
    started = time.monotonic()
    assert enumerate_faults(real, probe, tally, scenarios=CACHE_MACHINE_CASES[:1])
    if time.monotonic() >= stress.until:
        tally.bound_too_short(
            "fault enumeration", "the whole enumeration of one scenario", time.monotonic() - started, stress.until - started
        )
    enumerate_faults(real, probe, tally, scenarios=CACHE_MACHINE_CASES[1:], until=stress.until)
    covered = tally.pairs_covered
    assert {step for _, step in covered} == set(FAULTABLE_STEPS), f"steps never failed: {set(FAULTABLE_STEPS) - {s for _, s in covered}}"
    assert {name for name, _ in covered} == {operation.name for operation in OPERATIONS}
    assert tally.failures == [], tally.failures
