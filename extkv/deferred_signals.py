"""Signal handlers wait for the operation in progress to finish.

Theory of operation
-------------------
Python runs a signal handler in the main thread between two bytecodes of
whatever runs there. A handler that raises (Ctrl-C's KeyboardInterrupt,
pytest-timeout's signal method, a serving framework's SIGTERM handler that
exits) can therefore stop extkv between a driver step and the bookkeeping
that records it: a memfd closed but still recorded (its number, reused by
another file, would be closed again), a chunk unmapped but still counted as
mapped, a chunk created but not yet on any undo list.

`deferred_signals()` closes that window. While the outermost one is entered
on the main thread, every signal that has a Python handler gets `_record`
instead, which only notes the signal; on exit the original handlers return
and each noted signal is handed to its handler once (a signal repeated
before its handler ran is one signal, as without deferral), with the frame
it first arrived in, so the handler runs (and raises) once the operation has completed or
failed cleanly. Calling the handler, rather than raising the signal again,
keeps `signal.set_wakeup_fd` listeners (asyncio) from seeing it twice.
Other threads need nothing: Python never runs a handler outside the main
thread, so a signal cannot raise in them. Signals without a Python handler
(SIGKILL, SIGTERM's default) end the process and are not deferred.

A handler installed outside Python (a native library's `sigaction`) is left
alone: it runs no Python code, and Python cannot put it back, since
`signal.getsignal` still reports the handler Python last installed. So a
signal is deferred only where the kernel runs CPython's own C-level handler
for it, read with `sigaction`; that handler's address is learned once, by
installing a signal's Python handler again while the signal is blocked and
then putting the kernel's action back byte for byte.

What a wait costs the caller: Ctrl-C takes effect when the operation ends,
including the time it waits for the reservation's lock. What it costs the
operation: one pass over the handler table and three `sigaction` calls per
Python handler (one reads which handler the kernel runs), for the
outermost operation only (5 us with SIGINT's handler alone, 0.5 us of it
the read, on a shared 2-core x86-64 host; a nested operation pays a
counter, 0.3 us).

Every step is written so that a signal arriving inside this module's own
code cannot leave a handler replaced for good: `_record` outside a deferral
hands the signal straight to the original handler, so a recorder left in
place by an interrupted restore behaves as the handler it replaced.
"""

from __future__ import annotations

import _signal
import ctypes
import os
import signal
import threading
from types import FrameType

_MAIN_THREAD = threading.main_thread().ident
_SIGNALS = tuple(sorted(int(number) for number in signal.valid_signals()))

_libc = ctypes.CDLL(None, use_errno=True)
_libc.sigaction.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
#: Room for a `struct sigaction` (152 bytes with glibc on x86-64 and arm64).
_SIGACTION_BYTES = 512
#: Where `_kernel_handler` reads into; only the main thread defers.
_read_action = ctypes.create_string_buffer(_SIGACTION_BYTES)
#: The address of CPython's C-level signal handler, once learned.
_python_entry: int | None = None

#: How many deferrals the main thread is inside (only the main thread's count).
_depth = 0
#: The handler each replaced signal had, by signal number.
_originals: dict[int, object] = {}
#: Signals noted while deferring, oldest first, with the frame each arrived in.
_pending: list[tuple[int, FrameType | None]] = []


def _forked() -> None:
    # The thread that forks is the child's main thread, and the one Python
    # runs the child's handlers in.
    global _MAIN_THREAD
    _MAIN_THREAD = threading.get_ident()


os.register_at_fork(after_in_child=_forked)


def _record(number: int, frame: FrameType | None) -> None:
    if _depth:
        # A signal that arrives again before its handler ran is one signal,
        # as the kernel and Python's own handling count it.
        if all(pending != number for pending, _ in _pending):
            _pending.append((number, frame))
        return
    handler = _originals.get(number)
    if callable(handler):
        handler(number, frame)


def _kernel_handler(number: int) -> int:
    """The address of the handler the kernel runs for signal `number` (0 for
    SIG_DFL, 1 for SIG_IGN): `sa_handler`, the first field of `struct
    sigaction` on Linux's ABIs but MIPS."""
    _libc.sigaction(number, None, _read_action)
    return ctypes.c_void_p.from_buffer(_read_action).value or 0


def _learn_python_entry(number: int, handler: object) -> int:
    """CPython's C-level handler: the kernel's handler for `number` right
    after `handler`, which Python says it has already, is installed again.
    The signal is blocked meanwhile and the kernel's action put back after,
    so whatever handler it had keeps every signal."""
    saved = ctypes.create_string_buffer(_SIGACTION_BYTES)
    _libc.sigaction(number, None, saved)
    unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, (number,))
    try:
        _signal.signal(number, handler)
        return _kernel_handler(number)
    finally:
        _libc.sigaction(number, saved, None)
        signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)


def _python_runs(number: int, handler: object) -> bool:
    """Whether the kernel hands signal `number` to Python, whose handler
    for it is `handler`, rather than to one installed outside Python."""
    global _python_entry
    if _python_entry is None:
        _python_entry = _learn_python_entry(number, handler)
    return _kernel_handler(number) == _python_entry


def _restore() -> None:
    for number, handler in list(_originals.items()):
        if _signal.getsignal(number) is _record:
            _signal.signal(number, handler)
        del _originals[number]


def _deliver(pending: list[tuple[int, FrameType | None]]) -> None:
    """Hand each noted signal to the handler it has now; the first exception
    a handler raises propagates once every handler has run."""
    first: BaseException | None = None
    for number, frame in pending:
        handler = _signal.getsignal(number)
        if handler is _record:
            handler = _originals.get(number)
        if not callable(handler):
            continue
        try:
            handler(number, frame)
        except BaseException as error:  # noqa: B036 - a handler's exception is the caller's
            first = first or error
    if first is not None:
        raise first


class _Deferral:
    __slots__ = ()

    def __enter__(self) -> None:
        global _depth
        if threading.get_ident() != _MAIN_THREAD:
            return
        if _depth:
            _depth += 1
            return
        try:
            _depth = 1
            getsignal, install = _signal.getsignal, _signal.signal
            for number in _SIGNALS:
                handler = getsignal(number)
                if callable(handler) and handler is not _record and _python_runs(number, handler):
                    _originals[number] = handler
                    install(number, _record)
        except ValueError:
            # Not the main interpreter: its handlers are not this one's to
            # replace, and none of them runs here.
            _depth = 0
            _restore()
        except BaseException:
            # A handler ran before its replacement: nothing of the operation
            # has run yet, so the signal takes effect now.
            _depth = 0
            try:
                _restore()
            finally:
                _deliver(_take_pending())
            raise

    def __exit__(self, *exc_info) -> None:
        global _depth
        if threading.get_ident() != _MAIN_THREAD or not _depth:
            return
        _depth -= 1
        if _depth:
            return
        pending = _take_pending()
        try:
            _restore()
        finally:
            _deliver(pending)


def _take_pending() -> list[tuple[int, FrameType | None]]:
    pending = _pending[:]
    del _pending[: len(pending)]
    return pending


_DEFERRAL = _Deferral()


def deferred_signals() -> _Deferral:
    """A context manager: signal handlers that would run inside it run when
    the outermost one exits. Re-entrant; a no-op off the main thread."""
    return _DEFERRAL


def run_deferred(function, *args):
    """`function(*args)` with signal handlers deferred, for a step that must
    run once begun (closing descriptors a caller owns). A handler can still
    raise as the deferral is entered, before it holds; then `function` runs
    undeferred before that exception propagates, so an interrupt past this
    function's first instruction never skips it. One on that first
    instruction raises before anything ran, as at the entry of any Python
    call: the caller's object is as it was, and calling again finishes it."""
    entered = False
    try:
        with _DEFERRAL:
            entered = True
            return function(*args)
    except BaseException:
        if not entered:
            function(*args)
        raise


def deferring() -> bool:
    """Whether the calling thread is inside a deferral (off the main thread:
    never, since no handler can interrupt it)."""
    return threading.get_ident() == _MAIN_THREAD and _depth > 0


def signal_waiting() -> bool:
    """Whether a signal arrived inside the calling thread's deferral and
    waits for it to end: a long wait inside one (a host commit waiting for
    another process's lock) stops early on it, so the handler runs soon."""
    return deferring() and bool(_pending)
