"""An engine SIGKILLed at any step of the budget protocol: the ledger comes back to what the live engines hold.

A child of the fork server runs a real cache under the budget (extkv.budget
over the host driver) and stops at one step of the protocol
(extkv.testing.budget.STEPS): its lease just made; a reserve granted with
nothing created; a chunk created but not yet confirmed; a commit confirmed;
a shrink's chunks released but not yet returned; a reclaim being answered;
a preserving defragment's scratch created. It says where it stopped on a
pipe and waits there; the test sends it SIGKILL and reaps it. Within
KILL_SETTLES_S of that exit the daemon's ledger, granted and dead bytes
together, must equal the physical bytes of the live engine beside it (a
cache of this process), and must no longer name the killed engine: what the
dead one held, confirmed or not, counts until it is seen gone and never
after (extkv.testing.budget.ledger_settles, the check a planted defect must
fail too).
"""

from __future__ import annotations

import threading

import pytest

from extkv import ExtensibleKVCache
from extkv.budget.client import BudgetClient
from extkv.testing.budget import (
    ANSWERING_RECLAIMS,
    CHILD_BLOCKS,
    HANG_S,
    LAYOUT,
    STEPS,
    child_stopped_at,
    footprint,
    ledger_settles,
    served_daemon,
    sigkill,
)
from extkv.testing.configs import config_for
from extkv.vmm import HostDriver

pytestmark = [pytest.mark.invariant(5), pytest.mark.budget_proof("SIGKILL")]

#: The live engine's blocks.
LIVE_BLOCKS = 40


@pytest.mark.parametrize("step", STEPS)
def test_the_ledger_equals_the_live_engines_bytes_within_2_s_of_a_sigkill(step):
    granule = HostDriver().granularity
    live_bytes, child_bytes = footprint(LIVE_BLOCKS), footprint(CHILD_BLOCKS)
    # Room for both caches and for the child's defragment scratch; for a
    # reclaim, none: the live engine's next granule needs one of the child's.
    budget = live_bytes + child_bytes + (0 if step == "reclaim" else child_bytes)
    with (served_daemon(budget) as served,
          BudgetClient(served.path, timeout=HANG_S) as live_client):
        live = ExtensibleKVCache(config_for("full", LAYOUT), HostDriver(), LAYOUT, budget=live_client)
        try:
            live.commit(LIVE_BLOCKS)
            asker = None
            with child_stopped_at(served.path, step) as (child, replies):
                if step == "reclaim":
                    assert replies.recv() == ANSWERING_RECLAIMS
                    asker = _ReserveInThread(live_client, granule)
                    assert replies.poll(HANG_S), f"the child engine was not asked to reclaim within {HANG_S} s; the reserve: {asker.result}"
                assert replies.recv() == step
                exited = sigkill(child)
                ledger_settles(served.path, child.pid, lambda: live.physical_bytes + (asker.granted if asker else 0),
                               exited)
            if asker is not None:
                asker.thread.join(HANG_S)
                assert asker.granted, f"the reserve that waited on the killed engine's reclaim: {asker.result}"
                asker.client.cancel(asker.result[1])
        finally:
            live.free()


class _ReserveInThread:
    """A reserve of the live engine that needs the child's bytes: it waits
    while the daemon asks the child to reclaim."""

    def __init__(self, client: BudgetClient, nbytes: int):
        self.client, self.nbytes, self.result = client, nbytes, None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    @property
    def granted(self) -> int:
        """Its bytes once granted (an open ticket of the live engine), else 0."""
        result = self.result
        return self.nbytes if result is not None and result[0] == "granted" else 0

    def _run(self) -> None:
        try:
            self.result = ("granted", self.client.reserve(self.nbytes))
        except Exception as error:  # noqa: BLE001 — reported by the test that reads it
            self.result = ("raised", error)
