"""Host driver: the virtual-memory protocol on Linux, for CI and CPU tensors.

Theory of operation
-------------------
This is not a mock: it runs the same protocol as CUDA's VMM API on the kernel's
virtual memory, so every invariant that needs no GPU is proven for real.

- reserve: an aligned `mmap(PROT_NONE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE)`.
- chunk: `memfd_create` + `fallocate`, so the pages really exist (tmpfs/shmem)
  and the kernel accounts them to the file, which is how usage is measured.
- map: `mmap(MAP_SHARED|MAP_FIXED, memfd)` with no access, like `cuMemMap`.
- access: `mprotect(PROT_READ|PROT_WRITE)` over a whole mapped run.
- unmap: map fresh `PROT_NONE` anonymous memory over the range; plain
  `munmap` would punch a hole in the reservation that another mmap could take.
- release: `close(memfd)`; the kernel frees the pages once nothing maps them.
- read-back: `/proc/self/maps` names the file (device, inode) and offset that
  back each address.
- export / import: a chunk *is* a file descriptor, so exporting is `dup` and
  importing is `dup` too (the imported chunk owns its own descriptor, and the
  caller closes the one it received). Another process gets the descriptor
  through a Unix socket (SCM_RIGHTS) and maps the same pages.
"""

from __future__ import annotations

import ctypes
import errno
import os
from typing import Hashable, Iterable

import torch

from ..errors import DriverError, OutOfMemoryError
from .base import Chunk, Driver, format_granularity
from .dlpack import uint8_view

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
#: Name of every chunk's memfd, as /proc/self/fd and /proc/self/maps show it.
MEMFD_NAME = "extkv-chunk"

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long,
]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mprotect.restype = ctypes.c_int
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _fail(call: str, size: int | None, address: int | None, code: int | None = None) -> DriverError:
    code = ctypes.get_errno() if code is None else code
    name = errno.errorcode.get(code, "E?")
    error_type = OutOfMemoryError if code in (errno.ENOMEM, errno.ENOSPC) else DriverError
    return error_type(call, code, name, size=size, address=address, detail=os.strerror(code))


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
        if _libc.munmap(address, size) != 0:
            raise _fail("munmap", size, address)

    def _create(self, size: int) -> Chunk:
        fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as error:
            os.close(fd)
            raise _fail("memfd_create+fallocate", size, None, error.errno) from None
        return Chunk(handle=fd, size=size)

    def _release(self, chunk: Chunk) -> None:
        try:
            os.close(chunk.handle)
        except OSError as error:
            raise _fail("close(memfd)", chunk.size, None, error.errno) from None

    def _export_fd(self, chunk: Chunk) -> int:
        try:
            return os.dup(chunk.handle)
        except OSError as error:
            raise _fail("dup(memfd) export", chunk.size, None, error.errno) from None

    def _import_fd(self, fd: int, size: int) -> Chunk:
        try:
            file_size = os.fstat(fd).st_size
        except OSError as error:
            raise _fail(f"fstat(fd {fd}) import", size, None, error.errno) from None
        if file_size < size:
            # Mapping past the end of the file would succeed and then fault
            # (SIGBUS) on first touch; refuse here instead.
            raise ValueError(f"import_fd: fd {fd} holds {file_size} bytes, fewer than the {size} bytes to import")
        try:
            return Chunk(handle=os.dup(fd), size=size)
        except OSError as error:
            raise _fail(f"dup(fd {fd}) import", size, None, error.errno) from None

    def _map(self, address: int, chunk: Chunk) -> None:
        self._mmap("mmap(MAP_FIXED, memfd)", address, chunk.size, PROT_NONE, MAP_SHARED | MAP_FIXED, chunk.handle)

    def _set_access(self, address: int, size: int) -> None:
        if _libc.mprotect(address, size, PROT_READ | PROT_WRITE) != 0:
            raise _fail("mprotect(PROT_READ|PROT_WRITE)", size, address)

    def _unmap(self, address: int, size: int) -> None:
        self._mmap(
            "mmap(PROT_NONE) unmap", address, size, PROT_NONE,
            MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
        )

    def synchronize(self) -> None:
        """CPU tensor operations are synchronous: nothing is in flight."""

    def reclaim_cache(self) -> bool:
        return False

    def chunk_at(self, address: int) -> Hashable | None:
        return self.chunks_at([address])[0]

    def chunks_at(self, addresses: Iterable[int]) -> list[Hashable | None]:
        """`chunk_at` for many addresses with one read of /proc/self/maps."""
        regions = []
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                start, end = (int(part, 16) for part in fields[0].split("-"))
                major, minor = (int(part, 16) for part in fields[3].split(":"))
                inode = int(fields[4])
                if inode:
                    regions.append((start, end, (major, minor, inode)))
        result = []
        for address in addresses:
            result.append(next((ident for start, end, ident in regions if start <= address < end), None))
        return result

    def view(self, address: int, size: int) -> torch.Tensor:
        return uint8_view(address, size, self.device)

    def describe(self) -> dict[str, str]:
        return {
            "device": "host (Linux virtual memory, memfd chunks)",
            "driver": f"Linux {os.uname().release}",
            "granularity": format_granularity(self.granularity),
        }
