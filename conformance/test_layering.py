"""The house rules of the code, checked from its import statements.

extkv is layered: each module imports only modules of lower layers, so the
graph has no cycle and nothing reaches back up (a driver never learns of KV
caches, the cache never of connectors). `LAYERS` is the map, lowest first; a
new module goes into the lowest layer above everything it imports.
`PACKAGES` does the same for packages, which modules in order can still
join in a circle (a package importing another's low module while that one
imports its high one): every import between packages goes down a floor,
also one deferred into a function. Beside
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
    {"extkv.errors", "extkv.faultable", "extkv.validate", "extkv.deferred_signals", "extkv.files", "extkv.vmm.dlpack",
     "extkv.vmm.torch_memory", "extkv.vmm.host_maps", "extkv.memfds"},
    {"extkv.cli_arguments", "extkv.vmm.witness"},
    {"extkv.vmm.base"},
    {"extkv.vmm.host_memory", "extkv.vmm.host_commits"},
    {"extkv.vmm.transaction"},
    {"extkv.vmm.wrapping", "extkv.vmm.host", "extkv.vmm.cuda"},
    {"extkv.vmm.faults", "extkv.vmm.late", "extkv.vmm.poison"},
    {"extkv.vmm"},
    {"extkv.vmm.primitives", "extkv.vmm.pressure"},
    {"extkv.tensor", "extkv.layout_types", "extkv.sizing", "extkv.usage", "extkv.wire"},
    {"extkv.budget", "extkv.budget.ledger"},
    {"extkv.budget.protocol", "extkv.budget.device", "extkv.budget.listener", "extkv.budget.journal"},
    {"extkv.budget.daemon", "extkv.budget.client"},
    {"extkv.budget.driver"},
    {"extkv.layout", "extkv.peer"},
    {"extkv.ahead"},
    {"extkv.cache"},
    {"extkv.sleep"},
    {"extkv.integrations", "extkv.integrations.transformers"},
    {"extkv.ranks", "extkv.connector"},
    {"extkv.runner"},
    {"extkv.tiny_decoder"},
    {"extkv.reference_model"},
    {"extkv.testing", "extkv.testing.gpus", "extkv.testing.readings", "extkv.testing.configs", "extkv.testing.checks",
     "extkv.testing.work", "extkv.testing.invariants", "extkv.testing.descriptors"},
    {"extkv.testing.model_warm_up"},
    {"extkv.testing.facts", "extkv.testing.children", "extkv.testing.ctrl_c", "extkv.testing.ledger_machine"},
    {"extkv.testing.record", "extkv.testing.exclusive", "extkv.testing.budget"},
    {"extkv.testing.second_run"},
    {"extkv.testing.models", "extkv.testing.choices"},
    {"extkv.testing.modelled_cache"},
    {"extkv.testing.machines"},
    {"extkv.testing.planted"},
    {"extkv.testing.interrupts", "extkv.testing.generating_engines", "extkv.testing.asleep"},
    {"extkv.testing.graphs"},
    # One line per owner, so that work on checks, benchmarks and stress runs
    # can add modules without touching each other's line.
    {"extkv.testing.harness_hooks"},
    {"extkv.testing.harness", "extkv.testing.timeline"},
    {"extkv.benchmarking", "extkv.benchmarking.geometry", "extkv.benchmarking.primitives", "extkv.benchmarking.rounds",
     "extkv.benchmarking.sizes", "extkv.benchmarking.result_files", "extkv.benchmarking.decode_report",
     "extkv.benchmarking.growth_report"},
    {"extkv.benchmarking.decode"},
    {"extkv.benchmarking.store"},
    {"extkv.benchmarking.raw"},
    {"extkv.benchmarking.clocks"},
    {"extkv.benchmarking.contenders", "extkv.benchmarking.growth_loop", "extkv.benchmarking.budget_bench"},
    {"extkv.benchmarking.cases"},
    {"extkv.benchmarking.measure"},
    {"extkv.benchmarking.engine", "extkv.benchmarking.playback"},
    {"extkv.testing.stress.base", "extkv.testing.stress.tally", "extkv.testing.stress.timeline",
     "extkv.testing.stress.reclaim"},
    {"extkv.testing.stress.bounds", "extkv.testing.stress.child", "extkv.testing.stress.faultable"},
    {"extkv.testing.stress.walk", "extkv.testing.stress.faults", "extkv.testing.stress.pressure", "extkv.testing.stress.ahead",
     "extkv.testing.stress.threads", "extkv.testing.stress.crashes", "extkv.testing.stress.budget_sampler",
     "extkv.testing.stress.budget_engine", "extkv.testing.stress.budget_result"},
    {"extkv.testing.stress.under_pressure", "extkv.testing.stress.processes", "extkv.testing.stress.warm_up",
     "extkv.testing.stress.__main__", "extkv.testing.stress.budget"},
    {"extkv.testing.stress"},
    {"extkv.benchmarking.budget_bursts"},
    {"extkv.runs.rundir", "extkv.runs", "extkv.runs.steps", "extkv.runs.bytecode"},
    {"extkv.runs.results", "extkv.runs.commands", "extkv.runs.plots"},
    {"extkv.check.features"},
    {"extkv.runs.machine", "extkv.check", "extkv.stress", "extkv.check.plots", "extkv.stress.plots", "extkv.check.verdict", "extkv.runs.portable"},
    {"extkv.check.report"},
    {"extkv.benchmarking.results"},
    {"extkv.benchmarking.targets", "extkv.benchmarking.plots"},
    {"extkv.benchmarking.budget_report"},
    {"extkv.benchmarking.report"},
    {"extkv.benchmarking.pool", "extkv.benchmarking.headline"},
    {"extkv.stress.report"},
    {"extkv.report.front"},
    {"extkv.report"},
    {"extkv.check.run"},
    {"extkv.benchmarking.run"},
    {"extkv.stress.run"},
    {"extkv.reference_run"},
    {"extkv.cli"},
    {"extkv", "extkv.__main__"},
]
LAYER_OF = {module: index for index, layer in enumerate(LAYERS) for module in layer}
SUITES = ("conformance", "stress", "bench")

#: extkv's packages and the modules directly in extkv/, by floor, lowest
#: first. Top-level modules on one floor may import each other (LAYERS
#: orders them); packages on one floor import nothing of each other: the
#: run kinds' wings stand side by side on extkv.runs, and extkv.report puts
#: their sections together from above.
PACKAGES: list[set[str]] = [
    {"extkv.errors", "extkv.faultable", "extkv.validate", "extkv.deferred_signals", "extkv.files", "extkv.cli_arguments",
     "extkv.memfds"},
    {"extkv.vmm"},
    {"extkv.tensor", "extkv.layout_types", "extkv.sizing", "extkv.usage", "extkv.wire"},
    # The shared KV budget: above the wire format it speaks, below the cache that asks it.
    {"extkv.budget"},
    {"extkv.layout", "extkv.peer", "extkv.ahead", "extkv.cache", "extkv.sleep"},
    {"extkv.integrations"},
    {"extkv.ranks", "extkv.connector", "extkv.runner", "extkv.tiny_decoder", "extkv.reference_model"},
    {"extkv.testing"},
    {"extkv.testing.stress"},
    {"extkv.runs"},
    {"extkv.check", "extkv.benchmarking", "extkv.stress"},
    {"extkv.report"},
    {"extkv.reference_run"},
    {"extkv.cli"},
    {"extkv", "extkv.__main__"},
]
FLOOR_OF = {package: index for index, floor in enumerate(PACKAGES) for package in floor}


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


def package_of(module: str) -> str:
    """What PACKAGES places `module` by: its innermost package, or itself
    where it lies directly in extkv/ (a name taken from a module counts as
    the module)."""
    parts = module.split(".")
    while len(parts) > 1 and not (ROOT.joinpath(*parts).is_dir() or ROOT.joinpath(*parts).with_suffix(".py").is_file()):
        parts.pop()
    if len(parts) > 2 and not ROOT.joinpath(*parts).is_dir():
        parts.pop()
    return ".".join(parts)


def stands_alone(package: str) -> bool:
    """A module directly in extkv/ (or extkv's own __init__), not a package of modules."""
    return package == "extkv" or not ROOT.joinpath(*package.split(".")).is_dir()


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


def test_every_package_has_a_floor():
    unplaced = sorted({package_of(module_name(path)) for path in library_files()} - set(FLOOR_OF))
    assert not unplaced, f"packages or top-level modules missing from PACKAGES (put each above what it imports): {unplaced}"


def test_every_import_between_packages_goes_down_a_floor():
    """Imports inside functions count (imports_of walks the whole module):
    an import deferred to dodge a circle at load time is still a circle."""
    upward = []
    for path in library_files():
        module = module_name(path)
        here = package_of(module)
        for target, _, line in imports_of(path):
            there = package_of(target)
            if target.split(".")[0] != "extkv" or there == here or not {here, there} <= set(FLOOR_OF):
                continue  # a suite, or unplaced: the tests above name those
            if FLOOR_OF[there] < FLOOR_OF[here]:
                continue
            if FLOOR_OF[there] == FLOOR_OF[here] and stands_alone(here) and stands_alone(there):
                continue
            upward.append(f"{module}:{line} ({here}, floor {FLOOR_OF[here]}) imports {target} "
                          f"({there}, floor {FLOOR_OF[there]})")
    assert not upward, "imports between packages that do not go down a floor (a circle or a reach upwards):\n" + \
        "\n".join(dict.fromkeys(upward))


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
#: named tuple API, torch's switch that turns off __torch_function__ and
#: torch's spin kernel (`torch.cuda._sleep`, the one way to hold a stream on
#: the device, which torch's own tests use too).
FOREIGN_PRIVATE_ATTRIBUTES = {
    "_asdict", "_replace", "_fields", "_C", "_disabled_torch_function_impl", "_exit", "_getframe", "_sleep",
}
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


#: Command-line entry points among the top-level modules: tooling, which
#: reports on the machine (its GPUs, its cuda-bindings) rather than runs
#: the cache, so it is not held to the product's rule.
TOOLING_TOP_LEVEL = {"cli.py", "cli_arguments.py", "reference_run.py", "__main__.py"}
#: Strings that name a kind of device or driver (`device.type`, `Driver.kind`).
DEVICE_KINDS = {"cuda", "cpu", "host", "mps", "xpu"}


def product_files() -> list[Path]:
    """The product: extkv's top-level modules and its integrations."""
    top = [path for path in (ROOT / "extkv").glob("*.py") if path.name not in TOOLING_TOP_LEVEL]
    return sorted(top + list((ROOT / "extkv" / "integrations").rglob("*.py")))


def device_kind_branches(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, code) of every place that asks which kind of device it runs
    on: a comparison with a device kind's name (`device.type == "cuda"`,
    `driver.kind != "host"`, `"cpu" in types`), `.is_cuda` / `.is_cpu`, and
    any use of `torch.cuda`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            if any(isinstance(side, ast.Constant) and side.value in DEVICE_KINDS for side in [node.left, *node.comparators]):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Attribute) and node.attr in ("is_cuda", "is_cpu"):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Attribute) and node.attr == "cuda" and ast.unparse(node.value) == "torch":
            found.append((node.lineno, ast.unparse(node)))
    return sorted(set(found))


@pytest.mark.parametrize("path", product_files(), ids=lambda path: str(path.relative_to(ROOT)))
def test_only_vmm_knows_the_device_kind(path):
    """What differs between devices is a Driver method or property (graphs,
    streams, staging memory, where a collective reduces): a product module
    that compares a device kind, or calls torch.cuda, has a branch that
    belongs behind the driver."""
    branches = [f"line {line}: {code}" for line, code in device_kind_branches(ast.parse(path.read_text(), str(path)))]
    assert not branches, f"{path.relative_to(ROOT)} asks which kind of device it runs on:\n" + "\n".join(branches)


#: Modules outside extkv.vmm that may import a CUDA binding, with the reason.
CUDA_BINDING_IMPORTERS = {
    # `extkv --version` names the cuda-bindings release and whether it
    # imports, which is the question itself; it calls nothing of them.
    "extkv/cli.py": "reports whether cuda-bindings imports",
}


def cuda_binding_loads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, code) of every import of a CUDA binding (cuda.bindings,
    cuda.cuda, cuda.cudart, cudart, cuda.core, by import statement or
    importlib) and every ctypes load of a CUDA library (libcuda, libcudart)."""

    def binding(name: str) -> bool:
        return name == "cuda" or name.startswith(("cuda.", "cudart"))

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(binding(alias.name) for alias in node.names):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom) and not node.level and binding(node.module or ""):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call):
            called = ast.unparse(node.func)
            texts = [arg.value for arg in node.args if isinstance(arg, ast.Constant) and isinstance(arg.value, str)]
            if called.endswith(("import_module", "__import__")) and any(binding(text) for text in texts):
                found.append((node.lineno, ast.unparse(node)))
            elif called.endswith(("CDLL", "LoadLibrary", "PyDLL")) and any("cuda" in text.lower() for text in texts):
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_only_vmm_imports_a_cuda_binding():
    """Every call into the CUDA driver is extkv.vmm's: one binding, each
    raw sequence written once, beside the drivers' own."""
    checked = [path for path in library_files() if "vmm" not in path.relative_to(ROOT / "extkv").parts[:1]]
    checked += [path for directory in ("meta", "tools") if (ROOT / directory).is_dir() for path in (ROOT / directory).rglob("*.py")]
    loads = [
        f"{path.relative_to(ROOT)}:{line}: {code}"
        for path in checked + suite_files()
        if str(path.relative_to(ROOT)) not in CUDA_BINDING_IMPORTERS
        for line, code in cuda_binding_loads(ast.parse(path.read_text(), str(path)))
    ]
    assert not loads, "CUDA bindings loaded outside extkv.vmm:\n" + "\n".join(loads)
