"""An engine that claims a release it did not make: the outside reading decides.

A child of the fork server reserves, creates real memfd chunks and confirms
them under a real daemon (extkv.testing.budget), then sends `returned` for
bytes it still holds. The daemon reads the process's chunks from outside
(its memfd pages, on the host driver, which reads the engine's chunks
alone) as it takes the claim, and counts what it reads: the ledger holds
every byte the child still maps, and another engine is refused them. An
honest release of the same bytes is taken at its word, the reading
agreeing. The ledger's own rule is checked number by number.
"""

from __future__ import annotations

import contextlib

import pytest

from extkv.budget.client import BudgetClient, read_status
from extkv.budget.ledger import Ledger
from extkv.errors import BudgetDeniedError, BudgetProtocolError
from extkv.testing.budget import served_daemon
from extkv.testing.children import fork_server
from extkv.vmm import HostDriver

pytestmark = [pytest.mark.invariant(5), pytest.mark.budget_proof("ledger")]

#: Safety net against a hang, never a synchronization.
HANG_S = 60
#: Granules the child holds, and those it claims to return.
HELD, CLAIMED = 3, 2


def engine_claiming(socket_path: str, honest: bool, replies) -> None:
    """A child engine: holds HELD granules as chunks of one granule each,
    then returns CLAIMED of them, releasing them first only if `honest`."""
    driver = HostDriver()
    granule = driver.granularity
    client = BudgetClient(socket_path, timeout=HANG_S)
    ticket = client.reserve(HELD * granule)
    chunks = [driver.create(granule) for _ in range(HELD)]
    client.confirm(ticket, HELD * granule)
    if honest:
        for chunk in chunks[:CLAIMED]:
            driver.release(chunk)
    client.returned(CLAIMED * granule)
    replies.send("returned")
    replies.recv()  # held until the test is done with it


@contextlib.contextmanager
def claiming_child(socket_path: str, honest: bool):
    context = fork_server()
    replies_in, replies = context.Pipe()
    process = context.Process(target=engine_claiming, args=(socket_path, honest, replies), daemon=True)
    process.start()
    replies.close()
    try:
        assert replies_in.poll(HANG_S), f"the child engine did not return within {HANG_S} s"
        assert replies_in.recv() == "returned"
        yield process
    finally:
        process.kill()
        process.join(HANG_S)
        replies_in.close()


@pytest.mark.parametrize("honest", [False, True], ids=["claims a release it did not make", "honest"])
def test_the_outside_reading_decides_a_claimed_release(honest):
    granule = HostDriver().granularity
    with served_daemon(4 * granule) as served, claiming_child(served.path, honest) as child:
        (engine,) = read_status(served.path, HANG_S)["engines"]
        kept = HELD - (CLAIMED if honest else 0)
        assert (engine["pid"], engine["held"], engine["outside"]) == (child.pid, kept * granule, kept * granule), (
            f"{'an honest' if honest else 'a false'} claim of {CLAIMED} of {HELD} granules: the ledger holds "
            f"{engine['held']} bytes, the process {engine['outside']}")
        with BudgetClient(served.path, timeout=HANG_S) as other:
            free = 4 - kept
            other.cancel(other.reserve(free * granule))
            with pytest.raises(BudgetDeniedError):
                other.reserve((free + 1) * granule)
    lied = [line for line in served.log if "still holds" in line]
    assert len(lied) == (0 if honest else 1), lied


def test_the_ledger_counts_a_reading_above_the_grant_and_never_lowers_held():
    ledger = Ledger(100)
    ledger.join("a", pid=1, uid=0, floor=0, cap=None, weight=1.0, now=0.0, held=0)
    ledger.confirm("a", ledger.reserve("a", 60, 0.0).ticket, 60, 0.0)
    ticket = ledger.reserve("a", 10, 0.0).ticket  # open: its bytes may exist already
    ledger.returned("a", 50, 1.0)  # a claim: held 10, grant 20
    assert ledger.outside_reading("a", 20, 1.0) == 0  # within the grant: nothing to decide
    assert ledger.outside_reading("a", 5, 1.0) == 0  # below: a reading never lowers held
    assert ledger.outside_reading("a", 60, 1.0) == 40  # 40 of the 50 claimed are still there
    (status,) = ledger.status()
    assert (status.held, status.grant, status.overclaimed_bytes, ledger.granted) == (50, 60, 40, 60)
    ledger.cancel("a", ticket, 2.0)
    with pytest.raises(BudgetProtocolError, match="nbytes must be an int >= 0"):
        ledger.outside_reading("a", -1, 2.0)
    ledger.leave("a", 3.0)
    with pytest.raises(BudgetProtocolError, match="outside_reading: engine 'a' is dead"):
        ledger.outside_reading("a", 60, 3.0)
