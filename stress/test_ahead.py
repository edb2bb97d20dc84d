"""Decode beside commit-ahead for minutes: an engine's growth, shrinks and
sleeps while the background worker grows ahead, checked against a model
(extkv.testing.stress.decode_beside_commit_ahead)."""

from __future__ import annotations

import pytest

from extkv.testing.stress import decode_beside_commit_ahead

pytestmark = [pytest.mark.stress, pytest.mark.invariant(1, 4, 5)]


# An endurance walk's share: at the default weight, last in the run, a
# 5-minute H200 run left it 4 s (6,020 operations) of its bound.
@pytest.mark.stress_weight(6)
def test_decode_beside_commit_ahead_for_minutes(device, stress):
    episodes = decode_beside_commit_ahead(device, stress.tally, seed=stress.seed, until=stress.until)
    assert episodes >= 1
    assert stress.tally.failures == [], stress.tally.failures
