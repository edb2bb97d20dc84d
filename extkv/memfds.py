"""How many bytes a process holds in extkv's host chunks, read from /proc.

Theory of operation
-------------------
Every host chunk is a memfd named MEMFD_NAME, and the kernel reports the
pages a file really holds (`st_blocks`). `host_chunk_bytes(pid)` sums them
over every such file the process still reaches, each file once: through an
open descriptor (`/proc/PID/fd`) or through a mapping whose descriptor was
closed (`/proc/PID/maps`, the file stat'ed through `/proc/PID/map_files`). A
mapping left behind after its chunk was released holds the pages as surely
as an open descriptor does. `host_chunks(pid)` gives the same reading
file by file, so that readings taken apart in time can be matched.

`pid` is "self" for this process (extkv.vmm.witness's reading) or another
process's id (the budget daemon's outside reading of an engine), which the
kernel lets this process read only under the same uid, and only while that
process is dumpable: an OSError (PermissionError, or FileNotFoundError for a
process that is gone) says when it cannot be read. /proc/PID/map_files is
closed to a process without CAP_SYS_ADMIN on many kernels; there the
mapped extent stands for what a mapping holds, which is at least that.

Only the standard library is imported: the budget daemon reads engines
without importing torch.
"""

from __future__ import annotations

import os

#: Name of every host chunk's memfd, as /proc/PID/fd and /proc/PID/maps show it.
MEMFD_NAME = "extkv-chunk"
_MEMFD_LINK = f"/memfd:{MEMFD_NAME}"
_MEMFD_LINK_BYTES = _MEMFD_LINK.encode()


def open_chunk_fds(pid: int | str = "self") -> list[int]:
    """Descriptors of process `pid` that are extkv host chunks."""
    fds = []
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:  # closed between listdir and readlink
            continue
        if target.startswith(_MEMFD_LINK):
            fds.append(int(name))
    return fds


def host_chunk_bytes(pid: int | str = "self") -> int:
    """Bytes of pages the kernel holds for the extkv memfds process `pid`
    reaches by descriptor or by mapping, each file counted once."""
    return sum(host_chunks(pid).values())


def host_chunks(pid: int | str = "self") -> dict[tuple[int, int], int]:
    """The extkv memfds process `pid` reaches by descriptor or by mapping,
    by file ((device, inode)), each with the bytes of pages the kernel
    holds for it (`host_chunk_bytes` is their sum)."""
    held: dict[tuple[int, int], int] = {}
    for fd in open_chunk_fds(pid):
        try:
            status = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        held[(status.st_dev, status.st_ino)] = status.st_blocks * 512
    mapped_extent: dict[tuple[int, int], int] = {}
    for line in _memfd_mapping_lines(pid):
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or not fields[5].startswith(_MEMFD_LINK_BYTES):
            continue
        major, minor = (int(part, 16) for part in fields[3].split(b":"))
        key = (os.makedev(major, minor), int(fields[4]))
        if key in held:
            continue
        span = fields[0].decode()
        try:
            held[key] = os.stat(f"/proc/{pid}/map_files/{span}").st_blocks * 512
        except OSError:
            # map_files is closed to this process (older kernels, no
            # CAP_SYS_ADMIN): the mapped extent is what it holds at least.
            start, end = (int(part, 16) for part in span.split("-"))
            mapped_extent[key] = mapped_extent.get(key, 0) + end - start
    for key, extent in mapped_extent.items():
        held[key] = held.get(key, 0) + extent
    return held


def _memfd_mapping_lines(pid: int | str) -> list[bytes]:
    """The lines of /proc/PID/maps that name an extkv memfd. The text is
    searched, not split: of some 400 lines (a process that imported torch)
    none or a few are chunks, and splitting and decoding every line cost
    about a fifth of a read."""
    with open(f"/proc/{pid}/maps", "rb") as maps:
        text = maps.read()
    lines = []
    found = text.find(_MEMFD_LINK_BYTES)
    while found != -1:
        start = text.rfind(b"\n", 0, found) + 1
        end = text.find(b"\n", found)
        end = len(text) if end == -1 else end
        lines.append(text[start:end])
        found = text.find(_MEMFD_LINK_BYTES, end)
    return lines
