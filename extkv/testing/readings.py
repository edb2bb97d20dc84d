"""Memory readings a test chooses, around a real driver.

Sizing turns readings of free memory into block counts and a cap on torch.
Real readings move with everything else on the machine, so a test that wants
exact, hand-computed answers wraps the real driver in `InjectedReadingsDriver`:
every chunk, mapping and byte is still real; only `memory_info()` answers
with the numbers the test set (and may change between steps).
"""

from __future__ import annotations

from .. import validate
from ..vmm import Driver
from ..vmm.wrapping import WrappingDriver


class InjectedReadingsDriver(WrappingDriver):
    """`inner`, except that `memory_info()` returns `(free, total)` as set."""

    def __init__(self, inner: Driver, *, free: int, total: int):
        super().__init__(inner)
        self.set_readings(free=free, total=total)

    def set_readings(self, *, free: int, total: int) -> None:
        total = validate.integer("total", total, minimum=1)
        self.free = validate.integer("free", free, maximum=total)
        self.total = total

    def memory_info(self) -> tuple[int, int]:
        return self.free, self.total

    def describe(self) -> dict[str, str]:
        return {**self.inner.describe(), "readings": f"injected: {self.free} of {self.total} bytes free"}
