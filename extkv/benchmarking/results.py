"""A bench run read back: its cases, each contender's rounds, and their ratios.

Theory of operation
-------------------
`extkv bench` leaves two files in the run directory: pytest-benchmark's
`bench.json` (one benchmark per (case, contender): the interleaved wall
times as `stats.data`, the case, CPU times and any pivot in `extra_info`)
and the engine's `bench_cases.json` (the run's facts, and every case with
the status of each contender: measured, not run or failed, and why). `load`
reads both into a `BenchRun`: times come from bench.json; what was not run,
and why, from bench_cases.json.

Every figure is a ratio: one contender's time over another's, with the
minimum over rounds of each (`ratio(..., "min")`) or the median of each.
Two contenders of one process are divided directly. A peer that ran in a
process of its own (torch's expandable segments, torch_memory_saver) is
compared through the case's pivot, measured in both processes: (extkv /
pivot here) / (peer / pivot there). `carryover` reads a case's rounds by
whose round ran before them, from the order the engine recorded.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..runs.rundir import read_json_object
from .result_files import BENCH_JSON, CASES_FILE


@dataclass
class Entry:
    """One contender's rounds in one case (seconds)."""

    contender: str
    process: str
    wall: list[float]
    cpu: list[float]
    pivot: dict | None = None
    #: extkv: CPU seconds of each round outside driver calls (else empty).
    own_cpu: list[float] = field(default_factory=list)
    #: The same with the caches evicted inside every driver step (the two
    #: ends of the byte series, measured interleaved).
    own_cpu_evicted: list[float] = field(default_factory=list)
    #: Where own CPU is read: bytecode instructions of the operation (else None).
    python_instructions: int | None = None


@dataclass
class CaseResult:
    facts: dict
    entries: dict[str, Entry] = field(default_factory=dict)
    #: contender -> (status, reason) for those with no times.
    missing: dict[str, tuple[str, str]] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return self.facts["case"]


@dataclass
class BenchRun:
    facts: dict
    cases: list[CaseResult]
    bench_json_problem: str = ""

    def case(self, op: str, geometry: str, state: str = "recycled", size: int | None = None) -> CaseResult | None:
        for case in self.cases:
            f = case.facts
            if f["op"] == op and f["geometry"] == geometry and f["state"] == state and (size is None or f["bytes"] == size):
                return case
        return None


def load(run_dir: Path) -> BenchRun | None:
    """The run's bench results, or None where the directory has none."""
    cases_path = Path(run_dir) / CASES_FILE
    if not cases_path.exists():
        return None
    facts = read_json_object(cases_path)
    measured: dict[tuple[str, str], Entry] = {}
    problem = ""
    bench_path = Path(run_dir) / BENCH_JSON
    if bench_path.exists():
        for benchmark in read_json_object(bench_path).get("benchmarks", []):
            info = benchmark.get("extra_info", {})
            if "case" not in info:
                continue
            measured[(info["case"], info["contender"])] = Entry(
                info["contender"], info["process"], list(benchmark["stats"]["data"]), list(info["cpu"]), info.get("pivot"),
                list(info.get("own_cpu") or []), list(info.get("own_cpu_evicted") or []), info.get("python_instructions"),
            )
    else:
        problem = f"{BENCH_JSON} is missing: pytest-benchmark wrote no results (the run stopped early?)"
    cases = []
    for case_facts in facts.pop("cases"):
        result = CaseResult({k: v for k, v in case_facts.items() if k != "results"})
        for name, outcome in case_facts["results"].items():
            entry = measured.get((result.id, name))
            if entry is not None and entry.wall:
                result.entries[name] = entry
            elif outcome["status"] == "measured":
                result.missing[name] = ("not recorded", f"measured, but not in {BENCH_JSON}")
            else:
                result.missing[name] = (outcome["status"], outcome["reason"])
        cases.append(result)
    return BenchRun(facts, cases, problem)


STATISTICS: dict[str, Callable[[list[float]], float]] = {"min": min, "median": statistics.median}


def _pivot_wall(case: CaseResult, entry: Entry) -> list[float] | None:
    if entry.pivot:
        return entry.pivot["wall"]
    pivot = case.entries.get(case.facts["pivot"])
    return pivot.wall if pivot is not None and pivot.process == entry.process else None


def ratio(case: CaseResult, subject: str, baseline: str, statistic: str) -> float | None:
    """subject's time over baseline's in `case` (None where either is
    missing): directly within one process, else through the pivots."""
    first, second = case.entries.get(subject), case.entries.get(baseline)
    if first is None or second is None:
        return None
    stat = STATISTICS[statistic]
    if first.process == second.process:
        return stat(first.wall) / stat(second.wall)
    first_pivot, second_pivot = _pivot_wall(case, first), _pivot_wall(case, second)
    if not first_pivot or not second_pivot:
        return None
    return (stat(first.wall) / stat(first_pivot)) / (stat(second.wall) / stat(second_pivot))


def carryover(case: CaseResult, lag: int) -> dict[str, dict[str, list[float]]]:
    """Wall times of each contender's rounds in `case` by whose round ran
    `lag` rounds before it, from the order the run recorded: contender ->
    predecessor -> seconds. A round whose predecessor belongs to the case
    before is left out."""
    by: dict[str, dict[str, list[float]]] = {}
    seen: dict[str, int] = {}
    order = case.facts["order"]
    for position, name in enumerate(order):
        index = seen[name] = seen.get(name, -1) + 1
        entry = case.entries.get(name)
        if position >= lag and entry is not None and index < len(entry.wall):
            by.setdefault(name, {}).setdefault(order[position - lag], []).append(entry.wall[index])
    return by
