"""Descriptors a test opened and left open.

Counting /proc/self/fd before and after an operation compares the whole
process, not the operation: garbage of an earlier test (a socket pair held in
a reference cycle) that a collection triggered during the operation closes,
the count falls, and a leak of as many descriptors would pass unseen, while
the exact comparison fails a correct operation. So a descriptor is named by
its number and the file behind it (device and inode): "left open" is a pair
that was not open before, whatever else closed meanwhile, and a number
reused for another file counts as new. No collection is forced: in a check's
worker, holding torch and a model, one before and one after each of
test_connector.py's leak checks added 23 s to that file (9.3 to 32.5 s,
host reference), and a descriptor the operation left to the collector is
not closed yet.
"""

from __future__ import annotations

import os

Descriptor = tuple[int, int, int]


def open_descriptors() -> frozenset[Descriptor]:
    """Every descriptor this process holds, as (number, device, inode)."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            stat = os.fstat(int(name))
        except OSError:  # listdir's own descriptor, closed by now
            continue
        found.add((int(name), stat.st_dev, stat.st_ino))
    return frozenset(found)


def left_open(before: frozenset[Descriptor]) -> list[str]:
    """Descriptors open now that were not in `before`, each as `fd N: what
    it points to`; empty when nothing was left open."""
    left = []
    for number, _, _ in sorted(open_descriptors() - before):
        try:
            target = os.readlink(f"/proc/self/fd/{number}")
        except OSError:
            target = "closed while read"
        left.append(f"fd {number}: {target}")
    return left
