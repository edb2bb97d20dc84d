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
  Between the fork and the child's first instruction after it the copy is
  still open: a parent commit that ends in that window leaves the lock
  held until the child is scheduled (a wait of the scheduler's, bounded
  like any other by MACHINE_LOCK_WAIT_S, never the child's life).

That file is anyone's: any local process of any user can hold its lock, or
put something other than a regular file at its path. A commit therefore
never waits on it unboundedly:

- the path is opened with O_NOFOLLOW|O_NONBLOCK and must be a regular file
  (fstat): a FIFO, device, directory or symbolic link is refused at once,
  and no open can block;
- the lock is tried without blocking for at most `MACHINE_LOCK_WAIT_S`,
  the pauses between tries doubling from `MACHINE_LOCK_FIRST_POLL_S` to
  `MACHINE_LOCK_POLL_S`: another process's commit of a few granules holds
  the lock for about a millisecond, and a fixed 20 ms pause would make
  every commit that meets one wait that long (processes that commit side
  by side meet often). Between tries, a signal that the commit's
  deferral holds back (extkv.deferred_signals) ends the wait: the commit
  raises DriverError(EINTR) before it creates anything, and the handler
  then runs, so Ctrl-C lands as KeyboardInterrupt with nothing changed;
- past the bound, or where the path is refused or cannot be opened, the
  commit goes on without the machine lock, with a RuntimeWarning naming
  the path and, where /proc/locks names it, the holder.

Why going on is the safe path: the machine lock only keeps two processes'
headroom checks apart. The commit still holds this process's lock and runs
the same check, so it risks only what every commit risks where the file
cannot be created: that another process's commit, checked but not yet
made, takes memory the check counted. No honest commit holds the lock for
the whole bound. Refusing to commit instead would let any local process
stop every host commit on the machine for as long as it likes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import tempfile
import threading
import time
from typing import Iterator

from ..deferred_signals import signal_waiting
from ..errors import DriverError, warn_without_raising

#: The machine's host commits take an flock on this file (any process may
#: open it for reading, which is all flock needs).
COMMITS_LOCK_PATH = os.path.join(tempfile.gettempdir(), "extkv-host-commits.lock")
#: Longest wait for another process's commit: a commit holds the lock from
#: its check to its last create, and creating 64 GiB of memfd pages (the
#: kernel zeroes each) takes a few seconds; a holder past this is stuck,
#: stopped or hostile, and the commit goes on without it.
MACHINE_LOCK_WAIT_S = 30.0
#: Longest pause between two tries of the lock: the most a Ctrl-C waits,
#: and a small cost next to a commit that has waited this long already.
MACHINE_LOCK_POLL_S = 0.02
#: First pause: about what another process's commit of a few granules
#: holds the lock for; each pause after doubles, up to MACHINE_LOCK_POLL_S.
MACHINE_LOCK_FIRST_POLL_S = 0.0005

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
    """Hold this process's commit lock, then the machine's (see the module
    docstring for when a commit goes on without the machine's)."""
    with _process_commits:
        descriptor = _open_lock_file()
        try:
            if descriptor is not None:
                _wait_for_lock(descriptor)
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
    """A descriptor of COMMITS_LOCK_PATH, recorded for a fork, or None with
    a warning where it is refused or cannot be opened nor created."""
    global _commit_descriptor
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    path = COMMITS_LOCK_PATH
    with _descriptor_guard:
        try:
            try:
                descriptor = os.open(path, flags)
            except FileNotFoundError:
                descriptor = os.open(path, flags | os.O_CREAT, 0o644)
        except OSError as error:
            _go_on_without(f"it can be neither opened nor created ({errno.errorcode.get(error.errno, error.errno)})")
            return None
        mode = os.fstat(descriptor).st_mode
        if not stat.S_ISREG(mode):
            os.close(descriptor)
            _go_on_without(f"it is not a regular file ({_file_kind(mode)})")
            return None
        _commit_descriptor = descriptor
        return descriptor


def _wait_for_lock(descriptor: int) -> None:
    """flock(LOCK_EX) for at most MACHINE_LOCK_WAIT_S; past that, a warning
    and the commit goes on. DriverError(EINTR) where a deferred signal is
    waiting for the commit to end."""
    deadline = time.monotonic() + MACHINE_LOCK_WAIT_S
    pause = MACHINE_LOCK_FIRST_POLL_S
    while True:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        if signal_waiting():
            raise DriverError(
                f"flock({COMMITS_LOCK_PATH}, LOCK_EX)", errno.EINTR, "EINTR",
                detail=f"a signal arrived while waiting for the machine's host commit lock, {_holder(descriptor)}; "
                "nothing was created",
            )
        if time.monotonic() >= deadline:
            _go_on_without(f"it stayed locked for {MACHINE_LOCK_WAIT_S} s, {_holder(descriptor)}")
            return
        time.sleep(pause)
        pause = min(2 * pause, MACHINE_LOCK_POLL_S)


def _go_on_without(why: str) -> None:
    warn_without_raising(
        f"host commit goes on without the machine's commit lock {COMMITS_LOCK_PATH}: {why}; its headroom check "
        "is no longer kept apart from other processes' commits",
        stacklevel=2,
    )


def _holder(descriptor: int) -> str:
    """Who holds the flock on `descriptor`'s file, from /proc/locks."""
    status = os.fstat(descriptor)
    file = f"{os.major(status.st_dev):02x}:{os.minor(status.st_dev):02x}:{status.st_ino}"
    try:
        with open("/proc/locks") as locks:
            lines = locks.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 4242 00:2a:1234 0 EOF"; a waiter's line has "->" second.
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == file:
            pid = fields[4]
            try:
                with open(f"/proc/{pid}/comm") as comm:
                    return f"held by pid {pid} ({comm.read().strip()})"
            except OSError:
                return f"held by pid {pid}"
    return "held by a process /proc/locks does not name"


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return f"mode {mode:#o}"
