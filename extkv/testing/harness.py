"""The extkv harness, as a pytest plugin (`-p extkv.testing.harness`; the
checkout's root conftest.py loads it with `pytest_plugins`).

Theory of operation
-------------------
- One GPU per xdist worker, chosen before anything initializes CUDA: pinning
  is the first thing this module does, and pytest imports a plugin before it
  imports any test module.
- The `device` fixture: the host driver and every CUDA device this process
  sees (ids `host`, `cuda:0`, ...). Where there is no GPU a `cuda:0` case is
  still collected, so the report shows it skipped and why.
- Capability markers (gpu, cuda_graphs, multi_gpu(n), stress) become skips
  with reasons in one hook, `pytest_collection_modifyitems`.
- After every test: no reservation, chunk or memfd left behind, and physical
  usage measured outside extkv back where it started.
- Hypothesis profiles: `ci` (derandomized, the default), `dev`, `nightly`;
  choose with --hypothesis-profile or EXTKV_HYPOTHESIS_PROFILE.
- `@pytest.mark.invariant(n, ...)` names which of DESIGN.md's invariants
  (1-8) a test proves. Numbers are checked at collection; the invariants ride
  on each report's `user_properties`, so the terminal summary can count, also
  under xdist, how many tests of each invariant ran and passed: a reader sees
  which invariants a run proved and which it did not touch.
- The `build` fixture makes ExtensibleTensors and ExtensibleKVCaches and frees
  them after the test, even when it fails, before the leak check runs.
"""

from __future__ import annotations

from .gpus import gpu_for_worker, pin_this_worker, visible_gpu_ids

# Must precede any CUDA initialization in this process.
_PINNED_GPU = pin_this_worker()

import os  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from .. import vmm  # noqa: E402
from ..cache import ExtensibleKVCache  # noqa: E402
from ..tensor import ExtensibleTensor  # noqa: E402
from ..layout import KVCacheConfig, KVCacheLayout  # noqa: E402
from .checks import warm_up_kernels  # noqa: E402
from .configs import CAPACITY, CASE_IDS, CASES, config_for  # noqa: E402
from ..usage import UsageProbe, open_chunk_fds  # noqa: E402

# The suites' CPU tensors are a few MiB: one thread copies or compares them
# in about a millisecond, while OpenMP threads on a busy machine, or under
# xdist (one process per core already), wait for each other for longer than
# the work takes (10 ms instead of 0.1 ms per op was measured on 2 loaded
# cores). EXTKV_TORCH_THREADS overrides.
torch.set_num_threads(int(os.environ.get("EXTKV_TORCH_THREADS", "1")))

settings.register_profile(
    "ci", derandomize=True, max_examples=40, stateful_step_count=20, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.register_profile(
    "nightly", max_examples=2000, stateful_step_count=100, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("EXTKV_HYPOTHESIS_PROFILE", "ci"))

MARKERS = {
    "gpu": "needs a CUDA GPU driven through cuda-python",
    "cuda_graphs": "captures and replays CUDA graphs",
    "multi_gpu(n)": "needs n GPUs visible to this process",
    "stress": "long randomized run; only with --stress",
    "invariant(n, ...)": "proves DESIGN.md's invariant(s) n (1-8); counted in the terminal summary",
}

#: DESIGN.md's invariants, by number, in a few words each.
INVARIANTS = {
    1: "fixed addresses, contents survive growth",
    2: "CUDA graph replay after growth",
    3: "shrink/defragment: one chunk per segment, exact footprint",
    4: "sleep/recommit returns memory, reads zero",
    5: "accounting: usage measured outside equals physical_bytes",
    6: "bad input raises and changes nothing",
    7: "concurrency",
    8: "exports cannot harm the exporter",
}
_INVARIANT_PROPERTY = "extkv_invariants"


def pytest_addoption(parser):
    parser.addoption("--stress", action="store_true", help="run tests marked stress (long, nightly)")


def pytest_configure(config):
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")


def cuda_device_count() -> int:
    return torch.cuda.device_count() if vmm.cuda_usable() else 0


def _no_cuda_reason() -> str:
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False (no GPU or a CPU build of torch)"
    return "cuda-python (cuda-bindings) is not importable"


def _invariants_of(item) -> list[int]:
    numbers: set[int] = set()
    for marker in item.iter_markers("invariant"):
        if not marker.args or marker.kwargs:
            raise pytest.UsageError(f"{item.nodeid}: write @pytest.mark.invariant(n, ...) with n in 1-8, got {marker}")
        for number in marker.args:
            if isinstance(number, bool) or number not in INVARIANTS:
                raise pytest.UsageError(
                    f"{item.nodeid}: invariant {number!r} is not one of DESIGN.md's invariants {sorted(INVARIANTS)}"
                )
            numbers.add(number)
    return sorted(numbers)


def pytest_collection_modifyitems(config, items):
    """The one place capability markers turn into skips; invariant markers
    are checked and attached to the reports here too."""
    gpus = cuda_device_count()
    for item in items:
        invariants = _invariants_of(item)
        if invariants:
            item.user_properties.append((_INVARIANT_PROPERTY, invariants))
        if item.get_closest_marker("stress") and not config.getoption("--stress"):
            item.add_marker(pytest.mark.skip(reason="stress test: run with --stress"))
        needs_cuda = item.get_closest_marker("gpu") or item.get_closest_marker("cuda_graphs")
        if needs_cuda and gpus == 0:
            what = "CUDA graphs need" if item.get_closest_marker("cuda_graphs") else "needs"
            item.add_marker(pytest.mark.skip(reason=f"{what} a CUDA GPU: {_no_cuda_reason()}"))
        multi = item.get_closest_marker("multi_gpu")
        if multi is not None:
            wanted = multi.args[0] if multi.args else 2
            if gpus < wanted:
                item.add_marker(
                    pytest.mark.skip(reason=f"needs {wanted} GPUs visible to this process, found {gpus}")
                )


def pytest_collection_finish(session):
    """Which invariants the collected tests carry. Under xdist the controller
    collects nothing and says nothing here; the terminal summary counts."""
    reporter = session.config.pluginmanager.getplugin("terminalreporter")
    if reporter is None or not session.items:
        return
    carried = {number: 0 for number in INVARIANTS}
    for item in session.items:
        for number in _invariants_of(item):
            carried[number] += 1
    reporter.write_line(
        "extkv: tests per invariant: " + ", ".join(f"{number}: {count}" for number, count in carried.items())
    )


# nodeid -> (invariants, outcome): "failed" once any phase failed, else
# "skipped" if a phase skipped, else "passed" once the call passed.
_invariant_outcomes: dict[str, tuple[list[int], str | None]] = {}


def pytest_runtest_logreport(report):
    invariants = next((value for name, value in report.user_properties if name == _INVARIANT_PROPERTY), None)
    if not invariants:
        return
    _, outcome = _invariant_outcomes.get(report.nodeid, (invariants, None))
    if report.failed:
        outcome = "failed"
    elif report.skipped and outcome != "failed":
        outcome = "skipped"
    elif report.when == "call" and outcome is None:
        outcome = "passed"
    _invariant_outcomes[report.nodeid] = (invariants, outcome)


def pytest_terminal_summary(terminalreporter):
    if not _invariant_outcomes:
        return
    terminalreporter.write_sep("-", "extkv invariants proven by this run")
    for number, words in INVARIANTS.items():
        outcomes = [outcome for invariants, outcome in _invariant_outcomes.values() if number in invariants]
        counts = {kind: outcomes.count(kind) for kind in ("passed", "failed", "skipped")}
        verdict = "FAILED" if counts["failed"] else "proven" if counts["passed"] else "not proven"
        terminalreporter.write_line(
            f"invariant {number} ({words}): {len(outcomes)} tests, {counts['passed']} passed, "
            f"{counts['failed']} failed, {counts['skipped']} skipped -> {verdict}"
        )


def device_ids() -> list[str]:
    return ["host"] + [f"cuda:{i}" for i in range(max(cuda_device_count(), 1))]


def pytest_generate_tests(metafunc):
    if "device" in metafunc.fixturenames:
        params = [
            pytest.param(name, id=name, marks=() if name == "host" else pytest.mark.gpu) for name in device_ids()
        ]
        metafunc.parametrize("device", params, indirect=True)


@pytest.fixture
def device(request) -> torch.device:
    """The device a test runs on: `cpu` (host driver) or `cuda:N`."""
    return torch.device("cpu") if request.param == "host" else torch.device(request.param)


@pytest.fixture(params=CASES, ids=CASE_IDS)
def case(request) -> tuple:
    """(config kind, layout, config) for each KV cache case the suites share."""
    kind, layout = request.param
    return kind, layout, config_for(kind, layout)


@pytest.fixture
def driver(device) -> vmm.Driver:
    return vmm.driver_for(device)


@pytest.fixture
def usage(device) -> UsageProbe:
    """Physical usage of `device`, read outside extkv (NVML / memfd pages)."""
    return _probe(device)


_probes: dict[torch.device, UsageProbe] = {}


def _probe(device: torch.device) -> UsageProbe:
    if device not in _probes:
        _probes[device] = UsageProbe(device)
        warm_up_kernels(device)
    return _probes[device]


class Builder:
    """Makes ExtensibleTensors and ExtensibleKVCaches that are freed at the
    end of the test; `device` defaults to the test's `device` parameter."""

    def __init__(self, default_device: torch.device | None):
        self._default_device = default_device
        self._made: list[ExtensibleTensor | ExtensibleKVCache] = []

    def _device(self, device):
        if device is not None:
            return device
        if self._default_device is None:
            raise ValueError("this test has no `device` parameter: pass device= (a torch device or a Driver)")
        return self._default_device

    def tensor(self, size: int, *, device=None, segment_capacities=None) -> ExtensibleTensor:
        tensor = ExtensibleTensor(size, device=self._device(device), segment_capacities=segment_capacities)
        self._made.append(tensor)
        return tensor

    def cache(self, config: KVCacheConfig, layout: KVCacheLayout, *, device=None) -> ExtensibleKVCache:
        kv_cache = ExtensibleKVCache(config, self._device(device), layout)
        self._made.append(kv_cache)
        return kv_cache

    def cache_for(self, kind: str, layout: KVCacheLayout, capacity: int = CAPACITY, *, device=None) -> ExtensibleKVCache:
        """A cache over `extkv.testing.configs.config_for(kind, layout, capacity)`."""
        return self.cache(config_for(kind, layout, capacity), layout, device=device)

    def free_all(self) -> None:
        # Newest first; every object is freed even if one fails, then the
        # first failure is raised.
        failure: Exception | None = None
        while self._made:
            try:
                self._made.pop().free()
            except Exception as error:
                failure = failure or error
        if failure is not None:
            raise failure


@pytest.fixture
def build(request) -> Builder:
    """Build tensors and caches (`build.tensor`, `build.cache`, `build.cache_for`)
    that are freed after the test, even on failure."""
    default = request.getfixturevalue("device") if "device" in request.fixturenames else None
    builder = Builder(default)
    yield builder
    builder.free_all()


def _nonzero(counts) -> dict[str, int]:
    return {kind: count for kind, count in counts.items() if count}


@pytest.fixture(autouse=True)
def no_leaks(request):
    """Fail a test that leaves a reservation, chunk, memfd or physical memory behind."""
    devices = [request.getfixturevalue("device")] if "device" in request.fixturenames else []
    reservations = _nonzero(vmm.live_reservations)
    chunks = _nonzero(vmm.live_chunks)
    fds = len(open_chunk_fds())
    before = {d: _probe(d).read_outside_torch() for d in devices}
    yield
    problems = []
    if _nonzero(vmm.live_reservations) != reservations:
        problems.append(f"live reservations {reservations} -> {_nonzero(vmm.live_reservations)}")
    if _nonzero(vmm.live_chunks) != chunks:
        problems.append(f"live chunks {chunks} -> {_nonzero(vmm.live_chunks)}")
    if len(open_chunk_fds()) != fds:
        problems.append(f"open chunk memfds {fds} -> {len(open_chunk_fds())}")
    for d, start in before.items():
        end = _probe(d).read_outside_torch()
        # A leaked chunk is at least one granule; CUDA's lazy module loading can
        # add less than that to a context as a test runs new kernels.
        tolerance = 0 if d.type == "cpu" else vmm.driver_for(d).granularity
        if abs(end - start) >= max(tolerance, 1):
            problems.append(f"{_probe(d).source} on {d}: {start} -> {end} bytes")
    if problems:
        pytest.fail("test leaked: " + "; ".join(problems), pytrace=False)


def pytest_report_header(config):
    lines = [
        f"extkv: torch {torch.__version__}, cuda-bindings {_version('cuda-bindings')}, "
        f"nvidia-ml-py {_version('nvidia-ml-py')}, python {sys.version.split()[0]}"
    ]
    host = vmm.driver_for("cpu").describe()
    lines.append(f"extkv: host driver: {host['driver']}, granularity {host['granularity']}")
    gpu_ids = visible_gpu_ids()
    if vmm.cuda_usable():
        from ..vmm.cuda import query_granularity

        for index in range(torch.cuda.device_count()):
            lines.append(
                f"extkv: cuda:{index} {torch.cuda.get_device_name(index)}, driver {_nvidia_driver_version()}, "
                f"VMM granularity {query_granularity(index) >> 20} MiB"
            )
    else:
        lines.append(f"extkv: no CUDA device ({_no_cuda_reason()}); GPU tests skip")
    workers = _xdist_workers(config)
    if workers and gpu_ids:
        pins = ", ".join(f"gw{i}->GPU {gpu_for_worker(f'gw{i}', gpu_ids)}" for i in range(workers))
        lines.append(f"extkv: one GPU per xdist worker: {pins}")
    elif workers:
        lines.append(f"extkv: {workers} xdist workers, host driver only")
    return lines


def _xdist_workers(config) -> int:
    count = getattr(config.option, "numprocesses", None)
    return count if isinstance(count, int) else 0


def _version(distribution: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def _nvidia_driver_version() -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else version
    except Exception as error:
        return f"unknown ({error})"
