"""conformance/conftest.py refuses at collection a test the certificate
cannot count: one that names no invariant, or one of extkv's own tooling
(`harness`). Each run here is a real pytest process over a suite of its
own, in a temporary directory, whose conftest is conformance/conftest.py
itself; the tests in it do nothing, so only collection decides."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

#: Every test here checks extkv's own tooling: the certified suite's collection.
pytestmark = pytest.mark.harness

CHECKOUT = Path(__file__).resolve().parents[1]

MIXED = '''
import pytest

@pytest.mark.invariant(6)
def test_proves():
    pass

def test_names_nothing():
    pass

@pytest.mark.invariant(5)
@pytest.mark.harness
def test_of_the_tooling():
    pass
'''

PROVING = '''
import pytest

@pytest.mark.invariant(1)
@pytest.mark.parametrize("n", [1, 2])
def test_proves(n):
    pass
'''

TOOLING = '''
def test_of_the_tooling_beside():
    pass
'''


def suite(root: Path, certified: str, beside: str | None = None) -> Path:
    """`root/conformance` with conformance/conftest.py and `certified` as its
    one test module; `root/meta` with `beside`, under no such conftest."""
    (root / "conformance").mkdir()
    shutil.copy(CHECKOUT / "conformance" / "conftest.py", root / "conformance" / "conftest.py")
    (root / "conformance" / "test_certified.py").write_text(certified)
    if beside is not None:
        (root / "meta").mkdir()
        (root / "meta" / "test_beside.py").write_text(beside)
    return root


def run_pytest(root: Path, *args: str) -> subprocess.CompletedProcess:
    # An outer xdist worker's variables would make the inner run call itself a worker.
    env = {name: value for name, value in os.environ.items() if not name.startswith(("PYTEST_", "XDIST_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CHECKOUT), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-c", os.devnull, "--rootdir", str(root),
               "--strict-markers", "-q", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=root)


def test_a_test_that_names_no_invariant_or_is_tooling_is_refused_by_name(tmp_path):
    """Collected as `extkv check` collects (xdist, a report directory): the
    module fails to collect, naming both tests it cannot count and not the
    one it can, nothing runs, and the run's record holds the error."""
    root = suite(tmp_path, MIXED)
    report = tmp_path / "report"
    result = run_pytest(root, "conformance", "-n", "1", f"--extkv-report-dir={report}", "--extkv-report-step=check-host")
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "1 error in" in output, f"exit status {result.returncode}:\n{output[-3000:]}"
    assert "conformance/test_certified.py::test_names_nothing names no invariant" in output, output[-3000:]
    assert "conformance/test_certified.py::test_of_the_tooling carries `harness`" in output, output[-3000:]
    assert "test_proves" not in output and " passed" not in output, output[-3000:]
    (error,) = json.loads((report / "check-host.json").read_text())["collection_errors"]
    assert error["nodeid"] == "conformance/test_certified.py", error
    assert error["message"] == (
        "not certifiable: conformance/test_certified.py::test_names_nothing, "
        "conformance/test_certified.py::test_of_the_tooling"
    ), error


def test_tests_that_name_their_invariant_run_and_a_sibling_suite_is_left_alone(tmp_path):
    """The README's test command collects meta/ beside conformance/ in one
    session: the refusal is conformance's alone."""
    root = suite(tmp_path, PROVING, beside=TOOLING)
    result = run_pytest(root, "conformance", "meta")
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "3 passed" in result.stdout, result.stdout[-3000:]
