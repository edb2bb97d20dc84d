"""A budget daemon serving from a thread of the test process, and the checks of the budget's proofs.

Theory of operation
-------------------
The budget's tests need a real daemon (extkv.budget.daemon) on a real Unix
socket, and an engine's side that talks to it through the real client.
`served_daemon(budget)` starts a `BudgetDaemon` (or the daemon `make_daemon`
builds: a planted defect's, extkv.testing.planted) over the host device in
a directory of its own (short: an AF_UNIX address holds 107 bytes, and
pytest's tmp_path is long) and runs its loop in a daemon thread, so a test
reads the ledger through the same protocol an operator's `extkv budget
status` uses; on the way out it stops the loop, joins it within
STOP_WAIT_S, closes the daemon and removes the directory.

`daemon_process(run_dir, budget)` serves from a child process of the fork
server (extkv.testing.children) instead, so that a test can SIGKILL the
daemon, as a crash would end it, and start another on the same socket; and
so that the shared budget's bench (extkv.benchmarking.budget_bench) talks to
a daemon in another process, as engines do, of the device `device` names
(extkv.budget.device's `open_device`: "host", or a GPU's UUID).
Given `log_path`, the child appends each of the daemon's log lines to that
file as it logs it, one write a line, so a SIGKILL loses none of them.

The checks live here so that the contract tests (conformance/
test_budget_*.py) and the planted defects that must fail them
(conformance/test_planted_defects.py) run the same code:

- `CoveredCreates`: a driver under a budgeted driver that, at each create,
  reads the daemon's ledger and demands a grant covering it and every byte
  created before it.
- `check_ledger_holds`: at a quiescent point the ledger holds exactly what
  the engine maps and its client keeps granted ahead, with no ticket open.
- `CancelsSeen`: the real client, saying when it sent a cancel, so that a
  test waits for the cancel of a grant to a reserve given up (extkv.budget.
  client's AbandonableReserves) on an event rather than a clock.
- `ledger_settles`: after an engine's SIGKILL, the ledger comes back to the
  live engines' bytes within KILL_SETTLES_S of its exit, and names the dead
  engine no more. A child engine for it (`child_stopped_at`) stops at one
  step of the protocol, says so on a pipe and waits there for its SIGKILL;
  its stop is a driver step (`StopsAt`, under the budgeted driver, so it
  sees each create and release where the budget asked for it) or the
  reclaim handler itself, so no sleep orders anything.
- `check_ledger_holds_each_cache`: the daemon's ledger holds a live lease
  per engine, exactly its cache's physical bytes; a daemon that restarted
  (`daemon_process`) holds that once each engine rejoined it.
  `check_ledger_holds_engines` checks the same of engines in other
  processes, from the bytes each says its caches hold.
- `check_uid_refused`: a daemon told to serve other uids refuses this one
  before anything it sends is read, and nothing of it reaches the ledger.
- `check_claimed_release_counted`: after an engine claimed to return bytes
  it still holds, the daemon's ledger holds what its process holds, as
  read from outside. Its child engine (`claiming_child`) holds
  CLAIM_HELD granules, returns CLAIM_RETURNED of them, releasing them first
  only if honest, says so on a pipe and waits there for its SIGKILL.

Every check raises AssertionError naming the numbers it found.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
import time
from typing import Callable, Iterator

from ..budget.client import BudgetClient, read_status
from ..budget.daemon import BudgetDaemon
from ..budget.device import HostDevice, open_device
from ..cache import ExtensibleKVCache
from ..errors import BudgetUnavailableError
from ..layout import KVCacheLayout
from ..vmm import HostDriver
from ..vmm.wrapping import WrappingDriver
from .children import fork_server
from .configs import config_for

#: Seconds the daemon's loop may take to stop once asked, and a daemon's
#: child process to start or to be reaped once killed: a net against a hang.
STOP_WAIT_S = 60
#: A safety net against a hang (a child that never reaches its step, a
#: reply that never comes), never a synchronization.
HANG_S = 60
#: The issue's bound: the ledger equals the live engines' bytes within this
#: many seconds of a killed engine's exit. The daemon reads a dead lease's
#: process every DEAD_LEASE_POLL_S (0.02 s), a hundredth of it.
KILL_SETTLES_S = 2.0


class ServedDaemon:
    """A daemon serving from a thread; `log` holds its lines, `path` its socket.
    `make_daemon` takes BudgetDaemon's arguments and returns the daemon to serve."""

    def __init__(self, run_dir: str, budget: int, allowed_uids=None,
                 make_daemon: Callable[..., BudgetDaemon] = BudgetDaemon):
        self.log: list[str] = []
        device = HostDevice()
        # It reads its engines from outside, this process among them: chunks
        # an earlier test left here would count as held by every engine of
        # this process, and the test would fail on numbers that name none.
        left = device.read_process(os.getpid())
        if left:
            raise AssertionError(f"this process holds {left} bytes of extkv chunks before its budget daemon starts: "
                                 "an earlier test left them (its own failure says so); this test's outside "
                                 "readings would count them")
        self.daemon = make_daemon(device, budget, run_dir=run_dir, allowed_uids=allowed_uids, log=self.log.append)
        self.daemon.start()
        self.path = self.daemon.socket_path
        self.thread = threading.Thread(target=self.daemon.serve_forever, name="budget-daemon", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Idempotent; raises if the loop did not stop."""
        if self.thread.is_alive():
            self.daemon.stop()
            self.thread.join(STOP_WAIT_S)
            if self.thread.is_alive():
                raise AssertionError(f"the budget daemon's loop did not stop within {STOP_WAIT_S} s")
        self.daemon.close()


@contextlib.contextmanager
def served_daemon(budget: int, allowed_uids=None,
                  make_daemon: Callable[..., BudgetDaemon] = BudgetDaemon) -> Iterator[ServedDaemon]:
    with short_run_dir() as run_dir:
        served = ServedDaemon(run_dir, budget, allowed_uids, make_daemon)
        try:
            yield served
        finally:
            served.stop()


@contextlib.contextmanager
def short_run_dir() -> Iterator[str]:
    """A daemon's run directory, not made yet, in a new directory of the
    temp dir, removed on the way out. Short: an AF_UNIX address holds 107
    bytes, and pytest's tmp_path is long."""
    parent = tempfile.mkdtemp(prefix="extkv-budget-")
    try:
        yield os.path.join(parent, "run")
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def _serve_in_child(run_dir: str, budget: int, ready, log_path: str | None = None, device: str = "host") -> None:
    """A daemon child's life: start, say where it listens (or why it could
    not), serve until killed; its log lines appended to `log_path`, if given."""
    try:
        # Line-buffered: each line is written as it is logged.
        log_file = None if log_path is None else open(log_path, "a", buffering=1)
        log = None if log_file is None else (lambda line: log_file.write(line + "\n"))
        daemon = BudgetDaemon(open_device(device), budget, run_dir=run_dir, log=log)
        daemon.start()
    except Exception as error:  # noqa: BLE001 - handed to the parent, which raises it
        ready.send(("failed", f"{type(error).__name__}: {error}"))
        return
    ready.send(("serving", daemon.socket_path))
    ready.close()
    daemon.serve_forever()


class DaemonProcess:
    """A daemon of `device` ("host", or a GPU's UUID) serving from a child
    process: `path` its socket, `pid` the child's; its log lines appended
    to `log_path`, if given."""

    def __init__(self, run_dir: str, budget: int, log_path: str | None = None, device: str = "host"):
        context = fork_server()
        ready, ready_in_child = context.Pipe(duplex=False)
        self.process = context.Process(target=_serve_in_child,
                                       args=(run_dir, budget, ready_in_child, log_path, device), daemon=True)
        self.process.start()
        self.pid = self.process.pid
        ready_in_child.close()
        try:
            if not ready.poll(STOP_WAIT_S):
                raise AssertionError(f"the budget daemon's child did not start within {STOP_WAIT_S} s")
            try:
                state, self.path = ready.recv()
            except EOFError:
                self.process.join(STOP_WAIT_S)
                raise AssertionError(f"the budget daemon's child {self.pid} exited (exit code "
                                     f"{self.process.exitcode}) before it said where it serves") from None
            if state != "serving":
                raise AssertionError(f"the budget daemon's child did not start: {self.path}")
        except BaseException:
            self.kill()
            raise
        finally:
            ready.close()

    def kill(self) -> None:
        """SIGKILL the daemon and reap it: its connections end as a crash
        ends them, and its socket file stays behind, stale. Idempotent."""
        if self.process.exitcode is None:
            self.process.kill()
        self.process.join(STOP_WAIT_S)
        if self.process.exitcode is None:
            raise AssertionError(f"the budget daemon's child {self.pid} was not reaped within {STOP_WAIT_S} s")


@contextlib.contextmanager
def daemon_process(run_dir: str, budget: int, log_path: str | None = None,
                   device: str = "host") -> Iterator[DaemonProcess]:
    """A DaemonProcess of `device` with `budget` bytes in `run_dir` (logging
    to `log_path`, if given), killed on the way out."""
    served = DaemonProcess(run_dir, budget, log_path, device)
    try:
        yield served
    finally:
        served.kill()


# -- grants ------------------------------------------------------------------------
def ledger_held(client: BudgetClient) -> tuple[int, int]:
    """(held, open tickets) of `client`'s own engine, as the daemon reads its ledger."""
    report = client.report()
    (engine,) = [engine for engine in report["engines"] if engine["engine"] == report["asker"]]
    return engine["held"], engine["open_tickets"]


def check_ledger_holds(client: BudgetClient, physical_bytes: int, when: str) -> None:
    """At a quiescent point (`when`, for the message): the ledger holds
    exactly `physical_bytes` for `client`'s engine and the bytes its client
    keeps granted ahead, and no ticket is open."""
    held, open_tickets = ledger_held(client)
    ahead = client.ahead_bytes
    if (held, open_tickets) != (physical_bytes + ahead, 0):
        raise AssertionError(f"{when}: the ledger holds {held} bytes and {open_tickets} open tickets for an engine "
                             f"whose chunks hold {physical_bytes} bytes"
                             + (f" and {ahead} granted ahead" if ahead else ""))


class CancelsSeen(BudgetClient):
    """The real client, saying when it sent a cancel: `cancelled` holds the
    tickets, and `cancel_sent` is set at each."""

    def __init__(self, *args, **kwargs):
        self.cancelled: list[int] = []
        self.cancel_sent = threading.Event()
        super().__init__(*args, **kwargs)

    def cancel(self, ticket: int) -> None:
        super().cancel(ticket)
        self.cancelled.append(ticket)
        self.cancel_sent.set()


class CoveredCreates(WrappingDriver):
    """Under the budgeted driver: at each create, the engine's grant in the
    daemon's ledger (held and open tickets) must cover every byte this
    wrapper created and did not release, and this create: whether under a
    ticket or under bytes granted ahead and held. `mapped`: the bytes of
    the chunks that exist; `creates`: how many creates it saw."""

    def __init__(self, inner, client: BudgetClient):
        super().__init__(inner)
        self.client, self.mapped, self.creates = client, 0, 0

    def _create(self, size: int):
        report = self.client.report()
        (engine,) = [engine for engine in report["engines"] if engine["engine"] == report["asker"]]
        if engine["grant"] < self.mapped + size:
            raise AssertionError(f"a create of {size} bytes under a grant of {engine['grant']} bytes "
                                 f"({engine['held']} held), {self.mapped} of them created already")
        chunk = self.inner._create(size)
        self.mapped += size
        self.creates += 1
        return chunk

    def _release(self, chunk) -> None:
        self.inner._release(chunk)
        self.mapped -= chunk.size


# -- an engine killed at a step of the protocol -----------------------------------------
LAYOUT = KVCacheLayout.LBHNC
#: The child engine's blocks: several commits of a quarter each, so that a
#: defragment has chunks to join.
CHILD_BLOCKS = 400
#: Where a child engine stops, in the order an engine meets them: its lease
#: just made; a reserve granted with nothing created; a chunk created but
#: not yet confirmed; a commit confirmed; a shrink's chunks released but
#: not yet returned; a reclaim being answered; a preserving defragment's
#: scratch created.
STEPS = ("lease", "granted", "created", "confirmed", "released", "reclaim", "scratch")
#: What a child stopped at "reclaim" says once it answers reclaims.
ANSWERING_RECLAIMS = "answering reclaims"


def footprint(blocks: int) -> int:
    """The physical bytes of `blocks` committed blocks of the child's cache
    (and of a cache of the same config and layout beside it)."""
    cache = ExtensibleKVCache(config_for("full", LAYOUT), HostDriver(), LAYOUT)
    try:
        return cache.physical_bytes_for(blocks)
    finally:
        cache.free()


class StopsAt(WrappingDriver):
    """The host driver, except that at `step`, once armed, it tells the test
    where it is and waits there for its SIGKILL."""

    def __init__(self, inner, step: str, replies):
        super().__init__(inner)
        self.step, self.replies, self.armed = step, replies, False

    def reached(self, step: str) -> None:
        if step == self.step and self.armed:
            self.replies.send(step)
            while True:
                signal.pause()

    def _create(self, size: int):
        self.reached("granted")
        chunk = self.inner._create(size)
        self.reached("created")
        self.reached("scratch")
        return chunk

    def _release(self, chunk) -> None:
        self.inner._release(chunk)
        self.reached("released")


def engine_stopping_at(socket_path: str, step: str, replies) -> None:
    """A child engine: a cache under the budget that commits, shrinks,
    answers a reclaim and defragments, stopping at `step`."""
    stops = StopsAt(HostDriver(), step, replies)
    stops.armed = step in ("lease", "granted", "created")
    client = BudgetClient(socket_path, timeout=HANG_S)
    cache = ExtensibleKVCache(config_for("full", LAYOUT), stops, LAYOUT, budget=client)
    stops.reached("lease")
    for blocks in range(CHILD_BLOCKS // 4, CHILD_BLOCKS + 1, CHILD_BLOCKS // 4):
        cache.commit(blocks)
    stops.armed = True
    stops.reached("confirmed")
    if step == "reclaim":
        client.on_reclaim(lambda target_bytes: stops.reached("reclaim"))
        replies.send(ANSWERING_RECLAIMS)
        while True:
            signal.pause()
    if step == "scratch":
        cache.commit(CHILD_BLOCKS, defragment=True, preserve_contents=True)
    cache.commit(CHILD_BLOCKS // 2, shrink=True)
    raise AssertionError(f"the child engine passed {step!r} without stopping there")


@contextlib.contextmanager
def child_stopped_at(socket_path: str, step: str):
    """A child engine (`engine_stopping_at`) of the daemon at `socket_path`,
    once it said something on its pipe: yields (process, replies). For
    "reclaim" that is ANSWERING_RECLAIMS, and `step` follows once a reclaim
    reaches it; otherwise `step` itself, waiting in `replies`. The child is
    killed and reaped on the way out."""
    if step not in STEPS:
        raise ValueError(f"step must be one of {STEPS}, got {step!r}")
    context = fork_server()
    replies, replies_out = context.Pipe(duplex=False)
    process = context.Process(target=engine_stopping_at, args=(socket_path, step, replies_out), daemon=True)
    process.start()
    replies_out.close()
    try:
        assert replies.poll(HANG_S), f"the child engine did not reach {step!r} within {HANG_S} s"
        yield process, replies
    finally:
        process.kill()
        process.join(HANG_S)
        replies.close()


def sigkill(process) -> float:
    """SIGKILL `process`, reap it, and return time.monotonic() at its exit."""
    os.kill(process.pid, signal.SIGKILL)
    process.join(HANG_S)
    return time.monotonic()


def wait_for_status(path: str, condition: Callable[[dict], bool], what: str, within_s: float = HANG_S) -> dict:
    """The first status report of the daemon at `path` that meets
    `condition`, asked again at each reply (the daemon's own pace);
    AssertionError naming `what` and the last report after `within_s`."""
    end = time.monotonic() + within_s
    while not condition(report := read_status(path, HANG_S)):
        if time.monotonic() >= end:
            raise AssertionError(f"{what}: not within {within_s:g} s; the last report: {report}")
    return report


def ledger_settles(path: str, pid: int, live_bytes: Callable[[], int], exited: float,
                   within_s: float = KILL_SETTLES_S) -> dict:
    """The first status report of the daemon at `path`, asked again at each
    reply, that names no engine of process `pid`, holds no dead bytes, and
    whose grants equal `live_bytes()` (read at each report: a reserve that
    waited may be granted meanwhile); AssertionError with the numbers of the
    last report once `within_s` seconds have passed since `exited`
    (time.monotonic() at the process's exit)."""
    while True:
        report = read_status(path, HANG_S)
        pids = [engine["pid"] for engine in report["engines"]]
        expected = live_bytes()
        if pid not in pids and report["dead"] == 0 and report["granted"] == expected:
            return report
        elapsed = time.monotonic() - exited
        if elapsed > within_s:
            raise AssertionError(
                f"{elapsed:.2f} s after pid {pid} exited the ledger names pids {pids} and holds "
                f"{report['granted'] + report['dead']} bytes ({report['dead']} dead) for the live engines' {expected}")


# -- a daemon that restarted -------------------------------------------------------
def check_ledger_holds_each_cache(path: str, engines) -> dict:
    """The status report of the daemon at `path`, once it shows one live
    lease per engine of `engines` ((client, cache) pairs) and no other,
    each holding exactly its cache's physical bytes with no ticket open,
    and grants that add up to the caches' bytes. A daemon that restarted
    counts the processes it found as dead leases until their engines
    rejoin: those are asked about again, at the daemon's pace, for up to
    KILL_SETTLES_S, as a killed engine's are."""
    return check_ledger_holds_engines(path, {client.report()["asker"]: cache.physical_bytes for client, cache in engines})


def check_ledger_holds_engines(path: str, expected: dict[str, int]) -> dict:
    """`check_ledger_holds_each_cache` for engines named by the daemon's
    names for them (a client's `report()["asker"]`), each with the physical
    bytes its caches hold (`expected`): for engines in other processes,
    each read at a quiescent point of its own."""
    end = time.monotonic() + KILL_SETTLES_S
    while True:
        report = read_status(path, HANG_S)
        by_name = {engine["engine"]: engine for engine in report["engines"]}
        settling = [name for name in by_name if name not in expected and by_name[name]["lease"] == "dead"]
        if not settling or time.monotonic() >= end:
            break
    for name, physical_bytes in expected.items():
        mine = by_name.get(name)
        if mine is not None and (mine["lease"], mine["held"], mine["open_tickets"]) != ("live", physical_bytes, 0):
            raise AssertionError(f"engine {name}: the ledger holds {mine['held']} bytes under a {mine['lease']} lease "
                                 f"with {mine['open_tickets']} open tickets for a cache of {physical_bytes} bytes")
    if set(by_name) != set(expected):
        dead = {name: by_name[name]["dead"] for name in by_name if by_name[name]["lease"] == "dead"}
        raise AssertionError(f"the ledger names engines {sorted(by_name)}, expected {sorted(expected)}"
                             + (f"; dead leases' bytes {dead}" if dead else ""))
    if report["granted"] != sum(expected.values()):
        raise AssertionError(f"the ledger grants {report['granted']} bytes for caches of {sum(expected.values())} bytes")
    return report


# -- hostile peers -----------------------------------------------------------------
def check_uid_refused(served: ServedDaemon) -> None:
    """`served` was told to serve uids other than this process's: an engine
    of this uid is refused with a reason naming the socket, this uid and
    the uids served; an observer asking status is refused too; and, once
    the daemon is stopped (its ledger read with no loop beside), the ledger
    holds no engine and no byte."""
    uid, allowed = os.geteuid(), sorted(served.daemon.allowed_uids)
    try:
        client = BudgetClient(served.path, timeout=HANG_S)
    except BudgetUnavailableError as refused:
        message = str(refused)
        wanted = (served.path, f"uid {uid} is not among", str(allowed))
        if not all(words in message for words in wanted):
            raise AssertionError(f"the refusal of uid {uid} does not name {wanted}: {message}") from None
    else:
        with client:
            held = ledger_held(client)
        raise AssertionError(f"the daemon at {served.path}, told to serve uids {allowed}, served uid {uid}: "
                             f"its engine joined and held {held[0]} bytes with {held[1]} open tickets")
    try:
        report = read_status(served.path, HANG_S)
    except BudgetUnavailableError as refused:
        if "refused" not in str(refused):
            raise AssertionError(f"the observer of uid {uid} was not told it was refused: {refused}") from None
    else:
        raise AssertionError(f"the daemon at {served.path}, told to serve uids {allowed}, reported to uid {uid}: "
                             f"{len(report['engines'])} engines, {report['granted']} bytes granted")
    served.stop()
    ledger = served.daemon.ledger
    if ledger.status() or ledger.granted:
        raise AssertionError(f"refusing uid {uid} left {len(ledger.status())} engines and {ledger.granted} bytes "
                             "granted in the ledger")


#: Granules the claiming child engine holds, and those it says it returned.
CLAIM_HELD, CLAIM_RETURNED = 3, 2
#: What the claiming child says once its `returned` was answered.
RETURNED = "returned"


def engine_claiming(socket_path: str, honest: bool, replies) -> None:
    """A child engine: holds CLAIM_HELD granules as chunks of one granule
    each, then returns CLAIM_RETURNED of them, releasing them first only if
    `honest`, says so and waits for its SIGKILL."""
    driver = HostDriver()
    granule = driver.granularity
    client = BudgetClient(socket_path, timeout=HANG_S)
    ticket = client.reserve(CLAIM_HELD * granule)
    chunks = [driver.create(granule) for _ in range(CLAIM_HELD)]
    client.confirm(ticket, CLAIM_HELD * granule)
    if honest:
        for chunk in chunks[:CLAIM_RETURNED]:
            driver.release(chunk)
    # The daemon reads the process from outside as it takes the claim, before it serves another message.
    client.returned(CLAIM_RETURNED * granule)
    replies.send(RETURNED)
    while True:
        signal.pause()


@contextlib.contextmanager
def claiming_child(socket_path: str, honest: bool):
    """A child engine (`engine_claiming`) of the daemon at `socket_path`,
    once its `returned` was answered: yields the process, killed and reaped
    on the way out."""
    context = fork_server()
    replies, replies_out = context.Pipe(duplex=False)
    process = context.Process(target=engine_claiming, args=(socket_path, honest, replies_out), daemon=True)
    process.start()
    replies_out.close()
    try:
        assert replies.poll(HANG_S), f"the child engine did not return within {HANG_S} s"
        assert replies.recv() == RETURNED
        yield process
    finally:
        process.kill()
        process.join(HANG_S)
        replies.close()


def check_claimed_release_counted(served: ServedDaemon, pid: int, kept_bytes: int) -> dict:
    """The engine of process `pid`, the only one of `served`, kept
    `kept_bytes` of what it claimed to return (all it claimed, if it lied):
    the ledger holds exactly those, and the outside reading of its process
    shows them. Returns the engine's line of the status report."""
    engines = read_status(served.path, HANG_S)["engines"]
    if [engine["pid"] for engine in engines] != [pid]:
        raise AssertionError(f"the ledger names pids {[engine['pid'] for engine in engines]}, expected [{pid}]")
    (engine,) = engines
    if (engine["held"], engine["outside"]) != (kept_bytes, kept_bytes):
        raise AssertionError(f"the ledger holds {engine['held']} bytes for pid {pid}, whose process holds "
                             f"{engine['outside']} bytes read from outside and kept {kept_bytes} past its claimed release")
    return engine
