"""Read-back of the host driver's mappings: which file backs an address, with what access.

Theory of operation
-------------------
The kernel's record of this process's mappings is the witness of what the
host driver mapped (extkv.vmm.host): for each address, the file (device,
inode) of the mapping holding it and the access that mapping grants, or
nothing for an address in a reservation's `PROT_NONE` anonymous memory.

- By PROCMAP_QUERY (an ioctl on /proc/self/maps, Linux 6.11+): through
  the addresses in ascending order, one query returns the file mapping
  holding an address or else the next one above it, which answers every
  address up to that mapping's end. A tensor's read-back is a query per
  mapping it meets, some 10 us for a few chunks.
- By /proc/self/maps' text, where the kernel has no such ioctl (the first
  ENOTTY or EINVAL turns it off for the process): the kernel formats every mapping
  of the process, some 400 in one that imported torch, about 0.5 ms a
  read on the 2-core CI host, whatever the addresses asked.

Both open /proc/self/maps at each read-back: a descriptor kept from before
a fork would answer for the parent. Neither is atomic over many mappings
(the text is made a page at a time): a read-back taken while another
thread maps or unmaps may see either state of that range.
"""

from __future__ import annotations

import bisect
import errno
import fcntl
import struct
from typing import NamedTuple


class Region(NamedTuple):
    """A file mapping of this process, as the kernel reads it back."""

    start: int
    end: int
    file: tuple[int, int, int]   # (device major, minor, inode)
    permissions: str             # such as "rw-s"


#: Whether to ask the kernel by PROCMAP_QUERY; False reads /proc/self/maps'
#: text instead, which is what a kernel without the ioctl leaves (it is
#: set so at the first ENOTTY).
QUERY_MAPS_BY_IOCTL = True
#: _IOWR('f', 17, struct procmap_query) of linux/fs.h, and that struct: size,
#: query_flags, query_addr, vma_start, vma_end, vma_flags, vma_page_size,
#: vma_offset, inode (u64); dev_major, dev_minor, vma_name_size,
#: build_id_size (u32); vma_name_addr, build_id_addr (u64).
_PROCMAP_QUERY = 0xC0686611
_QUERY = struct.Struct("=9Q4I2Q")
_VMA_READABLE, _VMA_WRITABLE, _VMA_EXECUTABLE, _VMA_SHARED = 0x1, 0x2, 0x4, 0x8
#: The mapping holding the address, else the next one above it; file-backed only.
_COVERING_OR_NEXT_FILE_VMA = 0x10 | 0x20


def regions_at(addresses: list[int]) -> list[Region | None]:
    """The file mapping holding each address, or None, as the kernel reads now."""
    global QUERY_MAPS_BY_IOCTL
    if not addresses:
        return []
    if QUERY_MAPS_BY_IOCTL:
        try:
            return _queried_regions_at(addresses)
        except OSError as error:
            if error.errno not in (errno.ENOTTY, errno.EINVAL):
                raise
            QUERY_MAPS_BY_IOCTL = False  # a kernel before 6.11
    return _parsed_regions_at(addresses)


def _queried_regions_at(addresses: list[int]) -> list[Region | None]:
    """`regions_at` by PROCMAP_QUERY (see the module docstring)."""
    found: dict[int, Region | None] = {}
    ordered = sorted(set(addresses))
    with open("/proc/self/maps", "rb", buffering=0) as maps:
        index = 0
        while index < len(ordered):
            query = bytearray(_QUERY.pack(_QUERY.size, _COVERING_OR_NEXT_FILE_VMA, ordered[index], *[0] * 12))
            try:
                fcntl.ioctl(maps.fileno(), _PROCMAP_QUERY, query)
            except FileNotFoundError:  # ENOENT: no file mapping at or above the address
                break
            _, _, _, start, end, flags, _, _, inode, major, minor, *_ = _QUERY.unpack(query)
            region = Region(start, end, (major, minor, inode), _permissions(flags))
            while index < len(ordered) and ordered[index] < end:
                found[ordered[index]] = region if ordered[index] >= start else None
                index += 1
    return [found.get(address) for address in addresses]


def _permissions(flags: int) -> str:
    """A PROCMAP_QUERY mapping's flags as /proc/self/maps writes them ("rw-s")."""
    return "".join((
        "r" if flags & _VMA_READABLE else "-",
        "w" if flags & _VMA_WRITABLE else "-",
        "x" if flags & _VMA_EXECUTABLE else "-",
        "s" if flags & _VMA_SHARED else "p",
    ))


def _parsed_regions_at(addresses: list[int]) -> list[Region | None]:
    """`regions_at` from /proc/self/maps' text, by bisection over the starts
    of the file mappings between the least and the greatest address."""
    regions = _file_regions(min(addresses), max(addresses))
    starts = [region.start for region in regions]
    found = []
    for address in addresses:
        index = bisect.bisect_right(starts, address) - 1
        found.append(regions[index] if index >= 0 and address < regions[index].end else None)
    return found


def _file_regions(low: int, high: int) -> list[Region]:
    """The VMAs of this process that map a file and lie between `low` and
    `high`, in address order (the order /proc/self/maps lists them in). Only
    a line's span is parsed until it is known to matter: most of some 450
    lines are libraries."""
    with open("/proc/self/maps", "rb") as maps:
        lines = maps.read().splitlines()
    regions = []
    for line in lines:
        span, _, rest = line.partition(b" ")
        start_text, _, end_text = span.partition(b"-")
        start = int(start_text, 16)
        if start > high:
            break
        end = int(end_text, 16)
        if end <= low:
            continue
        permissions, _, device, inode = rest.split(None, 4)[:4]
        if inode == b"0":
            continue
        major, _, minor = device.partition(b":")
        regions.append(Region(start, end, (int(major, 16), int(minor, 16), int(inode)), permissions.decode()))
    return regions
