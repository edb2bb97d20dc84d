"""What a budget stress run did and found, and the bounds it broke.

Theory of operation
-------------------
A `BudgetStressResult` is plain data (it goes into the tally's settings
as a dict): the run's shape (engines, budget, granule, and the bound the
outside sampler's maximum is held to, the budget plus one granule per
engine), its episode (engine starts and kills, daemon kills, samples),
what the engines counted, and what the daemon's log says happened.
`problems()` names every bound broken with its numbers; the run
(extkv.testing.stress.budget) raises them once everything is stopped.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BudgetStressResult:
    """What a budget stress run did and found (see extkv.testing.stress.budget's theory)."""

    engines: int
    budget: int
    granule: int
    bound: int
    #: Whether each sample was one pass with every engine stopped
    #: (extkv.testing.stress.budget_sampler), else two passes matched.
    engines_read_stopped: bool = False
    engine_starts: int = 0
    engine_kills: int = 0
    daemon_kills: int = 0
    samples: int = 0
    sampled_max: int = 0
    sampled_max_plain: int = 0
    over_bound_samples: int = 0
    #: Seconds from the latest daemon restart to the largest sample past the bound (None: none, or no restart before).
    largest_over_bound_after_restart_s: float | None = None
    #: Seconds from the run's start to the largest sample past the bound.
    largest_over_bound_at_s: float | None = None
    #: Of the largest sample past the bound, per engine process: its two
    #: passes' readings and its baseline, "pid": [first, second, baseline]
    #: bytes (with the engines read stopped, the sample is the second alone).
    largest_over_bound_readings: dict = field(default_factory=dict)
    operations: int = 0
    denials: int = 0
    unavailable: int = 0
    reclaims_answered: int = 0
    reclaim_slowest_s: float = 0.0
    out_of_memory_inside_budget: int = 0
    reclaims_late: int = 0
    reserves_denied_at_deadline: int = 0
    rejoins_past_budget: int = 0
    most_past_budget: int = 0
    releases_contradicted: int = 0
    #: Engine processes a restarted daemon counted from its predecessor's journal until they rejoined.
    found_at_restarts: int = 0
    leaks: list = field(default_factory=list)
    #: Seconds from the first of the engines started at once to pass the
    #: gate to the last, and from the first to join to the last.
    starts_spread_s: float | None = None
    joins_spread_s: float | None = None
    seconds: float = 0.0

    def problems(self) -> list[str]:
        """Every bound the run broke, with its numbers."""
        found = []
        if self.sampled_max > self.bound:
            found.append(f"sampled maximum {self.sampled_max} bytes > bound {self.bound} (budget {self.budget} + "
                         f"{self.engines} granules of {self.granule}) in {self.over_bound_samples} of {self.samples} "
                         f"samples, the largest {self.largest_over_bound_at_s} s into the run and "
                         f"{self.largest_over_bound_after_restart_s} s after a daemon restart; "
                         f"{self.rejoins_past_budget} rejoins took the engines past the budget, by up to "
                         f"{self.most_past_budget} bytes; that sample's readings, pid: [first pass, second pass, "
                         f"baseline] bytes: {self.largest_over_bound_readings}")
        if self.out_of_memory_inside_budget:
            found.append(f"{self.out_of_memory_inside_budget} creates the ledger granted ran out of memory")
        if self.reclaims_late:
            found.append(f"{self.reclaims_late} reclaims were answered past their deadline (reclaims_ignored)")
        found += [f"leak: {leak}" for leak in self.leaks]
        return found

