"""Real memory pressure from a second process (extkv.testing.stress.PressureProcess):
memfd pages on the host, torch allocations on a GPU.

- Commits that need more than the pressure leaves are refused with
  `OutOfMemoryError` by the real driver (GPU) or by the kernel's numbers
  before anything is allocated (host), change nothing and leave the cache
  usable; on a GPU they succeed once the pressure process lets go, and a
  sleeping cache's wake meets the pressure too (on the host the refused
  commit asks for more than the machine has, so that no other process can
  let it fit, and is never performed). However short the share, one whole
  episode runs; episodes other jobs' memory decided are retried, and ten
  in a row skip the test as inconclusive (extkv.testing.exclusive).
- The endurance walk runs while the pressure process takes and frees memory
  in a loop; on a GPU its commits meet real out-of-memory, are checked and
  made again once memory returns. However short the share, the walk runs
  through one whole pressure cycle.
"""

from __future__ import annotations

import pytest

from extkv import KVCacheLayout
from extkv.testing.exclusive import Inconclusive
from extkv.testing.stress import PressureProcess, meet_real_out_of_memory, walk_under_pressure

pytestmark = [pytest.mark.stress, pytest.mark.invariant(4, 5)]


def episodes_or_skip(device, stress, layout: KVCacheLayout) -> None:
    with PressureProcess(device) as pressure:
        try:
            meet_real_out_of_memory(device, pressure, stress.tally, seed=stress.seed, until=stress.until, layout=layout)
        except Inconclusive as why:
            pytest.skip(f"inconclusive on this machine: {why}")


@pytest.mark.stress_weight(1)
def test_commits_meet_real_out_of_memory(device, stress):
    episodes_or_skip(device, stress, KVCacheLayout.BLHNC)
    events = stress.tally.events
    assert events["commit refused by real out-of-memory"] > 0, dict(events)
    if device.type == "cuda":
        assert events["refused commit succeeded once memory returned"] > 0, dict(events)


@pytest.mark.stress_weight(1)
def test_a_commit_of_many_runs_meets_real_out_of_memory_whole(device, stress):
    """One run per layer (LBHNC), each of which fits alone where all do not:
    on the host the commit is refused before its first create, so the
    refused commit changes nothing (the episode's snapshot check)."""
    if device.type == "cuda":
        pytest.skip("on CUDA each cuMemCreate decides: a commit refused part way keeps the runs it had mapped")
    episodes_or_skip(device, stress, KVCacheLayout.LBHNC)
    assert stress.tally.events["commit refused by real out-of-memory"] > 0, dict(stress.tally.events)


@pytest.mark.stress_weight(3)
def test_walk_under_memory_pressure(device, stress):
    with PressureProcess(device) as pressure:
        steps = walk_under_pressure(device, pressure, stress.tally, seed=stress.seed, until=stress.until)
    assert steps > 0 and stress.tally.failures == [], stress.tally.failures
    assert stress.tally.events["pressure cycles (take, hold, free)"] > 0, dict(stress.tally.events)
