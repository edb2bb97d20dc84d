"""A budget daemon serving from a thread of the test process.

Theory of operation
-------------------
The budget's tests need a real daemon (extkv.budget.daemon) on a real Unix
socket, and an engine's side that talks to it through the real client.
`served_daemon(budget)` starts a `BudgetDaemon` over the host device in a
directory of its own (short: an AF_UNIX address holds 107 bytes, and
pytest's tmp_path is long) and runs its loop in a daemon thread, so a test
reads the ledger through the same protocol an operator's `extkv budget
status` uses; on the way out it stops the loop, joins it within
STOP_WAIT_S, closes the daemon and removes the directory.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
from typing import Iterator

from ..budget.daemon import BudgetDaemon
from ..budget.device import HostDevice

#: Seconds the daemon's loop may take to stop once asked.
STOP_WAIT_S = 60


class ServedDaemon:
    """A daemon serving from a thread; `log` holds its lines, `path` its socket."""

    def __init__(self, run_dir: str, budget: int, allowed_uids=None):
        self.log: list[str] = []
        self.daemon = BudgetDaemon(HostDevice(), budget, run_dir=run_dir, allowed_uids=allowed_uids,
                                   log=self.log.append)
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
def served_daemon(budget: int, allowed_uids=None) -> Iterator[ServedDaemon]:
    parent = tempfile.mkdtemp(prefix="extkv-budget-")
    served = ServedDaemon(os.path.join(parent, "run"), budget, allowed_uids)
    try:
        yield served
    finally:
        try:
            served.stop()
        finally:
            shutil.rmtree(parent, ignore_errors=True)
