"""What stress workloads did and found: one `StressTally` per test.

Theory of operation
-------------------
Every workload adds to one tally: operations completed (each a public
operation on a real cache, checked), checks passed, faults injected by
(operation, driver step, mode) and the (operation, step) pairs they
covered, events met (real out-of-memory, kills), the largest physical
footprint, leaks and content mismatches, failures with their reproduction,
seeds, settings, and the workloads whose least episode outlasted their
deadline (`short_bounds`). A tally is plain data: `to_json` is a test's raw
result, `from_json` reads it back (a walk process's tally reaches its parent
so), and `add` pools tallies.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from ..models import ContentMismatch, LeakFound


@dataclass
class StressTally:
    """What stress workloads did and found. Counters are by name; `faults`
    by (operation, step, mode); everything converts to JSON and back."""

    operations: collections.Counter = field(default_factory=collections.Counter)
    checks: collections.Counter = field(default_factory=collections.Counter)
    events: collections.Counter = field(default_factory=collections.Counter)
    #: Faults injected that fired, by (operation, driver step, mode).
    faults: collections.Counter = field(default_factory=collections.Counter)
    #: (operation, step) pairs tried whose first call the operation never made.
    unreached: set = field(default_factory=set)
    #: Largest physical footprint a stressed cache held, bookkept and checked.
    peak_physical_bytes: int = 0
    leaks: list = field(default_factory=list)
    content_mismatches: int = 0
    failures: list = field(default_factory=list)
    seeds: list = field(default_factory=list)
    #: How the workloads ran (check intervals, bounds), for the report.
    settings: dict = field(default_factory=dict)
    #: Workloads whose least episode outlasted their deadline: {"workload",
    #: "ran" (what the least was), "seconds" (what it took), "share_s"
    #: (seconds its deadline gave it)}.
    short_bounds: list = field(default_factory=list)

    @property
    def pairs_covered(self) -> set[tuple[str, str]]:
        return {(operation, step) for operation, step, _ in self.faults}

    def observe_physical(self, nbytes: int) -> None:
        self.peak_physical_bytes = max(self.peak_physical_bytes, nbytes)

    def fail(self, error: BaseException, reproduction: str = "") -> None:
        """Record a failure; content mismatches and leaks are counted apart."""
        if isinstance(error, ContentMismatch):
            self.content_mismatches += 1
        if isinstance(error, LeakFound):
            self.leaks.append(str(error))
        self.failures.append({"error": f"{type(error).__name__}: {error}", "reproduction": reproduction})

    def bound_too_short(self, workload: str, ran: str, seconds: float, share_s: float) -> None:
        """Record that `workload` ran only its least (`ran`), which took
        `seconds` where its deadline gave it `share_s`."""
        self.short_bounds.append({"workload": workload, "ran": ran, "seconds": round(seconds, 1), "share_s": round(max(share_s, 0.0), 1)})
        self.events["bound too short: a workload ran only its least episode, past its deadline"] += 1

    def add(self, other: "StressTally") -> None:
        for name in ("operations", "checks", "events", "faults"):
            getattr(self, name).update(getattr(other, name))
        self.unreached |= other.unreached
        self.peak_physical_bytes = max(self.peak_physical_bytes, other.peak_physical_bytes)
        self.leaks += other.leaks
        self.content_mismatches += other.content_mismatches
        self.failures += other.failures
        self.seeds += other.seeds
        self.settings.update(other.settings)
        self.short_bounds += other.short_bounds

    def to_json(self) -> dict:
        return {
            "operations": dict(self.operations),
            "operations_total": sum(self.operations.values()),
            "checks": dict(self.checks),
            "events": dict(self.events),
            "faults": [[operation, step, mode, count] for (operation, step, mode), count in sorted(self.faults.items())],
            "faults_injected": sum(self.faults.values()),
            "pairs_covered": sorted([operation, step] for operation, step in self.pairs_covered),
            "unreached": sorted([operation, step] for operation, step in self.unreached),
            "peak_physical_bytes": self.peak_physical_bytes,
            "leaks": list(self.leaks),
            "content_mismatches": self.content_mismatches,
            "failures": list(self.failures),
            "seeds": list(self.seeds),
            "settings": dict(self.settings),
            "short_bounds": list(self.short_bounds),
        }

    @classmethod
    def from_json(cls, data: dict) -> "StressTally":
        return cls(
            operations=collections.Counter(data.get("operations", {})),
            checks=collections.Counter(data.get("checks", {})),
            events=collections.Counter(data.get("events", {})),
            faults=collections.Counter({(o, s, m): c for o, s, m, c in data.get("faults", [])}),
            unreached={(o, s) for o, s in data.get("unreached", [])},
            peak_physical_bytes=data.get("peak_physical_bytes", 0),
            leaks=list(data.get("leaks", [])),
            content_mismatches=data.get("content_mismatches", 0),
            failures=list(data.get("failures", [])),
            seeds=list(data.get("seeds", [])),
            settings=dict(data.get("settings", {})),
            short_bounds=list(data.get("short_bounds", [])),
        )
