"""The bench's two parts (extkv.benchmarking.result_files.PARTS): each part
runs its own modules, `--overwrite` of a part replaces that part's files and
keeps the other's, and each part's sections read their own run's record."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from extkv.benchmarking.report import budget_result, partial_reason
from extkv.benchmarking.result_files import PARTS, RUN_FILE, harness_step, part_of, run_file
from extkv.benchmarking.run import drop_whole_run_records, own_files
from extkv.runs.rundir import prepare_run_directory, suite_directory

pytestmark = pytest.mark.harness

BENCH = suite_directory("bench")


def test_every_bench_module_is_in_exactly_one_part():
    modules = sorted(path.name for path in BENCH.glob("bench_*.py"))
    in_parts = sorted(module for part in PARTS.values() for module in part["modules"])
    assert in_parts == modules, f"bench modules {modules}, in the parts {in_parts}"
    with pytest.raises(ValueError, match="bench module 'bench_new.py' is in no part"):
        part_of("bench_new.py")


def files_of_both_parts(directory: Path) -> list[str]:
    names = ["bench.json", "bench_cases.json", "bench_scaling_bytes.png", "bench_budget.json", "bench_decode.json",
             "bench_growth.json", run_file("cases"), f"{harness_step('cases')}.json", run_file("engines"),
             f"{harness_step('engines')}.json", "summary.md", "machine.json", "check-host.json"]
    directory.mkdir()
    for name in names:
        (directory / name).write_text("{}")
    return names


@pytest.mark.parametrize("part", ["cases", "engines"])
def test_overwriting_one_part_keeps_the_other_part_s_results(tmp_path, part):
    names = files_of_both_parts(tmp_path / "run")
    prepare_run_directory(tmp_path / "run", {"gpus": []}, True, own_files(part))
    left = sorted(path.name for path in (tmp_path / "run").iterdir())
    other = "engines" if part == "cases" else "cases"
    gone = {name for name in names if name not in left}
    assert run_file(other) in left and f"{harness_step(other)}.json" in left, left
    assert {"machine.json", "check-host.json"} <= set(left), "another kind of run's files were removed"
    for name in PARTS[other]["files"]:
        assert any(Path(kept).match(name) for kept in left), f"{name} of the {other} part was removed: {left}"
    assert gone == {name for name in names if any(Path(name).match(own) for own in own_files(part))}, gone
    assert {run_file(part), "summary.md"} <= gone, gone


def test_overwriting_the_whole_bench_replaces_both_parts(tmp_path):
    names = files_of_both_parts(tmp_path / "run")
    prepare_run_directory(tmp_path / "run", {"gpus": []}, True, own_files(None))
    left = sorted(path.name for path in (tmp_path / "run").iterdir())
    assert left == ["check-host.json", "machine.json"], left
    assert len(names) - len(left) == 11


def record(directory: Path, name: str, **fields) -> None:
    (directory / name).write_text(json.dumps({"pytest": ["python", "-m", "pytest", "bench"]} | fields))


def test_each_part_reads_its_own_run_record(tmp_path):
    """A cases run that ended on its own beside an engines run a signal
    ended: the cases are complete and the engines are not; a part with no
    record of its own reads the whole bench's."""
    record(tmp_path, run_file("cases"), exit_status=0)
    record(tmp_path, run_file("engines"), exit_status=2, interrupted="SIGINT")
    assert partial_reason(tmp_path, "cases") is None
    assert partial_reason(tmp_path, "engines") == "INTERRUPTED by SIGINT"
    (tmp_path / run_file("engines")).unlink()
    record(tmp_path, RUN_FILE, exit_status=3)
    assert partial_reason(tmp_path, "engines") == "pytest ended with exit status 3"
    assert partial_reason(tmp_path, "cases") is None


def test_the_budget_is_judged_by_the_selection_of_the_run_that_measured_it(tmp_path):
    (tmp_path / "bench_budget.json").write_text(json.dumps({"profile": "gpu"}))
    record(tmp_path, run_file("cases"), exit_status=0)
    record(tmp_path, run_file("engines"), exit_status=0, pytest=["python", "-m", "pytest", "bench", "-k", "grant"])
    assert budget_result(tmp_path, None)[1] == "narrowed by -k grant"
    record(tmp_path, run_file("engines"), exit_status=0)
    assert budget_result(tmp_path, None)[1] is None


@pytest.mark.parametrize("part", ["cases", "engines"])
def test_a_part_collects_its_own_modules_only(tmp_path, part):
    command = [sys.executable, "-m", "pytest", str(BENCH), "-q", "-p", "no:cacheprovider", "--collect-only",
               "-o", "python_files=bench_*.py", "--extkv-bench-profile=quick", f"--extkv-bench-dir={tmp_path}",
               f"--extkv-bench-part={part}"]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=BENCH.parent)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    collected = [line.split("::")[0] for line in finished.stdout.splitlines() if "::" in line]
    assert collected and {Path(path).name for path in collected} == set(PARTS[part]["modules"]), collected


def test_a_whole_run_s_records_go_once_every_part_has_its_own(tmp_path):
    """A reference re-made part by part over a whole run leaves no record
    that describes none of its results; one part's record alone keeps the
    whole run's, which the other part's results still rest on."""
    whole = [RUN_FILE, f"{harness_step(None)}.json"]
    for name in [*whole, run_file("cases")]:
        (tmp_path / name).write_text("{}")
    drop_whole_run_records(tmp_path)
    assert all((tmp_path / name).exists() for name in whole), "the engines' results still rest on the whole run's record"
    (tmp_path / run_file("engines")).write_text("{}")
    drop_whole_run_records(tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted([run_file("cases"), run_file("engines")])
