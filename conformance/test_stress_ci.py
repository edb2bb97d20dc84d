"""Each scenario of the nightly stress run (`stress/`, `extkv stress`),
short and with fixed seeds, so that every change meets it in CI: the seeded
endurance walk and the Hypothesis endurance machine on each case of
CACHE_MACHINE_CASES, the whole fault enumeration of one case, real memory
pressure from a second process, threads, a crash, and several processes on
one device. The workloads are extkv.testing.stress's; the nightly run gives
them minutes where these give them seconds.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from extkv import KVCacheLayout
from extkv.testing.stateful import CACHE_MACHINE_CASES, endurance_machine
from extkv.testing.stress import (
    HOST_STRESS_GRANULE,
    OPERATIONS,
    PressureProcess,
    StressTally,
    crash_once,
    enumerate_faults,
    meet_real_out_of_memory,
    run_walk,
    run_walk_processes,
    stress_driver,
    thread_rounds,
    walk_under_pressure,
    warmed_probe,
)
from extkv.vmm import FAULTABLE_STEPS, HostDriver, driver_for

CASE_IDS = [f"{kind}-{layout.name}" for kind, layout in CACHE_MACHINE_CASES]
SEED = 20261130
#: Steps of a CI walk, with everything checked every FULL_CHECK_EVERY of them.
WALK_STEPS = 600
FULL_CHECK_EVERY = 8
#: Examples of the CI endurance machine (the profile's step count each).
MACHINE_EXAMPLES = 8


def no_failures(tally: StressTally) -> None:
    assert tally.failures == [] and tally.leaks == [] and tally.content_mismatches == 0, tally.failures


@pytest.mark.invariant(1, 3, 4, 5)
@pytest.mark.parametrize("kind, layout", CACHE_MACHINE_CASES, ids=CASE_IDS)
def test_endurance_walk(device, kind, layout):
    tally = StressTally()
    steps = run_walk(device, kind, layout, SEED, tally, steps=WALK_STEPS, full_check_every=FULL_CHECK_EVERY)
    assert steps == WALK_STEPS
    no_failures(tally)
    full_checks = tally.checks["everything: addresses, every byte, read-back, one chunk, usage probe"]
    assert full_checks == WALK_STEPS // FULL_CHECK_EVERY, dict(tally.checks)
    for operation in ("commit (grow)", "commit (shrink)", "commit (defragment, discarding)",
                      "commit (defragment, preserving)", "release_physical", "recommit", "write a block",
                      "read a block", "export to a peer and compare digests", "free"):
        assert tally.operations[operation] > 0, f"{WALK_STEPS} steps never ran {operation!r}: {dict(tally.operations)}"


@pytest.mark.invariant(1, 3, 4, 5)
@pytest.mark.parametrize("kind, layout", CACHE_MACHINE_CASES, ids=CASE_IDS)
def test_endurance_state_machine(device, kind, layout):
    tally = StressTally()
    machine = endurance_machine(
        stress_driver(device), warmed_probe(device), kind, layout, operations=tally.operations, checks=tally.checks
    )
    run_state_machine_as_test(machine, settings=settings(max_examples=MACHINE_EXAMPLES))
    for operation in ("commit (grow)", "read a block", "free"):
        assert tally.operations[operation] > 0, dict(tally.operations)


@pytest.mark.invariant(5)
def test_every_driver_step_of_every_operation(device):
    real = HostDriver(HOST_STRESS_GRANULE) if device.type == "cpu" else driver_for(device)
    tally = StressTally()
    assert enumerate_faults(real, warmed_probe(device), tally, scenarios=CACHE_MACHINE_CASES[:1])
    no_failures(tally)
    covered = tally.pairs_covered
    assert {step for _, step in covered} == set(FAULTABLE_STEPS)
    assert {name for name, _ in covered} == {operation.name for operation in OPERATIONS}
    # Both modes fire at every pair.
    for mode in ("failure", "out of memory"):
        assert {(o, s) for o, s, m in tally.faults if m == mode} == covered


@pytest.mark.invariant(4, 5)
@pytest.mark.exclusive  # fills the device, and reads what it has free
def test_real_memory_pressure(device):
    tally = StressTally()
    with PressureProcess(device) as pressure:
        assert meet_real_out_of_memory(device, pressure, tally, seed=SEED, episodes=1) == 1
        assert walk_under_pressure(device, pressure, tally, seed=SEED, steps=200) == 200
    no_failures(tally)
    assert tally.events["commit refused by real out-of-memory"] == 1, dict(tally.events)
    if device.type == "cuda":
        assert tally.events["refused commit succeeded once memory returned"] == 1, dict(tally.events)


@pytest.mark.invariant(7)
@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.BLHNC], ids=lambda layout: layout.name)
def test_threads(device, layout):
    tally = StressTally()
    assert thread_rounds(device, layout, tally, seed=SEED, rounds=4) == 4
    no_failures(tally)
    assert sum(tally.operations.values()) == 4 * 8 * 16


@pytest.mark.invariant(5, 8)
def test_crash_of_an_exporter(device):
    tally = StressTally()
    where = crash_once(device, SEED, tally)
    no_failures(tally)
    assert tally.events[f"crash child SIGKILLed {where}"] == 1
    assert tally.checks["peer unharmed by the exporter's death (digests)"] == 1


@pytest.mark.invariant(5)
def test_several_processes_on_one_device(device):
    tally = StressTally()
    run_walk_processes(device, 2, SEED, tally, steps=300)
    no_failures(tally)
    assert tally.events["walk processes sharing the device"] == 2 and len(tally.seeds) == 2
    assert sum(tally.operations.values()) >= 2 * 300
