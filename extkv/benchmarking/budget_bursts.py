"""Two engines under one KV budget, bursts alternating, against a static half each, read from outside.

Theory of operation
-------------------
The issue's workload for the shared budget (extkv.budget): two engines on
one device, one busy while the other idles, A, B, A, B. Under a budget of
B bytes the busy one should reach nearly B less what the idle one may keep
(its floor), and step about as fast as an engine whose cache was split off
statically, B/2 each, committed up front. Two readings, beside the budget
bench's three (extkv.benchmarking.budget_bench), in the same result file:

- *Bursts*: how far each burst's busy engine reached, and its p99 step
  against the static split's over the same steps.
- *Overshoot*: the most the two engines held together past the budget,
  read from outside them while the bursts ran (the issue's target: 0).

The engines. Each is a child process (`_burst_engine`, driven through
budget_bench's `EngineChild`) with a cache of the setting's geometry whose
reservation covers the whole budget, and a decode-like step: its batch
(`step_blocks` blocks' worth of sequences, a token each) appends
`step_blocks` blocks of KV, which the step writes into the cache in every
segment and reads back (a sum), then the model's fixed work, `work_matmuls`
products of the batch's activations by one `work_dim`-square weight. A
step is timed from its first call to the device's synchronize, so a step
that commits pays for its commit. A burst takes steps until the engine
cannot hold the next step's blocks:

- *budgeted*: the engine holds a lease with its floor, its cache asks the
  daemon before each create (`budget=`). At rest it holds its floor's
  blocks. A burst turns commit-ahead on (a window of `ahead_blocks` grown
  in steps of `ahead_step_blocks` by a worker beside the steps, as an
  engine that hides its growth does) and commits each step's blocks, until
  a commit is denied (the other engine is down to its floor, which the
  daemon never asks for) or the reservation is full. Then commit-ahead is
  turned off and the engine idles, keeping all it grew (its sequences are
  finished, but an engine keeps its KV until someone needs the room): it
  gives back only when the daemon asks, and then everything above its
  floor (`on_reclaim`: a shrink from the top to its floor's blocks,
  keeping them as they are mapped: nothing is created or zeroed, so the
  busy engine that waits on the reclaim waits for the unmaps and releases
  alone). The daemon asks once the other engine's growth no longer fits.
- *static*: no lease; the cache commits half the budget's blocks up front,
  and a burst takes steps until those are used.

A round runs both modes over the same two processes, in the order of a
Williams design (extkv.benchmarking.rounds), each mode's caches made anew
and freed after its `bursts` bursts (A, B, A, B); one daemon of the
device serves every budgeted round, and the ledger is seen empty before
the next. Readings, per round and mode:

- *Reach*: the busy engine's physical bytes at its burst's end (what the
  budget let it hold, commit-ahead's window included), beside the idle
  engine's, asked right after. Judged: at least the budget less the other
  engine's floor less one growth step (`growth_bytes`: the most a step's
  own commit maps, wherever it starts). A burst ends at the engine's own
  commit being denied, the worker's larger steps denied before it, so
  what the daemon could not grant is less than that commit.
- *Step times*: the *compared* steps are each burst's first
  `static_blocks // step_blocks`, the steps a static engine takes too, so
  both modes are timed over the same steps at the same KV; the budgeted
  engine's steps past them are kept, not compared. p50 and p99 of the
  round's compared steps, its bursts together; judged: the ratio of the
  least p99s over rounds.
- *Outside sums*: an `OutsideSampler` (extkv.testing.stress.budget_sampler)
  reads both engine processes every SAMPLE_EVERY_S (10 ms) through the
  device's outside reading (extkv.budget.device's `open_device`, the
  daemon's own: the pages of an engine's memfds on the host, NVML's
  per-process used memory on a GPU; nothing here asks which), less each
  engine's baseline read before any of its caches existed (nothing on the
  host; its CUDA context and torch's memory on a GPU, each step's kernels
  loaded by a warm-up first and nothing allocated by torch after it). A
  sample pairs two passes, each engine at the smaller of its readings: it
  is at most what both held at one instant between the passes, provided
  no engine's holding falls and rises again within the two passes. An
  engine falls only when reclaimed while idle and rises only in its own
  bursts, and the bench waits for GUARD_SAMPLES more samples after each
  burst before the next begins, so two passes never see both. Overshoot:
  the largest budgeted sample less the budget (0 where none is above it).
  The sampler runs in static rounds too, so both modes share its load.

Sizes and rounds are the profile's (`SETTINGS`). `run` returns one JSON
object, which bench/bench_budget.py stores under "bursts" in the budget
bench's result; extkv.benchmarking.targets judges it.
"""

from __future__ import annotations

import statistics
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from ..budget.client import BudgetClient, read_status
from ..budget.device import open_device
from ..cache import ExtensibleKVCache
from ..errors import OutOfMemoryError
from ..testing.budget import daemon_process, short_run_dir
from ..testing.stress.budget_sampler import SAMPLE_EVERY_S, OutsideSampler
from .budget_bench import HANG_S, EngineChild, daemon_device, refuse_a_budget_from_the_environment
from .decode import p99
from .geometry import GEOMETRIES
from .primitives import synchronize
from .rounds import round_order
from .sizes import GiB, MiB

ENGINES = ("A", "B")
MODES = ("budgeted", "static")
#: Samples the bench waits for after each burst before the next begins: two
#: whole passes lie between an engine's fall and its next rise (see the theory).
GUARD_SAMPLES = 3
#: Steps each engine runs on a throwaway cache before its baseline is read,
#: so that every kernel a step runs is loaded by then.
WARM_UP_STEPS = 3
#: How long the daemon may take to forget a round's leases once both engines
#: freed their caches and closed them (extkv.testing.budget's KILL_SETTLES_S).
SETTLE_S = 2.0
#: Threads of torch's CPU work in each engine. Two engines of the default
#: pool (a thread per core) oversubscribe the 2-core CI host: a step's
#: parallel kernel there waited whole scheduler quanta for a thread the
#: other engine's pool was spinning on, 28 to 36 ms steps where the step
#: alone took 0.1 ms (the quick profile, host driver).
ENGINE_THREADS = 1


@dataclass(frozen=True)
class BurstSetting:
    geometry: str
    budget_bytes: int
    #: Engine A's and engine B's floors.
    floors: tuple[int, int]
    #: KV blocks a step appends: its batch is this many blocks of tokens.
    step_blocks: int
    #: Commit-ahead's window and step, in blocks, while a budgeted engine is busy.
    ahead_blocks: int
    ahead_step_blocks: int
    work_dim: int
    work_matmuls: int
    work_dtype: str
    rounds: int
    bursts: int = 4

    def __post_init__(self):
        if self.geometry not in GEOMETRIES:
            raise ValueError(f"geometry must be one of {sorted(GEOMETRIES)}, got {self.geometry!r}")
        if len(self.floors) != len(ENGINES) or not all(0 <= floor < self.budget_bytes // 2 for floor in self.floors):
            raise ValueError(f"floors must be two byte counts below half the budget ({self.budget_bytes // 2}), "
                             f"got {self.floors!r}")
        if not isinstance(getattr(torch, self.work_dtype, None), torch.dtype):
            raise ValueError(f"work_dtype must name a torch dtype, got {self.work_dtype!r}")


#: The reference GPU run: a 32 GiB budget of vLLM's layout (32 layer
#: segments), floors of 2 and 4 GiB, a batch of 256 sequences (16 blocks a
#: step) over a step of sixteen 8192-square bf16 products.
GPU_BURSTS = BurstSetting("lbhnc32", 32 * GiB, (2 * GiB, 4 * GiB), step_blocks=16, ahead_blocks=1024,
                          ahead_step_blocks=128, work_dim=8192, work_matmuls=16, work_dtype="bfloat16", rounds=3)
#: The host run: 256 MiB in 2 MiB blocks, at most the budget held at once,
#: a batch of 16 sequences (a block a step).
HOST_BURSTS = BurstSetting("blhnc1", 256 * MiB, (32 * MiB, 64 * MiB), step_blocks=1, ahead_blocks=16,
                           ahead_step_blocks=4, work_dim=1024, work_matmuls=8, work_dtype="float32", rounds=3)
#: The smoke run: one round of four bursts in 48 MiB.
QUICK_BURSTS = BurstSetting("blhnc1", 48 * MiB, (8 * MiB, 16 * MiB), step_blocks=1, ahead_blocks=4,
                            ahead_step_blocks=2, work_dim=64, work_matmuls=1, work_dtype="float32", rounds=1)
SETTINGS = {"gpu": GPU_BURSTS, "host": HOST_BURSTS, "quick": QUICK_BURSTS}


def setting_for(profile: str) -> BurstSetting:
    if profile not in SETTINGS:
        raise ValueError(f"profile must be one of {sorted(SETTINGS)}, got {profile!r}")
    return SETTINGS[profile]


# -- an engine ----------------------------------------------------------------------------------
class _Engine:
    """An engine's state in its child process (see the module's theory).
    `lock` is held around each step and by the reclaim handler, so a
    reclaim runs between two steps and never while the engine is busy."""

    def __init__(self, socket_path: str, floor: int, setting: BurstSetting, device: torch.device,
                 client_class: type[BudgetClient]):
        self.socket_path, self.floor, self.setting, self.device = socket_path, floor, setting, device
        self.client_class = client_class
        self.shape = GEOMETRIES[setting.geometry]
        self.capacity = setting.budget_bytes // self.shape.bytes_per_block
        self.lock = threading.Lock()
        self.cache: ExtensibleKVCache | None = None
        self.client: BudgetClient | None = None
        self.rows: list[torch.Tensor] = []
        self.busy = False
        self.reclaims: list[dict] = []
        dtype = getattr(torch, setting.work_dtype)
        batch = setting.step_blocks * self.shape.spec.block_size
        generator = torch.Generator().manual_seed(0)
        self.activations = torch.randn(batch, setting.work_dim, generator=generator).to(device, dtype)
        self.weight = (torch.randn(setting.work_dim, setting.work_dim, generator=generator)
                       / setting.work_dim ** 0.5).to(device, dtype)
        self.product = torch.empty(batch, setting.work_dim, dtype=dtype, device=device)
        self.total = torch.zeros((), dtype=torch.float32, device=device)
        # The bytes of a step's new K and V, one row per block, in each segment's stride.
        self.kv = torch.full((setting.step_blocks, max(self.shape.strides())), 0x3C, dtype=torch.uint8, device=device)
        self.sizes = self._measure_and_warm_up()

    def _new_cache(self, client: BudgetClient | None) -> ExtensibleKVCache:
        cache = ExtensibleKVCache(self.shape.config(self.capacity), self.device, self.shape.layout, budget=client)
        full = cache.buffer.full_view()
        self.rows = [full[offset:offset + self.capacity * stride].view(-1, stride)
                     for offset, stride in zip(cache.segment_offsets, cache.segment_strides)]
        return cache

    def _measure_and_warm_up(self) -> dict:
        """The sizes every reading rests on, from a throwaway unbudgeted cache
        on which the step, commit-ahead and a shrink then run once each."""
        s, n = self.setting, self.setting.step_blocks
        cache = self._new_cache(None)
        try:
            floor_blocks = cache.blocks_within(self.floor)
            static_blocks = cache.blocks_within(s.budget_bytes // 2)
            sizes = {"capacity_blocks": self.capacity, "floor_blocks": floor_blocks,
                     "floor_held_bytes": cache.physical_bytes_for(floor_blocks), "static_blocks": static_blocks,
                     "static_bytes": cache.physical_bytes_for(static_blocks),
                     # What a step's commit maps at most, wherever it starts: a
                     # block's bytes may straddle a granule of each segment.
                     "growth_bytes": max(cache.physical_bytes_for(used + n) - cache.physical_bytes_for(used)
                                         for used in range(self.capacity - n + 1))}
            cache.commit_ahead(max(s.ahead_blocks, 1), step_blocks=s.ahead_step_blocks)
            for step in range(WARM_UP_STEPS):
                cache.commit((step + 1) * n)
                self._step(step * n, (step + 1) * n)
            synchronize(self.device)
            cache.commit_ahead(0)
            cache.commit(n, shrink=True, preserve_contents=True)
            synchronize(self.device)
        finally:
            cache.free()
            self.rows = []
        self.floor_blocks, self.static_blocks = floor_blocks, static_blocks
        return sizes

    def _step(self, used: int, want: int) -> None:
        """The step's device work: blocks [used, want) written and read back in
        every segment, then the model's products."""
        for rows in self.rows:
            new = rows[used:want]
            new.copy_(self.kv[:want - used, :new.shape[1]])
            torch.sum(new.view(torch.float32), dim=(0, 1), out=self.total)
        for _ in range(self.setting.work_matmuls):
            torch.mm(self.activations, self.weight, out=self.product)

    # -- a mode's caches ---------------------------------------------------------------
    def begin(self, mode: str) -> int:
        """Make the mode's cache: under a lease holding the floor's blocks, or
        unbudgeted holding half the budget; returns its physical bytes."""
        with self.lock:
            if mode == "budgeted":
                self.client = self.client_class(self.socket_path, floor=self.floor, timeout=HANG_S)
                self.client.on_reclaim(self.on_reclaim)
                self.cache = self._new_cache(self.client)
                self.cache.commit(self.floor_blocks)
            else:
                self.cache = self._new_cache(None)
                self.cache.commit(self.static_blocks)
            synchronize(self.device)
            return self.cache.physical_bytes

    def on_reclaim(self, target_bytes: int) -> int:
        """Idle: shrink to the floor's blocks, whatever the target (the
        sequences are finished), keeping them mapped as they are; busy (or
        between modes): 0, `cannot`."""
        with self.lock:
            cache = self.cache
            if self.busy or cache is None:
                return 0
            before = cache.physical_bytes
            start = time.perf_counter()
            cache.commit(self.floor_blocks, shrink=True, preserve_contents=True)
            synchronize(self.device)
            freed = before - cache.physical_bytes
            self.reclaims.append({"asked_bytes": target_bytes, "freed_bytes": freed,
                                  "shrink_s": time.perf_counter() - start})
            return freed

    def burst(self) -> dict:
        s, cache = self.setting, self.cache
        budgeted = self.client is not None
        limit = self.capacity if budgeted else self.static_blocks
        ahead = budgeted and s.ahead_blocks > 0
        with self.lock:
            self.busy = True
        if ahead:
            cache.commit_ahead(s.ahead_blocks, step_blocks=s.ahead_step_blocks)
        times: list[float] = []
        used, stopped = 0, "full"
        clock = time.perf_counter
        try:
            while used + s.step_blocks <= limit:
                want = used + s.step_blocks
                with self.lock:
                    start = clock()
                    if want > cache.num_committed_blocks:
                        try:
                            cache.commit(want)
                        except OutOfMemoryError as error:  # the budget's denial, or the driver's own
                            stopped = f"{type(error).__name__}: {error}"
                            break
                    self._step(used, want)
                    synchronize(self.device)
                    times.append(clock() - start)
                used = want
        finally:
            if ahead:
                cache.commit_ahead(0)
            with self.lock:
                self.busy = False
                reach = cache.physical_bytes
        return {"steps_s": times, "used_bytes": cache.physical_bytes_for(used), "reach_bytes": reach,
                "stopped": stopped}

    def held(self) -> int:
        with self.lock:
            return 0 if self.cache is None else self.cache.physical_bytes

    def end(self) -> list[dict]:
        """Free the mode's cache, then end its lease; returns the reclaims answered."""
        with self.lock:
            reclaims, self.reclaims = self.reclaims, []
            if self.cache is not None:
                self.cache.free()
            self.cache, self.rows = None, []
            client, self.client = self.client, None
        if client is not None:
            client.close()  # outside the lock: it joins the thread a handler runs on
        return reclaims


def _burst_engine(socket_path: str, floor: int, setting: BurstSetting, device: str,
                  client_class: type[BudgetClient], commands) -> None:
    """An engine's process: says ("ready", sizes), then answers "budgeted" and
    "static" (make that mode's cache), "burst", "held", "end" (free it) and
    "stop" with (command, value); anything it raises, ("failed", traceback)."""
    try:
        torch.set_num_threads(ENGINE_THREADS)
        engine = _Engine(socket_path, floor, setting, torch.device(device), client_class)
        commands.send(("ready", engine.sizes))
        while True:
            command = commands.recv()
            if command in MODES:
                commands.send((command, engine.begin(command)))
            elif command == "burst":
                commands.send(("burst", engine.burst()))
            elif command == "held":
                commands.send(("held", engine.held()))
            elif command == "end":
                commands.send(("end", engine.end()))
            elif command == "stop":
                engine.end()
                commands.send(("stop", None))
                return
            else:
                raise ValueError(f"the burst engine was sent {command!r}; expected one of "
                                 f"{[*MODES, 'burst', 'held', 'end', 'stop']}")
    except BaseException:  # noqa: BLE001 - said to the parent, which raises it
        commands.send(("failed", traceback.format_exc()))


# -- the bench's side -----------------------------------------------------------------------------
def _baselines(device, pids: list[int]) -> dict[int, int]:
    """Each engine's bytes as `device` reads them from outside, before its
    first cache: what every sample takes off its reading."""
    read = device.read_pieces(pids)
    unread = [pid for pid in pids if read[pid] is None]
    if unread:
        raise RuntimeError(f"{device!r} cannot read engine processes {unread} from outside (another uid, an "
                           "undumpable process, or no per-process reading): the overshoot needs it")
    return {pid: sum(read[pid].values()) for pid in pids}


def _wait_for_an_empty_ledger(socket_path: str) -> None:
    """Once both engines ended their leases: the daemon holds nothing for
    them within SETTLE_S, so the next round starts from an empty budget."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        report = read_status(socket_path, HANG_S)
        if not report["engines"] and report["granted"] == 0 and report["dead"] == 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{SETTLE_S} s after both engines ended their leases the budget daemon still names "
                               f"{len(report['engines'])} engines, {report['granted']} bytes granted, "
                               f"{report['dead']} dead")


def _one_mode(engines: list[EngineChild], mode: str, setting: BurstSetting, outside, baselines: dict[int, int],
              compared_steps: int, socket_path: str) -> dict:
    """One mode's bursts, A, B, A, B, with the outside sampler running."""
    for engine in engines:
        engine.ask(mode)
    sampler = OutsideSampler(outside.read_pieces, SAMPLE_EVERY_S, bound=setting.budget_bytes)
    for engine in engines:
        sampler.watch(engine.pid, baselines[engine.pid])
    sampler.start()
    bursts = []
    try:
        for index in range(setting.bursts):
            busy, idle = engines[index % 2], engines[1 - index % 2]
            burst = busy.ask("burst")
            bursts.append({"engine": ENGINES[index % 2], **burst, "other_held_bytes": idle.ask("held")})
            if not sampler.wait_samples(sampler.samples + GUARD_SAMPLES, HANG_S):
                raise TimeoutError(f"the outside sampler took no {GUARD_SAMPLES} samples within {HANG_S} s")
    finally:
        sampler.stop()
    reclaims = {name: engine.ask("end") for name, engine in zip(ENGINES, engines)}
    if mode == "budgeted":
        _wait_for_an_empty_ledger(socket_path)
    compared = [took for burst in bursts for took in burst["steps_s"][:compared_steps]]
    return {"bursts": bursts, "reclaims": reclaims, "compared": len(compared),
            "p50_s": statistics.median(compared) if compared else None, "p99_s": p99(compared) if compared else None,
            "samples": sampler.samples, "max_outside_bytes": sampler.max_bytes,
            "max_plain_bytes": sampler.max_plain_bytes, "over_samples": len(sampler.over)}


def run(device: torch.device | str, profile: str, progress: Callable[[str], None] = print, *,
        setting: BurstSetting | None = None, client_class: type[BudgetClient] = BudgetClient) -> dict:
    """Both modes' bursts on `device`, `setting.rounds` rounds, with the
    profile's setting (or `setting`); each engine's client a `client_class`
    (a planted defect's, in the bench's own tests)."""
    refuse_a_budget_from_the_environment("the budget's bursts")
    device = torch.device(device)
    setting = setting_for(profile) if setting is None else setting
    spec = daemon_device(device)
    outside = open_device(spec)
    rounds = []
    with short_run_dir() as run_dir, daemon_process(run_dir, setting.budget_bytes, device=spec) as daemon:
        engines: list[EngineChild] = []
        try:
            for name, floor in zip(ENGINES, setting.floors):
                engines.append(EngineChild(f"burst engine {name}", _burst_engine,
                                           (daemon.path, floor, setting, str(device), client_class)))
            baselines = _baselines(outside, [engine.pid for engine in engines])
            sizes = {name: engine.ready for name, engine in zip(ENGINES, engines)}
            compared_steps = sizes["A"]["static_blocks"] // setting.step_blocks
            for r in range(setting.rounds):
                order = round_order(MODES, r)
                measured = {mode: _one_mode(engines, mode, setting, outside, baselines, compared_steps, daemon.path)
                            for mode in order}
                rounds.append({"order": order, **measured})
                b, s = measured["budgeted"], measured["static"]
                reach = ", ".join(f"{burst['engine']} {burst['reach_bytes'] / MiB:.0f}" for burst in b["bursts"])
                progress(f"budget bursts round {r + 1}/{setting.rounds}: p99 step budgeted "
                         f"{(b['p99_s'] or 0) * 1e3:.2f} ms, static {(s['p99_s'] or 0) * 1e3:.2f} ms "
                         f"(over {b['compared']} and {s['compared']} steps); reach MiB {reach} of "
                         f"{setting.budget_bytes / MiB:.0f}; largest outside sum "
                         f"{b['max_outside_bytes'] / MiB:.1f} MiB over {b['samples']} samples")
        except BaseException:
            for engine in engines:
                engine.kill()
            raise
        for engine in engines:
            engine.close()
    return {"setting": asdict(setting), "geometry_what": GEOMETRIES[setting.geometry].what,
            "budget_bytes": setting.budget_bytes, "floors": dict(zip(ENGINES, setting.floors)),
            "floor_held_bytes": {name: size["floor_held_bytes"] for name, size in sizes.items()},
            "static_bytes": sizes["A"]["static_bytes"], "growth_bytes": sizes["A"]["growth_bytes"],
            "compared_steps": compared_steps, "outside": repr(outside),
            "baselines": {name: baselines[engine.pid] for name, engine in zip(ENGINES, engines)},
            "rounds": rounds}
