"""Time bounds of stress runs: a deadline is a floor for one episode.

Theory of operation
-------------------
A time bound is a floor, not a hard stop, for the least a workload must do
to prove its point: one *episode* (one whole pressure episode, a walk that
ran every kind of operation, a preserving and a mixed thread round, a
pressure cycle walked through). `Floor` runs a workload's loop until its
deadline and then on until that least is done; where the least outlasted
the deadline, the tally says so (`short_bounds`, "bound too short"), and
the report lists it. `share_of_bound` is how the nightly suite divides what
is left of its bound among the tests still to run: in proportion to their
weights, and nothing at all once the bound is spent, since each workload's
floor is what keeps a test meaningful, not a least number of seconds.
"""

from __future__ import annotations

import time
from typing import Callable

from .tally import StressTally


def share_of_bound(left_s: float, weight: float, weights_left: float) -> float:
    """Seconds of `left_s` (what is left of a run's bound) for a test of
    `weight` among tests of `weights_left` still to run, itself included:
    its part by weight, and none once the bound is spent. No test gets a
    least number of seconds: a guess at an episode's length is too short on
    one machine and wasted on another, and every test past a spent bound
    would add it to the overrun. The workloads' `Floor` makes every test run
    one whole episode however small its share."""
    if weight <= 0 or weights_left <= 0:
        raise ValueError(f"weights must be > 0, got weight {weight} of {weights_left} left")
    return max(left_s, 0.0) * min(weight / weights_left, 1.0)


class Floor:
    """A workload's deadline `until` (time.monotonic(); None: bounded by a
    count instead), made a floor for its least episode: `more()` is True
    before the deadline, and after it for as long as `least()` says the
    least is not done yet. `least` must stay True once it is (counts only
    grow); it is asked before each episode until it is. `close()` records in
    the tally when the least was done only after the deadline: the bound was
    too short for more than the least."""

    def __init__(self, until: float | None, least: Callable[[], bool] = lambda: True):
        self.until = until
        self.least = least
        self.started = time.monotonic()
        #: When `least()` was first seen True (time.monotonic()), else None.
        self.done_at: float | None = None

    def more(self) -> bool:
        now = time.monotonic()
        if self.done_at is None and self.least():
            self.done_at = now
        return self.until is None or now < self.until or self.done_at is None

    @property
    def too_short(self) -> bool:
        return self.until is not None and self.done_at is not None and self.done_at >= self.until

    def close(self, tally: "StressTally", workload: str, ran: str) -> None:
        """Say in `tally` that `workload` ran only `ran` (its least), past its deadline, if it did."""
        if self.done_at is None and self.until is not None and self.least():
            self.done_at = time.monotonic()
        if self.too_short:
            tally.bound_too_short(workload, ran, time.monotonic() - self.started, self.until - self.started)
