"""Several engines sharing one KV budget, through SIGKILLs of engines and of the daemon.

Theory of operation
-------------------
`share_one_budget` runs the shared budget (extkv.budget) as a machine of
several engines runs it, and reads it from outside:

- The daemon serves the host device from a child process
  (extkv.testing.budget.DaemonProcess), its log lines appended to a file as
  it logs them, so a SIGKILL loses none.
- Each engine is a child process (`python -m extkv.testing.stress
  budget-engine ...`, extkv.testing.stress.child, spoken to by lines), with
  a floor and a weight drawn from the seed and a cache of up to
  ENGINE_BLOCKS blocks (nearly a quarter of the budget) over the budgeted
  host driver with HOST_STRESS_GRANULE, unpoisoned: zeroing over poison is
  the walk's to prove (extkv.testing.stress.walk), and here every byte
  touched is time taken from the steps. Its reclaim handler shrinks the
  cache from the top. Its loop commits, shrinks (`commit(n, shrink=True)`),
  releases, recommits, writes blocks and defragments preserving contents,
  drawn among the operations that have something to do (while its lease
  is down, neither a shrink nor a release: it serves on with what it holds,
  which the restarted daemon must then count), each step under
  the engine's lock, which the handler takes too. Between two steps the
  loop yields the lock to a handler that waits for it (an event, not the
  lock's luck: a thread that releases a lock and takes it again at once
  keeps it), so a reclaim waits one step at most; then it waits up to
  ENGINE_STEP_GAP_S for a command, as an engine between two requests. A
  denial (`BudgetDeniedError`) and a growth refused while the daemon is
  down (`BudgetUnavailableError`) are the budget at work: counted, never
  failures. An `OutOfMemoryError` that is no denial is the driver refusing
  a create the ledger granted: out of memory inside the budget, a failure.
  Every block written must read as written after a preserving defragment,
  and a shrink must leave exactly the footprint of its blocks.
- The first engines all start at once: each says `ready` having opened a
  FIFO (the *gate*) for reading, and waits on it; once all have, one open
  and close of its writing end wakes every one of them, and they connect,
  join and grow together, as engines starting at once on one device do.
  The kills begin once each has said it joined.
- Until the deadline (a floor: `Floor`, for LEAST_ENGINE_KILLS,
  LEAST_DAEMON_KILLS and LEAST_SAMPLES), every KILL_GAP_S it SIGKILLs an
  engine (and starts another in its place, with draws of its own) or the
  daemon (and starts another on the same socket after a down time of up
  to DAEMON_DOWN_S; the clients rejoin by themselves).
- An `OutsideSampler` thread makes a pass every SAMPLE_EVERY_S over every
  live engine's process, reading its chunks file by file
  (extkv.memfds.host_chunks, what the daemon's own outside reading sums).
  A pass reads the engines one after another, so its plain sum may count
  one engine's chunks before it released them and another's created
  after, from the room the release made: more than was ever held at once.
  So a sample counts only the chunks two passes in a row both read in the
  same process, each at the smaller reading: a chunk lives one interval,
  so all of those lived at the instant between the passes, and the sample
  is at most what the engines held together then. Its maximum is held to
  the bound: the budget plus one granule per engine. The plain sums'
  maximum is kept beside it, for the record.

Engines report by lines: a cumulative tally when they joined and every
TALLY_EVERY_S after (so a killed engine's work up to its last line
counts), and a `failed` line at once for anything that is no budget
outcome. At the end every engine is told to stop: it frees its cache,
checks that its own process holds no chunk any more, closes its lease and
sends its last tally. Then the ledger must hold nothing (no engine, no
grant, no dead byte) within LEAK_SETTLES_S, and no process may reach any
chunk an ended engine (killed or stopped) held when last sampled. From the
daemon's logs: reclaims that went past their deadline (`reclaims_ignored`,
must be none), reserves denied at theirs, engines a restarted daemon
counted from its predecessor's journal before they rejoined, rejoins that
took the engines past the budget and releases the outside reading
contradicted. All of it goes
into the `StressTally` and a `BudgetStressResult`; once everything is
stopped, a bound broken raises AssertionError naming its numbers.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import select
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from ...budget.client import BudgetClient, read_status
from ...cache import ExtensibleKVCache
from ...errors import BudgetDeniedError, BudgetUnavailableError, OutOfMemoryError
from ...layout import KVCacheLayout
from ...memfds import host_chunk_bytes, host_chunks
from ...vmm import HostDriver
from ..budget import KILL_SETTLES_S, DaemonProcess, short_run_dir
from ..configs import config_for
from ..models import ContentMismatch, LeakFound
from .base import CHILD_TIMEOUT_S, HOST_STRESS_GRANULE
from .bounds import Floor
from .child import ChildProcess
from .reclaim import processes_reaching
from .tally import StressTally

#: The budget the engines share: 256 granules of HOST_STRESS_GRANULE, so
#: that eight engines together ask far more than it while the whole run
#: holds a few tens of MiB.
BUDGET_STRESS_BYTES = 16 << 20
#: Engines at once, and the most: the issue's "2 to 8 engine processes".
ENGINES = 8
MOST_ENGINES = 8
#: Blocks of an engine's cache ("full" config: 24 KiB a block, in 3
#: segments under LBHNC): 3.875 MiB with its granules, nearly a quarter
#: of the budget and twice an engine's share of it among eight, so that
#: every engine can grow past its share and press the others. No multiple
#: of the 8 blocks a granule holds, so LBHNC's segments share granules.
ENGINE_BLOCKS = 164
#: Layouts the engines draw from: three segments sharing granules, or one.
ENGINE_LAYOUTS = (KVCacheLayout.LBHNC, KVCacheLayout.BLHNC)
#: Weights the engines draw from.
ENGINE_WEIGHTS = (0.5, 1.0, 2.0)
#: The outside sampler's period: the issue's 10 ms.
SAMPLE_EVERY_S = 0.01
#: The most an engine waits for a command between two steps. An engine
#: alone, its daemon in a thread of its process, stepped every 3.4 ms (500
#: steps in 1.7 s on the 2-core CI host): eight stepping back to back would
#: keep both cores busy, and the daemon and the sampler would run in what
#: is left.
ENGINE_STEP_GAP_S = 0.002
#: How often an engine reports its tally, so a SIGKILL loses little of it.
TALLY_EVERY_S = 0.5
#: Seconds between two kills, drawn; and the longest a killed daemon stays
#: down before another starts on its socket.
KILL_GAP_S = (0.2, 0.6)
DAEMON_DOWN_S = 0.3
#: Of the kills past the least, the share that kill the daemon.
DAEMON_KILL_SHARE = 0.25
#: The least episode, however short the share of time: engines killed (and
#: replaced), and daemons killed (and restarted).
LEAST_ENGINE_KILLS = 2
LEAST_DAEMON_KILLS = 1
#: Samples the outside sampler takes at least, however short the share of time.
LEAST_SAMPLES = 20
#: Why a GPU runs none of it.
HOST_ONLY = ("the budget stress reads each engine's chunks from outside, which on a GPU is NVML's per-process "
             "reading: it counts each engine's CUDA context and torch's memory too, so its sum cannot be held to "
             "the budget; it runs on the host driver")
#: The issue's bound for the ledger to settle once engines end (the same as
#: a killed engine's, extkv.testing.budget.KILL_SETTLES_S).
LEAK_SETTLES_S = KILL_SETTLES_S

#: Failures an AssertionError of the run names, of all the tally holds.
MOST_FAILURES_SAID = 10
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


# -- the outside sampler -------------------------------------------------------------
Chunks = dict[tuple[int, int], int]


def consistent_bytes(first: dict[int, Chunks], second: dict[int, Chunks]) -> int:
    """Bytes of the chunks both passes read in the same process, each at
    the smaller of its two readings: all of them lived at once, between the
    passes (see the module's theory)."""
    total = 0
    for pid, chunks in first.items():
        again = second.get(pid, {})
        total += sum(min(size, again[key]) for key, size in chunks.items() if key in again)
    return total


def read_chunks(pid: int) -> Chunks:
    """The chunks process `pid` reaches, by file; none once it is gone."""
    try:
        return host_chunks(pid)
    except (FileNotFoundError, ProcessLookupError):
        return {}


class OutsideSampler:
    """Every `every_s`, a pass over the watched processes, each read from
    outside by `read`; each sample matches a pass with the one before it
    (see the module's theory): `samples` taken, `max_bytes` the largest
    consistent total, `max_plain_bytes` the largest plain sum of a pass,
    `last_bytes` the latest consistent total, `over` the samples above
    `bound` (if set) as (time.monotonic(), bytes)."""

    def __init__(self, every_s: float = SAMPLE_EVERY_S, read: Callable[[int], Chunks] = read_chunks,
                 bound: int | None = None):
        if not every_s > 0:
            raise ValueError(f"every_s must be > 0 seconds, got {every_s!r}")
        self.every_s, self._read, self.bound = every_s, read, bound
        self._pids: set[int] = set()
        self._lock = threading.Lock()
        self._sampled = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._previous: dict[int, Chunks] = {}
        self.passes = 0
        self.samples = 0
        self.max_bytes = 0
        self.max_plain_bytes = 0
        self.last_bytes = 0
        self.over: list[tuple[float, int]] = []
        #: The chunks each watched process was last read holding, in the last two passes.
        self.last: dict[int, Chunks] = {}
        self.error: BaseException | None = None

    def watch(self, pid: int) -> None:
        with self._lock:
            self._pids.add(pid)

    def forget(self, pid: int) -> Chunks:
        """Stop reading `pid`; returns the chunks it was last read holding."""
        with self._lock:
            self._pids.discard(pid)
            return self.last.pop(pid, {})

    def sample(self) -> int | None:
        """Take one pass; returns the consistent total it and the pass
        before it give (None for the first pass: no sample yet)."""
        with self._lock:
            pids = sorted(self._pids)
        chunks = {pid: self._read(pid) for pid in pids}
        with self._sampled:
            previous, self._previous = self._previous, chunks
            self.passes += 1
            self.max_plain_bytes = max(self.max_plain_bytes, sum(sum(held.values()) for held in chunks.values()))
            for pid in pids:
                if pid in self._pids:
                    self.last[pid] = {**previous.get(pid, {}), **chunks[pid]}
            if self.passes == 1:
                return None
            total = consistent_bytes(previous, chunks)
            self.samples += 1
            self.max_bytes = max(self.max_bytes, total)
            self.last_bytes = total
            if self.bound is not None and total > self.bound:
                self.over.append((time.monotonic(), total))
            self._sampled.notify_all()
        return total

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                self.sample()
                self._stop.wait(max(started + self.every_s - time.monotonic(), 0))
        except BaseException as error:  # noqa: BLE001 - raised again by stop()
            self.error = error
            with self._sampled:
                self._sampled.notify_all()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="extkv-outside-sampler", daemon=True)
        self._thread.start()

    def wait_samples(self, count: int, timeout_s: float = CHILD_TIMEOUT_S) -> bool:
        """Wait until `count` samples were taken in all; False at the timeout."""
        with self._sampled:
            return self._sampled.wait_for(lambda: self.samples >= count or self.error is not None, timeout_s)

    def stop(self) -> None:
        """Stop the thread; raises what stopped it, if anything did."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(CHILD_TIMEOUT_S)
        if self.error is not None:
            raise AssertionError(f"the outside sampler failed: {self.error!r}") from self.error


# -- an engine (the child's side) --------------------------------------------------------
class _Engine:
    """One engine process's cache, lock, reclaim handler and tally."""

    def __init__(self, client: BudgetClient, layout: KVCacheLayout, capacity: int, rng: random.Random,
                 tally: StressTally, say: Callable[[str], None]):
        self.client, self.rng, self.tally, self.say = client, rng, tally, say
        # The host driver unpoisoned: the walk proves zeroing over poison
        # (extkv.testing.stress.walk), and here every byte touched is time
        # the engines' steps take (4 MiB filled in 8 ms on the 2-core CI host).
        self.cache = ExtensibleKVCache(config_for("full", layout, capacity), HostDriver(HOST_STRESS_GRANULE), layout,
                                       budget=client)
        #: The blocks written since the last shrink or release, and the value of every byte.
        self.written: dict[int, int] = {}
        self.capacity = capacity
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
        for block, value in self.written.items():
            for i in range(len(self.cache.segment_strides)):
                if not self.block(i, block).eq(value).all():
                    raise ContentMismatch(f"a preserving defragment to {target} blocks changed block {block} of "
                                          f"segment {i}, written {value} in every byte")
        self.tally.checks["preserving defragment kept every written block"] += 1

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
                keep = min(self.cache.blocks_within(max(held - target, 0)), committed)
                if keep == committed:
                    self.tally.events["reclaims answered: nothing to give"] += 1
                    return 0
                self.written.clear()
                try:
                    self.cache.commit(keep, shrink=True)
                except (BudgetDeniedError, BudgetUnavailableError):
                    # Released, then the smaller prefix's regrowth refused: all of it was given back.
                    self.tally.events["reclaims: the shrink's regrowth refused"] += 1
                except OutOfMemoryError as error:
                    self.tally.events[OUT_OF_MEMORY_INSIDE] += 1
                    self.tally.fail(error, "a reclaim's shrink")
                    self.say(f"{FAILED} {OUT_OF_MEMORY_INSIDE}: a reclaim's shrink: {error}")
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
        """Free the cache (its chunks must be gone from this process) and end the lease."""
        self.client.on_reclaim(None)
        with self.lock:
            self.stopped = True
            self.cache.free()
        left = host_chunk_bytes("self")
        if left:
            self.tally.fail(LeakFound(f"after free the engine's process still holds {left} bytes of chunks"))
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
                       capacity: int, gate: str | None) -> int:
    """An engine child (`python -m extkv.testing.stress budget-engine`): says
    `ready`, waits at `gate` (a FIFO) if given, joins the daemon at
    `socket_path` and runs random operations until told `stop` (or
    `quit`), reporting its tally as it goes; returns its exit status."""
    if capacity < 4:  # a growth draws up to a quarter of it, at least one block
        raise ValueError(f"capacity must be at least 4 blocks, got {capacity!r}")
    rng = random.Random(seed)
    tally = StressTally(seeds=[seed])

    def say(line: str) -> None:
        print(line, flush=True)

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
        engine = _Engine(client, layout, capacity, rng, tally, say)
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


# -- the run (the parent's side) -------------------------------------------------------
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


@dataclass
class BudgetStressResult:
    """What a budget stress run did and found (see the module's theory)."""

    engines: int
    budget: int
    granule: int
    bound: int
    engine_starts: int = 0
    engine_kills: int = 0
    daemon_kills: int = 0
    samples: int = 0
    sampled_max: int = 0
    sampled_max_plain: int = 0
    over_bound_samples: int = 0
    #: Seconds from the latest daemon restart to the largest sample past the bound (None: none, or no restart before).
    largest_over_bound_after_restart_s: float | None = None
    operations: int = 0
    denials: int = 0
    unavailable: int = 0
    reclaims_answered: int = 0
    reclaim_slowest_s: float = 0.0
    out_of_memory_inside_budget: int = 0
    reclaims_late: int = 0
    reserves_denied_at_deadline: int = 0
    rejoins_past_budget: int = 0
    most_past_budget: int = 0
    releases_contradicted: int = 0
    #: Engine processes a restarted daemon counted from its predecessor's journal until they rejoined.
    found_at_restarts: int = 0
    leaks: list = field(default_factory=list)
    #: Seconds from the first of the engines started at once to pass the
    #: gate to the last, and from the first to join to the last.
    starts_spread_s: float | None = None
    joins_spread_s: float | None = None
    seconds: float = 0.0

    def problems(self) -> list[str]:
        """Every bound the run broke, with its numbers."""
        found = []
        if self.sampled_max > self.bound:
            found.append(f"sampled maximum {self.sampled_max} bytes > bound {self.bound} (budget {self.budget} + "
                         f"{self.engines} granules of {self.granule}) in {self.over_bound_samples} of {self.samples} "
                         f"samples, the largest {self.largest_over_bound_after_restart_s} s after a daemon restart; "
                         f"{self.rejoins_past_budget} rejoins took the engines past the budget, by up to "
                         f"{self.most_past_budget} bytes")
        if self.out_of_memory_inside_budget:
            found.append(f"{self.out_of_memory_inside_budget} creates the ledger granted ran out of memory")
        if self.reclaims_late:
            found.append(f"{self.reclaims_late} reclaims were answered past their deadline (reclaims_ignored)")
        found += [f"leak: {leak}" for leak in self.leaks]
        return found


def _daemon_log_counts(text: str) -> dict[str, int]:
    """What the daemon's log lines say happened (extkv.budget.daemon)."""
    past = [int(bytes_) for bytes_ in re.findall(r"the engines are (\d+) bytes past the budget", text)]
    return {
        "reclaims_late": len(re.findall(r"^expired: ReclaimIgnored\(", text, re.M)),
        "reserves_denied_at_deadline": len(re.findall(r"^expired: ReserveDenied\(", text, re.M)),
        "rejoins_past_budget": len(past),
        "most_past_budget": max(past, default=0),
        "releases_contradicted": len(re.findall(r"counted as held$", text, re.M)),
        "found_at_restarts": len(re.findall(r"^process \d+, an engine of the daemon before, holds \d+ bytes", text, re.M)),
    }


class _Run:
    """The parent's side of one run: the daemon, the engines, the sampler."""

    def __init__(self, tally: StressTally, seed: int, engines: int, budget: int, run_dir: str):
        self.tally, self.rng, self.engines, self.budget, self.run_dir = tally, random.Random(seed), engines, budget, run_dir
        directory = os.path.dirname(run_dir)
        self.gate, self.log_path = os.path.join(directory, "gate"), os.path.join(directory, "daemon.log")
        os.mkfifo(self.gate, 0o600)
        self.result = BudgetStressResult(engines, budget, HOST_STRESS_GRANULE, budget + engines * HOST_STRESS_GRANULE)
        self.sampler = OutsideSampler(bound=self.result.bound)
        self.daemon: DaemonProcess | None = None
        self.path: str | None = None
        self.fleet: list[EngineChild] = []
        self.ended: list[EngineChild] = []
        self.held_by_ended: Chunks = {}
        self.restarts: list[float] = []  # time.monotonic() as each restarted daemon listened
        self.pause = threading.Event()  # never set: its wait paces the kills, it orders nothing

    def start_daemon(self) -> None:
        self.daemon = DaemonProcess(self.run_dir, self.budget, self.log_path)
        if self.path is not None and self.daemon.path != self.path:
            raise AssertionError(f"the restarted daemon listens at {self.daemon.path}, not at {self.path}")
        self.path = self.daemon.path

    def new_engine(self, gated: bool) -> EngineChild:
        seed = self.rng.randrange(1 << 31)
        floor = HOST_STRESS_GRANULE * self.rng.randint(0, self.budget // (2 * MOST_ENGINES * HOST_STRESS_GRANULE))
        weight, layout = self.rng.choice(ENGINE_WEIGHTS), self.rng.choice(ENGINE_LAYOUTS)
        child = ChildProcess([
            "budget-engine", "--socket", self.path, "--seed", str(seed), "--floor", str(floor), "--weight", str(weight),
            "--layout", layout.name, "--capacity", str(ENGINE_BLOCKS), *(["--gate", self.gate] if gated else []),
        ])
        engine = EngineChild(child, child.pid, seed, floor, weight, layout)
        self.fleet.append(engine)
        self.result.engine_starts += 1
        return engine

    def ready(self, engine: EngineChild) -> None:
        said = engine.child.line()
        if said != READY:
            raise AssertionError(f"engine {engine.pid} said {said!r}, expected {READY!r}: {engine.child.command}")
        self.sampler.watch(engine.pid)

    def joined(self, engine: EngineChild) -> None:
        said = engine.child.line()
        engine.read_lines([said])
        if "joined_at" not in engine.info:
            raise AssertionError(f"engine {engine.pid} said {said!r}, expected its tally once it joined: "
                                 f"{engine.child.command}")

    def open_gate(self) -> None:
        """Wake every engine waiting at the gate at once."""
        os.close(os.open(self.gate, os.O_WRONLY | os.O_NONBLOCK))

    def drain(self) -> None:
        for engine in self.fleet:
            engine.read_lines(engine.child.drain(0))

    def end(self, engine: EngineChild) -> None:
        """An engine that exited or was killed: read the rest of what it said, count it."""
        engine.read_lines(engine.child.drain(0))
        self.held_by_ended.update(self.sampler.forget(engine.pid))
        engine.child.close()
        self.fleet.remove(engine)
        self.ended.append(engine)

    def kill_engine(self) -> None:
        engine = self.rng.choice(self.fleet)
        os.kill(engine.pid, signal.SIGKILL)
        engine.child.wait()
        self.end(engine)
        self.result.engine_kills += 1
        self.tally.events["engine SIGKILLed, and another started in its place"] += 1
        self.ready(self.new_engine(gated=False))

    def kill_daemon(self) -> None:
        self.daemon.kill()
        self.result.daemon_kills += 1
        self.pause.wait(self.rng.uniform(0, DAEMON_DOWN_S))  # engines meet a daemon that is gone
        self.start_daemon()
        self.restarts.append(time.monotonic())
        self.tally.events["budget daemon SIGKILLed, and another started on its socket"] += 1

    def stop_engines(self) -> None:
        """Tell every engine to stop, then read each to its end."""
        for engine in self.fleet:
            engine.child.send("stop")
        for engine in list(self.fleet):
            lines = []
            while not lines or lines[-1] != STOPPED:
                lines.append(engine.child.line())
            engine.read_lines(lines)
            if engine.child.wait() != 0:
                engine.problems.append(f"engine {engine.pid} exited with status {engine.child.returncode}")
            self.end(engine)

    def check_ledger_empty(self, since: float) -> None:
        """The ledger holds nothing within LEAK_SETTLES_S of `since`."""
        while True:
            report = read_status(self.path, CHILD_TIMEOUT_S)
            if not report["engines"] and report["granted"] == 0 and report["dead"] == 0:
                self.tally.checks["the ledger holds nothing once every engine ended"] += 1
                return
            if time.monotonic() - since > LEAK_SETTLES_S:
                self.result.leaks.append(
                    f"{LEAK_SETTLES_S} s after the last engine ended the ledger names pids "
                    f"{[engine['pid'] for engine in report['engines']]} and holds {report['granted']} bytes granted, "
                    f"{report['dead']} dead")
                return

    def check_chunks_gone(self) -> None:
        reaching = processes_reaching(set(self.held_by_ended))
        if reaching:
            self.result.leaks.append(f"processes {reaching} still reach chunks the ended engines held")
        else:
            self.tally.checks["no process reaches a chunk an ended engine held"] += 1

    def account(self) -> None:
        """Pool the engines' tallies and the daemon's log into the result and the tally."""
        result, pooled = self.result, StressTally()
        for engine in self.ended:
            pooled.add(engine.tally)
            for failure in engine.failures():
                pooled.fail(AssertionError(failure), engine.child.command)
            result.reclaim_slowest_s = max(result.reclaim_slowest_s, engine.info.get("reclaim_slowest_s", 0.0))
        result.operations = sum(pooled.operations.values())
        result.denials = sum(count for event, count in pooled.events.items() if event.startswith(DENIED))
        result.unavailable = sum(count for event, count in pooled.events.items() if event.startswith(UNAVAILABLE))
        result.reclaims_answered = pooled.events["reclaims answered"]
        result.out_of_memory_inside_budget = pooled.events[OUT_OF_MEMORY_INSIDE]
        with open(self.log_path) as log:
            for name, count in _daemon_log_counts(log.read()).items():
                setattr(result, name, count)
        sampler = self.sampler
        result.samples, result.sampled_max, result.sampled_max_plain = sampler.samples, sampler.max_bytes, sampler.max_plain_bytes
        result.over_bound_samples = len(sampler.over)
        if sampler.over:
            when, _ = max(sampler.over, key=lambda sample: sample[1])
            restarts = [restart for restart in self.restarts if restart <= when]
            result.largest_over_bound_after_restart_s = round(when - restarts[-1], 3) if restarts else None
        pooled.observe_physical(result.sampled_max)
        pooled.events["outside samples of the engines' chunks"] += result.samples
        pooled.events["reclaims answered past their deadline (daemon log)"] += result.reclaims_late
        pooled.events["reserves denied at their deadline (daemon log)"] += result.reserves_denied_at_deadline
        pooled.events["rejoins past the budget (daemon log)"] += result.rejoins_past_budget
        pooled.events["releases the outside reading contradicted (daemon log)"] += result.releases_contradicted
        pooled.events["engines a restarted daemon counted before they rejoined (daemon log)"] += result.found_at_restarts
        pooled.leaks += result.leaks
        pooled.settings["budget stress"] = asdict(result)
        self.tally.add(pooled)


def _spread(times: list[float | None]) -> float | None:
    """Seconds from the first of `times` to the last; None if one is missing."""
    return None if None in times else round(max(times) - min(times), 4)


def share_one_budget(tally: StressTally, seed: int, *, engines: int = ENGINES, until: float | None = None,
                     budget: int = BUDGET_STRESS_BYTES) -> BudgetStressResult:
    """`engines` engine processes sharing `budget` bytes through one daemon,
    all started at once, SIGKILLed at random (engines and the daemon) until
    `until` (time.monotonic(); a floor for the least episode, None: the
    least alone), sampled from outside every SAMPLE_EVERY_S (see the
    module's theory). Everything joins `tally`; AssertionError naming the
    numbers where a bound broke."""
    if not 2 <= engines <= MOST_ENGINES:
        raise ValueError(f"engines must be 2 to {MOST_ENGINES}, got {engines!r}")
    if budget < 2 * MOST_ENGINES * HOST_STRESS_GRANULE:
        raise ValueError(f"budget must be at least {2 * MOST_ENGINES * HOST_STRESS_GRANULE} bytes, got {budget!r}")
    tally.seeds.append(seed)
    started = time.monotonic()
    with short_run_dir() as run_dir:
        run = _Run(tally, seed, engines, budget, run_dir)
        try:
            run.start_daemon()
            first = [run.new_engine(gated=True) for _ in range(engines)]
            for engine in first:
                run.ready(engine)
            run.sampler.start()
            run.open_gate()
            for engine in first:  # each says so once it joined: no kill lands before every start
                run.joined(engine)
            tally.events["engines started at once, through one gate"] += engines
            floor = Floor(until, lambda: run.result.engine_kills >= LEAST_ENGINE_KILLS
                          and run.result.daemon_kills >= LEAST_DAEMON_KILLS and run.sampler.samples >= LEAST_SAMPLES)
            while floor.more():
                run.pause.wait(run.rng.uniform(*KILL_GAP_S))
                run.drain()
                owe_engine = run.result.engine_kills < LEAST_ENGINE_KILLS
                owe_daemon = run.result.daemon_kills < LEAST_DAEMON_KILLS
                if owe_daemon != owe_engine:
                    run.kill_daemon() if owe_daemon else run.kill_engine()
                elif run.rng.random() < DAEMON_KILL_SHARE:
                    run.kill_daemon()
                else:
                    run.kill_engine()
            floor.close(tally, "engines sharing one budget",
                        f"{run.result.engine_kills} engine and {run.result.daemon_kills} daemon SIGKILLs, "
                        f"{LEAST_SAMPLES} samples at least")
            run.stop_engines()
            run.sampler.stop()
            run.result.starts_spread_s = _spread([engine.info.get("gate_passed_at") for engine in first])
            run.result.joins_spread_s = _spread([engine.info.get("joined_at") for engine in first])
            run.check_ledger_empty(time.monotonic())
            run.check_chunks_gone()
        finally:
            with contextlib.suppress(AssertionError):  # raised above already, if at all
                run.sampler.stop()
            for engine in list(run.fleet):
                engine.child.close()
            if run.daemon is not None:
                run.daemon.kill()
        run.result.seconds = round(time.monotonic() - started, 2)
        run.account()
    failures = [failure["error"] for failure in tally.failures]
    problems = run.result.problems() + failures[:MOST_FAILURES_SAID] + (
        [f"{len(failures) - MOST_FAILURES_SAID} failures more (the tally holds them)"]
        if len(failures) > MOST_FAILURES_SAID else [])
    if problems:
        raise AssertionError("engines sharing one budget: " + "; ".join(problems))
    return run.result
