"""Bench runs pooled: the rounds of several runs of one code on one machine, read as one run.

Theory of operation
-------------------
A verdict reads each side's least round. One run fits 21-61 rounds of a
headline case into a machine's ten minutes, and on the H200 a miss of a few
percent can rest on one lucky round or on a stretch of them (the report's
halves say so); two runs of one code then flag different readings. Runs of
the same code, profile and machine are the same experiment repeated, so
`pool` joins their rounds case by case, each run's rounds in the order they
ran, the runs in the order given: every round is still interleaved with its
case's other contenders as its run ran it, the even and odd halves keep their
meaning, and the earlier and later halves now mostly set run against run.
pytest-benchmark's own compare sets runs side by side; it does not join
their rounds into one run whose verdicts read them all, which is what this
module does.

A pooled directory holds what a run's does (`bench_cases.json`,
`bench.json`, `machine.json`), so `extkv report` renders it like any run;
its facts name the runs pooled. The decode, growth-loop and shared-budget
benches are not pooled: their readings stay in each run's own report. Each is written anew (rundir.write_text),
replacing any entry of its name rather than writing through it, and the
first run's machine.json is read as a results file, never copied blind.

Runs that differ in what they measured on (profile, device and driver,
torch, host) or in the code measured (the Python work of a measured
operation, counted in bytecode instructions) are refused, the difference
named. So is a run given twice (under any spelling: a symlink, a path
through `..`), whose rounds would count twice, and a pooled directory that
is one of the runs, which would be overwritten; both before anything is
read or written.

A run that did not end on its own (extkv.benchmarking.report.partial_reason)
is pooled, and so is its partiality: the pooled directory's `bench-run.json`
names each partial run and why, and its report is headed as partial.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
from pathlib import Path
from typing import Sequence

from ..runs.machine import MACHINE_FILE, read_machine_facts
from ..runs.rundir import read_json_object, results_as_written, write_text
from .report import partial_reason
from .result_files import BENCH_JSON, CASES_FILE, RUN_FILE, run_file

#: Facts that must be equal in every run pooled.
SAME_IN_EVERY_RUN = ("profile", "device", "device_description", "granularity", "torch", "host", "headline_bytes")
#: Facts of each run that the pooled run sums or joins.
_JOINED_FACTS = {"cases", "elapsed_seconds", "budget_seconds", "clocks"}
#: Per-round lists in a benchmark's extra info, joined like its rounds.
_ROUND_LISTS = ("cpu", "own_cpu", "own_cpu_evicted")


def pool(run_dirs: Sequence[Path], out_dir: Path) -> Path:
    """Write into `out_dir` one run made of the rounds of `run_dirs` (two
    or more bench runs), and return `out_dir`; ValueError naming what keeps
    them apart."""
    run_dirs = [Path(run_dir) for run_dir in run_dirs]
    if len(run_dirs) < 2:
        raise ValueError(f"pooling needs two or more run directories, got {len(run_dirs)}")
    out_dir = Path(out_dir)
    for run_dir in run_dirs:
        if _same_directory(out_dir, run_dir):
            raise ValueError(
                f"{out_dir}: the pooled directory must not be one of the runs pooled (it is {run_dir}); "
                "name a new or empty directory"
            )
    for later, run_dir in enumerate(run_dirs[1:], 1):
        for earlier in run_dirs[:later]:
            if _same_directory(earlier, run_dir):
                raise ValueError(
                    f"{run_dir} is {earlier} again: a run pooled with itself would count each of its rounds "
                    "twice; name each run directory once"
                )
    runs, partial = [], []
    for run_dir in run_dirs:
        with results_as_written(run_dir, "bench results"):
            runs.append(_read(run_dir))
            if reason := partial_reason(run_dir):
                partial.append(f"{run_dir.name}: {reason}")
    first_facts = runs[0][0]
    for run_dir, (facts, _) in zip(run_dirs[1:], runs[1:]):
        for key in SAME_IN_EVERY_RUN:
            if facts.get(key) != first_facts.get(key):
                raise ValueError(
                    f"{run_dir} ran on another {key} than {run_dirs[0]}: {facts.get(key)!r}, not {first_facts.get(key)!r}"
                )
    with results_as_written(f"the runs {', '.join(map(str, run_dirs))}", "bench results"):
        facts = _pooled_facts(run_dirs, runs)
        benchmarks = _pooled_benchmarks(run_dirs, [benchmarks for _, benchmarks in runs])
    machine = read_machine_facts(run_dirs[0])
    out_dir.mkdir(parents=True, exist_ok=True)
    # Written anew (write_text), never through an entry already at a name
    # in out_dir: a symlink there could point anywhere.
    write_text(out_dir / CASES_FILE, json.dumps(facts, indent=1))
    write_text(out_dir / BENCH_JSON, json.dumps({"benchmarks": benchmarks}, indent=1))
    if machine is not None:
        write_text(out_dir / MACHINE_FILE, json.dumps(machine, indent=1) + "\n")
    # An earlier pool's record, of other runs, or a cases part's, which
    # the report would read before the pooled run's.
    (out_dir / run_file("cases")).unlink(missing_ok=True)
    if partial:
        write_text(out_dir / RUN_FILE, json.dumps({"pooled_partial": partial}, indent=1) + "\n")
    else:
        (out_dir / RUN_FILE).unlink(missing_ok=True)
    return out_dir


def _same_directory(first: Path, second: Path) -> bool:
    """Whether two spellings name one directory: by inode where both exist
    (a symlink, `..`, a bind mount), else by the path each resolves to."""
    try:
        return os.path.samefile(first, second)
    except OSError:  # one of them does not exist (yet)
        return first.resolve() == second.resolve()


def _read(run_dir: Path) -> tuple[dict, list[dict]]:
    missing = [name for name in (CASES_FILE, BENCH_JSON) if not (run_dir / name).is_file()]
    if missing:
        raise ValueError(f"{run_dir}: not a bench run with results ({' and '.join(missing)} missing)")
    facts = read_json_object(run_dir / CASES_FILE)
    benchmarks = [b for b in read_json_object(run_dir / BENCH_JSON).get("benchmarks", [])
                  if "case" in b.get("extra_info", {})]
    return facts, benchmarks


def _pooled_facts(run_dirs: list[Path], runs: list[tuple[dict, list[dict]]]) -> dict:
    facts = {key: value for key, value in runs[0][0].items() if key != "cases"}
    facts["elapsed_seconds"] = sum(run_facts["elapsed_seconds"] for run_facts, _ in runs)
    facts["budget_seconds"] = sum(run_facts["budget_seconds"] for run_facts, _ in runs)
    facts["clocks"] = [clock for run_facts, _ in runs for clock in run_facts["clocks"]]
    facts["pooled_differences"] = sorted(
        key for key in set().union(*(run_facts.keys() for run_facts, _ in runs)) - _JOINED_FACTS
        if any(run_facts.get(key) != runs[0][0].get(key) for run_facts, _ in runs)
    )
    facts["pooled_from"] = [
        {"run": run_dir.name, "elapsed_seconds": run_facts["elapsed_seconds"], "cases": len(run_facts["cases"])}
        for run_dir, (run_facts, _) in zip(run_dirs, runs)
    ]
    cases: dict[str, dict] = {}
    for run_facts, _ in runs:
        for case in run_facts["cases"]:
            pooled = cases.get(case["case"])
            if pooled is None:
                cases[case["case"]] = copy.deepcopy(case)
                continue
            pooled["order"] = pooled["order"] + case["order"]
            for name, outcome in case["results"].items():
                if pooled["results"].get(name, {}).get("status") != "measured":
                    pooled["results"][name] = outcome
    facts["cases"] = list(cases.values())
    return facts


def _pooled_benchmarks(run_dirs: list[Path], runs: list[list[dict]]) -> list[dict]:
    pooled: dict[tuple[str, str], dict] = {}
    for run_dir, benchmarks in zip(run_dirs, runs):
        for benchmark in benchmarks:
            info = benchmark["extra_info"]
            key = (info["case"], info["contender"])
            if key not in pooled:
                pooled[key] = {"name": benchmark["name"], "extra_info": copy.deepcopy(info),
                               "stats": {"data": list(benchmark["stats"]["data"])}, "runs": [run_dir.name]}
                continue
            joined = pooled[key]
            _check_same_work(joined, info, run_dir)
            joined["stats"]["data"] += benchmark["stats"]["data"]
            joined["runs"].append(run_dir.name)
            for name in _ROUND_LISTS:
                joined["extra_info"][name] = list(joined["extra_info"].get(name) or []) + list(info.get(name) or [])
            if info.get("pivot") and joined["extra_info"].get("pivot"):
                for name in ("wall", "cpu"):
                    joined["extra_info"]["pivot"][name] += info["pivot"][name]
    for joined in pooled.values():
        data = joined["stats"]["data"]
        joined["stats"].update(rounds=len(data), min=min(data), max=max(data), mean=statistics.fmean(data),
                               median=statistics.median(data))
    return list(pooled.values())


def _check_same_work(joined: dict, info: dict, run_dir: Path) -> None:
    """Refuse rounds of different code: the operation's bytecode count is exact, so any change to what it runs shows."""
    before, now = joined["extra_info"].get("python_instructions"), info.get("python_instructions")
    if before is not None and now is not None and before != now:
        raise ValueError(
            f"{run_dir} measured other code: {info['contender']} in {info['case']} ran {now:,} bytecode instructions "
            f"there and {before:,} in {joined['runs'][0]}"
        )
