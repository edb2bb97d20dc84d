"""An engine's side of the shared KV budget: ask before creating, say what was created and given back.

Theory of operation
-------------------
`BudgetClient(socket_path, floor=, cap=, weight=)` connects to the daemon
of its device (extkv.budget.daemon) and says `hello`; from then on its
connection is the engine's lease, which the kernel ends when the process
does, however it ends. `EXTKV_BUDGET=<socket>` names the daemon for
`from_environment()`, and `EXTKV_BUDGET_AHEAD=<bytes>` its bytes ahead.

Requests (extkv.budget.protocol) go out under one send lock, so any thread
may call (a commit-ahead worker reserves from its own); each carries an id,
unique over the client's life, and one reader thread per connection hands
each reply to the call waiting on that id. A call waits at most `timeout`
seconds for its reply, which covers a reserve waiting while the daemon
reclaims from other engines. The socket's timeout is set once, at connect,
and bounds every send and every read once a message has begun to arrive;
the reader waits for the next message with poll(), unbounded, until the
connection ends or is shut down.

Giving a reserve up. A thread whose waiting reserve holds others up (a
commit-ahead step waits holding its cache's reservation lock) reserves
inside `AbandonableReserves.abandonable()`. Another thread, inside
`abandoned()` of the same object, gives up the reserve that thread waits on
now, and refuses every reserve it starts until the block is left: each
raises BudgetDeniedError naming the bytes, at once, and a refused one sends
nothing. The reserve given up stays awaited by the reader, which cancels
its grant as it arrives (a cancel awaits no reply, so the reader may send
it) and drops a denial: once the daemon counts the cancel it holds no byte
for it. A reply that came before the give-up is the caller's, as ever. Such
a grant is an open ticket only from its arrival to its cancel, so a rejoin
waits on it no longer than that, and one of a connection that ended meanwhile
is settled here alone, as any.

A confirm, a cancel and a `returned` await no reply: the daemon takes one
connection's messages in order, so the next request of this client is
answered with them counted, and a budgeted create waits for its grant
alone. Each reply wakes two threads of this process, the reader and the
caller, beside the daemon: on the 2-core host, a reserve and a confirm of
its ticket took p50 212-218 us, p99 268-347 us while the confirm awaited
its `ok`, and p50 76-93 us, p99 131-145 us once it did not (3,000 pairs,
three runs each). The client checks a settle before it sends it (a ticket
it holds open, a confirm within the bytes reserved), so that the daemon has
no reason to refuse it.

Bytes granted ahead. A create of a budgeted driver (extkv.budget.driver)
asks through `draw`: a client made with `ahead=B` keeps up to B bytes that
the daemon counts as held and no chunk holds yet, and a create they cover
takes them and sends nothing, so it waits for no round trip. A `draw`
they do not cover reserves its bytes and asks for B more beside them,
which the daemon grants only from room free now (extkv.budget.ledger);
after the creates `settle_draw` confirms what was created and what of the
rest it keeps, and a release (`give_back`) keeps its bytes too, while the
pool holds less than B. A reclaim takes these bytes first, before the
engine's handler is asked for the rest. They belong to the lease that
granted them: a connection's end empties the pool, so growth past what
exists fails closed as without it, and a rejoin's `held` counts the chunks
alone. With `ahead=0` (the default) every create reserves.

The daemon's pushes (`reclaim`) go to a second thread, which runs the
handler given to `on_reclaim` and answers `released` with the bytes it
freed, or `cannot`; with no handler, every reclaim is answered `cannot`.
The handler shrinks the cache, which calls this client again, and a call
that waits for its reply on the reader's own thread would wait forever.
The bytes it frees reach the daemon as the cache's own `returned`
(extkv.budget.driver) before the answer, on this connection; the answer
only ends the reclaim, so no byte is given back twice. A reclaim from a
connection that has ended is dropped unheard: the daemon that asked is gone.

Failing closed, and rejoining. When the connection ends (the daemon died
or dropped it, a send failed, a reply was late, and then the client hangs
up, which ends its lease and with it any ticket the late reply carried),
the client is disconnected: every `reserve` raises BudgetUnavailableError
naming the socket and the cause, so nothing grows without a grant, while
what the engine holds stays usable. A rejoin thread connects again to the
same socket path, at once and then after waits that double from
REJOIN_FIRST_WAIT_S up to REJOIN_MAX_WAIT_S, for as long as it takes; the
thread alone waits on a daemon that is slow to answer, never a commit.
When a daemon answers, the client says `hello` again, with the same
floor, cap and weight and with `held`: the bytes its engine holds now, the
sum of the callables given to `track_held` (each budgeted driver gives
one: its chunks' bytes, extkv.budget.driver). A restarted daemon's ledger
is rebuilt from these hellos, and it counts them even past the budget
(extkv.budget.ledger's `join`): they exist.

Held is exact only if nothing it counts changes unseen around the rejoin:

- No ticket is open. A ticket of the ended connection (a create that may
  be under way) defers the rejoin until it is confirmed or cancelled; its
  confirm or cancel goes to no daemon, since the one that granted it is
  gone or has ended the lease, and the bytes it created are in the next
  hello's held. Meanwhile no ticket is granted, so when none is open no
  create is under way.
- Each release is told to exactly one connection. Every rejoin is a lease,
  numbered; `track_held`'s callable is given the number as it reads the
  bytes, and the `returned` of each release later names the lease it was
  read under: a release before the read is in no hello and goes nowhere
  (its lease ended), one after it reaches the new daemon, after the hello.
  A `returned` that names no lease goes to the connection of the moment,
  and while there is none it is dropped: the next hello carries the truth.

A forked child inherits the parent's sockets, and with them the power to
keep the lease alive after the parent died; the child closes its copies at
fork and finds the client closed for good: the lease is the parent's, and
a child never rejoins on it. `close()` also ends the client for good.
"""

from __future__ import annotations

import contextlib
import inspect
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
#: The environment variable of `from_environment()`'s `ahead`: bytes (512MiB).
AHEAD_VARIABLE = "EXTKV_BUDGET_AHEAD"
#: `BudgetClient`'s default timeout: a reserve may wait for reclaims from
#: other engines (extkv.budget.ledger's RECLAIM_DEADLINE_S), well inside it.
DEFAULT_TIMEOUT_S = 30.0
#: The wait after the first failed rejoin; it doubles after each failure, up
#: to REJOIN_MAX_WAIT_S. A choice: a refused connect costs microseconds, so
#: the waits bound the log of failures, not any load on the daemon, and a
#: daemon that restarts is rejoined within REJOIN_MAX_WAIT_S of its start.
REJOIN_FIRST_WAIT_S = 0.05
REJOIN_MAX_WAIT_S = 1.0

#: Every client of this process, so a forked child can close its copies.
_CLIENTS: "weakref.WeakSet[BudgetClient]" = weakref.WeakSet()
#: Held while a client makes a socket and records it, and across every
#: fork: a child finds every socket its parent's clients made, to close it.
_SOCKET_BIRTH = threading.Lock()


#: Per thread, the AbandonableReserves its reserves are made under, if any.
_RESERVING = threading.local()
#: The reason of a BudgetDeniedError for a reserve given up by its caller.
GIVEN_UP = "the reserve was given up by its caller (AbandonableReserves.abandoned), not answered by the daemon"


class _Waiter:
    def __init__(self):
        self.done = threading.Event()
        self.reply: dict | None = None
        self.abandoned = False  # given up before its reply came: the reader settles the reply


class AbandonableReserves:
    """The reserves of a thread that other threads may give up (see the
    module's theory): that thread reserves inside `abandonable()`, the others
    give up inside `abandoned()`."""

    def __init__(self):
        self._lock = threading.Lock()
        self._abandoning = 0  # `abandoned()` blocks entered and not yet left
        self._waiting: dict[_Waiter, BudgetClient] = {}  # the reserves waiting now, and their clients

    @contextlib.contextmanager
    def abandonable(self):
        """While inside, the calling thread's reserves are given up by `abandoned()`."""
        outer = getattr(_RESERVING, "reserves", None)
        _RESERVING.reserves = self
        try:
            yield
        finally:
            _RESERVING.reserves = outer

    @contextlib.contextmanager
    def abandoned(self):
        """While inside, from any thread: the reserve an `abandonable()` thread
        waits on as this is entered raises BudgetDeniedError at once, and each
        it starts before the last of these blocks is left raises it with
        nothing sent. Blocks may nest and overlap."""
        with self._lock:
            self._abandoning += 1
            waiting = list(self._waiting.items())
        for waiter, client in waiting:
            client._abandon(waiter)
        try:
            yield
        finally:
            with self._lock:
                self._abandoning -= 1

    def _attach(self, waiter: _Waiter, client: "BudgetClient") -> bool:
        """Count `waiter` among the reserves waiting now; False, counting
        nothing, inside `abandoned()`."""
        with self._lock:
            if self._abandoning:
                return False
            self._waiting[waiter] = client
            return True

    def _detach(self, waiter: _Waiter) -> None:
        with self._lock:
            self._waiting.pop(waiter, None)


def _connect(socket_path: str, timeout: float | None, sock: socket.socket) -> socket.socket:
    """`sock`, a fresh AF_UNIX stream socket, connected to `socket_path`; closed and BudgetUnavailableError if not."""
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
                 timeout: float = DEFAULT_TIMEOUT_S, ahead: int = 0):
        floor = validate.integer("floor", floor, what="bytes")
        self.ahead = validate.integer("ahead", ahead, what="bytes")
        if cap is not None:
            cap = validate.integer("cap", cap, minimum=1, what="bytes")
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not 0 < weight < math.inf:
            raise ValueError(f"weight must be a finite number > 0, got {weight!r}")
        self.timeout = validate.timeout("timeout", timeout)
        self.socket_path = os.fspath(socket_path)
        self._terms = {"floor": floor, "cap": cap, "weight": weight}
        self._handler: Callable[[int], int] | None = None
        self._lock = threading.Lock()  # everything below but the sockets' traffic
        self._changed = threading.Condition(self._lock)  # the connection, the open tickets, the end
        self._send_lock = threading.Lock()
        self._next_id = 1
        self._waiters: dict[int, _Waiter] = {}
        self._holders: list[Callable[[], Callable[[int], int] | None]] = []
        self._lease = 0  # the number of the latest join, made or under way
        self._sock: socket.socket | None = None  # the latest connection that joined
        self._joining_sock: socket.socket | None = None
        self._joining = False
        self._returned_while_joining = 0
        self._connected = False
        self._open_tickets: set[int] = set()
        self._ticket_bytes: dict[int, int] = {}  # what reserve was granted, per ticket not yet settled
        # Bytes granted ahead and confirmed as held, not created: all of the
        # lease of the moment (kept only while it is live, emptied as it ends).
        self._pool = 0
        self._down: str | None = None  # why it is disconnected
        self._rejoin_failed: str | None = None
        self._closed: str | None = None  # why it is closed for good
        self._reader: threading.Thread | None = None
        self._reclaims: queue.SimpleQueue = queue.SimpleQueue()
        _CLIENTS.add(self)  # before any socket exists: a fork from here on closes the child's copies
        self._join()
        self._worker = threading.Thread(target=self._answer_reclaims, name="extkv-budget-reclaims", daemon=True)
        self._rejoiner = threading.Thread(target=self._rejoin, name="extkv-budget-rejoin", daemon=True)
        self._worker.start()
        self._rejoiner.start()

    @classmethod
    def from_environment(cls) -> "BudgetClient | None":
        """A client of the daemon EXTKV_BUDGET names, keeping the bytes
        EXTKV_BUDGET_AHEAD names granted ahead (none where it is unset or
        empty), or None where EXTKV_BUDGET is unset or empty. ValueError
        naming EXTKV_BUDGET_AHEAD where it holds no size in bytes."""
        path = os.environ.get(ENVIRONMENT_VARIABLE)
        if not path:
            return None
        text = os.environ.get(AHEAD_VARIABLE, "")
        ahead = validate.byte_size(text) if text.strip() else 0
        if ahead is None:
            raise ValueError(f"{AHEAD_VARIABLE} must be {validate.BYTE_SIZE_EXPECTED}, got {text!r}")
        return cls(path, ahead=ahead)

    @property
    def available(self) -> bool:
        """Whether the client holds a lease now (it may end at any moment)."""
        return self._connected

    def wait_available(self, timeout: float | None) -> bool:
        """Wait until the client holds a lease (at once if it does), at most
        `timeout` seconds (None: no limit); False at the timeout or once the
        client is closed for good."""
        timeout = validate.timeout("timeout", timeout)
        with self._changed:
            self._changed.wait_for(lambda: self._connected or self._closed is not None, timeout)
            return self._connected

    def track_held(self, held_bytes: Callable[[int], int]) -> int:
        """Count `held_bytes(lease)`, the bytes some part of the engine holds
        now, into every rejoin's `held`; `lease` numbers that rejoin, and the
        releases it reads from then on are returned naming it (see the
        module's theory). Returns the lease number now, which the releases
        name until the first call. A bound method is held weakly: a driver
        no one uses any longer stops counting."""
        if not callable(held_bytes):
            raise ValueError(f"held_bytes must be a callable taking a lease number, got {held_bytes!r}")
        holder = weakref.WeakMethod(held_bytes) if inspect.ismethod(held_bytes) else (lambda: held_bytes)
        with self._lock:
            self._holders.append(holder)
            return self._lease

    # -- the engine's calls ----------------------------------------------------
    def reserve(self, nbytes: int) -> int:
        """A ticket for `nbytes` about to be created; BudgetDeniedError (an
        OutOfMemoryError) naming the bytes and the daemon's reason (or
        GIVEN_UP, for a reserve given up by its caller: see
        `AbandonableReserves`), or BudgetUnavailableError when there is no
        daemon to ask."""
        return self._reserve(validate.integer("nbytes", nbytes, minimum=1, what="bytes"), 0)[0]

    def _reserve(self, nbytes: int, ahead: int) -> tuple[int, int]:
        """(ticket, bytes granted): `nbytes` and what of `ahead` the daemon granted."""
        reserves, waiter = getattr(_RESERVING, "reserves", None), _Waiter()
        if reserves is not None and not reserves._attach(waiter, self):
            raise BudgetDeniedError(nbytes, GIVEN_UP)
        try:
            reply = self._request({"op": "reserve", "bytes": nbytes, "ahead": ahead}, waiter=waiter)
        finally:
            if reserves is not None:
                reserves._detach(waiter)
        if reply is None:
            raise BudgetDeniedError(nbytes, GIVEN_UP)
        if reply["op"] == "granted":
            if not nbytes <= reply["bytes"] <= nbytes + ahead:
                raise BudgetProtocolError(f"the budget daemon at {self.socket_path!r} granted {reply['bytes']} bytes "
                                          f"for a reserve of {nbytes} and {ahead} ahead")
            with self._lock:
                self._ticket_bytes[reply["ticket"]] = reply["bytes"]
            return reply["ticket"], reply["bytes"]
        if reply["op"] == "denied":
            raise BudgetDeniedError(nbytes, reply["reason"])
        raise self._refused("reserve", reply)

    # -- bytes granted ahead ---------------------------------------------------
    @property
    def ahead_bytes(self) -> int:
        """Bytes granted ahead that the daemon counts as held and no chunk holds yet."""
        return self._pool

    def draw(self, nbytes: int) -> tuple[int | None, int, int]:
        """Bytes to create `nbytes` under, for a budgeted driver: (None,
        nbytes, lease) from the bytes granted ahead where they hold them, a
        create that asks nothing; else (ticket, granted, lease) of a reserve
        that asks up to `ahead` more. Settle it with `settle_draw`."""
        nbytes = validate.integer("nbytes", nbytes, minimum=1, what="bytes")
        with self._lock:
            lease = self._lease
            if self._connected and self._pool >= nbytes:
                self._pool -= nbytes
                return None, nbytes, lease
        ticket, granted = self._reserve(nbytes, self.ahead)
        return ticket, granted, lease

    def settle_draw(self, ticket: int | None, granted: int, created: int, lease: int) -> None:
        """After the creates of a `draw`: `created` bytes exist, and the rest
        is given back as a release's bytes are (`give_back`). A ticket's
        confirm first makes held what may be kept ahead, so that a reclaim's
        `returned` of those bytes always follows it on the connection."""
        unused = granted - created
        if ticket is not None:
            with self._lock:
                live = self._connected and lease == self._lease
                unused = min(unused, max(0, self.ahead - self._pool)) if live else 0
            self.confirm(ticket, created + unused)  # the rest of the ticket goes back with it
        if unused:
            self.give_back(unused, lease)

    def give_back(self, nbytes: int, lease: int) -> None:
        """`nbytes` released, read under `lease`, for a budgeted driver: up to
        `ahead` of them (less those kept) stay granted ahead for the next
        growth, held, and the rest are `returned`."""
        with self._lock:
            live = self._connected and lease == self._lease
            kept = min(nbytes, max(0, self.ahead - self._pool)) if live else 0
            self._pool += kept
        if nbytes - kept:
            self.returned(nbytes - kept, lease)

    def confirm(self, ticket: int, created: int) -> None:
        """`created` bytes (at most the ticket's) were created; the rest goes
        back. Sent, not awaited (see the module's theory); BudgetProtocolError,
        nothing sent, for a ticket this client holds no longer (or never
        did) or `created` past the bytes it reserved. A ticket of a
        connection that ended is settled here alone."""
        ticket = validate.integer("ticket", ticket, minimum=1)
        created = validate.integer("created", created, what="bytes")
        self._settle({"op": "confirm", "ticket": ticket, "created": created})

    def cancel(self, ticket: int) -> None:
        """The create the ticket was for failed: all of it goes back. Sent
        and checked as `confirm` is."""
        ticket = validate.integer("ticket", ticket, minimum=1)
        self._settle({"op": "cancel", "ticket": ticket})

    def returned(self, nbytes: int, lease: int | None = None) -> None:
        """`nbytes` were given back (a shrink, a release), read under `lease`
        (a number `track_held` gave; None: the connection of the moment). No
        reply is awaited; one the daemon of `lease` cannot hear is dropped
        (see the module's theory)."""
        nbytes = validate.integer("nbytes", nbytes, what="bytes")
        if lease is not None:
            lease = validate.integer("lease", lease, what="a lease number")
        with self._lock:
            if self._joining and lease == self._lease:  # read after this join's hello: told once it is answered
                self._returned_while_joining += nbytes
                return
        try:
            self._request({"op": "returned", "bytes": nbytes}, wait=False, lease=lease)
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
        """End the lease, and with it the client for good. Idempotent."""
        with self._changed:
            self._closed = self._closed or "the client was closed"
            self._changed.notify_all()
            sockets = [sock for sock in (self._sock, self._joining_sock) if sock is not None]
        self._disconnect(self._lease, "the client was closed")
        for sock in sockets:  # wakes the reader's poll, and a join waiting for its hello's answer
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._reclaims.put(None)
        for thread in (self._reader, self._worker, self._rejoiner):
            if thread is not None and thread is not threading.current_thread() and thread.ident is not None:
                thread.join(self.timeout)
        for sock in sockets:
            sock.close()

    def __enter__(self) -> "BudgetClient":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        failed = f"; the last rejoin: {self._rejoin_failed}" if self._rejoin_failed and not self._closed else ""
        state = "available" if self._connected else f"unavailable: {self._closed or self._down}{failed}"
        return f"BudgetClient({self.socket_path!r}, {state})"

    # -- joining ---------------------------------------------------------------
    def _join(self) -> None:
        """Connect and say hello, as the next lease number; on success the
        connection is the client's and its reader runs. BudgetUnavailableError
        (no daemon, or it refused this process), BudgetProtocolError (it
        refused the hello) or what a `track_held` callable raised otherwise."""
        with self._lock:
            if self._closed is not None:
                raise self._unavailable_error()
            self._lease += 1
            self._pool = 0  # granted ahead under a lease that ended: the new one's hello counts chunks alone
            lease, self._joining, self._returned_while_joining = self._lease, True, 0
            self._holders = [holder for holder in self._holders if holder() is not None]
            holders = [held_bytes for holder in self._holders if (held_bytes := holder()) is not None]
        sock = None
        try:
            with _SOCKET_BIRTH:
                sock = self._joining_sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            _connect(self.socket_path, self.timeout, sock)
            held = sum(validate.integer("bytes held", held_bytes(lease), what="bytes") for held_bytes in holders)
            self._hello(sock, {"op": "hello", "id": 0, "protocol": PROTOCOL, **self._terms, "held": held})
            sock.settimeout(self.timeout)  # the deadline's waits changed it; from here on it never changes
        except BaseException:
            with self._lock:
                self._joining, self._joining_sock = False, None
            if sock is not None:
                sock.close()
            raise
        with self._changed:
            # One step from joining to joined: a `returned` of this lease is counted either way, once.
            self._joining, self._joining_sock = False, None
            if self._closed is not None:  # closed while joining: this connection was never the client's
                sock.close()
                raise self._unavailable_error()
            self._sock, self._connected, self._down, self._rejoin_failed = sock, True, None, None
            returned, self._returned_while_joining = self._returned_while_joining, 0
            self._reader = threading.Thread(target=self._read, args=(sock, lease), name="extkv-budget-reader",
                                            daemon=True)
            self._changed.notify_all()
        self._reader.start()
        if returned:
            self.returned(returned, lease)

    def _hello(self, sock: socket.socket, hello: dict) -> None:
        """Join on `sock`, before its reader starts. A daemon that refuses
        this process says why and hangs up: the reason is read even where
        the hello could not be sent, since it waits in this socket's queue."""
        deadline = Deadline(self.timeout, f"hello to the budget daemon at {self.socket_path!r}")
        try:
            send_message(sock, hello, deadline=deadline)
        except BrokenPipeError:
            pass  # refused at once: its reason follows
        except OSError as error:
            raise BudgetUnavailableError(f"the budget daemon at {self.socket_path!r} did not take hello: {error}") from None
        try:
            reply = validate_message(receive_message(sock, max_bytes=MAX_REPLY_BYTES, deadline=deadline), FROM_DAEMON)
        except (OSError, ValueError) as error:
            raise BudgetUnavailableError(f"the budget daemon at {self.socket_path!r} did not answer hello: {error}") from None
        if reply["op"] == "error" and reply["id"] is None:
            raise BudgetUnavailableError(f"the budget daemon at {self.socket_path!r} refused this process: {reply['reason']}")
        if reply["op"] != "ok":
            raise self._refused("hello", reply)

    def _rejoin(self) -> None:
        """The rejoin thread (see the module's theory): once the connection
        ended and no ticket of it is open, join again, waiting longer after
        each failure, until a daemon answers or the client is closed."""
        wait_s = 0.0
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._closed is not None or (not self._connected and not self._open_tickets))
                if self._closed is not None or self._changed.wait_for(lambda: self._closed is not None, wait_s):
                    return
            try:
                self._join()
                wait_s = 0.0
            except Exception as error:  # noqa: BLE001 - each failure is the cause a reserve names, and is tried again
                with self._lock:
                    self._rejoin_failed = f"{type(error).__name__}: {error}"
                wait_s = min(max(2 * wait_s, REJOIN_FIRST_WAIT_S), REJOIN_MAX_WAIT_S)

    # -- requests and replies --------------------------------------------------
    def _unavailable_error(self) -> BudgetUnavailableError:
        if self._closed is not None:
            return BudgetUnavailableError(f"the budget daemon at {self.socket_path!r} is unavailable ({self._closed}): "
                                          "growth fails closed; memory already held stays usable")
        failed = f"; the last rejoin: {self._rejoin_failed}" if self._rejoin_failed else ""
        return BudgetUnavailableError(f"the budget daemon at {self.socket_path!r} is unavailable ({self._down}{failed}): "
                                      "growth fails closed until the client rejoins; memory already held stays usable")

    def _request(self, message: dict, *, wait: bool = True, lease: int | None = None,
                 waiter: _Waiter | None = None) -> dict | None:
        """Send `message` on the connection of the moment (which must be that
        of `lease`, if given) and return its reply (None if not `wait`, or
        if `waiter`, the caller's own, was given up: see `_abandon`);
        BudgetUnavailableError where there is none, or it ends first."""
        op = message["op"]
        with self._lock:
            if not self._connected or (lease is not None and lease != self._lease):
                raise self._unavailable_error()
            if waiter is not None and waiter.abandoned:  # given up before it was sent
                return None
            sock, lease = self._sock, self._lease
            message["id"] = self._next_id
            self._next_id += 1
            waiter = (waiter or _Waiter()) if wait else None
            if waiter is not None:
                self._waiters[message["id"]] = waiter
        try:
            with self._send_lock:
                send_message(sock, message, what=f"a budget {op}")
        except OSError as error:  # a timeout or a hang-up
            self._disconnect(lease, f"sending {op} failed: {error}")
            raise self._unavailable_error() from None
        if waiter is None:
            return None
        if not waiter.done.wait(self.timeout):
            self._disconnect(lease, f"no reply to {op} within {self.timeout:g} s")
        with self._lock:  # a reply is given under it: one that came as the wait ended is taken, not lost
            reply, abandoned = waiter.reply, waiter.abandoned
        if abandoned:
            return None
        if reply is None:
            raise self._unavailable_error()
        return reply

    def _abandon(self, waiter: _Waiter) -> None:
        """Give up `waiter`'s wait, unless its reply came first: its caller
        returns at once, and the reader settles the reply (`_read`)."""
        with self._lock:
            if waiter.reply is None:
                waiter.abandoned = True
                waiter.done.set()

    def _settle(self, message: dict) -> None:
        """Confirm or cancel a ticket, awaiting no reply: a create waits for
        its grant, never for the daemon to hear what it created. The daemon
        takes a connection's messages in order, so whatever this client asks
        next (a reserve, a report) is answered with the settle counted. So
        that the daemon has no reason to refuse it, the ticket is checked
        here first: one this client holds open, and a confirm of at most the
        bytes it reserved (BudgetProtocolError naming the value, nothing
        sent). A refusal all the same (a ticket that outlived its time to
        live) comes back to no caller, and is warned of. One of a connection
        that ended is settled here alone: the daemon that granted it is gone
        or has ended the lease, and the rejoin's held counts what it
        created."""
        op, ticket = message["op"], message["ticket"]
        with self._changed:
            if ticket not in self._open_tickets:
                raise BudgetProtocolError(f"{op}: ticket must be one of this client's open tickets "
                                          f"{sorted(self._open_tickets)}, got {ticket} (settled, or never granted)")
            reserved = self._ticket_bytes.get(ticket)
            if op == "confirm" and reserved is not None and message["created"] > reserved:
                raise BudgetProtocolError(f"confirm: created must be <= the ticket's {reserved} bytes, "
                                          f"got {message['created']}")
        try:
            self._request(message, wait=False)
        except BudgetUnavailableError:
            if self._closed is not None:
                raise
        with self._changed:
            self._open_tickets.discard(ticket)
            self._ticket_bytes.pop(ticket, None)
            self._changed.notify_all()

    def _refused(self, op: str, reply: dict) -> Exception:
        dropped = " (the daemon dropped the connection)" if reply.get("dropped") else ""
        return BudgetProtocolError(f"the budget daemon at {self.socket_path!r} refused {op}: {reply['reason']}{dropped}")

    def _disconnect(self, lease: int, reason: str) -> None:
        """The connection of `lease` ended, or must: wake every call waiting
        on it and its reader, and let the rejoin thread start."""
        with self._changed:
            if lease != self._lease or not self._connected:
                return
            self._connected, self._down, self._pool = False, reason, 0  # growth fails closed: nothing ahead either
            waiters, self._waiters = self._waiters, {}
            sock = self._sock
            self._changed.notify_all()
        for waiter in waiters.values():
            waiter.done.set()
        try:
            sock.shutdown(socket.SHUT_RDWR)  # wakes the reader's poll, and ends the lease of a late reply
        except OSError:
            pass

    def _read(self, sock: socket.socket, lease: int) -> None:
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        reason = "the daemon closed the connection"
        try:
            while True:
                poller.poll()
                with self._lock:
                    if lease != self._lease or not self._connected:
                        return  # disconnected by this side
                message = validate_message(
                    receive_message(sock, max_bytes=MAX_REPLY_BYTES, what="a budget daemon message"), FROM_DAEMON
                )
                if message["op"] == "reclaim":
                    self._reclaims.put((lease, message))
                    continue
                if message["id"] is None:  # the daemon refused the connection itself
                    reason = f"the daemon refused this process: {message['reason']}"
                    return
                abandoned_grant = None
                with self._lock:
                    waiter = self._waiters.pop(message["id"], None)
                    if waiter is not None:  # None: a reply nobody waits for (returned's, or one a timeout ended)
                        waiter.reply = message
                        if message["op"] == "granted":  # open until settled: a rejoin waits for it
                            self._open_tickets.add(message["ticket"])
                            if waiter.abandoned:
                                abandoned_grant = message["ticket"]
                if waiter is not None:
                    waiter.done.set()
                    if abandoned_grant is not None:  # its caller gave it up: all of it goes back
                        with contextlib.suppress(BudgetUnavailableError):  # closed meanwhile: the lease ended it
                            self.cancel(abandoned_grant)
                elif message["op"] == "error":
                    warn_without_raising(f"the budget daemon at {self.socket_path!r} refused a message this client "
                                         f"awaited no reply to: {message['reason']}")
        except (OSError, ValueError) as error:  # the connection ended, or the daemon sent garbage
            reason = f"{type(error).__name__}: {error}"
        finally:
            self._disconnect(lease, reason)
            sock.close()

    def _answer_reclaims(self) -> None:
        while (pushed := self._reclaims.get()) is not None:
            lease, push = pushed
            if not self._connected or lease != self._lease:
                continue  # asked on a connection that ended: no daemon waits for the answer
            with self._lock:  # bytes granted ahead go back first: no block moves for them
                ahead = min(self._pool, push["bytes"]) if lease == self._lease else 0
                self._pool -= ahead
            if ahead:
                self.returned(ahead, lease)
            handler, freed = self._handler, 0
            if handler is not None and push["bytes"] > ahead:
                try:
                    freed = validate.integer("bytes freed by the reclaim handler", handler(push["bytes"] - ahead),
                                             what="bytes")
                except Exception as error:  # the daemon hears `cannot`; the engine serves on
                    warn_without_raising(f"the budget's reclaim handler {handler!r} failed: {error!r}; answered cannot")
                    freed = 0
            freed += ahead
            answer = {"op": "released", "bytes": freed} if freed else {"op": "cannot"}
            try:
                self._request({**answer, "reclaim": push["reclaim"]}, wait=False, lease=lease)
            except BudgetUnavailableError:
                pass  # its connection ended meanwhile


def _before_fork() -> None:
    _SOCKET_BIRTH.acquire()


def _after_fork_in_parent() -> None:
    _SOCKET_BIRTH.release()


def _forget_in_child() -> None:
    """In a forked child: close the inherited sockets (never shut them down,
    which would end the parent's connection too) and close every client
    for good; its locks may have been held by threads the child lacks."""
    _SOCKET_BIRTH.release()
    for client in list(_CLIENTS):
        client._lock = threading.Lock()
        client._changed = threading.Condition(client._lock)
        client._send_lock = threading.Lock()
        client._closed = "inherited across fork: the lease is the parent's"
        client._connected = False
        for sock in (client._sock, client._joining_sock):
            if sock is not None:
                sock.close()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_forget_in_child)


def read_status(socket_path: str, timeout: float = 10.0) -> dict:
    """The daemon's `report` (extkv.budget.protocol), asked as an observer that
    holds no lease; BudgetUnavailableError where no daemon answers."""
    deadline = Deadline(validate.timeout("timeout", timeout), f"the status of the budget daemon at {socket_path!r}")
    with _connect(socket_path, timeout, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)) as sock:
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
