"""Host driver locks: what one reservation, one thread or one process can
do to the commits and the bookkeeping of another.

The host driver keeps one address book for the whole process (which
memfd each mapping holds), and serializes commits with one lock per
process and one per machine. Here each of them is driven by real threads,
real forks and real processes holding the real lock file, at moments
chosen by events and pipes, never by sleeping:

- *Address book.* A thread's operations are traced line by line through
  the host driver, and at every line it runs without holding the address
  book's lock, another thread maps or unmaps a chunk of a reservation of
  its own (`Interleaver`): every interleaving the lock allows is run, and
  none may fail either side or leave the first thread's object holding
  less than it records.
- *Fork.* A child forked while a thread commits (paused inside its first
  create, both commit locks held) must hold neither lock: the parent's next
  commit, another process's and the child's own all go through at once
  while the child lives.
- *The machine's lock file.* Another process's commit in its admission:
  this process's commit waits until it leaves. Another process holding the
  lock, a FIFO or a symbolic link at its path, and Ctrl-C during the wait:
  the commit goes on within the bound, at once, or lands the interrupt with
  nothing changed.
  These run on a lock file of their own (`COMMITS_LOCK_PATH` set to a
  temporary path), never on the machine's.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest

import extkv
from extkv.connector import SegmentExportConnector
from extkv.peer import import_segments
from extkv.testing.checks import check_readback_matches_bookkeeping
from extkv.testing.children import python_c
from extkv.testing.configs import config_for
from extkv.testing.ctrl_c import python_handles_ctrl_c
from extkv.testing.stress.child import child_env
from extkv.vmm import HostDriver, host, host_commits
from extkv.vmm.wrapping import WrappingDriver

pytestmark = pytest.mark.invariant(7)

#: Safety net against a hang, never a synchronization: every wait below is
#: on an event or a pipe that the other side sets once it has done its part.
HANG_S = 60


@pytest.fixture
def driver() -> HostDriver:
    return HostDriver()


class Interleaver:
    """A reservation of its own, whose one chunk a thread of its own maps
    and unmaps by turns, one step each time `step()` asks and waits for it."""

    def __init__(self, driver: HostDriver):
        self.driver = driver
        self.size = driver.granularity
        self.base = driver.reserve(self.size)
        self.chunk = driver.create(self.size)
        self.mapped = False
        self.steps = 0
        self._asks: queue.Queue[bool] = queue.Queue()
        self._done: queue.Queue[BaseException | None] = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name="interleaver")
        self._thread.start()

    def _serve(self) -> None:
        while self._asks.get():
            try:
                if self.mapped:
                    self.driver.unmap(self.base, self.size)
                else:
                    self.driver.map(self.base, self.chunk)
                    self.driver.set_access(self.base, self.size)
                    self.driver.view(self.base, self.size)[-1] = self.steps % 251
                self.mapped = not self.mapped
                self.steps += 1
                self._done.put(None)
            except BaseException as error:  # noqa: B036 - handed to the thread that asked
                self._done.put(error)

    def step(self) -> None:
        self._asks.put(True)
        error = self._done.get(timeout=HANG_S)
        if error is not None:
            raise error

    def close(self) -> None:
        self._asks.put(False)
        self._thread.join(HANG_S)
        assert not self._thread.is_alive(), "the interleaving thread hung"
        if self.mapped:
            self.driver.unmap(self.base, self.size)
        self.driver.release(self.chunk)
        self.driver.free_reservation(self.base, self.size)

    def tracer(self):
        """A `sys.settrace` function: at each line of the host driver the
        traced thread runs while the address book is unlocked, one step."""

        def local(frame, event, arg):
            if event == "line" and not host.ADDRESS_BOOK_LOCK.locked():
                self.step()
            return local

        def on_call(frame, event, arg):
            return local if frame.f_code.co_filename == host.__file__ else None

        return on_call

    def run_traced(self, operation) -> BaseException | None:
        """`operation()` on a thread of its own, traced; what it raised."""
        outcome: list[BaseException | None] = []

        def traced() -> None:
            sys.settrace(self.tracer())
            try:
                operation()
                outcome.append(None)
            except BaseException as error:  # noqa: B036 - reported to the test
                outcome.append(error)
            finally:
                sys.settrace(None)

        thread = threading.Thread(target=traced, name="traced")
        thread.start()
        thread.join(HANG_S)
        assert not thread.is_alive(), "the traced operation hung"
        return outcome[0]


@pytest.fixture
def interleaver(driver):
    interleaver = Interleaver(driver)
    yield interleaver
    interleaver.close()


def fragmented_tensor(driver: HostDriver) -> extkv.ExtensibleTensor:
    """One segment of three granules over three chunks, each granule's last
    byte its index."""
    g = driver.granularity
    tensor = extkv.ExtensibleTensor(3 * g, device=driver)
    for granules in (1, 2, 3):
        tensor.resize_segments_([granules * g])
        tensor.segment_view(0)[granules * g - 1] = granules
    return tensor


def test_a_thread_grows_defragments_and_frees_while_another_maps_and_unmaps(driver, interleaver):
    """A preserving defragment frees its scratch reservation and `free()`
    its reservation, each walking the address book while the other thread
    maps and unmaps in its own reservation: every step of both succeeds."""
    g = driver.granularity
    tensor = fragmented_tensor(driver)
    try:
        def defragment_then_free() -> None:
            tensor.resize_segments_([3 * g], zero_new=True)
            assert tensor.defragment_segment_(0)
            assert [int(tensor.segment_view(0)[k * g - 1]) for k in (1, 2, 3)] == [1, 2, 3]
            check_readback_matches_bookkeeping(tensor)
            tensor.free()

        error = interleaver.run_traced(defragment_then_free)
        assert error is None, f"with another reservation mapping and unmapping meanwhile: {error!r}"
        assert interleaver.steps > 10, f"only {interleaver.steps} steps interleaved"
    finally:
        tensor.free()


def test_an_import_closes_while_another_thread_maps_and_unmaps(driver, interleaver):
    """`ImportedSegments.close()` frees the import's reservation with the
    same walk of the address book, here with a cache exported from this
    process and imported by a traced thread."""
    layout = extkv.KVCacheLayout.LBHNC
    cache = extkv.ExtensibleKVCache(config_for("full", layout, 8), driver, layout)
    connector = SegmentExportConnector()
    sender, receiver = socket.socketpair()
    try:
        cache.commit(2)
        connector.register_kv_caches(cache)
        connector.export_to(sender)

        def import_then_close() -> None:
            imported = import_segments(receiver, driver=driver)
            assert imported.segment_sizes
            imported.close()
            assert imported.closed

        error = interleaver.run_traced(import_then_close)
        assert error is None, f"with another reservation mapping and unmapping meanwhile: {error!r}"
    finally:
        sender.close()
        receiver.close()
        connector.close()
        cache.free()


MAP_FIXED_NOREPLACE = 0x100000


def occupy(address: int, size: int) -> int:
    """Map `size` bytes of anonymous memory at exactly `address` (refused if
    anything is there): what another library would get from the kernel once
    the range is free."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    got = libc.mmap(address, size, 0x3, 0x22 | MAP_FIXED_NOREPLACE, -1, 0)  # RW, MAP_PRIVATE|MAP_ANONYMOUS
    assert got == address, f"could not map {size} bytes at {address:#x} (errno {ctypes.get_errno()})"
    return got


def is_mapped(address: int, size: int) -> bool:
    """Whether /proc/self/maps covers the whole of [address, address+size)."""
    covered = address
    with open("/proc/self/maps") as maps:
        for line in maps:
            start, end = (int(part, 16) for part in line.split()[0].split("-"))
            if start <= covered < end:
                covered = end
    return covered >= address + size


def test_a_retried_free_never_unmaps_what_it_no_longer_owns(driver, interleaver):
    """Whatever a first `free()` meets (here: another thread mapping and
    unmapping at every unlocked line), either it freed the reservation and
    a retry does nothing, or it raised and still owns all of it. Once the
    range is free another mapping takes it, and the retry leaves it alone."""
    tensor = fragmented_tensor(driver)
    base, size = tensor.base, tensor.reserved_bytes
    first = interleaver.run_traced(tensor.free)
    if is_mapped(base, size):
        assert first is not None, "free() returned but the reservation is still mapped"
        other = None
    else:
        other = occupy(base, size)
        ctypes.memset(other, 7, size)
    try:
        with contextlib.suppress(Exception):
            tensor.free()  # the retry a caller makes after a failure
        if other is not None:
            assert is_mapped(other, size), (
                f"the retried free unmapped {size} bytes at {other:#x} that it no longer owned (first free raised "
                f"{first!r})")
            assert ctypes.string_at(other, 1) == b"\x07"
        assert first is None, f"free() failed with another reservation mapping and unmapping meanwhile: {first!r}"
    finally:
        if other is not None:
            ctypes.CDLL(None).munmap(ctypes.c_void_p(other), ctypes.c_size_t(size))


@pytest.fixture
def lock_path(tmp_path, monkeypatch) -> str:
    """The machine's commit lock, moved to a file of this test's own."""
    path = str(tmp_path / "extkv-host-commits.lock")
    monkeypatch.setattr(host_commits, "COMMITS_LOCK_PATH", path)
    return path


def lock_is_free(path: str) -> bool:
    """Whether an flock on `path` can be taken now, from a descriptor of this test's own."""
    descriptor = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(descriptor)


class PausedCreate(WrappingDriver):
    """A real driver whose first create waits for `resume`, the commit's
    locks held; `inside` is set once it waits."""

    def __init__(self, inner: HostDriver):
        super().__init__(inner)
        self.inside = threading.Event()
        self.resume = threading.Event()

    def _create(self, size: int):
        if not self.inside.is_set():
            self.inside.set()
            assert self.resume.wait(HANG_S), "the paused create was never resumed"
        return self.inner._create(size)


COMMITS_ELSEWHERE = """
import sys, warnings
import extkv
from extkv.vmm import HostDriver, host_commits
host_commits.COMMITS_LOCK_PATH = sys.argv[1]
host_commits.MACHINE_LOCK_WAIT_S = 0.0
warnings.simplefilter("error", RuntimeWarning)  # going on without the lock fails
driver = HostDriver()
with extkv.ExtensibleTensor(driver.granularity, device=driver) as tensor:
    tensor.resize_segments_([driver.granularity])
"""


def commits_elsewhere(lock_path: str, outputs: Path) -> subprocess.CompletedProcess:
    """Another process's commit that must get the lock at its first try: a
    child of the fork server (extkv.testing.children), which shares no
    descriptor with this process."""
    return python_c(f"import sys\nsys.argv = {['-c', lock_path]!r}\n{COMMITS_ELSEWHERE}", outputs, timeout=HANG_S)


def commit_one_granule(driver: HostDriver) -> list[int]:
    with extkv.ExtensibleTensor(driver.granularity, device=driver) as tensor:
        tensor.resize_segments_([driver.granularity])
        return tensor.segment_sizes


def _child_commits(commit_now: int, report: int) -> None:
    """In the forked child: on the parent's word commit a tensor of its own,
    say how it went, then live until the parent's next word."""
    status = 1
    try:
        os.write(report, b"forked\n")  # past the fork's handlers
        os.read(commit_now, 1)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            sizes = commit_one_granule(HostDriver())
        os.write(report, f"committed {sizes}\n".encode())
        os.read(commit_now, 1)
        status = 0
    except BaseException as error:  # noqa: B036 - reported to the parent
        os.write(report, f"{error!r}\n".encode())
    finally:
        os._exit(status)


def read_line(descriptor: int) -> str:
    ready, _, _ = select.select([descriptor], [], [], HANG_S)
    return os.read(descriptor, 4096).decode().strip() if ready else "(nothing: the child hung)"


@pytest.mark.long
def test_a_child_forked_during_a_commit_holds_none_of_its_locks(driver, lock_path, monkeypatch, tmp_path):
    """The child's copy of the in-flight commit's lock descriptor is closed
    at the fork and its process lock is new: once the parent's commit ends,
    the parent's next commit and another process's get the machine lock at
    the first try (no wait at all) while the child lives, and the child
    commits a tensor of its own."""
    monkeypatch.setattr(host_commits, "MACHINE_LOCK_WAIT_S", 0.0)
    g = driver.granularity
    paused = PausedCreate(driver)
    tensor = extkv.ExtensibleTensor(g, device=paused)
    committing = threading.Thread(target=tensor.resize_segments_, args=([g],), name="committing")
    commit_now_r, commit_now = os.pipe()
    report, report_w = os.pipe()
    pid = None
    try:
        committing.start()
        assert paused.inside.wait(HANG_S), "the commit never reached its first create"
        pid = os.fork()
        if pid == 0:
            os.close(commit_now)  # the parent's end alone: its close ends the child's reads
            _child_commits(commit_now_r, report_w)
        os.close(commit_now_r)
        os.close(report_w)
        # Until the child has run the fork's handlers it holds its copy of
        # the lock's descriptor (a window of the child's scheduling, not of
        # its life): the parent's commit ends after that here.
        assert read_line(report) == "forked"
        paused.resume.set()
        committing.join(HANG_S)
        assert not committing.is_alive() and tensor.segment_sizes == [g]
        assert lock_is_free(lock_path), "the machine's commit lock stays held after the parent's commit: by the child"
        os.write(commit_now, b"c")
        assert read_line(report) == f"committed {[g]}"
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            assert commit_one_granule(driver) == [g]
        elsewhere = commits_elsewhere(lock_path, tmp_path / "elsewhere")
        assert elsewhere.returncode == 0, elsewhere.stderr[-2000:]
    finally:
        paused.resume.set()
        committing.join(HANG_S)
        # Closed, not written to: the child's reads end whichever it waits
        # in (a test that failed before the first word wrote none).
        os.close(commit_now)
        tensor.free()  # first: a tensor left to a failed assertion below would count in the worker's later tests
        if pid is not None:
            # The child may have ended already (the close above ends its
            # last read), and then this first wait reaps it.
            reaped, status = os.waitpid(pid, os.WNOHANG)
            if reaped == 0:
                if not select.select([report], [], [], HANG_S)[0]:
                    os.kill(pid, signal.SIGKILL)  # hung in its commit
                _, status = os.waitpid(pid, 0)
            os.close(report)
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"the child ended with status {status}"


HOLDS_THE_LOCK = """
import fcntl, os, sys
descriptor = os.open(sys.argv[1], os.O_RDONLY | os.O_CREAT, 0o644)
fcntl.flock(descriptor, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.readline()  # until the test is done
"""


@contextlib.contextmanager
def lock_held_elsewhere(path: str):
    """Another process holding the flock on `path`; a safety net lets it go
    after HANG_S, should a commit wait for it unboundedly."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDS_THE_LOCK, path], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    safety_net = threading.Timer(HANG_S, holder.stdin.close)
    try:
        assert holder.stdout.readline().strip() == "held"
        safety_net.start()
        yield holder
    finally:
        safety_net.cancel()
        holder.stdin.close()
        holder.wait(HANG_S)


def test_a_commit_waits_for_another_processs_lock_no_longer_than_the_bound(driver, lock_path, monkeypatch):
    """Past MACHINE_LOCK_WAIT_S the commit goes on with its own headroom
    check, warning with the lock's path and the holder's pid."""
    monkeypatch.setattr(host_commits, "MACHINE_LOCK_WAIT_S", 0.2)
    g = driver.granularity
    with extkv.ExtensibleTensor(g, device=driver) as tensor, lock_held_elsewhere(lock_path) as holder:
        with pytest.warns(RuntimeWarning, match="commit lock") as warned:
            tensor.resize_segments_([g])
        assert not holder.stdin.closed, "the commit went on only once the holder was let go"
        assert tensor.segment_sizes == [g]
        message = str(warned[0].message)
        assert lock_path in message and f"pid {holder.pid}" in message, message


HOLDS_A_COMMIT = """
import sys, time
from extkv.vmm import HostDriver, host_commits
host_commits.COMMITS_LOCK_PATH = sys.argv[1]
with HostDriver().admit(1):
    print("admitted", flush=True)
    sys.stdin.readline()  # until the test says leave
    print("leaving", time.monotonic(), flush=True)  # CLOCK_MONOTONIC: one clock for every process
"""


@pytest.mark.long
def test_two_processes_commit_one_after_the_other(driver, lock_path, monkeypatch):
    """While another process is between its commit's check and its last
    create, this process's commit waits: two commits cannot both pass on one
    reading of the headroom. The other process leaves its admission only
    once this one's commit has been refused the lock twice (it is still
    waiting) or was admitted (it did not wait: the defect)."""
    refusals: list[int] = []
    decided = threading.Event()  # refused twice, or admitted
    real_flock = fcntl.flock

    def flock(descriptor: int, operation: int) -> None:
        try:
            real_flock(descriptor, operation)
        except BlockingIOError:
            refusals.append(operation)
            if len(refusals) == 2:
                decided.set()
            raise

    monkeypatch.setattr(fcntl, "flock", flock)
    holder = subprocess.Popen([sys.executable, "-c", HOLDS_A_COMMIT, lock_path], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=child_env())
    entered: list[float] = []

    def commit() -> None:
        with driver.admit(driver.granularity):
            entered.append(time.monotonic())
            decided.set()

    committing = threading.Thread(target=commit, name="commit")
    try:
        assert holder.stdout.readline().strip() == "admitted"
        committing.start()
        assert decided.wait(HANG_S), f"this process's commit neither waited nor went on ({len(refusals)} refusals)"
        assert not entered, f"admitted after {len(refusals)} refusals, while the other process held its admission"
        holder.stdin.write("leave\n")
        holder.stdin.flush()
        leaving = float(holder.stdout.readline().split()[1])
    finally:
        holder.stdin.close()
        holder.wait(HANG_S)
        if committing.ident is not None:
            committing.join(HANG_S)
    assert entered and entered[0] >= leaving, f"admitted at {entered}, before the other process left at {leaving}"


@pytest.mark.parametrize("planted", ["FIFO", "symbolic link"])
def test_something_planted_at_the_lock_path_is_refused_at_once(driver, lock_path, tmp_path, planted):
    """No open of the path can block (a FIFO without a writer would) nor
    follow a link elsewhere: the commit goes on at once, warning why."""
    if planted == "FIFO":
        os.mkfifo(lock_path)
        # Safety net: a commit blocked opening the FIFO goes on once a writer opens it.
        safety_net = threading.Timer(HANG_S, lambda: os.close(os.open(lock_path, os.O_WRONLY | os.O_NONBLOCK)))
    else:
        target = tmp_path / "elsewhere"
        target.touch()
        os.symlink(target, lock_path)
        safety_net = threading.Timer(HANG_S, lambda: None)
    g = driver.granularity
    safety_net.start()
    try:
        with extkv.ExtensibleTensor(g, device=driver) as tensor:
            with pytest.warns(RuntimeWarning, match="commit lock") as warned:
                tensor.resize_segments_([g])
            assert safety_net.is_alive(), "the commit went on only once the safety net opened the FIFO"
            assert tensor.segment_sizes == [g]
    finally:
        safety_net.cancel()
    message = str(warned[0].message)
    assert lock_path in message and ("a FIFO" if planted == "FIFO" else "ELOOP") in message, message


def test_under_warnings_as_errors_a_commit_past_a_planted_lock_still_goes_on(driver, lock_path, recwarn):
    """The warning says what was already done: filters that make warnings
    errors (-W error) must not turn it into a refused commit."""
    os.mkfifo(lock_path)
    g = driver.granularity
    with extkv.ExtensibleTensor(g, device=driver) as tensor, warnings.catch_warnings():
        warnings.simplefilter("error")
        tensor.resize_segments_([g])
        assert tensor.segment_sizes == [g] and tensor.physical_bytes == g


class SaysWhenAdmitting(WrappingDriver):
    """A real driver that sets `admitting` as a commit asks for admission,
    before it waits for any lock."""

    def __init__(self, inner: HostDriver):
        super().__init__(inner)
        self.admitting = threading.Event()

    def admit(self, size: int, chunks: int = 1):
        self.admitting.set()
        return self.inner.admit(size, chunks)


def test_ctrl_c_while_waiting_for_the_lock_lands_and_changes_nothing(driver, lock_path, monkeypatch):
    """SIGINT sent once the commit asks for admission, while another process
    holds the lock and the bound is far away: KeyboardInterrupt, with the
    wait's DriverError (naming the lock and the holder) as its context, and
    the tensor as it was."""
    monkeypatch.setattr(host_commits, "MACHINE_LOCK_WAIT_S", 10 * HANG_S)
    g = driver.granularity
    wrapper = SaysWhenAdmitting(driver)
    main = threading.main_thread().ident

    def interrupt() -> None:
        if wrapper.admitting.wait(HANG_S):
            signal.pthread_kill(main, signal.SIGINT)

    with extkv.ExtensibleTensor(g, device=wrapper) as tensor, lock_held_elsewhere(lock_path) as holder:
        sender = threading.Thread(target=interrupt, name="interrupt")
        sender.start()
        try:
            with python_handles_ctrl_c(), pytest.raises(KeyboardInterrupt) as interrupted:
                tensor.resize_segments_([g])
        finally:
            sender.join(HANG_S)
        assert not holder.stdin.closed, "the interrupt landed only once the holder was let go"
        assert tensor.segment_sizes == [0] and tensor.mapped_chunks == []
        check_readback_matches_bookkeeping(tensor)
        context = str(interrupted.value.__context__)
        assert lock_path in context and f"pid {holder.pid}" in context, context
