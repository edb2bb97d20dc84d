"""Each scenario of the nightly stress run (`stress/`, `extkv stress`),
short and with fixed seeds, so that every change meets it in CI: the seeded
endurance walk and the Hypothesis endurance machine on each case of
CACHE_MACHINE_CASES, the whole fault enumeration of one case, real memory
pressure from a second process, threads, a crash, several processes on
one device, and engine processes sharing one KV budget through SIGKILLs. The workloads are extkv.testing.stress's; the nightly run gives
them minutes where these give them seconds.

Where a workload has a deadline, these give it one already spent: a
deadline is a floor for the workload's least episode (one whole pressure
episode, a walk through every kind of operation, two thread rounds, a
pressure cycle walked through), so a spent one must still run that least,
exactly, and say that the bound was too short. That is the nightly suite's
shortest bound, met here in a second (the shared budget's: a few).
"""

from __future__ import annotations

import time

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from extkv import KVCacheLayout
from extkv.testing.exclusive import Inconclusive
from extkv.testing.machines import CACHE_MACHINE_CASES, endurance_machine
from extkv.testing.stress.budget import ENGINES, LEAST_DAEMON_KILLS, LEAST_ENGINE_KILLS, LEAST_SAMPLES
from extkv.testing.stress import (
    BUDGET_STRESS_GRANULES,
    HOST_STRESS_GRANULE,
    OutsideUnreadable,
    LEAST_THREAD_ROUNDS,
    OPERATIONS,
    WALK_EPISODE_OPERATIONS,
    PressureProcess,
    StressTally,
    crash_once,
    decode_beside_commit_ahead,
    enumerate_faults,
    meet_real_out_of_memory,
    run_walk,
    run_walk_processes,
    share_one_budget,
    stress_driver,
    thread_rounds,
    walk_under_pressure,
    walked_through,
    warmed_probe,
)
from extkv.vmm import FAULTABLE_STEPS, HostDriver, driver_for, host_commits

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
@pytest.mark.long
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
@pytest.mark.long
def test_endurance_state_machine(device, kind, layout):
    tally = StressTally()
    machine = endurance_machine(
        stress_driver(device), warmed_probe(device), kind, layout, operations=tally.operations, checks=tally.checks
    )
    run_state_machine_as_test(machine, settings=settings(max_examples=MACHINE_EXAMPLES))
    for operation in ("commit (grow)", "read a block", "free"):
        assert tally.operations[operation] > 0, dict(tally.operations)


@pytest.fixture
def commit_lock_of_its_own(monkeypatch, tmp_path):
    """A machine commit lock of the test's own on the host, for a workload
    of this process alone that commits hundreds of times: on the shared
    lock each commit met while another process (another test worker)
    commits waits 20 ms a try. What that lock keeps apart across processes
    is test_host_locks.py's to prove."""
    monkeypatch.setattr(host_commits, "COMMITS_LOCK_PATH", str(tmp_path / "commits.lock"))


@pytest.mark.invariant(5)
@pytest.mark.usefixtures("commit_lock_of_its_own")
@pytest.mark.long
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
@pytest.mark.long
def test_crash_of_an_exporter(device):
    tally = StressTally()
    where = crash_once(device, SEED, tally)
    no_failures(tally)
    assert tally.events[f"crash child SIGKILLed {where}"] == 1
    assert tally.checks["peer unharmed by the exporter's death (digests)"] == 1


@pytest.mark.invariant(5)
@pytest.mark.long
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


@pytest.mark.invariant(5)
@pytest.mark.long
def test_engines_sharing_one_budget_through_sigkills(device):
    """Eight engine processes start at once on one budget of 256 granules
    (16 MiB on the host, 512 MiB on a GPU) and commit, shrink, release,
    recommit and defragment preserving contents, answering reclaims, while
    engines and the daemon are SIGKILLed (a spent deadline: the least, two
    engines and one daemon) and a 10 ms sampler reads them from outside (a
    GPU's engines by NVML, less what each held before its first commit):
    never more than the budget and a granule per engine together, no create
    the ledger granted out of memory, no reclaim answered late, and once
    they end the ledger and their memory are gone
    (extkv.testing.stress.share_one_budget raises, naming the numbers,
    where one of these fails)."""
    tally = StressTally()
    try:
        result = share_one_budget(tally, SEED, device=device, until=time.monotonic())
    except OutsideUnreadable as error:
        pytest.skip(str(error))
    no_failures(tally)
    assert (result.engine_kills, result.daemon_kills) == (LEAST_ENGINE_KILLS, LEAST_DAEMON_KILLS), result
    assert result.engine_starts == ENGINES + LEAST_ENGINE_KILLS and result.samples >= LEAST_SAMPLES, result
    assert result.granule == stress_driver(device).granularity, result
    assert (result.budget, result.bound) == (BUDGET_STRESS_GRANULES * result.granule,
                                             result.budget + ENGINES * result.granule), result
    assert result.sampled_max <= result.bound, result
    # NVML reads a GPU's engines as whole processes: a sample is read with them stopped.
    assert result.engines_read_stopped == (device.type == "cuda"), result
    assert (result.out_of_memory_inside_budget, result.reclaims_late, result.leaks) == (0, 0, []), result
    assert result.operations > 0 and result.starts_spread_s is not None, result
    assert tally.checks["the ledger holds nothing once every engine ended"] == 1, dict(tally.checks)
    assert tally.checks["no process reaches a chunk an ended engine held"] == 1, dict(tally.checks)
    assert [short["workload"] for short in tally.short_bounds] == ["engines sharing one budget"], tally.short_bounds
