"""Host driver conformance: what its chunks promise to whoever shares them
(seals, read-only exports, imports of sealed memfds only), and that a create
the kernel cannot satisfy, for the machine or for this process's memory
cgroup, is refused before any page is allocated.

Everything here runs on real memfds, mappings and (where this process may
create one) a real child cgroup; the memory check's arithmetic is also tested
on made-up readings, since the real machine's readings cannot be chosen.
Over-large requests run under a file-size limit or in a limited cgroup, so a
driver that lost its check fails the test instead of filling the machine.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import multiprocessing
import os
import resource
import signal
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

import extkv
from extkv.errors import DriverError, OutOfMemoryError
from extkv.testing.checks import check_readback_matches_bookkeeping, maps_permissions
from extkv.testing.children import python_c
from extkv.usage import host_chunk_bytes, open_chunk_fds
from extkv.vmm import HostDriver, host_maps, host_memory, live_chunks, live_reservations
from extkv.vmm.base import READ_ONLY, READ_WRITE
from extkv.vmm.host import F_SEAL_FUTURE_WRITE
from extkv.vmm.host_memory import (
    HOST_KEEP_FREE_DESCRIPTORS,
    CgroupMemoryReading,
    MemoryHeadroom,
    cgroup_memory_files,
    host_memory_headroom,
    read_host_memory_headroom,
)


def live_counts() -> tuple[dict, dict]:
    nonzero = lambda counts: {kind: count for kind, count in counts.items() if count}  # noqa: E731
    return nonzero(live_chunks), nonzero(live_reservations)


@pytest.fixture
def driver() -> HostDriver:
    return HostDriver()


@pytest.mark.invariant(8)
def test_chunks_are_sealed_against_shrink_and_grow(driver):
    chunk = driver.create(driver.granularity)
    size = driver.granularity
    try:
        fd = chunk.handle
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) == fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
        assert stat.S_IMODE(os.fstat(fd).st_mode) == 0o600
        for attempt in (
            lambda: os.ftruncate(fd, 0),
            lambda: os.ftruncate(fd, 2 * size),
            lambda: os.posix_fallocate(fd, size, size),
        ):
            with pytest.raises(PermissionError):
                attempt()
        assert os.fstat(fd).st_size == size
        # The seals leave writing alone: this process's own mapping works.
        base = driver.reserve(size)
        try:
            driver.map(base, chunk)
            driver.set_access(base, size)
            view = driver.view(base, size)
            view[-1] = 42
            assert int(view[-1]) == 42 and maps_permissions(base) == "rw-s"
            driver.unmap(base, size)
        finally:
            driver.free_reservation(base, size)
    finally:
        driver.release(chunk)


def punch_hole(fd: int, size: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x1, 0x2
    if libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, ctypes.c_long(0), ctypes.c_long(size)):
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


@pytest.mark.invariant(8)
def test_a_read_only_export_seals_the_chunk_against_every_new_write_access(driver):
    """After the first read-only export nobody can write the memfd, punch a
    hole in it or map it writable, also through a descriptor reopened
    read-write via /proc (what a process under the same uid can do), while
    the exporter's own mapping keeps working."""
    g = driver.granularity
    tensor = extkv.ExtensibleTensor(g, device=driver)
    exported = reopened = None
    try:
        tensor.resize_segments_([g], zero_new=True)
        fd = tensor.mapped_chunks[0].chunk.handle
        exported = driver.export_fd(tensor.mapped_chunks[0].chunk)
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) == (
            fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)
        reopened = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
        for name, attempt in (
            ("write", lambda: os.pwrite(reopened, b"x", 0)),
            ("punch a hole", lambda: punch_hole(reopened, g)),
            ("map writable", lambda: mmap.mmap(reopened, g, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE).close()),
            ("truncate", lambda: os.ftruncate(reopened, 0)),
            ("add a seal", lambda: fcntl.fcntl(reopened, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)),
        ):
            with pytest.raises(PermissionError):
                attempt()
                pytest.fail(f"{name} through a read-write reopen succeeded")
        view = tensor.segment_view(0)
        view[-1] = 9
        assert int(view[-1]) == 9 and os.pread(exported, 1, g - 1) == b"\x09"
    finally:
        for descriptor in (exported, reopened):
            if descriptor is not None:
                os.close(descriptor)
        tensor.free()


@pytest.mark.invariant(6, 8)
def test_a_chunk_exported_read_only_is_never_exported_writable(driver):
    """The seal is for good: a writable export is refused, naming why. A
    writable export of a fresh chunk seals it against new seals, so the
    trusted peer cannot seal it against this process."""
    first, second = driver.create(driver.granularity), driver.create(driver.granularity)
    descriptors = []
    try:
        descriptors.append(driver.export_fd(first))
        with pytest.raises(ValueError, match=r"exported read-only, which sealed it against new write access"):
            driver.export_fd(first, writable=True)
        descriptors.append(driver.export_fd(second, writable=True))
        assert fcntl.fcntl(second.handle, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SEAL
        with pytest.raises(PermissionError):
            fcntl.fcntl(descriptors[-1], fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE)
    finally:
        for descriptor in descriptors:
            os.close(descriptor)
        driver.release(first)
        driver.release(second)


@pytest.mark.invariant(3, 8)
def test_a_failed_defragment_puts_exported_chunks_back_writable(driver):
    """A preserving defragment whose swap fails maps the old chunks back;
    those exported read-only are sealed against new writable mappings, so
    their mappings are moved aside and back instead: the tensor stays live,
    keeps every byte, writes where it wrote, and the retry completes."""
    g = driver.granularity
    faulty = extkv.FaultInjectingDriver(driver)
    tensor = extkv.ExtensibleTensor(4 * g, device=faulty, segment_capacities=[2 * g, 2 * g])
    exported = []
    try:
        tensor.resize_segments_([g, g], zero_new=True)
        tensor.resize_segments_([2 * g, 2 * g], zero_new=True)
        assert tensor.num_physical_chunks == 4
        exported = [driver.export_fd(mapped.chunk) for mapped in tensor.mapped_chunks]
        view = tensor.full_view()
        view.copy_(torch.arange(4 * g, dtype=torch.int64).remainder(251).to(torch.uint8))
        before = view.clone()
        faulty.fail_in("set_access", 3)  # after the two scratch grants: the first swap's, its old chunks unmapped
        with pytest.raises(extkv.DriverError, match="injected fault"):
            tensor.defragment_segments_()
        assert not tensor.is_broken, "the undo could not map an exported chunk back writable"
        check_readback_matches_bookkeeping(tensor)
        assert torch.equal(tensor.full_view(), before), "the failed defragment changed a byte"
        assert all(maps_permissions(mapped.address) == "rw-s" for mapped in tensor.mapped_chunks)
        tensor.full_view()[0] = 250
        assert tensor.defragment_segments_() == [True, True] and tensor.num_physical_chunks == 2
        before[0] = 250
        assert torch.equal(tensor.full_view(), before)
    finally:
        for descriptor in exported:
            os.close(descriptor)
        tensor.free()


@pytest.mark.invariant(8)
def test_export_gives_a_read_only_descriptor_of_the_same_memory(driver):
    chunk = driver.create(driver.granularity)
    exported = driver.export_fd(chunk)
    try:
        assert fcntl.fcntl(exported, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
        assert fcntl.fcntl(exported, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
        mine, theirs = os.fstat(chunk.handle), os.fstat(exported)
        assert (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino)
        for attempt in (lambda: os.pwrite(exported, b"x", 0), lambda: os.ftruncate(exported, 0)):
            with pytest.raises(OSError) as raised:
                attempt()
            assert raised.value.errno in (errno.EBADF, errno.EINVAL)
    finally:
        os.close(exported)
        driver.release(chunk)


@pytest.mark.invariant(8)
def test_set_access_grants_what_is_asked_and_no_more_than_the_descriptor_allows(driver):
    """One range, two chunks: an import of a read-only export can be granted
    read access only (asking for write is refused by the kernel), the chunk
    beside it read-write, as the kernel reports."""
    g = driver.granularity
    counts = live_counts()
    with contextlib.ExitStack() as undo:
        own = driver.create(g)
        undo.callback(driver.release, own)
        neighbour = driver.create(g)
        undo.callback(driver.release, neighbour)
        # Written before the export: a read-only export seals the memfd against write().
        os.pwrite(own.handle, b"\x05", g - 1)
        exported = driver.export_fd(own)
        undo.callback(os.close, exported)
        imported = driver.import_fd(exported, g)
        undo.callback(driver.release, imported)
        base = driver.reserve(2 * g)
        undo.callback(driver.free_reservation, base, 2 * g)
        for address, chunk in ((base, imported), (base + g, neighbour)):
            driver.map(address, chunk)
            undo.callback(driver.unmap, address, g)
        with pytest.raises(DriverError, match=r"mprotect\(PROT_READ\|PROT_WRITE\) failed: EACCES"):
            driver.set_access(base, g)
        driver.set_access(base, g, writable=False)
        driver.set_access(base + g, g)
        assert maps_permissions(base) == "r--s" and maps_permissions(base + g) == "rw-s"
        assert int(driver.view(base, g)[-1]) == 5  # the same pages: written there, read here
        driver.view(base + g, g).fill_(7)
        assert int(driver.view(base + g, g).sum()) == 7 * g
    assert live_counts() == counts


def file_of(fd: int) -> tuple[int, int, int]:
    status = os.fstat(fd)
    return os.major(status.st_dev), os.minor(status.st_dev), status.st_ino


@pytest.mark.invariant(1, 8)
@pytest.mark.parametrize("by_ioctl", [True, False], ids=["PROCMAP_QUERY", "maps text"])
def test_read_back_names_each_granules_file_and_access_by_either_way_of_asking(driver, monkeypatch, by_ioctl):
    """Read back by PROCMAP_QUERY and by /proc/self/maps' text (what a kernel
    before 6.11 leaves), over a reservation of a read-only import, a
    read-write chunk beside it and an unmapped granule, asked in no order
    and twice over: each address names the memfd fstat names, with the
    access the kernel's maps show, and an unmapped one nothing."""
    monkeypatch.setattr(host_maps, "QUERY_MAPS_BY_IOCTL", by_ioctl)
    g = driver.granularity
    with contextlib.ExitStack() as undo:
        own = driver.create(g)
        undo.callback(driver.release, own)
        neighbour = driver.create(g)
        undo.callback(driver.release, neighbour)
        exported = driver.export_fd(own)
        undo.callback(os.close, exported)
        imported = driver.import_fd(exported, g)
        undo.callback(driver.release, imported)
        base = driver.reserve(3 * g)
        undo.callback(driver.free_reservation, base, 3 * g)
        for address, chunk, writable in ((base, imported, False), (base + g, neighbour, True)):
            driver.map(address, chunk)
            undo.callback(driver.unmap, address, g)
            driver.set_access(address, g, writable=writable)
        assert maps_permissions(base) == "r--s" and maps_permissions(base + g) == "rw-s"
        read_only, read_write = (file_of(imported.handle), READ_ONLY), (file_of(neighbour.handle), READ_WRITE)
        expected = {
            base + g - 1: read_only, base: read_only, base + 2 * g - 1: read_write, base + g: read_write,
            base + 2 * g: (None, None), base + 3 * g - 1: (None, None),
        }
        addresses = [*expected, *expected]
        assert driver.chunks_at(addresses) == [expected[a][0] for a in addresses]
        assert driver.accesses_at(addresses) == [expected[a][1] for a in addresses]


@pytest.mark.invariant(6, 8)
@pytest.mark.parametrize("kind", ["regular file", "unsealed memfd", "memfd sealed against shrinking only"])
def test_import_accepts_only_memfds_sealed_against_shrink_and_grow(driver, kind):
    g = driver.granularity
    counts = live_counts()
    if kind == "regular file":
        fd, path = tempfile.mkstemp(prefix="extkv-")
        os.unlink(path)
    else:
        fd = os.memfd_create("extkv-chunk", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, g)
        if kind == "memfd sealed against shrinking only":
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        with pytest.raises(ValueError, match=rf"import_fd: fd {fd} \(.*\) is not a memfd sealed with F_SEAL_SHRINK\|F_SEAL_GROW"):
            driver.import_fd(fd, g)
    finally:
        os.close(fd)
    assert live_counts() == counts


# -- memory headroom: arithmetic on made-up readings ------------------------------
MEMINFO = "MemTotal:       16000000 kB\nMemFree:          500000 kB\nMemAvailable:    1000000 kB\n"
MEM_AVAILABLE = 1_000_000 * 1024


@pytest.mark.invariant(5)
def test_usage_counts_a_released_chunk_while_it_stays_mapped(driver):
    """The witness sees what holds pages, not only what holds descriptors: a
    chunk released (its memfd closed) while still mapped keeps its pages, and
    the usage reading must say so until the mapping goes."""
    g = driver.granularity
    baseline = host_chunk_bytes()
    chunk = driver.create(2 * g)
    base = driver.reserve(2 * g)
    try:
        driver.map(base, chunk)
        driver.set_access(base, 2 * g)
        driver.view(base, 2 * g).fill_(1)
        driver.release(chunk)
        assert chunk.handle not in open_chunk_fds(), "release must close the chunk's descriptor"
        assert host_chunk_bytes() - baseline == 2 * g, "a mapped, released chunk still holds its pages"
        driver.unmap(base, 2 * g)
        assert host_chunk_bytes() == baseline, "unmapped and released: nothing is held"
    finally:
        driver.free_reservation(base, 2 * g)


@pytest.mark.invariant(5)
def test_headroom_is_mem_available_without_cgroup_limits():
    assert host_memory_headroom(MEMINFO) == MemoryHeadroom(
        MEM_AVAILABLE, f"MemAvailable {MEM_AVAILABLE} bytes in /proc/meminfo"
    )
    unlimited = CgroupMemoryReading("/sys/fs/cgroup/a", "max\n", "123\n")
    assert host_memory_headroom(MEMINFO, [unlimited]).available == MEM_AVAILABLE
    assert host_memory_headroom("MemTotal: 1 kB\n") == MemoryHeadroom(None, "no reading limits it")


@pytest.mark.invariant(5)
def test_headroom_is_the_tightest_cgroup_limit_less_usage_plus_reclaimable_cache():
    leaf = CgroupMemoryReading("/sys/fs/cgroup/a/b", "max\n", "400000000\n")
    parent = CgroupMemoryReading("/sys/fs/cgroup/a", "536870912\n", "436870912\n")
    assert host_memory_headroom(MEMINFO, [leaf, parent]) == MemoryHeadroom(
        100_000_000,
        "cgroup /sys/fs/cgroup/a: limit 536870912 - usage 436870912 + reclaimable file cache 0 bytes",
    )
    # File cache the kernel would drop before refusing counts as available (v2 names).
    v2_stat = "anon 9999\nfile 77777\ninactive_file 4096\nactive_file 8192\nshmem 5\n"
    cached = CgroupMemoryReading("/sys/fs/cgroup/a", "536870912\n", "436870912\n", v2_stat)
    assert host_memory_headroom(MEMINFO, [cached]).available == 100_000_000 + 12288
    # v1 reports hierarchical totals beside the cgroup's own counters: the totals count.
    v1_stat = "inactive_file 1\nactive_file 2\ntotal_inactive_file 40960\ntotal_active_file 81920\n"
    v1 = CgroupMemoryReading("/sys/fs/cgroup/memory/a", "536870912\n", "436870912\n", v1_stat)
    assert host_memory_headroom(MEMINFO, [v1]).available == 100_000_000 + 122880
    # Over its limit (usage may exceed it briefly): nothing, never negative.
    over = CgroupMemoryReading("/sys/fs/cgroup/a", "1000\n", "5000\n")
    assert host_memory_headroom(MEMINFO, [over]).available == 0
    # A loose cgroup limit leaves MemAvailable in charge.
    loose = CgroupMemoryReading("/sys/fs/cgroup/a", str(64 << 30), "0")
    assert host_memory_headroom(MEMINFO, [loose]).available == MEM_AVAILABLE


@pytest.mark.invariant(5)
def test_this_machine_has_a_headroom_below_its_memory():
    with open("/proc/meminfo") as meminfo:
        total = int(next(line for line in meminfo if line.startswith("MemTotal:")).split()[1]) * 1024
    headroom = read_host_memory_headroom(1)
    assert headroom.available is not None and 0 < headroom.available <= total, headroom


# -- memory headroom: the real refusal ---------------------------------------------
@contextlib.contextmanager
def file_size_limit(limit: int):
    """Were the driver's check missing, fallocate past `limit` would fail
    (EFBIG) instead of filling the machine and waking the OOM killer."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


@pytest.mark.invariant(5)
def test_a_create_beyond_memory_is_refused_before_any_page_is_allocated(driver):
    with open("/proc/meminfo") as meminfo:
        total = int(next(line for line in meminfo if line.startswith("MemTotal:")).split()[1]) * 1024
    g = driver.granularity
    size = -(-2 * total // g) * g
    memfds, counts = open_chunk_fds(), live_counts()
    with file_size_limit(4 * g):
        with pytest.raises(OutOfMemoryError) as raised:
            driver.create(size)
    assert open_chunk_fds() == memfds and live_counts() == counts
    error = raised.value
    assert (error.code, error.code_name, error.size) == (errno.ENOMEM, "ENOMEM", size)
    assert f"refused before allocating: {size} bytes requested, " in str(error)
    assert " available (" in str(error)
    # A create that fits still succeeds.
    chunk = driver.create(g)
    driver.release(chunk)


CGROUP_PEER = """
import os, sys
from extkv.errors import DriverError, OutOfMemoryError
from extkv.vmm import HostDriver
with open(os.path.join(sys.argv[1], "cgroup.procs"), "w") as procs:
    procs.write(str(os.getpid()))
driver = HostDriver()
try:
    driver.create(int(sys.argv[2]))
except OutOfMemoryError as error:
    print(error)
driver.release(driver.create(driver.granularity))
"""


def run_in_a_limited_cgroup(
    code: str, limit: int, outputs: Path, *arguments: str
) -> tuple[subprocess.CompletedProcess, str]:
    """`code` in a process of its own (a child of the fork server, through
    `outputs`: extkv.testing.children), which it moves into a child memory
    cgroup limited to `limit` bytes (its first argument) before its first
    create; (the finished run, the cgroup). Skips where no cgroup can be made."""
    leaf = cgroup_memory_files()
    if not leaf:
        pytest.skip("this process is in no memory cgroup with a limit file")
    directory = os.path.join(leaf[0].directory, f"extkv-test-{os.getpid()}")
    try:
        os.mkdir(directory)
    except OSError as error:
        pytest.skip(f"cannot create a child memory cgroup: {error}")
    try:
        try:
            with open(os.path.join(directory, leaf[0].limit), "w") as file:
                file.write(str(limit))
        except OSError as error:
            pytest.skip(f"cannot limit a child memory cgroup: {error}")
        argv = ["-c", directory, *arguments]
        run = python_c(f"import sys\nsys.argv = {argv!r}\n{code}", outputs, timeout=120)
    finally:
        os.rmdir(directory)
    return run, directory


@pytest.mark.invariant(5)
def test_a_create_beyond_this_cgroups_limit_is_refused(tmp_path):
    """In a child cgroup limited far below free memory, a create over the
    limit is refused, naming the cgroup; one within it succeeds. Runs in a
    process of its own, moved into the cgroup before its first create."""
    limit = 64 << 20
    request = 2 * limit
    run, directory = run_in_a_limited_cgroup(CGROUP_PEER, limit, tmp_path / "peer", str(request))
    assert run.returncode == 0, run.stderr
    assert f"refused before allocating: {request} bytes requested" in run.stdout, run.stdout
    assert f"(cgroup {directory}: limit {limit} - usage " in run.stdout, run.stdout


MANY_RUNS_PEER = """
import os, sys
from extkv import ExtensibleTensor
from extkv.errors import OutOfMemoryError
from extkv.usage import open_chunk_fds
from extkv.vmm import HostDriver, live_chunks
with open(os.path.join(sys.argv[1], "cgroup.procs"), "w") as procs:
    procs.write(str(os.getpid()))
driver = HostDriver()
g = driver.granularity
segments = int(sys.argv[2])
tensor = ExtensibleTensor(segments * 2 * g, device=driver, segment_capacities=[2 * g] * segments)
try:
    tensor.resize_segments_([g] * segments)  # one run of one granule per segment
    print("committed", tensor.physical_bytes)
except OutOfMemoryError as error:
    print("refused:", error)
print("chunks", tensor.num_physical_chunks, "live", sum(live_chunks.values()), "memfds", len(open_chunk_fds()))
tensor.resize_segments_([g] * 4 + [0] * (segments - 4))
print("then committed", tensor.physical_bytes)
tensor.free()
"""


@pytest.mark.invariant(5)
def test_a_commit_of_many_runs_that_fit_alone_is_refused_whole_before_any_create(tmp_path):
    """48 runs of one 2 MiB granule each fit a 64 MiB cgroup alone and not
    together. Checked run by run, the commit took chunk after chunk until
    the kernel's OOM killer ended the process; the driver checks the whole
    commit first, so nothing is created, and a commit that fits still does."""
    limit = 64 << 20
    run, directory = run_in_a_limited_cgroup(MANY_RUNS_PEER, limit, tmp_path / "peer", "48")
    assert run.returncode == 0, (run.returncode, run.stdout[-2000:], run.stderr[-2000:])
    assert "refused: map_new_chunks (the commit's runs together) failed" in run.stdout, run.stdout
    assert f"refused before allocating: {48 * (2 << 20)} bytes requested" in run.stdout, run.stdout
    assert "chunks 0 live 0 memfds 0" in run.stdout, "a refused commit took chunks:\n" + run.stdout
    assert f"then committed {4 * (2 << 20)}" in run.stdout, run.stdout


@pytest.mark.invariant(5)
def test_a_commit_reads_the_machine_once_and_its_creates_take_what_it_admitted(driver, monkeypatch):
    """A commit of one granule in each of 16 segments checks its total once,
    before its first create, and its creates read the machine no more (each
    reading took 23 us on the 2-core host, 17 of them a commit of a
    32-segment cache). A create outside any commit still checks its own
    size, and the next commit its own total."""
    reads: list[int] = []
    real = host_memory.read_host_memory_headroom
    monkeypatch.setattr(host_memory, "read_host_memory_headroom", lambda size: reads.append(size) or real(size))
    g = driver.granularity
    tensor = extkv.ExtensibleTensor(16 * 2 * g, device=driver, segment_capacities=[2 * g] * 16)
    try:
        tensor.resize_segments_([g] * 16)
        assert reads == [16 * g], f"the commit of 16 granules read the machine for {reads}"
        reads.clear()
        driver.release(driver.create(g))
        assert reads == [g], f"a create outside a commit read the machine for {reads}"
        reads.clear()
        tensor.resize_segments_([2 * g] * 16)
        assert reads == [16 * g], f"the next commit of 16 granules read the machine for {reads}"
    finally:
        tensor.free()


@pytest.mark.invariant(5, 6)
def test_a_chunk_whose_close_failed_is_never_closed_again(driver):
    """On Linux close() frees the descriptor number even when it reports an
    error, so a chunk whose close failed is released, and a retry would close
    whatever file took the number since."""
    g = driver.granularity
    tensor = extkv.ExtensibleTensor(2 * g, device=driver)
    tensor.resize_segments_([g], zero_new=True)
    fd = tensor.mapped_chunks[0].chunk.handle
    os.close(fd)  # behind extkv's back: its own close now fails with EBADF
    with pytest.warns(RuntimeWarning, match=rf"close\(memfd {fd}\) .* EBADF"):
        tensor.release_physical()
    assert live_chunks["host"] == 0, f"{live_chunks['host']} host chunks still counted after the release"
    # Another file takes the number; nothing of extkv's may close it.
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, fd)
    try:
        tensor.free()
        assert os.path.samestat(os.fstat(fd), os.fstat(devnull)), f"descriptor {fd} no longer names {os.devnull}"
    finally:
        os.close(fd)
        os.close(devnull)


@pytest.mark.invariant(5, 6)
def test_a_commit_past_the_descriptor_limit_is_refused_before_any_create(driver):
    """Each host chunk holds a descriptor: a commit of 100 runs with room for
    74 below RLIMIT_NOFILE, 64 of them kept free, is refused whole, as a
    DriverError naming the limit, and takes nothing; 5 runs fit."""
    g = driver.granularity
    tensor = extkv.ExtensibleTensor(200 * g, device=driver, segment_capacities=[g] * 200)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    open_now = len(os.listdir("/proc/self/fd")) - 1
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + HOST_KEEP_FREE_DESCRIPTORS + 10, hard))
        with pytest.raises(DriverError, match=r"EMFILE.*100 new chunks need a descriptor each.*RLIMIT_NOFILE"):
            tensor.resize_segments_([g, 0] * 100)
        assert tensor.physical_bytes == 0 and tensor.segment_sizes == [0] * 200
        assert open_chunk_fds() == [] and live_chunks["host"] == 0, "the refused commit kept descriptors"
        tensor.resize_segments_([g, 0] * 5 + [0] * 190)  # 5 runs fit
        assert tensor.num_physical_chunks == 5
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        tensor.free()


def _forked_child_report(tensor, cache, chunk_fds: list[int], addresses: list[int], sender) -> None:
    """What a forked child holds of its parent's tensor and cache."""
    report: dict = {}
    try:
        driver = tensor.driver
        report["memfds"] = open_chunk_fds()
        report["mapped"] = [driver.chunk_at(address) is not None for address in addresses]
        report["names"] = {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in chunk_fds if os.path.exists(f"/proc/self/fd/{fd}")}
        report["inherited"] = (tensor.is_inherited, cache.buffer.is_inherited)
        refused = []
        for operation in (lambda: tensor.resize_segments_(list(tensor.segment_capacities)), tensor.release_physical,
                          lambda: cache.commit(2), cache.recommit):
            try:
                operation()
                refused.append("done")
            except extkv.StateError as error:
                refused.append(str(error))
        report["refused"] = refused
        tensor.free()
        cache.free()
        report["freed"] = (tensor.is_freed, cache.is_freed)
    except Exception as error:
        report["error"] = repr(error)
    finally:
        sender.send(report)
        os._exit(0)


@pytest.mark.invariant(5)
def test_a_forked_child_holds_none_of_the_memory_and_uses_none_of_it(driver):
    """A child forked from a process with a committed tensor and cache (the
    fork start method, DataLoader workers) maps none of their chunks, holds
    no descriptor of them (each inherited one names /dev/null, so the pages
    go when the parent releases them), refuses every operation on them but
    free, which frees nothing of the parent's."""
    from extkv.testing.configs import config_for

    g = driver.granularity
    tensor = extkv.ExtensibleTensor(4 * g, device=driver, segment_capacities=[2 * g, 2 * g])
    layout = extkv.KVCacheLayout.LBHNC
    cache = extkv.ExtensibleKVCache(config_for("full", layout, 8), driver, layout)
    try:
        tensor.resize_segments_([2 * g, g], zero_new=True)
        cache.commit(1)
        chunk_fds = [mapped.chunk.handle for mapped in tensor.mapped_chunks + cache.buffer.mapped_chunks]
        addresses = [mapped.address for mapped in tensor.mapped_chunks + cache.buffer.mapped_chunks]
        receiver, sender = multiprocessing.Pipe(duplex=False)
        pid = os.fork()
        if pid == 0:
            _forked_child_report(tensor, cache, chunk_fds, addresses, sender)
        sender.close()
        try:
            report = receiver.recv() if receiver.poll(60) else None
        finally:
            os.waitpid(pid, 0)
            receiver.close()
        assert report is not None, "the child sent nothing"
        assert "error" not in report or report.get("memfds"), report.get("error")
        assert report["memfds"] == [], f"the child holds extkv memfds {report['memfds']}"
        assert not any(report["mapped"]), f"the child maps the parent's chunks: {report['mapped']}"
        assert set(report["names"].values()) == {os.devnull}, report["names"]
        assert report["inherited"] == (True, True)
        assert all("inherited" in refusal for refusal in report["refused"]), report["refused"]
        assert report["freed"] == (True, True)
        # The parent's objects are untouched by the child's free.
        assert tensor.segment_sizes == [2 * g, g] and cache.num_committed_blocks == 1
        assert all(os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:") for fd in chunk_fds)
    finally:
        tensor.free()
        cache.free()


NOBODY = 65534


def _become_nobody_if_root() -> None:
    """Root may open any process's /proc files: both sides of the test run
    as `nobody` where the test runs as root. A change of uid makes a process
    undumpable (fs.suid_dumpable), so dumpability is set back explicitly."""
    if os.geteuid() == 0:
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE, 1


def _exporter(undumpable: bool, to_parent: int, from_parent: int) -> None:
    try:
        _become_nobody_if_root()
        driver = HostDriver()
        chunk = driver.create(driver.granularity)
        if undumpable:
            extkv.make_undumpable()
        os.write(to_parent, f"{chunk.handle}\n".encode())
        os.read(from_parent, 1)  # until the peer has tried
        driver.release(chunk)
    finally:
        os._exit(0)


def _peer_attempts(pid: int, fd: int, to_parent: int) -> None:
    try:
        _become_nobody_if_root()
        results = []
        for path, flags in ((f"/proc/{pid}/fd/{fd}", os.O_RDWR), (f"/proc/{pid}/mem", os.O_RDWR)):
            try:
                os.close(os.open(path, flags))
                results.append("opened")
            except OSError as error:
                results.append(errno.errorcode[error.errno])
        os.write(to_parent, (" ".join(results) + "\n").encode())
    finally:
        os._exit(0)


def _attempts_on_exporter(undumpable: bool) -> list[str]:
    exporter_out, parent_in = os.pipe()
    parent_out, exporter_in = os.pipe()
    exporter = os.fork()
    if exporter == 0:
        _exporter(undumpable, parent_in, parent_out)
    os.close(parent_in)
    os.close(parent_out)
    try:
        fd = int(os.read(exporter_out, 64).decode())
        peer_out, peer_in = os.pipe()
        peer = os.fork()
        if peer == 0:
            _peer_attempts(exporter, fd, peer_in)
        os.close(peer_in)
        results = os.read(peer_out, 256).decode().split()
        os.close(peer_out)
        os.waitpid(peer, 0)
        return results
    finally:
        os.write(exporter_in, b"x")
        os.close(exporter_in)
        os.close(exporter_out)
        os.waitpid(exporter, 0)


@pytest.mark.invariant(8)
def test_an_undumpable_exporter_closes_proc_to_a_peer_under_the_same_uid():
    """A peer under the exporter's uid (not root) reopens a chunk read-write
    through /proc/<pid>/fd; once the exporter calls make_undumpable() it can
    open neither that nor /proc/<pid>/mem."""
    dumpable = _attempts_on_exporter(undumpable=False)
    assert dumpable[0] == "opened", f"the control peer could not reopen the chunk: {dumpable}"
    undumpable = _attempts_on_exporter(undumpable=True)
    assert undumpable == ["EACCES", "EACCES"] or all(result in ("EACCES", "EPERM") for result in undumpable), undumpable
