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

`daemon_process(run_dir, budget)` serves from a child process of the fork
server (extkv.testing.children) instead, so that a test can SIGKILL the
daemon, as a crash would end it, and start another on the same socket.
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
from .children import fork_server

#: Seconds the daemon's loop may take to stop once asked, and a daemon's
#: child process to start or to be reaped once killed: a net against a hang.
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


def _serve_in_child(run_dir: str, budget: int, ready) -> None:
    """A daemon child's life: start, say where it listens (or why it could
    not), serve until killed."""
    try:
        daemon = BudgetDaemon(HostDevice(), budget, run_dir=run_dir)
        daemon.start()
    except Exception as error:  # noqa: BLE001 - handed to the parent, which raises it
        ready.send(("failed", f"{type(error).__name__}: {error}"))
        return
    ready.send(("serving", daemon.socket_path))
    ready.close()
    daemon.serve_forever()


class DaemonProcess:
    """A daemon serving from a child process: `path` its socket, `pid` the child's."""

    def __init__(self, run_dir: str, budget: int):
        context = fork_server()
        ready, ready_in_child = context.Pipe(duplex=False)
        self.process = context.Process(target=_serve_in_child, args=(run_dir, budget, ready_in_child), daemon=True)
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
def daemon_process(run_dir: str, budget: int) -> Iterator[DaemonProcess]:
    """A DaemonProcess of `budget` bytes in `run_dir`, killed on the way out."""
    served = DaemonProcess(run_dir, budget)
    try:
        yield served
    finally:
        served.kill()
