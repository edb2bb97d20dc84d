"""docs/INVARIANTS.md, the page that says what `extkv check` certifies, held
to the code: for each invariant the test modules it names are exactly those
whose tests carry that invariant's marker, and its table of what each kind of
device can prove is extkv.testing.invariants.DEVICE_KINDS."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from extkv.reporting.rundir import checkout_root
from extkv.testing.invariants import DEVICE_KINDS, INVARIANTS

CONFORMANCE = Path(__file__).resolve().parent


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
    return (root / "docs" / "INVARIANTS.md").read_text()


def test_each_invariant_names_the_modules_that_prove_it(page):
    modules = {path.name: marked_invariants(path) for path in CONFORMANCE.glob("test_*.py")}
    for number in INVARIANTS:
        entry = re.search(rf"(?ms)^{number}\. \*\*.*?Proven by: (.*?)\.\n", page)
        assert entry, f"docs/INVARIANTS.md has no entry `{number}. **...** ... Proven by: ...` for invariant {number}"
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
