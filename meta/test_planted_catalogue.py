"""The catalogue of planted defects (extkv.testing.planted) against the tests
that plant them (conformance/test_planted_defects.py): every defect is
planted by a test, every test plants a known defect, and each such test
carries exactly the invariants its defect says it breaks, so that the
certificate counts a caught defect under the invariant whose check caught
it. This checks the suite's bookkeeping, not the cache."""

from __future__ import annotations

import importlib
import re

import pytest

from extkv.testing import planted
from extkv.testing.invariants import INVARIANTS

#: Every test here checks extkv's own tooling: the self-test's catalogue.
pytestmark = pytest.mark.harness


def broken_invariants(defect: planted.Defect) -> set[int]:
    """The invariants `defect.breaks` names: `... (invariants 1 and 4)`."""
    named = re.search(r"\(invariants? ([\d, and]+)\)$", defect.breaks)
    return {int(number) for number in re.findall(r"\d+", named.group(1))} if named else set()


def planting_tests() -> dict[str, tuple[set[str], set[int]]]:
    """Per test function of conformance/test_planted_defects.py that plants a
    defect (by its own marker or its parameters'): the defects it plants and
    the invariants it carries."""
    module = importlib.import_module("conformance.test_planted_defects")
    found = {}
    for name, function in vars(module).items():
        marks = getattr(function, "pytestmark", []) if name.startswith("test") else []
        defects = {mark.args[0] for mark in marks if mark.name == "planted_defect"}
        for mark in marks:
            if mark.name == "parametrize":
                defects |= {m.args[0] for param in mark.args[1] for m in getattr(param, "marks", ()) if m.name == "planted_defect"}
        if defects:
            found[name] = (defects, {number for mark in marks if mark.name == "invariant" for number in mark.args})
    return found


def test_every_planted_defect_is_planted_by_a_test():
    named = {defect for defects, _ in planting_tests().values() for defect in defects}
    assert named <= set(planted.DEFECTS), sorted(named - set(planted.DEFECTS))
    assert set(planted.DEFECTS) <= named, sorted(set(planted.DEFECTS) - named)
    for defect in planted.DEFECTS.values():
        assert defect.breaks and defect.caught_by, defect.name
        assert broken_invariants(defect) and broken_invariants(defect) <= set(INVARIANTS), (
            f"{defect.name}: `{defect.breaks}` names no invariant as `(invariant n)` or `(invariants n and m)`")


def test_each_test_that_plants_a_defect_carries_the_invariants_it_breaks():
    wrong = [
        f"{test}: invariants {sorted(carried)}, but {defect} breaks {sorted(broken_invariants(planted.DEFECTS[defect]))}"
        for test, (defects, carried) in planting_tests().items()
        for defect in sorted(defects)
        if defect in planted.DEFECTS and carried != broken_invariants(planted.DEFECTS[defect])
    ]
    assert not wrong, "\n".join(wrong)
