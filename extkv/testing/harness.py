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
  with reasons in one hook, `pytest_collection_modifyitems`. `per_gpu` marks
  a test that `extkv check` runs again in its all-GPUs step.
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
- Each test also carries, from collection on, the device it runs on as a
  label that names the physical GPU (`GPU 1 (NVIDIA H200)`: in an xdist
  worker `cuda:0` is the worker's pinned GPU) or `host`, and the xdist worker.
- `--extkv-report-dir DIR`: the controlling process (under xdist it receives
  every worker's reports, user_properties included) writes `DIR/<step>.json`
  at the end of the session (`--extkv-report-step`, default `check`): per
  test its outcome, invariants, device, worker, duration and skip reason or
  failure message; the totals; and the machine facts the report header
  prints (`machine_facts`, which extkv.reporting.machine uses too).
"""

from __future__ import annotations

from .gpus import gpu_for_worker, pin_this_worker, visible_gpu_ids

# Must precede any CUDA initialization in this process.
_PINNED_GPU = pin_this_worker()

import datetime  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
from importlib import metadata  # noqa: E402
from pathlib import Path  # noqa: E402

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
    "per_gpu": "runs again in extkv check's all-GPUs step, so that every GPU gets one (under xdist each test runs on one worker's GPU)",
    "invariant(n, ...)": "proves DESIGN.md's invariant(s) n (1-8); counted in the terminal summary",
    "planted_defect(name)": "plants a defect in a broken implementation; the check under test must flag it",
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
#: Names of the user_properties every test report carries (also written
#: into JUnit XML as testcase properties).
INVARIANTS_PROPERTY = "extkv_invariants"
DEVICE_PROPERTY = "extkv_device"
WORKER_PROPERTY = "extkv_worker"
#: Label of everything that runs on the host driver or needs no device.
HOST_LABEL = "host"
#: Format tag of the `<step>.json` files this harness writes.
RECORD_FORMAT = "extkv-check/1"


def pytest_addoption(parser):
    parser.addoption("--stress", action="store_true", help="run tests marked stress (long, nightly)")
    group = parser.getgroup("extkv", "extkv reports")
    group.addoption(
        "--extkv-report-dir",
        metavar="DIR",
        default=None,
        help="write DIR/<step>.json: every test's outcome, invariants and device, and the machine facts",
    )
    group.addoption(
        "--extkv-report-step",
        metavar="NAME",
        default="check",
        help="name of this run's results file in the report directory (default %(default)s: check.json)",
    )


def pytest_configure(config):
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    config.pluginmanager.register(RunRecord(config), "extkv-run-record")


def cuda_device_count() -> int:
    return torch.cuda.device_count() if vmm.cuda_usable() else 0


def _no_cuda_reason() -> str:
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False (no GPU or a CPU build of torch)"
    return "cuda-python (cuda-bindings) is not importable"


# -- machine facts: the report header and extkv.reporting.machine -------------
def gpu_label(gpu_id: str, name: str) -> str:
    """`GPU 1 (NVIDIA H200)`: the physical GPU, as CUDA_VISIBLE_DEVICES names it."""
    return f"GPU {gpu_id} ({name})"


@functools.lru_cache(maxsize=None)
def machine_facts() -> dict:
    """Host name, versions, the host driver and each GPU this process sees:
    name, physical id and label, NVIDIA driver, CUDA driver API, VMM
    granularity. Creates no CUDA context (NVML, and cuInit for the
    granularity), so a controlling process that runs no GPU work holds none."""
    host = vmm.driver_for("cpu").describe()
    facts = {
        "host": socket.gethostname(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda-bindings": _version("cuda-bindings"),
        "nvidia-ml-py": _version("nvidia-ml-py"),
        "host_driver": host["driver"],
        "host_granularity": host["granularity"],
        "gpus": [],
        "no_gpu_reason": None,
    }
    if not vmm.cuda_usable():
        facts["no_gpu_reason"] = _no_cuda_reason()
        return facts
    from ..vmm.base import format_granularity
    from ..vmm.cuda import query_granularity

    driver, cuda_api = _nvidia_driver_versions()
    gpu_ids = visible_gpu_ids()
    for index in range(torch.cuda.device_count()):
        gpu_id = gpu_ids[index] if index < len(gpu_ids) else str(index)
        name = torch.cuda.get_device_name(index)
        facts["gpus"].append(
            {
                "index": index,
                "id": gpu_id,
                "name": name,
                "label": gpu_label(gpu_id, name),
                "driver": driver,
                "cuda_driver_api": cuda_api,
                "granularity": format_granularity(query_granularity(index)),
            }
        )
    return facts


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def _nvidia_driver_versions() -> tuple[str, str]:
    """(NVIDIA driver version, CUDA driver API version) from NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
        api = pynvml.nvmlSystemGetCudaDriverVersion()
        return (driver.decode() if isinstance(driver, bytes) else driver), f"{api // 1000}.{api % 1000 // 10}"
    except Exception as error:
        return f"unknown ({error})", "unknown"


def _xdist_workers(config) -> int:
    count = getattr(config.option, "numprocesses", None)
    return count if isinstance(count, int) else 0


def worker_gpus(config) -> dict[str, str]:
    """Each xdist worker's GPU label ({} outside xdist or without GPUs)."""
    labels = {gpu["id"]: gpu["label"] for gpu in machine_facts()["gpus"]}
    gpu_ids = visible_gpu_ids()
    pins = {}
    for number in range(_xdist_workers(config)):
        gpu = gpu_for_worker(f"gw{number}", gpu_ids)
        if gpu is not None:
            pins[f"gw{number}"] = labels.get(gpu, f"GPU {gpu}")
    return pins


def pytest_report_header(config):
    facts = machine_facts()
    lines = [
        f"extkv: torch {facts['torch']}, cuda-bindings {facts['cuda-bindings']}, "
        f"nvidia-ml-py {facts['nvidia-ml-py']}, python {facts['python']}",
        f"extkv: host driver: {facts['host_driver']}, granularity {facts['host_granularity']}",
    ]
    for gpu in facts["gpus"]:
        lines.append(
            f"extkv: cuda:{gpu['index']} = {gpu['label']}, driver {gpu['driver']} (CUDA {gpu['cuda_driver_api']}), "
            f"VMM granularity {gpu['granularity']}"
        )
    if not facts["gpus"]:
        lines.append(f"extkv: no CUDA device ({facts['no_gpu_reason']}); GPU tests skip")
    pins = worker_gpus(config)
    if pins:
        lines.append("extkv: one GPU per xdist worker: " + ", ".join(f"{w}->{label}" for w, label in pins.items()))
    elif _xdist_workers(config):
        lines.append(f"extkv: {_xdist_workers(config)} xdist workers, host driver only")
    return lines


# -- collection: invariants, capabilities, device labels ------------------------
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


def _wanted_gpus(item) -> int:
    multi = item.get_closest_marker("multi_gpu")
    if multi is None:
        return 0
    return multi.args[0] if multi.args else 2


def _device_label(item, gpus: list[dict]) -> str:
    """Where `item` runs: a test with a `device` parameter on that device;
    multi_gpu(n) on the first n GPUs; gpu / cuda_graphs on cuda:0 (in an
    xdist worker, the pinned GPU); everything else on the host. `gpus`: the
    GPUs of `machine_facts()`."""
    wanted = _wanted_gpus(item)
    if wanted:
        if len(gpus) < wanted:
            return f"{wanted} GPUs (not visible)"
        names = sorted({gpu["name"] for gpu in gpus[:wanted]})
        return f"GPUs {', '.join(gpu['id'] for gpu in gpus[:wanted])} ({', '.join(names)})"
    params = getattr(item, "callspec", None)
    device = params.params.get("device") if params is not None else None
    if device is None:
        needs_cuda = item.get_closest_marker("gpu") or item.get_closest_marker("cuda_graphs")
        device = "cuda:0" if needs_cuda else HOST_LABEL
    if device == HOST_LABEL:
        return HOST_LABEL
    index = torch.device(device).index or 0
    return gpus[index]["label"] if index < len(gpus) else f"{device} (no GPU)"


def pytest_collection_modifyitems(config, items):
    """The one place capability markers turn into skips; invariant markers
    are checked and, with the device label and the worker, attached to the
    reports here too."""
    gpus = cuda_device_count()
    gpu_facts = machine_facts()["gpus"]
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    for item in items:
        invariants = _invariants_of(item)
        if invariants:
            item.user_properties.append((INVARIANTS_PROPERTY, invariants))
        item.user_properties.append((DEVICE_PROPERTY, _device_label(item, gpu_facts)))
        if worker:
            item.user_properties.append((WORKER_PROPERTY, worker))
        if item.get_closest_marker("stress") and not config.getoption("--stress"):
            item.add_marker(pytest.mark.skip(reason="stress test: run with --stress"))
        needs_cuda = item.get_closest_marker("gpu") or item.get_closest_marker("cuda_graphs")
        if needs_cuda and gpus == 0:
            what = "CUDA graphs need" if item.get_closest_marker("cuda_graphs") else "needs"
            item.add_marker(pytest.mark.skip(reason=f"{what} a CUDA GPU: {_no_cuda_reason()}"))
        wanted = _wanted_gpus(item)
        if wanted and gpus < wanted:
            item.add_marker(pytest.mark.skip(reason=f"needs {wanted} GPUs visible to this process, found {gpus}"))


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


# -- results: the terminal summary and <step>.json ------------------------------
#: Outcomes a test's record can have. A failing call is "failed"; a failing
#: setup or teardown (the leak check runs there) is "error", as in JUnit XML.
OUTCOMES = ("passed", "failed", "error", "skipped")


class RunRecord:
    """Every test's reports, folded into one record per nodeid as they
    arrive. In the controlling process (not an xdist worker) it prints the
    per-invariant summary and, with --extkv-report-dir, writes the JSON."""

    def __init__(self, config):
        self.config = config
        self.tests: dict[str, dict] = {}
        self.collection_errors: list[dict] = []
        self.started = datetime.datetime.now(datetime.timezone.utc)

    @property
    def controlling(self) -> bool:
        return not hasattr(self.config, "workerinput")

    def pytest_runtest_logreport(self, report):
        properties = dict(report.user_properties)
        record = self.tests.setdefault(
            report.nodeid,
            {
                "outcome": None,
                "invariants": properties.get(INVARIANTS_PROPERTY, []),
                "device": properties.get(DEVICE_PROPERTY, HOST_LABEL),
                "worker": properties.get(WORKER_PROPERTY),
                "duration_s": 0.0,
                "skip_reason": None,
                "message": None,
            },
        )
        record["duration_s"] = round(record["duration_s"] + report.duration, 6)
        if report.failed:
            if record["outcome"] != "failed":
                record["outcome"] = "failed" if report.when == "call" else "error"
            record["message"] = record["message"] or _failure_message(report)
        elif report.skipped and record["outcome"] not in ("failed", "error"):
            record["outcome"] = "skipped"
            record["skip_reason"] = _skip_reason(report)
        elif report.when == "call" and record["outcome"] is None:
            record["outcome"] = "passed"

    def pytest_collectreport(self, report):
        if report.failed:
            self.collection_errors.append({"nodeid": report.nodeid, "message": _failure_message(report)})

    def pytest_terminal_summary(self, terminalreporter):
        counted = [record for record in self.tests.values() if record["invariants"]]
        if not counted:
            return
        terminalreporter.write_sep("-", "extkv invariants proven by this run")
        for number, words in INVARIANTS.items():
            outcomes = [record["outcome"] for record in counted if number in record["invariants"]]
            counts = {kind: outcomes.count(kind) for kind in OUTCOMES}
            failed = counts["failed"] + counts["error"]
            verdict = "FAILED" if failed else "proven" if counts["passed"] else "not proven"
            terminalreporter.write_line(
                f"invariant {number} ({words}): {len(outcomes)} tests, {counts['passed']} passed, "
                f"{failed} failed, {counts['skipped']} skipped -> {verdict}"
            )

    def pytest_sessionfinish(self, session, exitstatus):
        directory = self.config.getoption("--extkv-report-dir")
        if directory is None or not self.controlling:
            return
        path = Path(directory) / f"{self.config.getoption('--extkv-report-step')}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tests = {nodeid: {**record, "outcome": record["outcome"] or "error"} for nodeid, record in self.tests.items()}
        outcomes = [record["outcome"] for record in tests.values()]
        document = {
            "format": RECORD_FORMAT,
            "step": self.config.getoption("--extkv-report-step"),
            "arguments": list(self.config.invocation_params.args),
            "started": self.started.isoformat(timespec="seconds"),
            "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "exit_status": int(exitstatus),
            "machine": machine_facts(),
            "worker_gpus": worker_gpus(self.config),
            "invariants": {str(number): words for number, words in INVARIANTS.items()},
            "totals": {kind: outcomes.count(kind) for kind in OUTCOMES},
            "collection_errors": self.collection_errors,
            "tests": tests,
        }
        path.write_text(json.dumps(document, indent=1) + "\n")
        reporter = self.config.pluginmanager.getplugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"extkv: results written to {path}")


def _skip_reason(report) -> str:
    if isinstance(report.longrepr, tuple):
        return report.longrepr[2].removeprefix("Skipped: ")
    return str(report.longrepr)


def _failure_message(report) -> str:
    """The one line that says what failed (pytest's crash line), shortened."""
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    return text.strip().splitlines()[0][:500] if text.strip() else "(no message)"


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


@pytest.fixture
def report_dir(request) -> Path | None:
    """The run directory of --extkv-report-dir, for tests that leave results
    beside check.json (the memory timeline); None when not reporting."""
    directory = request.config.getoption("--extkv-report-dir")
    return Path(directory) if directory is not None else None


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
