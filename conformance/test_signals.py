"""What a process set up for itself survives extkv's operations: a signal
handler installed outside Python, several signals' handlers, warnings
filters that turn warnings into errors.

`extkv.deferred_signals` swaps Python's signal handlers for a recorder
while an operation runs; the tests here read the kernel's own record of each
signal's handler (`sigaction`, through ctypes) before and after real
operations, and raise real signals in the middle of them from a driver
wrapper, as test_interrupts.py does.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from extkv import ExtensibleTensor
from extkv.vmm import HostDriver, live_chunks
from extkv.vmm.wrapping import WrappingDriver

_libc = ctypes.CDLL(None, use_errno=True)
_libc.sigaction.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
C_HANDLER_TYPE = ctypes.CFUNCTYPE(None, ctypes.c_int)
#: A handler that is C code to the kernel; never called here.
C_HANDLER = C_HANDLER_TYPE(lambda number: None)
SIG_IGN = 1
#: Where this suite's package is importable from.
SUITE_PARENT = Path(__file__).resolve().parent.parent


class Sigaction(ctypes.Structure):
    """glibc's `struct sigaction` on x86-64 and arm64, with room to spare."""

    _fields_ = [
        ("handler", ctypes.c_void_p),
        ("mask", ctypes.c_ulong * (1024 // (8 * ctypes.sizeof(ctypes.c_ulong)))),
        ("flags", ctypes.c_int),
        ("restorer", ctypes.c_void_p),
        ("spare", ctypes.c_char * 256),
    ]


class Raised(Exception):
    pass


def kernel_action(number: int) -> tuple[int, int, int]:
    """(handler, blocked signals, flags): what the kernel does on signal
    `number` (glibc fills only the kernel's 64 bits of the mask)."""
    action = Sigaction()
    assert _libc.sigaction(number, None, ctypes.byref(action)) == 0, os.strerror(ctypes.get_errno())
    return action.handler or 0, action.mask[0], action.flags


def install_outside_python(number: int, handler: int) -> None:
    """Install `handler` (an address, or SIG_IGN) for `number` with libc's
    sigaction, as a native library does: Python's signal module never hears
    of it."""
    action = Sigaction(handler=handler, flags=0)
    action.mask[0] = 1 << (signal.SIGUSR2 - 1)  # something to tell this action from Python's
    assert _libc.sigaction(number, ctypes.byref(action), None) == 0, os.strerror(ctypes.get_errno())


@contextlib.contextmanager
def python_handler(number: int, handler):
    previous = signal.signal(number, handler)
    try:
        yield
    finally:
        signal.signal(number, previous)


def raises(number, frame):
    raise Raised(number)


class SignalsAfterCreate(WrappingDriver):
    """The real driver, raising `numbers` in this process, in order, right
    after each chunk is created, before the tensor has recorded it."""

    def __init__(self, inner, numbers):
        super().__init__(inner)
        self.numbers = numbers

    def _create(self, size):
        chunk = self.inner._create(size)
        for number in self.numbers:
            signal.raise_signal(number)
        return chunk


def commit_release_free(driver) -> None:
    granule = driver.granularity
    tensor = ExtensibleTensor(2 * granule, device=driver)
    try:
        tensor.resize_segments_([granule], zero_new=True)
        tensor.release_physical()
    finally:
        tensor.free()


@pytest.mark.invariant(6)
@pytest.mark.parametrize("handler", ["C function", "SIG_IGN"])
def test_a_handler_installed_outside_python_stays_installed_and_gets_its_signals(driver, handler):
    """Python's handler for SIGUSR1 raises, but a native library has since
    installed its own: extkv's operations leave the kernel's action exactly
    as it was, and a signal raised inside one goes to the library's
    handler, not to Python's (which `signal.getsignal` still reports)."""
    address = ctypes.cast(C_HANDLER, ctypes.c_void_p).value if handler == "C function" else SIG_IGN
    with python_handler(signal.SIGUSR1, raises):
        install_outside_python(signal.SIGUSR1, address)
        before = kernel_action(signal.SIGUSR1)
        commit_release_free(driver)
        assert kernel_action(signal.SIGUSR1) == before, "an operation replaced the handler installed outside Python"
        if handler == "SIG_IGN":
            commit_release_free(SignalsAfterCreate(driver, [signal.SIGUSR1]))  # ignored: nothing raises
            assert kernel_action(signal.SIGUSR1) == before


FIRST_OPERATION_UNDER_A_NATIVE_SIGINT_HANDLER = """
import importlib, os, signal, sys
import extkv
sys.path.insert(0, sys.argv[1])
this_module = importlib.import_module(sys.argv[2])
SIG_IGN, install_outside_python, kernel_action = (
    this_module.SIG_IGN, this_module.install_outside_python, this_module.kernel_action
)
install_outside_python(signal.SIGINT, SIG_IGN)
before = kernel_action(signal.SIGINT)
with extkv.ExtensibleTensor(4 << 20, device="cpu") as tensor:
    tensor.resize_segments_([2 << 20])
    os.kill(os.getpid(), signal.SIGINT)  # ignored, as the library wants
after = kernel_action(signal.SIGINT)
print("unchanged" if after == before else f"{before} became {after}")
"""


@pytest.mark.invariant(6)
@pytest.mark.long
def test_a_native_handler_survives_the_first_operation_of_a_process():
    """A process's first operation learns which handler is CPython's: where
    it learns it on a signal a native library took over (SIGINT set to
    SIG_IGN behind Python's back), the library's action stays and the
    signal stays ignored inside the operation."""
    child = subprocess.run(
        [sys.executable, "-c", FIRST_OPERATION_UNDER_A_NATIVE_SIGINT_HANDLER, str(SUITE_PARENT), __name__],
        capture_output=True, text=True, timeout=120,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.strip() == "unchanged", child.stdout


@pytest.mark.invariant(6)
def test_signals_noted_in_one_operation_all_reach_their_handlers_when_one_raises(driver):
    """SIGUSR1's handler raises and SIGUSR2's records, both signals raised
    inside one commit: once the commit completed every handler runs, in the
    order the signals arrived, and the first exception propagates."""
    ran = []

    def usr1(number, frame):
        ran.append(number)
        raise Raised(number)

    def usr2(number, frame):
        ran.append(number)

    granule = driver.granularity
    with python_handler(signal.SIGUSR1, usr1), python_handler(signal.SIGUSR2, usr2):
        tensor = ExtensibleTensor(2 * granule, device=SignalsAfterCreate(driver, [signal.SIGUSR1, signal.SIGUSR2]))
        try:
            with pytest.raises(Raised):
                tensor.resize_segments_([granule], zero_new=True)
            assert tensor.segment_sizes == [granule], "the commit stopped half way"
        finally:
            tensor.free()
    assert ran == [signal.SIGUSR1, signal.SIGUSR2], f"handlers ran for {ran}"


@pytest.mark.invariant(5, 6)
def test_under_warnings_as_errors_a_chunk_whose_close_failed_is_never_closed_again():
    """`-W error` turns the warning about a failed close into an exception:
    the chunk is released all the same (Linux freed its descriptor number)
    and nothing of extkv's closes that number again once another file took
    it."""
    driver = HostDriver()
    granule = driver.granularity
    tensor = ExtensibleTensor(2 * granule, device=driver)
    raised = None
    devnull = os.open(os.devnull, os.O_RDONLY)
    try:
        with warnings.catch_warnings(record=True) as shown:
            warnings.simplefilter("error")
            tensor.resize_segments_([granule], zero_new=True)
            fd = tensor.mapped_chunks[0].chunk.handle
            os.close(fd)  # behind extkv's back: its own close now fails with EBADF
            try:
                tensor.release_physical()
            except RuntimeWarning as error:
                raised = error
            os.dup2(devnull, fd)  # another file takes the number
            try:
                tensor.free()
                still_devnull = os.path.samestat(os.fstat(fd), os.fstat(devnull))
            except OSError:
                still_devnull = False
            finally:
                with contextlib.suppress(OSError):
                    os.close(fd)
    finally:
        os.close(devnull)
    assert still_devnull, f"descriptor {fd}, taken by {os.devnull} after extkv's close failed, was closed again"
    assert raised is None, f"the release raised {raised!r}, which reads as a refusal to release"
    assert any(f"close(memfd {fd})" in str(warning.message) for warning in shown), [str(w.message) for w in shown]
    assert live_chunks["host"] == 0, f"{live_chunks['host']} host chunks still counted after the release"
