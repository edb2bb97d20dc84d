"""The budget daemon restarts: the engines rebuild its ledger as they rejoin.

A real daemon (extkv.budget.daemon) serves the host "device" from a child
process (extkv.testing.budget.daemon_process), on a real Unix socket, and
is killed by SIGKILL as a crash would end it; a second one is started on
the same socket. Engines are real clients (extkv.budget.client) in this
process, each with a cache under its budget over the real host driver.
Nothing is mocked, and nothing waits by sleeping: each side waits on a
pipe, a client's rejoin or the daemon's status, within HANG_S, a net
against a hang.

- While the daemon is down, growth fails closed, naming the socket and the
  cause; what the caches hold stays readable and writable, and what they
  give back is told to no one. (A shrink is a release, then a commit of
  the smaller prefix, which asks the budget: it fails closed too.)
- Restarted on the same socket, it is rejoined by each engine with what its
  cache holds: the ledger holds each cache's physical bytes
  (extkv.testing.budget's check_ledger_holds_each_cache, which the planted
  rejoin-holds-nothing must fail), and growth within the budget works again.
- Restarted with a budget below what the engines hold, it counts all of it,
  says so in `extkv budget status`, and denies growth until they give back.
- A client that hangs up on a daemon that stalls rejoins it once it
  answers, and the lease it ended is not counted beside the new one; nor
  is a lease of the same process that claimed bytes it never created.
- An engine slow to rejoin (stopped as the daemon restarts) is counted from
  the restart, at what its process holds, so no other engine is granted it.
- A forked child never rejoins on its parent's lease.
"""

from __future__ import annotations

import os
import re
import signal

import pytest

from extkv import ExtensibleKVCache, KVCacheLayout
from extkv.budget.client import BudgetClient, read_status, status_lines
from extkv.budget.daemon import BudgetDaemon
from extkv.budget.device import HostDevice
from extkv.budget.journal import journal_path, start_time
from extkv.budget.journal import write as write_journal
from extkv.budget.protocol import socket_path
from extkv.errors import BudgetDeniedError, BudgetUnavailableError
from extkv.testing.budget import (
    CHILD_BLOCKS,
    check_ledger_holds,
    check_ledger_holds_each_cache,
    child_stopped_at,
    daemon_process,
    footprint,
    short_run_dir,
    wait_for_status,
)
from extkv.testing.checks import check_unchanged, snapshot
from extkv.testing.configs import config_for
from extkv.vmm import HostDriver

pytestmark = [pytest.mark.invariant(5), pytest.mark.budget_proof("restart")]

#: Safety net against a hang, never a synchronization.
HANG_S = 60
#: A client's wait for a reply where the test stalls the daemon: the stall
#: is a SIGSTOP, so no reply comes however long it waits.
STALLED_REPLY_S = 1.0
MiB = 1 << 20
#: Block-outermost: one segment, so growth comes in whole granules (2 MiB on the host driver) of 85 blocks.
LAYOUT = KVCacheLayout.BLHNC


@pytest.fixture
def run_dir():
    with short_run_dir() as run_dir:
        yield run_dir


@pytest.fixture
def engines():
    """`engine(path, **client_terms)`: (a client of the daemon at `path`, a
    cache under it); the caches are freed and the clients closed after."""
    made: list[tuple[BudgetClient, ExtensibleKVCache]] = []

    def engine(path: str, **terms) -> tuple[BudgetClient, ExtensibleKVCache]:
        client = BudgetClient(path, timeout=terms.pop("timeout", HANG_S), **terms)
        made.append((client, ExtensibleKVCache(config_for("full", LAYOUT), HostDriver(), LAYOUT, budget=client)))
        return made[-1]

    yield engine
    for client, cache in made:
        cache.free()
        client.close()


def grow_to(cache: ExtensibleKVCache, nbytes: int) -> None:
    cache.commit(cache.blocks_within(nbytes))


def shrink_to(cache: ExtensibleKVCache, nbytes: int) -> None:
    cache.commit(cache.blocks_within(nbytes), shrink=True)


def status_fields(path: str) -> list[dict[str, str]]:
    """`extkv budget status`'s lines, each as its name=value pairs."""
    return [dict(pair.split("=", 1) for pair in line.split()) for line in status_lines(read_status(path, HANG_S))]


def test_growth_fails_closed_while_the_daemon_is_down_and_engines_rejoin_it_restarted(run_dir, engines):
    with daemon_process(run_dir, 16 * MiB) as daemon:
        path = daemon.path
        first, second = engines(path), engines(path)
        grow_to(first[1], 4 * MiB)
        grow_to(second[1], 6 * MiB)
        check_ledger_holds_each_cache(path, [first, second])
        first[1].buffer.segment_view(0)[:4096].fill_(7)
    # SIGKILLed: the caches hold what they held, and nothing grants more.
    before = snapshot(first[1])
    with pytest.raises(BudgetUnavailableError) as gone:
        grow_to(first[1], 8 * MiB)
    assert re.search(rf"the budget daemon at {re.escape(repr(path))} is unavailable \(.+\): growth fails closed",
                     str(gone.value)), str(gone.value)
    assert not first[0].available
    check_unchanged(first[1], before)
    held = first[1].buffer.segment_view(0)[:4096]
    assert int(held.sum()) == 7 * 4096, "what the cache held is readable"
    held.fill_(3)
    assert int(held.sum()) == 3 * 4096, "and writable"
    second[1].release_physical()  # given back while down: told to no daemon, and no rejoin counts it

    with daemon_process(run_dir, 16 * MiB) as daemon:
        assert daemon.path == path
        for client, _ in (first, second):
            assert client.wait_available(HANG_S), f"{client} did not rejoin within {HANG_S} s"
        check_ledger_holds_each_cache(path, [first, second])
        grow_to(first[1], 8 * MiB)
        second[1].recommit()  # 8 + 6 of 16: granted again
        report = check_ledger_holds_each_cache(path, [first, second])
        assert report["granted"] == 14 * MiB


def test_bytes_granted_ahead_end_with_the_connection_and_a_rejoin_holds_the_chunks_alone(run_dir, engines):
    """A client keeping bytes ahead (held by the daemon that granted them)
    drops them when its connection ends, so growth fails closed as without
    them, and its rejoin says it holds its chunks alone."""
    ahead = 8 * MiB
    with daemon_process(run_dir, 64 * MiB) as daemon:
        path = daemon.path
        client, cache = engines(path, ahead=ahead)
        grow_to(cache, 4 * MiB)
        assert client.ahead_bytes == ahead
        check_ledger_holds(client, cache.physical_bytes, "with bytes ahead")
    with pytest.raises(BudgetUnavailableError):
        client.report()  # the connection's end, seen
    assert client.ahead_bytes == 0
    before = snapshot(cache)
    with pytest.raises(BudgetUnavailableError):
        grow_to(cache, 6 * MiB)  # within what was ahead: refused all the same
    check_unchanged(cache, before)
    with daemon_process(run_dir, 64 * MiB):
        assert client.wait_available(HANG_S), f"{client} did not rejoin within {HANG_S} s"
        assert client.ahead_bytes == 0
        check_ledger_holds_each_cache(path, [(client, cache)])
        grow_to(cache, 6 * MiB)
        assert client.ahead_bytes == ahead
        check_ledger_holds(client, cache.physical_bytes, "after growth past the rejoin")


def test_a_rejoin_holding_more_than_the_budget_is_counted_and_growth_denied_until_returned(run_dir, engines):
    """Restarted with 8 MiB where the engines hold 14 (10 and 4): all 14 are
    counted, the status names 6 past the budget and 2 past the first's cap
    (the budget), and neither grows until the first gives back."""
    with daemon_process(run_dir, 32 * MiB) as daemon:
        first, second = engines(daemon.path), engines(daemon.path)
        grow_to(first[1], 10 * MiB)
        grow_to(second[1], 4 * MiB)
    with daemon_process(run_dir, 8 * MiB) as daemon:
        for client, _ in (first, second):
            assert client.wait_available(HANG_S), f"{client} did not rejoin within {HANG_S} s"
        check_ledger_holds_each_cache(daemon.path, [first, second])
        budget_line, *engine_lines = status_fields(daemon.path)
        assert (budget_line["granted"], budget_line["over_budget"], budget_line["free"]) == (
            str(14 * MiB), str(6 * MiB), "0"), budget_line
        over_cap = {line["engine"]: line["over_cap"] for line in engine_lines}
        assert over_cap == {first[0].report()["asker"]: str(2 * MiB), second[0].report()["asker"]: "0"}, engine_lines

        with pytest.raises(BudgetDeniedError, match=f"more than its cap of {8 * MiB}"):
            grow_to(first[1], 12 * MiB)
        before = snapshot(second[1])
        with pytest.raises(BudgetDeniedError, match=f"budget {8 * MiB}, granted {14 * MiB}"):
            grow_to(second[1], 6 * MiB)
        check_unchanged(second[1], before)
        check_ledger_holds_each_cache(daemon.path, [first, second])

        shrink_to(first[1], 2 * MiB)  # 2 + 4 of 8
        grow_to(second[1], 6 * MiB)
        check_ledger_holds_each_cache(daemon.path, [first, second])
        budget_line, *engine_lines = status_fields(daemon.path)
        assert budget_line["over_budget"] == "0" and {line["over_cap"] for line in engine_lines} == {"0"}


def test_a_client_that_hangs_up_on_a_stalled_daemon_rejoins_it_and_is_counted_once(run_dir, engines):
    """The daemon stops (SIGSTOP) and the client's reply is late: it hangs
    up, which ends its lease there, and rejoins once the daemon goes on.
    The ended lease's bytes are the process's, which the new lease holds:
    they must not stay counted beside it."""
    with daemon_process(run_dir, 16 * MiB) as daemon:
        engine = engines(daemon.path, timeout=STALLED_REPLY_S)
        grow_to(engine[1], 4 * MiB)
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            with pytest.raises(BudgetUnavailableError, match=f"no reply to status within {STALLED_REPLY_S:g} s"):
                engine[0].report()
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        assert engine[0].wait_available(HANG_S), f"{engine[0]} did not rejoin within {HANG_S} s"
        wait_until_no_lease_is_dead(daemon.path)
        check_ledger_holds_each_cache(daemon.path, [engine])
        # A lease that claimed bytes it never created ends: it is read gone as
        # the first was, which takes the daemon's reading of its dead leases
        # again, now that the first is forgotten: the daemon serves on.
        with BudgetClient(daemon.path, timeout=HANG_S) as claimant:
            claimant.confirm(claimant.reserve(MiB), MiB)
        wait_until_no_lease_is_dead(daemon.path)
        grow_to(engine[1], 6 * MiB)
        check_ledger_holds_each_cache(daemon.path, [engine])


def test_an_engine_slow_to_rejoin_is_counted_from_the_restart(run_dir, engines):
    """B, a child engine holding 16 MiB, is stopped (SIGSTOP) as the daemon
    restarts, so it cannot rejoin: the new daemon counts what B's process
    holds from its start, and A, which rejoined, is not granted those bytes.
    Once B goes on, it rejoins with them and nothing else stays counted."""
    held = footprint(CHILD_BLOCKS)
    with daemon_process(run_dir, held + 6 * MiB) as daemon:
        path = daemon.path
        first = engines(path)
        grow_to(first[1], 2 * MiB)
        with child_stopped_at(path, "confirmed") as (child, replies):
            assert replies.recv() == "confirmed"
            os.kill(child.pid, signal.SIGSTOP)
            try:
                daemon.kill()
                with daemon_process(run_dir, held + 6 * MiB) as restarted:
                    assert first[0].wait_available(HANG_S), f"{first[0]} did not rejoin within {HANG_S} s"
                    before = snapshot(first[1])
                    with pytest.raises(BudgetDeniedError, match=f"budget {held + 6 * MiB}, granted {2 * MiB}, dead "
                                                                f"{held}; {2 * MiB} must come back"):
                        grow_to(first[1], 8 * MiB)
                    check_unchanged(first[1], before)
                    grow_to(first[1], 6 * MiB)  # what B's bytes leave
                    os.kill(child.pid, signal.SIGCONT)
                    wait_until_no_lease_is_dead(restarted.path)
                    report = read_status(restarted.path, HANG_S)
                    holds = sorted((engine["pid"], engine["held"]) for engine in report["engines"])
                    assert holds == sorted([(os.getpid(), 6 * MiB), (child.pid, held)]), report
                    assert (report["granted"], report["dead"]) == (held + 6 * MiB, 0), report
            finally:
                os.kill(child.pid, signal.SIGCONT)


@pytest.mark.parametrize("journal", ["another process", "a FIFO", "not JSON"])
def test_a_journal_naming_no_live_engine_counts_nothing(run_dir, journal):
    """What the restarted daemon reads of its predecessor's engines can only
    add counted bytes: a pid whose start time differs (another process took
    it), a FIFO planted at the journal's path (refused without opening it:
    the start does not block) and a file that is no journal count nothing,
    and the last two are logged."""
    lines: list[str] = []
    path = socket_path(run_dir, "host")
    os.makedirs(run_dir, mode=0o700, exist_ok=True)
    cache = ExtensibleKVCache(config_for("full", LAYOUT), HostDriver(), LAYOUT)
    try:
        cache.commit(cache.blocks_within(2 * MiB))  # this process holds chunks: listed as itself, it would count
        where = journal_path(path)
        if journal == "another process":
            write_journal(where, {os.getpid(): start_time(os.getpid()) + 1})
        elif journal == "a FIFO":
            os.mkfifo(where)
        else:
            with open(where, "w") as planted:
                planted.write("{")
        with BudgetDaemon(HostDevice(), 16 * MiB, run_dir=run_dir, log=lines.append) as daemon:
            assert (daemon.ledger.dead, daemon.ledger.status()) == (0, []), daemon.ledger.status()
        ignored = [line for line in lines if line.endswith(": ignored")]
        assert len(ignored) == (journal != "another process"), lines
    finally:
        cache.free()


def wait_until_no_lease_is_dead(path: str) -> None:
    """Asked again at each reply, the daemon's own pace (it reads its dead
    leases every DEAD_LEASE_POLL_S), within HANG_S."""
    wait_for_status(path, lambda report: not report["dead"] and all(e["lease"] == "live" for e in report["engines"]),
                    "a lease that ended still counted")


def test_a_forked_child_never_rejoins_on_its_parent_s_lease(run_dir, engines):
    """A child forked while the daemon is down: once a daemon serves again,
    the parent rejoins and the child does not, nor can it grow."""
    with daemon_process(run_dir, 16 * MiB) as daemon:
        client, cache = engines(daemon.path)
        grow_to(cache, 2 * MiB)
    restarted_read, restarted_write = os.pipe()
    outcome_read, outcome_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: once told the daemon is back, report what its client does, then leave without cleanup
        try:
            os.close(restarted_write)
            os.read(restarted_read, 1)
            try:  # a cache of its own (an inherited one may not be used) under the inherited client
                ExtensibleKVCache(config_for("full", LAYOUT), HostDriver(), LAYOUT, budget=client).commit(10)
                grew = "grew"
            except BudgetUnavailableError as error:
                grew = "refused" if "the lease is the parent's" in str(error) else repr(error)
            outcome = f"{client.available} {grew}"
        except BaseException as error:  # noqa: BLE001 - any other outcome is the test's failure
            outcome = repr(error)
        os.write(outcome_write, outcome.encode()[:500])
        os._exit(0)
    os.close(restarted_read)
    os.close(outcome_write)
    try:
        with daemon_process(run_dir, 16 * MiB) as daemon:
            assert client.wait_available(HANG_S), f"{client} did not rejoin within {HANG_S} s"
            os.write(restarted_write, b"x")
            with os.fdopen(outcome_read, "rb") as pipe:
                outcome = pipe.read().decode()
            assert outcome == "False refused", f"the forked child: {outcome!r}"
            report = check_ledger_holds_each_cache(daemon.path, [(client, cache)])
            assert [engine["pid"] for engine in report["engines"]] == [os.getpid()], report
    finally:
        os.close(restarted_write)
        os.waitpid(pid, 0)
