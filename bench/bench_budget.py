"""The shared KV budget's costs: a grant's round trip, what the budget adds
to a commit, a reclaim from an idle engine (extkv.benchmarking.budget_bench),
and two engines in alternating bursts against a static half each, with what
they held together read from outside (extkv.benchmarking.budget_bursts),
written to the run directory's bench_budget.json for the bench's report."""

from __future__ import annotations

import json

from extkv.benchmarking import budget_bench, budget_bursts
from extkv.benchmarking.result_files import BUDGET_FILE


def test_shared_budget(bench_run):
    profile, device, run_dir = bench_run
    progress = lambda line: print(f"bench {line}", flush=True)  # noqa: E731
    result = budget_bench.run(device, profile, progress=progress)
    result["bursts"] = budget_bursts.run(device, profile, progress=progress)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / BUDGET_FILE).write_text(json.dumps(result, indent=1) + "\n")
    setting = budget_bench.setting_for(profile)
    assert len(result["grant"]["rounds"]) == setting.grant_rounds
    assert [len(commit["budgeted_s"]) for commit in result["commits"]] == \
        [setting.commit_rounds] * len(setting.commit_bytes)
    assert len(result["reclaim"]["grant_s"]) == setting.reclaim_rounds
    bursts = budget_bursts.setting_for(profile)
    assert [[len(rounds[mode]["bursts"]) for mode in budget_bursts.MODES] for rounds in result["bursts"]["rounds"]] \
        == [[bursts.bursts] * len(budget_bursts.MODES)] * bursts.rounds
