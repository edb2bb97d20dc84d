"""pytest wiring of the extkv harness.

- One GPU per xdist worker, chosen before anything initializes CUDA (the
  first thing this file does), printed in the report header.
- The `device` fixture: the host driver and every CUDA device this process
  sees (ids `host`, `cuda:0`, ...). Where there is no GPU a `cuda:0` case is
  still collected, so the report shows it skipped and why.
- Capability markers (gpu, cuda_graphs, multi_gpu(n), stress) become skips
  with reasons in one hook, `pytest_collection_modifyitems`.
- After every test: no reservation, chunk or memfd left behind, and physical
  usage measured outside extkv back where it started.
- Hypothesis profiles: `ci` (derandomized, the default), `dev`, `nightly`;
  choose with --hypothesis-profile or EXTKV_HYPOTHESIS_PROFILE.
"""

from __future__ import annotations

from extkv.testing.gpus import gpu_for_worker, pin_this_worker, visible_gpu_ids

# Must precede any CUDA initialization in this process.
_PINNED_GPU = pin_this_worker()

import os  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from extkv import vmm  # noqa: E402
from extkv.testing.checks import warm_up_kernels  # noqa: E402
from extkv.usage import UsageProbe, open_chunk_fds  # noqa: E402

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
}


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


def pytest_collection_modifyitems(config, items):
    """The one place capability markers turn into skips."""
    gpus = cuda_device_count()
    for item in items:
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
        from extkv.vmm.cuda import query_granularity

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
