"""docs/guarantees.md, the page that says what `extkv check` certifies, held
to the code: for each invariant the test modules it names are exactly those
whose tests carry that invariant's marker, and its table of what each kind of
device can prove is extkv.testing.invariants.DEVICE_KINDS. So that those
lists are whole, every test of the suite says what it is for: it proves
invariants (`invariant`), plants a defect (`planted_defect`) or checks extkv's
own tooling (`harness`)."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from extkv.runs.rundir import checkout_root
from extkv.testing.invariants import DEVICE_KINDS, INVARIANTS

pytestmark = pytest.mark.harness

ROOT = Path(__file__).resolve().parent.parent
#: The suite whose markers the page names; the tooling's tests (meta/) say what they are for too.
CONFORMANCE = ROOT / "conformance"
SUITES = (CONFORMANCE, ROOT / "meta")
#: The markers that say what a test is for: one of them on every test.
PURPOSE_MARKERS = ("invariant", "planted_defect", "harness")


def marked_invariants(path: Path) -> set[int]:
    """Invariant numbers of every `pytest.mark.invariant(...)` in the module's code (not in its strings)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "invariant":
            found |= {arg.value for arg in node.args if isinstance(arg, ast.Constant)}
    return found


@pytest.fixture(scope="module")
def page() -> str:
    root = checkout_root()
    if root is None:
        pytest.skip("an installed extkv carries no docs/: checked from a checkout")
    return (root / "docs" / "guarantees.md").read_text()


def test_each_invariant_names_the_modules_that_prove_it(page):
    modules = {path.name: marked_invariants(path) for path in CONFORMANCE.glob("test_*.py")}
    for number in INVARIANTS:
        entry = re.search(rf"(?ms)^{number}\. \*\*.*?Proven by: (.*?)\.\n", page)
        assert entry, f"docs/guarantees.md has no entry `{number}. **...** ... Proven by: ...` for invariant {number}"
        named = set(re.findall(r"`(test_\w+\.py)`", entry.group(1)))
        proving = {name for name, numbers in modules.items() if number in numbers}
        assert named == proving, (
            f"invariant {number}: the page names {sorted(named - proving)} that prove nothing of it"
            f" and misses {sorted(proving - named)}"
        )


def test_the_page_says_which_device_kind_proves_which(page):
    rows = dict(re.findall(r"(?m)^\| (\d) \| (.*) \|$", page))
    assert sorted(map(int, rows)) == sorted(INVARIANTS)
    for number, cells in rows.items():
        said = [cell.strip().startswith("yes") for cell in cells.split("|")]
        assert said == [int(number) not in kind.cannot for kind in DEVICE_KINDS.values()], f"row {number}: {cells}"


def _names(marks) -> set[str]:
    if not isinstance(marks, (list, tuple)):
        marks = [marks]
    return {mark.name for mark in marks}


def carries_a_purpose(function, module_marks: set[str]) -> bool:
    """Whether every test `function` generates carries a purpose marker: on
    the function or its module, or on every parameter of one parametrize."""
    marks = getattr(function, "pytestmark", [])
    if (module_marks | _names(marks)) & set(PURPOSE_MARKERS):
        return True
    for mark in marks:
        if mark.name == "parametrize" and len(mark.args) > 1:
            values = list(mark.args[1])
            if values and all(_names(getattr(value, "marks", ())) & set(PURPOSE_MARKERS) for value in values):
                return True
    return False


def unmarked_tests(path: Path) -> list[str]:
    """`module::test` of each top-level test function of the module at `path`
    that carries no purpose marker."""
    tree = ast.parse(path.read_text())
    names = [
        node.name for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test")
    ]
    module = importlib.import_module(f"{path.parent.name}.{path.stem}")
    module_marks = _names(getattr(module, "pytestmark", []))
    return [f"{path.name}::{name}" for name in names if not carries_a_purpose(getattr(module, name), module_marks)]


def test_every_test_says_what_it_is_for():
    paths = sorted(path for suite in SUITES for path in suite.glob("test_*.py"))
    unmarked = [test for path in paths for test in unmarked_tests(path)]
    assert not unmarked, (
        f"{len(unmarked)} tests carry none of the markers {', '.join(PURPOSE_MARKERS)}:\n" + "\n".join(unmarked)
    )
