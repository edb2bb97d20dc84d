"""Workloads under real memory pressure from the pressure process.

Theory of operation
-------------------
`meet_real_out_of_memory`: the pressure process takes memory, and a commit
needing more than is left must be refused with `OutOfMemoryError` by the
real driver or kernel, change nothing, and leave the cache usable; on a GPU,
once the pressure process lets go the same commit succeeds, and a sleeping
cache's wake is refused while it does not fit and wakes once memory
returns. Other processes take and free memory too, and no reading of free
memory holds still until the commit: each side sizes its commit so.

- On the host the refusal comes from the kernel's numbers before anything
  is allocated, so a larger commit costs nothing: the refused commit asks
  for more than the machine's whole memory, which no other process's
  release can let fit, and is never performed (`AllocationBound` would
  refuse anything above `host_commit_bound()` that the kernel would grant).
- On a GPU the pressure fills the device and the commit asks for what was
  free plus 0.5 to 1 GiB, so that it fits once the pressure lets go. An
  episode that another process's memory decided (the commit fitted, or a
  step that needed the room the pressure left met out-of-memory) is
  inconclusive: the cache is checked once the pressure let go, and the
  episode runs again, a bounded number of times (extkv.testing.exclusive).

`walk_under_pressure`: the endurance walk while the pressure process takes
and frees memory in a loop; each commit refused by real out-of-memory must
leave the cache consistent and succeed once the pressure process says it
released its memory (`PressureProcess.next_release`). Beside a full
GPU its checks compare on the host, with up to HOST_COMPARE_THREADS threads.
"""

from __future__ import annotations

import contextlib
import os
import random
from typing import Iterator

import torch

from ... import vmm
from ...cache import ExtensibleKVCache
from ...errors import OutOfMemoryError
from ...layout import KVCacheLayout, kv_cache_segments
from ...vmm import Driver, HostDriver, PoisoningDriver, driver_for
from ...vmm.poison import DEFAULT_POISON
from ...vmm import torch_memory
from ...vmm.host_memory import read_host_memory_headroom
from ...vmm.wrapping import WrappingDriver
from .. import exclusive
from ..exclusive import Inconclusive, until_conclusive
from ..checks import check_readback_matches_bookkeeping, check_unchanged, snapshot
from ..configs import config_for
from ..models import ContentMismatch
from .base import warmed_probe
from .bounds import Floor
from .pressure import PressureProcess, host_pressure_bound
from .tally import StressTally
from .walk import WALK_WEIGHTS, run_walk


def host_commit_bound() -> int:
    """The largest commit a host stress test performs for real: a quarter of
    the machine's memory, at most 4 GiB."""
    _, total = vmm.device_memory_info("cpu")
    return min(4 << 30, total // 4)


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
            raise ContentMismatch(f"{what}: segment {segment}: {wrong} of {rows.numel()} bytes are not {value}; "
                                  f"{_what_they_read(rows, wrong)}; {_state_of(kv_cache)}")


def _what_they_read(rows: torch.Tensor, wrong: int) -> str:
    """What the `wrong` bytes of `rows` hold (the expected value is neither
    0 nor the poison), as counts of the values that tell a cause apart: zero
    (zeroed again), the poison (an unzeroed fresh chunk), any other."""
    zero = sum(int((rows[at : at + COMPARE_SLICE] == 0).count_nonzero()) for at in range(0, rows.numel(), COMPARE_SLICE))
    poison = sum(
        int((rows[at : at + COMPARE_SLICE] == DEFAULT_POISON).count_nonzero()) for at in range(0, rows.numel(), COMPARE_SLICE)
    )
    return f"they read 0 in {zero}, {DEFAULT_POISON:#04x} (poison) in {poison}, other values in {wrong - zero - poison}"


def _state_of(kv_cache: ExtensibleKVCache) -> str:
    buffer = kv_cache.buffer
    return (f"committed {kv_cache.num_committed_blocks} blocks, grown {kv_cache.grown_blocks}, "
            f"segment sizes {buffer.segment_sizes}, {buffer.num_physical_chunks} chunks mapped, asleep {kv_cache.is_asleep}")


#: Blocks a real-out-of-memory episode keeps committed and patterned throughout,
#: and the bytes it commits under pressure to show the cache still usable.
PRESSURE_KEPT_BLOCKS = 64
PRESSURE_PATTERN = 0x5C
PRESSURE_SMALL_COMMIT_BYTES = 8 << 20
#: Host granule of the out-of-memory episodes: their cache spans more than the
#: machine's memory, and reading back every granule of it stays quick.
PRESSURE_HOST_GRANULE = 32 << 20
#: Address space of a GPU episode's cache: more than any commit it makes
#: (what the pressure process leaves free, at most 6 GiB, what another job
#: may free meanwhile, up to 8 GiB beside tools/busy_check.py, plus 1 GiB),
#: so that an episode the pressure left the span free of stays rare.
GPU_PRESSURE_CAPACITY_BYTES = 24 << 30
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
    """Whole episodes until `until` (time.monotonic) or `episodes` of them;
    returns how many. `layout` BLHNC commits one run; LBHNC one run per
    layer, each of which may fit alone where all do not (on the host the
    commit is refused whole before its first create). In each, the pressure
    process takes memory; a commit needing more than is left then is refused
    with `OutOfMemoryError` by the real driver or kernel, changes nothing,
    and the cache stays usable (a small commit succeeds); the pressure
    process lets go; on a GPU the same commit succeeds (new blocks zero,
    kept blocks kept), and the cache sleeps, its wake meets pressure and is
    refused while it does not fit, and wakes once memory returns. On the
    host the refused commit asks for more than the machine's whole memory
    (MemAvailable never exceeds MemTotal, nor a cgroup's headroom its
    limit), so no other process freeing memory can let it fit, and it is
    never performed. On a GPU it asks for what was free plus 0.5 to 1 GiB:
    an episode that another process's memory decided (the commit fitted,
    the pressure left the cache's span free, or a step that needed room met
    out-of-memory) is inconclusive: the cache is checked once the pressure
    let go, and the episode runs again (extkv.testing.exclusive), up to
    INCONCLUSIVE_ATTEMPTS in a row, then `Inconclusive`. `until` is a floor
    for one whole episode."""
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
    tally.settings["real out-of-memory: largest commit performed (bytes)"] = bound
    stride = bytes_per_block("full", layout)
    capacity_bytes = total + total // 4 if host else GPU_PRESSURE_CAPACITY_BYTES
    kv_cache = ExtensibleKVCache(config_for("full", layout, -(-capacity_bytes // stride)), driver, layout)
    episode = PressureEpisode(kv_cache, driver, pressure, tally, rng, total)
    try:
        kv_cache.commit(PRESSURE_KEPT_BLOCKS)
        write_block_values(kv_cache, 0, PRESSURE_KEPT_BLOCKS, PRESSURE_PATTERN)
        whole = 0
        floor = Floor(until, lambda: whole >= 1)
        while (episodes is None or whole < episodes) and floor.more():
            until_conclusive(episode.attempt)
            whole += 1
            tally.checks["whole real out-of-memory episode"] += 1
        floor.close(tally, "real out-of-memory episodes", f"{whole} whole pressure episode{'s' if whole != 1 else ''}")
    finally:
        kv_cache.free()
    return whole


#: Why a pressure episode was inconclusive, as the tally counts it.
FITTED = "the refused commit fitted: other processes freed memory between the reading and the commit"
LEFT_FREE = "the pressure left the cache's span free: other processes freed memory meanwhile"
TAKEN = "out-of-memory where the pressure left room: other processes took it"


@contextlib.contextmanager
def others_may_take_the_room(what: str) -> Iterator[None]:
    """Out-of-memory inside the block (extkv's or torch's) becomes
    `Inconclusive`: the pressure left room for it, which another process
    can take at any moment; the episode checks the cache afterwards."""
    try:
        yield
    except (OutOfMemoryError, torch.OutOfMemoryError) as error:
        raise Inconclusive(f"{TAKEN} ({what})") from error


class PressureEpisode:
    """One real-out-of-memory episode of `meet_real_out_of_memory` over one
    cache, which holds PRESSURE_KEPT_BLOCKS patterned blocks between episodes."""

    def __init__(self, kv_cache: ExtensibleKVCache, driver: Driver, pressure: PressureProcess,
                 tally: StressTally, rng: random.Random, total: int):
        self.kv_cache, self.driver, self.pressure, self.tally, self.rng = kv_cache, driver, pressure, tally, rng
        self.total = total
        self.host = driver.kind == "host"
        self.stride = kv_cache.bytes_per_block
        self.margin = host_pressure_bound() // 2 if self.host else 1 << 30

    def attempt(self) -> None:
        """One episode; `Inconclusive` once the cache was checked after it."""
        self.tally.events["pressure episodes"] += 1
        try:
            self.run()
        except Inconclusive as why:
            self.tally.events[f"episode inconclusive: {str(why).split(' (')[0]}"] += 1
            self.recover()
            raise

    def run(self) -> None:
        kv_cache, pressure, tally, rng, stride = self.kv_cache, self.pressure, self.tally, self.rng, self.stride
        held = pressure.held(f"hold {host_pressure_bound()}") if self.host else pressure.held(f"fill {rng.randint(2, 6) << 30}")
        available = free_memory_for(self.driver, self.total)
        # Past the host's whole memory, no release by anyone lets it fit.
        wanted = (self.total if self.host else available) + rng.randint(self.margin // 2, self.margin)
        target = min(PRESSURE_KEPT_BLOCKS + -(-wanted // stride), kv_cache.capacity_blocks)
        new_bytes = (target - PRESSURE_KEPT_BLOCKS) * stride
        if new_bytes <= available:
            raise Inconclusive(f"{LEFT_FREE} ({available} bytes available, the cache spans {new_bytes} more)")
        with others_may_take_the_room("a snapshot's copy"):
            before = snapshot(kv_cache)
        try:
            kv_cache.commit(target)
        except OutOfMemoryError:
            tally.events["commit refused by real out-of-memory"] += 1
        else:
            if self.host:
                raise AssertionError(f"a commit of {new_bytes} new bytes, more than the machine's {self.total}, succeeded")
            self.release()
            check_block_values(kv_cache, 0, PRESSURE_KEPT_BLOCKS, PRESSURE_PATTERN, "kept blocks after a commit that fitted")
            check_block_values(kv_cache, PRESSURE_KEPT_BLOCKS, target, 0, "blocks a commit that fitted added")
            raise Inconclusive(f"{FITTED} ({new_bytes} new bytes with {available} available, {held} held by the pressure)")
        with others_may_take_the_room("checks and a small commit under pressure"):
            check_unchanged(kv_cache, before)
            tally.checks["refused commit changed nothing (snapshot: chunks, read-back, bytes)"] += 1
            small = PRESSURE_KEPT_BLOCKS + PRESSURE_SMALL_COMMIT_BYTES // stride
            kv_cache.commit(small)
            check_block_values(kv_cache, 0, PRESSURE_KEPT_BLOCKS, PRESSURE_PATTERN, "kept blocks under pressure")
            check_block_values(kv_cache, PRESSURE_KEPT_BLOCKS, small, 0, "blocks committed under pressure")
        kv_cache.commit(PRESSURE_KEPT_BLOCKS, shrink=True)
        write_block_values(kv_cache, 0, PRESSURE_KEPT_BLOCKS, PRESSURE_PATTERN)
        tally.operations["commit refused by real out-of-memory, small commit and shrink under pressure"] += 3
        self.release()
        if self.host:
            tally.events["refused commit past the machine's whole memory: never fits, not performed"] += 1
            return
        with others_may_take_the_room("the refused commit once the pressure let go"):
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
        self.release()
        with others_may_take_the_room("the wake once the pressure let go"):
            kv_cache.recommit()
            check_block_values(kv_cache, 0, target, 0, "blocks after a wake")
        kv_cache.commit(PRESSURE_KEPT_BLOCKS, shrink=True)
        write_block_values(kv_cache, 0, PRESSURE_KEPT_BLOCKS, PRESSURE_PATTERN)
        tally.operations["retried commit, sleep, wake under pressure, wake, shrink"] += 5

    def release(self) -> None:
        if self.pressure.ask("release") != "released":
            raise AssertionError("the pressure process did not release its memory")

    def recover(self) -> None:
        """After an inconclusive episode, with the pressure let go: the cache
        is consistent, wakes, holds its kept blocks again and still commits;
        any failure here is extkv's, since the memory is back."""
        kv_cache = self.kv_cache
        self.release()
        check_readback_matches_bookkeeping(kv_cache.buffer)
        if kv_cache.is_asleep:
            kv_cache.recommit()
        kv_cache.commit(PRESSURE_KEPT_BLOCKS, shrink=True)
        write_block_values(kv_cache, 0, PRESSURE_KEPT_BLOCKS, PRESSURE_PATTERN)
        small = PRESSURE_KEPT_BLOCKS + PRESSURE_SMALL_COMMIT_BYTES // self.stride
        kv_cache.commit(small)
        check_block_values(kv_cache, 0, PRESSURE_KEPT_BLOCKS, PRESSURE_PATTERN, "kept blocks after an inconclusive episode")
        check_block_values(kv_cache, PRESSURE_KEPT_BLOCKS, small, 0, "blocks committed after an inconclusive episode")
        kv_cache.commit(PRESSURE_KEPT_BLOCKS, shrink=True)
        # A shrink remaps the prefix it keeps, zeroed: the next episode expects the pattern.
        write_block_values(kv_cache, 0, PRESSURE_KEPT_BLOCKS, PRESSURE_PATTERN)
        check_readback_matches_bookkeeping(kv_cache.buffer)
        self.tally.checks["after an inconclusive episode: read-back, kept blocks, a small commit"] += 1


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
    probe) and succeed when made again once the pressure process released
    its memory next (its event, not a reading of free memory). `until` is a
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
            capacity=capacity, weights=weights, memory_returns=pressure.next_release,
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
