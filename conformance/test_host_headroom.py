"""Where the host's memory headroom counts reclaimable file cache.

A host commit is refused when it does not fit `room_for` the headroom: what
the kernel could give, less a margin kept free for other processes. Under a
cgroup limit the kernel drops the cgroup's file cache before it refuses a
charge, so that cache counts as available; reading it (memory.stat) is
skipped where it cannot change the verdict. These tests hold both to made-up
/proc/meminfo and memory.stat texts: the cache is read wherever it decides
the verdict, margin included, and counts only where the kernel would
reclaim it.
"""

from __future__ import annotations

import pytest

from extkv.vmm.host_memory import (
    NO_LIMIT_BYTES,
    CgroupMemoryReading,
    file_cache_decides,
    host_memory_headroom,
    room_for,
)

pytestmark = pytest.mark.invariant(5)

MiB, GiB = 1 << 20, 1 << 30
#: 32 GiB available on the machine: the cgroup's limit is what decides.
MEMINFO = "MemTotal: 67108864 kB\nMemFree: 1048576 kB\nMemAvailable: 33554432 kB\n"
LIMIT = 4 * GiB
#: 1 GiB of file cache the kernel would reclaim (v2 names), beside extkv's
#: memfd pages, which are shmem: swap-backed, never reclaimed as cache.
STAT = ("anon 104857600\nfile 2147483648\nshmem 1073741824\ninactive_file 805306368\nactive_file 268435456\n"
        "file_mapped 0\n")


def fits(size: int, usage: int, *, read_stat: bool) -> bool:
    """The verdict of a host commit of `size` bytes under the cgroup of
    usage `usage`, with its memory.stat read or not."""
    reading = CgroupMemoryReading("/sys/fs/cgroup/made-up", f"{LIMIT}\n", f"{usage}\n", STAT if read_stat else "")
    return size <= room_for(host_memory_headroom(MEMINFO, [reading]).available)


@pytest.mark.parametrize("free_below_limit", [300 * MiB, 2 * GiB, 0], ids=["300 MiB", "2 GiB", "none"])
def test_the_file_cache_is_read_wherever_it_decides_the_verdict(free_below_limit):
    """Over every size from 0 to past what limit, usage and cache together
    leave, in steps of 1 MiB: reading memory.stat only where
    `file_cache_decides` says gives the verdict that always reading it gives."""
    usage = LIMIT - free_below_limit
    differ = [
        size
        for size in range(0, free_below_limit + 2 * GiB, MiB)
        if fits(size, usage, read_stat=file_cache_decides(LIMIT, usage, size)) != fits(size, usage, read_stat=True)
    ]
    assert differ == [], f"{len(differ)} sizes from {differ[0]} bytes refused for want of the file cache it did not read"


def test_a_commit_that_fits_limit_less_usage_but_not_the_margin_reads_the_cache():
    """300 MiB under the limit, less a sixteenth kept free, leaves 281.25
    MiB: a commit of 290 MiB fits limit - usage yet needs the cache, which
    makes it fit."""
    usage, size = LIMIT - 300 * MiB, 290 * MiB
    assert size <= LIMIT - usage and size > room_for(LIMIT - usage)
    assert file_cache_decides(LIMIT, usage, size)
    assert not fits(size, usage, read_stat=False) and fits(size, usage, read_stat=True)
    assert not file_cache_decides(LIMIT, usage, 200 * MiB)  # fits with the margin: no read


def test_only_the_file_lists_count_and_never_on_top_of_mem_available():
    """The cache counted is inactive_file + active_file (1 GiB here), not
    `file`, which holds shmem (memfd pages, extkv's own among them); and a
    machine whose MemAvailable (which already counts its page cache) is
    below the cgroup's room keeps MemAvailable."""
    reading = CgroupMemoryReading("/sys/fs/cgroup/made-up", f"{LIMIT}\n", f"{LIMIT - 300 * MiB}\n", STAT)
    assert host_memory_headroom(MEMINFO, [reading]).available == 300 * MiB + GiB
    tight = "MemTotal: 67108864 kB\nMemAvailable: 512000 kB\n"
    headroom = host_memory_headroom(tight, [reading])
    assert headroom.available == 512000 * 1024 and headroom.limited_by.startswith("MemAvailable"), headroom


@pytest.mark.parametrize("meminfo", [MEMINFO, "MemTotal: 1099511627776 kB\nMemAvailable: 1099511627776 kB\n"],
                         ids=["32 GiB available", "1 PiB available"])
def test_a_level_at_no_limit_is_never_the_tightest_so_its_usage_need_not_be_read(meminfo):
    """cgroup v1 writes "no limit" as 2**63 - 4096 bytes. From NO_LIMIT_BYTES
    up, whatever usage from 0 to 2**61 bytes and whatever cache the level
    reads, it leaves the headroom what MemAvailable alone gives, so the
    check skips its usage and memory.stat."""
    alone = host_memory_headroom(meminfo)
    for limit in (NO_LIMIT_BYTES, (1 << 63) - 4096):
        for usage in (0, GiB, 1 << 61):
            reading = CgroupMemoryReading("/sys/fs/cgroup/memory/made-up", f"{limit}\n", f"{usage}\n", STAT)
            assert host_memory_headroom(meminfo, [reading]) == alone, (limit, usage)
