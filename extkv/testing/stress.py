"""The machinery of stress runs: workloads, their tally, and the processes
that press on them from outside.

Theory of operation
-------------------
Every workload here drives real caches on a real driver and adds what it did
and found to one `StressTally`: operations completed (each a public operation
on a real cache, checked), checks passed, faults injected and the
(operation, driver step) pairs they covered, events met (real out-of-memory,
kills), leaks and content mismatches, seeds and reproductions of failures.
A tally is plain data and becomes a test's raw result (JSON); the nightly
suite (`stress/`) runs the workloads until a time bound, the conformance
suite runs each briefly with fixed seeds.

A time bound is a floor, not a hard stop, for the least a workload must do
to prove its point: one *episode* (one whole pressure episode, a walk that
ran every kind of operation, a preserving and a mixed thread round, a
pressure cycle walked through). `Floor` runs a workload's loop until its
deadline and then on until that least is done; where the least outlasted
the deadline, the tally says so (`short_bounds`, "bound too short"), and
the report lists it. `share_of_bound` is how the nightly suite divides what
is left of its bound among the tests still to run: in proportion to their
weights, and nothing at all once the bound is spent, since each workload's
floor is what keeps a test meaningful, not a least number of seconds.

- Endurance (`walk`): a seeded random walk over `ModelledCache`, the cache
  beside its plain-Python model (extkv.testing.stateful). Hypothesis's
  per-step cost caps a state machine at tens of steps a second; the walk runs
  the same operations at hundreds. Each step runs the checks its operation
  alone could break (counts, sizes, the bytes it touched, one chunk per
  segment after a defragment); every `full_check_every` steps the full
  invariant runs (every byte, the driver's read-back, the usage probe). A
  failure names the seed, the step and the steps before it.
- Faults (`enumerate_faults`): for each public operation of `OPERATIONS`,
  from a prepared state, a fault at the 1st, 2nd, ... call of each driver
  step, as a plain failure and as out-of-memory, until the operation
  completes without reaching it. After each: the state agrees with the
  driver's read-back and the usage probe, committed bytes are kept where the
  contract keeps them, a retry succeeds and ends exactly where a fault-free
  run ends (same sizes, physical bytes, one-chunk layout, bytes, over
  poisoned memory), and everything freed leaves nothing behind.
- Pressure (`PressureProcess`, `meet_real_out_of_memory`, `walk_under_pressure`):
  a second process holds and frees real memory on the device (memfd pages on
  the host, torch allocations on a GPU) as told. On a GPU it fills the
  device so that commits meet the driver's real out-of-memory, which must
  raise `OutOfMemoryError`, leave the cache consistent and usable, and
  succeed once the pressure process lets go. On the host the same refusal
  comes from the kernel's numbers before anything is allocated; what the
  refused commit would allocate once memory returns is most of the machine,
  so it is performed only below `host_commit_bound()` and otherwise shown
  to fit the kernel's headroom again.
- Threads (`thread_rounds`): several threads mix operations on one cache for
  as long as allowed; checks between rounds.
- Crashes (`crash_once`): a child process commits, defragments and exports
  in a loop and is stopped and SIGKILLed at a random point of one of them;
  a peer (this process) that imported its segments keeps reading the same
  bytes, and the memory the child held comes back (no process reaches its
  memfds any more; NVML no longer counts it).
- Processes (`run_walk_processes`): several walks in child processes on one
  device at once.

Child processes run this module: `python -m extkv.testing.stress walk|pressure|crash-child ...`.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import random
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .. import vmm
from ..cache import ExtensibleKVCache
from ..connector import SegmentExportConnector, listen_privately
from ..errors import DriverError, OutOfMemoryError
from ..layout import KVCacheLayout, kv_cache_segments
from ..peer import ImportedSegments, import_segments, sha256_hex
from ..tensor import ExtensibleTensor
from ..usage import UsageProbe, open_chunk_fds
from ..vmm import FAULTABLE_STEPS, Driver, FaultInjectingDriver, HostDriver, PoisoningDriver, driver_for
from ..vmm import torch_memory
from ..vmm.host import read_host_memory_headroom
from ..vmm.wrapping import WrappingDriver
from . import exclusive
from .checks import (
    check_readback_matches_bookkeeping,
    check_unchanged,
    readback_one_chunk_per_segment,
    register_workload_warm_up,
    snapshot,
    warm_up_kernels,
)
from .configs import config_for, fill_segments
from .stateful import (
    CACHE_MACHINE_CASES,
    ContentMismatch,
    LeakFound,
    ModelledCache,
    SeededChoices,
    capacity_for,
)

#: Host granule of stress caches: segments still span and share several
#: granules, at a thirty-second of the bytes a 2 MiB granule moves. CUDA
#: keeps its own granule.
HOST_STRESS_GRANULE = 64 << 10
#: Bounds on a wait for a child process's line, or for memory to return.
CHILD_TIMEOUT_S = 120.0
FAULT_MODES = ("failure", "out of memory")


def repo_root() -> Path:
    """The directory holding the extkv package (a checkout's root)."""
    return Path(__file__).resolve().parent.parent.parent


def child_env() -> dict[str, str]:
    """The environment of a child process: this one's, with the extkv
    package importable and one torch thread."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo_root()), env.get("PYTHONPATH")]))
    env.setdefault("EXTKV_TORCH_THREADS", "1")
    return env


def stress_driver(device: torch.device | str) -> Driver:
    """What stress caches run on: poisoned memory (so zeroing is extkv's),
    over the host driver with `HOST_STRESS_GRANULE` or the device's CUDA driver."""
    device = torch.device(device)
    inner = HostDriver(HOST_STRESS_GRANULE) if device.type == "cpu" else driver_for(device)
    return PoisoningDriver(inner)


# -- the tally --------------------------------------------------------------------
@dataclass
class StressTally:
    """What stress workloads did and found. Counters are by name; `faults`
    by (operation, step, mode); everything converts to JSON and back."""

    operations: collections.Counter = field(default_factory=collections.Counter)
    checks: collections.Counter = field(default_factory=collections.Counter)
    events: collections.Counter = field(default_factory=collections.Counter)
    #: Faults injected that fired, by (operation, driver step, mode).
    faults: collections.Counter = field(default_factory=collections.Counter)
    #: (operation, step) pairs tried whose first call the operation never made.
    unreached: set = field(default_factory=set)
    #: Largest physical footprint a stressed cache held, bookkept and checked.
    peak_physical_bytes: int = 0
    leaks: list = field(default_factory=list)
    content_mismatches: int = 0
    failures: list = field(default_factory=list)
    seeds: list = field(default_factory=list)
    #: How the workloads ran (check intervals, bounds), for the report.
    settings: dict = field(default_factory=dict)
    #: Workloads whose least episode outlasted their deadline: {"workload",
    #: "ran" (what the least was), "seconds" (what it took), "share_s"
    #: (seconds its deadline gave it)}.
    short_bounds: list = field(default_factory=list)

    @property
    def pairs_covered(self) -> set[tuple[str, str]]:
        return {(operation, step) for operation, step, _ in self.faults}

    def observe_physical(self, nbytes: int) -> None:
        self.peak_physical_bytes = max(self.peak_physical_bytes, nbytes)

    def fail(self, error: BaseException, reproduction: str = "") -> None:
        """Record a failure; content mismatches and leaks are counted apart."""
        if isinstance(error, ContentMismatch):
            self.content_mismatches += 1
        if isinstance(error, LeakFound):
            self.leaks.append(str(error))
        self.failures.append({"error": f"{type(error).__name__}: {error}", "reproduction": reproduction})

    def bound_too_short(self, workload: str, ran: str, seconds: float, share_s: float) -> None:
        """Record that `workload` ran only its least (`ran`), which took
        `seconds` where its deadline gave it `share_s`."""
        self.short_bounds.append({"workload": workload, "ran": ran, "seconds": round(seconds, 1), "share_s": round(max(share_s, 0.0), 1)})
        self.events["bound too short: a workload ran only its least episode, past its deadline"] += 1

    def add(self, other: "StressTally") -> None:
        for name in ("operations", "checks", "events", "faults"):
            getattr(self, name).update(getattr(other, name))
        self.unreached |= other.unreached
        self.peak_physical_bytes = max(self.peak_physical_bytes, other.peak_physical_bytes)
        self.leaks += other.leaks
        self.content_mismatches += other.content_mismatches
        self.failures += other.failures
        self.seeds += other.seeds
        self.settings.update(other.settings)
        self.short_bounds += other.short_bounds

    def to_json(self) -> dict:
        return {
            "operations": dict(self.operations),
            "operations_total": sum(self.operations.values()),
            "checks": dict(self.checks),
            "events": dict(self.events),
            "faults": [[operation, step, mode, count] for (operation, step, mode), count in sorted(self.faults.items())],
            "faults_injected": sum(self.faults.values()),
            "pairs_covered": sorted([operation, step] for operation, step in self.pairs_covered),
            "unreached": sorted([operation, step] for operation, step in self.unreached),
            "peak_physical_bytes": self.peak_physical_bytes,
            "leaks": list(self.leaks),
            "content_mismatches": self.content_mismatches,
            "failures": list(self.failures),
            "seeds": list(self.seeds),
            "settings": dict(self.settings),
            "short_bounds": list(self.short_bounds),
        }

    @classmethod
    def from_json(cls, data: dict) -> "StressTally":
        return cls(
            operations=collections.Counter(data.get("operations", {})),
            checks=collections.Counter(data.get("checks", {})),
            events=collections.Counter(data.get("events", {})),
            faults=collections.Counter({(o, s, m): c for o, s, m, c in data.get("faults", [])}),
            unreached={(o, s) for o, s in data.get("unreached", [])},
            peak_physical_bytes=data.get("peak_physical_bytes", 0),
            leaks=list(data.get("leaks", [])),
            content_mismatches=data.get("content_mismatches", 0),
            failures=list(data.get("failures", [])),
            seeds=list(data.get("seeds", [])),
            settings=dict(data.get("settings", {})),
            short_bounds=list(data.get("short_bounds", [])),
        )


# -- bounds: a deadline is a floor for one episode ----------------------------------
def share_of_bound(left_s: float, weight: float, weights_left: float) -> float:
    """Seconds of `left_s` (what is left of a run's bound) for a test of
    `weight` among tests of `weights_left` still to run, itself included:
    its part by weight, and none once the bound is spent. No test gets a
    least number of seconds: a guess at an episode's length (3 s was one)
    is too short on one machine and wasted on another, and every test past
    a spent bound would add it to the overrun. The workloads' `Floor` makes
    every test run one whole episode however small its share."""
    if weight <= 0 or weights_left <= 0:
        raise ValueError(f"weights must be > 0, got weight {weight} of {weights_left} left")
    return max(left_s, 0.0) * min(weight / weights_left, 1.0)


class Floor:
    """A workload's deadline `until` (time.monotonic(); None: bounded by a
    count instead), made a floor for its least episode: `more()` is True
    before the deadline, and after it for as long as `least()` says the
    least is not done yet. `least` must stay True once it is (counts only
    grow); it is asked before each episode until it is. `close()` records in
    the tally when the least was done only after the deadline: the bound was
    too short for more than the least."""

    def __init__(self, until: float | None, least: Callable[[], bool] = lambda: True):
        self.until = until
        self.least = least
        self.started = time.monotonic()
        #: When `least()` was first seen True (time.monotonic()), else None.
        self.done_at: float | None = None

    def more(self) -> bool:
        now = time.monotonic()
        if self.done_at is None and self.least():
            self.done_at = now
        return self.until is None or now < self.until or self.done_at is None

    @property
    def too_short(self) -> bool:
        return self.until is not None and self.done_at is not None and self.done_at >= self.until

    def close(self, tally: "StressTally", workload: str, ran: str) -> None:
        """Say in `tally` that `workload` ran only `ran` (its least), past its deadline, if it did."""
        if self.done_at is None and self.until is not None and self.least():
            self.done_at = time.monotonic()
        if self.too_short:
            tally.bound_too_short(workload, ran, time.monotonic() - self.started, self.until - self.started)


# -- the memory timeline ------------------------------------------------------------
class MemoryTimeline:
    """Samples, in a thread, physical memory on each device as seen from
    outside extkv: this process's usage (`UsageProbe`: memfd pages, NVML per
    process) and the device's used memory (the kernel's MemTotal -
    MemAvailable, or the CUDA driver's total - free), every `interval_s`."""

    def __init__(self, devices: list[torch.device], interval_s: float = 0.5):
        self.devices = [torch.device(device) for device in devices]
        self.interval_s = interval_s
        self.probes = {device: UsageProbe(device) for device in self.devices}
        self.start = time.time()
        #: One row per sample: [seconds since start, device, process bytes, device used bytes].
        self.samples: list[list] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="extkv-memory-timeline", daemon=True)

    def __enter__(self) -> "MemoryTimeline":
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        now = round(time.time() - self.start, 3)
        for device, probe in self.probes.items():
            free, total = vmm.device_memory_info(device)
            self.samples.append([now, str(device), probe.read(), total - free])

    def to_json(self) -> dict:
        return {
            "started": self.start,
            "interval_s": self.interval_s,
            "columns": ["seconds", "device", "process_bytes", "device_used_bytes"],
            "sources": {str(device): probe.source for device, probe in self.probes.items()},
            "samples": self.samples,
        }


# -- endurance: the seeded walk --------------------------------------------------------
#: How often each `ModelledCache` operation is picked, relative to the others:
#: a serving engine reads and writes blocks far more often than it resizes.
WALK_WEIGHTS: dict[str, float] = {
    "commit_grow": 8,
    "commit_at_or_below": 3,
    "shrink": 3,
    "defragment": 5,
    "release": 2,
    "recommit": 3,
    "write_block": 14,
    "read_block": 10,
    "export_to_peer": 1,
    "free_and_recreate": 0.5,
    "capture_graph": 0.5,
    "replay_graphs": 2,
}
#: Steps between two full checks of everything.
FULL_CHECK_EVERY = 16
#: Steps after which a walk past its deadline gives up on its least episode
#: as unreachable (minutes on the host driver, where a walk runs hundreds of
#: steps a second).
LEAST_STEPS_CAP = 200_000
#: The operations whose running at least once is a walk's least episode in
#: the nightly suite (stress/test_endurance.py asserts each ran).
WALK_EPISODE_OPERATIONS = ("commit (grow)", "commit (shrink)", "commit (defragment, preserving)", "recommit", "write a block")


def walked_through(operations: collections.Counter, names: tuple[str, ...] = WALK_EPISODE_OPERATIONS, least_steps: int = 1):
    """A walk's `least`: at least `least_steps` steps, with every operation
    of `names` run at least once (counted in `operations`)."""
    return lambda steps: steps >= least_steps and all(operations[name] > 0 for name in names)


def walk(
    driven: ModelledCache,
    choices: SeededChoices,
    tally: StressTally,
    *,
    until: float | None = None,
    steps: int | None = None,
    full_check_every: int = FULL_CHECK_EVERY,
    weights: dict[str, float] = WALK_WEIGHTS,
    replay: str = "",
    least: Callable[[int], bool] | None = None,
    least_what: str = "one step",
    workload: str = "walk",
) -> int:
    """Run `driven` through random operations until `until` (time.monotonic)
    or for `steps` steps; return the steps run. `until` is a floor for the
    walk's least episode: past it the walk goes on until `least(steps so
    far)` holds (default: one step), and says in `tally` when that took it
    past `until` (`least_what` names the least). A failure is recorded in
    `tally` with the seed, the step and the steps before it (and `replay`,
    the command that runs this walk again), then raised."""
    if until is None and steps is None:
        raise ValueError("walk needs a bound: until= (a time.monotonic() deadline) or steps=")
    names = list(weights)
    step = 0
    least = least or (lambda ran: ran >= 1)
    floor = Floor(until, lambda: least(step))
    try:
        while (steps is None or step < steps) and floor.more():
            if floor.done_at is None and until is not None and step > LEAST_STEPS_CAP and time.monotonic() > until:
                raise AssertionError(f"{step} steps, past its deadline, and the walk has not done its least: {least_what}")
            choices.step = step
            driven.thorough = step % full_check_every == full_check_every - 1
            possible = [name for name in names if weights[name] > 0 and driven.can(name)]
            operation = choices.random.choices(possible, [weights[name] for name in possible])[0]
            getattr(driven, operation)(choices)
            if driven.thorough:
                driven.check_everything()
            tally.observe_physical(driven.cache.physical_bytes)
            step += 1
    except BaseException as error:
        reproduction = (
            f"seed {choices.seed}, failed at step {step}"
            + (f"; run again: {replay} --steps {step + 1}" if replay else "")
            + "\n"
            + "\n".join(choices.recent)
        )
        if isinstance(error, Exception):
            tally.fail(error, reproduction)
            error.add_note(reproduction)
        raise
    floor.close(tally, workload, f"{step} steps ({least_what})")
    return step


def run_walk(
    device: torch.device | str,
    kind: str,
    layout: KVCacheLayout,
    seed: int,
    tally: StressTally,
    *,
    until: float | None = None,
    steps: int | None = None,
    full_check_every: int = FULL_CHECK_EVERY,
    weights: dict[str, float] = WALK_WEIGHTS,
    probe: UsageProbe | None = None,
    capacity: int | None = None,
    retry_out_of_memory: bool = False,
    usage_checks: bool = True,
    beside_full_device: bool = False,
    least: Callable[[int], bool] | None = None,
    least_what: str = "one step",
    workload: str = "walk",
) -> int:
    """A walk over a fresh cache of `config_for(kind, layout, capacity)` on
    `stress_driver(device)`; the cache is freed afterwards and must leave
    nothing behind. With `retry_out_of_memory`, a commit refused by real
    out-of-memory is checked, then made again once memory returns;
    `beside_full_device` keeps the checks from taking device memory (no
    snapshots, comparisons on the host). `least`, `least_what`: the walk's
    least episode (see `walk`). Returns the steps run."""
    device = torch.device(device)
    driver = stress_driver(device)
    probe = warmed_probe(device) if probe is None else probe
    tally.seeds.append(seed)
    tally.settings["full check every (steps)"] = full_check_every
    driven = ModelledCache(driver, probe, kind, layout, capacity, operations=tally.operations, checks=tally.checks)
    driven.usage_checks = usage_checks
    driven.snapshot_checks = not beside_full_device
    driven.compare_on_host = beside_full_device
    tally.settings["usage probe compared"] = "yes" if usage_checks else f"no: {probe.source}, other processes share the device"
    if retry_out_of_memory:
        driven.on_out_of_memory = out_of_memory_waiter(driver, tally, driven.check_mapping)
    replay = (
        f"python -m extkv.testing.stress walk --device {device} --kind {kind} --layout {layout.name} "
        f"--seed {seed} --full-check-every {full_check_every}"
    )
    try:
        ran = walk(
            driven, SeededChoices(seed), tally, until=until, steps=steps,
            full_check_every=full_check_every, weights=weights, replay=replay,
            least=least, least_what=least_what, workload=workload,
        )
    finally:
        driven.free()
    try:
        driven.check_nothing_left()
    except LeakFound as error:
        tally.fail(error, f"seed {seed}: after the walk's cache was freed")
        raise
    return ran


def warmed_probe(device: torch.device | str) -> UsageProbe:
    """The usage probe of `device`, once every kernel the workloads run has
    run: CUDA loads a kernel's module on first use, which grows the process's
    NVML reading, and a usage check must see only extkv."""
    device = vmm.canonical_device(device)
    warm_up_kernels(device)
    return UsageProbe(device)


def _warm_up_workload_kernels(device: torch.device | str) -> None:
    """Registered with `warm_up_kernels`, which the harness runs before every
    leak baseline, so no test is the first to load these kernels."""
    device = vmm.canonical_device(device)
    if device.type == "cuda":
        _walk_once(device)


@functools.lru_cache(maxsize=None)
def _walk_once(device: torch.device) -> None:
    """Once per process and GPU: a short walk and a thread round's row checks
    on a throwaway cache, usage unchecked."""
    driven = ModelledCache(stress_driver(device), UsageProbe(device), "full", KVCacheLayout.LBHNC)
    driven.usage_checks = False
    try:
        walk(driven, SeededChoices(0), StressTally(), steps=WARM_UP_STEPS, full_check_every=4)
        if driven.model.mapped and driven.model.committed:
            write_thread_patterns(driven.cache)
            row_states(driven.cache)
    finally:
        driven.free()


register_workload_warm_up(_warm_up_workload_kernels)


#: Steps of the walk that runs every kernel once before a GPU's usage is compared.
WARM_UP_STEPS = 200


def out_of_memory_waiter(
    driven_driver: Driver, tally: StressTally, check: Callable[[], None], timeout_s: float = CHILD_TIMEOUT_S
) -> Callable[[OutOfMemoryError], None]:
    """A `ModelledCache.on_out_of_memory` for walks under real pressure: the
    cache must be consistent after the refusal (`check`); then wait until the
    driver reports more free memory than at the refusal, and let the caller
    retry the same call."""

    def wait_for_memory(error: OutOfMemoryError) -> None:
        tally.events["real out-of-memory met by a walk's commit"] += 1
        check()
        refused_at, _ = driven_driver.memory_info()
        deadline = time.monotonic() + timeout_s
        while driven_driver.memory_info()[0] <= refused_at:
            if time.monotonic() > deadline:
                raise AssertionError(f"memory did not return within {timeout_s} s after: {error}") from error
            time.sleep(0.02)
        tally.events["retried after memory returned"] += 1

    return wait_for_memory


# -- faults: every driver step of every operation -------------------------------------
def chunk_fd_count() -> int:
    """Descriptors of extkv chunks this process holds (exported ones too:
    they reopen the same memfds)."""
    return len(open_chunk_fds())


def live_counts(kind: str) -> tuple[int, int]:
    return vmm.live_reservations[kind], vmm.live_chunks[kind]


@dataclass
class Scene:
    """What one fault attempt works on. `driver` backs the cache or tensor
    (poisoned memory under a fault injector), `importer` is a peer's driver
    over the same real driver; faults are planned on `target`, one of the
    two. The other fields are filled by an operation's `prepare`."""

    kind: str
    layout: KVCacheLayout
    capacity: int
    driver: FaultInjectingDriver
    importer: FaultInjectingDriver
    target: FaultInjectingDriver
    cache: ExtensibleKVCache | None = None
    tensor: ExtensibleTensor | None = None
    connector: SegmentExportConnector | None = None
    sockets: tuple[socket.socket, socket.socket] | None = None
    imported: ImportedSegments | None = None

    @property
    def buffer(self) -> ExtensibleTensor | None:
        return self.cache.buffer if self.cache is not None else self.tensor

    def committed_bytes(self) -> list[torch.Tensor]:
        buffer = self.buffer
        if buffer is None or buffer.is_freed:
            return []
        return [buffer.segment_view(i).clone() for i in range(len(buffer.segment_sizes))]

    def close(self) -> None:
        """Free everything; the first failure is raised after every step ran."""
        failure: Exception | None = None
        steps = [
            self.imported.close if self.imported is not None else None,
            self.connector.close if self.connector is not None else None,
            self.cache.free if self.cache is not None else None,
            self.tensor.free if self.tensor is not None else None,
        ]
        for step in filter(None, steps):
            try:
                step()
            except Exception as error:
                failure = failure or error
        for sock in self.sockets or ():
            sock.close()
        if failure is not None:
            raise failure


def new_cache(scene: Scene) -> None:
    scene.cache = ExtensibleKVCache(config_for(scene.kind, scene.layout, scene.capacity), scene.driver, scene.layout)


def fragmented_cache(scene: Scene) -> None:
    """Two growths, each followed by a pattern over every committed byte:
    every segment spans several chunks."""
    new_cache(scene)
    scene.cache.commit(scene.capacity // 4)
    fill_segments(scene.cache, seed=1)
    scene.cache.commit(scene.capacity // 2)
    fill_segments(scene.cache, seed=2)


def released_cache(scene: Scene) -> None:
    fragmented_cache(scene)
    scene.cache.release_physical()


def registered_cache(scene: Scene) -> None:
    new_cache(scene)
    scene.cache.commit(scene.capacity // 2, defragment=True)
    fill_segments(scene.cache, seed=3)
    scene.connector = SegmentExportConnector()
    scene.connector.register_kv_caches(scene.cache)
    scene.sockets = socket.socketpair()


def imported_cache(scene: Scene) -> None:
    registered_cache(scene)
    export_and_import(scene)


def export_and_import(scene: Scene) -> None:
    scene.connector.export_to(scene.sockets[0])
    scene.imported = import_segments(scene.sockets[1], driver=scene.importer, timeout=CHILD_TIMEOUT_S)


def fragmented_tensor(scene: Scene) -> None:
    """Three segments, the middle one starting mid-granule, each grown twice
    with a pattern written after each growth."""
    g = scene.driver.granularity
    scene.tensor = ExtensibleTensor(7 * g, device=scene.driver, segment_capacities=[g * 5 // 2, g * 3 // 2, 3 * g])
    for sizes, seed in (([g // 2, g // 4, g // 2], 1), ([2 * g, g, 2 * g], 2)):
        scene.tensor.resize_segments_(sizes)
        for i in range(len(sizes)):
            view = scene.tensor.segment_view(i)
            view.copy_((torch.arange(view.numel(), dtype=torch.int32, device=view.device) * 7 + seed + 31 * i).remainder(251).add(1).to(torch.uint8))


def nothing_sent(scene: Scene) -> None:
    """A failed export sent nothing: the peer's end has nothing to read."""
    receiver = scene.sockets[1]
    receiver.setblocking(False)
    try:
        receiver.recv(1)
    except BlockingIOError:
        return
    finally:
        receiver.setblocking(True)
    raise AssertionError("a failed export_to sent something to the peer")


@dataclass(frozen=True)
class FaultableOperation:
    """A public operation, the state it starts from (`prepare`), the call,
    and whether the contract keeps committed bytes when it fails
    (`keeps_contents`). `after_failure` checks what only this operation
    promises; `finish` completes an outcome to compare (an export is
    compared by what a fault-free peer imports)."""

    name: str
    prepare: Callable[[Scene], None]
    call: Callable[[Scene], object]
    keeps_contents: bool
    target_is_importer: bool = False
    after_failure: Callable[[Scene], None] | None = None
    finish: Callable[[Scene], None] | None = None


def clean_import(scene: Scene) -> None:
    scene.imported = import_segments(scene.sockets[1], timeout=CHILD_TIMEOUT_S)


#: Every public operation that makes driver calls, from a state where it
#: makes several of each kind it makes at all.
OPERATIONS: list[FaultableOperation] = [
    FaultableOperation("ExtensibleKVCache()", lambda scene: None, new_cache, keeps_contents=False),
    FaultableOperation("allocate", new_cache, lambda scene: scene.cache.allocate(scene.cache.size), keeps_contents=False),
    FaultableOperation(
        "commit (grow, clamped)", fragmented_cache,
        lambda scene: scene.cache.commit(scene.capacity + scene.capacity // 4), keeps_contents=True,
    ),
    FaultableOperation(
        "commit (shrink)", fragmented_cache, lambda scene: scene.cache.commit(scene.capacity // 8, shrink=True),
        keeps_contents=False,
    ),
    FaultableOperation(
        "commit (defragment, discarding)", fragmented_cache,
        lambda scene: scene.cache.commit(scene.capacity // 2, defragment=True), keeps_contents=False,
    ),
    FaultableOperation(
        "commit (defragment, preserving)", fragmented_cache,
        lambda scene: scene.cache.commit(scene.capacity // 2, defragment=True, preserve_contents=True),
        keeps_contents=True,
    ),
    FaultableOperation(
        "commit (defragment, preserving, growing)", fragmented_cache,
        lambda scene: scene.cache.commit(3 * scene.capacity // 4, defragment=True, preserve_contents=True),
        keeps_contents=True,
    ),
    FaultableOperation("release_physical", fragmented_cache, lambda scene: scene.cache.release_physical(), keeps_contents=False),
    FaultableOperation("recommit", released_cache, lambda scene: scene.cache.recommit(), keeps_contents=False),
    FaultableOperation("free", fragmented_cache, lambda scene: scene.cache.free(), keeps_contents=False),
    FaultableOperation(
        "SegmentExportConnector.export_to", registered_cache,
        lambda scene: scene.connector.export_to(scene.sockets[0]), keeps_contents=True,
        after_failure=nothing_sent, finish=clean_import,
    ),
    FaultableOperation("import_segments", registered_cache, export_and_import, keeps_contents=True, target_is_importer=True),
    FaultableOperation(
        "ImportedSegments.close", imported_cache, lambda scene: scene.imported.close(), keeps_contents=True,
        target_is_importer=True,
    ),
    FaultableOperation(
        "ExtensibleTensor.resize_segments_", fragmented_tensor,
        lambda scene: scene.tensor.resize_segments_(scene.tensor.segment_capacities, zero_new=True), keeps_contents=True,
    ),
    FaultableOperation(
        "ExtensibleTensor.defragment_segment_", fragmented_tensor,
        lambda scene: scene.tensor.defragment_segment_(0), keeps_contents=True,
    ),
]
#: A guard against an operation that never stops making calls of one step.
MAX_CALLS_ENUMERATED = 256
#: Steps after whose failure unmapped chunks may wait for the retry to be
#: released (tensor.release_physical keeps them recorded, not released).
STEPS_THAT_LEAVE_RELEASES_OWED = ("unmap", "release")
#: A call number no operation reaches: a fault planned there never fires.
NEVER = 1 << 62


def observe(scene: Scene) -> dict:
    """Everything a fault-free run and a failed-then-retried run must agree
    on: sizes, committed count, physical bytes, which segments are one chunk
    (read back), each segment's bytes (as digests), what a peer imported."""
    seen: dict[str, object] = {}
    for name, buffer in (("cache", scene.cache.buffer if scene.cache else None), ("tensor", scene.tensor)):
        if buffer is None:
            continue
        if buffer.is_freed:
            seen[name] = "freed"
            continue
        sizes = buffer.segment_sizes
        seen[name] = {
            "segment sizes": sizes,
            "committed blocks": scene.cache.num_committed_blocks if name == "cache" else None,
            "physical bytes": buffer.physical_bytes,
            "one chunk per segment (read back)": readback_one_chunk_per_segment(buffer, sizes),
            "segment digests": [sha256_hex(buffer.segment_view(i)) for i in range(len(sizes))],
        }
    if scene.imported is not None:
        seen["import"] = scene.imported.digests() if scene.imported.views else "closed"
    return seen


def compare_outcomes(seen: dict, golden: dict, what: str) -> None:
    if seen == golden:
        return
    differences = []
    for name in sorted(set(seen) | set(golden)):
        mine, theirs = seen.get(name), golden.get(name)
        if isinstance(mine, dict) and isinstance(theirs, dict):
            differences += [f"{name} {key}" for key in mine if mine[key] != theirs.get(key)]
        elif mine != theirs:
            differences.append(name)
    error = ContentMismatch if any("digests" in d or d == "import" for d in differences) else AssertionError
    raise error(f"{what}: differs from a fault-free run in {', '.join(differences)}")


def check_after_failure(
    scene: Scene, operation: FaultableOperation, kept: list[torch.Tensor], step: str, probe: UsageProbe, baseline: int, what: str
) -> None:
    """The state a failed operation leaves: the driver's read-back agrees with
    the bookkeeping, the usage probe with `physical_bytes` (after a failed
    unmap or release, chunks already unmapped stay owed a release until the
    retry, so it may read more), a cache's sizes match its committed count
    or nothing, and committed bytes the contract keeps are still there."""
    buffer = scene.buffer
    if buffer is None or buffer.is_freed:
        return
    check_readback_matches_bookkeeping(buffer)
    measured = probe.read_outside_torch() - baseline
    owed = step in STEPS_THAT_LEAVE_RELEASES_OWED and measured > buffer.physical_bytes
    if measured != buffer.physical_bytes and not owed:
        raise LeakFound(f"{what}: {probe.source}: {measured} bytes above baseline, but {buffer.physical_bytes} mapped")
    if scene.cache is not None:
        sizes = buffer.segment_sizes
        counted = [scene.cache.num_committed_blocks * stride for stride in scene.cache.segment_strides]
        assert sizes in (counted, [0] * len(sizes)), f"{what}: segment sizes {sizes}, neither the committed count's {counted} nor released"
    if operation.keeps_contents:
        for i, before in enumerate(kept):
            now = buffer.segment_view(i)
            common = min(now.numel(), before.numel())
            if not torch.equal(now[:common], before[:common].to(now.device)):
                raise ContentMismatch(f"{what}: segment {i}: committed bytes changed by a failed operation that keeps them")


def fault_attempt(
    operation: FaultableOperation,
    scenario: tuple[str, KVCacheLayout],
    real: Driver,
    probe: UsageProbe,
    tally: StressTally,
    step: str,
    nth: int,
    mode: str,
    golden: dict,
) -> bool:
    """Plan a fault at the `nth` call of `step` during `operation`; True when
    the operation reached it. Everything is checked and freed before return."""
    kind, layout = scenario
    live, fds, baseline = live_counts(real.kind), chunk_fd_count(), probe.read_outside_torch()
    scene = new_scene(scenario, real, out_of_memory=mode == "out of memory", target_is_importer=operation.target_is_importer)
    try:
        operation.prepare(scene)
        # Copies of the committed bytes only where the contract keeps them:
        # nothing else reads them (on the host, clones of fresh pages were
        # a sixth of a fault enumeration's time under cProfile).
        kept = scene.committed_bytes() if operation.keeps_contents else []
        scene.target.fail_in(step, nth)
        error: DriverError | None = None
        try:
            operation.call(scene)
        except DriverError as raised:
            error = raised
        if not scene.target.fired:
            # Moved out of reach, so that freeing the scene does not meet it.
            scene.target.fail_in(step, NEVER)
            if error is not None:
                raise error
            if nth == 1:
                tally.unreached.add((operation.name, step))
            return False
        tally.faults[(operation.name, step, mode)] += 1
        tally.operations["operation under an injected fault, retried"] += 1
        what = f"{operation.name}, fault ({mode}) at call {nth} of {step}, {kind}-{layout.name}"
        if error is not None:
            expected = OutOfMemoryError if mode == "out of memory" else DriverError
            if not isinstance(error, expected) or "injected fault" not in str(error):
                raise AssertionError(f"{what}: raised {error!r}, expected the injected {expected.__name__}") from error
            check_after_failure(scene, operation, kept, step, probe, baseline, what)
            if operation.after_failure is not None:
                operation.after_failure(scene)
            tally.checks["consistent after an injected fault: read-back, usage, kept bytes"] += 1
            operation.call(scene)  # each planned fault fires once: the retry must succeed
        else:
            # CUDA answers an out-of-memory create by emptying torch's cache
            # and creating again, which succeeds past a one-shot fault.
            tally.events["injected out-of-memory absorbed by the create retry"] += 1
        if operation.finish is not None:
            operation.finish(scene)
        compare_outcomes(observe(scene), golden, what)
        tally.checks["retry ends where a fault-free run ends"] += 1
    finally:
        scene.close()
    left = live_counts(real.kind), chunk_fd_count(), probe.read_outside_torch() - baseline
    if left != (live, fds, 0):
        raise LeakFound(
            f"{operation.name}, fault ({mode}) at call {nth} of {step}: after freeing everything, "
            f"live (reservations, chunks) {live} -> {left[0]}, chunk descriptors {fds} -> {left[1]}, {left[2]} bytes above baseline"
        )
    tally.checks["nothing left after a fault and its retry"] += 1
    return True


def new_scene(scenario: tuple[str, KVCacheLayout], real: Driver, *, out_of_memory: bool, target_is_importer: bool) -> Scene:
    kind, layout = scenario
    driver = FaultInjectingDriver(PoisoningDriver(real), out_of_memory=out_of_memory)
    importer = FaultInjectingDriver(real, out_of_memory=out_of_memory)
    return Scene(
        kind, layout, capacity_for(kind, layout, real.granularity), driver, importer,
        importer if target_is_importer else driver,
    )


def golden_outcome(operation: FaultableOperation, scenario: tuple[str, KVCacheLayout], real: Driver) -> dict:
    """`observe` after `operation` ran without a fault."""
    scene = new_scene(scenario, real, out_of_memory=False, target_is_importer=operation.target_is_importer)
    try:
        operation.prepare(scene)
        operation.call(scene)
        if operation.finish is not None:
            operation.finish(scene)
        return observe(scene)
    finally:
        scene.close()


def enumerate_faults(
    real: Driver,
    probe: UsageProbe,
    tally: StressTally,
    *,
    scenarios: list[tuple[str, KVCacheLayout]] = CACHE_MACHINE_CASES[:1],
    operations: list[FaultableOperation] = OPERATIONS,
    until: float | None = None,
    progress: Callable[[str], None] | None = None,
) -> bool:
    """For each scenario and operation: a fault at the 1st, 2nd, ... call of
    every driver step, in both modes, until the operation completes without
    reaching it. `real` is the real driver (host or CUDA) under it all.
    Returns False when `until` (time.monotonic) stopped it first."""
    for scenario in scenarios:
        for operation in operations:
            golden = golden_outcome(operation, scenario, real)
            for mode in FAULT_MODES:
                for step in FAULTABLE_STEPS:
                    if until is not None and time.monotonic() > until:
                        tally.events["fault enumeration stopped by its time bound"] += 1
                        return False
                    nth = 1
                    while fault_attempt(operation, scenario, real, probe, tally, step, nth, mode, golden):
                        nth += 1
                        if nth > MAX_CALLS_ENUMERATED:
                            raise AssertionError(f"{operation.name} made more than {MAX_CALLS_ENUMERATED} {step} calls")
            if progress is not None:
                covered = sum(1 for name, _ in tally.pairs_covered if name == operation.name)
                progress(f"faults: {operation.name} ({scenario[0]}-{scenario[1].name}): {covered} steps covered")
    tally.events["fault enumeration passes completed"] += 1
    return True


# -- pressure: a second process holding real memory ------------------------------------
#: Pieces a pressure process holds (`hold`), and the smallest it tries when
#: filling (`fill` asks for the whole gap at once and halves what the device
#: refuses): small enough to leave little unused when the device is nearly full.
HOST_PRESSURE_PIECE = 64 << 20
GPU_PRESSURE_PIECE = 256 << 20
#: The largest piece of a GPU fill.
GPU_FILL_PIECE = 8 << 30
#: Name of the pressure process's memfds (not extkv's, so no probe counts them).
PRESSURE_MEMFD_NAME = "extkv-stress-pressure"


def host_pressure_bound() -> int:
    """The most a host pressure process holds: an eighth of the machine's
    memory, at most 2 GiB, well below what the machine has."""
    _, total = vmm.device_memory_info("cpu")
    return min(2 << 30, total // 8)


def host_commit_bound() -> int:
    """The largest commit a host stress test performs for real: a quarter of
    the machine's memory, at most 4 GiB."""
    _, total = vmm.device_memory_info("cpu")
    return min(4 << 30, total // 4)


class MemoryHolder:
    """Real memory held by the pressure process: memfd pages on the host
    (fallocate'd, so the kernel really gives them), torch allocations on a GPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pieces: list = []
        self.held = 0

    def _take(self, size: int) -> bool:
        """Allocate one piece; False when the device has no more."""
        if self.device.type == "cpu":
            fd = os.memfd_create(PRESSURE_MEMFD_NAME, os.MFD_CLOEXEC)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError:
                os.close(fd)
                return False
            self.pieces.append(fd)
        else:
            try:
                self.pieces.append(torch.empty(size, dtype=torch.uint8, device=self.device))
            except torch.OutOfMemoryError:
                return False
        self.held += size
        return True

    def hold(self, nbytes: int) -> int:
        """Hold about `nbytes` more (whole pieces); returns what is held."""
        piece = HOST_PRESSURE_PIECE if self.device.type == "cpu" else GPU_PRESSURE_PIECE
        target = self.held + nbytes
        while self.held < target and self._take(min(piece, target - self.held)):
            pass
        return self.held

    def fill(self, leave: int) -> int:
        """Allocate until the device's free memory is at most `leave` bytes,
        in pieces of at most GPU_FILL_PIECE that each fit what is free, a
        piece the device refuses halved down to the smallest piece. On a
        141 GB H200 that is about 17 allocations a fill, where pieces of
        256 MiB were about 540. Measured there: asking for the whole gap at
        once (135.29 GiB of 139.29 free) is refused, and a fill that went on
        with halved pieces after that refusal was not given back by
        `release`: the device still read 4 GiB free 3 s later. Pieces of at
        most 8 GiB come back at `release`."""
        smallest = HOST_PRESSURE_PIECE if self.device.type == "cpu" else GPU_PRESSURE_PIECE
        largest = HOST_PRESSURE_PIECE if self.device.type == "cpu" else GPU_FILL_PIECE
        while True:
            free, _ = vmm.device_memory_info(self.device)
            if free <= leave:
                return self.held
            piece = min(free - leave, largest)
            while not self._take(piece):
                if piece <= smallest:
                    return self.held
                piece = max(piece // 2, smallest)

    def release(self) -> None:
        for piece in self.pieces:
            if self.device.type == "cpu":
                os.close(piece)
        self.pieces = []
        self.held = 0
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def pressure_main(device: torch.device) -> None:
    """The pressure process: one command a line on stdin, one answer a line
    on stdout.

    hold N        hold N more bytes             -> held <bytes held>
    fill L        allocate until L bytes free   -> held <bytes held>
    release       free everything               -> released
    cycle MODE N SECONDS  in a thread: hold N (MODE hold) or fill to N free
                  (MODE fill) for SECONDS, release for SECONDS, again -> cycling
    cycles        cycles completed so far       -> cycles <cycles>
    stop          end the cycle, release        -> stopped <cycles>
    quit          exit
    """
    holder = MemoryHolder(device)
    stop = threading.Event()
    cycler: threading.Thread | None = None
    cycles = 0

    def cycle(mode: str, amount: int, seconds: float) -> None:
        nonlocal cycles
        while not stop.is_set():
            holder.hold(amount) if mode == "hold" else holder.fill(amount)
            stop.wait(seconds)
            holder.release()
            cycles += 1
            stop.wait(seconds)

    def answer(text: str) -> None:
        print(text, flush=True)

    answer("ready")
    for line in sys.stdin:
        command, *arguments = line.split()
        if command == "hold":
            answer(f"held {holder.hold(int(arguments[0]))}")
        elif command == "fill":
            answer(f"held {holder.fill(int(arguments[0]))}")
        elif command == "release":
            holder.release()
            answer("released")
        elif command == "cycle":
            stop.clear()
            cycler = threading.Thread(target=cycle, args=(arguments[0], int(arguments[1]), float(arguments[2])), daemon=True)
            cycler.start()
            answer("cycling")
        elif command == "cycles":
            answer(f"cycles {cycles}")
        elif command == "stop":
            stop.set()
            if cycler is not None:
                cycler.join()
            holder.release()
            answer(f"stopped {cycles}")
        elif command == "quit":
            break
        else:
            answer(f"error: unknown command {command!r}")


class ChildProcess:
    """A child running this module, spoken to by lines. Its stdout is read
    unbuffered, so that `drain()` sees every line it wrote before it stopped;
    every wait is bounded."""

    def __init__(self, arguments: list[str]):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "extkv.testing.stress", *arguments],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=child_env(),
            cwd=repo_root(),
        )
        self._pending = bytearray()
        self._lines: collections.deque[str] = collections.deque()

    @property
    def pid(self) -> int:
        return self.process.pid

    def send(self, line: str) -> None:
        self.process.stdin.write(line.encode() + b"\n")
        self.process.stdin.flush()

    def _read(self, timeout_s: float) -> bool:
        """Read what the child wrote within `timeout_s`; False at a timeout or end."""
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        data = os.read(self.process.stdout.fileno(), 1 << 16) if ready else b""
        self._pending += data
        *complete, rest = self._pending.split(b"\n")
        self._lines.extend(line.decode() for line in complete)
        self._pending = bytearray(rest)
        return bool(data)

    def line(self, timeout_s: float = CHILD_TIMEOUT_S) -> str:
        """The child's next line of stdout."""
        deadline = time.monotonic() + timeout_s
        while not self._lines:
            if not self._read(max(deadline - time.monotonic(), 0)):
                self.kill()
                stderr = self.process.stderr.read().decode(errors="replace")
                raise AssertionError(
                    f"child {' '.join(map(str, self.process.args[3:]))} said nothing within {timeout_s} s "
                    f"(exit {self.process.returncode}): {stderr[-3000:]}"
                )
        return self._lines.popleft()

    def drain(self, quiet_s: float = 0.05) -> list[str]:
        """Every line written so far (of a stopped child: all it wrote)."""
        while self._read(quiet_s):
            pass
        lines = list(self._lines)
        self._lines.clear()
        return lines

    def ask(self, line: str, timeout_s: float = CHILD_TIMEOUT_S) -> str:
        self.send(line)
        return self.line(timeout_s)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(CHILD_TIMEOUT_S)

    def close(self) -> None:
        """Ask the child to quit, then kill it; reaps it either way."""
        if self.process.poll() is None:
            try:
                self.send("quit")
                self.process.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            stream.close()

    def __enter__(self) -> "ChildProcess":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class PressureProcess(ChildProcess):
    """`pressure_main` in a child process on `device`."""

    def __init__(self, device: torch.device | str):
        super().__init__(["pressure", "--device", str(device)])
        ready = self.line()
        if ready != "ready":
            self.kill()
            raise AssertionError(f"pressure process said {ready!r}, expected 'ready'")

    def held(self, command: str) -> int:
        reply = self.ask(command)
        if not reply.startswith("held "):
            raise AssertionError(f"pressure process answered {command!r} with {reply!r}")
        return int(reply.split()[1])

    def cycles(self) -> int:
        """Cycles (take, hold, free) the pressure process completed so far."""
        reply = self.ask("cycles")
        if not reply.startswith("cycles "):
            raise AssertionError(f"pressure process answered 'cycles' with {reply!r}")
        return int(reply.split()[1])


class AllocationBound(WrappingDriver):
    """`inner`, except that a create above `bound` bytes which the host's
    headroom would grant is refused with an AssertionError instead: a host
    stress test that means to meet the kernel's refusal must never take most
    of the machine because memory came back at the wrong moment."""

    def __init__(self, inner: Driver, bound: int):
        super().__init__(inner)
        self.bound = bound

    def _create(self, size: int):
        if size > self.bound:
            available = read_host_memory_headroom(size).available
            if available is None or size <= available:
                raise AssertionError(
                    f"a create of {size} bytes would be granted ({available} available), above the "
                    f"test's bound of {self.bound} bytes; not allocating"
                )
        return self.inner._create(size)


def bytes_per_block(kind: str, layout: KVCacheLayout) -> int:
    """Bytes one block of `config_for(kind, layout)` spans over all its segments."""
    _, strides = kv_cache_segments(config_for(kind, layout, 1), layout)
    return sum(strides)


def free_memory_for(driver: Driver, size: int) -> int:
    """What a create of `size` bytes may take now: the host's headroom (the
    kernel's numbers, as the host driver's create reads them) or the CUDA
    driver's free memory plus what torch's caching allocator holds unused,
    which extkv hands back and retries with when a create meets out of
    memory (found on 2x H200: a commit 1 GiB past the driver's free memory
    succeeded on cached blocks)."""
    if driver.kind == "host":
        available = read_host_memory_headroom(size).available
        return size * 2 if available is None else available
    return driver.memory_info()[0] + torch_memory.cached_unused(driver.device)


#: Bytes compared at once: a comparison allocates a mask as large as its input.
COMPARE_SLICE = 256 << 20


def write_block_values(kv_cache: ExtensibleKVCache, first: int, end: int, value: int) -> None:
    for segment, stride in enumerate(kv_cache.segment_strides):
        kv_cache.buffer.segment_view(segment)[first * stride : end * stride].fill_(value)


def check_block_values(kv_cache: ExtensibleKVCache, first: int, end: int, value: int, what: str) -> None:
    """Every byte of blocks [first, end) is `value`, compared a slice at a time."""
    for segment, stride in enumerate(kv_cache.segment_strides):
        rows = kv_cache.buffer.segment_view(segment)[first * stride : end * stride]
        wrong = sum(int((rows[at : at + COMPARE_SLICE] != value).count_nonzero()) for at in range(0, rows.numel(), COMPARE_SLICE))
        if wrong:
            raise ContentMismatch(f"{what}: segment {segment}: {wrong} of {rows.numel()} bytes are not {value}")


#: Blocks a real-out-of-memory episode keeps committed and patterned throughout,
#: and the bytes it commits under pressure to show the cache still usable.
PRESSURE_KEPT_BLOCKS = 64
PRESSURE_PATTERN = 0x5C
PRESSURE_SMALL_COMMIT_BYTES = 8 << 20
#: Host granule of the out-of-memory episodes: their cache spans more than the
#: machine's memory, and reading back every granule of it stays quick.
PRESSURE_HOST_GRANULE = 32 << 20
#: Address space of a GPU episode's cache: more than any commit it makes
#: (what the pressure process leaves free, at most 6 GiB, plus 1 GiB).
GPU_PRESSURE_CAPACITY_BYTES = 12 << 30
#: Skipped pressure episodes in a row that mean the pressure never presses.
MAX_SKIPPED_EPISODES = 10
#: Most torch CPU threads a walk beside a full GPU compares bytes with. Its
#: checks copy what they compare to the host (a comparison on the device
#: would need device memory the pressure leaves none of): the 200 steps of
#: the CI walk under pressure (1.5 GiB cache, seed 20261130) compare 46 GiB,
#: counted on the host driver with the same capacity and weights. One
#: thread, the harness's default, compared 32 MiB of rows against their
#: expanded values (torch.equal) in 46 ms on a 2-core x86 development host,
#: two threads in 23 ms: under 1 GB/s a thread, which is most of the 46-90 s
#: the CI test took on the H200 (check runs under reports/).
HOST_COMPARE_THREADS = 8


def host_compare_threads() -> int:
    """torch CPU threads for host comparisons: up to HOST_COMPARE_THREADS,
    the CPUs this process may use shared among the xdist workers, or all of
    them while the test holds its device alone (its device's other workers
    wait then: extkv.testing.exclusive)."""
    alone = os.environ.get(exclusive.ALONE_VARIABLE) == "1"
    workers = 1 if alone else max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), 1)
    return max(1, min(HOST_COMPARE_THREADS, len(os.sched_getaffinity(0)) // workers))


def meet_real_out_of_memory(
    device: torch.device | str,
    pressure: PressureProcess,
    tally: StressTally,
    *,
    seed: int,
    until: float | None = None,
    episodes: int | None = None,
    layout: KVCacheLayout = KVCacheLayout.BLHNC,
) -> int:
    """Episodes until `until` (time.monotonic) or `episodes` of them; returns
    how many ran. `layout` BLHNC commits one run; LBHNC one run per layer,
    each of which may fit alone where all do not (on the host the commit is
    refused whole before its first create). In each, the pressure process takes memory; a commit
    needing more than is left then is refused with `OutOfMemoryError` by the
    real driver or kernel, changes nothing, and the cache stays usable (a
    small commit succeeds); the pressure process lets go; the same commit
    succeeds (new blocks zero, kept blocks kept); the cache sleeps, its wake
    meets pressure and is refused while it does not fit, and wakes once
    memory returns. On the host a commit is performed only below
    `host_commit_bound()`: above it, the refused commit is shown to fit the
    kernel's headroom once memory returned, and is not performed. `until` is
    a floor for one whole episode (a skipped one, where the pressure left
    more free than the cache spans, does not count)."""
    if until is None and episodes is None:
        raise ValueError("meet_real_out_of_memory needs a bound: until= or episodes=")
    device = torch.device(device)
    rng = random.Random(seed)
    tally.seeds.append(seed)
    host = device.type == "cpu"
    real = HostDriver(PRESSURE_HOST_GRANULE) if host else driver_for(device)
    _, total = real.memory_info()
    bound = host_commit_bound() if host else total
    driver = AllocationBound(PoisoningDriver(real), bound) if host else PoisoningDriver(real)
    margin = host_pressure_bound() // 2 if host else 1 << 30
    tally.settings["real out-of-memory: largest commit performed (bytes)"] = bound
    stride = bytes_per_block("full", layout)
    capacity_bytes = total + total // 4 if host else GPU_PRESSURE_CAPACITY_BYTES
    kv_cache = ExtensibleKVCache(config_for("full", layout, -(-capacity_bytes // stride)), driver, layout)
    small = PRESSURE_KEPT_BLOCKS + PRESSURE_SMALL_COMMIT_BYTES // stride
    try:
        kv_cache.commit(PRESSURE_KEPT_BLOCKS)
        write_block_values(kv_cache, 0, PRESSURE_KEPT_BLOCKS, PRESSURE_PATTERN)
        ran = whole = skipped_in_a_row = 0
        floor = Floor(until, lambda: whole >= 1)
        while (episodes is None or ran < episodes) and floor.more():
            ran += 1
            held = pressure.held(f"hold {host_pressure_bound()}") if host else pressure.held(f"fill {rng.randint(2, 6) << 30}")
            tally.events["pressure episodes"] += 1
            available = free_memory_for(driver, total)
            wanted = available + rng.randint(margin // 2, margin)
            target = min(PRESSURE_KEPT_BLOCKS + -(-wanted // stride), kv_cache.capacity_blocks)
            new_bytes = (target - PRESSURE_KEPT_BLOCKS) * stride
            if new_bytes <= available:
                tally.events["episode skipped: the pressure process left more free than the cache spans"] += 1
                pressure.ask("release")
                skipped_in_a_row += 1
                if skipped_in_a_row >= MAX_SKIPPED_EPISODES:
                    raise AssertionError(
                        f"{skipped_in_a_row} pressure episodes in a row left more free ({available} bytes) than the cache spans"
                    )
                continue
            skipped_in_a_row = 0
            before = snapshot(kv_cache)
            try:
                kv_cache.commit(target)
            except OutOfMemoryError:
                tally.events["commit refused by real out-of-memory"] += 1
            else:
                raise AssertionError(
                    f"a commit of {new_bytes} new bytes succeeded with {available} available "
                    f"and {held} held by the pressure process"
                )
            check_unchanged(kv_cache, before)
            tally.checks["refused commit changed nothing (snapshot: chunks, read-back, bytes)"] += 1
            kv_cache.commit(small)
            check_block_values(kv_cache, 0, PRESSURE_KEPT_BLOCKS, PRESSURE_PATTERN, "kept blocks under pressure")
            check_block_values(kv_cache, PRESSURE_KEPT_BLOCKS, small, 0, "blocks committed under pressure")
            kv_cache.commit(PRESSURE_KEPT_BLOCKS, shrink=True)
            write_block_values(kv_cache, 0, PRESSURE_KEPT_BLOCKS, PRESSURE_PATTERN)
            tally.operations["commit refused by real out-of-memory, small commit and shrink under pressure"] += 3
            if pressure.ask("release") != "released":
                raise AssertionError("the pressure process did not release its memory")
            returned = free_memory_for(driver, new_bytes)
            if new_bytes > bound:
                fits = "fits" if returned >= new_bytes else "does not fit (others took memory meanwhile)"
                tally.events[f"refused commit {fits} once memory returned; not performed: above the {bound >> 20} MiB bound"] += 1
                whole += 1
                continue
            kv_cache.commit(target)
            tally.events["refused commit succeeded once memory returned"] += 1
            check_block_values(kv_cache, 0, PRESSURE_KEPT_BLOCKS, PRESSURE_PATTERN, "kept blocks after the retried commit")
            check_block_values(kv_cache, PRESSURE_KEPT_BLOCKS, target, 0, "blocks the retried commit added")
            check_readback_matches_bookkeeping(kv_cache.buffer)
            tally.observe_physical(kv_cache.physical_bytes)
            kv_cache.release_physical()  # sleep
            pressure.held(f"fill {rng.randint(1, 3) << 30}")
            try:
                kv_cache.recommit()
                tally.events["wake fitted beside the pressure"] += 1
            except OutOfMemoryError:
                tally.events["wake refused by real out-of-memory"] += 1
                check_readback_matches_bookkeeping(kv_cache.buffer)
            if pressure.ask("release") != "released":
                raise AssertionError("the pressure process did not release its memory")
            kv_cache.recommit()
            check_block_values(kv_cache, 0, target, 0, "blocks after a wake")
            kv_cache.commit(PRESSURE_KEPT_BLOCKS, shrink=True)
            write_block_values(kv_cache, 0, PRESSURE_KEPT_BLOCKS, PRESSURE_PATTERN)
            tally.operations["retried commit, sleep, wake under pressure, wake, shrink"] += 5
            whole += 1
        floor.close(tally, "real out-of-memory episodes", f"{whole} whole pressure episode{'s' if whole != 1 else ''}")
    finally:
        kv_cache.free()
    return ran


def walk_under_pressure(
    device: torch.device | str,
    pressure: PressureProcess,
    tally: StressTally,
    *,
    seed: int,
    until: float | None = None,
    steps: int | None = None,
    least_steps: int = 1,
) -> int:
    """The endurance walk while the pressure process takes and frees memory in
    a loop. On the host it holds `host_pressure_bound()` for half a second at
    a time; on a GPU it fills the device to half a GiB free for a second at a
    time, beside a cache of up to 1.5 GiB, so growing commits meet real
    out-of-memory: each must leave the cache consistent (read-back, usage
    probe) and succeed when made again once memory returns. `until` is a
    floor for the least episode: `least_steps` steps, walked through at
    least one whole pressure cycle (take, hold, free)."""
    device = torch.device(device)
    probe = warmed_probe(device)
    if device.type == "cpu":
        reply = pressure.ask(f"cycle hold {host_pressure_bound()} 0.5")
        capacity = None
    else:
        reply = pressure.ask(f"cycle fill {512 << 20} 1.0")
        capacity = (3 << 29) // bytes_per_block("full", KVCacheLayout.LBHNC)
    if reply != "cycling":
        raise AssertionError(f"the pressure process answered 'cycle' with {reply!r}")
    # On a GPU: an export hashes every committed byte on the CPU, too slow
    # for 1.5 GiB, and a graph's capture takes device memory of its own.
    weights = WALK_WEIGHTS if capacity is None else dict(WALK_WEIGHTS, export_to_peer=0, capture_graph=0, replay_graphs=0)
    cycled = False

    def least(ran: int) -> bool:
        # Asked before each step until it holds: one line to the pressure process.
        nonlocal cycled
        cycled = cycled or (ran >= least_steps and pressure.cycles() >= 1)
        return cycled

    threads = torch.get_num_threads()
    if capacity is not None:
        torch.set_num_threads(host_compare_threads())
        tally.settings["torch CPU threads of host comparisons beside a full GPU"] = torch.get_num_threads()
    try:
        ran = run_walk(
            device, "full", KVCacheLayout.LBHNC, seed, tally, until=until, steps=steps, probe=probe,
            capacity=capacity, weights=weights, retry_out_of_memory=True,
            # A device-wide reading would count the pressure process too.
            usage_checks=probe.per_process, beside_full_device=capacity is not None,
            least=least, least_what=f"{least_steps} step{'s' if least_steps != 1 else ''}, through a whole pressure cycle",
            workload="walk under memory pressure",
        )
    finally:
        torch.set_num_threads(threads)
        stopped = pressure.ask("stop")
    tally.events["pressure cycles (take, hold, free)"] += int(stopped.split()[1])
    return ran


# -- threads -------------------------------------------------------------------------
THREADS = 8
OPERATIONS_PER_THREAD = 16
#: A thread workload's least episode: one preserving and one mixed round.
LEAST_THREAD_ROUNDS = 2


def thread_pattern(kv_cache: ExtensibleKVCache, segment: int, num_blocks: int) -> torch.Tensor:
    """Never-zero byte per (block, segment): row b of segment s holds one value."""
    blocks = torch.arange(num_blocks, dtype=torch.int32, device=kv_cache.buffer.device)
    return ((blocks * 7 + 31 * segment) % 251 + 1).to(torch.uint8)


def committed_rows(kv_cache: ExtensibleKVCache, segment: int) -> torch.Tensor:
    stride = kv_cache.segment_strides[segment]
    return kv_cache.buffer.segment_view(segment)[: kv_cache.num_committed_blocks * stride].view(-1, stride)


def write_thread_patterns(kv_cache: ExtensibleKVCache) -> None:
    for segment in range(len(kv_cache.segment_strides)):
        rows = committed_rows(kv_cache, segment)
        rows.copy_(thread_pattern(kv_cache, segment, rows.shape[0])[:, None].expand_as(rows))


def row_states(kv_cache: ExtensibleKVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """Per committed block: whether every segment's row is its whole
    pattern, and whether every segment's row is all zero."""
    n = kv_cache.num_committed_blocks
    patterned = torch.ones(n, dtype=torch.bool, device=kv_cache.buffer.device)
    zero = torch.ones_like(patterned)
    for segment in range(len(kv_cache.segment_strides)):
        rows = committed_rows(kv_cache, segment)
        patterned &= (rows == thread_pattern(kv_cache, segment, n)[:, None]).all(dim=1)
        zero &= (rows == 0).all(dim=1)
    return patterned, zero


def thread_rounds(
    device: torch.device | str,
    layout: KVCacheLayout,
    tally: StressTally,
    *,
    seed: int,
    until: float | None = None,
    rounds: int | None = None,
    threads: int = THREADS,
    per_thread: int = OPERATIONS_PER_THREAD,
) -> int:
    """Rounds of `threads` threads, each making `per_thread` random calls on
    one shared cache (over poisoned memory), until `until` or for `rounds`.
    Between rounds the threads are joined and checked against what any
    interleaving of the round's calls allows: in *preserving* rounds
    (growing, at-or-below and content-preserving defragmenting commits)
    blocks committed before keep their pattern and new ones read zero and the
    count is the largest asked; in *mixed* rounds (also shrinks, discarding
    defragments, release, recommit) every block is its whole pattern or all
    zero and the count is one some call asked for. Each round also checks
    the driver's read-back and the usage probe. `until` is a floor for
    LEAST_THREAD_ROUNDS rounds. Returns the rounds run."""
    if until is None and rounds is None:
        raise ValueError("thread_rounds needs a bound: until= or rounds=")
    device = torch.device(device)
    probe = warmed_probe(device)
    baseline = probe.read_outside_torch()
    driver = stress_driver(device)
    capacity = 8 * capacity_for("full", layout, driver.granularity)
    kv_cache = ExtensibleKVCache(config_for("full", layout, capacity), driver, layout)
    requested: set[int] = set()
    lock = threading.Lock()
    tally.seeds.append(seed)
    tally.settings["threads"] = threads

    def asked(n: int) -> int:
        with lock:
            requested.add(n)
        return n

    def target(rng: random.Random) -> int:
        return asked(rng.randrange(1, capacity + 1))

    def at_or_below(rng: random.Random) -> int:
        # Another thread may shrink the cache before this commit runs, which
        # then grows it to this count: recorded as asked.
        return asked(rng.randrange(0, kv_cache.num_committed_blocks + 1))

    preserving = {
        "commit (grow)": lambda rng: kv_cache.commit(target(rng)),
        "commit (at or below)": lambda rng: kv_cache.commit(at_or_below(rng)),
        "commit (defragment, preserving)": lambda rng: kv_cache.commit(target(rng), defragment=True, preserve_contents=True),
        "read sizes and chunks": lambda rng: (kv_cache.physical_bytes, kv_cache.buffer.mapped_chunks, kv_cache.committable_blocks()),
    }
    mixed = {
        **{name: preserving[name] for name in ("commit (grow)", "commit (at or below)", "commit (defragment, preserving)")},
        "commit (shrink)": lambda rng: kv_cache.commit(target(rng), shrink=True),
        "commit (defragment, discarding)": lambda rng: kv_cache.commit(target(rng), defragment=True),
        "release_physical": lambda rng: kv_cache.release_physical(),
        "recommit": lambda rng: kv_cache.recommit(),
    }

    def run_round(operations: dict, round_seed: int) -> list[BaseException]:
        errors: list[BaseException] = []
        start = threading.Barrier(threads)
        names = list(operations)

        def work(thread: int) -> None:
            rng = random.Random(round_seed * 1000 + thread)
            start.wait()
            try:
                for _ in range(per_thread):
                    name = rng.choice(names)
                    operations[name](rng)
                    with lock:
                        tally.operations[f"thread: {name}"] += 1
            except BaseException as error:  # reported by the round, not lost in the thread
                errors.append(error)

        workers = [threading.Thread(target=work, args=(i,), name=f"extkv-stress-{i}") for i in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        return errors

    number = 0
    # The least: a preserving and a mixed round.
    floor = Floor(until, lambda: number >= LEAST_THREAD_ROUNDS)
    try:
        kv_cache.commit(capacity // 8)
        while (rounds is None or number < rounds) and floor.more():
            preserving_round = number % 2 == 0
            if kv_cache.buffer.physical_bytes == 0:
                kv_cache.recommit()
            write_thread_patterns(kv_cache)
            before = kv_cache.num_committed_blocks
            requested.clear()
            round_seed = seed * 100_003 + number
            errors = run_round(preserving if preserving_round else mixed, round_seed)
            where = f"thread round {number} (seed {seed}, round seed {round_seed}, {'preserving' if preserving_round else 'mixed'})"
            if errors:
                raise AssertionError(f"{where}: {len(errors)} call(s) raised, first: {errors[0]!r}") from errors[0]
            check_readback_matches_bookkeeping(kv_cache.buffer)
            measured = probe.read_outside_torch() - baseline
            if measured != kv_cache.physical_bytes:
                raise LeakFound(f"{where}: {probe.source} reads {measured} bytes, the cache maps {kv_cache.physical_bytes}")
            tally.checks["after a thread round: read-back, usage probe"] += 1
            number += 1
            if kv_cache.buffer.physical_bytes == 0:
                continue  # released last: nothing readable until recommit
            n = kv_cache.num_committed_blocks
            assert kv_cache.buffer.segment_sizes == [n * s for s in kv_cache.segment_strides], f"{where}: sizes disagree with the count {n}"
            assert kv_cache.physical_bytes == kv_cache.physical_bytes_for(n), f"{where}: footprint disagrees with the count {n}"
            patterned, zero = row_states(kv_cache)
            if preserving_round:
                assert n == max([before, *requested]), f"{where}: {n} blocks committed, the round asked for at most {max(requested)}"
                wrong = int((~patterned[: min(before, n)]).sum()) + int((~zero[before:]).sum())
            else:
                assert n == before or n in requested, f"{where}: {n} blocks committed, a count nobody asked for"
                wrong = int((~(patterned | zero)).sum())
            if wrong:
                raise ContentMismatch(f"{where}: {wrong} block(s) hold neither what the round allows")
            tally.checks["after a thread round: every block as any interleaving allows"] += 1
            tally.observe_physical(kv_cache.physical_bytes)
    except Exception as error:
        tally.fail(error, f"seed {seed}, round {number}")
        raise
    finally:
        kv_cache.free()
    measured = probe.read_outside_torch() - baseline
    if measured:
        error = LeakFound(f"{probe.source}: {measured} bytes above baseline after the threads' cache was freed")
        tally.fail(error)
        raise error
    floor.close(tally, f"thread rounds ({layout.name})", f"{number} rounds (a preserving and a mixed one)")
    return number


# -- crashes: a child killed at a random point ------------------------------------------
#: What the crash child does in a loop; a kill lands during one of them.
CRASH_OPERATIONS = ("commit", "defragment", "export")


def crash_child_main(device: torch.device, seed: int) -> None:
    """The crash child: export a defragmented, patterned cache to the first
    peer that connects, say so with the segments' digests, then commit,
    defragment and export to itself in a loop, announcing each step
    ("begin <operation>", "end <operation>"), until it is killed."""
    rng = random.Random(seed)
    driver = stress_driver(device)
    layout = KVCacheLayout.LBHNC
    capacity = 8 * capacity_for("full", layout, driver.granularity)
    kv_cache = ExtensibleKVCache(config_for("full", layout, capacity), driver, layout)
    kv_cache.commit(capacity // 2, defragment=True)
    fill_segments(kv_cache, seed)
    connector = SegmentExportConnector()
    connector.register_kv_caches(kv_cache)
    with listen_privately() as listener:
        print(f"listening {listener.path}", flush=True)
        listener.socket.settimeout(CHILD_TIMEOUT_S)
        with listener.accept() as connection:
            connector.export_to(connection)
    connector.close()
    digests = [sha256_hex(kv_cache.buffer.segment_view(i)) for i in range(len(kv_cache.segment_strides))]
    print("exported " + json.dumps(digests), flush=True)
    while True:
        operation = rng.choice(CRASH_OPERATIONS)
        print(f"begin {operation}", flush=True)
        if operation == "commit":
            kv_cache.commit(rng.randint(1, capacity), shrink=rng.random() < 0.5)
        elif operation == "defragment":
            kv_cache.commit(rng.randint(1, capacity), defragment=True, preserve_contents=rng.random() < 0.5)
        else:
            kv_cache.commit(kv_cache.num_committed_blocks, defragment=True, preserve_contents=True)
            exporter = SegmentExportConnector()
            exporter.register_kv_caches(kv_cache)
            sender, receiver = socket.socketpair()
            with sender, receiver:
                exporter.export_to(sender)
                with import_segments(receiver, timeout=CHILD_TIMEOUT_S) as imported:
                    imported.digests()
            exporter.close()
        print(f"end {operation}", flush=True)


def host_memfds_of(pid: int) -> dict[tuple[int, int], int]:
    """extkv chunks (memfds) process `pid` reaches by descriptor or mapping:
    (device, inode) -> bytes the kernel holds for each (0 where only a
    mapping reaches it)."""
    held: dict[tuple[int, int], int] = {}
    link = f"/memfd:{vmm.MEMFD_NAME}"
    for fd in _listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(link):
                status = os.stat(f"/proc/{pid}/fd/{fd}")
                held[(status.st_dev, status.st_ino)] = status.st_blocks * 512
        except OSError:
            continue
    for key in _mapped_memfds(pid, link):
        held.setdefault(key, 0)
    return held


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:  # the process is gone
        return []


def _mapped_memfds(pid: int, link: str) -> set[tuple[int, int]]:
    found = set()
    try:
        with open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith(link):
                    major, minor = (int(part, 16) for part in fields[3].split(":"))
                    found.add((os.makedev(major, minor), int(fields[4])))
    except OSError:
        pass
    return found


def processes_reaching(memfds: set[tuple[int, int]]) -> dict[int, int]:
    """Processes that still reach any of `memfds` ((device, inode) pairs), by
    descriptor or mapping: pid -> how many. The kernel frees a memfd's pages
    once nothing reaches it, so an empty answer is the memory come back."""
    reaching: dict[int, int] = {}
    for name in _listdir("/proc"):
        if name.isdigit():
            count = len(memfds & set(host_memfds_of(int(name))))
            if count:
                reaching[int(name)] = count
    return reaching


@functools.lru_cache(maxsize=None)
def nvml_handle(device: torch.device):
    """NVML's handle for a CUDA device (by UUID: NVML numbers GPUs physically,
    CUDA_VISIBLE_DEVICES renumbers them)."""
    import pynvml

    pynvml.nvmlInit()
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")


def nvml_used(device: torch.device) -> int:
    """Memory in use on the whole GPU, as NVML reports it."""
    import pynvml

    return int(pynvml.nvmlDeviceGetMemoryInfo(nvml_handle(device)).used)


def nvml_process_used(device: torch.device, pid: int) -> int | None:
    """What NVML counts for process `pid` on the GPU; None when it lists no
    such process (gone, or hidden by a PID namespace)."""
    import pynvml

    for process in pynvml.nvmlDeviceGetComputeRunningProcesses(nvml_handle(device)):
        if process.pid == pid and isinstance(process.usedGpuMemory, int):
            return int(process.usedGpuMemory)
    return None


#: What a GPU's used memory may differ from before a child ran, once it is
#: gone: this process's own CUDA context grows a little as it loads kernels.
GPU_RETURN_TOLERANCE = 64 << 20


def wait_for_gpu_memory(device: torch.device, before: int, what: str, timeout_s: float = 30.0) -> None:
    """NVML's used memory of the GPU returns to `before` (within
    GPU_RETURN_TOLERANCE) within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (used := nvml_used(device)) > before + GPU_RETURN_TOLERANCE:
        if time.monotonic() > deadline:
            raise LeakFound(f"{what}: NVML reads {used} bytes used on {device}, {used - before} more than before, after {timeout_s} s")
        time.sleep(0.1)


def crash_once(device: torch.device | str, seed: int, tally: StressTally) -> str:
    """One crash: start the child, import its segments as a peer, let it run,
    stop it at a random point of a random operation and SIGKILL it; the
    peer's bytes must be unchanged, and the memory the child held must come
    back. Returns where the kill landed."""
    device = torch.device(device)
    rng = random.Random(seed)
    tally.seeds.append(seed)
    gpu_before = nvml_used(device) if device.type == "cuda" else 0
    with ChildProcess(["crash-child", "--device", str(device), "--seed", str(seed)]) as child:
        listening = child.line()
        if not listening.startswith("listening "):
            raise AssertionError(f"crash child said {listening!r}, expected 'listening PATH'")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(CHILD_TIMEOUT_S)
            sock.connect(listening.split(" ", 1)[1])
            imported = import_segments(sock, timeout=CHILD_TIMEOUT_S)
        try:
            exported = json.loads(child.line().removeprefix("exported "))
            if imported.digests() != exported:
                raise ContentMismatch("the peer's import differs from what the crash child exported")
            target, skip = rng.choice(CRASH_OPERATIONS), rng.randint(0, 24)
            while skip >= 0:
                if child.line() == f"begin {target}":
                    skip -= 1
            time.sleep(rng.uniform(0, 0.0005))  # into the operation, or past it
            os.kill(child.pid, signal.SIGSTOP)
            last = child.drain()[-1:] or [f"begin {target}"]
            where = f"inside {last[0].split()[1]}" if last[0].startswith("begin") else f"just after {last[0].split()[1]}"
            held = host_memfds_of(child.pid) if device.type == "cpu" else {}
            child_used = nvml_process_used(device, child.pid) if device.type == "cuda" else None
            os.kill(child.pid, signal.SIGKILL)
            child.process.wait(CHILD_TIMEOUT_S)
            tally.events[f"crash child SIGKILLed {where}"] += 1
            if imported.digests() != exported:
                raise ContentMismatch("the peer's bytes changed when the exporter was killed")
            tally.checks["peer unharmed by the exporter's death (digests)"] += 1
        finally:
            imported.close()
    if device.type == "cpu":
        reaching = processes_reaching(set(held))
        if reaching:
            raise LeakFound(f"after the crash child's death, processes {reaching} still reach its memfds")
        tally.events["bytes the killed children held, returned to the kernel"] += sum(held.values())
        tally.checks["killed child's memfds reached by no process"] += 1
    else:
        if child_used is not None:
            tally.events["bytes the killed children held (NVML), returned"] += child_used
            if nvml_process_used(device, child.pid) is not None:
                time.sleep(1.0)
                if nvml_process_used(device, child.pid) is not None:
                    raise LeakFound(f"NVML still lists the killed child {child.pid} on {device}")
        wait_for_gpu_memory(device, gpu_before, "after the crash child's death")
        tally.checks["GPU memory back after the crash (NVML)"] += 1
    return where


# -- processes: several walks on one device ----------------------------------------------
def run_walk_processes(
    device: torch.device | str,
    count: int,
    seed: int,
    tally: StressTally,
    *,
    seconds: float | None = None,
    steps: int | None = None,
    full_check_every: int = FULL_CHECK_EVERY,
    least_steps: int = 1,
) -> None:
    """`count` walks at once for `seconds` or `steps`, each in a child process
    on `device`, each on its own case of CACHE_MACHINE_CASES; their tallies
    join `tally`. `seconds` is a floor for `least_steps` steps of each walk.
    Each child checks its own leaks; on a GPU, NVML's used memory must be
    back after."""
    device = torch.device(device)
    gpu_before = nvml_used(device) if device.type == "cuda" else 0
    children = []
    for index in range(count):
        kind, layout = CACHE_MACHINE_CASES[index % len(CACHE_MACHINE_CASES)]
        children.append(
            ChildProcess([
                "walk", "--device", str(device), "--kind", kind, "--layout", layout.name, "--seed", str(seed + index),
                *(["--seconds", str(seconds), "--least-steps", str(least_steps)] if steps is None else ["--steps", str(steps)]),
                "--full-check-every", str(full_check_every), "--shared-device",
            ])
        )
    failures = []
    try:
        for index, child in enumerate(children):
            result = child.line((seconds or 0) + CHILD_TIMEOUT_S)
            child.process.wait(CHILD_TIMEOUT_S)
            child_tally = StressTally.from_json(json.loads(result))
            tally.add(child_tally)
            tally.events["walk processes sharing the device"] += 1
            if child.process.returncode != 0:
                failures.append(f"walk process {index} (exit {child.process.returncode}): {child_tally.failures}")
    finally:
        for child in children:
            child.close()
    if failures:
        raise AssertionError("; ".join(failures))
    if device.type == "cuda":
        wait_for_gpu_memory(device, gpu_before, "after the walk processes ended")
        tally.checks["GPU memory back after the walk processes (NVML)"] += 1


# -- child processes' entry point ------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m extkv.testing.stress", description="child processes of stress runs")
    commands = parser.add_subparsers(dest="command", required=True)
    walk_command = commands.add_parser("walk", help="one endurance walk; prints its tally as JSON")
    walk_command.add_argument("--device", default="cpu")
    walk_command.add_argument("--kind", default="full")
    walk_command.add_argument("--layout", default="LBHNC", choices=[layout.name for layout in KVCacheLayout])
    walk_command.add_argument("--seed", type=int, default=0)
    bound = walk_command.add_mutually_exclusive_group(required=True)
    bound.add_argument("--seconds", type=float)
    bound.add_argument("--steps", type=int)
    walk_command.add_argument("--full-check-every", type=int, default=FULL_CHECK_EVERY)
    walk_command.add_argument("--least-steps", type=int, default=1, help="with --seconds: steps the walk runs however short they are")
    walk_command.add_argument(
        "--shared-device", action="store_true",
        help="other processes use the device: compare the usage probe only where it reads this process alone",
    )
    pressure_command = commands.add_parser("pressure", help="hold and free memory as told on stdin")
    pressure_command.add_argument("--device", default="cpu")
    crash_command = commands.add_parser("crash-child", help="commit, defragment and export until killed")
    crash_command.add_argument("--device", default="cpu")
    crash_command.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("EXTKV_TORCH_THREADS", "1")))
    device = torch.device(args.device)
    if args.command == "pressure":
        pressure_main(device)
        return 0
    if args.command == "crash-child":
        crash_child_main(device, args.seed)
        return 0
    tally = StressTally()
    until = None if args.seconds is None else time.monotonic() + args.seconds
    status = 0
    probe = warmed_probe(device)
    try:
        run_walk(
            device, args.kind, KVCacheLayout[args.layout], args.seed, tally, until=until, steps=args.steps,
            full_check_every=args.full_check_every, probe=probe,
            usage_checks=probe.per_process or not args.shared_device,
            least=lambda ran: ran >= args.least_steps, least_what="the least it was given",
            workload=f"walk process ({args.kind}-{args.layout})",
        )
    except Exception as error:  # recorded in the tally, which the parent reads
        print(f"walk failed: {error!r}", file=sys.stderr, flush=True)
        status = 1
    print(json.dumps(tally.to_json()), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
