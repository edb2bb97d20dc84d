"""The shared KV budget's proofs (extkv.testing.invariants.BUDGET_PROOFS)
against the tests that carry them: every test of the budget's modules says
which proof it is part of, by a name the table knows, and every proof has a
planted defect (conformance/test_planted_defects.py) that a test carrying
that proof plants, so that the verdict's budget line can count a caught
defect under each. This checks the suite's bookkeeping, not the budget."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from extkv import ExtensibleTensor
from extkv.testing.budget import served_daemon
from extkv.testing.invariants import BUDGET_PROOFS
from extkv.vmm import HostDriver

pytestmark = pytest.mark.harness

CONFORMANCE = Path(__file__).resolve().parents[1] / "conformance"
#: The budget's contract tests: every test in them carries a budget proof.
BUDGET_MODULES = sorted(CONFORMANCE.glob("test_budget_*.py")) + [CONFORMANCE / "test_transformers_budget.py"]


def proofs_named(node: ast.AST) -> list[str]:
    """The first argument of every `budget_proof(...)` call under `node` (a string, or its source)."""
    return [
        call.args[0].value if call.args and isinstance(call.args[0], ast.Constant) else ast.unparse(call)
        for call in ast.walk(node)
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "budget_proof"
    ]


def carried_proofs(path: Path) -> dict[str, list[str]]:
    """Per top-level test function of the module at `path`: the budget
    proofs it carries, its module's `pytestmark` and its own decorators
    together (read from the source: importing the transformers module
    would import transformers)."""
    tree = ast.parse(path.read_text())
    module = [name for node in tree.body if isinstance(node, ast.Assign)
              and any(isinstance(target, ast.Name) and target.id == "pytestmark" for target in node.targets)
              for name in proofs_named(node.value)]
    return {
        node.name: module + [name for decorator in node.decorator_list for name in proofs_named(decorator)]
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test")
    }


def test_every_test_of_the_budget_carries_one_known_proof():
    assert len(BUDGET_MODULES) >= 6, [path.name for path in BUDGET_MODULES]
    wrong = [
        f"{path.name}::{test}: {proofs or 'no budget_proof'}"
        for path in BUDGET_MODULES
        for test, proofs in carried_proofs(path).items()
        if len(proofs) != 1 or proofs[0] not in BUDGET_PROOFS
    ]
    assert not wrong, f"each test must carry exactly one of {list(BUDGET_PROOFS)}:\n" + "\n".join(wrong)


def planted_budget_defects() -> dict[str, set[str]]:
    """Per budget proof, the defects planted by tests of
    conformance/test_planted_defects.py that carry it (by their own marker
    or their parameters')."""
    module = importlib.import_module("conformance.test_planted_defects")
    found: dict[str, set[str]] = {}
    for name, function in vars(module).items():
        marks = getattr(function, "pytestmark", []) if name.startswith("test") else []
        cases = [marks] + [[*marks, *param.marks] for mark in marks if mark.name == "parametrize"
                           for param in mark.args[1] if hasattr(param, "marks")]
        for case in cases:
            defects = {mark.args[0] for mark in case if mark.name == "planted_defect"}
            for proof in {mark.args[0] for mark in case if mark.name == "budget_proof"}:
                found.setdefault(proof, set()).update(defects)
    return found


def test_every_budget_proof_has_a_planted_defect():
    planted = planted_budget_defects()
    assert set(planted) <= set(BUDGET_PROOFS), sorted(set(planted) - set(BUDGET_PROOFS))
    lacking = [proof for proof in BUDGET_PROOFS if not planted.get(proof)]
    assert not lacking, f"budget proofs no planted defect undoes: {lacking}; planted: {planted}"


def test_a_served_daemon_refuses_to_start_over_chunks_an_earlier_test_left():
    """A tensor an earlier test left in this process would count as held by
    every engine of it that a served daemon reads from outside: the daemon
    says so before it starts, naming the bytes, rather than the test failing
    on numbers off by them. Once the tensor is gone it starts."""
    driver = HostDriver()
    left = ExtensibleTensor(driver.granularity, device=driver)
    try:
        left.resize_segments_([driver.granularity])
        with pytest.raises(AssertionError, match=rf"^this process holds {driver.granularity} bytes of extkv chunks "
                                                 "before its budget daemon starts: an earlier test left them"):
            with served_daemon(1000):
                pass
    finally:
        left.free()
    with served_daemon(1000) as served:
        assert served.thread.is_alive()
