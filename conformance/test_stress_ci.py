"""Each scenario of the nightly stress run (`stress/`, `extkv stress`),
short and with fixed seeds, so that every change meets it in CI: the seeded
endurance walk and the Hypothesis endurance machine on each case of
CACHE_MACHINE_CASES, the whole fault enumeration of one case, real memory
pressure from a second process, threads, a crash, and several processes on
one device. The workloads are extkv.testing.stress's; the nightly run gives
them minutes where these give them seconds.

Where a workload has a deadline, these give it one already spent: a
deadline is a floor for the workload's least episode (one whole pressure
episode, a walk through every kind of operation, two thread rounds, a
pressure cycle walked through), so a spent one must still run that least,
exactly, and say that the bound was too short. That is the nightly suite's
shortest bound, met here in a second.
"""

from __future__ import annotations

import errno
import json
import time

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from extkv import KVCacheLayout, OutOfMemoryError
from extkv.testing.exclusive import Inconclusive
from extkv.testing.machines import CACHE_MACHINE_CASES, endurance_machine
from extkv.reporting.stress import stress_section
from extkv.testing.stress import (
    HOST_STRESS_GRANULE,
    LEAST_THREAD_ROUNDS,
    OPERATIONS,
    WALK_EPISODE_OPERATIONS,
    Floor,
    PressureProcess,
    StressTally,
    crash_once,
    decode_beside_commit_ahead,
    enumerate_faults,
    meet_real_out_of_memory,
    run_walk,
    run_walk_processes,
    stress_driver,
    share_of_bound,
    thread_rounds,
    walk_under_pressure,
    walked_through,
    warmed_probe,
)
from extkv.testing.stress.walk import out_of_memory_waiter
from extkv.vmm import FAULTABLE_STEPS, HostDriver, driver_for

CASE_IDS = [f"{kind}-{layout.name}" for kind, layout in CACHE_MACHINE_CASES]
SEED = 20261130
#: Steps of a CI walk, with everything checked every FULL_CHECK_EVERY of them.
WALK_STEPS = 600
FULL_CHECK_EVERY = 8
#: Examples of the CI endurance machine (the profile's step count each).
MACHINE_EXAMPLES = 8
#: Steps of the CI walk under memory pressure and of each walk process.
PRESSURE_WALK_STEPS = 200
PROCESS_WALK_STEPS = 300


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
def test_walk_past_a_spent_deadline(device):
    """A spent deadline: the walk runs until it ran every kind of operation
    the nightly test asserts, and says the bound was too short."""
    tally = StressTally()
    kind, layout = CACHE_MACHINE_CASES[0]
    steps = run_walk(
        device, kind, layout, SEED, tally, until=time.monotonic(),
        least=walked_through(tally.operations), least_what="every kind of operation once", workload="walk",
    )
    no_failures(tally)
    for operation in WALK_EPISODE_OPERATIONS:
        assert tally.operations[operation] > 0, f"{steps} steps never ran {operation!r}: {dict(tally.operations)}"
    assert [short["workload"] for short in tally.short_bounds] == ["walk"], tally.short_bounds
    assert tally.short_bounds[0]["ran"] == f"{steps} steps (every kind of operation once)"


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
@pytest.mark.exclusive  # fills the device: the suite's other tests there would meet its pressure
def test_real_memory_pressure(device):
    """One whole pressure episode and a walk through a pressure cycle. Other
    jobs' memory never decides the verdict: an episode it decided is
    retried (extkv.testing.exclusive), and ten in a row skip the test."""
    tally = StressTally()
    with PressureProcess(device) as pressure:
        # Spent deadlines: one whole episode all the same, then the walk's
        # steps, through a whole pressure cycle at least.
        try:
            assert meet_real_out_of_memory(device, pressure, tally, seed=SEED, until=time.monotonic()) == 1
        except Inconclusive as why:
            pytest.skip(f"inconclusive on this machine: {why}")
        steps = walk_under_pressure(device, pressure, tally, seed=SEED, until=time.monotonic(), least_steps=PRESSURE_WALK_STEPS)
    assert steps >= PRESSURE_WALK_STEPS
    no_failures(tally)
    assert tally.checks["whole real out-of-memory episode"] == 1, dict(tally.checks)
    inconclusive = sum(count for event, count in tally.events.items() if event.startswith("episode inconclusive"))
    assert tally.events["pressure episodes"] == 1 + inconclusive, dict(tally.events)
    assert tally.events["commit refused by real out-of-memory"] >= 1, dict(tally.events)
    if device.type == "cuda":
        assert tally.events["refused commit succeeded once memory returned"] >= 1, dict(tally.events)
    else:
        assert tally.events["refused commit past the machine's whole memory: never fits, not performed"] == 1, dict(tally.events)
    assert tally.events["pressure cycles (take, hold, free)"] >= 1, dict(tally.events)
    assert [short["workload"] for short in tally.short_bounds] == ["real out-of-memory episodes", "walk under memory pressure"]


@pytest.mark.harness
def test_a_walk_under_pressure_waits_for_the_pressure_process_to_release():
    """A commit a walk under pressure saw refused is checked, then retried
    once the pressure process says its cycle released the memory: its
    event, whatever the machine's free memory does meanwhile."""
    tally, seen = StressTally(), []
    with PressureProcess("cpu") as pressure:
        assert pressure.ask("next-release") == "error: not cycling"  # nothing to wait for: an answer, not a hang
        assert pressure.ask(f"cycle hold {HOST_STRESS_GRANULE} 0.01") == "cycling"
        waiter = out_of_memory_waiter(
            tally, lambda: seen.append(("checked", pressure.cycles())), lambda: seen.append(("released", pressure.next_release()))
        )
        waiter(OutOfMemoryError("fallocate", errno.ENOMEM, "ENOMEM", size=1 << 40))
        assert pressure.ask("stop").startswith("stopped ")
    (checked, cycles_then), (released, cycles_after) = seen
    assert (checked, released) == ("checked", "released") and cycles_after > cycles_then, seen
    assert tally.events["real out-of-memory met by a walk's commit"] == 1
    assert tally.events["retried after the pressure process released its memory"] == 1


@pytest.mark.invariant(7)
@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.BLHNC], ids=lambda layout: layout.name)
def test_threads(device, layout):
    tally = StressTally()
    assert thread_rounds(device, layout, tally, seed=SEED, rounds=4) == 4
    no_failures(tally)
    assert sum(tally.operations.values()) == 4 * 8 * 16
    # A spent deadline: the least, a preserving and a mixed round.
    spent = StressTally()
    assert thread_rounds(device, layout, spent, seed=SEED + 1, until=time.monotonic()) == LEAST_THREAD_ROUNDS
    no_failures(spent)
    assert len(spent.short_bounds) == 1 and spent.checks["after a thread round: read-back, usage probe"] == LEAST_THREAD_ROUNDS


@pytest.mark.invariant(1, 4, 5)
def test_decode_beside_commit_ahead(device):
    tally = StressTally()
    assert decode_beside_commit_ahead(device, tally, seed=SEED, episodes=2) == 2
    no_failures(tally)
    assert tally.operations["commit-ahead: commit the next block"] > 100, dict(tally.operations)
    assert tally.checks["beside commit-ahead: every block, read-back, usage probe"] >= 8, dict(tally.checks)
    assert tally.checks["beside commit-ahead: nothing left after free"] == 1


@pytest.mark.invariant(5, 8)
def test_crash_of_an_exporter(device):
    tally = StressTally()
    where = crash_once(device, SEED, tally)
    no_failures(tally)
    assert tally.events[f"crash child SIGKILLed {where}"] == 1
    assert tally.checks["peer unharmed by the exporter's death (digests)"] == 1


@pytest.mark.invariant(5)
def test_several_processes_on_one_device(device):
    """Two walk processes beside each other; each checks itself, and on a
    GPU NVML lists neither once they are gone. Only their own memory is
    read, so the suite's other tests and other jobs may share the device."""
    tally = StressTally()
    # No seconds at all: each child walks its least.
    run_walk_processes(device, 2, SEED, tally, seconds=0.0, least_steps=PROCESS_WALK_STEPS)
    no_failures(tally)
    assert tally.events["walk processes sharing the device"] == 2 and len(tally.seeds) == 2
    assert sum(tally.operations.values()) >= 2 * PROCESS_WALK_STEPS
    assert sorted(short["ran"] for short in tally.short_bounds) == [f"{PROCESS_WALK_STEPS} steps (the least it was given)"] * 2, tally.short_bounds


@pytest.mark.harness
def test_walk_processes_that_die_without_a_tally_are_each_a_failure_of_the_pooled_tally(monkeypatch):
    """Every walk child dies at its start, before printing a tally (its
    environment's thread count is no number): each is a failure of the
    pooled tally, with the command that reproduces it, and the run raises
    naming both."""
    monkeypatch.setenv("EXTKV_TORCH_THREADS", "none")
    tally = StressTally()
    with pytest.raises(AssertionError, match=r"(?s)^walk process 0: .*; walk process 1: "):
        run_walk_processes("cpu", 2, SEED, tally, steps=1)
    assert len(tally.failures) == 2, tally.failures
    for index, failure in enumerate(tally.failures):
        assert "exited before saying anything" in failure["error"] and "ValueError" in failure["error"], failure["error"]
        assert " walk --device cpu " in failure["reproduction"] and f" --seed {SEED + index} " in failure["reproduction"]
    assert tally.events["walk processes sharing the device"] == 0


@pytest.mark.harness
def test_a_spent_bound_gives_no_test_seconds():
    """The nightly suite's shares: by weight of what is left, none once it is
    spent (a workload's floor, not a least number of seconds, keeps a test
    meaningful); a test's share never exceeds what is left."""
    assert share_of_bound(40.0, 1.0, 4.0) == 10.0
    assert share_of_bound(40.0, 3.0, 4.0) == 30.0
    assert share_of_bound(40.0, 2.0, 1.0) == 40.0
    assert share_of_bound(0.0, 1.0, 4.0) == 0.0
    assert share_of_bound(-12.0, 1.0, 4.0) == 0.0
    with pytest.raises(ValueError):
        share_of_bound(10.0, 0.0, 4.0)


@pytest.mark.harness
def test_a_floor_runs_the_least_past_its_deadline():
    ran = 0
    floor = Floor(time.monotonic() - 1.0, lambda: ran >= 3)
    while floor.more():
        ran += 1
    tally = StressTally()
    floor.close(tally, "crashes", f"{ran} crashes")
    assert ran == 3 and floor.too_short
    assert tally.short_bounds == [{"workload": "crashes", "ran": "3 crashes", "seconds": tally.short_bounds[0]["seconds"], "share_s": 0.0}]
    # Bounded by a count instead, a floor never stops a loop, nor reports.
    counted, ran = Floor(None, lambda: ran >= 3), 0
    while counted.more() and ran < 10:
        ran += 1
    assert ran == 10 and not counted.too_short


@pytest.mark.harness
def test_the_report_names_each_bound_too_short(tmp_path):
    """A test whose least outlasted its share is named in the stress
    section, with what it ran, in how long, of what share."""
    tally = StressTally()
    tally.operations["commit (grow)"] += 1
    tally.bound_too_short("real out-of-memory episodes", "1 whole pressure episode", 6.04, 0.0)
    record = {
        "format": "extkv-stress/1", "nodeid": "stress/test_pressure.py::test_commits_meet_real_out_of_memory[host]",
        "worker": "main", "device": "host", "device_label": None, "outcome": "passed", "failure": "", "skip_reason": None,
        "seed": 1, "budget_s": 0.0, "started": 0.0, "duration_s": 7.5, "tally": tally.to_json(),
    }
    (tmp_path / "stress" / "tests").mkdir(parents=True)
    (tmp_path / "stress" / "tests" / "main--pressure.json").write_text(json.dumps(record))
    section = stress_section(tmp_path)
    assert "- bounds too short: 1 test ran only its least episode" in section, section
    assert (
        "| `test_commits_meet_real_out_of_memory[host]` | host | real out-of-memory episodes | 1 whole pressure episode "
        "| 6.0 s | 0 s | 8 s |"
    ) in section, section
