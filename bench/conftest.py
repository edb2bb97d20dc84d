"""pytest wiring of the benchmarks (`extkv bench` runs them; see
extkv.benchmarking for how they measure).

Options choose the run: `--extkv-bench-profile` (gpu, host, quick; default
gpu where a CUDA GPU is usable, else host), `--extkv-bench-device`,
`--extkv-bench-rounds`, `--extkv-bench-budget` (seconds),
`--extkv-bench-dir` (the run directory; default: beside --benchmark-json)
and `--extkv-bench-part` (the modules of one part,
extkv.benchmarking.result_files.PARTS; the others are deselected).
Every test that takes `bench_case` runs once per (case, contender) of the
profile's catalogue. One session-scoped engine measures each case once and
writes bench_cases.json when the session ends.

The machine_info pytest-benchmark saves leaves out the CPU's clock of the
moment: it is no fact of the machine, and a compared run whose machine_info
differs makes pytest-benchmark warn of another machine (and stop, where the
storage lies outside pytest's working directory: extkv.benchmarking.run).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from extkv import vmm
from extkv.testing import harness
from extkv.benchmarking.cases import PROFILES, catalogue
from extkv.benchmarking.engine import Engine
from extkv.benchmarking.result_files import PARTS, part_of


def pytest_configure(config):
    harness.activate(config)


#: Fields of py-cpuinfo's answer that read the current clock, which frequency scaling moves run to run.
MOMENTARY_CPU_FIELDS = ("hz_actual", "hz_actual_friendly")


def pytest_benchmark_update_machine_info(config, machine_info):
    for name in MOMENTARY_CPU_FIELDS:
        machine_info.get("cpu", {}).pop(name, None)


def pytest_addoption(parser):
    group = parser.getgroup("extkv bench")
    group.addoption("--extkv-bench-profile", choices=sorted(PROFILES), default=None, help="which run (default: gpu or host)")
    group.addoption("--extkv-bench-device", default=None, help="cuda:N or cpu (default: cuda:0 if usable, else cpu)")
    group.addoption("--extkv-bench-rounds", type=int, default=None, help="rounds per case (default: the profile's)")
    group.addoption("--extkv-bench-budget", type=float, default=None, help="seconds of measuring (default: the profile's)")
    group.addoption("--extkv-bench-dir", default=None, help="run directory for bench_cases.json")
    group.addoption("--extkv-bench-part", choices=sorted(PARTS), default=None, help="run one part's modules only")


def pytest_collection_modifyitems(config, items):
    part = config.getoption("--extkv-bench-part")
    if part is None:
        return
    other = [item for item in items if part_of(item.path.name) != part]
    if other:
        items[:] = [item for item in items if part_of(item.path.name) == part]
        config.hook.pytest_deselected(items=other)


def bench_device(config) -> str:
    return config.getoption("--extkv-bench-device") or ("cuda:0" if vmm.cuda_usable() else "cpu")


def bench_profile(config):
    name = config.getoption("--extkv-bench-profile") or ("gpu" if vmm.cuda_usable() else "host")
    return PROFILES[name]


def _run_dir(config) -> Path:
    chosen = config.getoption("--extkv-bench-dir")
    if chosen:
        return Path(chosen)
    bench_json = config.getoption("benchmark_json", None)
    if bench_json:
        return Path(bench_json).parent
    raise pytest.UsageError("benchmarks need --extkv-bench-dir DIR or --benchmark-json PATH; `extkv bench` passes both")


def pytest_generate_tests(metafunc):
    """One test per (case, contender) of the profile's catalogue, in its order."""
    if "bench_case" not in metafunc.fixturenames:
        return
    pairs = [(case, name) for case in catalogue(bench_profile(metafunc.config)) for name in case.contenders]
    metafunc.parametrize(("bench_case", "contender"), pairs, ids=[f"{case.id}-{name}" for case, name in pairs])


@pytest.fixture(scope="session")
def bench_run(request) -> tuple[str, str, Path]:
    """(profile name, device, run directory) of this bench session."""
    config = request.config
    return bench_profile(config).name, bench_device(config), _run_dir(config)


@pytest.fixture(scope="session")
def bench_engine(request) -> Engine:
    config = request.config
    engine = Engine(
        bench_profile(config),
        bench_device(config),
        _run_dir(config),
        rounds=config.getoption("--extkv-bench-rounds"),
        budget_seconds=config.getoption("--extkv-bench-budget"),
    )
    yield engine
    print(f"\nextkv bench: wrote {engine.finish()}", flush=True)
