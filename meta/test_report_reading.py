"""Reports read in a minute: the verdict on the first screen, a run that
judges nothing judging nothing, no path of the machine that made them.

The committed references (reports/reference/<kind>/) are rendered again
from their stored results, in a copy: their first screen holds each run's
verdict and the table of extkv against each contender, their text names the
extkv build and its commit and no directory of any machine, and the
committed summary.md is exactly what rendering makes of the stored results.
A smoke bench run, one whose rounds were capped and one narrowed (by an
option or a test path), written file by file as `extkv bench` leaves them,
show their readings and no met or missed; a narrowed check judges no
device, a narrowed stress run passes nothing."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from extkv.benchmarking.result_files import BENCH_JSON, CASES_FILE, HARNESS_STEP, RUN_FILE
from extkv.check.report import load_check
from extkv.check.verdict import front_lines
from extkv.report import render_report
from extkv.runs.machine import read_machine_facts
from extkv.runs.results import CHECK_FORMAT
from extkv.runs.rundir import checkout_root

#: Every test here checks extkv's own tooling: benchmarks, reports, the command line.
pytestmark = pytest.mark.harness

REFERENCES = Path(__file__).resolve().parents[1] / "reports" / "reference"
KINDS = sorted(path.name for path in REFERENCES.iterdir() if (path / "summary.md").is_file())
#: The lines a reader sees before scrolling.
FIRST_SCREEN = 40
#: Words of a verdict on a target, which a run that judges nothing never prints.
JUDGING = re.compile(r"\b(met|missed|MISSED)\b")


@pytest.fixture(scope="module", params=KINDS)
def reference(request, tmp_path_factory) -> tuple[Path, str]:
    """(the committed reference directory, its summary rendered again in a copy)."""
    committed = REFERENCES / request.param
    copy = tmp_path_factory.mktemp("reference") / request.param
    shutil.copytree(committed, copy)
    return committed, render_report(copy).read_text()


def test_a_references_first_screen_holds_every_verdict_and_the_contender_table(reference):
    committed, summary = reference
    screen = summary.splitlines()[:FIRST_SCREEN]
    text = "\n".join(screen)
    assert "## Verdict" in screen, text
    assert any(line.startswith("**Check: CERTIFIED ") for line in screen), text
    assert any(line.startswith("- host driver (") and "proven" in line for line in screen), text
    assert any(line.startswith("**Benchmarks: targets ") and " met, " in line for line in screen), text
    assert "| extkv against | operation | bound |" in text, text
    for contender in ("raw driver sequence", "memset", "torch_memory_saver", "torch expandable_segments",
                      "one handle per 2 MiB granule", "allocate + copy"):
        assert re.search(rf"(?m)^\| {re.escape(contender)}", text), f"no row for {contender}:\n{text}"
    assert any(line.startswith("**Stress: PASSED") for line in screen), text
    assert "## Machine" not in screen[:screen.index("## Verdict")], "the verdict comes before the detail"


def test_a_reference_names_its_build_and_no_path_of_any_machine(reference):
    committed, summary = reference
    check = load_check(committed)  # the facts the report names: the check's, else machine.json
    facts = check["machine"] if check is not None else read_machine_facts(committed)
    commit = re.escape(facts["extkv_commit"])
    assert re.search(rf"(?m)^extkv \d+\.\d+\S* .*at commit {commit}, on ", summary), summary[:600]
    assert "unknown (not installed)" not in summary
    for path in ("/work/", "/home/", "/tmp/", str(checkout_root()), str(REFERENCES)):
        found = [line for line in summary.splitlines() if path in line]
        assert not found, f"{len(found)} lines name {path}, the first: {found[0][:300]}"


def test_a_committed_reference_is_what_rendering_makes_of_its_stored_results(reference):
    committed, summary = reference
    assert (committed / "summary.md").read_text() == summary, (
        f"{committed}/summary.md differs from its results rendered again: run `extkv report {committed}`")


def write_bench_run(run_dir: Path, profile: str, pytest_arguments: list[str], selected: list[str] | None = None,
                    rounds_given: bool = False) -> Path:
    """A run directory of one 1 GiB 8-step growth in which extkv took twice
    the raw sequence's time (a target missed by 90%), as the engine,
    pytest-benchmark and `extkv bench` (bench-run.json) write it; where
    `selected` is given, with the harness's record of the run, in which
    pytest took those positional arguments; `rounds_given`: as `--rounds 2`
    leaves it."""
    walls = {"extkv": [0.002, 0.003], "raw": [0.001, 0.001]}
    case = {"case": "grow8-blhnc1-1GiB-recycled", "op": "grow8", "op_what": "growth", "pivot": "memset",
            "contenders": list(walls), "geometry": "blhnc1", "geometry_what": "g", "segments": 1, "blocks": 8,
            "capacity_blocks": 8, "bytes": 1 << 30, "smallest_segment_bytes": 1 << 30, "commits": 8, "replays": 0,
            "state": "recycled", "order": ["extkv", "raw", "raw", "extkv"],
            "results": {name: {"status": "measured", "reason": ""} for name in walls}}
    facts = {"profile": profile, "profile_what": f"the {profile} profile", "device": "cpu",
             "device_description": {}, "host": "h", "torch": "t", "granularity": 2 << 20, "rounds": 2,
             "rounds_given": rounds_given, "case_seconds": 2.0, "costly_rounds": 2, "elapsed_seconds": 1.0, "budget_seconds": 60.0,
             "clocks": ["c"], "cpu_time": "thread_time", "cases": [case]}
    run_dir.mkdir(parents=True)
    (run_dir / CASES_FILE).write_text(json.dumps(facts))
    benchmarks = [{"name": f"test_bench[{case['case']}-{name}]",
                   "extra_info": {"case": case["case"], "contender": name, "process": "main", "cpu": wall},
                   "stats": {"data": wall}} for name, wall in walls.items()]
    (run_dir / BENCH_JSON).write_text(json.dumps({"benchmarks": benchmarks}))
    command = ["python", "-m", "pytest", "reports", "-q", "-s", "-o", "python_files=bench_*.py", *pytest_arguments]
    (run_dir / RUN_FILE).write_text(json.dumps({"pytest": command, "exit_status": 0}))
    if selected is not None:
        record = {"format": CHECK_FORMAT, "step": HARNESS_STEP, "machine": {"gpus": []}, "invariants": {},
                  "totals": {}, "exit_status": 0, "devices": {}, "selection": {"args": selected},
                  "collection_errors": [], "worker_gpus": {}, "tests": {}}
        (run_dir / f"{HARNESS_STEP}.json").write_text(json.dumps(record))
    return run_dir


#: Options of pytest whose value is an argument of its own, which a reading
#: of the command could take for a test path: `/dev/null` is one.
VALUED_OPTIONS = ["-p", "no:cacheprovider", "-W", "error", "-c", "/dev/null", "--rootdir", "bench", "-n", "2"]


@pytest.mark.parametrize("profile, arguments, selected, rounds_given, said", [
    ("quick", [], None, False, "Not a verdict: profile quick: the quick profile"),
    ("gpu", ["-k", "grow8"], None, False, "Not a verdict: narrowed by -k grow8"),
    ("gpu", ["--deselect=bench/bench_kv.py::test_bench", "-x"], None, False, "Not a verdict: narrowed by --deselect "
     "bench/bench_kv.py::test_bench, -x"),
    ("gpu", [*VALUED_OPTIONS, "bench/bench_kv.py"], ["reports", "bench/bench_kv.py"], False,
     "Not a verdict: narrowed by path bench/bench_kv.py"),
    ("gpu", ["bench/bench_kv.py::test_bench", "-k", "grow8"], ["reports", "bench/bench_kv.py::test_bench"], False,
     "Not a verdict: narrowed by -k grow8, path bench/bench_kv.py::test_bench"),
    ("gpu", [], ["reports"], True, "Not a verdict: rounds capped at 2"),
    ("quick", [], ["reports"], True, "Not a verdict: profile quick: the quick profile; rounds capped at 2"),
], ids=["smoke", "keyword", "deselected", "path", "test-and-keyword", "rounds-capped", "smoke-rounds-capped"])
def test_a_smoke_or_narrowed_bench_run_shows_readings_and_judges_nothing(
        tmp_path, profile, arguments, selected, rounds_given, said):
    run_dir = write_bench_run(tmp_path / "run", profile, arguments, selected, rounds_given)
    summary = render_report(run_dir).read_text()
    front = "\n".join(summary.splitlines()[:FIRST_SCREEN])
    assert "**Benchmarks: not a verdict: " in front and "| raw driver sequence | 8-step growth | <= 1.05x | 2.00x |" in (
        front), front
    assert f"**{said}.**" in summary, summary[:2000]
    assert "| 2.00x, not judged |" in summary, "the target's reading is shown, as a reading"
    judged = [line for line in summary.splitlines() if JUDGING.search(line)]
    assert not judged, f"{len(judged)} lines judge: " + "\n".join(judged[:5])


@pytest.mark.parametrize("arguments, selected", [
    ([], None),
    (VALUED_OPTIONS, ["reports"]),
], ids=["no-harness-record", "options-with-values"])
def test_the_same_run_whole_is_judged(tmp_path, arguments, selected):
    """The yardstick of the test above: unnarrowed, the same results miss
    the target, whatever values its options take (the suite itself, `-o
    python_files=bench_*.py`, `-c /dev/null` are no test paths)."""
    summary = render_report(write_bench_run(tmp_path / "run", "gpu", arguments, selected)).read_text()
    assert "**Benchmarks: targets 0 met, 1 missed, 0 not measured**" in summary, summary[:2000]
    assert "missed by 90%: 2.00x" in summary


def narrowed_check(keyword: str | None) -> dict:
    """Merged check results (extkv.check.report.load_check's shape) of
    one host step, one test passed and one failed, `-k keyword` where given."""
    record = {"device": "host", "invariants": [1], "planted_defect": None, "duration_s": 0.1, "message": None,
              "skip_reason": None}
    selection = {"args": ["conformance"]} | ({"keyword": keyword} if keyword else {})
    step = {"selection": selection, "collection_errors": [], "exit_status": 1}
    return {"steps": {"check-host": step}, "devices": {"host": "host"},
            "machine": {"host": "h", "torch": "t", "host_driver": "Linux 6.18", "gpus": []},
            "tests": {"test_one": record | {"outcome": "passed"}, "test_two": record | {"outcome": "failed"}},
            "run": None}


def test_a_narrowed_check_judges_no_device():
    lines = front_lines(narrowed_check("sizing"), None)
    assert lines[0].startswith("**Check: partial run: nothing certified (narrowed by -k sizing)"), lines
    assert lines[2:] == ["- host driver (Linux 6.18, memfd): 1 passed, 1 failed, 0 skipped"], lines
    whole = front_lines(narrowed_check(None), None)
    assert whole[2].startswith("- host driver (Linux 6.18, memfd): NOT CERTIFIED: 1 failed"), whole


#: A stress run's command as `extkv stress` records it, up to the arguments it hands pytest.
STRESS_COMMAND = ["python", "-m", "pytest", "stress", "-q", "-p", "no:cacheprovider", "--extkv-stress", "-n", "2",
                  "--dist", "each"]


@pytest.mark.parametrize("run, selected, shown", [
    ({"exit_status": 1, "pytest": [*STRESS_COMMAND, "-k", "walk"]}, ["stress"],
     "partial run: not a verdict (narrowed by -k walk); 1 passed, 1 failed, 0 skipped"),
    ({"exit_status": 1, "pytest": [*STRESS_COMMAND, "stress/test_walk.py"]}, ["stress", "stress/test_walk.py"],
     "partial run: not a verdict (narrowed by path stress/test_walk.py); 1 passed, 1 failed, 0 skipped"),
    ({"exit_status": 1, "pytest": STRESS_COMMAND}, ["stress"],
     "NOT PASSED: 1 failed, pytest ended with exit status 1; 1 passed, 1 failed, 0 skipped"),
], ids=["narrowed", "path", "whole"])
def test_a_narrowed_stress_run_judges_nothing(tmp_path, run, selected, shown):
    from meta.test_reporting import stress_run_directory

    summary = render_report(stress_run_directory(tmp_path, ["passed", "error"], run, [], selected)).read_text()
    front = summary.splitlines()[:FIRST_SCREEN]
    assert any(line.startswith(f"**Stress: {shown}** (") for line in front), "\n".join(front)
    assert f"- verdict: **{shown}**" in summary, summary


def test_a_checkout_never_installed_records_the_version_its_pyproject_states(tmp_path):
    """Run from a copy of the checkout's package and pyproject.toml, without
    site-packages (so no installed extkv, and no egg-info an editable
    install leaves in the checkout, can answer), the facts a run records
    name pyproject.toml's version."""
    import subprocess
    import sys

    source = Path(__file__).resolve().parents[1]
    checkout = tmp_path / "checkout"
    shutil.copytree(source / "extkv", checkout / "extkv", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(source / "pyproject.toml", checkout / "pyproject.toml")
    said = subprocess.run(
        [sys.executable, "-I", "-S", "-c",
         f"import sys; sys.path.insert(0, {str(checkout)!r}); "
         "from extkv.testing.facts import extkv_version; print(extkv_version())"],
        capture_output=True, text=True, timeout=120,
    )
    stated = re.search(r'(?m)^version\s*=\s*"([^"]+)"', (checkout / "pyproject.toml").read_text()).group(1)
    assert said.stdout.strip() == f"{stated} (a checkout, not installed)", said.stdout + said.stderr
