"""Signals that raise: an operation is never stopped between a driver step
and its bookkeeping.

`extkv.deferred_signals` defers Python signal handlers while an operation
runs on the main thread; the tests here prove what it promises on real
signals (SIGALRM from `setitimer`, SIGUSR1 raised by the process itself),
then run the random-interrupt workload of `extkv.testing.interrupts` on the
host driver and on each CUDA device: at least 1,000 interrupts that land
inside extkv code, through every operation, with 0 inconsistent states,
0 leaks and 0 crashes. The same workload with deferral planted away is in
test_planted_defects.py, and must find the inconsistencies.
"""

from __future__ import annotations

import signal
import threading

import pytest

from extkv import ExtensibleTensor
from extkv.deferred_signals import deferred_signals, deferring
from extkv.testing.checks import check_readback_matches_bookkeeping
from extkv.testing.interrupts import run_in_child
from extkv.vmm.wrapping import WrappingDriver

SEED = 20261201
#: Interrupts that must land while extkv code runs.
INSIDE_TARGET = 1000


class Raised(Exception):
    pass


@pytest.fixture
def raising_handler():
    """SIGUSR1's handler raises `Raised` and records the frame it was given."""
    frames = []

    def handler(number, frame):
        frames.append(frame)
        raise Raised(number)

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        yield handler, frames
    finally:
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.invariant(6)
def test_a_handler_that_raises_runs_once_when_the_outermost_deferral_ends(raising_handler):
    handler, frames = raising_handler
    reached = []
    with pytest.raises(Raised):
        with deferred_signals():
            with deferred_signals():
                signal.raise_signal(signal.SIGUSR1)
                reached.append("inner body")
            reached.append("outer body")
            assert deferring()
    assert reached == ["inner body", "outer body"], reached
    assert len(frames) == 1, f"the handler ran {len(frames)} times"
    assert frames[0] is not None and frames[0].f_code.co_name == test_a_handler_that_raises_runs_once_when_the_outermost_deferral_ends.__name__
    assert signal.getsignal(signal.SIGUSR1) is handler, "the handler was not put back"
    assert not deferring()


@pytest.mark.invariant(6)
def test_outside_a_deferral_and_off_the_main_thread_handlers_are_untouched(raising_handler):
    handler, frames = raising_handler
    with pytest.raises(Raised):
        signal.raise_signal(signal.SIGUSR1)
    seen = []

    def other_thread():
        with deferred_signals():
            seen.append((deferring(), signal.getsignal(signal.SIGUSR1) is handler))

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    assert seen == [(False, True)], seen


@pytest.mark.invariant(6)
def test_a_deferred_handler_raises_after_an_error_of_the_operation_itself(raising_handler):
    with pytest.raises(Raised) as caught:
        with deferred_signals():
            signal.raise_signal(signal.SIGUSR1)
            raise ValueError("the operation's own error")
    assert isinstance(caught.value.__context__, ValueError), repr(caught.value.__context__)


class SignalsBetweenSteps(WrappingDriver):
    """The real driver, raising SIGUSR1 in this process right after each
    chunk is created, before the tensor has recorded it."""

    def _create(self, size):
        chunk = self.inner._create(size)
        signal.raise_signal(signal.SIGUSR1)
        return chunk

    def _release(self, chunk):
        self.inner._release(chunk)
        signal.raise_signal(signal.SIGUSR1)


@pytest.mark.invariant(6)
def test_a_signal_between_two_driver_steps_raises_once_the_operation_completed(raising_handler, driver):
    handler, frames = raising_handler
    granule = driver.granularity
    tensor = ExtensibleTensor(4 * granule, device=SignalsBetweenSteps(driver), segment_capacities=[2 * granule] * 2)
    try:
        with pytest.raises(Raised):
            tensor.resize_segments_([granule, 2 * granule], zero_new=True)
        assert tensor.segment_sizes == [granule, 2 * granule], "the commit stopped half way"
        assert tensor.physical_bytes == 3 * granule and tensor.num_physical_chunks == 2
        check_readback_matches_bookkeeping(tensor)
        with pytest.raises(Raised):
            tensor.release_physical()
        assert tensor.physical_bytes == 0 and tensor.num_physical_chunks == 0, "the release stopped half way"
        assert len(frames) == 2, f"the handler ran {len(frames)} times for two operations"
    finally:
        tensor.free()


@pytest.mark.invariant(5, 6)
def test_interrupts_at_random_moments_leave_every_object_consistent(device):
    code, tally = run_in_child(device, inside_target=INSIDE_TARGET, seed=SEED)
    assert code == 0 and tally is not None, f"the interrupted child exited with {code} and sent {tally}"
    assert tally["problem_count"] == 0, f"{tally['problem_count']} problems: {tally['problems']}"
    assert tally["inside"] >= INSIDE_TARGET, f"only {tally['inside']} of {tally['interrupts']} interrupts landed in extkv"
    never = sorted(set(tally["operations"]) - set(tally["interrupted"]))
    assert not never, f"operations never interrupted: {never}"


@pytest.mark.invariant(6)
def test_a_child_forked_from_another_thread_defers_in_its_own_main_thread():
    """The thread that forks is the child's main thread, where Python runs
    the child's handlers: the deferral must hold there."""
    import os

    outcome = {}

    def fork_and_wait() -> None:
        pid = os.fork()
        if pid == 0:
            with deferred_signals():
                held = deferring()
            os._exit(0 if held else 3)
        _, status = os.waitpid(pid, 0)
        outcome["exit"] = os.waitstatus_to_exitcode(status)

    thread = threading.Thread(target=fork_and_wait)
    thread.start()
    thread.join()
    assert outcome == {"exit": 0}, f"the child's deferral did not hold in its main thread: {outcome}"
