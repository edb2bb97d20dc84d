"""How much a host commit may take: memory and descriptors, checked before any create.

Theory of operation
-------------------
`fallocate` on a memfd has no early size check: a request the machine
cannot hold summons the OOM killer instead of failing, and memfd pages are
not in extkv's RSS, so the killer picks someone else. Before anything is
created, a commit's new bytes, all its runs together, are checked against
what the kernel can give (`host_memory_headroom`: MemAvailable, and limit
minus usage plus reclaimable file cache of this process's memory cgroup and
its ancestors, v2 or v1), less a margin kept free for other processes; a
request that cannot fit is an `OutOfMemoryError` naming both numbers. Each
check reads /proc/meminfo and each cgroup level's limit (and usage where it
sets one, memory.stat only where its file cache decides the outcome:
`file_cache_decides`); limits are read each time as they may change (pod
resize). Commits of this process's threads and of every process on the
machine are checked and made one after another, so two cannot pass on one
reading (extkv.vmm.host_commits, which also says how long a commit waits
for another process's and what it does past that).

Each chunk holds one descriptor for its life, so a commit is refused as
DriverError EMFILE before its first create when its chunks would take the
process to within `HOST_KEEP_FREE_DESCRIPTORS` of RLIMIT_NOFILE.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import resource
from dataclasses import dataclass
from typing import Sequence

from ..errors import DriverError, OutOfMemoryError
from .base import live_chunks


def driver_error(call: str, size: int | None, address: int | None, code: int | None = None) -> DriverError:
    """The DriverError (OutOfMemoryError for ENOMEM/ENOSPC) of a failed host
    system call, `code` defaulting to ctypes' errno."""
    code = ctypes.get_errno() if code is None else code
    name = errno.errorcode.get(code, "E?")
    error_type = OutOfMemoryError if code in (errno.ENOMEM, errno.ENOSPC) else DriverError
    return error_type(call, code, name, size=size, address=address, detail=os.strerror(code))



@dataclass(frozen=True)
class CgroupMemoryReading:
    """What one memory cgroup's files said.

    `limit`: memory.max (v2) or memory.limit_in_bytes (v1), "max" for none;
    `usage`: memory.current / memory.usage_in_bytes; `stat`: memory.stat, whose
    file-cache counts the kernel reclaims before it refuses a charge ("" when
    not read).
    """

    path: str
    limit: str
    usage: str
    stat: str = ""


@dataclass(frozen=True)
class MemoryHeadroom:
    """Bytes a create may take (None: nothing limits it) and what limits it."""

    available: int | None
    limited_by: str


def kib_field(meminfo_text: str, key: str) -> int | None:
    for line in meminfo_text.splitlines():
        name, _, value = line.partition(":")
        if name == key:
            number, *unit = value.split()
            return int(number) * (1024 if unit == ["kB"] else 1)
    return None


def _reclaimable_file_cache(stat_text: str) -> int:
    counters = dict(line.split() for line in stat_text.splitlines() if len(line.split()) == 2)
    # v1 names the hierarchical counters total_*; v2's counters are hierarchical.
    prefix = "total_" if "total_inactive_file" in counters else ""
    return sum(int(counters.get(f"{prefix}{name}", 0)) for name in ("inactive_file", "active_file"))


def host_memory_headroom(meminfo_text: str, cgroups: Sequence[CgroupMemoryReading] = ()) -> MemoryHeadroom:
    """The most a new chunk may take: the smallest of MemAvailable (from
    /proc/meminfo text) and, per cgroup, limit - usage + reclaimable file
    cache (never below 0). Pure arithmetic over the readings given."""
    candidates: list[tuple[int, str]] = []
    mem_available = kib_field(meminfo_text, "MemAvailable")
    if mem_available is not None:
        candidates.append((mem_available, f"MemAvailable {mem_available} bytes in /proc/meminfo"))
    for cgroup in cgroups:
        if cgroup.limit.strip() == "max":
            continue
        limit, usage = int(cgroup.limit), int(cgroup.usage)
        reclaimable = _reclaimable_file_cache(cgroup.stat)
        candidates.append(
            (
                max(limit - usage + reclaimable, 0),
                f"cgroup {cgroup.path}: limit {limit} - usage {usage} + reclaimable file cache {reclaimable} bytes",
            )
        )
    if not candidates:
        return MemoryHeadroom(None, "no reading limits it")
    available, limited_by = min(candidates)
    return MemoryHeadroom(available, limited_by)


@dataclass(frozen=True)
class CgroupMemoryFiles:
    """A memory cgroup's directory and the names of its limit and usage files."""

    directory: str
    limit: str
    usage: str


@functools.lru_cache(maxsize=None)
def cgroup_memory_files() -> tuple[CgroupMemoryFiles, ...]:
    """This process's memory cgroup and its ancestors, leaf first, with the
    names of their limit and usage files (v2 and v1 hierarchies; levels
    without a limit file, such as a v2 hierarchy without the memory
    controller, are left out). Found once: processes rarely change cgroup."""
    mounts: dict[str, tuple[str, str]] = {}  # "v2" / "v1" -> (root, mount point)
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            left, _, right = line.partition(" - ")
            fields, (fstype, _source, options, *_rest) = left.split(), right.split()
            if fstype == "cgroup2":
                mounts.setdefault("v2", (fields[3], fields[4]))
            elif fstype == "cgroup" and "memory" in options.split(","):
                mounts.setdefault("v1", (fields[3], fields[4]))
    names = {"v2": ("memory.max", "memory.current"), "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes")}
    levels: list[CgroupMemoryFiles] = []
    with open("/proc/self/cgroup") as cgroups:
        for line in cgroups:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            version = "v2" if controllers == "" else "v1" if "memory" in controllers.split(",") else None
            if version not in mounts:
                continue
            root, mount_point = mounts[version]
            inside = os.path.relpath(path, root)
            if inside.startswith(".."):
                continue  # outside what this mount shows
            directory = os.path.normpath(os.path.join(mount_point, inside))
            limit, usage = names[version]
            # Up to and including the mount point: in a cgroup namespace it
            # is the container's own cgroup, whose limit is the one that counts.
            while True:
                if os.path.exists(os.path.join(directory, limit)):
                    levels.append(CgroupMemoryFiles(directory, limit, usage))
                if directory == mount_point:
                    break
                directory = os.path.dirname(directory)
    return tuple(levels)


def read_text(path: str) -> str:
    """A small file of the kernel's, whole. Read with os.read: a commit reads
    up to seven of these, and a Python file object costs twice the system
    calls' time (15 us against 7 us a file on the 2-core CI host)."""
    descriptor = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        parts = []
        while part := os.read(descriptor, 1 << 16):
            parts.append(part)
    finally:
        os.close(descriptor)
    return b"".join(parts).decode()


def room_for(available: int) -> int:
    """What a commit may take of the `available` bytes the kernel could
    give: all but what is kept free for other processes."""
    return available - min(HOST_KEEP_FREE_BYTES, available // 16)


def file_cache_decides(limit: int, usage: int, size: int) -> bool:
    """Whether a cgroup's reclaimable file cache can decide if `size` bytes
    fit under its limit: they do not fit in `room_for` what limit - usage
    leaves. The check refuses past `room_for`, not past limit - usage, so
    the cache must count wherever the margin alone would refuse."""
    return room_for(max(limit - usage, 0)) < size


#: A cgroup limit at least this large limits nothing: cgroup v1 writes "no
#: limit" as PAGE_COUNTER_MAX pages (2**63 - 4096 bytes with 4 KiB pages),
#: and limit - usage stays above 2**61 bytes, more than any MemAvailable,
#: so such a level is never the tightest and its usage is not read.
NO_LIMIT_BYTES = 1 << 62


def read_host_memory_headroom(size: int) -> MemoryHeadroom:
    """`host_memory_headroom` over this machine's readings, leaving out the
    levels without a limit ("max", or NO_LIMIT_BYTES and above). A cgroup's
    memory.stat is read only where its file cache decides whether `size`
    fits (`file_cache_decides`)."""
    readings = []
    for files in cgroup_memory_files():
        try:
            limit = read_text(os.path.join(files.directory, files.limit))
            if limit.strip() == "max" or int(limit) >= NO_LIMIT_BYTES:
                continue
            usage = read_text(os.path.join(files.directory, files.usage))
            stat = ""
            if file_cache_decides(int(limit), int(usage), size):
                stat = read_text(os.path.join(files.directory, "memory.stat"))
        except OSError:
            continue  # the cgroup went away: it limits nothing any more
        readings.append(CgroupMemoryReading(files.directory, limit, usage, stat))
    return host_memory_headroom(read_text("/proc/meminfo"), readings)


#: What a host commit leaves free for other processes: a sixteenth of what
#: the kernel (or the memory cgroup) could give, at most 256 MiB.
HOST_KEEP_FREE_BYTES = 256 << 20


#: Descriptors a host commit leaves free for the rest of the process (files,
#: sockets, exports), below the soft RLIMIT_NOFILE.
HOST_KEEP_FREE_DESCRIPTORS = 64


def check_descriptors(chunks: int, step: str) -> None:
    """DriverError(EMFILE), before anything is created, when `chunks` new
    memfds would leave fewer than HOST_KEEP_FREE_DESCRIPTORS free below the
    soft limit. /proc/self/fd is listed only where the chunks this driver
    holds and the new ones come within half the limit of it."""
    limit, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if limit == resource.RLIM_INFINITY or live_chunks["host"] + chunks <= limit // 2 - HOST_KEEP_FREE_DESCRIPTORS:
        return
    try:
        open_now = len(os.listdir("/proc/self/fd")) - 1  # less the one listdir opened
    except OSError as error:
        raise driver_error(f"{step}: listdir(/proc/self/fd)", None, None, error.errno) from None
    if open_now + chunks > limit - HOST_KEEP_FREE_DESCRIPTORS:
        raise DriverError(
            step, errno.EMFILE, "EMFILE",
            detail=f"refused before creating: {chunks} new chunks need a descriptor each, {open_now} of the "
            f"soft limit {limit} (RLIMIT_NOFILE) are open and {HOST_KEEP_FREE_DESCRIPTORS} are kept free; "
            "raise the limit (ulimit -n, resource.setrlimit) or commit fewer, larger runs",
        )


def check_room(size: int, step: str) -> None:
    """OutOfMemoryError, before anything is allocated, when `size` bytes do
    not fit what the kernel could give less what is kept free for others."""
    try:
        headroom = read_host_memory_headroom(size)
    except OSError as error:  # EMFILE: no descriptor left to read /proc/meminfo with
        raise driver_error(f"{step}: read /proc/meminfo and cgroup limits", size, None, error.errno) from None
    if headroom.available is None:
        return
    kept = headroom.available - room_for(headroom.available)
    if size > headroom.available - kept:
        raise OutOfMemoryError(
            step, errno.ENOMEM, "ENOMEM", size=size,
            detail=f"refused before allocating: {size} bytes requested, {headroom.available} available "
            f"({headroom.limited_by}), {kept} kept free for other processes",
        )
