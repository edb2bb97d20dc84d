"""Several stress processes on one device at once: walks in child processes
(extkv.testing.stress.run_walk_processes), each checking itself, on the host
driver or one GPU; `extkv stress` runs one pytest worker per GPU on a
machine of several, so every GPU has its own."""

from __future__ import annotations


import pytest

from extkv.testing.stress import FULL_CHECK_EVERY, run_walk_processes

pytestmark = [pytest.mark.stress, pytest.mark.invariant(5)]
#: Walk processes per device: one per core of a small CI machine on the
#: host; on a GPU, more than one engine's worth.
PROCESSES = {"cpu": 2, "cuda": 3}
#: A child's start (importing torch, a CUDA context) takes seconds of its share.
STARTUP_S = 3.0
#: Each walk's least episode, however short the share: two full checks of
#: everything while the other walks run.
LEAST_STEPS = 2 * FULL_CHECK_EVERY


@pytest.mark.stress_weight(3)
def test_several_walk_processes_share_one_device(device, stress):
    count = PROCESSES[device.type]
    seconds = max(stress.left() - STARTUP_S, 0.0)
    run_walk_processes(device, count, stress.seed, stress.tally, seconds=seconds, least_steps=LEAST_STEPS)
    assert stress.tally.events["walk processes sharing the device"] == count
    assert sum(stress.tally.operations.values()) >= count * LEAST_STEPS, dict(stress.tally.operations)
    assert len(stress.tally.seeds) == count and stress.tally.failures == [], stress.tally.failures
