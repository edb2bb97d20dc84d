"""Several engines sharing one KV budget, through SIGKILLs of engines and of the daemon.

Theory of operation
-------------------
`share_one_budget` runs the shared budget (extkv.budget) as a machine of
several engines runs it, and reads it from outside. Its parts are modules
of their own: the engine child (extkv.testing.stress.budget_engine), the
outside sampler (extkv.testing.stress.budget_sampler) and the result
(extkv.testing.stress.budget_result); this module is the run that sets
them to work, on one device (the host driver, or a GPU):

- Sizes are counted in the granules of the device's stress driver
  (extkv.testing.stress.base's `plain_stress_driver`), so that a GPU's run
  is the host's scaled: a budget of BUDGET_STRESS_GRANULES granules (16 MiB
  of HOST_STRESS_GRANULE on the host, 512 MiB of a GPU's 2 MiB), engines of
  `engine_blocks(granule)` blocks (nearly a quarter of the budget), floors
  of whole granules.
- The daemon serves the device from a child process
  (extkv.testing.budget.DaemonProcess) under the key its driver names
  (`Driver.device_key()`: "host", or the GPU's "GPU-<uuid>", which the
  daemon reads through NVML), its log lines appended to a file as it logs
  them, so a SIGKILL loses none. The run reads the engines from outside
  through the same device (extkv.budget.device's `open_device`), so nothing
  here asks which kind of device it runs on.
- Each engine is a child process (`python -m extkv.testing.stress
  budget-engine ...`) on the device, with a seed, a floor, a weight and a
  layout drawn from the run's seed, reporting by lines. It says `ready`
  having opened a FIFO (the *gate*) for reading, and waits on it: its
  driver exists then (on a GPU, its CUDA context) and it has committed
  nothing, so what the device reads of its process is its baseline, which
  every sample of it subtracts (0 on the host; on a GPU its context and
  torch's memory). A device that reads whole processes and reads a ready
  engine's as 0 cannot see this machine's processes (a PID namespace hides
  them from NVML): `OutsideUnreadable`. One open and close of the gate's
  writing end wakes every engine waiting there.
- The first engines all start at once: the gate opens once all said
  `ready`, and they connect, join and grow together, as engines starting
  at once on one device do. The kills begin once each has said it joined.
  An engine started in a killed one's place passes the gate alone.
- Until the deadline (a floor: `Floor`, for LEAST_ENGINE_KILLS,
  LEAST_DAEMON_KILLS and LEAST_SAMPLES), every KILL_GAP_S it SIGKILLs an
  engine (and starts another in its place, with draws of its own) or the
  daemon (and starts another on the same socket after a down time of up
  to DAEMON_DOWN_S; the clients rejoin by themselves).
- An `OutsideSampler` thread makes a pass every SAMPLE_EVERY_S over every
  live engine's process; on the host a sample is at most what the engines
  held together at one instant, and on a GPU, whose NVML reading of a
  process has no chunks to match across passes, it is one pass made with
  every engine stopped (extkv.testing.stress.budget_sampler). Its maximum is held to the bound:
  the budget plus one granule per engine. A GPU's reading of an engine
  less its baseline is its chunks alone while its context keeps its size:
  the chunks are whole 2 MiB granules, so NVML's counting in 2 MiB steps
  rounds nothing of them away, and the engine ran the torch kernels its
  steps launch before `ready`; the granule an engine has in the bound also
  holds one 2 MiB step of its context grown after all (a module CUDA
  loaded lazily: extkv.vmm.witness's `lazy_growth_step`). The
  plain sums' maximum is kept beside it, for the record.

At the end every engine is told to stop. Then the ledger must hold
nothing (no engine, no grant, no dead byte) within LEAK_SETTLES_S, and no
process may hold any piece an ended engine (killed or stopped) held when
last sampled (`check_memory_gone`): on the host no process may reach its
chunks; on a GPU, whose pieces are whole processes, NVML must list none
of the ended engines, which it does once the driver tore the context
down, in its own time after the exit (waited for up to CHILD_TIMEOUT_S, a
net). From the daemon's logs: reclaims that went past their
deadline (`reclaims_ignored`, must be none), reserves denied at theirs,
engines a restarted daemon counted from its predecessor's journal before
they rejoined, rejoins that took the engines past the budget and releases
the outside reading contradicted. All of it goes into the `StressTally`
and a `BudgetStressResult`; once everything is stopped, a bound broken
raises AssertionError naming its numbers.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import threading
import time
from dataclasses import asdict

import torch

from ...budget.client import read_status
from ...budget.device import Pieces, open_device
from ...layout import KVCacheLayout
from ..budget import KILL_SETTLES_S, DaemonProcess, short_run_dir
from .base import CHILD_TIMEOUT_S, HOST_STRESS_GRANULE, plain_stress_driver
from .bounds import Floor
from .budget_engine import DENIED, OUT_OF_MEMORY_INSIDE, READY, STOPPED, UNAVAILABLE, EngineChild, engine_blocks
from .budget_result import BudgetStressResult
from .budget_sampler import OutsideSampler
from .child import ChildProcess
from .tally import StressTally

# Handed on, so that every name of the budget stress can be taken from here.
from .budget_engine import budget_engine_main  # noqa: F401
from .budget_sampler import SAMPLE_EVERY_S, consistent_bytes  # noqa: F401

#: The budget the engines share, in granules of the device's stress driver:
#: eight engines together ask far more than it, while the host's run holds
#: a few tens of MiB.
BUDGET_STRESS_GRANULES = 256
#: The host's budget: BUDGET_STRESS_GRANULES of HOST_STRESS_GRANULE, 16 MiB.
BUDGET_STRESS_BYTES = BUDGET_STRESS_GRANULES * HOST_STRESS_GRANULE
#: Engines at once, and the most: the issue's "2 to 8 engine processes".
ENGINES = 8
MOST_ENGINES = 8
#: Layouts the engines draw from: three segments sharing granules, or one.
ENGINE_LAYOUTS = (KVCacheLayout.LBHNC, KVCacheLayout.BLHNC)
#: Weights the engines draw from.
ENGINE_WEIGHTS = (0.5, 1.0, 2.0)
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
#: The issue's bound for the ledger to settle once engines end (the same as
#: a killed engine's, extkv.testing.budget.KILL_SETTLES_S).
LEAK_SETTLES_S = KILL_SETTLES_S
#: How often the ended engines' memory is read again while it outlives them
#: (a GPU's, until the driver tore their contexts down).
LEAK_POLL_S = 0.05

#: Failures an AssertionError of the run names, of all the tally holds.
MOST_FAILURES_SAID = 10


class OutsideUnreadable(Exception):
    """The device cannot read the engines' processes from outside here."""


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

    def __init__(self, tally: StressTally, seed: int, engines: int, device: torch.device, run_dir: str,
                 still: bool | None):
        self.tally, self.rng, self.engines, self.device, self.run_dir = tally, random.Random(seed), engines, device, run_dir
        driver = plain_stress_driver(device)
        self.granule, self.key = driver.granularity, driver.device_key()
        self.outside = open_device(self.key)
        self.budget = BUDGET_STRESS_GRANULES * self.granule
        directory = os.path.dirname(run_dir)
        self.gate, self.log_path = os.path.join(directory, "gate"), os.path.join(directory, "daemon.log")
        os.mkfifo(self.gate, 0o600)
        self.result = BudgetStressResult(engines, self.budget, self.granule, self.budget + engines * self.granule)
        # A process's total (NVML) has no identity to match across passes: read the engines stopped.
        self.result.engines_read_stopped = not self.outside.reads_chunks_only if still is None else still
        self.sampler = OutsideSampler(self.outside.read_pieces, bound=self.result.bound,
                                      still=self.result.engines_read_stopped)
        self.daemon: DaemonProcess | None = None
        self.path: str | None = None
        self.fleet: list[EngineChild] = []
        self.ended: list[EngineChild] = []
        self.held_by_ended: Pieces = {}
        self.started = time.monotonic()
        self.restarts: list[float] = []  # time.monotonic() as each restarted daemon listened
        self.pause = threading.Event()  # never set: its wait paces the kills and the leak's reads, it orders nothing

    def start_daemon(self) -> None:
        self.daemon = DaemonProcess(self.run_dir, self.budget, self.log_path, self.key)
        if self.path is not None and self.daemon.path != self.path:
            raise AssertionError(f"the restarted daemon listens at {self.daemon.path}, not at {self.path}")
        self.path = self.daemon.path

    def new_engine(self) -> EngineChild:
        seed = self.rng.randrange(1 << 31)
        floor = self.granule * self.rng.randint(0, BUDGET_STRESS_GRANULES // (2 * MOST_ENGINES))
        weight, layout = self.rng.choice(ENGINE_WEIGHTS), self.rng.choice(ENGINE_LAYOUTS)
        child = ChildProcess([
            "budget-engine", "--socket", self.path, "--seed", str(seed), "--floor", str(floor), "--weight", str(weight),
            "--layout", layout.name, "--capacity", str(engine_blocks(self.granule)), "--device", str(self.device),
            "--gate", self.gate,
        ])
        engine = EngineChild(child, child.pid, seed, floor, weight, layout)
        self.fleet.append(engine)
        self.result.engine_starts += 1
        return engine

    def ready(self, engine: EngineChild) -> None:
        """Once it says so, watch the engine, less its baseline (see the module's theory)."""
        said = engine.child.line()
        if said != READY:
            raise AssertionError(f"engine {engine.pid} said {said!r}, expected {READY!r}: {engine.child.command}")
        pieces = self.outside.read_pieces([engine.pid])[engine.pid]
        if pieces is None or not pieces and not self.outside.reads_chunks_only:
            raise OutsideUnreadable(
                f"{self.outside.name} reads engine process {engine.pid}, ready, as {pieces!r}: it cannot see this "
                "machine's processes (another uid's, a PID namespace, or no memory counted per process)")
        self.sampler.watch(engine.pid, sum(pieces.values()))

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
        self.ready(self.new_engine())
        self.open_gate()

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

    def check_memory_gone(self) -> None:
        """No process holds a piece an ended engine held: every process of
        this machine and every ended engine is read (see the module's
        theory); where the device's memory outlives the process for a while,
        read again until CHILD_TIMEOUT_S has passed."""
        ended = {engine.pid for engine in self.ended}
        deadline = time.monotonic() + (0 if self.outside.freed_at_exit else CHILD_TIMEOUT_S)
        while True:
            pids = ended | {int(name) for name in os.listdir("/proc") if name.isdigit()}
            read = self.outside.read_pieces(sorted(pids))
            unread = sorted(pid for pid in ended if read[pid] is None)
            if unread:
                self.result.leaks.append(f"{self.outside.name} cannot read the ended engines {unread}: their memory "
                                         "is not seen gone")
                return
            # A process the kernel will not let this one read (another uid's) is passed over: this uid's
            # memfds (mode 0600) reach it only if handed over, which nothing here does.
            reaching = {pid: len(self.held_by_ended.keys() & pieces.keys()) for pid, pieces in read.items() if pieces}
            reaching = {pid: count for pid, count in reaching.items() if count}
            if not reaching:
                self.tally.checks["no process reaches a chunk an ended engine held"] += 1
                return
            if time.monotonic() >= deadline:
                self.result.leaks.append(f"processes {reaching} still hold pieces the ended engines held "
                                         f"({self.outside.name}): pid -> pieces")
                return
            self.pause.wait(LEAK_POLL_S)

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
            result.largest_over_bound_at_s = round(when - self.started, 3)
            result.largest_over_bound_readings = {str(pid): list(readings) for pid, readings in sampler.largest_over.items()}
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


def share_one_budget(tally: StressTally, seed: int, *, device: torch.device | str = "cpu", engines: int = ENGINES,
                     until: float | None = None, still: bool | None = None) -> BudgetStressResult:
    """`engines` engine processes on `device` sharing BUDGET_STRESS_GRANULES
    of its granules through one daemon, all started at once, SIGKILLed at
    random (engines and the daemon) until `until` (time.monotonic(); a
    floor for the least episode, None: the least alone), sampled from
    outside every SAMPLE_EVERY_S (see the module's theory), with the
    engines stopped for each pass if `still` (None: where the device reads
    no chunks, as on a GPU; the host's tooling test sets it). Everything
    joins `tally`; AssertionError naming the numbers where a bound broke,
    OutsideUnreadable where the device cannot read the engines here."""
    if not 2 <= engines <= MOST_ENGINES:
        raise ValueError(f"engines must be 2 to {MOST_ENGINES}, got {engines!r}")
    tally.seeds.append(seed)
    started = time.monotonic()
    with short_run_dir() as run_dir:
        run = _Run(tally, seed, engines, torch.device(device), run_dir, still)
        try:
            run.start_daemon()
            first = [run.new_engine() for _ in range(engines)]
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
            run.check_memory_gone()
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
