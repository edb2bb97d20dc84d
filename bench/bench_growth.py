"""A decode loop whose KV cache grows from an eighth to full, with inline
commits, with commit-ahead, with one handle per granule and without growth
(extkv.benchmarking.growth_loop), written to the run directory's
bench_growth.json for the bench's report."""

from __future__ import annotations

import json

from extkv.benchmarking import growth_loop
from extkv.benchmarking.result_files import GROWTH_FILE


def test_growth_loop(bench_run):
    profile, device, run_dir = bench_run
    result = growth_loop.run(device, profile, progress=lambda line: print(f"bench {line}", flush=True))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / GROWTH_FILE).write_text(json.dumps(result, indent=1) + "\n")
    assert set(result["modes"]) == set(growth_loop.MODES + growth_loop.APART_MODES)
    assert all("fresh_p50_s" in result["modes"][mode] for mode in growth_loop.MODES)
    assert all(mode["p50_s"] > 0 for mode in result["modes"].values())
