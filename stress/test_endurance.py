"""Endurance: a KV cache driven for minutes beside its plain-Python model,
over poisoned memory, on each case of CACHE_MACHINE_CASES.

- The seeded walk (extkv.testing.stress.walk) runs hundreds of operations a
  second with the checks each operation could break after every step and
  every invariant every FULL_CHECK_EVERY steps.
- The Hypothesis state machine (extkv.testing.machines.endurance_machine)
  checks every invariant after every step and shrinks a failure to a short
  script; batches of examples run, each with its own seed, until the test's
  share of the time bound is spent. A failure's text carries Hypothesis's
  reproduction (the steps, and the `@reproduce_failure` blob) and the seed.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, seed, settings
from hypothesis.reporting import with_reporter
from hypothesis.stateful import run_state_machine_as_test

from extkv.testing.machines import CACHE_MACHINE_CASES, endurance_machine
from extkv.testing.stress import WALK_EPISODE_OPERATIONS, Floor, run_walk, stress_driver, walked_through, warmed_probe

pytestmark = [pytest.mark.stress, pytest.mark.invariant(1, 3, 4, 5)]
CASE_IDS = [f"{kind}-{layout.name}" for kind, layout in CACHE_MACHINE_CASES]
#: One batch of the Hypothesis machine: examples, and steps in each.
EXAMPLES_PER_BATCH = 5
#: Batches a spent bound may take to draw a growing commit before the test
#: says it never did (one batch of 5 examples drew none on the H200).
MOST_BATCHES_WITHOUT_A_GROWTH = 20
STEPS_PER_EXAMPLE = 60


@pytest.mark.stress_weight(6)
@pytest.mark.parametrize("kind, layout", CACHE_MACHINE_CASES, ids=CASE_IDS)
def test_endurance_walk(device, stress, kind, layout):
    tally = stress.tally
    # The least episode: every kind of operation asserted below, once.
    steps = run_walk(
        device, kind, layout, stress.seed, tally, until=stress.until,
        least=walked_through(tally.operations), least_what="every kind of operation once",
        workload=f"endurance walk ({kind}-{layout.name})",
    )
    assert steps > 0 and tally.failures == [], tally.failures
    for operation in WALK_EPISODE_OPERATIONS:
        assert tally.operations[operation] > 0, f"{steps} steps never ran {operation!r}: {dict(tally.operations)}"


@pytest.mark.stress_weight(1.5)
@pytest.mark.parametrize("kind, layout", CACHE_MACHINE_CASES, ids=CASE_IDS)
def test_endurance_state_machine(device, stress, kind, layout):
    tally = stress.tally
    machine = endurance_machine(
        stress_driver(device), warmed_probe(device), kind, layout, operations=tally.operations, checks=tally.checks
    )
    batch_settings = settings(
        max_examples=EXAMPLES_PER_BATCH,
        stateful_step_count=STEPS_PER_EXAMPLE,
        deadline=None,
        database=None,
        derandomize=False,
        print_blob=True,
        suppress_health_check=list(HealthCheck),
    )
    batches = 0
    # The least episode is a batch whose examples grew the cache, the
    # operation this test must see: one batch of a few examples may draw none.
    floor = Floor(stress.until, lambda: batches >= 1 and tally.operations["commit (grow)"] > 0)
    while floor.more() and (batches < MOST_BATCHES_WITHOUT_A_GROWTH or tally.operations["commit (grow)"] > 0):
        batch_seed = stress.seed + batches
        tally.seeds.append(batch_seed)
        reported: list[str] = []
        try:
            with with_reporter(reported.append):
                run_state_machine_as_test(seed(batch_seed)(machine), settings=batch_settings)
        except Exception as error:
            reproduction = f"hypothesis seed {batch_seed}:\n" + "\n".join(reported)
            tally.fail(error, reproduction)
            error.add_note(reproduction)
            raise
        batches += 1
    floor.close(tally, f"Hypothesis endurance machine ({kind}-{layout.name})", f"{batches} batch of {EXAMPLES_PER_BATCH} examples")
    tally.events["Hypothesis batches"] += batches
    assert tally.operations["commit (grow)"] > 0, dict(tally.operations)
