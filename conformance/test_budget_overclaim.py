"""An engine that claims a release it did not make: the outside reading decides.

A child of the fork server reserves, creates real memfd chunks and confirms
them under a real daemon (extkv.testing.budget), then sends `returned` for
bytes it still holds. The daemon reads the process's chunks from outside
(its memfd pages, on the host driver, which reads the engine's chunks
alone) as it takes the claim, and counts what it reads: the ledger holds
every byte the child still maps (extkv.testing.budget's
check_claimed_release_counted, which the planted claimed-release-believed
must fail), and another engine is refused them. An
honest release of the same bytes is taken at its word, the reading
agreeing. The ledger's own rule is checked number by number.
"""

from __future__ import annotations

import pytest

from extkv.budget.client import BudgetClient
from extkv.budget.ledger import Ledger
from extkv.errors import BudgetDeniedError, BudgetProtocolError
from extkv.testing.budget import (
    CLAIM_HELD,
    CLAIM_RETURNED,
    HANG_S,
    check_claimed_release_counted,
    claiming_child,
    served_daemon,
)
from extkv.vmm import HostDriver

pytestmark = [pytest.mark.invariant(5), pytest.mark.budget_proof("hostile peers")]

#: The daemon's budget, in granules: room for what the child holds and one more.
BUDGET_GRANULES = CLAIM_HELD + 1


@pytest.mark.parametrize("honest", [False, True], ids=["claims a release it did not make", "honest"])
def test_the_outside_reading_decides_a_claimed_release(honest):
    granule = HostDriver().granularity
    kept = CLAIM_HELD - (CLAIM_RETURNED if honest else 0)
    with served_daemon(BUDGET_GRANULES * granule) as served, claiming_child(served.path, honest) as child:
        check_claimed_release_counted(served, child.pid, kept * granule)
        with BudgetClient(served.path, timeout=HANG_S) as other:
            free = BUDGET_GRANULES - kept
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
