"""Host commits one at a time: among this process's threads and on the machine.

Theory of operation
-------------------
A host commit checks its headroom and then creates its chunks
(extkv.vmm.host_memory). Two commits that check on one reading could both
pass and together take more than there is, so `one_commit_at_a_time()`
keeps them apart from the check to the last create:

- in this process, by a re-entrant lock. A forked child gets a new one: the
  thread that held the parent's at the fork does not exist in the child,
  whose first commit would otherwise wait for it forever.
- on the machine, by an flock on `COMMITS_LOCK_PATH`
  ($TMPDIR/extkv-host-commits.lock), which any process may open for
  reading, all flock needs, so the extkv processes of every user take the
  same lock. An flock belongs to the open file description, which a forked
  child shares: were the child to keep its copy of a commit's descriptor,
  the lock would stay held after the parent let go, until the child exits.
  So the descriptor of the commit in flight is recorded as it is opened
  and forgotten as it is closed, both under a lock that a fork waits for,
  and the child closes its copy at once. Closing a copy never releases the
  lock while the parent's descriptor stays open, so the parent keeps it.

Where the file can be neither opened nor created (another user's file in a
directory that refuses it), commits of other processes are not kept apart,
and nothing else changes.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import threading
from typing import Iterator

#: The machine's host commits take an flock on this file (any process may
#: open it for reading, which is all flock needs).
COMMITS_LOCK_PATH = os.path.join(tempfile.gettempdir(), "extkv-host-commits.lock")
_process_commits = threading.RLock()
#: The descriptor of the commit in flight that a forked child must close,
#: recorded and forgotten under `_descriptor_guard`, which a fork waits for.
_commit_descriptor: int | None = None
_descriptor_guard = threading.Lock()


def _before_fork() -> None:
    _descriptor_guard.acquire()


def _after_fork_in_parent() -> None:
    _descriptor_guard.release()


def _after_fork_in_child() -> None:
    """The child holds none of the parent's commit locks: a new process
    lock, and no descriptor of the machine lock's open file description
    (closing it leaves the parent's lock held: the parent's own stays open)."""
    global _process_commits, _descriptor_guard, _commit_descriptor
    _process_commits = threading.RLock()
    _descriptor_guard = threading.Lock()
    if _commit_descriptor is not None:
        with contextlib.suppress(OSError):
            os.close(_commit_descriptor)
        _commit_descriptor = None


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def one_commit_at_a_time() -> Iterator[None]:
    """Hold this process's commit lock, then the machine's where its file
    can be opened."""
    with _process_commits:
        descriptor = _open_lock_file()
        try:
            if descriptor is not None:
                fcntl.flock(descriptor, fcntl.LOCK_EX)
            yield
        finally:
            if descriptor is not None:
                with _descriptor_guard:
                    _forget(descriptor)


def _forget(descriptor: int) -> None:
    global _commit_descriptor
    _commit_descriptor = None
    os.close(descriptor)  # releases the flock


def _open_lock_file() -> int | None:
    """A descriptor of COMMITS_LOCK_PATH, recorded for a fork, or None where
    it can be neither opened nor created."""
    global _commit_descriptor
    with _descriptor_guard:
        try:
            try:
                descriptor = os.open(COMMITS_LOCK_PATH, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                descriptor = os.open(COMMITS_LOCK_PATH, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError:
            return None
        _commit_descriptor = descriptor
        return descriptor
