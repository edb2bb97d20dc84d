"""A child process of a stress run, spoken to by lines.

Theory of operation
-------------------
The workloads that need a second process (the pressure process, the crash
child, walk processes) run `python -m extkv.testing.stress COMMAND ...`'s
`main` (extkv.testing.stress.__main__) in a child of the fork server
(extkv.testing.children), which imported torch once: a fresh interpreter
spent about 2 s of CPU importing it, for each of the four such children of
a host check on 2 cores. The child runs from the checkout's root with the
extkv package importable and one torch thread (`child_env`); one end of a
socket pair is its stdin and stdout, and its stderr goes to a file read
back when it fails. A `ChildProcess` writes commands to the socket and reads
it unbuffered, so that `drain()` sees every line the child wrote before it
stopped; every wait is bounded (CHILD_TIMEOUT_S), and a child that says
nothing in time is killed, its stderr in the error.
"""

from __future__ import annotations

import collections
import contextlib
import os
import runpy
import select
import socket
import sys
import tempfile
import time
from pathlib import Path

from ..children import fork_server
from .base import CHILD_TIMEOUT_S


def repo_root() -> Path:
    """The directory holding the extkv package (a checkout's root)."""
    return Path(__file__).resolve().parents[3]


def child_env() -> dict[str, str]:
    """The environment of a child process: this one's, with the extkv
    package importable and one torch thread."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo_root()), env.get("PYTHONPATH")]))
    env.setdefault("EXTKV_TORCH_THREADS", "1")
    return env


def _child_main(arguments: list[str], channel: socket.socket, stderr_path: str, environment: dict[str, str],
                directory: str) -> None:
    """The child's side: `channel` becomes its stdin and stdout."""
    os.chdir(directory)
    os.environ.clear()
    os.environ.update(environment)
    os.dup2(channel.fileno(), 0)
    os.dup2(channel.fileno(), 1)
    channel.close()
    os.dup2(os.open(stderr_path, os.O_WRONLY | os.O_TRUNC), 2)
    sys.stdin = open(0, "r", closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    sys.argv = ["python -m extkv.testing.stress", *arguments]
    runpy.run_module("extkv.testing.stress", run_name="__main__", alter_sys=True)  # exits with its status


class ChildProcess:
    """A child running `python -m extkv.testing.stress ARGUMENTS`'s `main`,
    spoken to by lines. Its output is read unbuffered, so that `drain()`
    sees every line it wrote before it stopped; every wait is bounded."""

    def __init__(self, arguments: list[str]):
        self.arguments = list(arguments)
        descriptor, self._stderr_path = tempfile.mkstemp(prefix="extkv-child-", suffix=".stderr")
        os.close(descriptor)
        self._channel, theirs = socket.socketpair()
        try:
            self._process = fork_server().Process(
                target=_child_main,
                args=(self.arguments, theirs, self._stderr_path, child_env(), str(repo_root())),
                name=f"extkv-stress-{self.arguments[0]}",
            )
            self._process.start()
            # Kept: a closed Process object no longer answers its pid, and
            # NVML is read for it after the child is closed.
            self.pid = self._process.pid
        except BaseException:
            self._channel.close()
            os.unlink(self._stderr_path)
            raise
        finally:
            theirs.close()
        self._pending = bytearray()
        self._closed = False
        self._lines: collections.deque[str] = collections.deque()

    @property
    def command(self) -> str:
        """The command that runs the same child on its own, to reproduce it."""
        return " ".join(["python -m extkv.testing.stress", *self.arguments])

    @property
    def returncode(self) -> int | None:
        """The exit status (negative: the signal that ended it); None while it runs."""
        return self._process.exitcode

    def wait(self, timeout_s: float = CHILD_TIMEOUT_S) -> int:
        self._process.join(timeout_s)
        if self._process.exitcode is None:
            raise TimeoutError(f"child {' '.join(self.arguments)} still runs after {timeout_s} s")
        return self._process.exitcode

    def send(self, line: str) -> None:
        self._channel.sendall(line.encode() + b"\n")

    def _read(self, timeout_s: float) -> bool:
        """Read what the child wrote within `timeout_s`; False at a timeout or end."""
        ready, _, _ = select.select([self._channel], [], [], timeout_s)
        data = self._channel.recv(1 << 16) if ready else b""
        # Readable yet empty: the child's end closed (it exited), not merely slow.
        self._closed = bool(ready) and not data
        self._pending += data
        *complete, rest = self._pending.split(b"\n")
        self._lines.extend(line.decode() for line in complete)
        self._pending = bytearray(rest)
        return bool(data)

    def stderr(self) -> str:
        """What the child wrote to its stderr so far."""
        return Path(self._stderr_path).read_text(errors="replace")

    def line(self, timeout_s: float = CHILD_TIMEOUT_S) -> str:
        """The child's next line of output."""
        deadline = time.monotonic() + timeout_s
        while not self._lines:
            if not self._read(max(deadline - time.monotonic(), 0)):
                ended = self._closed
                self.kill()
                said = "exited before saying anything" if ended else f"said nothing within {timeout_s} s"
                raise AssertionError(
                    f"child {' '.join(self.arguments)} {said} (exit {self.returncode}): {self.stderr()[-3000:]}"
                )
        return self._lines.popleft()

    def drain(self, quiet_s: float = 0.05) -> list[str]:
        """Every line written so far (of a stopped child: all it wrote)."""
        while self._read(quiet_s):
            pass
        lines = list(self._lines)
        self._lines.clear()
        return lines

    def ask(self, line: str, timeout_s: float = CHILD_TIMEOUT_S) -> str:
        self.send(line)
        return self.line(timeout_s)

    def kill(self) -> None:
        if self._process.exitcode is None:
            self._process.kill()
        self._process.join(CHILD_TIMEOUT_S)

    def close(self) -> None:
        """Ask the child to quit, then kill it; reaps it either way."""
        if self._process.exitcode is None:
            try:
                self.send("quit")
                self._process.join(10)
            except OSError:
                pass
        self.kill()
        self._process.close()
        self._channel.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._stderr_path)

    def __enter__(self) -> "ChildProcess":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
