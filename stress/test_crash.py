"""Crash safety: a child process that commits, defragments and exports in a
loop is killed (SIGKILL) at a random point of one of them; a peer that
imported its segments keeps reading the same bytes, and the memory the child
held comes back: no process reaches its memfds any more (host), NVML lists
the child no more and the peer holds no more than before (GPU; the test's
own processes only, so other jobs on the GPU cannot move it).
extkv.testing.stress.crash_once is one such crash."""

from __future__ import annotations

import pytest

from extkv.testing.stress import Floor, crash_once

pytestmark = [pytest.mark.stress, pytest.mark.invariant(5, 8)]
#: Crashes every run has, however short its share: its least episode.
AT_LEAST = 2


@pytest.mark.stress_weight(2)
def test_sigkill_during_commits_defragments_exports(device, stress):
    kills = 0
    floor = Floor(stress.until, lambda: kills >= AT_LEAST)
    while floor.more():
        crash_once(device, stress.seed + kills, stress.tally)
        kills += 1
    floor.close(stress.tally, "crashes", f"{kills} SIGKILLed exporters")
    landed = [event for event in stress.tally.events if event.startswith("crash child SIGKILLed")]
    assert sum(stress.tally.events[event] for event in landed) == kills, dict(stress.tally.events)
    assert stress.tally.failures == [], stress.tally.failures
