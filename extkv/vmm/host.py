"""Host driver: the virtual-memory protocol on Linux, for CI and CPU tensors.

Theory of operation
-------------------
This is not a mock: it runs the same protocol as CUDA's VMM API on the kernel's
virtual memory, so every invariant that needs no GPU is proven for real.

- reserve: an aligned `mmap(PROT_NONE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE)`.
- chunk: `memfd_create` + `fallocate`, so the pages really exist (tmpfs/shmem)
  and the kernel accounts them to the file, which is how usage is measured.
  A commit's memory and descriptors are checked before its first create
  (extkv.vmm.host_memory): `fallocate` would wake the OOM killer rather
  than fail. Its creates then take what that check admitted without
  reading the machine again (on the 2-core host a 256 MiB growth over 32
  segments in 8 commits read it 136 times and took 119.5-121.1 ms; with
  one reading a commit, 114.1 ms); a create outside a commit checks its
  own size.
- sealing: right after `fallocate` every chunk is sealed with
  `F_SEAL_SHRINK|F_SEAL_GROW`, so its size is fixed for its whole life
  whoever holds a descriptor: a peer that truncated a shared chunk would
  make this process's next read of the vanished pages a SIGBUS. The first
  read-only export adds `F_SEAL_FUTURE_WRITE|F_SEAL_SEAL` (Linux 5.1+): from
  then on no one can write the memfd, punch a hole in it or map it writable
  (`write`, `fallocate`, `MADV_REMOVE` and a writable `mmap` fail with
  EPERM, also through a descriptor reopened read-write via /proc), while
  this process's mappings made before keep working. A writable export adds
  `F_SEAL_SEAL` alone, so the trusted peer cannot seal the chunk against
  this process; such a chunk cannot be sealed against writing later. The
  memfd's mode is 0600, so a process under another uid cannot reopen it
  through /proc.
- map: `mmap(MAP_SHARED|MAP_FIXED, memfd)` with no access, like `cuMemMap`,
  and `MADV_DONTFORK`: a forked child gets no mapping of any chunk, and
  every extkv memfd descriptor it inherits is replaced by /dev/null at the
  fork, so it holds none of the pages (`_placehold_inherited_chunks`).
- access: `mprotect(PROT_READ|PROT_WRITE)` over a whole mapped run, or
  `PROT_READ` for a peer's view of a read-only export. A mapping never gets
  more access than its descriptor allows: over a read-only descriptor the
  kernel refuses write access (EACCES), whatever the importer asks.
- unmap: map fresh `PROT_NONE` anonymous memory over the range; plain
  `munmap` would punch a hole in the reservation that another mmap could take.
  A chunk sealed against writing could never be mapped writable again, and
  a failed defragmentation's undo maps the old chunks back: its mapping is
  therefore moved aside first (`mremap(MREMAP_DONTUNMAP)`, Linux 5.13+,
  which leaves the range mapped until the `PROT_NONE` memory replaces it),
  and a later map of the chunk moves that mapping back, writable as it was.
  The mapping set aside goes when the chunk is released.
- address book: which memfd each mapping holds (`_MAPPED_AT`, read by
  unmap) and which mappings are set aside (`_SET_ASIDE`) are one record
  for the whole process, changed only under `ADDRESS_BOOK_LOCK`: a free
  walks it while other threads map and unmap in their own reservations.
  A free's munmap and the forgetting of its mappings are one step under
  that lock, and nothing after a successful munmap can fail: a free that
  raises has freed nothing, so its retry never unmaps a range the kernel
  has since handed to another reservation.
- release: `close(memfd)`; the kernel frees the pages once nothing maps them.
  A close that reports an error has still freed the descriptor number, so
  it is never retried (a warning says so, shown rather than raised where
  filters make warnings errors).
- read-back: the kernel's record of this process's mappings names the file
  (device, inode) that backs each address, and the access each mapping
  grants (its `rw` columns); an address whose mapping is no file is in a
  reservation, not mapped (extkv.vmm.host_maps asks it).
- GPUDirect RDMA: host memory is no GPU's, so `gpudirect_rdma` and
  `rdma_capable_at` read None (does not apply) and no dma-buf is exported;
  a peer maps the memfd itself.
- export: a new *read-only* open file description of the chunk
  (`open("/proc/self/fd/N", O_RDONLY)`), after sealing it against writing
  (see sealing). Through it a peer can map the pages for reading only:
  `mmap(PROT_WRITE, MAP_SHARED)`, `write`, `ftruncate` and
  `fallocate(PUNCH_HOLE)` all fail, while this process keeps its writable
  mapping. `export_fd(chunk, writable=True)` gives a read-write one instead,
  for a peer that is trusted to write; a chunk already sealed by a
  read-only export refuses it (ValueError). What the seals leave to a
  process under the same uid: reading the pages (through /proc/<pid>/fd or
  /proc/<pid>/mem) and writing them through /proc/<pid>/mem, which no seal
  covers; `make_undumpable()` closes both to non-root processes.
- import: accepts only memfds sealed against shrinking and growing
  (`F_GET_SEALS`) and at least as large as asked, then `dup`s the descriptor
  (the imported chunk owns its own descriptor, and the caller closes the one
  it received). Another process gets descriptors through a Unix socket
  (SCM_RIGHTS) and maps the same pages.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import threading
from typing import Hashable, Iterable, Iterator

import torch

from ..errors import warn_without_raising
from .base import NO_ACCESS, READ_ONLY, READ_WRITE, Chunk, Driver, format_granularity
from .dlpack import uint8_view
from .host_commits import one_commit_at_a_time
from .host_maps import regions_at
from .host_memory import check_descriptors, check_room, driver_error as _fail, kib_field, read_text
from .transaction import map_new_chunks_step_by_step
from .witness import MEMFD_NAME, MemfdPages, open_chunk_fds

PROT_NONE = 0x0
PROT_READ = 0x1
PROT_WRITE = 0x2
MAP_SHARED = 0x01
MAP_PRIVATE = 0x02
MAP_FIXED = 0x10
MAP_ANONYMOUS = 0x20
MAP_NORESERVE = 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value

DEFAULT_HOST_GRANULARITY = 2 << 20
#: Seals every chunk carries from creation on.
CHUNK_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
#: Not in every Python's fcntl module (Linux 5.1+).
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)
#: What the first read-only export adds: no new write access for anyone.
READ_ONLY_EXPORT_SEALS = F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL
#: Seals a descriptor must carry to be imported: without them a peer could
#: truncate the file under this process's mapping.
REQUIRED_IMPORT_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long,
]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mprotect.restype = ctypes.c_int
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mremap.restype = ctypes.c_void_p
_libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
_libc.prctl.restype = ctypes.c_int
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
MADV_DONTFORK = 10
MADV_POPULATE_WRITE = 23
MREMAP_MAYMOVE = 1
MREMAP_FIXED = 2
MREMAP_DONTUNMAP = 4
PR_SET_DUMPABLE = 4

#: Which chunk (memfd) each mapping this process made starts with, by address.
_MAPPED_AT: dict[int, int] = {}
#: Mappings of sealed chunks moved aside by an unmap: memfd -> (address, size).
_SET_ASIDE: dict[int, tuple[int, int]] = {}
#: Held for every change to `_MAPPED_AT` and `_SET_ASIDE`, which all of this
#: process's reservations share: a free walks `_MAPPED_AT` while other
#: threads map and unmap in their own reservations. Never held across a
#: wait for anything but a system call, so a fork never finds it held for
#: long; the child takes a fresh one all the same (`_forget_parents_mappings`).
ADDRESS_BOOK_LOCK = threading.Lock()
class _Admitted(threading.local):
    #: The bytes the commit under way (`HostDriver.admit`) checked and its
    #: creates have not yet taken; none outside a commit.
    bytes = 0


#: Per thread: see `_Admitted`.
_ADMITTED = _Admitted()


def make_undumpable() -> None:
    """`prctl(PR_SET_DUMPABLE, 0)`: processes under the same uid, root
    excepted, can no longer open this process's /proc/<pid>/fd entries
    (reopening a chunk read-write) or /proc/<pid>/mem (reading and writing
    any of its memory, which no seal covers), nor ptrace it. It also
    disables core dumps and same-uid debuggers (gdb, py-spy): a choice for
    a serving process, not a library default. Lasts until exec."""
    if _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise _fail("prctl(PR_SET_DUMPABLE, 0)", None, None)


def _placehold_inherited_chunks() -> None:
    """In a forked child: every extkv memfd descriptor it inherited now
    names /dev/null. The child then holds none of the parent's pages (a
    descriptor keeps a memfd's pages alive after the parent released them,
    and recommit would take a second copy), and the number stays taken, so
    an inherited object that releases its chunk closes the placeholder,
    never a file the child opened since."""
    try:
        inherited = open_chunk_fds()
    except OSError:
        return
    if not inherited:
        return
    null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    try:
        for fd in inherited:
            try:
                os.dup2(null, fd, inheritable=False)
            except OSError:
                continue  # closed meanwhile
    finally:
        os.close(null)


os.register_at_fork(after_in_child=_placehold_inherited_chunks)


def _forget_parents_mappings() -> None:
    """In a forked child: none of the parent's chunk mappings exist
    (MADV_DONTFORK), so none is recorded, and the address book's lock is
    free even if another thread of the parent held it at the fork."""
    global ADDRESS_BOOK_LOCK
    ADDRESS_BOOK_LOCK = threading.Lock()
    _MAPPED_AT.clear()
    _SET_ASIDE.clear()


os.register_at_fork(after_in_child=_forget_parents_mappings)


def reopen(fd: int, *, writable: bool) -> int:
    """A new open file description of the memfd behind `fd`, read-only or
    read-write; the caller owns and closes it."""
    try:
        return os.open(f"/proc/self/fd/{fd}", (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
    except OSError as error:
        mode = "O_RDWR" if writable else "O_RDONLY"
        raise _fail(f"open(/proc/self/fd/{fd}, {mode})", None, None, error.errno) from None


def create_memfd(size: int, name: str = MEMFD_NAME) -> int:
    """A chunk's memfd: `size` bytes whose pages exist (`fallocate`), mode
    0600, sealed at that size (CHUNK_SEALS); the caller owns the descriptor.
    No check that the pages fit: the driver's create checks that first
    (`check_room`), and a raw sequence measured against the driver makes
    the same file without it. Memory held for another purpose (a pressure
    process's) takes another `name`, so that no witness counts it as a
    chunk. DriverError (OutOfMemoryError for ENOMEM and ENOSPC) where the
    kernel refuses."""
    try:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as error:
        raise _fail("memfd_create", size, None, error.errno) from None
    try:
        os.fchmod(fd, 0o600)
        os.posix_fallocate(fd, 0, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, CHUNK_SEALS)
    except OSError as error:
        os.close(fd)
        raise _fail("memfd_create+fallocate+seal", size, None, error.errno) from None
    return fd


class HostDriver(Driver):
    """Linux virtual memory backed by memfd chunks."""

    kind = "host"

    def __init__(self, granularity: int = DEFAULT_HOST_GRANULARITY):
        page = os.sysconf("SC_PAGE_SIZE")
        if isinstance(granularity, bool) or not isinstance(granularity, int) or granularity <= 0 or granularity % page:
            raise ValueError(
                f"host granularity {granularity!r} must be a positive multiple of the page size {page}"
            )
        self.granularity = granularity
        self.device = torch.device("cpu")

    def _mmap(self, call, address, size, prot, flags, fd=-1, offset=0) -> int:
        result = _libc.mmap(address, size, prot, flags, fd, offset)
        if result is None or result == _MAP_FAILED:
            raise _fail(call, size, address)
        return result

    def _reserve(self, size: int) -> int:
        # Over-reserve by one granule and trim, so the base is granule-aligned as
        # a CUDA reservation is.
        padded = size + self.granularity
        raw = self._mmap(
            "mmap(PROT_NONE) reserve", None, padded, PROT_NONE,
            MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
        )
        base = -(-raw // self.granularity) * self.granularity
        head, tail = base - raw, raw + padded - (base + size)
        if head:
            _libc.munmap(raw, head)
        if tail:
            _libc.munmap(base + size, tail)
        return base

    def _free_reservation(self, address: int, size: int) -> None:
        # The munmap and the forgetting of its mappings are one step for the
        # other threads: nothing after a successful munmap can fail, so a
        # free that raises has freed nothing and its retry unmaps only what
        # is still its own, never a range the kernel has since handed out.
        with ADDRESS_BOOK_LOCK:
            if _libc.munmap(address, size) != 0:
                raise _fail("munmap", size, address)
            for start in [start for start in _MAPPED_AT if address <= start < address + size]:
                del _MAPPED_AT[start]

    def _create(self, size: int) -> Chunk:
        admitted = _ADMITTED.bytes
        if size <= admitted:
            _ADMITTED.bytes = admitted - size  # checked with the commit's total
        else:
            check_room(size, "memfd_create+fallocate")
        return Chunk(handle=create_memfd(size), size=size)

    def _release(self, chunk: Chunk) -> None:
        with ADDRESS_BOOK_LOCK:
            aside = _SET_ASIDE.pop(chunk.handle, None)
        if aside is not None:
            _libc.munmap(*aside)  # a mapping of this process's own, nothing else there
        # On Linux close() frees the descriptor number even when it reports
        # an error (EINTR and EIO included), so a chunk whose close failed is
        # released all the same and never closed again: a retry would close
        # whatever file took the number since. EBADF means the number was
        # closed behind extkv's back.
        try:
            os.close(chunk.handle)
        except OSError as error:
            message = (
                f"close(memfd {chunk.handle}) of a {chunk.size}-byte chunk failed with "
                f"{errno.errorcode.get(error.errno, error.errno)}; its descriptor is not closed again"
            )
            warn_without_raising(message, stacklevel=3)

    def _export_fd(self, chunk: Chunk, writable: bool) -> int:
        fd = chunk.handle
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            if writable:
                if seals & F_SEAL_FUTURE_WRITE:
                    raise ValueError(
                        f"export_fd(writable=True): the chunk of memfd {fd} was exported read-only, which sealed it "
                        "against new write access (F_SEAL_FUTURE_WRITE) for good; only read-only exports remain"
                    )
                if not seals & fcntl.F_SEAL_SEAL:
                    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL)
            elif not seals & fcntl.F_SEAL_SEAL:
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, READ_ONLY_EXPORT_SEALS)
        except OSError as error:
            raise _fail(f"fcntl(memfd {fd}, F_ADD_SEALS) export", chunk.size, None, error.errno) from None
        return reopen(fd, writable=writable)

    def _import_fd(self, fd: int, size: int) -> Chunk:
        try:
            file_size = os.fstat(fd).st_size
        except OSError as error:
            raise _fail(f"fstat(fd {fd}) import", size, None, error.errno) from None
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError as error:
            if error.errno != errno.EINVAL:  # EINVAL: a file that cannot be sealed
                raise _fail(f"fcntl(fd {fd}, F_GET_SEALS) import", size, None, error.errno) from None
            seals = 0
        if seals & REQUIRED_IMPORT_SEALS != REQUIRED_IMPORT_SEALS:
            raise ValueError(
                f"import_fd: fd {fd} ({_describe_fd(fd)}, seals {seals:#x}) is not a memfd sealed with "
                f"F_SEAL_SHRINK|F_SEAL_GROW ({REQUIRED_IMPORT_SEALS:#x}); only such chunks can be shared safely"
            )
        if file_size < size:
            # Mapping past the end of the file would succeed and then fault
            # (SIGBUS) on first touch; refuse here instead.
            raise ValueError(f"import_fd: fd {fd} holds {file_size} bytes, fewer than the {size} bytes to import")
        try:
            return Chunk(handle=os.dup(fd), size=size)
        except OSError as error:
            raise _fail(f"dup(fd {fd}) import", size, None, error.errno) from None

    def _map(self, address: int, chunk: Chunk) -> None:
        aside = _SET_ASIDE.get(chunk.handle)
        if aside is not None and aside[1] == chunk.size:
            self._move_back(aside[0], address, chunk)
            return
        self._mmap("mmap(MAP_FIXED, memfd)", address, chunk.size, PROT_NONE, MAP_SHARED | MAP_FIXED, chunk.handle)
        with ADDRESS_BOOK_LOCK:
            _MAPPED_AT[address] = chunk.handle
        # A forked child (multiprocessing's fork start method, DataLoader
        # workers) gets no mapping: over MAP_SHARED it would read released
        # memory and write the parent's live cache.
        if _libc.madvise(address, chunk.size, MADV_DONTFORK) != 0:
            error = _fail("madvise(MADV_DONTFORK)", chunk.size, address)
            self._unmap(address, chunk.size)
            raise error

    def _move_back(self, aside: int, address: int, chunk: Chunk) -> None:
        """Map a chunk whose mapping an unmap set aside: move that mapping
        to `address` (replacing what is there in one step), with no access
        until `set_access`, as a fresh map has."""
        moved = _libc.mremap(aside, chunk.size, chunk.size, MREMAP_MAYMOVE | MREMAP_FIXED, address)
        if moved is None or moved == _MAP_FAILED:
            raise _fail("mremap(MREMAP_FIXED) map of a sealed chunk", chunk.size, address)
        with ADDRESS_BOOK_LOCK:
            del _SET_ASIDE[chunk.handle]
            _MAPPED_AT[address] = chunk.handle
        if _libc.mprotect(address, chunk.size, PROT_NONE) != 0:
            raise _fail("mprotect(PROT_NONE) map of a sealed chunk", chunk.size, address)

    def _set_aside(self, address: int, size: int, fd: int) -> None:
        """Keep the mapping of a chunk sealed against writing elsewhere, as
        it is (see unmap); the range stays mapped until the caller replaces it."""
        moved = _libc.mremap(address, size, size, MREMAP_MAYMOVE | MREMAP_DONTUNMAP, None)
        if moved is None or moved == _MAP_FAILED:
            code = ctypes.get_errno()
            if code == errno.EINVAL:
                return  # a kernel before 5.13: the chunk is unmapped, and can come back read-only only
            raise _fail("mremap(MREMAP_DONTUNMAP) unmap of a sealed chunk", size, address, code)
        with ADDRESS_BOOK_LOCK:
            _SET_ASIDE[fd] = (moved, size)

    def _set_access(self, address: int, size: int, writable: bool) -> None:
        # Over a read-only descriptor the kernel refuses PROT_WRITE (EACCES):
        # the exporter's choice holds whatever the importer asks.
        prot, call = (PROT_READ | PROT_WRITE, "mprotect(PROT_READ|PROT_WRITE)") if writable else (PROT_READ, "mprotect(PROT_READ)")
        if _libc.mprotect(address, size, prot) != 0:
            raise _fail(call, size, address)

    def _unmap(self, address: int, size: int) -> None:
        fd = _MAPPED_AT.get(address)
        if fd is not None and fd not in _SET_ASIDE and _sealed_against_writing(fd) and _maps_file_of(address, fd):
            self._set_aside(address, size, fd)
        self._mmap(
            "mmap(PROT_NONE) unmap", address, size, PROT_NONE,
            MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
        )
        with ADDRESS_BOOK_LOCK:
            _MAPPED_AT.pop(address, None)

    def _zero(self, address: int, size: int) -> None:
        # A range mapped since its pages were last touched here takes a
        # page fault per 4 KiB page at its first write: 1.2 ms for 2 MiB on
        # the 2-core CI host. MADV_POPULATE_WRITE (Linux 5.14+) maps the
        # whole range in one call (0.65 ms), and the memset then writes to
        # mapped pages (0.14 ms). Where the kernel refuses it, the memset
        # faults the pages in itself: it alone does the zeroing.
        _libc.madvise(address, size, MADV_POPULATE_WRITE)
        ctypes.memset(address, 0, size)

    def _copy(self, destination: int, source: int, size: int) -> None:
        ctypes.memmove(destination, source, size)

    @contextlib.contextmanager
    def admit(self, size: int, chunks: int = 1) -> Iterator[None]:
        # The whole commit is checked before its first create: each run alone
        # may fit while all of them take the machine (one commit of many
        # 2 MiB runs took 21.6 GiB of a 24 GiB host, and the OOM killer then
        # chose other processes: memfd pages are not in extkv's RSS). Commits
        # of this process's threads, and of every process on the machine
        # that can open the machine's commit lock file, check and create one
        # after another, so two cannot both pass on one reading
        # (extkv.vmm.host_commits: never for longer than a bound).
        with one_commit_at_a_time():
            step = "map_new_chunks (the commit's runs together)"
            check_descriptors(chunks, step)
            check_room(size, step)
            outer, _ADMITTED.bytes = _ADMITTED.bytes, size
            try:
                yield
            finally:
                _ADMITTED.bytes = outer

    def _map_new_chunks(self, runs, created, give_back, zero_after) -> None:
        # A memfd's steps are system calls that cost far more than the
        # Python around them: the generic sequence is as fast.
        map_new_chunks_step_by_step(self, runs, created, give_back, zero_after)

    def synchronize(self) -> None:
        """CPU tensor operations are synchronous: nothing is in flight."""

    def memory_info(self) -> tuple[int, int]:
        """MemAvailable and MemTotal: what the kernel could give without
        swapping, and all there is."""
        meminfo = read_text("/proc/meminfo")
        return kib_field(meminfo, "MemAvailable"), kib_field(meminfo, "MemTotal")

    def reclaim_cache(self) -> bool:
        return False

    def chunk_at(self, address: int) -> Hashable | None:
        return self.chunks_at([address])[0]

    def chunks_at(self, addresses: Iterable[int]) -> list[Hashable | None]:
        """`chunk_at` for many addresses with one read-back."""
        return [None if region is None else region.file for region in regions_at(list(addresses))]

    def _access_at(self, address: int) -> str | None:
        return self.accesses_at([address])[0]

    def accesses_at(self, addresses: Iterable[int]) -> list[str | None]:
        """`access_at` for many addresses with one read-back."""
        return [None if region is None else _access_of(region.permissions) for region in regions_at(list(addresses))]

    def rdma_capable_at(self, address: int) -> bool | None:
        """None: host memory is no GPU's, so GPUDirect RDMA does not apply."""
        return None

    def _export_dma_buf(self, address: int, size: int) -> int:
        raise NotImplementedError(
            "the host driver's chunks are memfds in host memory, not GPU memory: it exports no dma-buf "
            "(a peer imports the memfd itself: export_fd)"
        )

    def view(self, address: int, size: int) -> torch.Tensor:
        return uint8_view(address, size, self.device)

    def usage_witness(self) -> MemfdPages:
        return MemfdPages()

    def refuse_partly_backed(self, fd: int, what: str) -> None:
        # A memfd with holes is allocated as it is read, in the reader's
        # memory cgroup; an extkv chunk has every page (create_memfd).
        status = os.fstat(fd)
        allocated = status.st_blocks * 512
        if allocated < status.st_size:
            raise ValueError(
                f"{what} is a sparse memfd: {allocated} of its {status.st_size} bytes are allocated (an extkv "
                "chunk has all of them); reading it would allocate the rest in this process"
            )

    def describe(self) -> dict[str, str]:
        return {
            "device": "host (Linux virtual memory, memfd chunks)",
            "driver": f"Linux {os.uname().release}",
            "granularity": format_granularity(self.granularity),
        }


def _access_of(permissions: str) -> str:
    # x86-64 and aarch64 have no write-only pages: PROT_WRITE reads too.
    if permissions[1] == "w":
        return READ_WRITE
    return READ_ONLY if permissions[0] == "r" else NO_ACCESS


def _maps_file_of(address: int, fd: int) -> bool:
    """Whether the mapping at `address` is of the file behind `fd`, read back
    (a stale record must never move another file's mapping aside)."""
    regions = regions_at([address])
    try:
        status = os.fstat(fd)
    except OSError:
        return False
    return regions[0] is not None and regions[0].file == (os.major(status.st_dev), os.minor(status.st_dev), status.st_ino)


def _sealed_against_writing(fd: int) -> bool:
    try:
        return bool(fcntl.fcntl(fd, fcntl.F_GET_SEALS) & F_SEAL_FUTURE_WRITE)
    except OSError:
        return False


def _describe_fd(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "unknown file"
