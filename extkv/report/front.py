"""A report's front page: whether to turn extkv on, on one screen.

Theory of operation
-------------------
A reader opens summary.md to decide, and the detail (tables per test file,
every benchmark case, how the rounds were run) is for checking that
decision. So the report opens with `front_page`: what ran (the extkv build,
its commit, the devices), then under `## Verdict` each run the directory
holds, its verdict first: the check's certificate line and each device's
verdict (extkv.check.verdict), the stress run's verdict
(extkv.stress.report), then the benchmarks' targets met and missed with
the table of extkv against each contender and the shared budget's
readings (extkv.benchmarking.headline): the one-line verdicts before the
tables, so all of them fit the first screen. A run that judges nothing (a
smoke or narrowed run) says so there, and shows its readings only. The sections follow it:
the machine, then each run's detail, each ending in how it was measured.
"""

from __future__ import annotations

from pathlib import Path

from ..benchmarking.headline import bench_front
from ..check.verdict import front_lines
from ..runs.machine import build_words
from ..stress.report import stress_front


def _devices(facts: dict) -> str:
    """`cuda:0 NVIDIA H200 (driver 580.159.04) and the host driver (Linux 6.18)`."""
    gpus = [f"cuda:{gpu['index']} {gpu['name']} (driver {gpu['driver']})" for gpu in facts["gpus"]]
    return ", ".join(gpus + [f"the host driver ({facts['host_driver']})"])


def front_page(run_dir: Path, facts: dict | None, check: dict | None) -> str:
    """The front page of the report of `run_dir`: `facts`, the machine's
    (None where no run recorded them), `check`, the merged check results
    (extkv.check.report.load_check) or None."""
    run_dir = Path(run_dir)
    lines = [f"# extkv report: {run_dir.name}", ""]
    if facts is not None:
        lines += [f"{build_words(facts)}, on {_devices(facts)}; host `{facts['host']}`.", ""]
    lines += ["## Verdict", ""]
    parts = []
    if check is not None:
        parts.append(front_lines(check, check["run"]))
    for found in (stress_front(run_dir), bench_front(run_dir)):
        if found is not None:
            parts.append(found)
    for part in parts:
        lines += part + [""]
    return "\n".join(lines)
