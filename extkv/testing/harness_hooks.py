"""The extkv harness's hooks and fixtures, registered when a run activates it.

Theory of operation
-------------------
extkv.testing.harness, the plugin pytest loads, registers this module when
a run asks for the harness (`harness.activate`: extkv's suites from their
conftest, or a harness option on the command line); until then none of it
exists for pytest, so a project that never asks has none of these fixtures,
markers or hooks, and pays for none of its imports (torch, the drivers).
Activation happens in pytest_configure, before collection, so nothing has
initialized CUDA yet when `start` pins.

- One GPU per xdist worker: worker gwN gets GPU N modulo the count
  (extkv.testing.gpus), by narrowing CUDA_VISIBLE_DEVICES.
- The `device` fixture: the host driver and every CUDA device this process
  sees (ids `host`, `cuda:0`, ...). Where there is no GPU a `cuda:0` case is
  still collected, so the report shows it skipped and why.
- Capability markers (gpu, cuda_graphs, multi_gpu(n), stress, and the GPU
  features gpudirect_rdma and dma_buf, which a GPU may lack: the machine
  facts say which it offers, read from its device attributes) become skips
  with reasons in one hook, `pytest_collection_modifyitems`; the same hook
  selects the tests of the device a run asks for (`--extkv-device`: how
  `extkv check` runs every device at once) and orders them: planted
  defects first, then tests marked `long`, tests marked `exclusive` last,
  which `--extkv-lock-dir`
  keeps alone on their device (extkv.testing.exclusive). A parallel run
  given no lock directory (`pytest -n 8`) gets one of its own for its
  duration, so its workers never share a device with an exclusive test.
- After every test: no reservation, chunk or memfd left behind, and physical
  usage measured outside extkv back where it started. A GPU test whose only
  failure is usage above its baseline by whole steps of the context's own
  growth runs once more (extkv.testing.second_run).
- Hypothesis profiles: `extkv-ci` (derandomized, the default), `extkv-dev`,
  `extkv-nightly`; choose with EXTKV_HYPOTHESIS_PROFILE=ci|dev|nightly or
  --hypothesis-profile. The prefix keeps them apart from Hypothesis's own
  `ci` profile, which Hypothesis loads by itself wherever CI is set.
- `@pytest.mark.invariant(n, ...)` names which invariants (1-8, the table
  in extkv.testing.invariants, stated in docs/guarantees.md) a test proves;
  numbers are checked at collection. Each test carries its invariants, the
  device it runs on as a label that names the physical GPU (`GPU 1 (NVIDIA
  H200)`: in an xdist worker `cuda:0` is the worker's pinned GPU) or `host`,
  its xdist worker and any planted defect on its report's user_properties,
  which extkv.testing.record folds into the run's results.
- `@pytest.mark.budget_proof(name)` names which of the shared KV budget's
  proofs (extkv.testing.invariants.BUDGET_PROOFS) a test proves, beside
  its invariants; the name is checked at collection and rides on the
  report's user_properties as a planted defect does, so that the verdict
  prints the budget's line (extkv.check.verdict).
- `@pytest.mark.harness` marks a test of extkv's own checking, reporting or
  tooling rather than of the cache: it proves no invariant, and the counts
  per invariant (read from `invariant` markers alone) leave it out. Such
  tests live in meta/, which `extkv check` does not run. Every conformance
  test carries `invariant`, a planted-defect test too (beside
  `planted_defect(name)`: the invariants its defect breaks), and none
  carries `harness`: conformance/conftest.py refuses any other at
  collection.
- The `build` fixture makes ExtensibleTensors and ExtensibleKVCaches and
  frees them after the test, even when it fails, before the leak check runs.

The fixtures and markers keep short names (`device`, `driver`, `build`,
`gpu`, `stress`): only an activated run sees them, extkv's suites use them
in every test, and a prefix would lengthen every one of those tests for no
project that could meet them unasked.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from .. import vmm
from ..cache import ExtensibleKVCache
from ..layout import KVCacheConfig, KVCacheLayout
from ..tensor import ExtensibleTensor
from ..usage import UsageProbe, open_chunk_fds
from ..vmm.cuda import DEVICE_FEATURES
from .checks import ContextGrowth, may_be_context_growth, warm_up_kernels
from . import model_warm_up  # noqa: F401  (registers the reference decoder's warm-up)
from .configs import CAPACITY, CASE_IDS, CASES, config_for
from .facts import cuda_device_count, machine_facts, no_cuda_reason
from . import exclusive as exclusive_locks
from .gpus import gpu_for_worker, pin_this_worker, visible_gpu_ids
from .invariants import BUDGET_PROOFS, GPU_FEATURES
from .invariants import INVARIANTS as INVARIANT_TABLE
from .record import (
    BUDGET_PROOF_PROPERTY,
    DEVICE_PROPERTY,
    GPU_FEATURES_PROPERTY,
    HOST_LABEL,
    INVARIANTS_PROPERTY,
    PLANTED_PROPERTY,
    WORKER_PROPERTY,
    RunRecord,
)

MARKERS = {
    "gpu": "needs a CUDA GPU driven through cuda-python",
    "cuda_graphs": "captures and replays CUDA graphs",
    "multi_gpu(n)": "needs n GPUs visible to this process",
    "gpudirect_rdma": "needs a GPU that creates VMM chunks GPUDirect RDMA capable "
    "(CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED)",
    "dma_buf": "needs a GPU that exports mapped ranges as dma-bufs (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)",
    "stress": "long randomized run; only with --extkv-stress",
    "long": "takes seconds (a subprocess, a compile, a walk): starts before the other shared tests, so that a "
    "parallel run does not wait for it at its end",
    "exclusive": "needs its device alone (fills it, or reads what the whole device has free): "
    "runs last, and with --extkv-lock-dir alone (extkv.testing.exclusive)",
    "planted_defect(name)": "plants a defect in a broken implementation; the check under test must flag it",
    "invariant(n, ...)": "proves invariant(s) n (1-8, docs/guarantees.md); counted per device",
    "budget_proof(name)": "proves one of the shared KV budget's promises (extkv.testing.invariants.BUDGET_PROOFS): "
    "counted in the verdict's budget line",
    "harness": "checks extkv's own checking, reporting or command-line tooling (verdicts, reports, the harness, "
    "docs/guarantees.md, the README commands), not an invariant of the cache; counted under no invariant",
}
#: The invariants by number, in a few words each.
INVARIANTS = {number: invariant.words for number, invariant in INVARIANT_TABLE.items()}


def pytest_configure(config):
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")


def start(config) -> None:
    """What activation does before these hooks run: pin this xdist worker's
    GPU, one torch thread, the Hypothesis profile, the run record."""
    if config.getoption("--extkv-device") != "multi-gpu":  # the multi-GPU tests need every GPU
        pin_this_worker()
    # The suites' CPU tensors are a few MiB: one thread copies or compares
    # them in about a millisecond, while OpenMP threads on a busy machine, or
    # under xdist (one process per core already), wait for each other for
    # longer than the work takes (10 ms instead of 0.1 ms per op was measured
    # on 2 loaded cores). EXTKV_TORCH_THREADS overrides.
    torch.set_num_threads(int(os.environ.get("EXTKV_TORCH_THREADS", "1")))
    _give_a_parallel_run_locks(config)
    _load_hypothesis_profile_if_used()
    gpus = machine_facts()["gpus"]
    kinds = {HOST_LABEL: "host"} | {gpu["label"]: "cuda" for gpu in gpus}
    chosen = config.getoption("--extkv-device")
    default = gpus[0]["label"] if chosen == "gpu" and gpus else HOST_LABEL
    config.pluginmanager.register(RunRecord(config, default, kinds, worker_gpus(config)), "extkv-run-record")


def _give_a_parallel_run_locks(config) -> None:
    """An xdist controller without `--extkv-lock-dir` makes a lock directory
    for this run, which goes when the run ends, and hands it to its workers
    (`pytest_configure_node`): without one, a test that fills a GPU runs
    beside others on it, and they meet out-of-memory (seen on the H200 under
    `pytest -n 8`: a commit-ahead worker stopped at 6 of 10 blocks)."""
    if config.option.extkv_lock_dir is not None:
        return
    worker = getattr(config, "workerinput", None)
    if worker is not None:
        config.option.extkv_lock_dir = worker.get(_RUN_LOCK_DIR)
    elif getattr(config.option, "numprocesses", None):
        directory = tempfile.mkdtemp(prefix="extkv-locks-")
        config.option.extkv_lock_dir = config.stash[_RUN_LOCKS] = directory
        config.add_cleanup(functools.partial(shutil.rmtree, directory, ignore_errors=True))


_RUN_LOCKS = pytest.StashKey[str]()
_RUN_LOCK_DIR = "extkv_lock_dir"


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist: a worker receives the lock directory its controller made."""
    directory = node.config.stash.get(_RUN_LOCKS, None)
    if directory is not None:
        node.workerinput[_RUN_LOCK_DIR] = directory


def _load_hypothesis_profile_if_used() -> None:
    """The profile, once Hypothesis is imported: by the test modules that use
    it, before their tests run. A process whose tests do not (an xdist
    controller, a small suite) never pays its import, 1.6 s on 2 cores."""
    if "hypothesis" in sys.modules:
        _load_hypothesis_profile()


@functools.cache
def _load_hypothesis_profile() -> None:
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "extkv-ci", derandomize=True, max_examples=40, stateful_step_count=20, deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    settings.register_profile("extkv-dev", max_examples=100, deadline=None)
    settings.register_profile(
        "extkv-nightly", max_examples=2000, stateful_step_count=100, deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    settings.load_profile("extkv-" + os.environ.get("EXTKV_HYPOTHESIS_PROFILE", "ci"))


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
        f"extkv {facts['extkv']}" + (f" at {facts['extkv_commit']}" if facts["extkv_commit"] else "")
        + f": torch {facts['torch']} (CUDA {facts['torch_cuda']}), cuda-bindings {facts['cuda-bindings']}, "
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


# -- collection: invariants, capabilities, device labels, selection ---------------
def _invariants_of(item) -> list[int]:
    numbers: set[int] = set()
    for marker in item.iter_markers("invariant"):
        if not marker.args or marker.kwargs:
            raise pytest.UsageError(f"{item.nodeid}: write @pytest.mark.invariant(n, ...) with n in 1-8, got {marker}")
        for number in marker.args:
            if isinstance(number, bool) or number not in INVARIANTS:
                raise pytest.UsageError(
                    f"{item.nodeid}: invariant {number!r} is not one of the invariants {sorted(INVARIANTS)}"
                )
            numbers.add(number)
    return sorted(numbers)


def _budget_proof_of(item) -> str | None:
    """The budget proof `item` carries (its closest `budget_proof` marker), checked against BUDGET_PROOFS."""
    marker = item.get_closest_marker("budget_proof")
    if marker is None:
        return None
    if len(marker.args) != 1 or marker.kwargs or marker.args[0] not in BUDGET_PROOFS:
        raise pytest.UsageError(f"{item.nodeid}: write @pytest.mark.budget_proof(name) with name one of "
                                f"{list(BUDGET_PROOFS)}, got {marker}")
    return marker.args[0]


def _needs_cuda(item) -> bool:
    return any(item.get_closest_marker(name) for name in ("gpu", "cuda_graphs", *GPU_FEATURES))


def _what_needs(item) -> str:
    """The subject of a skip's `... a CUDA GPU`: what needs one."""
    if item.get_closest_marker("cuda_graphs"):
        return "CUDA graphs need"
    feature = next((words for feature, words in GPU_FEATURES.items() if item.get_closest_marker(feature)), None)
    return f"{feature} needs" if feature else "needs"


def _lacking_feature(item, label: str, gpus: list[dict]) -> str | None:
    """Why the device `item` runs on (`label`) lacks a GPU feature the item's
    markers ask for; None where it has every one. `gpus`: the GPUs of
    `machine_facts()`."""
    offered = next((gpu for gpu in gpus if gpu["label"] == label), None)
    for feature, words in GPU_FEATURES.items():
        if not item.get_closest_marker(feature):
            continue
        if label == HOST_LABEL:
            return f"{words}: not supported here (the host driver: its memory is no GPU's)"
        if offered is None:
            return f"{words}: not supported here ({label}: no one GPU this process sees)"
        if not offered[feature]:
            return f"{words}: not supported here ({label}: {DEVICE_FEATURES[feature]} = 0)"
    return None


def _wanted_gpus(item) -> int:
    multi = item.get_closest_marker("multi_gpu")
    if multi is None:
        return 0
    return multi.args[0] if multi.args else 2


def _device_label(item, gpus: list[dict]) -> str:
    """Where `item` runs: a test with a `device` parameter on that device;
    multi_gpu(n) on the first n GPUs; gpu / cuda_graphs / a GPU feature on
    cuda:0 (in an xdist worker, the pinned GPU); everything else on the
    host. `gpus`: the GPUs of `machine_facts()`."""
    wanted = _wanted_gpus(item)
    if wanted:
        if len(gpus) < wanted:
            return f"{wanted} GPUs (not visible)"
        names = sorted({gpu["name"] for gpu in gpus[:wanted]})
        return f"GPUs {', '.join(gpu['id'] for gpu in gpus[:wanted])} ({', '.join(names)})"
    params = getattr(item, "callspec", None)
    device = params.params.get("device") if params is not None else None
    if device is None:
        device = "cuda:0" if _needs_cuda(item) else HOST_LABEL
    if device == HOST_LABEL:
        return HOST_LABEL
    index = torch.device(device).index or 0
    return gpus[index]["label"] if index < len(gpus) else f"{device} (no GPU)"


def _where(item, label: str) -> str:
    """`host`, `gpu` or `multi-gpu`: the `--extkv-device` choice that keeps `item`."""
    if _wanted_gpus(item):
        return "multi-gpu"
    return "host" if label == HOST_LABEL else "gpu"


#: The order a run takes its tests in, by part. The planted defects first:
#: the checks are shown to catch them before the rest of the run leans on
#: those checks. Then the long tests, so that a parallel run whose workers
#: take a test or two at a time (`extkv check`) does not end waiting for
#: one; the exclusive tests last: they wait for the others on their device
#: (extkv.testing.exclusive).
PART_ORDER = ("planted", "long", "shared", "exclusive")


def _part(item) -> str:
    if item.get_closest_marker("planted_defect"):
        return "planted"
    if item.get_closest_marker("exclusive"):
        return "exclusive"
    return "long" if item.get_closest_marker("long") else "shared"


def pytest_collection_modifyitems(config, items):
    """The one place capability markers turn into skips and a run's device
    and part select its tests; invariant markers are checked and, with the
    device label, the worker and any planted defect, attached to the reports."""
    _load_hypothesis_profile_if_used()
    gpus = cuda_device_count()
    gpu_facts = machine_facts()["gpus"]
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    device_choice = config.getoption("--extkv-device")
    kept, dropped = [], []
    for item in items:
        label = _device_label(item, gpu_facts)
        if device_choice not in ("all", _where(item, label)):
            dropped.append(item)
            continue
        kept.append(item)
        invariants = _invariants_of(item)
        if invariants:
            item.user_properties.append((INVARIANTS_PROPERTY, invariants))
        item.user_properties.append((DEVICE_PROPERTY, label))
        if worker:
            item.user_properties.append((WORKER_PROPERTY, worker))
        planted = item.get_closest_marker("planted_defect")
        if planted is not None:
            item.user_properties.append((PLANTED_PROPERTY, planted.args[0] if planted.args else item.name))
        proof = _budget_proof_of(item)
        if proof is not None:
            item.user_properties.append((BUDGET_PROOF_PROPERTY, proof))
        features = [feature for feature in GPU_FEATURES if item.get_closest_marker(feature)]
        if features:
            item.user_properties.append((GPU_FEATURES_PROPERTY, features))
        if item.get_closest_marker("stress") and not config.getoption("--extkv-stress"):
            item.add_marker(pytest.mark.skip(reason="stress test: run with --extkv-stress"))
        if _needs_cuda(item) and gpus == 0:
            item.add_marker(pytest.mark.skip(reason=f"{_what_needs(item)} a CUDA GPU: {no_cuda_reason()}"))
        elif lacking := _lacking_feature(item, label, gpu_facts):
            item.add_marker(pytest.mark.skip(reason=lacking))
        wanted = _wanted_gpus(item)
        if wanted and gpus < wanted:
            item.add_marker(pytest.mark.skip(reason=f"needs {wanted} GPUs visible to this process, found {gpus}"))
    kept.sort(key=lambda item: PART_ORDER.index(_part(item)))
    items[:] = kept
    if dropped:
        config.hook.pytest_deselected(items=dropped)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Setup, call and teardown under the test's locks (extkv.testing.exclusive)."""
    config = item.config
    directory = config.getoption("--extkv-lock-dir")
    if directory is None:
        return (yield)
    label = dict(item.user_properties).get(DEVICE_PROPERTY, HOST_LABEL)
    gpus = {gpu["label"]: gpu["id"] for gpu in machine_facts()["gpus"]}
    alone = _part(item) == "exclusive"
    with exclusive_locks.held(Path(directory), alone, gpus.get(label)), exclusive_locks.alone_on_device(alone):
        return (yield)


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


# -- fixtures ---------------------------------------------------------------------
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

    def tensor(self, size: int, *, device=None, segment_capacities=None, segment_strides=None) -> ExtensibleTensor:
        tensor = ExtensibleTensor(size, device=self._device(device), segment_capacities=segment_capacities,
                                  segment_strides=segment_strides)
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
    bookkeeping_clean = not problems
    excesses: list[tuple[UsageProbe, int]] = []
    for d, start in before.items():
        probe = _probe(d)
        end = probe.read_outside_torch()
        # A leaked chunk is at least one granule; CUDA's lazy module loading can
        # add less than that to a context as a test runs new kernels.
        tolerance = 0 if d.type == "cpu" else vmm.driver_for(d).granularity
        if abs(end - start) >= max(tolerance, 1):
            problems.append(f"{probe.source} on {d}: {start} -> {end} bytes")
            excesses.append((probe, end - start))
    if problems:
        message = "test leaked: " + "; ".join(problems)
        if bookkeeping_clean and all(may_be_context_growth(probe, excess) for probe, excess in excesses):
            __tracebackhide__ = True
            raise ContextGrowth(message, sum(excess for _, excess in excesses))
        pytest.fail(message, pytrace=False)
