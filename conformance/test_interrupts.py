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

import contextlib
import inspect
import os
import signal
import socket
import sys
import threading

import pytest

from extkv import ExtensibleTensor
from extkv.cache import ExtensibleKVCache
from extkv.connector import SegmentExportConnector
from extkv.deferred_signals import deferred_signals, deferring, run_deferred
from extkv.layout import KVCacheLayout
from extkv.peer import import_segments
from extkv.testing.checks import check_readback_matches_bookkeeping
from extkv.testing.configs import config_for
from extkv.testing.descriptors import left_open, open_descriptors
from extkv.wire import close_all
from extkv.testing.interrupts import run_in_child
from extkv.vmm import live_reservations
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


@contextlib.contextmanager
def an_export(device):
    """(connector, sender, receiver): a connector with a one-block cache
    registered, and a connected socket pair; all freed after."""
    layout = KVCacheLayout.LHBNC
    cache = ExtensibleKVCache(config_for("full", layout, 4), device, layout)
    connector = SegmentExportConnector()
    sender, receiver = socket.socketpair()
    try:
        cache.commit(1, defragment=True)
        connector.register_kv_caches(cache)
        yield connector, sender, receiver
    finally:
        sender.close()
        receiver.close()
        connector.close()
        cache.free()


@contextlib.contextmanager
def an_import(device):
    """An import of `an_export`'s cache, exported from a thread of this
    process."""
    with an_export(device) as (connector, sender, receiver):
        exporter = threading.Thread(target=connector.export_to, args=(sender,), kwargs={"timeout": 30})
        exporter.start()
        try:
            yield import_segments(receiver, timeout=30)
        finally:
            exporter.join(30)


@contextlib.contextmanager
def raising_in(function, called_by: str, event: str, line: int | None = None):
    """A trace function that raises `Raised` in `function` where the
    function of qualified name `called_by` calls it, on `event` ("call": its
    first instruction; "line": at `line`), as an interrupt landing there
    does. This thread only."""
    code = function.__code__

    def trace(frame, seen, arg):
        if frame.f_code is not code or frame.f_back is None or frame.f_back.f_code.co_qualname != called_by:
            return None
        if seen == event and (line is None or frame.f_lineno == line):
            raise Raised(seen)
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        yield
    finally:
        sys.settrace(previous)


@pytest.mark.invariant(5, 6)
def test_an_interrupt_on_the_first_instruction_of_a_deferred_close_leaves_it_open_for_a_retry(device):
    with an_import(device) as imported:
        kind = imported.driver.kind
        held, sizes = live_reservations[kind], imported.segment_sizes
        with pytest.raises(Raised), raising_in(run_deferred, "ImportedSegments.close", "call"):
            imported.close()
        assert not imported.closed and live_reservations[kind] == held, "an interrupt before any step did some"
        assert imported.segment_sizes == sizes and sum(sizes) > 0, f"segment sizes {imported.segment_sizes}, {sizes} before"
        imported.close()
        assert imported.closed and live_reservations[kind] == held - 1, f"{live_reservations[kind]} reservations after the retry, {held} before"


@pytest.mark.invariant(5, 6)
def test_an_interrupt_as_a_deferred_close_enters_its_deferral_still_closes(device):
    lines, first = inspect.getsourcelines(run_deferred)
    entering = first + next(i for i, text in enumerate(lines) if "with _DEFERRAL" in text)
    with an_import(device) as imported:
        kind = imported.driver.kind
        held = live_reservations[kind]
        with pytest.raises(Raised), raising_in(run_deferred, "ImportedSegments.close", "line", entering):
            imported.close()
        assert imported.closed and live_reservations[kind] == held - 1, f"{live_reservations[kind]} reservations, {held} before the close"


@pytest.mark.invariant(5, 6)
@pytest.mark.parametrize("where", [(close_all, "SegmentExportConnector.export_to"), (run_deferred, "close_all")],
                         ids=["close_all", "its run_deferred"])
def test_an_interrupt_on_the_way_into_closing_an_exports_descriptors_leaves_none_open(device, where):
    """export_to closes the descriptors it exported whatever happens: an
    interrupt on the first instruction of the call that closes them (which
    raises before that call runs) too."""
    with an_export(device) as (connector, sender, receiver):
        importer = threading.Thread(target=lambda: import_segments(receiver, timeout=30).close())
        before = open_descriptors()
        importer.start()
        try:
            with pytest.raises(Raised), raising_in(*where, "call"):
                connector.export_to(sender, timeout=30)
        finally:
            importer.join(30)
        assert left_open(before) == [], "descriptors left open by the interrupted export"


class DoublingSocket(socket.socket):
    """A socket that passes every descriptor twice: a peer that sends more
    than its header announced, which the import refuses having received
    them."""

    def sendmsg(self, buffers, ancdata=(), flags=0, address=None):
        return super().sendmsg(buffers, [(level, kind, data + data) for level, kind, data in ancdata], flags)


@pytest.mark.invariant(5, 6)
def test_an_interrupt_on_the_way_into_closing_a_failed_imports_descriptors_leaves_none_open(device):
    """An import that fails after receiving descriptors closes them: an
    interrupt on the first instruction of the call that closes them too."""
    with an_export(device) as (connector, sender, receiver):
        before = open_descriptors()
        doubling = DoublingSocket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=os.dup(sender.fileno()))

        def export() -> None:
            with contextlib.suppress(Exception):  # the importer hangs up on it
                connector.export_to(doubling, timeout=30)

        exporter = threading.Thread(target=export)
        exporter.start()
        try:
            with pytest.raises(Raised) as raised, raising_in(close_all, "_import", "call"):
                import_segments(receiver, timeout=30)
        finally:
            doubling.shutdown(socket.SHUT_RDWR)
            exporter.join(30)
            doubling.close()
        assert isinstance(raised.value.__context__, ConnectionError), f"the import failed with {raised.value.__context__!r}"
        assert left_open(before) == [], "descriptors left open by the interrupted import"


@pytest.mark.invariant(5, 6)
@pytest.mark.long
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
