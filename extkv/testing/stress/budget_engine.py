"""The budget stress's engine: a child process running a cache under the
shared budget, spoken to by lines, and the parent's reading of it.

Theory of operation
-------------------
An engine (`python -m extkv.testing.stress budget-engine ...`, run by
`budget_engine_main` in a child of extkv.testing.stress.child) is what the
budget stress (extkv.testing.stress.budget) starts several of, kills and
replaces. It joins the daemon with the floor and weight it is given and
runs a cache of up to the blocks it is given (`engine_blocks`: ENGINE_BLOCKS
at HOST_STRESS_GRANULE, as many more as the driver's granule is larger)
over its device's stress driver, budgeted and unpoisoned
(extkv.testing.stress.base's `plain_stress_driver`: the host driver with
HOST_STRESS_GRANULE, or the GPU's CUDA driver): zeroing over poison is the
walk's to prove (extkv.testing.stress.walk), and here every byte touched is
time taken from the steps. Its reclaim handler shrinks the cache from the
top keeping the blocks below (`commit(n, shrink=True,
preserve_contents=True)`, to `blocks_kept_within` the bytes it keeps).
Its loop commits, shrinks (`commit(n, shrink=True)`), releases,
recommits, writes blocks and defragments preserving contents, drawn among
the operations that have something to do (while its lease is down,
neither a shrink nor a release: it serves on with what it holds, which
the restarted daemon must then count), each step under the engine's lock,
which the handler takes too. Between two steps the loop yields the lock
to a handler that waits for it (an event, not the lock's luck: a thread
that releases a lock and takes it again at once keeps it), so a reclaim
waits one step at most; then it waits up to ENGINE_STEP_GAP_S for a
command, as an engine between two requests. A denial (`BudgetDeniedError`)
and a growth refused while the daemon is down (`BudgetUnavailableError`)
are the budget at work: counted, never failures. An `OutOfMemoryError`
that is no denial is the driver refusing a create the ledger granted: out
of memory inside the budget, a failure. Every block written must read as
written after a preserving defragment and below a reclaim's shrink, and a
shrink must leave exactly the footprint of its blocks (a reclaim's, the
footprint `physical_bytes_after_shrink` predicted).

Before it says anything it makes its driver (on a GPU, the CUDA context)
and runs once, on scratch tensors of its blocks' sizes, the torch kernels
its steps run on its blocks (fill, compare, reduce, read back), so that
neither a kernel's module, which CUDA loads at its first launch, nor
torch's first block of memory grows its process's reading from outside
after its parent read its baseline there; the driver's own zeroing and
copies are cuMemsetD8Async and cuMemcpyDtoDAsync, which load no module.
It reads its own usage witness then (`Driver.usage_witness`), the
baseline of its check at `stop`.

It speaks by lines: `ready` once it opened its gate (a FIFO) for reading,
before it waits there; a cumulative tally when it joined and every
TALLY_EVERY_S after (so a killed engine's work up to its last line
counts); a `failed` line at once for anything that is no budget outcome.
Told `stop`, it frees its cache, checks that its witness reads no more
than its baseline (on a GPU, give or take one step of a module loaded
lazily: the witness's `lazy_growth_step`), closes its lease, sends its
last tally and says `stopped`. `EngineChild` is the parent's side: the engine's draws, its
latest tally, and every failure it said that no later tally holds.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import select
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ...budget.client import BudgetClient
from ...cache import ExtensibleKVCache
from ...errors import BudgetDeniedError, BudgetUnavailableError, OutOfMemoryError
from ...layout import KVCacheLayout, kv_cache_segments
from ...layout_types import KVCacheConfig
from ...vmm import Driver
from ..configs import config_for
from ..models import ContentMismatch, LeakFound
from .base import HOST_STRESS_GRANULE, plain_stress_driver
from .child import ChildProcess
from .tally import StressTally

#: Blocks of an engine's cache at HOST_STRESS_GRANULE ("full" config: 24
#: KiB a block, in 3 segments under LBHNC): 3.875 MiB with its granules,
#: nearly a quarter of the budget stress's (BUDGET_STRESS_GRANULES) and
#: twice an engine's share of it among eight, so that every engine can
#: grow past its share and press the others. No multiple of the 8 blocks
#: a granule holds, so LBHNC's segments share granules.
ENGINE_BLOCKS = 164
#: The most an engine waits for a command between two steps. An engine
#: alone, its daemon in a thread of its process, stepped every 3.4 ms (500
#: steps in 1.7 s on the 2-core CI host): eight stepping back to back would
#: keep both cores busy, and the daemon and the sampler would run in what
#: is left.
ENGINE_STEP_GAP_S = 0.002
#: How often an engine reports its tally, so a SIGKILL loses little of it.
TALLY_EVERY_S = 0.5
#: An engine's operations, with their weights in its draw.
OPERATIONS = {
    "commit (grow)": 6,
    "commit (shrink)": 3,
    "commit (defragment, preserving)": 2,
    "release_physical": 1,
    "recommit": 2,
    "write a block": 3,
}
#: What an engine's tally names a budget outcome, beside the operation.
DENIED = "denied by the budget"
UNAVAILABLE = "refused while the daemon is down"
OUT_OF_MEMORY_INSIDE = "out of memory inside the budget (a create the ledger granted, refused)"
#: The lines of an engine child (see the module's theory).
READY, TALLY, FAILED, STOPPED = "ready", "tally", "failed", "stopped"


def engine_blocks(granule: int) -> int:
    """Blocks of an engine's cache over a driver of `granule` bytes:
    ENGINE_BLOCKS scaled from HOST_STRESS_GRANULE, so that the cache holds
    as many granules on every device."""
    if granule <= 0 or granule % HOST_STRESS_GRANULE:
        raise ValueError(f"granule must be a positive multiple of {HOST_STRESS_GRANULE} bytes, got {granule!r}")
    return ENGINE_BLOCKS * (granule // HOST_STRESS_GRANULE)


def _warm_up(driver: Driver, config: KVCacheConfig, layout: KVCacheLayout) -> None:
    """Run once what a step runs on a block of each segment, on torch's
    memory: see the module's theory."""
    for stride in sorted(set(kv_cache_segments(config, layout)[1])):
        scratch = torch.zeros(stride, dtype=torch.uint8, device=driver.device)
        scratch.fill_(1)
        if not scratch.eq(1).all():
            raise AssertionError(f"the warm-up's {stride} bytes, filled with 1, read otherwise")
    driver.synchronize()


class _Engine:
    """One engine process's cache, lock, reclaim handler and tally; `before`
    is what `witness`, its driver's usage witness, read before the cache."""

    def __init__(self, client: BudgetClient, driver: Driver, config: KVCacheConfig, layout: KVCacheLayout,
                 witness, before: int, rng: random.Random, tally: StressTally, say: Callable[[str], None]):
        self.client, self.rng, self.tally, self.say = client, rng, tally, say
        # Unpoisoned: the walk proves zeroing over poison (extkv.testing.stress.walk),
        # and here every byte touched is time the engines' steps take (4 MiB
        # filled in 8 ms on the 2-core CI host).
        self.cache = ExtensibleKVCache(config, driver, layout, budget=client)
        self.witness, self.before = witness, before
        #: The blocks written since the last discarding shrink or release (and
        #: below every reclaim's shrink since), and the value of every byte.
        self.written: dict[int, int] = {}
        self.capacity = config.num_blocks
        self.lock = threading.Lock()
        # A reclaim handler wants the lock: the loop waits for `idle` before its next step.
        self.wanted = threading.Event()
        self.idle = threading.Event()
        self.idle.set()
        self.stopped = False
        self.reclaim_slowest_s = 0.0
        client.on_reclaim(self.on_reclaim)

    # The operations, each under the lock.
    def grow(self) -> None:
        self.cache.commit(min(self.capacity, self.cache.num_committed_blocks + self.rng.randint(1, self.capacity // 4)))

    def shrink(self) -> None:
        target = self.rng.randint(0, max(self.cache.num_committed_blocks - 1, 0))
        self.written.clear()  # a shrink discards every block's contents, even when its regrowth is refused
        self.cache.commit(target, shrink=True)
        if self.cache.physical_bytes != self.cache.physical_bytes_for(target):
            raise LeakFound(f"a shrink to {target} blocks left {self.cache.physical_bytes} bytes mapped, "
                            f"expected {self.cache.physical_bytes_for(target)}")
        self.tally.checks["footprint after a shrink"] += 1

    def defragment(self) -> None:
        target = min(self.capacity, self.cache.num_committed_blocks + self.rng.randint(0, self.capacity // 8))
        self.cache.commit(target, defragment=True, preserve_contents=True)
        self.check_written("a preserving defragment", target)

    def check_written(self, what: str, target: int) -> None:
        """Every block written since the last shrink or release reads as
        written after `what` to `target` blocks (tallied as kept)."""
        for block, value in self.written.items():
            for i in range(len(self.cache.segment_strides)):
                if not self.block(i, block).eq(value).all():
                    raise ContentMismatch(f"{what} to {target} blocks changed block {block} of segment {i}, "
                                          f"written {value} in every byte")
        self.tally.checks[f"{what} kept every written block"] += 1

    def release(self) -> None:
        self.written.clear()
        self.cache.release_physical()
        if self.cache.physical_bytes != 0:
            raise LeakFound(f"release_physical left {self.cache.physical_bytes} bytes mapped")

    def recommit(self) -> None:
        self.cache.recommit()

    def write(self) -> None:
        block, value = self.rng.randrange(self.cache.num_committed_blocks), self.rng.randint(1, 255)
        for i in range(len(self.cache.segment_strides)):
            self.block(i, block).fill_(value)
        self.written[block] = value

    def block(self, segment: int, block: int):
        """Block `block`'s bytes in segment `segment`."""
        stride = self.cache.segment_strides[segment]
        return self.cache.buffer.segment_view(segment)[block * stride:(block + 1) * stride]

    def possible(self, name: str) -> bool:
        """Whether operation `name` has something to do in the cache's state.
        While its lease is down the engine serves on with what it holds: it
        neither shrinks (the regrowth would fail closed, leaving it nothing)
        nor releases, so what it holds meets the restarted daemon."""
        asleep, committed, up = self.cache.is_asleep, self.cache.num_committed_blocks, self.client.available
        return {
            "commit (grow)": asleep or committed < self.capacity,
            "commit (shrink)": up and (self.cache.physical_bytes > 0 or committed > 0),
            "commit (defragment, preserving)": not asleep and committed > 0,
            "release_physical": up and self.cache.physical_bytes > 0,
            "recommit": asleep,
            "write a block": not asleep and committed > 0,
        }[name]

    def step(self) -> None:
        """Run an operation drawn among those with something to do, under
        the lock; a budget outcome is counted, anything else raised."""
        operations = {
            "commit (grow)": self.grow, "commit (shrink)": self.shrink,
            "commit (defragment, preserving)": self.defragment, "release_physical": self.release,
            "recommit": self.recommit, "write a block": self.write,
        }
        with self.lock:
            names = [name for name in OPERATIONS if self.possible(name)]
            name = self.rng.choices(names, [OPERATIONS[name] for name in names])[0]
            try:
                operations[name]()
                self.tally.operations[name] += 1
            except BudgetDeniedError:
                self.tally.events[f"{DENIED}: {name}"] += 1
            except BudgetUnavailableError:
                self.tally.events[f"{UNAVAILABLE}: {name}"] += 1
            except OutOfMemoryError as error:
                self.tally.events[OUT_OF_MEMORY_INSIDE] += 1
                self.tally.fail(error, name)
                self.say(f"{FAILED} {OUT_OF_MEMORY_INSIDE}: {name}: {error}")
            self.tally.observe_physical(self.cache.physical_bytes)
        if self.wanted.is_set():  # a reclaim waits for the lock: let it have it before the next step
            self.idle.wait()

    def on_reclaim(self, target: int) -> int:
        """Shrink the cache from the top by at least `target` bytes, if it
        can, under the engine's lock; returns the bytes freed."""
        started = time.monotonic()
        self.idle.clear()
        self.wanted.set()
        try:
            with self.lock:
                if self.stopped or self.cache.is_asleep or self.cache.physical_bytes == 0:
                    self.tally.events["reclaims answered: nothing to give"] += 1
                    return 0
                held, committed = self.cache.physical_bytes, self.cache.num_committed_blocks
                keep = self.cache.blocks_kept_within(max(held - target, 0))
                if keep == committed:
                    self.tally.events["reclaims answered: nothing to give"] += 1
                    return 0
                # From the top, keeping the blocks below: it creates nothing,
                # so neither the budget nor the driver can refuse it.
                predicted = self.cache.physical_bytes_after_shrink(keep)
                self.written = {block: value for block, value in self.written.items() if block < keep}
                self.cache.commit(keep, shrink=True, preserve_contents=True)
                if self.cache.physical_bytes != predicted:
                    raise LeakFound(f"a reclaim's shrink to {keep} blocks keeping contents left "
                                    f"{self.cache.physical_bytes} bytes mapped, physical_bytes_after_shrink said "
                                    f"{predicted}")
                self.check_written("a reclaim's shrink keeping contents", keep)
                freed = held - self.cache.physical_bytes
                self.tally.events["reclaims answered: bytes freed"] += freed
                self.tally.events["reclaims answered"] += 1
                return freed
        except Exception as error:
            # The client would answer `cannot` and only warn: the failure is said here, where the parent reads it.
            with self.lock:
                self.tally.fail(error, "a reclaim")
            self.say(f"{FAILED} a reclaim: {type(error).__name__}: {error}")
            raise
        finally:
            self.wanted.clear()
            self.idle.set()
            self.reclaim_slowest_s = max(self.reclaim_slowest_s, time.monotonic() - started)

    def stop(self) -> None:
        """Free the cache (its memory must be gone from this process) and end the lease."""
        self.client.on_reclaim(None)
        with self.lock:
            self.stopped = True
            self.cache.free()
        left = self.witness.read() - self.before
        if left > self.witness.lazy_growth_step:
            self.tally.fail(LeakFound(f"after free the engine's process holds {left} bytes more than before its "
                                      f"cache ({self.witness.source}; {self.witness.lazy_growth_step} bytes allowed)"))
        else:
            self.tally.checks["no chunk left in the engine's process after free"] += 1
        self.client.close()


class _Commands:
    """The lines the parent sends on stdin."""

    def __init__(self):
        self.pending = b""

    def next(self, timeout_s: float) -> str | None:
        """The next whole line the parent sent, waiting up to `timeout_s`
        for one; None if none came, "" at the end of input."""
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self.pending:
            if not select.select([0], [], [], max(deadline - time.monotonic(), 0))[0]:
                return None
            data = os.read(0, 4096)
            if not data:
                return ""
            self.pending += data
        line, self.pending = self.pending.split(b"\n", 1)
        return line.decode().strip()


def budget_engine_main(socket_path: str, seed: int, floor: int, weight: float, layout: KVCacheLayout,
                       capacity: int, gate: str | None, device: torch.device | str = "cpu") -> int:
    """An engine child (`python -m extkv.testing.stress budget-engine`) on
    `device`: makes its driver and warms it up, says `ready`, waits at
    `gate` (a FIFO) if given, joins the daemon at `socket_path` and runs
    random operations until told `stop` (or `quit`), reporting its tally as
    it goes; returns its exit status."""
    if capacity < 4:  # a growth draws up to a quarter of it, at least one block
        raise ValueError(f"capacity must be at least 4 blocks, got {capacity!r}")
    rng = random.Random(seed)
    tally = StressTally(seeds=[seed])

    def say(line: str) -> None:
        print(line, flush=True)

    driver, config = plain_stress_driver(device), config_for("full", layout, capacity)
    _warm_up(driver, config, layout)
    witness = driver.usage_witness()
    before = witness.read()
    gate_fd = None if gate is None else os.open(gate, os.O_RDONLY | os.O_NONBLOCK)
    say(READY)
    if gate_fd is not None:
        # Readable once the parent's writing end has opened and closed: a
        # FIFO opened for reading before any writer reports no hang-up until then.
        select.select([gate_fd], [], [])
        os.close(gate_fd)
    info = {"pid": os.getpid(), "seed": seed, "floor": floor, "weight": weight, "layout": layout.name,
            "gate_passed_at": time.monotonic()}
    commands, engine, status = _Commands(), None, 0

    def report() -> None:
        # The reclaim handler's thread counts into the tally under the engine's lock.
        with contextlib.nullcontext() if engine is None else engine.lock:
            if engine is not None:
                info["reclaim_slowest_s"] = round(engine.reclaim_slowest_s, 4)
            line = f"{TALLY} {json.dumps({'tally': tally.to_json(), 'engine': info})}"
        say(line)

    try:
        client = BudgetClient(socket_path, floor=floor, weight=weight)
        info["joined_at"] = time.monotonic()
        engine = _Engine(client, driver, config, layout, witness, before, rng, tally, say)
        report()
        next_report = time.monotonic() + TALLY_EVERY_S
        while True:
            # Between two steps the engine waits for the parent's word, as
            # an engine between two requests: ENGINE_STEP_GAP_S at most.
            command = commands.next(ENGINE_STEP_GAP_S)
            if command in ("stop", "quit", ""):
                break
            if command is not None:
                say(f"error: unknown command {command!r}, expected stop or quit")
            engine.step()
            if time.monotonic() >= next_report:
                report()
                next_report = time.monotonic() + TALLY_EVERY_S
        engine.stop()
    except Exception as error:  # noqa: BLE001 - said on a line and in the tally, which the parent reads
        tally.fail(error, f"budget-engine --seed {seed} --floor {floor} --weight {weight} --layout {layout.name}, "
                          "beside other engines")
        say(f"{FAILED} {type(error).__name__}: {error}")
        print(f"budget engine failed: {error!r}", file=sys.stderr, flush=True)
        status = 1
    report()
    say(STOPPED)
    return status


@dataclass
class EngineChild:
    """An engine child process, its draws, and what it last reported."""

    child: ChildProcess
    pid: int
    seed: int
    floor: int
    weight: float
    layout: KVCacheLayout
    tally: StressTally = field(default_factory=StressTally)
    info: dict = field(default_factory=dict)
    #: Its `failed` lines: each is in its tally too, once a later tally line came.
    failed: list = field(default_factory=list)
    #: What went wrong between it and the parent: an unknown command, an exit status.
    problems: list = field(default_factory=list)

    def read_lines(self, lines: list[str]) -> None:
        """Take in what it said: its latest tally, and every failure."""
        for line in lines:
            word, _, rest = line.partition(" ")
            if word == TALLY:
                report = json.loads(rest)
                self.tally, self.info = StressTally.from_json(report["tally"]), report["engine"]
            elif word == FAILED:
                self.failed.append(line)
            elif word != READY and word != STOPPED:
                self.problems.append(f"engine {self.pid} said {line!r}")

    def failures(self) -> list[str]:
        """What it said went wrong that its last tally does not hold (it was
        killed before the next tally line), and the problems."""
        return self.failed[len(self.tally.failures):] + self.problems
