"""Engines sharing one KV budget for minutes: eight engine processes start
at once on one budget of 256 granules (16 MiB on the host driver, 512 MiB
of a GPU's 2 MiB granules) and commit, shrink, release, recommit and
defragment preserving contents, answering the daemon's reclaims, while
engines (each replaced) and the daemon (restarted on its socket) are
SIGKILLed at random; a 10 ms sampler reads them from outside. The sampled
maximum must stay within the budget and a granule per engine, no create
the ledger granted may run out of memory, every reclaim must be answered
by its deadline, and once the engines end the ledger and their memory must
be gone (extkv.testing.stress.share_one_budget). The outside reading is
the budget daemon's: on the host the pages of each engine's chunks
(memfds); on a GPU NVML's per-process used memory, less what each engine
held before its first commit (its CUDA context and torch's memory). Where
NVML cannot see this machine's processes (a PID namespace), a GPU's run
is skipped, saying so."""

from __future__ import annotations

import pytest

from extkv.testing.stress import OutsideUnreadable, share_one_budget
from extkv.testing.stress.budget import ENGINES, LEAST_DAEMON_KILLS, LEAST_ENGINE_KILLS

pytestmark = [pytest.mark.stress, pytest.mark.invariant(5)]
#: Seconds of the share that starting the engines and ending them take, beside the kills.
STARTUP_S = 3.0


@pytest.mark.stress_weight(2)
def test_engines_share_one_budget_through_sigkills(device, stress):
    try:
        result = share_one_budget(stress.tally, stress.seed, device=device, engines=ENGINES,
                                  until=stress.until - STARTUP_S)
    except OutsideUnreadable as error:
        pytest.skip(str(error))
    assert result.engine_kills >= LEAST_ENGINE_KILLS and result.daemon_kills >= LEAST_DAEMON_KILLS, result
    assert result.sampled_max <= result.bound, result
    assert (result.out_of_memory_inside_budget, result.reclaims_late, result.leaks) == (0, 0, []), result
    assert stress.tally.failures == [], stress.tally.failures
