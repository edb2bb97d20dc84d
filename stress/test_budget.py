"""Engines sharing one KV budget for minutes: eight engine processes start
at once on one 16 MiB budget and commit, shrink, release, recommit and
defragment preserving contents, answering the daemon's reclaims, while
engines (each replaced) and the daemon (restarted on its socket) are
SIGKILLed at random; a 10 ms sampler reads their chunks from outside. The
sampled maximum must stay within the budget and a granule per engine, no
create the ledger granted may run out of memory, every reclaim must be
answered by its deadline, and once the engines end the ledger and their
chunks must be gone (extkv.testing.stress.share_one_budget). On the host
driver only: a GPU's outside reading counts more than the KV caches."""

from __future__ import annotations

import pytest

from extkv.testing.stress import share_one_budget
from extkv.testing.stress.budget import ENGINES, HOST_ONLY, LEAST_DAEMON_KILLS, LEAST_ENGINE_KILLS

pytestmark = [pytest.mark.stress, pytest.mark.invariant(5)]
#: Seconds of the share that starting the engines and ending them take, beside the kills.
STARTUP_S = 3.0


@pytest.mark.stress_weight(2)
def test_engines_share_one_budget_through_sigkills(device, stress):
    if device.type != "cpu":
        pytest.skip(HOST_ONLY)
    result = share_one_budget(stress.tally, stress.seed, engines=ENGINES, until=stress.until - STARTUP_S)
    assert result.engine_kills >= LEAST_ENGINE_KILLS and result.daemon_kills >= LEAST_DAEMON_KILLS, result
    assert result.sampled_max <= result.bound, result
    assert (result.out_of_memory_inside_budget, result.reclaims_late, result.leaks) == (0, 0, []), result
    assert stress.tally.failures == [], stress.tally.failures
