"""An engine's side of the shared KV budget: ask before creating, say what was created and given back.

Theory of operation
-------------------
`BudgetClient(socket_path, floor=, cap=, weight=)` connects to the daemon
of its device (extkv.budget.daemon) and says `hello`; from then on its
connection is the engine's lease, which the kernel ends when the process
does, however it ends. `EXTKV_BUDGET=<socket>` names the daemon for
`from_environment()`.

Requests (extkv.budget.protocol) go out under one send lock, so any thread
may call (a commit-ahead worker reserves from its own); each carries an id,
and one reader thread hands each reply to the call waiting on that id. A
call waits at most `timeout` seconds for its reply, which covers a reserve
waiting while the daemon reclaims from other engines. The socket's timeout
is set once, at connect, and bounds every send and every read once a
message has begun to arrive; the reader waits for the next message with
poll(), unbounded, until `close()` shuts the socket down.

The daemon's pushes (`reclaim`) go to a second thread, which runs the
handler given to `on_reclaim` and answers `released` with the bytes it
freed, or `cannot`; with no handler, every reclaim is answered `cannot`.
The handler shrinks the cache, which calls this client again, and a call
that waits for its reply on the reader's own thread would wait forever.
The bytes it frees reach the daemon as the cache's own `returned`
(extkv.budget.driver) before the answer, on this connection; the answer
only ends the reclaim, so no byte is given back twice.

Failing closed: once the daemon is gone (the connection ends, a send
fails, a reply is late), the client is unavailable for good, and every
`reserve` raises BudgetUnavailableError naming the socket and the cause,
so nothing grows without a grant. What the engine holds stays usable: a
`returned` with no daemon to tell is dropped, since the bytes are gone
either way and a restarted daemon counts what engines hold as they
reconnect. A late reply does not leave a ticket nobody confirms: the
client hangs up, which ends its lease and with it the ticket.

A forked child inherits the parent's socket, and with it the power to keep
the lease alive after the parent died; the child closes its copy at fork
and finds the client unavailable: the lease is the parent's.
"""

from __future__ import annotations

import math
import numbers
import os
import queue
import select
import socket
import threading
import weakref
from typing import Callable

from .. import validate
from ..errors import BudgetDeniedError, BudgetProtocolError, BudgetUnavailableError, warn_without_raising
from ..wire import Deadline, receive_message, send_message
from .protocol import FROM_DAEMON, MAX_REPLY_BYTES, PROTOCOL, validate_message

#: The environment variable that names the daemon's socket.
ENVIRONMENT_VARIABLE = "EXTKV_BUDGET"
#: `BudgetClient`'s default timeout: a reserve may wait for reclaims from
#: other engines (extkv.budget.ledger's RECLAIM_DEADLINE_S), well inside it.
DEFAULT_TIMEOUT_S = 30.0

#: Every client of this process, so a forked child can close its copies.
_CLIENTS: "weakref.WeakSet[BudgetClient]" = weakref.WeakSet()


class _Waiter:
    def __init__(self):
        self.done = threading.Event()
        self.reply: dict | None = None


def _connect(socket_path: str, timeout: float | None) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(socket_path)
    except (OSError, ValueError) as error:
        sock.close()
        raise BudgetUnavailableError(f"no budget daemon answers at {socket_path!r}: {error}") from None
    return sock


class BudgetClient:
    """One engine's lease on its device's budget (see the module's theory)."""

    def __init__(self, socket_path: str, *, floor: int = 0, cap: int | None = None, weight: float = 1.0,
                 timeout: float = DEFAULT_TIMEOUT_S):
        floor = validate.integer("floor", floor, what="bytes")
        if cap is not None:
            cap = validate.integer("cap", cap, minimum=1, what="bytes")
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not 0 < weight < math.inf:
            raise ValueError(f"weight must be a finite number > 0, got {weight!r}")
        self.timeout = validate.timeout("timeout", timeout)
        self.socket_path = os.fspath(socket_path)
        self._handler: Callable[[int], int] | None = None
        self._lock = threading.Lock()  # ids, waiters, availability
        self._send_lock = threading.Lock()
        self._waiters: dict[int, _Waiter] = {}
        self._unavailable: str | None = None
        self._reclaims: queue.SimpleQueue = queue.SimpleQueue()
        self._sock = _connect(self.socket_path, self.timeout)
        try:
            self._hello({"op": "hello", "id": 0, "protocol": PROTOCOL, "floor": floor, "cap": cap, "weight": weight})
        except BaseException:
            self._sock.close()
            raise
        self._sock.settimeout(self.timeout)  # the deadline's waits changed it; from here on it never changes
        self._next_id = 1
        self._reader = threading.Thread(target=self._read, name="extkv-budget-reader", daemon=True)
        self._worker = threading.Thread(target=self._answer_reclaims, name="extkv-budget-reclaims", daemon=True)
        self._reader.start()
        self._worker.start()
        _CLIENTS.add(self)

    def _hello(self, hello: dict) -> None:
        """Join, before any thread starts. A daemon that refuses this process
        says why and hangs up: the reason is read even where the hello could
        not be sent, since it waits in this socket's queue."""
        deadline = Deadline(self.timeout, f"hello to the budget daemon at {self.socket_path!r}")
        try:
            send_message(self._sock, hello, deadline=deadline)
        except BrokenPipeError:
            pass  # refused at once: its reason follows
        except OSError as error:
            raise BudgetUnavailableError(f"the budget daemon at {self.socket_path!r} did not take hello: {error}") from None
        try:
            reply = validate_message(receive_message(self._sock, max_bytes=MAX_REPLY_BYTES, deadline=deadline), FROM_DAEMON)
        except (OSError, ValueError) as error:
            raise BudgetUnavailableError(f"the budget daemon at {self.socket_path!r} did not answer hello: {error}") from None
        if reply["op"] == "error" and reply["id"] is None:
            raise BudgetUnavailableError(f"the budget daemon at {self.socket_path!r} refused this process: {reply['reason']}")
        if reply["op"] != "ok":
            raise self._refused("hello", reply)

    @classmethod
    def from_environment(cls) -> "BudgetClient | None":
        """A client of the daemon EXTKV_BUDGET names, or None where it is unset or empty."""
        path = os.environ.get(ENVIRONMENT_VARIABLE)
        return cls(path) if path else None

    @property
    def available(self) -> bool:
        return self._unavailable is None

    # -- the engine's calls ----------------------------------------------------
    def reserve(self, nbytes: int) -> int:
        """A ticket for `nbytes` about to be created; BudgetDeniedError (an
        OutOfMemoryError) naming the bytes and the daemon's reason, or
        BudgetUnavailableError when there is no daemon to ask."""
        nbytes = validate.integer("nbytes", nbytes, minimum=1, what="bytes")
        reply = self._request({"op": "reserve", "bytes": nbytes})
        if reply["op"] == "granted":
            return reply["ticket"]
        if reply["op"] == "denied":
            raise BudgetDeniedError(nbytes, reply["reason"])
        raise self._refused("reserve", reply)

    def confirm(self, ticket: int, created: int) -> None:
        """`created` bytes (at most the ticket's) were created; the rest goes back."""
        ticket = validate.integer("ticket", ticket, minimum=1)
        created = validate.integer("created", created, what="bytes")
        self._expect_ok("confirm", self._request({"op": "confirm", "ticket": ticket, "created": created}))

    def cancel(self, ticket: int) -> None:
        """The create the ticket was for failed: all of it goes back."""
        ticket = validate.integer("ticket", ticket, minimum=1)
        self._expect_ok("cancel", self._request({"op": "cancel", "ticket": ticket}))

    def returned(self, nbytes: int) -> None:
        """`nbytes` were given back (a shrink, a release). No reply is
        awaited; without a daemon it is dropped (see the module's theory)."""
        nbytes = validate.integer("nbytes", nbytes, what="bytes")
        try:
            self._request({"op": "returned", "bytes": nbytes}, wait=False)
        except BudgetUnavailableError:
            pass

    def on_reclaim(self, handler: Callable[[int], int] | None) -> None:
        """`handler(target_bytes)` frees what it can, toward `target_bytes`,
        and returns the bytes it freed; run on the client's own thread."""
        if handler is not None and not callable(handler):
            raise ValueError(f"handler must be a callable taking the bytes to free, or None, got {handler!r}")
        self._handler = handler

    def report(self) -> dict:
        """The daemon's `report` (extkv.budget.protocol), asked on this lease's
        own connection, so it counts everything this client sent before."""
        reply = self._request({"op": "status"})
        if reply["op"] != "report":
            raise self._refused("status", reply)
        return reply

    def headroom(self) -> int:
        """Bytes this engine could be granted now without waiting: the budget
        less every grant and dead byte, and its cap less its own grant."""
        report = self.report()
        (own,) = [engine for engine in report["engines"] if engine["engine"] == report["asker"]]
        return max(0, min(report["budget"] - report["granted"] - report["dead"], own["cap"] - own["grant"]))

    def close(self) -> None:
        """End the lease. Idempotent."""
        self._fail("the client was closed")
        for thread in (self._reader, self._worker):
            if thread is not threading.current_thread() and thread.ident is not None:
                thread.join(self.timeout)
        self._sock.close()

    def __enter__(self) -> "BudgetClient":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "available" if self.available else f"unavailable: {self._unavailable}"
        return f"BudgetClient({self.socket_path!r}, {state})"

    # -- requests and replies --------------------------------------------------
    def _unavailable_error(self) -> BudgetUnavailableError:
        return BudgetUnavailableError(f"the budget daemon at {self.socket_path!r} is unavailable ({self._unavailable}): "
                                      "growth fails closed; memory already held stays usable")

    def _request(self, message: dict, *, wait: bool = True) -> dict | None:
        op = message["op"]
        with self._lock:
            if self._unavailable is not None:
                raise self._unavailable_error()
            message["id"] = self._next_id
            self._next_id += 1
            waiter = _Waiter() if wait else None
            if waiter is not None:
                self._waiters[message["id"]] = waiter
        try:
            with self._send_lock:
                send_message(self._sock, message, what=f"a budget {op}")
        except OSError as error:  # a timeout or a hang-up
            self._fail(f"sending {op} failed: {error}")
            raise self._unavailable_error() from None
        if waiter is None:
            return None
        if not waiter.done.wait(self.timeout):
            self._fail(f"no reply to {op} within {self.timeout:g} s")
        if waiter.reply is None:
            raise self._unavailable_error()
        return waiter.reply

    def _refused(self, op: str, reply: dict) -> Exception:
        dropped = " (the daemon dropped the connection)" if reply.get("dropped") else ""
        return BudgetProtocolError(f"the budget daemon at {self.socket_path!r} refused {op}: {reply['reason']}{dropped}")

    def _expect_ok(self, op: str, reply: dict) -> None:
        if reply["op"] != "ok":
            raise self._refused(op, reply)

    def _fail(self, reason: str) -> None:
        """Unavailable for good: wake every waiting call and the threads."""
        with self._lock:
            if self._unavailable is not None:
                return
            self._unavailable = reason
            waiters, self._waiters = self._waiters, {}
        for waiter in waiters.values():
            waiter.done.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the reader's poll
        except OSError:
            pass
        self._reclaims.put(None)

    def _read(self) -> None:
        poller = select.poll()
        poller.register(self._sock.fileno(), select.POLLIN)
        reason = "the daemon closed the connection"
        try:
            while self._unavailable is None:
                poller.poll()
                if self._unavailable is not None:
                    return
                message = validate_message(
                    receive_message(self._sock, max_bytes=MAX_REPLY_BYTES, what="a budget daemon message"), FROM_DAEMON
                )
                if message["op"] == "reclaim":
                    self._reclaims.put(message)
                    continue
                if message["id"] is None:  # the daemon refused the connection itself
                    reason = f"the daemon refused this process: {message['reason']}"
                    return
                with self._lock:
                    waiter = self._waiters.pop(message["id"], None)
                if waiter is not None:  # None: a reply nobody waits for (returned's)
                    waiter.reply = message
                    waiter.done.set()
        except (OSError, ValueError) as error:  # the connection ended, or the daemon sent garbage
            reason = f"{type(error).__name__}: {error}"
        finally:
            self._fail(reason)

    def _answer_reclaims(self) -> None:
        while (push := self._reclaims.get()) is not None:
            handler, freed = self._handler, 0
            if handler is not None:
                try:
                    freed = validate.integer("bytes freed by the reclaim handler", handler(push["bytes"]), what="bytes")
                except Exception as error:  # the daemon hears `cannot`; the engine serves on
                    warn_without_raising(f"the budget's reclaim handler {handler!r} failed: {error!r}; answered cannot")
                    freed = 0
            answer = {"op": "released", "bytes": freed} if freed else {"op": "cannot"}
            try:
                self._request({**answer, "reclaim": push["reclaim"]}, wait=False)
            except BudgetUnavailableError:
                return


def _forget_in_child() -> None:
    """In a forked child: close the inherited sockets (never shut them down,
    which would end the parent's connection too) and fail every client."""
    for client in list(_CLIENTS):
        client._unavailable = "inherited across fork: the lease is the parent's"
        client._sock.close()


os.register_at_fork(after_in_child=_forget_in_child)


def read_status(socket_path: str, timeout: float = 10.0) -> dict:
    """The daemon's `report` (extkv.budget.protocol), asked as an observer that
    holds no lease; BudgetUnavailableError where no daemon answers."""
    deadline = Deadline(validate.timeout("timeout", timeout), f"the status of the budget daemon at {socket_path!r}")
    with _connect(socket_path, timeout) as sock:
        try:
            try:
                send_message(sock, {"op": "status", "id": 0}, deadline=deadline)
            except BrokenPipeError:
                pass  # refused at once: its reason waits in the queue
            reply = validate_message(receive_message(sock, max_bytes=MAX_REPLY_BYTES, deadline=deadline), FROM_DAEMON)
        except (OSError, ValueError) as error:
            raise BudgetUnavailableError(f"the budget daemon at {socket_path!r} did not report: {error}") from None
    if reply["op"] != "report":
        raise BudgetUnavailableError(f"the budget daemon at {socket_path!r} refused status: {reply.get('reason')}")
    return reply


def status_lines(report: dict) -> list[str]:
    """`extkv budget status`'s lines: the budget, then one per engine, each a
    run of name=value (bytes exact; `outside` is the device's own reading of
    the process, `-` where it cannot be read). `over_budget` and an engine's
    `over_cap`: bytes counted past the budget, or past its cap, which only
    engines that rejoined a restarted daemon holding more can put there."""
    counted = report["granted"] + report["dead"]
    lines = [f"budget={report['budget']} granted={report['granted']} dead={report['dead']} "
             f"free={max(0, report['budget'] - counted)} over_budget={max(0, counted - report['budget'])} "
             f"engines={len(report['engines'])} device={report['device']}"]
    for engine in report["engines"]:
        outside = "-" if engine["outside"] is None else engine["outside"]
        lines.append(
            f"pid={engine['pid']} engine={engine['engine']} lease={engine['lease']} grant={engine['grant']} "
            f"held={engine['held']} dead={engine['dead']} outside={outside} floor={engine['floor']} cap={engine['cap']} "
            f"over_cap={max(0, engine['grant'] - engine['cap'])} "
            f"weight={engine['weight']:g} open_tickets={engine['open_tickets']} "
            f"reclaim_pending={engine['reclaim_pending_bytes']} reclaims_ignored={engine['reclaims_ignored']}"
        )
    return lines
