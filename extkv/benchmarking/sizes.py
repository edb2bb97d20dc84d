"""Byte units and how the benchmarks write a size.

Theory of operation
-------------------
Cases, clocks and reports all speak of sizes in binary units; a report
only writes them, so the units and `size_label` stand apart from the
geometries (which need torch and extkv's layout code) and a report can
label sizes without importing either.
"""

from __future__ import annotations

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def size_label(num_bytes: int) -> str:
    """"32GiB", "256MiB", "31.4GiB": bytes in three significant digits."""
    unit, name = (GiB, "GiB") if num_bytes >= GiB else (MiB, "MiB") if num_bytes >= MiB else (KiB, "KiB")
    return f"{num_bytes / unit:.3g}{name}"
