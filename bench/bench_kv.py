"""Benchmarks of extkv's KV cache against raw driver sequences and peers.

One test per (case, contender) of the profile's catalogue
(extkv.benchmarking.cases.catalogue, parametrized by bench/conftest.py),
in priority order. The session's
engine measures a case's contenders together, interleaved, the first time
one of them is asked for; each test hands its contender's rounds to
pytest-benchmark. A contender that could not run is a skip with the reason
(bench_cases.json keeps it for the report); one that failed fails the test.
"""

from __future__ import annotations

import pytest

from extkv.benchmarking.playback import record


def test_bench(benchmark, bench_engine, bench_case, contender):
    measurement = bench_engine.measure(bench_case)[contender]
    if measurement.status == "not run":
        pytest.skip(f"{contender} not run: {measurement.reason}")
    if measurement.status == "failed":
        pytest.fail(f"{contender} failed in {bench_case.id}: {measurement.reason}", pytrace=False)
    record(benchmark, bench_case, measurement)
