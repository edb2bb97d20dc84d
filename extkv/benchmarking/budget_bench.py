"""The shared KV budget's costs: a grant's round trip, what the budget adds to a commit, a reclaim from an idle engine.

Theory of operation
-------------------
Engines ask the budget daemon (extkv.budget) before they create physical
memory, so the budget sits on every commit's path and, when it is full, on
a busy engine's wait for an idle one to give back. Three readings, each on
the device of the run's driver, the daemon serving that device from a
process of its own (extkv.testing.budget's `daemon_process`, which opens
"host", or the GPU's UUID the driver's `device_identity` names: nothing
here asks which kind of device it runs on):

- *Grant round trip*: `reserve` of one granule and its `confirm` (nothing
  created), back to back, from this process's `BudgetClient`, timed
  together: what a budgeted commit waits for. `grant_samples` round trips a
  round (after `grant_warm_up` untimed ones), and per round their p50, p99
  and slowest; a daemon of the device's whole memory, so every reserve fits.
  Beside each round, in the order of a Williams design, the *floor*: as
  many round trips of a reserve's message and a grant's reply, same
  framing (extkv.wire), between this thread and a child process that
  answers each at once (`_echo`): what two Python processes take to
  exchange them here, with no reader thread, no ledger and no checks, the
  least any client of a Python daemon could take.
- *Commit through the budget*: `commit(N)` on a cache just made, to the
  device's synchronize, through a budgeted cache (`budget=client`), through
  one whose client keeps the commit's footprint granted ahead
  (`BudgetClient(ahead=)`: its untimed first commit asks for them, and from
  then on each teardown's release keeps them for the next commit, which
  asks nothing), and through the same cache unbudgeted, the three in the
  rows of a Williams design over rounds (extkv.benchmarking.rounds), one
  untimed round of each first. Setup (the cache's reservation) and teardown
  (`free`) are untimed; after a budgeted teardown a status request waits
  until the daemon has taken its `returned`, so that no outside reading of
  this process (the host device reads its memfds at each return) meets the
  unbudgeted cache's chunks. Per size: each side's rounds; the ratio of
  minima to the unbudgeted side's is the cost added, with and without
  bytes ahead.
- *Reclaim from an idle engine*: a budget of exactly N bytes; an idle
  engine, a child process (`_idle_engine`), holds all N in one commit and
  answers a reclaim through its `on_reclaim`, which shrinks its cache to
  nothing (`commit(0, shrink=True)`) and returns what it freed. This
  process, the busy engine, joins with a floor of N, so its fair share is
  all of it, and reserves N: timed from the call to its grant, which comes
  once the idle engine's returns reach the daemon. The ticket is cancelled
  and the idle engine grows back for the next round. Interleaved with it,
  the idle engine's unmap and release *alone*: the same commit and shrink
  on an unbudgeted cache in the same process, only the shrink timed (the
  budgeted cache holds nothing meanwhile). The reclaim's cost past the
  unmap and release is the least reserve-to-grant less the least shrink
  alone; the shrink inside the handler is recorded beside them.

Sizes and rounds are the profile's (`SETTINGS`: the reference GPU run, the
host run scaled to a small machine, the smoke run). The result is one JSON
object (`run`), written by bench/bench_budget.py as result_files.BUDGET_FILE;
extkv.benchmarking.targets judges it and extkv.benchmarking.budget_report
renders it in the bench's report.
"""

from __future__ import annotations

import os
import socket
import statistics
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from ..budget.client import ENVIRONMENT_VARIABLE, BudgetClient
from ..budget.device import open_device
from ..cache import ExtensibleKVCache
from ..vmm import driver_for
from ..testing.budget import daemon_process, short_run_dir
from ..testing.children import fork_server
from ..wire import receive_message, send_message
from .decode import p99
from .geometry import GEOMETRIES
from .primitives import synchronize
from .rounds import round_order
from .sizes import GiB, MiB

FORMAT = "extkv-bench-budget/1"
#: A net against a hang (an idle engine that never answers), never a wait
#: anything is ordered by.
HANG_S = 120


@dataclass(frozen=True)
class Setting:
    geometry: str
    grant_rounds: int
    #: Round trips a round.
    grant_samples: int
    #: Sizes of the commits, each measured budgeted and unbudgeted.
    commit_bytes: tuple[int, ...]
    commit_rounds: int
    #: What the idle engine holds and gives back.
    reclaim_bytes: int
    reclaim_rounds: int
    #: Untimed round trips before the first round: the daemon's and the
    #: client's first calls (imports, buffers) land in none.
    grant_warm_up: int = 50


#: The reference GPU run: the commits at the target's least size (256 MiB)
#: up to the headline 32 GiB, and the issue's 32 GiB reclaim.
GPU_SETTING = Setting("lbhnc32", grant_rounds=5, grant_samples=2000, commit_bytes=(256 * MiB, 4 * GiB, 32 * GiB),
                      commit_rounds=15, reclaim_bytes=32 * GiB, reclaim_rounds=7)
#: The host run: at most 1 GiB held at once, the host profile's headline
#: 256 MiB for the reclaim.
HOST_SETTING = Setting("lbhnc32", grant_rounds=5, grant_samples=1000, commit_bytes=(256 * MiB, GiB),
                       commit_rounds=9, reclaim_bytes=256 * MiB, reclaim_rounds=7)
#: The smoke run of `extkv bench --quick`: seconds, sizes below any target's.
QUICK_SETTING = Setting("blhnc1", grant_rounds=2, grant_samples=200, commit_bytes=(16 * MiB,), commit_rounds=3,
                        reclaim_bytes=16 * MiB, reclaim_rounds=2)
SETTINGS = {"gpu": GPU_SETTING, "host": HOST_SETTING, "quick": QUICK_SETTING}


def setting_for(profile: str) -> Setting:
    if profile not in SETTINGS:
        raise ValueError(f"profile must be one of {sorted(SETTINGS)}, got {profile!r}")
    return SETTINGS[profile]


def daemon_device(device: torch.device) -> str:
    """What the daemon of `device` opens (extkv.budget.device's `open_device`)."""
    return driver_for(device).device_key()


def _blocks(geometry: str, nbytes: int) -> int:
    return max(1, nbytes // GEOMETRIES[geometry].bytes_per_block)


def _cache(geometry: str, blocks: int, device: torch.device, client: BudgetClient | None = None) -> ExtensibleKVCache:
    shape = GEOMETRIES[geometry]
    return ExtensibleKVCache(shape.config(blocks), device, shape.layout, budget=client)


def footprint(geometry: str, blocks: int, device: torch.device) -> int:
    """The physical bytes of `blocks` committed blocks of the bench's cache."""
    cache = _cache(geometry, blocks, device)
    try:
        return cache.physical_bytes_for(blocks)
    finally:
        cache.free()


# -- grant round trip -------------------------------------------------------------------------
GRANT_SIDES = ("grant", "floor")


def _echo(sock: socket.socket) -> None:
    """The floor's child: answer each message with a grant's reply at once, until the parent hangs up."""
    with sock:
        while True:
            try:
                message = receive_message(sock)
            except ConnectionError:
                return
            send_message(sock, {"op": "granted", "id": message["id"], "ticket": 1, "bytes": message["bytes"]})


def _round(samples: int, round_trip: Callable[[], object]) -> dict:
    times = []
    clock = time.perf_counter
    for _ in range(samples):
        start = clock()
        round_trip()
        times.append(clock() - start)
    return {"p50_s": statistics.median(times), "p99_s": p99(times), "max_s": max(times), "samples": len(times)}


def measure_grants(client: BudgetClient, nbytes: int, setting: Setting,
                   progress: Callable[[str], None]) -> tuple[list[dict], list[dict]]:
    """Per round, the grant's and the floor's: p50, p99 and slowest of
    `grant_samples` round trips (reserve + confirm; a bare message and its
    reply)."""
    ours, theirs = socket.socketpair()
    echo = fork_server().Process(target=_echo, args=(theirs,), daemon=True)
    echo.start()
    theirs.close()
    ours.settimeout(HANG_S)
    request = {"op": "reserve", "id": 0, "bytes": nbytes, "ahead": 0}

    def bare() -> None:
        request["id"] += 1
        send_message(ours, request)
        receive_message(ours)

    round_trips = {"grant": lambda: client.confirm(client.reserve(nbytes), 0), "floor": bare}
    rounds: dict[str, list[dict]] = {side: [] for side in GRANT_SIDES}
    try:
        for side in GRANT_SIDES:
            for _ in range(setting.grant_warm_up):
                round_trips[side]()
        for r in range(setting.grant_rounds):
            for side in round_order(GRANT_SIDES, r):
                rounds[side].append(_round(setting.grant_samples, round_trips[side]))
            grant, floor = rounds["grant"][-1], rounds["floor"][-1]
            progress(f"budget grant round trip round {r + 1}/{setting.grant_rounds}: p50 {grant['p50_s'] * 1e6:.0f} "
                     f"us, p99 {grant['p99_s'] * 1e6:.0f} us (floor: p50 {floor['p50_s'] * 1e6:.0f} us, p99 "
                     f"{floor['p99_s'] * 1e6:.0f} us)")
    finally:
        ours.close()  # the child's read ends
        echo.join(HANG_S)
        if echo.exitcode is None:
            echo.kill()
            echo.join(HANG_S)
    return rounds["grant"], rounds["floor"]


# -- commit through the budget ----------------------------------------------------------------
COMMIT_SIDES = ("budgeted", "ahead", "unbudgeted")


def _timed_commit(geometry: str, blocks: int, device: torch.device, client: BudgetClient | None) -> float:
    cache = _cache(geometry, blocks, device, client)
    try:
        synchronize(device)
        start = time.perf_counter()
        cache.commit(blocks)
        synchronize(device)
        return time.perf_counter() - start
    finally:
        cache.free()
        if client is not None:
            client.report()  # the daemon has taken the free's returns (see the theory)


def measure_commits(client: BudgetClient, device: torch.device, setting: Setting,
                    progress: Callable[[str], None]) -> list[dict]:
    """Per size: the rounds (seconds) of the commit budgeted, budgeted on
    bytes granted ahead (a second client of `client`'s class, keeping the
    commit's footprint ahead), and unbudgeted."""
    measured = []
    for nbytes in setting.commit_bytes:
        blocks = _blocks(setting.geometry, nbytes)
        ahead = footprint(setting.geometry, blocks, device)
        with type(client)(client.socket_path, timeout=client.timeout, ahead=ahead) as ahead_client:
            sides = {"budgeted": client, "ahead": ahead_client, "unbudgeted": None}
            for side in COMMIT_SIDES:  # untimed: first-call costs (and the ahead side's one reserve) in no round
                _timed_commit(setting.geometry, blocks, device, sides[side])
            times: dict[str, list[float]] = {side: [] for side in COMMIT_SIDES}
            for r in range(setting.commit_rounds):
                for side in round_order(COMMIT_SIDES, r):
                    times[side].append(_timed_commit(setting.geometry, blocks, device, sides[side]))
        measured.append({"bytes": blocks * GEOMETRIES[setting.geometry].bytes_per_block, "ahead_bytes": ahead,
                         "budgeted_s": times["budgeted"], "ahead_s": times["ahead"],
                         "unbudgeted_s": times["unbudgeted"]})
        progress(f"budget commit {nbytes / MiB:g} MiB: budgeted {min(times['budgeted']) * 1e3:.3f} ms, on bytes "
                 f"ahead {min(times['ahead']) * 1e3:.3f} ms, unbudgeted {min(times['unbudgeted']) * 1e3:.3f} ms "
                 f"(least of {setting.commit_rounds})")
    return measured


# -- reclaim from an idle engine --------------------------------------------------------------
RECLAIM_SIDES = ("reclaim", "alone")


def _idle_engine(socket_path: str, geometry: str, blocks: int, device: str, commands) -> None:
    """The idle engine's process: a budgeted cache that gives everything back
    when asked, and an unbudgeted one for the unmap and release alone. Each
    command on its pipe ("grow", "shrunk", "alone", "stop") is answered
    (command, value); anything it raises, ("failed", traceback)."""
    try:
        device = torch.device(device)
        client = BudgetClient(socket_path, timeout=HANG_S)
        cache, alone = _cache(geometry, blocks, device, client), _cache(geometry, blocks, device)
        lock = threading.Lock()  # the engine's: the handler shrinks between two of its commands' steps
        shrinks: list[float] = []
        shrunk = threading.Condition(lock)

        def on_reclaim(target_bytes: int) -> int:
            with lock:
                held = cache.physical_bytes
                start = time.perf_counter()
                cache.commit(0, shrink=True)
                synchronize(device)
                shrinks.append(time.perf_counter() - start)
                shrunk.notify_all()
                return held

        client.on_reclaim(on_reclaim)
        commands.send(("ready", None))
        while True:
            command = commands.recv()
            if command == "grow":
                with lock:
                    cache.commit(blocks)
                    synchronize(device)
                    commands.send(("grow", cache.physical_bytes))
            elif command == "shrunk":  # the handler's shrink of the reclaim just granted
                with lock:
                    if not shrunk.wait_for(lambda: shrinks, HANG_S):
                        raise TimeoutError(f"no reclaim reached the idle engine within {HANG_S} s")
                    commands.send(("shrunk", shrinks.pop()))
            elif command == "alone":
                with lock:
                    alone.commit(blocks)
                    synchronize(device)
                    start = time.perf_counter()
                    alone.commit(0, shrink=True)
                    synchronize(device)
                    commands.send(("alone", time.perf_counter() - start))
            elif command == "stop":
                cache.free()
                alone.free()
                client.close()
                commands.send(("stop", None))
                return
            else:
                raise ValueError(f"the idle engine was sent {command!r}; expected grow, shrunk, alone or stop")
    except BaseException:  # noqa: BLE001 - said to the parent, which raises it
        commands.send(("failed", traceback.format_exc()))


class EngineChild:
    """The parent's side of an engine child, `target(*args, commands)` in a
    process of the fork server: it says ("ready", value) once set up, then
    answers each command sent on its pipe with (command, value), or
    ("failed", traceback). `what` names it in errors ("the idle engine");
    `ready` holds what it said when ready."""

    def __init__(self, what: str, target: Callable, args: tuple):
        context = fork_server()
        self.what = what
        self.commands, theirs = context.Pipe()
        self.process = context.Process(target=target, args=(*args, theirs), daemon=True)
        self.process.start()
        self.pid = self.process.pid
        theirs.close()
        try:
            self.ready = self._answer("ready")
        except BaseException:
            self.kill()
            raise

    def _answer(self, expected: str):
        if not self.commands.poll(HANG_S):
            raise TimeoutError(f"{self.what} (pid {self.pid}) did not answer {expected!r} within {HANG_S} s")
        said, value = self.commands.recv()
        if said == "failed":
            raise RuntimeError(f"{self.what} (pid {self.pid}) failed:\n{value}")
        if said != expected:
            raise RuntimeError(f"{self.what} (pid {self.pid}) said {said!r}, expected {expected!r}")
        return value

    def ask(self, command: str):
        self.commands.send(command)
        return self._answer(command)

    def close(self) -> None:
        """Stop it (it frees what it holds and ends its lease) and reap it;
        kill it if it does not stop."""
        try:
            if self.process.is_alive():
                self.ask("stop")
        finally:
            self.process.join(HANG_S)
            self.kill()

    def kill(self) -> None:
        """SIGKILL it if it still runs, and reap it. Idempotent."""
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join(HANG_S)
        self.commands.close()


def measure_reclaim(device: torch.device, setting: Setting, client_class: type[BudgetClient],
                    progress: Callable[[str], None]) -> dict:
    """Reserve-to-grant of the busy engine, the idle engine's shrink inside
    its handler, and its unmap and release alone, round by round (seconds)."""
    blocks = _blocks(setting.geometry, setting.reclaim_bytes)
    held = footprint(setting.geometry, blocks, device)
    times: dict[str, list[float]] = {"grant_s": [], "handler_shrink_s": [], "alone_s": []}
    with short_run_dir() as run_dir, daemon_process(run_dir, held, device=daemon_device(device)) as daemon:
        idle = EngineChild("the idle engine", _idle_engine, (daemon.path, setting.geometry, blocks, str(device)))
        try:
            with client_class(daemon.path, floor=held, timeout=HANG_S) as busy:
                def reclaim() -> tuple[float, float]:
                    grown = idle.ask("grow")
                    if grown != held:
                        raise RuntimeError(f"the idle engine holds {grown} bytes, expected {held}")
                    start = time.perf_counter()
                    ticket = busy.reserve(held)
                    took = time.perf_counter() - start
                    busy.cancel(ticket)
                    return took, idle.ask("shrunk")

                reclaim()  # each side once, untimed: first-call costs land in no round
                idle.ask("alone")
                for r in range(setting.reclaim_rounds):
                    for side in round_order(RECLAIM_SIDES, r):
                        if side == "reclaim":
                            took, inside = reclaim()
                            times["grant_s"].append(took)
                            times["handler_shrink_s"].append(inside)
                        else:
                            times["alone_s"].append(idle.ask("alone"))
                    progress(f"budget reclaim round {r + 1}/{setting.reclaim_rounds}: reserve to grant "
                             f"{times['grant_s'][-1] * 1e3:.2f} ms (the handler's shrink "
                             f"{times['handler_shrink_s'][-1] * 1e3:.2f} ms), shrink alone "
                             f"{times['alone_s'][-1] * 1e3:.2f} ms")
        finally:
            idle.close()
    return {"bytes": blocks * GEOMETRIES[setting.geometry].bytes_per_block, "physical_bytes": held, **times}


def refuse_a_budget_from_the_environment(what: str) -> None:
    """ValueError where EXTKV_BUDGET names a daemon: a cache given no client
    (and every child process, which inherits it) asks that daemon, so the
    unbudgeted side of `what`'s comparison would be budgeted too."""
    if os.environ.get(ENVIRONMENT_VARIABLE):
        raise ValueError(f"{what} compares with unbudgeted caches: unset {ENVIRONMENT_VARIABLE} "
                         f"(it names {os.environ[ENVIRONMENT_VARIABLE]!r})")


def run(device: torch.device | str, profile: str, progress: Callable[[str], None] = print, *,
        setting: Setting | None = None, client_class: type[BudgetClient] = BudgetClient) -> dict:
    """The three readings on `device` with the profile's setting (or
    `setting`), the busy engine's client a `client_class` (a planted slow
    one, in the bench's own tests)."""
    refuse_a_budget_from_the_environment("the budget bench")
    device = torch.device(device)
    setting = setting_for(profile) if setting is None else setting
    spec = daemon_device(device)
    granule = driver_for(device).granularity
    with short_run_dir() as run_dir, daemon_process(run_dir, open_device(spec).total_bytes, device=spec) as daemon:
        with client_class(daemon.path, timeout=HANG_S) as client:
            grants, floor = measure_grants(client, granule, setting, progress)
            commits = measure_commits(client, device, setting, progress)
    reclaim = measure_reclaim(device, setting, client_class, progress)
    return {"format": FORMAT, "profile": profile, "device": str(device), "daemon_device": spec,
            "torch": torch.__version__, "setting": asdict(setting), "geometry_what": GEOMETRIES[setting.geometry].what,
            "grant": {"bytes": granule, "rounds": grants, "floor_rounds": floor}, "commits": commits, "reclaim": reclaim}
