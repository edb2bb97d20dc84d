"""The names of the files a bench run leaves in its run directory.

Theory of operation
-------------------
The engine, pytest-benchmark and the decode, growth-loop and budget
benches write these files; `extkv report` reads them. The names live
here, apart from the code that writes them (which imports torch), so that
reading a run back needs no device library.
"""

from __future__ import annotations

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
