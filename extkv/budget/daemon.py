"""The budget daemon: one per device, it keeps the ledger and answers the engines.

Theory of operation
-------------------
`BudgetDaemon(device, budget)` listens on `<run dir>/<device key>.sock`
(extkv.budget.protocol) and serves every connection from one thread, one
selectors loop, with non-blocking sockets: no engine, however slowly it
sends or reads, holds up another. What arrives is framed as extkv.wire
frames every message and taken piecewise into a `MessageBuffer` (at most
MAX_REQUEST_BYTES a message); what goes out is queued per connection, and
an engine that lets more than MAX_OUTPUT_BYTES pile up unread is dropped.

Start-up (`start`) claims the socket's path (extkv.budget.listener): a run
directory of this uid's alone, one daemon per path (a lock), a stale socket
replaced only once `connect` to it is refused, a live one or anything
planted at the path refused without blocking.

A connection's first message is `hello` (an engine: its connection is its
lease from then on) or `status` (an observer). Who connected is read from
the kernel (SO_PEERCRED) at accept: a uid not in `allowed_uids` (by default
this process's own) is told why and dropped before anything it sends is
read. A message that cannot be read or is malformed
(extkv.budget.protocol.validate_message) gets `error{dropped: true}` and
its connection is dropped, which ends that engine's lease and changes
nothing else; a well-formed request the ledger refuses (an unknown ticket,
a floor past the budget) gets `error{dropped: false}` and changes nothing.

Reserves go to the ledger (extkv.budget.ledger). A WAIT sends the reclaims
it names to their engines and holds the reply; every answer, and every
call or lease end that frees bytes, runs each waiting reserve again, and
`Ledger.expire`, run at each deadline, denies those still waiting at
theirs. An engine has at most one reserve waiting: the ones it sends
meanwhile queue behind it, in order. The bytes an engine frees come as
`returned` (each release of its budgeted driver); its answer only ends the
reclaim, and an answer past the deadline ends nothing: it never passes for
the answer to a newer reclaim.

A lease ends when its connection does (the kernel closes it when the
process dies, however it dies). What it held stays counted as dead bytes
until the device's outside reading of its process (extkv.budget.device)
shows them gone, read every DEAD_LEASE_POLL_S while any lease is dead. On
the host a pidfd opened at `hello` says when the process exited (and with
it its memfds), so a process that later takes its pid is never read in its
place. A process that still lives may hold a live lease too (its client
rejoined, or it has a second client): the reading, less what its live
leases hold, is what the dead lease can still hold. A lying hello cannot
shrink what is counted by this: bytes it leaves out stay dead.

A daemon that restarts starts with an empty ledger, and engines rebuild it:
each client rejoins, saying in `hello` what its engine holds now, and the
ledger counts those bytes even past the budget or the engine's cap
(extkv.budget.ledger's `join`), since they exist; growth past either is
denied until engines give back, and the log names the excess. Engines
rejoin in their own time, so the daemon also counts, from its start, every
process its predecessor counted (extkv.budget.journal) at its outside
reading, as a dead lease (`Ledger.found`): the bytes of an engine that has
not rejoined yet are never granted to another. As the process rejoins, the
dead lease falls to its reading less what its live leases hold, to 0 on
the host; a GPU's reading counts the whole process, so there the found
lease is forgotten once the process has a live lease again, whose hello
says what it holds.

Nothing here imports torch, and no CUDA context is ever created: a GPU is
read through NVML.
"""

from __future__ import annotations

import collections
import heapq
import os
import select
import selectors
import socket
import time
from dataclasses import dataclass, field
from typing import Callable

from .. import validate
from ..errors import BudgetProtocolError
from ..wire import MessageBuffer, encode_message, peer_credentials
from . import journal
from .device import HostDevice, NvmlDevice
from .ledger import Lease, Ledger, ReclaimIgnored, ReserveDenied, Verdict
from .listener import ClaimedSocket, claim_socket
from .protocol import FROM_DAEMON, MAX_REQUEST_BYTES, TO_DAEMON, default_run_dir, socket_path, validate_message

#: How often a dead lease's process is read while any lease is dead: the
#: bytes of an engine that died are granted again within about this.
DEAD_LEASE_POLL_S = 0.02
#: How often tickets are looked at for expiry when nothing else wakes the loop.
EXPIRE_EVERY_S = 1.0
#: Connections the kernel queues before the loop accepts them (8 engines
#: starting at once, many times over).
BACKLOG = 128
#: The most one recv takes from one connection per turn of the loop.
RECEIVE_BYTES = 1 << 16
#: Reclaims past their deadline whose late answers an engine may still send
#: (and have counted) before the oldest are forgotten.
MAX_LATE_RECLAIMS = 64
#: Reserves an engine may send while one of its own waits (a thread each,
#: say); past them a reserve is refused rather than queued.
MAX_QUEUED_RESERVES = 64
#: Replies and pushes an engine may leave unread before it is dropped: some
#: thousands of replies, far past what an engine that reads lags behind.
MAX_OUTPUT_BYTES = 1 << 20


@dataclass
class _Connection:
    sock: socket.socket
    pid: int
    uid: int
    serial: int
    buffer: MessageBuffer = field(default_factory=lambda: MessageBuffer(MAX_REQUEST_BYTES))
    output: bytearray = field(default_factory=bytearray)
    engine: str | None = None
    pidfd: int | None = None
    reclaims: set[int] = field(default_factory=set)  # reclaim ids sent and not yet answered
    late_reclaims: dict[int, None] = field(default_factory=dict)  # past their deadline, an answer still taken
    waiting: int | None = None  # the ledger's wait id of its reserve that waits
    queued: collections.deque = field(default_factory=collections.deque)  # (request id, bytes, ahead) behind it
    writing: bool = False  # registered for EVENT_WRITE: replies wait for room
    closed: bool = False


@dataclass
class _Waiting:
    connection: _Connection
    request_id: int
    nbytes: int


class BudgetDaemon:
    """The daemon of one device (extkv.budget.device) with `budget` bytes for
    all engines' KV caches. `start()`, then `serve_forever()` in one thread
    until `stop()` (from any thread, or a signal handler), then `close()`."""

    def __init__(self, device: HostDevice | NvmlDevice, budget: int, *, run_dir: str | None = None, allowed_uids=None,
                 log: Callable[[str], None] | None = None):
        self.device = device
        self.ledger = Ledger(budget)
        self.run_dir = default_run_dir() if run_dir is None else os.fspath(run_dir)
        self.socket_path = socket_path(self.run_dir, device.key)
        self.allowed_uids = frozenset(
            [os.geteuid()] if allowed_uids is None
            else [validate.integer(f"allowed_uids[{i}]", uid, what="a user id") for i, uid in enumerate(allowed_uids)]
        )
        self._log = log or (lambda line: None)
        self._selector = selectors.DefaultSelector()
        self._claimed: ClaimedSocket | None = None
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_writer.setblocking(False)
        self._stopping = False
        self._connections: dict[int, _Connection] = {}  # by socket fd
        self._engines: dict[str, _Connection] = {}
        self._waits: dict[int, _Waiting] = {}
        self._dead: dict[str, tuple[int, int | None]] = {}  # engine -> (pid, pidfd)
        self._found: set[str] = set()  # dead leases of processes found at the start (`Ledger.found`)
        self._journal = journal.journal_path(self.socket_path)
        self._journaled: dict[int, int] = {}  # pid -> start time, as the journal lists them
        self._serial = 0
        self._next_expire = 0.0
        self._deadlines: list[float] = []  # a heap of the waits' deadlines, so the loop wakes at each
        self._next_dead_poll = 0.0

    # -- start and stop --------------------------------------------------------
    def start(self) -> None:
        """Claim the socket's path (extkv.budget.listener) and listen."""
        self._claimed = claim_socket(self.socket_path, backlog=BACKLOG, log=self._log)
        self._selector.register(self._claimed.listener, selectors.EVENT_READ, "listener")
        self._selector.register(self._wake_reader, selectors.EVENT_READ, "wake")
        self._count_found_processes(time.monotonic())
        self._write_journal()

    def _count_found_processes(self, now: float) -> None:
        """Count what each live process of the predecessor's journal holds,
        until it rejoins or its memory goes (see the theory)."""
        processes, ignored = journal.processes_to_count(self._journal)
        if ignored:
            self._log(ignored)
        for pid, started in processes.items():
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                continue  # gone since it was read
            # Read after the pidfd is open: a process given the pid since then fails this.
            reading = self.device.read_process(pid) if journal.start_time(pid) == started else 0
            if not reading:
                if reading is None:
                    self._log(f"process {pid}, an engine of the daemon before, cannot be read: not counted")
                os.close(pidfd)
                continue
            try:
                uid = os.stat(f"/proc/{pid}").st_uid
            except OSError:  # gone since it was read: its memory with it
                os.close(pidfd)
                continue
            engine = f"{pid}.found"
            self.ledger.found(engine, pid=pid, uid=uid, nbytes=reading, now=now)
            self._dead[engine], self._next_dead_poll = (pid, pidfd), now
            self._found.add(engine)
            self._log(f"process {pid}, an engine of the daemon before, holds {reading} bytes: counted until it "
                      "rejoins or its memory goes")

    def _write_journal(self) -> None:
        """Rewrite the journal if the processes the ledger counts changed."""
        counted = {status.pid for status in self.ledger.status()}
        processes = {pid: self._journaled[pid] if pid in self._journaled else journal.start_time(pid)
                     for pid in counted}
        processes = {pid: started for pid, started in processes.items() if started is not None}
        if processes == self._journaled:
            return
        try:
            journal.write(self._journal, processes)
        except OSError as error:
            self._log(f"the journal {self._journal} cannot be written: {error}")
            return
        self._journaled = processes

    def stop(self) -> None:
        """Make `serve_forever` return; safe from any thread or a signal handler."""
        self._stopping = True
        try:
            self._wake_writer.send(b"x")
        except (BlockingIOError, OSError):
            pass  # a wake-up is pending already, or the daemon is closed

    def close(self) -> None:
        """Close every connection and the listener, remove the socket (if it is
        still the one this daemon bound) and give up the lock. Idempotent."""
        for connection in list(self._connections.values()):
            self._close_socket(connection)
            if connection.pidfd is not None:
                os.close(connection.pidfd)
                connection.pidfd = None
        for _, pidfd in self._dead.values():
            if pidfd is not None:
                os.close(pidfd)
        self._dead.clear()
        if self._claimed is not None:
            self._selector.unregister(self._claimed.listener)
            self._claimed.close()
            self._claimed = None
        self._selector.close()
        self._wake_reader.close()
        self._wake_writer.close()

    def __enter__(self) -> "BudgetDaemon":
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- the loop --------------------------------------------------------------
    def serve_forever(self) -> None:
        while not self._stopping:
            now = time.monotonic()
            wake = min([self._next_expire] + ([self._next_dead_poll] if self._dead else []))
            for key, events in self._selector.select(max(0.0, wake - now)):
                if key.data == "listener":
                    self._accept()
                elif key.data == "wake":
                    self._wake_reader.recv(64)
                elif not key.data.closed:
                    if events & selectors.EVENT_WRITE:
                        self._flush(key.data)
                    if events & selectors.EVENT_READ and not key.data.closed:
                        self._receive(key.data)
            now = time.monotonic()
            if self._dead and now >= self._next_dead_poll:
                self._read_dead_leases(now)
            if now >= self._next_expire:
                self._expire(now)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._claimed.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as error:  # out of descriptors, say: the others are served on
                self._log(f"accept failed: {error}")
                return
            sock.setblocking(False)
            pid, uid, _ = peer_credentials(sock)
            if uid not in self.allowed_uids:
                reason = f"uid {uid} is not among the uids this budget daemon serves {sorted(self.allowed_uids)}"
                try:
                    sock.send(encode_message({"op": "error", "id": None, "reason": reason, "dropped": True}),
                              socket.MSG_NOSIGNAL)
                except OSError:
                    pass
                sock.close()
                self._log(f"refused pid {pid}: {reason}")
                continue
            self._serial += 1
            connection = _Connection(sock, pid, uid, self._serial)
            self._connections[sock.fileno()] = connection
            self._selector.register(sock, selectors.EVENT_READ, connection)

    def _receive(self, connection: _Connection) -> None:
        try:
            data = connection.sock.recv(RECEIVE_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._end(connection, "closed its connection")
            return
        while not connection.closed:
            try:
                connection.buffer.feed(data)
                data = b""
                message = connection.buffer.next_message()
            except ValueError as error:  # the framing or the JSON: nothing of it can be answered
                self._drop(connection, None, f"unreadable message: {error}")
                return
            if message is None:
                return
            self._handle(connection, message)

    def _handle(self, connection: _Connection, message: dict) -> None:
        request_id = message.get("id")
        request_id = request_id if type(request_id) is int and request_id >= 0 else None
        try:
            message = validate_message(message, TO_DAEMON)
        except BudgetProtocolError as error:
            self._drop(connection, request_id, f"malformed message: {error}")
            return
        op = message["op"]
        if connection.engine is None and op not in ("hello", "status"):
            self._drop(connection, request_id, f"{op} before hello: a connection begins with hello or status")
            return
        now = time.monotonic()
        try:
            getattr(self, f"_on_{op}")(connection, message, now)
        except BudgetProtocolError as error:
            self._reply(connection, {"op": "error", "id": request_id, "reason": str(error), "dropped": False})

    # -- requests --------------------------------------------------------------
    def _on_hello(self, connection: _Connection, message: dict, now: float) -> None:
        if connection.engine is not None:
            raise BudgetProtocolError(f"hello: this connection joined already, as engine {connection.engine!r}")
        engine = f"{connection.pid}.{connection.serial}"
        self.ledger.join(engine, pid=connection.pid, uid=connection.uid, floor=message["floor"], cap=message["cap"],
                         weight=message["weight"], now=now, held=message["held"])
        connection.engine = engine
        self._engines[engine] = connection
        try:
            connection.pidfd = os.pidfd_open(connection.pid)
        except OSError:
            connection.pidfd = None  # gone already: its lease ends with the connection it left
        if any(pid == connection.pid for pid, _ in self._dead.values()):
            self._read_dead_leases(now)  # its rejoin settles its dead leases before anything it asks next
        (status,) = [status for status in self.ledger.status() if status.engine == engine]
        past = "".join([f"; {status.over_cap} bytes past its cap" if status.over_cap else "",
                        f"; the engines are {self.ledger.over_budget} bytes past the budget, growth is denied until "
                        "they give back" if self.ledger.over_budget else ""])
        self._log(f"engine {engine} joined: floor {message['floor']}, cap {message['cap']}, weight {message['weight']}, "
                  f"holding {message['held']} bytes{past}")
        # The answer may find the peer gone: its lease then ends here, so the
        # ledger is read above, while the engine is certainly in it.
        self._reply(connection, {"op": "ok", "id": message["id"]})
        self._write_journal()

    def _on_reserve(self, connection: _Connection, message: dict, now: float) -> None:
        if connection.waiting is None:
            self._decide(connection, message["id"], message["bytes"], now, message["ahead"])
        elif len(connection.queued) < MAX_QUEUED_RESERVES:
            connection.queued.append((message["id"], message["bytes"], message["ahead"]))
        else:
            raise BudgetProtocolError(f"reserve: {len(connection.queued)} reserves of this engine wait already, "
                                      f"the most there may be ({MAX_QUEUED_RESERVES})")

    def _decide(self, connection: _Connection, request_id: int, nbytes: int, now: float, ahead: int = 0) -> None:
        decision = self.ledger.reserve(connection.engine, nbytes, now, ahead)
        if decision.verdict is Verdict.WAIT:
            connection.waiting = decision.wait
            self._waits[decision.wait] = _Waiting(connection, request_id, nbytes)
            heapq.heappush(self._deadlines, decision.deadline)
            self._next_expire = min(self._next_expire, decision.deadline)
            for reclaim in decision.reclaims:
                target = self._engines[reclaim.engine]
                target.reclaims.add(reclaim.id)
                self._reply(target, {"op": "reclaim", "reclaim": reclaim.id, "bytes": reclaim.nbytes,
                                     "deadline_s": max(0.0, reclaim.deadline - now)})
            return
        if decision.verdict is Verdict.GRANTED:
            self._reply(connection, {"op": "granted", "id": request_id, "ticket": decision.ticket,
                                     "bytes": decision.nbytes})
        else:
            self._reply(connection, {"op": "denied", "id": request_id, "reason": decision.reason})

    def _next_queued(self, connection: _Connection, now: float) -> None:
        """The reserves queued behind one that no longer waits, until one waits."""
        while connection.waiting is None and connection.queued and not connection.closed:
            request_id, nbytes, ahead = connection.queued.popleft()
            try:
                self._decide(connection, request_id, nbytes, now, ahead)
            except BudgetProtocolError as error:
                self._reply(connection, {"op": "error", "id": request_id, "reason": str(error), "dropped": False})

    def _retry_waits(self, now: float) -> None:
        """Run every waiting reserve again: bytes came back."""
        for wait, waiting in list(self._waits.items()):
            if self._waits.get(wait) is not waiting:
                continue  # answered meanwhile
            del self._waits[wait]
            waiting.connection.waiting = None
            self._decide(waiting.connection, waiting.request_id, waiting.nbytes, now)
            self._next_queued(waiting.connection, now)

    def _on_confirm(self, connection: _Connection, message: dict, now: float) -> None:
        self.ledger.confirm(connection.engine, message["ticket"], message["created"], now)
        self._reply(connection, {"op": "ok", "id": message["id"]})
        self._retry_waits(now)

    def _on_cancel(self, connection: _Connection, message: dict, now: float) -> None:
        self.ledger.cancel(connection.engine, message["ticket"], now)
        self._reply(connection, {"op": "ok", "id": message["id"]})
        self._retry_waits(now)

    def _on_returned(self, connection: _Connection, message: dict, now: float) -> None:
        self.ledger.returned(connection.engine, message["bytes"], now)
        self._reply(connection, {"op": "ok", "id": message["id"]})
        self._check_claimed_release(connection, now)
        self._retry_waits(now)

    def _check_claimed_release(self, connection: _Connection, now: float) -> None:
        """A release is claimed after its memory is gone, so the outside
        reading, taken now, shows no more than the engine's grant; where it
        shows more (and reads the engine's chunks alone), the reading decides."""
        if not self.device.reads_chunks_only:
            return
        reading = self._outside(connection.engine, connection.pid)
        if reading is None:
            return
        # The process reads as all it holds: what its other leases (a second
        # client, one that rejoined, a dead one not yet seen gone) may hold
        # is theirs.
        others = sum(status.grant + status.dead for status in self.ledger.status()
                     if status.pid == connection.pid and status.engine != connection.engine)
        added = self.ledger.outside_reading(connection.engine, max(reading - others, 0), now)
        if added:
            self._log(f"engine {connection.engine} returned {added} bytes its process still holds "
                      f"(read {reading} bytes from outside): counted as held")

    def _answered_reclaim(self, connection: _Connection, message: dict) -> bool:
        """Whether `message` answers the engine's pending reclaim (True) or
        one past its deadline (False), which the ledger no longer waits for:
        a late answer must not pass for the answer to a newer reclaim."""
        reclaim = message["reclaim"]
        if reclaim in connection.reclaims:
            connection.reclaims.discard(reclaim)
            return True
        if reclaim in connection.late_reclaims:
            del connection.late_reclaims[reclaim]
            return False
        raise BudgetProtocolError(f"{message['op']}: field 'reclaim' must name a reclaim sent to this engine and "
                                  f"not yet answered {sorted(connection.reclaims)}, got {reclaim}")

    def _on_released(self, connection: _Connection, message: dict, now: float) -> None:
        # The bytes came as `returned` before it: a late answer ends nothing and gives nothing back.
        if self._answered_reclaim(connection, message):
            self.ledger.released(connection.engine, message["bytes"], now)
        self._reply(connection, {"op": "ok", "id": message["id"]})
        self._retry_waits(now)

    def _on_cannot(self, connection: _Connection, message: dict, now: float) -> None:
        if self._answered_reclaim(connection, message):
            self.ledger.cannot(connection.engine, now)
        self._reply(connection, {"op": "ok", "id": message["id"]})
        self._retry_waits(now)

    def _on_status(self, connection: _Connection, message: dict, now: float) -> None:
        self._reply(connection, {
            "op": "report", "id": message["id"], "device": self.device.name, "budget": self.ledger.budget,
            "granted": self.ledger.granted, "dead": self.ledger.dead, "engines": self.engine_report(),
            "asker": connection.engine,  # the engine asking, None for an observer
        })

    def engine_report(self) -> list[dict]:
        """Per engine, live and dead: the ledger's numbers and the outside reading."""
        report = []
        for engine in self.ledger.status():
            report.append({
                "engine": engine.engine, "pid": engine.pid, "lease": engine.lease.value, "grant": engine.grant,
                "held": engine.held, "dead": engine.dead, "outside": self._outside(engine.engine, engine.pid),
                "floor": engine.floor, "cap": engine.cap, "weight": engine.weight,
                "open_tickets": engine.open_tickets, "reclaim_pending_bytes": engine.reclaim_pending_bytes,
                "reclaims_ignored": engine.reclaims_ignored,
            })
        return report

    # -- leases and deadlines --------------------------------------------------
    def _outside(self, engine: str, pid: int) -> int | None:
        """What the device reads for `engine`'s process; 0 once a pidfd says
        it exited, on a device whose memory dies with the process."""
        connection = self._engines.get(engine)
        pidfd = connection.pidfd if connection is not None else self._dead.get(engine, (pid, None))[1]
        if self.device.freed_at_exit and pidfd is not None and select.select([pidfd], [], [], 0)[0]:
            return 0
        return self.device.read_process(pid)

    def _read_dead_leases(self, now: float) -> None:
        dead = self.ledger.dead
        statuses = self.ledger.status()
        for engine, (pid, pidfd) in list(self._dead.items()):
            reading = self._outside(engine, pid)
            if reading is None:
                continue  # cannot be read: its bytes stay counted
            # The process reads as all it holds; what it holds under a live
            # lease of its own (a client that rejoined, a second client) is
            # counted there, not left to the dead one.
            live = [status.held for status in statuses if status.pid == pid and status.lease is Lease.LIVE]
            remaining = reading - sum(live)
            if engine in self._found and live and not self.device.reads_chunks_only:
                remaining = 0  # rejoined: its hello says what it holds, which the reading cannot tell apart
            self.ledger.seen_gone(engine, remaining, now)
            if remaining <= 0:  # the ledger forgot the lease at it: so does the loop
                del self._dead[engine]
                self._found.discard(engine)
                if pidfd is not None:
                    os.close(pidfd)
                self._log(f"engine {engine} (pid {pid}): its memory is seen gone"
                          + (", or counted under the lease it rejoined with" if live else ""))
        self._next_dead_poll = now + DEAD_LEASE_POLL_S
        if self.ledger.dead < dead:
            self._write_journal()
            self._retry_waits(now)

    def _expire(self, now: float) -> None:
        for event in self.ledger.expire(now):
            if isinstance(event, ReclaimIgnored) and event.engine in self._engines:
                target = self._engines[event.engine]
                target.reclaims.discard(event.reclaim)
                target.late_reclaims[event.reclaim] = None
                while len(target.late_reclaims) > MAX_LATE_RECLAIMS:
                    del target.late_reclaims[next(iter(target.late_reclaims))]
            if isinstance(event, ReserveDenied):
                waiting = self._waits.pop(event.wait, None)
                if waiting is not None:
                    waiting.connection.waiting = None
                    self._reply(waiting.connection, {"op": "denied", "id": waiting.request_id, "reason": event.reason})
                    self._next_queued(waiting.connection, now)
            self._log(f"expired: {event}")
        while self._deadlines and self._deadlines[0] <= now:
            heapq.heappop(self._deadlines)
        self._next_expire = min([now + EXPIRE_EVERY_S] + self._deadlines[:1])

    # -- connections -----------------------------------------------------------
    def _reply(self, connection: _Connection, message: dict) -> None:
        if connection.closed:
            return
        connection.output += encode_message(validate_message(message, FROM_DAEMON))
        if len(connection.output) > MAX_OUTPUT_BYTES:
            self._end(connection, f"left {len(connection.output)} bytes of replies unread (more than {MAX_OUTPUT_BYTES})")
            return
        self._flush(connection)

    def _flush(self, connection: _Connection) -> None:
        try:
            sent = connection.sock.send(connection.output, socket.MSG_NOSIGNAL)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as error:
            self._end(connection, f"hung up ({error.strerror})")
            return
        del connection.output[:sent]
        if bool(connection.output) != connection.writing:
            # Wait for room only while replies are left over: an epoll_ctl per reply would cost more than the reply.
            connection.writing = bool(connection.output)
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if connection.writing else 0)
            self._selector.modify(connection.sock, events, connection)

    def _drop(self, connection: _Connection, request_id: int | None, reason: str) -> None:
        """Refuse malformed input: say why, then end the connection (and its lease)."""
        self._reply(connection, {"op": "error", "id": request_id, "reason": reason, "dropped": True})
        self._end(connection, f"dropped: {reason}")

    def _end(self, connection: _Connection, why: str) -> None:
        if connection.closed:
            return
        self._close_socket(connection)
        now = time.monotonic()
        for wait in [wait for wait, waiting in self._waits.items() if waiting.connection is connection]:
            del self._waits[wait]
        engine = connection.engine
        if engine is None:
            return
        del self._engines[engine]
        self.ledger.leave(engine, now)
        if any(status.engine == engine for status in self.ledger.status()):
            self._dead[engine] = (connection.pid, connection.pidfd)
            self._next_dead_poll = now
        elif connection.pidfd is not None:
            os.close(connection.pidfd)
        self._log(f"engine {engine} (pid {connection.pid}): lease ended, {why}")
        self._write_journal()
        self._retry_waits(now)

    def _close_socket(self, connection: _Connection) -> None:
        connection.closed = True
        self._connections.pop(connection.sock.fileno(), None)
        try:
            self._selector.unregister(connection.sock)
        except (KeyError, ValueError):
            pass
        connection.sock.close()
