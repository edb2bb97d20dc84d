"""The budget daemon and its client: the bytes of the engines on one device stay within the budget, and faults change nothing else.

A real daemon (extkv.budget.daemon) serves a host "device" from a thread of
this process, on a real Unix socket in a private directory of its own;
engines are real clients (extkv.budget.client) in this process, raw
sockets speaking the protocol by hand, and children of the fork server
(extkv.testing.children) that hold real memfd chunks, killed by SIGKILL.
Nothing is mocked, and nothing waits by sleeping: each side waits on a
pipe, a reply or the daemon's status, within HANG_S, a net against a hang.

- Accounting: two engines whose reserves sum past the budget (the second
  is denied with the numbers); confirm, cancel and returned as the status
  reports them; a reclaim answered, and one ignored (the reserve is denied
  at the deadline, naming the engine).
- Giving a reserve up (extkv.budget.client's AbandonableReserves): one
  given up before it starts is refused with nothing sent; one waiting on a
  reclaim ends at once, and the grant that comes later goes back; a ticket
  granted before the give-up stays its caller's.
- Leases: a lease ends when its connection does, by close or by SIGKILL;
  its bytes are granted again only once the outside reading of the process
  (its memfd pages, read from /proc) shows them gone.
- Faults: another uid, malformed input (an error reply, that connection
  dropped, nothing else changed), an unknown ticket or reclaim (refused,
  the connection kept), a daemon gone (reserve fails closed naming the
  socket), a stale socket (replaced only once connect is refused), a live
  one or a planted file at the path (refused without blocking), a run
  directory that is not this uid's alone.
- The command line: `extkv budget status` prints the budget and each
  engine's numbers, the outside reading among them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest

from extkv import cli
from extkv.budget import ledger
from extkv.budget.client import GIVEN_UP, AbandonableReserves, BudgetClient, read_status
from extkv.budget.daemon import BudgetDaemon
from extkv.budget.listener import DaemonRunningError
from extkv.budget.device import HostDevice, open_device
from extkv.budget.protocol import MAX_REQUEST_BYTES, PROTOCOL
from extkv.errors import BudgetDeniedError, BudgetProtocolError, BudgetUnavailableError, OutOfMemoryError
from extkv.testing.budget import (
    CancelsSeen,
    ServedDaemon,
    check_uid_refused,
    daemon_process,
    short_run_dir,
    wait_for_status,
)
from extkv.testing.children import fork_server
from extkv.vmm import HostDriver, driver_for
from extkv.wire import encode_message, receive_message, send_message

pytestmark = pytest.mark.invariant(5)

#: Safety net against a hang, never a synchronization.
HANG_S = 60
#: The budget most tests give: small numbers read well in the denials.
BUDGET = 1000


# -- the daemon and its engines ------------------------------------------------
@pytest.fixture
def run_dir():
    with short_run_dir() as run_dir:
        yield run_dir


@pytest.fixture
def serve(run_dir):
    served: list[ServedDaemon] = []

    def start(budget: int = BUDGET, allowed_uids=None) -> ServedDaemon:
        served.append(ServedDaemon(run_dir, budget, allowed_uids))
        return served[-1]

    yield start
    for one in served:
        one.stop()


@pytest.fixture
def clients():
    made: list[BudgetClient] = []

    def connect(path: str, client_class: type[BudgetClient] = BudgetClient, **kwargs) -> BudgetClient:
        made.append(client_class(path, timeout=HANG_S, **kwargs))
        return made[-1]

    yield connect
    for client in made:
        client.close()


def engines_of(report: dict) -> dict[str, dict]:
    return {engine["engine"]: engine for engine in report["engines"]}


def without_id(report: dict) -> dict:
    """A report, less the id of the request it answered."""
    return {key: value for key, value in report.items() if key != "id"}


def raw_connection(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(HANG_S)
    sock.connect(path)
    return sock


def raw_hello(sock: socket.socket) -> None:
    send_message(sock, {"op": "hello", "id": 0, "protocol": PROTOCOL, "floor": 0, "cap": None, "weight": 1.0, "held": 0})
    assert receive_message(sock) == {"op": "ok", "id": 0}


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the daemon hung up: reading ends (EOF or a reset), after any replies."""
    try:
        while data := sock.recv(1 << 16):
            del data
    except ConnectionResetError:
        pass
    return True


# -- accounting ------------------------------------------------------------------
@pytest.mark.budget_proof("ledger")
def test_reserves_past_the_budget_are_denied_naming_the_numbers(serve, clients):
    served = serve()
    first = clients(served.path, floor=600)  # at its floor: never asked to reclaim
    second = clients(served.path)
    first.confirm(first.reserve(600), 600)
    second.reserve(300)
    with pytest.raises(BudgetDeniedError) as denied:
        second.reserve(200)
    assert isinstance(denied.value, OutOfMemoryError) and denied.value.size == 200
    for words in ("200 bytes", f"budget {BUDGET}", "granted 900"):
        assert words in str(denied.value), str(denied.value)
    report = first.report()
    assert (report["budget"], report["granted"], report["dead"]) == (BUDGET, 900, 0)
    assert second.reserve(100) > 0, "what is left of the budget is granted"
    with pytest.raises(BudgetDeniedError):
        second.reserve(1)


@pytest.mark.budget_proof("ledger")
def test_confirm_cancel_and_returned_move_grant_and_held(serve, clients):
    served = serve()
    engine = clients(served.path)
    ticket = engine.reserve(500)
    mine = next(iter(engines_of(engine.report()).values()))
    assert (mine["grant"], mine["held"], mine["open_tickets"], mine["pid"]) == (500, 0, 1, os.getpid())
    engine.confirm(ticket, 300)  # the rest of the ticket goes back at once
    engine.cancel(engine.reserve(400))
    engine.returned(100)
    mine = engines_of(engine.report())[mine["engine"]]
    assert (mine["grant"], mine["held"], mine["open_tickets"]) == (200, 200, 0)
    assert engine.report()["granted"] == 200


@pytest.mark.budget_proof("ledger")
@pytest.mark.parametrize("settle, outcome", [("cancel", "granted"), ("confirm", "denied")])
def test_a_reserve_short_by_a_create_under_way_waits_for_its_settling(serve, clients, settle, outcome):
    """Another engine's create under way (its ticket open) may give bytes
    back: a reserve that only they could make room for waits, unanswered,
    until that engine's cancel (granted) or confirm of all of it (denied)."""
    served = serve()
    holder = clients(served.path, floor=600)  # at its floor: never asked to reclaim
    holder.confirm(holder.reserve(600), 600)
    creating = clients(served.path)
    ticket = creating.reserve(300)
    asker = raw_connection(served.path)
    raw_hello(asker)
    send_message(asker, {"op": "reserve", "id": 1, "bytes": 200, "ahead": 0})  # 100 must come back: the 300 in flight
    send_message(asker, {"op": "status", "id": 2})
    # One connection's messages are answered in order: the status first, so the reserve waits.
    assert receive_message(asker)["op"] == "report"
    if settle == "cancel":
        creating.cancel(ticket)
    else:
        creating.confirm(ticket, 300)
    reply = receive_message(asker)
    assert (reply["op"], reply["id"]) == (outcome, 1), reply
    if outcome == "denied":
        assert "open tickets hold 0" in reply["reason"], reply["reason"]
    asker.close()


#: A reclaim deadline no test waits out: a reserve waiting on a reclaim ends
#: by the reclaim's answer or by being given up, never by the deadline.
NEVER_S = 10 * HANG_S
#: The reclaim deadline that a test waits out: the holder answers only after
#: the denial, so nothing races it, and the test waits this long, not the
#: engines' RECLAIM_DEADLINE_S (5 s).
WAITED_OUT_S = 0.5


@pytest.mark.budget_proof("reclaim")
def test_a_reclaim_ignored_is_denied_at_the_deadline_and_one_answered_makes_room(serve, clients, monkeypatch):
    """The holder (800 of 1000) is above its share once the asker wants 300:
    asked for the 100 missing, it first answers nothing (the asker is denied
    at the deadline, naming it), then gives them back (the asker is granted,
    under a deadline no answer can miss)."""
    monkeypatch.setattr(ledger, "RECLAIM_DEADLINE_S", WAITED_OUT_S)
    served = serve()
    holder = clients(served.path)
    holder.confirm(holder.reserve(800), 800)
    asker = clients(served.path)
    holder_name, asker_name = [engine["engine"] for engine in asker.report()["engines"]]
    asked: list[int] = []
    heard, answer = threading.Event(), threading.Event()

    def stubborn(target: int) -> int:
        asked.append(target)
        heard.set()
        answer.wait(HANG_S)  # hears the reclaim, answers nothing until told
        return 0

    holder.on_reclaim(stubborn)
    try:
        with pytest.raises(BudgetDeniedError) as denied:
            asker.reserve(300)
    finally:
        answer.set()  # its late `cannot` must not pass for an answer to the next reclaim
    assert holder_name in str(denied.value) and "no answer" in str(denied.value), str(denied.value)
    # The reclaim may reach the holder after the denial on a loaded machine:
    # the next handler must not be the one to hear it.
    assert heard.wait(HANG_S), "the holder never heard the reclaim"
    report = asker.report()
    assert engines_of(report)[holder_name]["reclaims_ignored"] == 1 and report["granted"] == 800

    def give_back(target: int) -> int:
        asked.append(target)
        holder.returned(target)  # as a cache's shrink does through its budgeted driver; the answer only ends the reclaim
        return target

    holder.on_reclaim(give_back)
    monkeypatch.setattr(ledger, "RECLAIM_DEADLINE_S", NEVER_S)
    assert asker.reserve(300) > 0, "granted once the holder gave back"
    assert asked == [100, 100], asked
    report = asker.report()
    assert (engines_of(report)[holder_name]["held"], engines_of(report)[asker_name]["grant"]) == (700, 300)
    assert report["granted"] == BUDGET


# -- giving a reserve up ---------------------------------------------------------
@pytest.fixture
def held_back_reclaim(serve, clients, monkeypatch):
    """(holder, asker, asked, answer): the holder holds 800 of BUDGET and,
    asked to give back, sets `asked` and gives back what it is asked only
    once the test sets `answer`; the asker (a CancelsSeen) finds 200 free."""
    monkeypatch.setattr(ledger, "RECLAIM_DEADLINE_S", NEVER_S)
    served = serve()
    holder = clients(served.path)
    holder.confirm(holder.reserve(800), 800)
    asked, answer = threading.Event(), threading.Event()

    def give_back_when_told(target: int) -> int:
        asked.set()
        assert answer.wait(HANG_S), "the test never let the reclaim answer"
        holder.returned(target)  # as a cache's shrink does; the answer only ends the reclaim
        return target

    holder.on_reclaim(give_back_when_told)
    try:
        yield holder, clients(served.path, client_class=CancelsSeen), asked, answer
    finally:
        answer.set()


def holder_and_asker(report: dict) -> tuple[dict, dict]:
    """The lines of the two engines of `report`, which the asker asked for."""
    (holder,) = [engine for engine in report["engines"] if engine["engine"] != report["asker"]]
    (asker,) = [engine for engine in report["engines"] if engine["engine"] == report["asker"]]
    return holder, asker


@pytest.mark.budget_proof("grants")
def test_a_reserve_given_up_before_it_starts_is_refused_with_nothing_sent(held_back_reclaim):
    """Past the 200 bytes free, a reserve sent would wait on a reclaim of
    the holder: refused unsent, the asker's next request (answered after
    anything it sent before) finds no reclaim pending and nothing granted.
    Once the give-up is over, the thread's reserves are sent again."""
    _, asker, _, _ = held_back_reclaim
    reserves = AbandonableReserves()
    with reserves.abandoned(), reserves.abandonable():
        with pytest.raises(BudgetDeniedError) as refused:
            asker.reserve(300)
    assert (refused.value.reason, refused.value.size) == (GIVEN_UP, 300), str(refused.value)
    holder, mine = holder_and_asker(asker.report())
    assert (holder["reclaim_pending_bytes"], mine["grant"], mine["open_tickets"]) == (0, 0, 0), (holder, mine)
    with reserves.abandonable():
        asker.confirm(asker.reserve(200), 200)
    assert holder_and_asker(asker.report())[1]["held"] == 200


@pytest.mark.budget_proof("grants")
def test_a_reserve_waiting_on_a_reclaim_given_up_ends_at_once_and_its_grant_goes_back(held_back_reclaim):
    """The asker's reserve of 300 waits while the holder's reclaim is held
    back: given up from another thread, it raises at once, before the holder
    answers. Then the holder answers, the daemon grants the reserve, and the
    client cancels that grant: the ledger holds nothing for the asker."""
    holder, asker, asked, answer = held_back_reclaim
    reserves = AbandonableReserves()
    outcome: list[int | BaseException] = []

    def reserve() -> None:
        with reserves.abandonable():
            try:
                outcome.append(asker.reserve(300))
            except BaseException as error:  # noqa: BLE001 - compared below
                outcome.append(error)

    reserving = threading.Thread(target=reserve)
    reserving.start()
    assert asked.wait(HANG_S), "the reserve never made the daemon ask the holder"
    with reserves.abandoned():
        reserving.join(HANG_S)
    assert not reserving.is_alive(), "the reserve given up waited on for the holder's answer"
    (denied,) = outcome
    assert isinstance(denied, BudgetDeniedError) and denied.reason == GIVEN_UP, repr(denied)
    answer.set()
    assert asker.cancel_sent.wait(HANG_S), "the grant of the reserve given up was never cancelled"
    report = asker.report()
    holder_line, mine = holder_and_asker(report)
    assert len(asker.cancelled) == 1, asker.cancelled
    assert (mine["grant"], mine["held"], mine["open_tickets"]) == (0, 0, 0), mine
    assert (holder_line["held"], report["granted"]) == (700, 700), (holder_line, report["granted"])


@pytest.mark.budget_proof("grants")
def test_a_ticket_granted_before_the_give_up_stays_its_caller_s(serve, clients):
    """A give-up ends the reserves waiting as it begins, not those answered:
    a ticket granted before it is confirmed after it, no cancel is sent, and
    the ledger holds the bytes confirmed."""
    served = serve()
    asker = clients(served.path, client_class=CancelsSeen)
    reserves = AbandonableReserves()
    with reserves.abandonable():
        ticket = asker.reserve(300)
        with reserves.abandoned():
            pass
        asker.confirm(ticket, 300)
    (mine,) = asker.report()["engines"]
    assert (mine["grant"], mine["held"], mine["open_tickets"], asker.cancelled) == (300, 300, 0, []), (
        mine, asker.cancelled)


# -- leases ----------------------------------------------------------------------
def engine_holding_memory(socket_path: str, nbytes: int, commands, replies) -> None:
    """A child engine: reserves `nbytes`, creates them as one real memfd
    chunk, confirms, then does what it is told: close its client, release
    its chunk, fork a child of its own (answering its pid)."""
    driver = HostDriver()
    client = BudgetClient(socket_path, timeout=HANG_S)
    ticket = client.reserve(nbytes)
    chunk = driver.create(nbytes)
    client.confirm(ticket, nbytes)
    replies.send("holding")
    while True:
        command = commands.recv()
        if command == "close":
            client.close()
        elif command == "release":
            driver.release(chunk)
        elif command == "fork":
            grandchild = os.fork()
            if grandchild == 0:  # outlives its parent, holding what it inherited, until killed
                while True:
                    signal.pause()
            command = str(grandchild)
        replies.send(command)


@contextlib.contextmanager
def child_engine(socket_path: str, nbytes: int):
    """A child holding `nbytes` under its lease; yields (process, tell), where
    `tell(command)` returns once the child did it."""
    context = fork_server()
    commands_in, commands = context.Pipe(duplex=False)
    replies, replies_out = context.Pipe(duplex=False)
    process = context.Process(target=engine_holding_memory, args=(socket_path, nbytes, commands_in, replies_out),
                              daemon=True)
    process.start()
    commands_in.close()
    replies_out.close()

    def tell(command: str | None) -> str:
        if command is not None:
            commands.send(command)
        assert replies.poll(HANG_S), f"the child engine did not answer {command!r} within {HANG_S} s"
        return replies.recv()

    try:
        assert tell(None) == "holding"
        yield process, tell
    finally:
        process.kill()
        process.join(HANG_S)
        commands.close()
        replies.close()


@pytest.mark.budget_proof("SIGKILL")
def test_a_sigkilled_engine_s_bytes_return_once_its_memory_is_seen_gone(serve, clients):
    granule = HostDriver().granularity
    served = serve(budget=4 * granule)
    with child_engine(served.path, 3 * granule) as (child, _):
        report = read_status(served.path)
        (engine,) = report["engines"]
        assert (engine["pid"], engine["held"], engine["outside"]) == (child.pid, 3 * granule, 3 * granule), engine
        other = clients(served.path)
        with pytest.raises(BudgetDeniedError):
            other.reserve(2 * granule)
        child.kill()
        child.join(HANG_S)
        wait_for_status(served.path, lambda r: pids_of(r) == [os.getpid()] and r["dead"] == 0,
                        "the killed engine's bytes seen gone")
    other.cancel(other.reserve(4 * granule))
    assert any("lease ended" in line for line in served.log) and any("seen gone" in line for line in served.log)


def pids_of(report: dict) -> list[int]:
    return [engine["pid"] for engine in report["engines"]]


@pytest.mark.budget_proof("SIGKILL")
def test_a_closed_lease_stays_counted_while_its_memory_is_still_held(serve, clients):
    granule = HostDriver().granularity
    served = serve(budget=4 * granule)
    with child_engine(served.path, 3 * granule) as (child, tell):
        tell("close")
        report = wait_for_status(served.path, lambda r: r["dead"] > 0, "the closed lease counted dead")
        (engine,) = report["engines"]
        assert (engine["lease"], engine["dead"], engine["outside"]) == ("dead", 3 * granule, 3 * granule), engine
        other = clients(served.path)
        with pytest.raises(BudgetDeniedError) as denied:
            other.reserve(2 * granule)
        assert f"dead {3 * granule}" in str(denied.value), str(denied.value)
        tell("release")  # the child lives on, holding nothing
        wait_for_status(served.path, lambda r: r["dead"] == 0 and pids_of(r) == [os.getpid()], "the released bytes seen gone")
        assert child.is_alive()
        other.cancel(other.reserve(4 * granule))


@pytest.mark.budget_proof("SIGKILL")
def test_a_forked_child_does_not_keep_its_parent_s_lease(serve):
    """The engine forks a child that outlives it: the child's copy of the
    connection must not keep the lease alive once the engine is killed."""
    granule = HostDriver().granularity
    served = serve(budget=4 * granule)
    with child_engine(served.path, granule) as (engine, tell):
        grandchild = int(tell("fork"))
        try:
            engine.kill()
            engine.join(HANG_S)
            wait_for_status(served.path, lambda r: r["engines"] == [], "the killed engine's lease ended")
            os.kill(grandchild, 0)  # alive all along
        finally:
            os.kill(grandchild, signal.SIGKILL)


# -- faults ----------------------------------------------------------------------
def frame(payload: bytes) -> bytes:
    return struct.pack(">Q", len(payload)) + payload


#: Input no daemon may act on: each gets an error reply and its connection dropped.
MALFORMED = {
    "not JSON": frame(b"{not json"),
    "not an object": frame(b"[1, 2]"),
    "too deep": frame(b"[" * 2000 + b"]" * 2000),
    "unknown op": encode_message({"op": "steal", "id": 1}),
    "negative bytes": encode_message({"op": "reserve", "id": 1, "bytes": -5}),
    "bytes as text": encode_message({"op": "reserve", "id": 1, "bytes": "100"}),
    "bytes as a bool": encode_message({"op": "reserve", "id": 1, "bytes": True}),
    "bytes missing": encode_message({"op": "reserve", "id": 1}),
    "an unknown field": encode_message({"op": "reserve", "id": 1, "bytes": 10, "ahead": 0, "please": True}),
    "no id": encode_message({"op": "reserve", "bytes": 10}),
    "a second protocol": encode_message({"op": "hello", "id": 1, "protocol": "extkv-budget/0", "floor": 0,
                                         "cap": None, "weight": 1}),
    "held negative": encode_message({"op": "hello", "id": 1, "protocol": PROTOCOL, "floor": 0, "cap": None,
                                     "weight": 1, "held": -1}),
    "held missing": encode_message({"op": "hello", "id": 1, "protocol": PROTOCOL, "floor": 0, "cap": None,
                                    "weight": 1}),
    "too long": struct.pack(">Q", MAX_REQUEST_BYTES + 1) + b"{",
}


@pytest.mark.budget_proof("hostile peers")
@pytest.mark.invariant(5, 6)
@pytest.mark.parametrize("case", sorted(MALFORMED))
@pytest.mark.parametrize("joined", [True, False], ids=["after hello", "before hello"])
def test_malformed_input_is_answered_and_dropped_and_changes_nothing_else(serve, clients, case, joined):
    served = serve()
    bystander = clients(served.path)
    bystander.confirm(bystander.reserve(400), 300)
    before = without_id(bystander.report())
    with raw_connection(served.path) as sock:
        if joined:
            raw_hello(sock)
        sock.sendall(MALFORMED[case])
        reply = receive_message(sock)
        assert reply["op"] == "error" and reply["dropped"] is True, reply
        assert closed_by_peer(sock)
    assert without_id(bystander.report()) == before, f"{case}: {reply['reason']}"
    assert bystander.reserve(600) > 0, "the bystander is served on"


@pytest.mark.budget_proof("hostile peers")
@pytest.mark.invariant(5, 6)
def test_a_request_before_hello_is_dropped(serve):
    served = serve()
    with raw_connection(served.path) as sock:
        send_message(sock, {"op": "reserve", "id": 3, "bytes": 10, "ahead": 0})
        reply = receive_message(sock)
        assert (reply["op"], reply["id"], reply["dropped"]) == ("error", 3, True) and "before hello" in reply["reason"]
        assert closed_by_peer(sock)
    assert read_status(served.path)["granted"] == 0


@pytest.mark.budget_proof("hostile peers")
@pytest.mark.invariant(5, 6)
def test_an_unknown_ticket_or_reclaim_is_refused_and_the_connection_kept(serve, clients):
    served = serve()
    engine = clients(served.path)
    ticket = engine.reserve(100)
    before = without_id(engine.report())
    # The client refuses these before sending (it awaits no reply to a settle) ...
    for call in (lambda: engine.confirm(ticket + 1000, 1), lambda: engine.cancel(ticket + 1000)):
        with pytest.raises(BudgetProtocolError, match=str(ticket + 1000)):
            call()
    with pytest.raises(BudgetProtocolError, match="created must be <= the ticket's 100 bytes, got 101"):
        engine.confirm(ticket, 101)
    assert without_id(engine.report()) == before
    with raw_connection(served.path) as sock:
        raw_hello(sock)
        # ... and the daemon refuses them from a peer that sends them all the same.
        send_message(sock, {"op": "reserve", "id": 10, "bytes": 50, "ahead": 0})
        own = receive_message(sock)["ticket"]
        for number, message in enumerate(({"op": "confirm", "ticket": ticket, "created": 1},
                                          {"op": "cancel", "ticket": own + 1000},
                                          {"op": "confirm", "ticket": own, "created": 51}), start=11):
            send_message(sock, {**message, "id": number})
            reply = receive_message(sock)
            assert (reply["op"], reply["id"], reply["dropped"]) == ("error", number, False), reply
        assert "created must be <= the ticket's 50 bytes, got 51" in reply["reason"], reply
        send_message(sock, {"op": "cancel", "id": 14, "ticket": own})
        assert receive_message(sock)["op"] == "ok", "the connection was kept"
        send_message(sock, {"op": "released", "id": 1, "bytes": 10, "reclaim": 77})
        reply = receive_message(sock)
        assert (reply["op"], reply["dropped"]) == ("error", False) and "77" in reply["reason"], reply
        send_message(sock, {"op": "reserve", "id": 2, "bytes": 10, "ahead": 0})
        assert receive_message(sock)["op"] == "granted", "the connection was kept"
    engine.confirm(ticket, 100)


@pytest.mark.budget_proof("hostile peers")
@pytest.mark.invariant(5, 6)
def test_a_refusal_of_a_message_sent_without_awaiting_is_warned_of_and_the_lease_serves_on(serve, clients):
    """A confirm, a cancel and a return are sent and not awaited; the client
    checks each first, so the daemon has no reason to refuse one. Should it
    all the same (here a confirm of a ticket this client never held, sent
    past those checks), the refusal reaches no caller: the client's reader
    warns of it, nothing changes, and the lease serves on."""
    served = serve()
    engine = clients(served.path)
    before = without_id(engine.report())
    with pytest.warns(RuntimeWarning, match="refused a message this client awaited no reply to: .*12345"):
        engine._request({"op": "confirm", "ticket": 12345, "created": 1}, wait=False)
        after = without_id(engine.report())  # answered after the refusal, which the reader took first
    assert after == before
    assert engine.reserve(10) > 0, "the lease serves on"


@pytest.mark.budget_proof("hostile peers")
@pytest.mark.invariant(5, 6)
def test_another_uid_is_refused_before_anything_it_sends_is_read(serve):
    check_uid_refused(serve(allowed_uids=[os.geteuid() + 1]))


@pytest.mark.budget_proof("hostile peers")
@pytest.mark.invariant(5, 6)
def test_an_engine_gone_before_the_answer_to_its_hello_leaves_the_daemon_serving(run_dir, clients):
    """A hello read after its sender hung up: the answer cannot be sent, the
    lease ends as it begins, and the daemon goes on serving. The daemon is
    stopped (SIGSTOP) while the peer sends and closes, so it reads the hello
    only once nobody can take the answer."""
    with daemon_process(run_dir, BUDGET) as daemon:
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            with raw_connection(daemon.path) as sock:
                send_message(sock, {"op": "hello", "id": 0, "protocol": PROTOCOL, "floor": 0, "cap": None,
                                    "weight": 1.0, "held": 0})
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        report = wait_for_status(daemon.path, lambda report: not report["engines"], "the hung-up engine's lease to end")
        assert report["granted"] == 0, report
        engine = clients(daemon.path)
        assert engine.reserve(600) > 0, "an engine joining after it is served"


@pytest.mark.budget_proof("hostile peers")
def test_a_silent_engine_holds_up_no_other(serve, clients):
    served = serve()
    with raw_connection(served.path) as stalled:
        raw_hello(stalled)
        stalled.sendall(struct.pack(">Q", 100) + b'{"op": ')  # half a message, then nothing
        engine = clients(served.path)
        engine.cancel(engine.reserve(10))


@pytest.mark.budget_proof("grants")
def test_reserve_fails_closed_once_the_daemon_is_gone(serve, clients):
    served = serve()
    engine = clients(served.path)
    engine.confirm(engine.reserve(100), 100)
    served.stop()
    with pytest.raises(BudgetUnavailableError) as gone:
        engine.reserve(1)
    assert served.path in str(gone.value) and "fails closed" in str(gone.value), str(gone.value)
    engine.returned(100)  # dropped: memory already held stays usable
    with pytest.raises(BudgetUnavailableError):
        engine.reserve(1)
    with pytest.raises(BudgetUnavailableError, match=served.path):
        BudgetClient(served.path, timeout=HANG_S)


@pytest.mark.budget_proof("hostile peers")
@pytest.mark.invariant(5, 6)
def test_a_stale_socket_is_replaced_only_once_connect_is_refused(run_dir, serve):
    os.makedirs(run_dir, mode=0o700)
    path = os.path.join(run_dir, "host.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as live:
        live.bind(path)
        live.listen(1)
        bound = os.lstat(path).st_ino
        with pytest.raises(DaemonRunningError, match=path):
            BudgetDaemon(HostDevice(), BUDGET, run_dir=run_dir).start()
        assert os.lstat(path).st_ino == bound, "a live daemon's socket was replaced"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.connect(path)  # and it still answers
    # Its listener closed, the file stays: connect is refused, so it is stale.
    assert os.path.exists(path)
    served = serve()
    assert any("replaced the stale socket" in line for line in served.log)
    read_status(served.path, HANG_S)


@pytest.mark.budget_proof("hostile peers")
@pytest.mark.invariant(5, 6)
def test_a_live_daemon_with_a_full_backlog_is_not_replaced_and_does_not_block_the_start(run_dir):
    os.makedirs(run_dir, mode=0o700)
    path = os.path.join(run_dir, "host.sock")
    with contextlib.ExitStack() as stack:
        live = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
        live.bind(path)
        live.listen(0)
        while True:  # fill the backlog: the next connect would block
            waiting = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
            waiting.setblocking(False)
            try:
                waiting.connect(path)
            except BlockingIOError:
                break
        outcome = run_bounded(lambda: BudgetDaemon(HostDevice(), BUDGET, run_dir=run_dir).start())
        assert isinstance(outcome, DaemonRunningError), outcome


def run_bounded(call):
    """What `call` raised (or returned), from a thread given HANG_S: a call
    that blocks fails the test instead of hanging it."""
    outcome: list = []

    def run():
        try:
            outcome.append(call())
        except BaseException as error:  # noqa: BLE001 - handed to the test
            outcome.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HANG_S)
    assert not thread.is_alive(), f"the call blocked for {HANG_S} s"
    return outcome[0]


def plant(kind: str, path: str) -> str:
    """Put `kind` of file at `path`; what the refusal calls it."""
    if kind == "a regular file":
        with open(path, "w") as planted:
            planted.write("planted")
    elif kind == "a FIFO":
        os.mkfifo(path, 0o600)  # opening it to read would block until a writer came
    elif kind == "a symlink":
        os.symlink("/dev/zero", path)
    elif kind == "a directory":
        os.mkdir(path)
    return kind


@pytest.mark.budget_proof("hostile peers")
@pytest.mark.invariant(5, 6)
@pytest.mark.parametrize("kind", ["a regular file", "a FIFO", "a symlink", "a directory"])
def test_a_file_planted_at_the_socket_path_is_refused_without_blocking(run_dir, kind):
    os.makedirs(run_dir, mode=0o700)
    path = os.path.join(run_dir, "host.sock")
    plant(kind, path)
    before = os.lstat(path)
    refused = run_bounded(lambda: BudgetDaemon(HostDevice(), BUDGET, run_dir=run_dir).start())
    assert isinstance(refused, ValueError) and path in str(refused) and f"is {kind}, not a socket" in str(refused)
    after = os.lstat(path)
    assert (after.st_ino, after.st_mode, after.st_mtime_ns) == (before.st_ino, before.st_mode, before.st_mtime_ns)
    assert run_bounded(lambda: BudgetDaemon(HostDevice(), BUDGET, run_dir=run_dir).start()).args == refused.args, \
        "the lock was not given back with the refusal"


@pytest.mark.budget_proof("hostile peers")
@pytest.mark.invariant(5, 6)
def test_the_run_directory_must_be_this_uid_s_alone(run_dir):
    os.makedirs(run_dir, mode=0o700)
    os.chmod(run_dir, 0o750)
    with pytest.raises(ValueError, match="has mode 0750, which lets group or others in"):
        BudgetDaemon(HostDevice(), BUDGET, run_dir=run_dir).start()
    os.chmod(run_dir, 0o700)
    link = run_dir + "-link"
    os.symlink(run_dir, link)
    with pytest.raises(ValueError, match="is a symlink"):
        BudgetDaemon(HostDevice(), BUDGET, run_dir=link).start()
    if os.geteuid() == 0:  # root can give it away to test the owner's check
        os.chown(run_dir, 65534, 65534)
        with pytest.raises(ValueError, match="is owned by uid 65534"):
            BudgetDaemon(HostDevice(), BUDGET, run_dir=run_dir).start()
    fresh = os.path.join(run_dir + "-new", "nested")
    daemon = BudgetDaemon(HostDevice(), BUDGET, run_dir=fresh)
    daemon.start()
    daemon.close()
    assert os.stat(fresh).st_mode & 0o777 == 0o700
    assert not os.path.exists(daemon.socket_path), "close leaves no socket behind"
    shutil.rmtree(run_dir + "-new")


@pytest.mark.budget_proof("ledger")
def test_the_daemon_imports_no_torch(run_dir):
    """The daemon starts fast and creates no CUDA context: nothing of it,
    nor the client, imports torch."""
    code = (
        "import sys\n"
        "from extkv.budget.daemon import BudgetDaemon\n"
        "from extkv.budget.device import HostDevice\n"
        "from extkv.budget.client import BudgetClient\n"
        f"daemon = BudgetDaemon(HostDevice(), 1000, run_dir={run_dir!r})\n"
        "daemon.start()\n"
        "daemon.close()\n"
        "print(sorted(name for name in sys.modules if name.split('.')[0] == 'torch'))\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=HANG_S)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout


# -- the command line ------------------------------------------------------------
@pytest.mark.budget_proof("ledger")
def test_budget_status_prints_the_budget_and_each_engine(serve, clients, capsys):
    granule = HostDriver().granularity
    served = serve(budget=8 * granule)
    engine = clients(served.path, floor=granule, cap=6 * granule, weight=2)
    engine.confirm(engine.reserve(2 * granule), 2 * granule)
    with child_engine(served.path, 3 * granule) as (child, _):
        assert cli.main(["budget", "status", "--run-dir", os.path.dirname(served.path)]) == 0
        out = capsys.readouterr().out.splitlines()
    fields = [dict(pair.split("=", 1) for pair in line.split()) for line in out]
    assert fields[0]["budget"] == str(8 * granule) and fields[0]["granted"] == str(5 * granule), out[0]
    assert fields[0]["socket"] == served.path and fields[0]["free"] == str(3 * granule), out[0]
    by_pid = {line["pid"]: line for line in fields[1:]}
    assert set(by_pid) == {str(os.getpid()), str(child.pid)}, out
    mine, theirs = by_pid[str(os.getpid())], by_pid[str(child.pid)]
    assert (mine["grant"], mine["held"], mine["floor"], mine["cap"], mine["weight"]) == (
        str(2 * granule), str(2 * granule), str(granule), str(6 * granule), "2"), mine
    assert (theirs["held"], theirs["outside"], theirs["lease"], theirs["reclaim_pending"]) == (
        str(3 * granule), str(3 * granule), "live", "0"), theirs
    assert json.dumps(read_status(served.path))  # the report is plain JSON


@pytest.mark.budget_proof("grants")
@pytest.mark.invariant(5)
def test_a_driver_names_its_device_as_the_daemon_opens_it(device):
    """`Driver.device_key()` is what `open_device` takes, and the device it
    opens carries that key: a GPU by the UUID NVML writes ("GPU-..."),
    which torch gives bare. An engine's grants come from the daemon of the
    device its driver creates on."""
    key = driver_for(device).device_key()
    assert open_device(key).key == key, key
    assert key == "host" if device.type == "cpu" else key.startswith("GPU-"), key


@pytest.mark.invariant(5, 6)
@pytest.mark.budget_proof("ledger")
@pytest.mark.parametrize("ahead", [-1, 1.5, "8", True])
def test_a_client_given_bad_bytes_ahead_raises_and_joins_nothing(serve, ahead):
    served = serve()
    with pytest.raises(ValueError, match=r"ahead must be an int >= 0 \(bytes\), got"):
        BudgetClient(served.path, timeout=HANG_S, ahead=ahead)
    assert read_status(served.path)["engines"] == []
