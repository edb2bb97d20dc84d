"""Reports (extkv.report) rendered from real runs: pytest runs in a
process of its own with the harness writing its results into a run directory, and
the summary's per-invariant, per-device counts are checked against pytest's
own JUnit XML of the same run. One run takes a few conformance tests; a
second, as the multi-GPU step, takes a planted file whose tests pass, fail,
error in teardown and skip, and the timeline test again, so every outcome
and both ways of merging go through the harness, the merge and the table. Bad run directories raise errors that name the file.
The stress section's verdict is read from results written here file by
file, as `extkv stress` leaves them, in every way a run can end."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import xml.etree.ElementTree as ElementTree
from collections import Counter
from pathlib import Path

import pytest

import extkv
from extkv.check.report import ALL_TESTS_ROW, HOST_LABEL as SUMMARY_HOST_LABEL, load_check
from extkv.report import render_report
from extkv.runs.commands import INSTALLED_OPTIONS
from extkv.runs.plots import matplotlib_missing
from extkv.runs.results import CHECK_FORMAT
from extkv.runs.rundir import SUITE_PACKAGES, checkout_root, gpu_slug, run_directory
from extkv.testing.children import python_c
from extkv.testing.harness import INVARIANTS
from extkv.testing.record import DEVICE_PROPERTY, HOST_LABEL, INVARIANTS_PROPERTY, RECORD_FORMAT

#: Every test here checks extkv's own tooling: benchmarks, reports, the command line.
pytestmark = pytest.mark.harness

CONFORMANCE = Path(__file__).resolve().parents[1] / "conformance"
#: Real conformance tests for the first run: invariant 5 on the host
#: (and a skipped or run cuda:0), invariant 6 on the host.
REAL_SELECTION = [str(CONFORMANCE / "test_timeline.py"), str(CONFORMANCE / "test_ranks.py"), "-k", "timeline or rejects"]
PLANTED = '''
import pytest

import extkv

@pytest.mark.invariant(1)
def test_passes(device):
    assert device is not None

@pytest.mark.invariant(1, 6)
def test_fails():
    assert 1 == 2, "planted failure"

@pytest.mark.invariant(6)
def test_skips():
    pytest.skip("planted skip")

@pytest.fixture
def broken_teardown():
    yield
    raise RuntimeError("planted teardown error")

@pytest.mark.invariant(3)
def test_errors_in_teardown(broken_teardown):
    pass

def test_without_invariant():
    pass
'''


def run_pytest(run_dir: Path, step: str, arguments: list[str], rootdir: Path) -> subprocess.CompletedProcess:
    """pytest in a process of its own (`python_c`), as `extkv check` runs it
    from an installed package: the harness as a plugin, no configuration
    file."""
    # An outer xdist worker's variables would make the inner run pin a GPU
    # and call itself a worker.
    environment = {name: value for name, value in os.environ.items() if not name.startswith(("PYTEST_", "XDIST_"))}
    options = ["-q", "-p", "extkv.testing.harness", "-p", "no:cacheprovider"]
    options += ["-c", os.devnull, "--rootdir", str(rootdir), *INSTALLED_OPTIONS]
    options += [f"--junitxml={run_dir / f'{step}-junit.xml'}", f"--extkv-report-dir={run_dir}", f"--extkv-report-step={step}"]
    code = f"import sys, pytest; sys.exit(int(pytest.main({options + arguments!r})))"
    return python_c(code, run_dir.with_name(f"{run_dir.name}-{step}"), environment)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> Path:
    """A run directory from two real runs, rendered; returns it."""
    run_dir = tmp_path_factory.mktemp("run")
    real = run_pytest(run_dir, "check", REAL_SELECTION, CONFORMANCE)
    assert real.returncode == 0, f"the real selection failed:\n{real.stdout[-3000:]}\n{real.stderr[-2000:]}"
    planted_dir = tmp_path_factory.mktemp("planted")
    (planted_dir / "test_planted.py").write_text(PLANTED)
    # The timeline test again, under the same node id: a test both steps ran.
    (planted_dir / "test_timeline.py").write_text((CONFORMANCE / "test_timeline.py").read_text())
    planted = run_pytest(run_dir, "check-multi-gpu", [str(planted_dir)], planted_dir)
    assert planted.returncode == 1, f"the planted failures must fail the run:\n{planted.stdout[-3000:]}"
    render_report(run_dir)
    return run_dir


def junit_outcome(testcase) -> str:
    tags = {child.tag for child in testcase}
    if "failure" in tags:
        return "failed"
    if "error" in tags:
        return "error"
    return "skipped" if "skipped" in tags else "passed"


def junit_counts(run_dir: Path) -> dict[str, dict[str, Counter]]:
    """{row: {device: Counter(outcome)}} from the JUnit XML files alone:
    every step's testcases count, a test two steps ran once in each."""
    testcases = {}
    for step in ("check", "check-multi-gpu"):
        for testcase in ElementTree.parse(run_dir / f"{step}-junit.xml").iter("testcase"):
            properties = {p.get("name"): p.get("value") for p in testcase.iter("property")}
            invariants = ast.literal_eval(properties.get(INVARIANTS_PROPERTY, "[]"))
            found = (invariants, properties[DEVICE_PROPERTY], junit_outcome(testcase))
            testcases[(step, testcase.get("classname"), testcase.get("name"))] = found
    rows: dict[str, dict[str, Counter]] = {}
    for invariants, device, outcome in testcases.values():
        for row in [str(n) for n in invariants] + [ALL_TESTS_ROW]:
            rows.setdefault(row, {}).setdefault(device, Counter())[outcome] += 1
    return rows


def summary_counts(summary: str) -> dict[str, dict[str, tuple[int, int, int]]]:
    """{row: {device: (passed, run, skipped)}} read back from summary.md's table."""
    lines = summary.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| invariant |"))
    devices = [cell.strip() for cell in lines[header].strip("|").split("|")][1:]
    table = {}
    for line in lines[header + 2 :]:
        if not line.startswith("|"):
            break
        name, *cells = [cell.strip() for cell in line.strip("|").split("|")]
        row = ALL_TESTS_ROW if name == ALL_TESTS_ROW else name.split(".")[0]
        for device, cell in zip(devices, cells):
            found = re.fullmatch(r"\**(\d+)/(\d+)(?: \((\d+) skipped\))?\**", cell)
            if found:
                passed, run, skipped = found.groups()
                table.setdefault(row, {})[device] = (int(passed), int(run), int(skipped or 0))
            else:
                assert cell == "-", f"row {row!r}, device {device!r}: cell {cell!r}"
    return table


def test_summary_counts_equal_the_junit_xml(rendered):
    summary = (rendered / "summary.md").read_text()
    from_junit = {
        row: {
            device: (c["passed"], c["passed"] + c["failed"] + c["error"], c["skipped"])
            for device, c in by_device.items()
        }
        for row, by_device in junit_counts(rendered).items()
    }
    assert summary_counts(summary) == from_junit
    # The planted run touched invariants 1, 3 and 6 with every outcome; both
    # runs proved 5 on the host, and both count.
    assert from_junit["5"][HOST_LABEL] == (2, 2, 0)
    assert from_junit["3"][HOST_LABEL] == (0, 1, 0), "a teardown error is a test run and not passed"
    assert from_junit["6"][HOST_LABEL][2] >= 1 and from_junit["6"][HOST_LABEL][1] > from_junit["6"][HOST_LABEL][0]


def test_summary_lists_failures_skips_timeline_and_the_step(rendered):
    summary = (rendered / "summary.md").read_text()
    assert re.search(r"- `[^`]*test_planted.py::test_fails` \(host, failed\): AssertionError: planted failure", summary)
    assert re.search(r"- `[^`]*test_planted.py::test_errors_in_teardown` \(host, error\): .*planted teardown error", summary)
    assert "| 1 | planted skip |" in summary
    assert "### Memory timeline: host" in summary
    if matplotlib_missing() is None:
        assert "(timeline-host.png)" in summary
        assert (rendered / "timeline-host.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:  # the `report` extra is optional: CI's virtualenv has only `test`
        assert f"Plots skipped: {matplotlib_missing()}." in summary and "(timeline-host.png)" not in summary
    step = summary.split("### Multi-GPU step")[1].split("###")[0]
    # The step ran the planted tests and every test of test_timeline.py, as pytest counted them.
    ran = len(list(ElementTree.parse(rendered / "check-multi-gpu-junit.xml").iter("testcase")))
    assert re.search(rf"FAILED: \d+ passed, 2 failed, \d+ skipped, of {ran} tests on ", step), step
    assert re.search(r"test_timeline.py::\S+\[host\] \(check-multi-gpu\)", json.dumps(load_check(rendered)["tests"]))


def test_check_json_matches_its_own_totals(rendered):
    document = json.loads((rendered / "check.json").read_text())
    outcomes = Counter(record["outcome"] for record in document["tests"].values())
    assert document["totals"] == {kind: outcomes[kind] for kind in document["totals"]}
    assert document["machine"]["host"] and document["invariants"] == {str(n): w for n, w in INVARIANTS.items()}
    assert document["devices"][HOST_LABEL] == "host"
    assert document["selection"]["keyword"] == "timeline or rejects", "the run's -k is recorded: it narrows the run"


def test_render_names_the_file_it_cannot_read(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "nowhere"))):
        render_report(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=f"{re.escape(str(tmp_path))}: no results to report"):
        render_report(tmp_path)
    (tmp_path / "check.json").write_text('{"format": "extkv-check/1", "tests": {')
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "check.json")) + ": not JSON"):
        render_report(tmp_path)
    (tmp_path / "check.json").write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "check.json")) + ".*format 'something else'"):
        render_report(tmp_path)


def test_render_names_a_garbled_timeline(rendered, tmp_path):
    for name in ("check.json", "check-multi-gpu.json"):
        (tmp_path / name).write_text((rendered / name).read_text())
    (tmp_path / "timeline-host.json").write_text('{"format": "extkv-timeline/1", "device": "host"}')
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "timeline-host.json")) + ": not a memory timeline"):
        render_report(tmp_path)


def test_without_matplotlib_the_report_says_plots_were_skipped(rendered, tmp_path):
    for path in rendered.glob("*.json"):
        (tmp_path / path.name).write_text(path.read_text())
    blocked = "import sys; sys.modules['matplotlib'] = None; from pathlib import Path; from extkv.report import render_report; "
    result = python_c(blocked + f"render_report(Path({str(tmp_path)!r}))", tmp_path / "render", timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = (tmp_path / "summary.md").read_text()
    assert "Plots skipped: matplotlib is not installed" in summary and "install extkv[report]" in summary
    assert not list(tmp_path.glob("*.png"))


def test_reporting_imports_without_the_test_extra(tmp_path):
    """`extkv info`, `extkv peer` and `extkv report` must not need pytest or hypothesis."""
    blocked = "import sys; sys.modules.update(pytest=None, hypothesis=None, xdist=None); import extkv.cli, extkv.report"
    result = python_c(blocked, tmp_path / "imports", timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_summary_reads_what_the_harness_writes():
    assert CHECK_FORMAT == RECORD_FORMAT and SUMMARY_HOST_LABEL == HOST_LABEL


@pytest.mark.parametrize(
    ("names", "slug"),
    [([], "host"), (["NVIDIA H200"], "h200"), (["NVIDIA H200"] * 2, "2xh200"), (["NVIDIA H200", "NVIDIA A100-SXM4-80GB"], "h200-a100-sxm4-80gb")],
)
def test_run_directory_names_the_machine(names, slug, tmp_path):
    import datetime

    facts = {"host": "Node-7.example.org", "gpus": [{"name": name} for name in names]}
    assert gpu_slug(facts) == slug
    assert run_directory(facts, datetime.date(2026, 11, 30), tmp_path) == tmp_path / f"2026-11-30-node-7-{slug}"


def test_the_distribution_names_every_package_and_the_ini_options():
    """pyproject lists extkv's packages by hand, and every suite rundir finds
    (conformance, bench, stress) as the package it looks for, mapped to its
    directory; check_run repeats its pytest options for installed runs."""
    root = checkout_root()
    if root is None:
        pytest.skip("an installed extkv has no pyproject.toml to compare: checked from a checkout")
    import tomllib

    project = tomllib.loads((root / "pyproject.toml").read_text())
    packages = {".".join(path.parent.relative_to(root).parts) for path in (root / "extkv").rglob("__init__.py")}
    listed = set(project["tool"]["setuptools"]["packages"])
    assert packages <= listed, f"extkv packages missing from pyproject's [tool.setuptools] packages: {sorted(packages - listed)}"
    mapped = project["tool"]["setuptools"]["package-dir"]
    for directory, package in SUITE_PACKAGES.items():
        assert package in listed, f"suite {directory}/ is not shipped: {package!r} missing from pyproject's packages"
        assert mapped.get(package) == directory, f"pyproject maps {package!r} to {mapped.get(package)!r}, expected {directory!r}"
        assert (root / directory).is_dir(), f"suite directory {directory}/ missing from the checkout"
    ini = project["tool"]["pytest"]["ini_options"]
    assert INSTALLED_OPTIONS == ini["addopts"].split() + ["-o", f"timeout={ini['timeout']}"]


def test_a_run_directory_from_anyone_is_read_and_written_as_files_of_its_own(rendered, tmp_path):
    """summary.md that is a symlink is replaced, not written through; a FIFO
    or a link to /dev/zero named like a results file is refused by name,
    without blocking or reading without end."""
    for path in rendered.glob("check*.json"):
        (tmp_path / path.name).write_text(path.read_text())
    outside = tmp_path.parent / f"{tmp_path.name}-outside.txt"
    outside.write_text("not a report")
    (tmp_path / "summary.md").symlink_to(outside)
    render_report(tmp_path)
    assert outside.read_text() == "not a report" and not (tmp_path / "summary.md").is_symlink()
    fifo = tmp_path / "check-fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=re.escape(str(fifo)) + ": not a regular file"):
        render_report(tmp_path)
    fifo.unlink()
    (tmp_path / "check-zero.json").symlink_to("/dev/zero")
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "check-zero.json")) + ": cannot be read as a results file"):
        render_report(tmp_path)


def one_series_bench_run(run_dir: Path) -> Path:
    """A bench run of one operation at two sizes (1 and 2 GiB), as the
    engine and pytest-benchmark write it: enough for the scaling plot."""
    cases, benchmarks = [], []
    for gib in (1, 2):
        case = {"case": f"grow8-blhnc1-{gib}GiB-recycled", "op": "grow8", "op_what": "growth", "pivot": "memset",
                "contenders": ["extkv", "raw"], "geometry": "blhnc1", "geometry_what": "g", "segments": 1,
                "blocks": 8, "capacity_blocks": 8, "bytes": gib << 30, "smallest_segment_bytes": gib << 30,
                "commits": 8, "replays": 0, "state": "recycled", "order": ["extkv", "raw"],
                "results": {name: {"status": "measured", "reason": ""} for name in ("extkv", "raw")}}
        cases.append(case)
        benchmarks += [{"name": f"test_bench[{case['case']}-{name}]",
                        "extra_info": {"case": case["case"], "contender": name, "process": "main", "cpu": [0.001 * gib]},
                        "stats": {"data": [0.001 * gib]}} for name in ("extkv", "raw")]
    facts = {"profile": "gpu", "profile_what": "w", "device": "cuda:0", "device_description": {}, "host": "h",
             "torch": "t", "granularity": 2 << 20, "rounds": 1, "case_seconds": 8.0, "costly_rounds": 2,
             "elapsed_seconds": 1.0, "budget_seconds": 2.0, "clocks": ["c"], "cpu_time": "thread_time", "cases": cases}
    (run_dir / "bench_cases.json").write_text(json.dumps(facts))
    (run_dir / "bench.json").write_text(json.dumps({"benchmarks": benchmarks}))
    return run_dir


def test_every_plot_replaces_a_symlink_planted_at_its_name(rendered, tmp_path):
    """Each PNG a report draws (the check's memory timeline, the bench's
    scaling plot, the stress run's memory plot) is a new file of the run
    directory: a symlink planted at its name is replaced, and the file it
    points to, outside the directory, is left as it was."""
    if matplotlib_missing() is not None:
        pytest.skip(matplotlib_missing())
    from extkv.stress.plots import plot_memory

    for path in [*rendered.glob("check*.json"), rendered / "timeline-host.json"]:
        (tmp_path / path.name).write_text(path.read_text())
    one_series_bench_run(tmp_path)
    stress_timeline = {"worker": "main", "samples": [[0.0, "cpu", 0, 1 << 30], [1.0, "cpu", 4 << 20, 2 << 30]]}
    plots = ["timeline-host.png", "bench_scaling_bytes.png", "stress-memory-main-cpu.png"]
    outside = {}
    for name in plots:
        outside[name] = tmp_path.parent / f"{tmp_path.name}-outside-{name}"
        outside[name].write_text("not a plot")
        (tmp_path / name).symlink_to(outside[name])
    summary = render_report(tmp_path).read_text()
    plot_memory(stress_timeline, "cpu", tmp_path / "stress-memory-main-cpu.png")
    assert "(timeline-host.png)" in summary and "(bench_scaling_bytes.png)" in summary, summary
    for name in plots:
        assert outside[name].read_bytes() == b"not a plot", f"{name} was written through the symlink planted there"
        path = tmp_path / name
        assert not path.is_symlink() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert not list(tmp_path.glob(".*.tmp")), "a temporary file was left behind"


def test_every_plot_is_saved_through_the_run_directory_writer():
    """One writer saves every figure (rundir.save_figure): a plot saved
    with `savefig(path)` elsewhere would write through a planted symlink."""
    root = Path(extkv.__file__).resolve().parent
    found = [
        f"{path.relative_to(root.parent)}:{number}"
        for path in sorted(root.rglob("*.py"))
        if path.name != "rundir.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if ".savefig(" in line
    ]
    assert not found, f"savefig outside extkv.runs.rundir.save_figure: {found}"


def test_a_results_file_json_cannot_hold_is_refused_by_name(tmp_path):
    """JSON nested past the parser's depth, or an integer of more digits
    than Python converts, is a results file that is not JSON, named."""
    check = tmp_path / "check.json"
    for text, words in (("[" * 100_000, "maximum recursion depth exceeded"), ("1" * 5_000, "Exceeds the limit")):
        check.write_text(text)
        with pytest.raises(ValueError, match=re.escape(f"{check}: not JSON (") + f".*{words}"):
            render_report(tmp_path)


def test_pool_writes_its_files_anew_in_a_directory_that_holds_symlinks(tmp_path):
    """Each file `pool` writes (the pooled results, machine.json) replaces a
    symlink planted at its name in the pooled directory, and leaves the
    file it points to, outside, as it was."""
    from extkv.benchmarking.pool import pool

    runs = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        runs.append(one_series_bench_run(tmp_path / name))
    machine = {"host": "h", "gpus": [], "no_gpu_reason": "none here"}
    (runs[0] / "machine.json").write_text(json.dumps(machine))
    out = tmp_path / "out"
    out.mkdir()
    names = ("bench_cases.json", "bench.json", "machine.json")
    for name in names:
        (tmp_path / f"outside-{name}").write_text("not pooled")
        (out / name).symlink_to(tmp_path / f"outside-{name}")
    pool(runs, out)
    for name in names:
        assert (tmp_path / f"outside-{name}").read_text() == "not pooled", f"{name} was written through the symlink"
        assert (out / name).is_file() and not (out / name).is_symlink(), name
    assert json.loads((out / "machine.json").read_text()) == machine


# -- the stress section's verdict -----------------------------------------------------------------
def stress_run_directory(run_dir: Path, outcomes: list[str], run: dict | None, stopped: list[str] = (),
                         selected: list[str] = ("stress",)) -> Path:
    """A stress run's results as `extkv stress` leaves them: a result per
    test of `outcomes` (from the stress suite's conftest), `run` as
    run.json, and the harness's record of the same pytest run, in which
    the tests `stopped` are those a signal stopped (no report of them came)
    and pytest took the positional arguments `selected`."""
    from extkv.testing.stress import StressTally

    tests = run_dir / "stress" / "tests"
    tests.mkdir(parents=True)
    harness_tests = {}
    for number, outcome in enumerate(outcomes):
        nodeid = f"stress/test_walk.py::test_{number}[host]"
        record = {"format": "extkv-stress/1", "nodeid": nodeid, "worker": "main", "device": "host",
                  "device_label": None, "outcome": outcome, "failure": "", "skip_reason": None, "seed": 1,
                  "budget_s": 1.0, "started": float(number), "duration_s": 1.0, "tally": StressTally().to_json()}
        (tests / f"main--test_{number}.json").write_text(json.dumps(record))
        harness_tests[nodeid] = {"device": "host", "invariants": [], "outcome": outcome, "planted_defect": None,
                                 "duration_s": 1.0, "message": "boom" if outcome == "error" else None,
                                 "skip_reason": None}
    for nodeid in stopped:
        harness_tests[nodeid] = {"device": "host", "invariants": [], "outcome": "error", "planted_defect": None,
                                 "duration_s": 1.0, "message": None, "skip_reason": None}
    status = (run or {}).get("exit_status", 0)
    harness = {"format": CHECK_FORMAT, "step": "stress", "machine": {"gpus": []}, "invariants": {}, "totals": {},
               "exit_status": status, "devices": {}, "selection": {"args": list(selected)}, "collection_errors": [],
               "worker_gpus": {}, "tests": harness_tests}
    (run_dir / "stress" / "stress.json").write_text(json.dumps(harness))
    if run is not None:
        (run_dir / "stress" / "run.json").write_text(json.dumps({"started": 0.0, "finished": 1.0, **run}))
    return run_dir


@pytest.mark.parametrize("outcomes, run, stopped, verdict", [
    (["passed", "passed"], {"exit_status": 0}, [], "PASSED: 2 passed, 0 skipped"),
    (["passed", "error"], {"exit_status": 1}, [],
     "NOT PASSED: 1 failed, pytest ended with exit status 1; 1 passed, 1 failed, 0 skipped"),
    (["passed"], {"exit_status": 2}, ["stress/test_walk.py::test_stopped[host]"],
     "NOT PASSED: 1 interrupted, interrupted (pytest exit status 2); 1 passed, 1 interrupted, 0 skipped"),
    (["passed"], {"exit_status": 2, "interrupted": "SIGINT"}, ["stress/test_walk.py::test_stopped[host]"],
     "INTERRUPTED by SIGINT: not passed (the run ended before its bound); 1 passed, 1 interrupted, 0 skipped"),
    (["passed"], {"exit_status": 3}, [], "NOT PASSED: pytest ended with exit status 3; 1 passed, 0 skipped"),
    (["passed"], None, [], "NOT PASSED: no run.json: how the run ended is unknown; 1 passed, 0 skipped"),
    (["skipped"], {"exit_status": 0}, [], "NOT PASSED: no test passed; 0 passed, 1 skipped"),
], ids=["passed", "errored", "stopped", "interrupted", "pytest-error", "no-run-file", "none-passed"])
def test_a_stress_run_passes_only_where_every_test_ran_and_passed(tmp_path, outcomes, run, stopped, verdict):
    """The stress verdict mirrors the check's: a test that erred, a pytest
    a signal stopped or that ended on an error of its own, and a run a
    signal ended pass nothing; a stopped test is `interrupted`, no failure,
    also where the harness holds it as an error without a message."""
    from extkv.stress.report import load_stress, stress_section, stress_verdict

    stress_run_directory(tmp_path, outcomes, run, stopped)
    passed, line = stress_verdict(load_stress(tmp_path))
    assert (passed, line) == (verdict.startswith("PASSED"), verdict)
    section = stress_section(tmp_path)
    assert f"- verdict: **{verdict}**" in section, section
    for nodeid in stopped:
        assert f"| `{nodeid.split('::')[-1]}` | host | interrupted | - |" in section, section
    if stopped:
        assert "1 failed" not in section, section


def test_a_stress_run_a_signal_ended_before_any_test_finished_is_still_reported(tmp_path):
    """No test left a result, only run.json and the harness's record: the
    report renders the stress section, interrupted, rather than refusing a
    directory without results."""
    stress_run_directory(tmp_path, [], {"exit_status": 2, "interrupted": "SIGTERM"},
                         ["stress/test_walk.py::test_stopped[host]"])
    summary = render_report(tmp_path).read_text()
    assert ("- verdict: **INTERRUPTED by SIGTERM: not passed (the run ended before its bound); 0 passed, "
            "1 interrupted, 0 skipped**") in summary, summary
