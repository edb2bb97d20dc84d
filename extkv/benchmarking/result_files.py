"""The names of the files a bench run leaves in its run directory.

Theory of operation
-------------------
The engine, pytest-benchmark and the decode, growth-loop and budget
benches write these files; `extkv report` reads them. The names live
here, apart from the code that writes them (which imports torch), so that
reading a run back needs no device library.
"""

from __future__ import annotations

from pathlib import Path

#: The engine's facts of the run and the status of every case.
CASES_FILE = "bench_cases.json"
#: File pytest-benchmark writes (`--benchmark-json`).
BENCH_JSON = "bench.json"
#: The decode bench's result (extkv.benchmarking.decode).
DECODE_FILE = "bench_decode.json"
#: The growth-loop bench's result (extkv.benchmarking.growth_loop).
GROWTH_FILE = "bench_growth.json"
#: The shared KV budget's bench result (extkv.benchmarking.budget_bench).
BUDGET_FILE = "bench_budget.json"
#: The harness's record of the benchmarks' pytest run, `<step>.json`
#: (`--extkv-report-step`; extkv.testing.record): among its facts the test
#: paths pytest took, which narrow a run as `-k` does.
HARNESS_STEP = "bench_tests"
#: What `extkv bench` records of the run as a whole: its pytest command and
#: exit status, and the signal that ended it, if one did. A pooled run
#: (extkv.benchmarking.pool) records there which of its runs were partial.
RUN_FILE = "bench-run.json"

#: The parts of a bench run (`extkv bench --part`), each its own modules of
#: bench/ and its own result files. One GPU run of both does not fit a
#: machine's ten minutes: on an H100 the engine-level benches took about
#: 200 s and the cases their 520 s budget, so a reference run measures
#: them as two runs into one directory. A part's run records itself under
#: names of its own (`run_file`, `harness_step`), so that each part's
#: sections read whether their own run ended on its own and what it selected.
PARTS: dict[str, dict[str, tuple[str, ...]]] = {
    "cases": {
        "modules": ("bench_kv.py",),
        "files": (BENCH_JSON, CASES_FILE, "bench_scaling_*.png"),
    },
    "engines": {
        "modules": ("bench_budget.py", "bench_decode.py", "bench_growth.py"),
        "files": (BUDGET_FILE, DECODE_FILE, GROWTH_FILE),
    },
}


def part_of(module: str) -> str:
    """The part that bench module `module` (a file name) belongs to."""
    for name, part in PARTS.items():
        if module in part["modules"]:
            return name
    raise ValueError(f"bench module {module!r} is in no part of PARTS")


def run_file(part: str | None) -> str:
    """The run record of a run of `part` (None: of the whole bench)."""
    return RUN_FILE if part is None else f"bench-run-{part}.json"


def harness_step(part: str | None) -> str:
    """The harness's step name for a run of `part` (None: of the whole bench)."""
    return HARNESS_STEP if part is None else f"{HARNESS_STEP}-{part}"


def record_of(run_dir: Path, part: str) -> tuple[str, str]:
    """(run file, harness step) that tell how the run that wrote `part`'s
    results in `run_dir` went: the part's own run where there was one,
    else the whole bench's."""
    if (Path(run_dir) / run_file(part)).exists():
        return run_file(part), harness_step(part)
    return RUN_FILE, HARNESS_STEP
