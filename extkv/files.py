"""Reading a file that anyone may have put there.

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
