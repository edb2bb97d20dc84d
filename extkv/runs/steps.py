"""The pytest processes of a run, and how Ctrl-C or SIGTERM ends them all.

Theory of operation
-------------------
`extkv check`, `stress` and `bench` run pytest in subprocesses (steps) and
wait for them. While a run is inside `interruptible()`, SIGINT, SIGTERM and
SIGHUP raise `RunInterrupted` in its main thread, wherever it waits; a
BaseException, as KeyboardInterrupt is, so no `except Exception` of the run
swallows it. The run then ends its steps (`end_all`), writes its report
marked interrupted, prints one line saying so and exits 128 plus the
signal's number (130 for SIGINT, 143 for SIGTERM), as a shell reports a
process a signal ended.

Each step starts in a session and process group of its own (`start`): a
terminal's Ctrl-C then reaches the run's own process only, which passes it
on once, and a signal sent to the run's pid alone reaches the steps too.
While interruptible, the run's process is a child subreaper
(PR_SET_CHILD_SUBREAPER): a process whose parent died (an xdist worker whose
pytest was killed) becomes the run's child rather than init's, so the run
can wait for every process it started, however deep.

`end_all` sends SIGINT to each step's group, so that pytest stops the test
it is in and writes the results it has (pytest's exit status 2), or the
run's own signal to a step that is itself a run (`extkv reference`'s steps,
which then name the signal the user sent), and waits
up to GRACE_S for them; then SIGKILL to each group, and every child the run
has left is killed and reaped, again until it has none. Once the run has
returned, no process it started runs. A second signal while the steps end
skips what is left of the grace.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from typing import Iterator

#: The signals that end a run.
ENDING_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: Seconds pytest gets to stop at its test and write its results.
GRACE_S = 30.0
#: prctl's option that makes a process the reaper of its orphaned descendants.
_PR_SET_CHILD_SUBREAPER = 36

_libc = ctypes.CDLL(None, use_errno=True)


class RunInterrupted(BaseException):
    """A signal ended the run: `signal_name` (SIGINT), `exit_status` (130)."""

    def __init__(self, number: int):
        super().__init__(signal.Signals(number).name)
        self.number = number

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.number).name

    @property
    def exit_status(self) -> int:
        return 128 + self.number


class _Interruption:
    """The signal that ended the run, once one has; a later one hurries the end."""

    first: int | None = None
    hurry = False


_state = _Interruption()


def _on_signal(number: int, frame) -> None:
    if _state.first is None:
        _state.first = number
        raise RunInterrupted(number)
    _state.hurry = True


def _set_subreaper(on: bool) -> None:
    if _libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl(PR_SET_CHILD_SUBREAPER, {int(on)}) failed")


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """While entered: ENDING_SIGNALS raise RunInterrupted (the first only)
    and the process is its descendants' subreaper; both undone on exit."""
    # Reset before the handlers go in: a signal between the two would be
    # taken for a second one and only hurry an end that never began.
    _state.first, _state.hurry = None, False
    previous = {number: signal.signal(number, _on_signal) for number in ENDING_SIGNALS}
    try:
        _set_subreaper(True)
        yield
    finally:
        _set_subreaper(False)
        for number, handler in previous.items():
            signal.signal(number, handler)


def start(command: list[str], **options) -> subprocess.Popen:
    """`command` as a step: in a session of its own, reading nothing."""
    return subprocess.Popen(command, start_new_session=True, stdin=subprocess.DEVNULL, **options)


def _signal_group(process: subprocess.Popen, number: int) -> None:
    # The step leads its group, so the group's id is its pid; the id stays
    # taken while a member lives, even after the step itself was reaped.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, number)


def _children() -> list[int]:
    """The pids whose parent is this process (zombies included)."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as file:
                stat = file.read()
        except OSError:
            continue  # ended meanwhile
        # Fields after the command name, which may hold spaces and parentheses.
        if int(stat[stat.rindex(b")") + 2:].split()[1]) == me:
            found.append(int(entry))
    return found


def _reaped(step: subprocess.Popen, block: bool) -> bool:
    """Whether `step` has ended, reaping it with waitpid directly. Popen's
    poll() and wait() take a lock of the Popen's first, and a signal whose
    handler raises between that lock's acquire and the try that releases it
    leaves it held: every later wait() without a timeout then blocks for
    ever, and poll() reports a running step."""
    if step.returncode is not None:
        return True
    try:
        pid, status = os.waitpid(step.pid, 0 if block else os.WNOHANG)
    except ChildProcessError:
        return True  # reaped already, by an earlier end_all's children loop
    if pid == 0:
        return False
    step.returncode = os.waitstatus_to_exitcode(status)
    return True


def end_all(steps: list[subprocess.Popen], grace_s: float = GRACE_S, number: int = signal.SIGINT) -> None:
    """End every step and every process they started, each step given
    `grace_s` to end on signal `number`; returns once none runs. Every other
    child of this process ends too (orphans reparented to a subreaper are
    known only as children), so it is for a run's own process only."""
    for step in steps:
        _signal_group(step, number)
    deadline = time.monotonic() + grace_s
    for step in steps:
        while not _reaped(step, block=False) and not _state.hurry and time.monotonic() < deadline:
            with contextlib.suppress(subprocess.TimeoutExpired):
                step.wait(timeout=0.2)
    for step in steps:
        _signal_group(step, signal.SIGKILL)
        _reaped(step, block=True)
    while children := _children():
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
