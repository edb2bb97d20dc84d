"""Invariant 7 for minutes: eight threads mix operations on one cache, round
after round, checked between rounds against what any interleaving allows
(extkv.testing.stress.thread_rounds)."""

from __future__ import annotations

import pytest

from extkv import KVCacheLayout
from extkv.testing.stress import thread_rounds

pytestmark = [pytest.mark.stress, pytest.mark.invariant(7)]


@pytest.mark.stress_weight(2)
@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.BLHNC], ids=lambda layout: layout.name)
def test_threads_mixing_operations_for_minutes(device, stress, layout):
    rounds = thread_rounds(device, layout, stress.tally, seed=stress.seed, until=stress.until)
    assert rounds >= 2, f"only {rounds} round(s): a preserving and a mixed round are the least"
    assert stress.tally.failures == [], stress.tally.failures
