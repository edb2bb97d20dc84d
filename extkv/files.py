"""Reading a file that anyone may have put there, and a directory no one else can.

Theory of operation
-------------------
A report reads run directories that may come from anyone, and a name in one
is nobody's promise: a FIFO named like a results file would block the read,
a symlink could lead out of the directory or to /dev/zero, which never
ends. `read_regular_file` opens without following a symlink and without
blocking, reads only a regular file, and at most a bound of bytes, checked
before the read and kept even if the file grows after the check. Every
refusal is a ValueError naming the path and what the file was expected to
be.

A server's Unix socket must live where no other user can put a file of
their own at its path or connect in its place (extkv.connector's export
socket, the budget daemon's): `private_directory` makes a directory 0700,
or takes one that is already there only after `private_directory_problem`
finds it a directory of this uid's own, no symlink, with no access for
group or others. The command line asks the same question of a directory
it is given, before anything runs.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def read_regular_file(path: Path, most_bytes: int, what: str) -> bytes:
    """The bytes of `path`, a regular file of at most `most_bytes` that
    should be `what` ("a results file"); ValueError naming it otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        raise ValueError(f"{path}: cannot be read as {what} ({error.strerror})") from None
    with os.fdopen(fd, "rb") as file:
        status = os.fstat(file.fileno())
        if not stat.S_ISREG(status.st_mode):
            raise ValueError(f"{path}: not a regular file, expected {what}")
        if status.st_size > most_bytes:
            raise ValueError(f"{path}: {status.st_size} bytes, more than {what} holds ({most_bytes})")
        return file.read(most_bytes + 1)


#: What `private_directory` wants, in words that follow a refusal.
PRIVATE_DIRECTORY_EXPECTED = "expected a directory only this uid can reach (0700)"


def private_directory_problem(path: str) -> str | None:
    """Why `path` is no directory that only this uid can reach, in words that
    follow its name, or None: it must be a directory itself (not a symlink
    to one), owned by this process's effective uid, with no access for its
    group or others. Only looked at (lstat), never opened."""
    try:
        found = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):  # the latter: an ancestor is a file
        return "does not exist"
    except (OSError, ValueError) as error:  # ValueError: a NUL in the path
        return f"cannot be looked at ({error.strerror if isinstance(error, OSError) else error})"
    if stat.S_ISLNK(found.st_mode):
        return "is a symlink, not a directory of its own"
    if not stat.S_ISDIR(found.st_mode):
        return "is not a directory"
    if found.st_uid != os.geteuid():
        return f"is owned by uid {found.st_uid}, not this process's uid {os.geteuid()}"
    if found.st_mode & 0o077:
        return f"has mode {stat.S_IMODE(found.st_mode):04o}, which lets group or others in"
    return None


def private_directory(path: str) -> str:
    """`path`, made a directory of mode 0700 if nothing is there (its missing
    parents too), then checked by `private_directory_problem`: ValueError
    naming it and what is wrong, such as a directory another uid made first
    or one whose mode lets others in."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except FileExistsError:
        pass  # something that is no directory: named below
    except OSError as error:
        raise ValueError(f"{path!r} cannot be made a private directory ({error.strerror})") from None
    problem = private_directory_problem(path)
    if problem is not None:
        raise ValueError(f"{path!r} {problem}; {PRIVATE_DIRECTORY_EXPECTED}")
    return path
