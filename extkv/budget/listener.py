"""Claiming a budget daemon's socket path: one daemon per path, and nothing planted there taken for it.

Theory of operation
-------------------
Engines connect to a path they are told; whoever listens there is their
budget. So `claim_socket(path)` listens only where no one else can have
put anything, and never in a live daemon's place:

- The directory is made 0700, and refused unless it is a directory of this
  uid's own that no group or other user can enter
  (extkv.files.private_directory): anyone who could write there could put
  a socket of theirs where the engines connect.
- A lock file beside the socket (`<key>.lock`, flock) makes one daemon per
  path; a second is refused (DaemonRunningError) while the first lives, and
  the kernel drops the lock when the first dies, however it dies. The lock
  file stays: removing it would let two daemons lock two files of one name.
- A socket file already at the path is replaced only after `connect` to it
  is refused (ECONNREFUSED: nothing listens, it is stale). One that
  accepts, or whose backlog is full (the non-blocking connect's EAGAIN),
  belongs to a live daemon, and the claim is refused without waiting.
  Anything else at the path (a regular file, a FIFO, a symlink, a
  directory) is refused, looked at with lstat and never opened, so nothing
  planted there can block the start or lead it elsewhere.

`ClaimedSocket.close()` closes the listener, removes the socket file only
if it is still the one bound here (by device and inode), and gives up the
lock.
"""

from __future__ import annotations

import fcntl
import os
import socket
import stat
from typing import Callable

from ..errors import ExtkvError
from ..files import private_directory


class DaemonRunningError(ExtkvError, RuntimeError):
    """Another daemon serves at this socket path."""


def _file_kind(mode: int) -> str:
    for test, words in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symlink"),
                        (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return words
    return "no socket"


class ClaimedSocket:
    """A listening, non-blocking AF_UNIX socket (`listener`) at `path`, and the lock that makes it this daemon's."""

    def __init__(self, path: str, listener: socket.socket, lock_fd: int):
        self.path = path
        self.listener = listener
        self._lock_fd: int | None = lock_fd
        bound = os.lstat(path)
        self._bound = (bound.st_dev, bound.st_ino)

    def close(self) -> None:
        """Idempotent."""
        self.listener.close()
        if self._lock_fd is None:
            return
        try:
            found = os.lstat(self.path)
            if (found.st_dev, found.st_ino) == self._bound:
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._lock_fd)  # the flock goes with the last descriptor
        self._lock_fd = None

    def __repr__(self) -> str:
        return f"ClaimedSocket({self.path!r})"


def claim_socket(path: str, *, backlog: int, log: Callable[[str], None]) -> ClaimedSocket:
    """Listen at `path` (see the theory): ValueError for a directory that is
    not this uid's alone or a file planted at the path, DaemonRunningError
    where a daemon serves there."""
    private_directory(os.path.dirname(path) or ".")
    lock_fd = _lock(path)
    try:
        _clear_stale_socket(path, log)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(path)
            os.chmod(path, 0o600)
            listener.listen(backlog)
            listener.setblocking(False)
            return ClaimedSocket(path, listener, lock_fd)
        except BaseException:
            listener.close()
            raise
    except BaseException:
        os.close(lock_fd)
        raise


def _lock(path: str) -> int:
    lock_path = os.path.splitext(path)[0] + ".lock"
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError as error:
        raise ValueError(f"{lock_path!r} cannot be opened as the daemon's lock file ({error.strerror})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(f"{lock_path!r} is {_file_kind(mode)}; expected the daemon's lock file")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DaemonRunningError(f"another budget daemon holds {lock_path}: it serves {path}") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _clear_stale_socket(path: str, log: Callable[[str], None]) -> None:
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(found.st_mode):
        raise ValueError(f"{path!r} is {_file_kind(found.st_mode)}, not a socket: refusing to replace it "
                         "(remove it if it is yours)")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)  # a live daemon's full backlog must not block the start
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            os.unlink(path)  # stale: nothing listens there
            log(f"replaced the stale socket {path}")
            return
        except BlockingIOError:
            pass  # a full backlog: a live daemon, too busy to take one more
    raise DaemonRunningError(f"a budget daemon already answers at {path}")
