"""The house rules of the code, checked from its import statements.

extkv is layered: each module imports only modules of lower layers, so the
graph has no cycle and nothing reaches back up (a driver never learns of KV
caches, the cache never of connectors). `LAYERS` is the map, lowest first; a
new module goes into the lowest layer above everything it imports. Beside
it: the suites import only extkv (and extkv.testing), never each other; no
private name crosses a module boundary; and only extkv.vmm knows which kind
of device it runs on, so the cache and the lifecycle never branch on it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import extkv

pytestmark = pytest.mark.invariant(6)

ROOT = Path(extkv.__file__).resolve().parent.parent

#: Every extkv module, by layer, lowest first.
LAYERS: list[set[str]] = [
    {"extkv.errors", "extkv.validate", "extkv.deferred_signals", "extkv.files", "extkv.vmm.dlpack",
     "extkv.vmm.torch_memory", "extkv.vmm.witness"},
    {"extkv.vmm.base"},
    {"extkv.vmm.host_memory", "extkv.vmm.host_commits"},
    {"extkv.vmm.transaction"},
    {"extkv.vmm.wrapping", "extkv.vmm.host", "extkv.vmm.cuda"},
    {"extkv.vmm.faults", "extkv.vmm.poison"},
    {"extkv.vmm"},
    {"extkv.tensor", "extkv.layout_types", "extkv.sizing", "extkv.usage", "extkv.wire"},
    {"extkv.layout", "extkv.peer"},
    {"extkv.ahead"},
    {"extkv.cache"},
    {"extkv.sleep"},
    {"extkv.integrations", "extkv.integrations.transformers"},
    {"extkv.ranks", "extkv.connector"},
    {"extkv.runner"},
    {"extkv.reference_model"},
    {"extkv.testing", "extkv.testing.gpus", "extkv.testing.readings", "extkv.testing.configs", "extkv.testing.checks",
     "extkv.testing.work", "extkv.testing.invariants"},
    {"extkv.testing.facts", "extkv.testing.children"},
    {"extkv.testing.record", "extkv.testing.exclusive"},
    {"extkv.testing.models", "extkv.testing.choices"},
    {"extkv.testing.modelled_cache"},
    {"extkv.testing.machines"},
    {"extkv.testing.planted"},
    {"extkv.testing.interrupts"},
    {"extkv.testing.graphs"},
    # One line per owner, so that work on checks, benchmarks and stress runs
    # can add modules without touching each other's line.
    {"extkv.testing.harness", "extkv.testing.timeline"},
    {"extkv.benchmarking", "extkv.benchmarking.geometry", "extkv.benchmarking.primitives", "extkv.benchmarking.rounds"},
    {"extkv.benchmarking.decode"},
    {"extkv.benchmarking.store"},
    {"extkv.benchmarking.raw"},
    {"extkv.benchmarking.clocks"},
    {"extkv.benchmarking.contenders", "extkv.benchmarking.growth_loop"},
    {"extkv.benchmarking.cases"},
    {"extkv.benchmarking.measure"},
    {"extkv.benchmarking.engine", "extkv.benchmarking.playback"},
    {"extkv.testing.stress.base", "extkv.testing.stress.tally", "extkv.testing.stress.timeline",
     "extkv.testing.stress.reclaim"},
    {"extkv.testing.stress.bounds", "extkv.testing.stress.child", "extkv.testing.stress.faultable"},
    {"extkv.testing.stress.walk", "extkv.testing.stress.faults", "extkv.testing.stress.pressure", "extkv.testing.stress.ahead",
     "extkv.testing.stress.threads", "extkv.testing.stress.crashes"},
    {"extkv.testing.stress.under_pressure", "extkv.testing.stress.processes", "extkv.testing.stress.warm_up",
     "extkv.testing.stress.__main__"},
    {"extkv.testing.stress"},
    {"extkv.reporting.rundir", "extkv.reporting.steps"},
    {"extkv.reporting.machine", "extkv.reporting.plots", "extkv.reporting.verdict"},
    {"extkv.reporting.summary"},
    {"extkv.benchmarking.results"},
    {"extkv.benchmarking.targets", "extkv.benchmarking.plots"},
    {"extkv.benchmarking.report"},
    {"extkv.benchmarking.pool"},
    {"extkv.reporting.stress"},
    {"extkv.reporting"},
    {"extkv.reporting.check_run"},
    {"extkv.benchmarking.run"},
    {"extkv.reporting.stress_run"},
    {"extkv.reporting.reference_run"},
    {"extkv.cli"},
    {"extkv", "extkv.__main__"},
]
LAYER_OF = {module: index for index, layer in enumerate(LAYERS) for module in layer}
SUITES = ("conformance", "stress", "reports")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> list[tuple[str, str | None, int]]:
    """(module imported, name taken from it or None, line) for every import
    of project code in `path`, relative imports resolved."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                # `from . import validate` imports a module, not a name.
                if node.module is None:
                    found.append((f"{target}.{alias.name}", None, node.lineno))
                else:
                    found.append((target, alias.name, node.lineno))
    return [(target, name, line) for target, name, line in found if target.split(".")[0] in ("extkv", *SUITES)]


def library_files() -> list[Path]:
    return sorted((ROOT / "extkv").rglob("*.py"))


def suite_files() -> list[Path]:
    return sorted(path for suite in SUITES if (ROOT / suite).is_dir() for path in (ROOT / suite).rglob("*.py"))


def test_every_module_has_a_layer():
    unplaced = sorted({module_name(path) for path in library_files()} - set(LAYER_OF))
    assert not unplaced, f"modules missing from LAYERS (put each above everything it imports): {unplaced}"


def test_every_import_goes_down_a_layer():
    upward = []
    for path in library_files():
        module = module_name(path)
        for target, _, line in imports_of(path):
            if target.split(".")[0] in SUITES:
                upward.append(f"{module}:{line} imports the suite {target}")
                continue
            if target not in LAYER_OF:
                continue  # a name imported from a package resolves to the package's layer
            if LAYER_OF[target] >= LAYER_OF.get(module, len(LAYERS)):
                upward.append(
                    f"{module} (layer {LAYER_OF.get(module)}) imports {target} (layer {LAYER_OF[target]}) at line {line}"
                )
    assert not upward, "imports that do not go down a layer (a cycle or a reach upwards):\n" + "\n".join(upward)


def test_suites_import_only_extkv():
    if not (ROOT / "conformance").is_dir():
        pytest.skip(f"no suite directories beside the extkv package in {ROOT} (an installed extkv): checked from a checkout")
    crossing = [
        f"{path.relative_to(ROOT)}:{line} imports {target}"
        for path in suite_files()
        for target, _, line in imports_of(path)
        if not target.startswith("extkv")
    ]
    assert not crossing, "a suite imports another suite:\n" + "\n".join(crossing)


def test_no_private_name_crosses_a_module_boundary():
    private = [
        f"{path.relative_to(ROOT)}:{line} takes {name} from {target}"
        for path in library_files() + suite_files()
        for target, name, line in imports_of(path)
        if name is not None and name.startswith("_") and name != "__version__"
    ]
    assert not private, "private names imported across modules:\n" + "\n".join(private)


#: Private attributes of other libraries that extkv reaches on purpose: the
#: named tuple API and torch's switch that turns off __torch_function__.
FOREIGN_PRIVATE_ATTRIBUTES = {"_asdict", "_replace", "_fields", "_C", "_disabled_torch_function_impl", "_exit", "_getframe"}
#: Modules whose job is to reach into others: the planted defects break
#: extkv's internals on purpose.
REACHES_IN_ON_PURPOSE = {"extkv.testing.planted"}


def _defined_names(tree: ast.AST) -> set[str]:
    """Names a module defines: functions, classes and their members,
    attributes it assigns on `self` or at module or class level."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def _driver_steps() -> set[str]:
    """The `_`-steps of the driver protocol: a wrapping driver calls its
    inner driver's steps, which the protocol defines for it."""
    tree = ast.parse((ROOT / "extkv" / "vmm" / "base.py").read_text())
    driver = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Driver")
    return {node.name for node in driver.body if isinstance(node, ast.FunctionDef) and node.name.startswith("_")}


def test_no_private_attribute_is_reached_across_modules():
    """`thing._name` outside `self`/`cls` must name something the module
    defines itself (or a driver step, from a driver): one module's
    internals are not another's interface."""
    steps = _driver_steps()
    reached = []
    for path in library_files():
        module = module_name(path)
        if module in REACHES_IN_ON_PURPOSE:
            continue
        tree = ast.parse(path.read_text(), str(path))
        own = _defined_names(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr in own or node.attr in steps or node.attr in FOREIGN_PRIVATE_ATTRIBUTES:
                continue
            reached.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert not reached, "private attributes reached from another module:\n" + "\n".join(reached)


@pytest.mark.parametrize("module", ["tensor.py", "cache.py", "runner.py", "usage.py", "sizing.py", "layout.py",
                                    "layout_types.py"])
def test_only_vmm_knows_the_device_kind(module):
    source = (ROOT / "extkv" / module).read_text()
    branches = [
        f"line {number}: {text.strip()}"
        for number, text in enumerate(source.splitlines(), 1)
        if "device.type" in text or "torch.cuda" in text
    ]
    assert not branches, f"extkv/{module} asks which kind of device it runs on:\n" + "\n".join(branches)
