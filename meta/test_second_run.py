"""The second run of a test whose only failure is its context's own growth
(extkv.testing.second_run), shown on the host with ContextGrowth raised by
hand: there, nothing grows by itself, so the checks never raise it."""

from __future__ import annotations

import ast
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

from extkv.check.report import check_section, load_check
from extkv.check.verdict import run_verdict
from extkv.testing.record import SECOND_RUN_PROPERTY

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.harness

#: Each test counts its runs in a file of its own, then fails as its name says.
TESTS = '''
import pathlib
import pytest
from extkv.testing.checks import ContextGrowth

STEP = 2 << 20


def runs(name):
    path = pathlib.Path(name + ".runs")
    count = int(path.read_text()) + 1 if path.exists() else 1
    path.write_text(str(count))
    return count


def test_grows_on_its_first_run_only():
    if runs("first_only") == 1:
        raise ContextGrowth("test leaked: 0 -> 2097152 bytes", STEP)


def test_grows_at_every_run():
    runs("every")
    raise ContextGrowth("test leaked: 0 -> 2097152 bytes", STEP)


def test_fails_otherwise():
    runs("otherwise")
    assert 1 == 2


@pytest.fixture
def leak_check_growing_once():
    yield
    if runs("teardown") == 1:
        raise ContextGrowth("test leaked: 0 -> 4194304 bytes", 2 * STEP)


def test_whose_teardown_grows_once(leak_check_growing_once):
    pass


@pytest.fixture
def failing_teardown():
    yield
    raise AssertionError("live chunks {} -> {'cuda:0': 1}")


def test_grows_and_fails_its_teardown_too(failing_teardown):
    runs("both")
    raise ContextGrowth("test leaked: 0 -> 2097152 bytes", STEP)


def test_passes():
    runs("passes")
'''


def test_only_a_test_whose_every_failure_is_context_growth_runs_again(pytester, tmp_path):
    pytester.makepyfile(test_growth=TESTS)
    junit = pytester.path / "junit.xml"
    result = pytester.runpytest_inprocess("-p", "extkv.testing.harness", "--extkv", "-p", "no:cacheprovider",
                                          f"--junitxml={junit}", f"--extkv-report-dir={tmp_path}",
                                          "--extkv-report-step=check-host")
    runs = {path.stem: int(path.read_text()) for path in pytester.path.glob("*.runs")}
    assert runs == {"first_only": 2, "every": 2, "otherwise": 1, "teardown": 2, "both": 1, "passes": 1}, runs
    result.assert_outcomes(passed=3, failed=3, errors=1)
    twice = {"test_grows_on_its_first_run_only": 2 << 20, "test_grows_at_every_run": 2 << 20,
             "test_whose_teardown_grows_once": 4 << 20}
    second = {case.get("name"): [p.get("value") for p in case.iter("property") if p.get("name") == SECOND_RUN_PROPERTY]
              for case in ElementTree.parse(junit).iter("testcase")}
    assert second == {name: [str(twice[name])] if name in twice else [] for name in second} and len(second) == 6, second
    result.stdout.fnmatch_lines(["*_ test_grows_at_every_run _*", "E *ContextGrowth: test leaked: 0 -> 2097152 bytes",
                                 "FAILED test_growth.py::test_grows_at_every_run - *"])
    check = load_check(tmp_path)
    recorded = {key.split("::")[1]: (test["second_run"], test["outcome"]) for key, test in check["tests"].items()
                if test["second_run"]}
    assert recorded == {"test_grows_on_its_first_run_only": (2 << 20, "passed"),
                        "test_grows_at_every_run": (2 << 20, "failed"),
                        "test_whose_teardown_grows_once": (4 << 20, "passed")}, recorded
    assert "3 tests ran twice: the first run read only the context's own growth; the second is the outcome " \
           "(the report lists them)" in run_verdict(check, None), run_verdict(check, None)
    section = check_section(check, [], None).splitlines()
    listed = section[section.index("### Tests run twice") + 4:][:3]
    assert listed == [
        "- `test_growth.py::test_grows_on_its_first_run_only` (host): the first run read 2097152 bytes above its "
        "baseline; the second passed",
        "- `test_growth.py::test_grows_at_every_run` (host): the first run read 2097152 bytes above its baseline; "
        "the second failed",
        "- `test_growth.py::test_whose_teardown_grows_once` (host): the first run read 4194304 bytes above its "
        "baseline; the second passed",
    ], section


def test_a_reading_above_by_whole_steps_is_context_growth_only_where_the_context_grows_by_itself():
    import torch

    from extkv.testing.checks import ContextGrowth, usage_mismatch
    from extkv.usage import UsageProbe

    host = UsageProbe("cpu")
    assert host.lazy_growth_step == 0
    assert type(usage_mismatch(host, "host", 2 << 20)) is AssertionError
    if not torch.cuda.is_available():
        pytest.skip("the rest needs a CUDA GPU: torch.cuda.is_available() is False")
    gpu = UsageProbe("cuda:0")
    step = gpu.lazy_growth_step
    assert step == 2 << 20, step
    kinds = {excess: type(usage_mismatch(gpu, "gpu", excess)).__name__ for excess in (step, 3 * step, step // 2, -step)}
    assert kinds == {step: "ContextGrowth", 3 * step: "ContextGrowth", step // 2: "AssertionError",
                     -step: "AssertionError"}, kinds
    assert usage_mismatch(gpu, "gpu", 3 * step).excess == 3 * step
    assert issubclass(ContextGrowth, AssertionError)


def bare_usage_asserts(source: str) -> list[int]:
    """Lines of `assert` statements that read usage from outside
    (`read_outside_torch()`) themselves: a failing one raises a plain
    AssertionError, so the second run never tells a context's growth from
    a leak there."""
    return [node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Assert)
            and any(isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                    and call.func.attr == "read_outside_torch" for call in ast.walk(node.test))]


def test_the_suite_compares_usage_only_through_the_checks_that_name_context_growth():
    suite = Path(__file__).resolve().parents[1] / "conformance"
    found = {path.name: lines for path in sorted(suite.glob("*.py")) if (lines := bare_usage_asserts(path.read_text()))}
    assert found == {}, f"asserts on usage read from outside, by module and line: {found}; use checks.check_usage_matches"
    planted = "def test_x(usage, baseline):\n    assert usage.read_outside_torch() == baseline\n"
    assert bare_usage_asserts(planted) == [2]
    assert bare_usage_asserts("check_usage_matches(usage, baseline, [])\nassert baseline == 0\n") == []
