"""A child process of a stress run, spoken to by lines.

Theory of operation
-------------------
The workloads that need a second process (the pressure process, the crash
child, walk processes) start `python -m extkv.testing.stress COMMAND ...`
(extkv.testing.stress.__main__) from the checkout's root, with the extkv
package importable and one torch thread (`child_env`). A `ChildProcess`
writes commands to its stdin and reads its stdout unbuffered, so that
`drain()` sees every line it wrote before it stopped; every wait is bounded
(CHILD_TIMEOUT_S), and a child that says nothing in time is killed, its
stderr in the error.
"""

from __future__ import annotations

import collections
import os
import select
import subprocess
import sys
import time
from pathlib import Path

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


class ChildProcess:
    """A child running `python -m extkv.testing.stress ARGUMENTS`, spoken to
    by lines. Its stdout is read unbuffered, so that `drain()` sees every
    line it wrote before it stopped; every wait is bounded."""

    def __init__(self, arguments: list[str]):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "extkv.testing.stress", *arguments],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=child_env(),
            cwd=repo_root(),
        )
        self._pending = bytearray()
        self._closed = False
        self._lines: collections.deque[str] = collections.deque()

    @property
    def pid(self) -> int:
        return self.process.pid

    def send(self, line: str) -> None:
        self.process.stdin.write(line.encode() + b"\n")
        self.process.stdin.flush()

    def _read(self, timeout_s: float) -> bool:
        """Read what the child wrote within `timeout_s`; False at a timeout or end."""
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        data = os.read(self.process.stdout.fileno(), 1 << 16) if ready else b""
        # Readable yet empty: the child closed its stdout (it exited), not merely slow.
        self._closed = bool(ready) and not data
        self._pending += data
        *complete, rest = self._pending.split(b"\n")
        self._lines.extend(line.decode() for line in complete)
        self._pending = bytearray(rest)
        return bool(data)

    def line(self, timeout_s: float = CHILD_TIMEOUT_S) -> str:
        """The child's next line of stdout."""
        deadline = time.monotonic() + timeout_s
        while not self._lines:
            if not self._read(max(deadline - time.monotonic(), 0)):
                ended = self._closed
                self.kill()
                stderr = self.process.stderr.read().decode(errors="replace")
                said = "exited before saying anything" if ended else f"said nothing within {timeout_s} s"
                raise AssertionError(
                    f"child {' '.join(map(str, self.process.args[3:]))} {said} "
                    f"(exit {self.process.returncode}): {stderr[-3000:]}"
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
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(CHILD_TIMEOUT_S)

    def close(self) -> None:
        """Ask the child to quit, then kill it; reaps it either way."""
        if self.process.poll() is None:
            try:
                self.send("quit")
                self.process.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            stream.close()

    def __enter__(self) -> "ChildProcess":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
