"""Fault injection around a real driver.

`FaultInjectingDriver(inner, {"map": 3})` behaves exactly like `inner` except
that its 3rd `map` call raises before reaching the driver. Each planned fault
fires once, so a retry of the same operation can succeed: that is how tests
prove a failed step leaves a consistent object that a retry completes. The real
driver does all the real work; nothing is simulated but the failure.
"""

from __future__ import annotations

from typing import Mapping

from ..errors import DriverError, OutOfMemoryError
from ..faultable import FAULTABLE_STEPS
from .base import Chunk, Driver
from .wrapping import WrappingDriver


class FaultInjectingDriver(WrappingDriver):
    """Wraps a driver; fails the Nth call of chosen steps once each.

    `out_of_memory=True` makes injected faults `OutOfMemoryError`s, the error a
    real driver gives when physical memory runs out.
    """

    def __init__(self, inner: Driver, fail_on: Mapping[str, int] = {}, *, out_of_memory: bool = False):
        self._check_plan(fail_on)
        super().__init__(inner)
        self.out_of_memory = out_of_memory
        self._planned = dict(fail_on)
        self.calls = dict.fromkeys(FAULTABLE_STEPS, 0)
        #: Faults raised so far, as (step, call number).
        self.fired: list[tuple[str, int]] = []

    def _maybe_fail(self, step: str, size: int | None, address: int | None) -> None:
        self.calls[step] += 1
        if self._planned.get(step) != self.calls[step]:
            return
        del self._planned[step]
        self.fired.append((step, self.calls[step]))
        error_type = OutOfMemoryError if self.out_of_memory else DriverError
        raise error_type(
            f"{step} (injected fault at call {self.calls[step]})",
            2 if self.out_of_memory else -1,
            "INJECTED_OUT_OF_MEMORY" if self.out_of_memory else "INJECTED_FAULT",
            size=size,
            address=address,
        )

    def fail_in(self, step: str, nth: int = 1) -> None:
        """Plan a fault for the `nth` call of `step` counted from now."""
        self._check_plan({step: nth})
        self._planned[step] = self.calls[step] + nth

    @staticmethod
    def _check_plan(fail_on: Mapping[str, int]) -> None:
        unknown = set(fail_on) - set(FAULTABLE_STEPS)
        if unknown:
            raise ValueError(f"unknown driver steps {sorted(unknown)}; expected some of {FAULTABLE_STEPS}")
        for step, nth in fail_on.items():
            if isinstance(nth, bool) or not isinstance(nth, int) or nth < 1:
                raise ValueError(f"fault for {step!r} must be planned at call number >= 1, got {nth!r}")

    @property
    def pending(self) -> dict[str, int]:
        """Planned faults that have not fired yet."""
        return dict(self._planned)

    def _reserve(self, size: int) -> int:
        self._maybe_fail("reserve", size, None)
        return self.inner._reserve(size)

    def _create(self, size: int) -> Chunk:
        self._maybe_fail("create", size, None)
        return self.inner._create(size)

    def _release(self, chunk: Chunk) -> None:
        self._maybe_fail("release", chunk.size, None)
        self.inner._release(chunk)

    def _export_fd(self, chunk: Chunk, writable: bool) -> int:
        self._maybe_fail("export", chunk.size, None)
        return self.inner._export_fd(chunk, writable)

    def _import_fd(self, fd: int, size: int) -> Chunk:
        self._maybe_fail("import", size, None)
        return self.inner._import_fd(fd, size)

    def _map(self, address: int, chunk: Chunk) -> None:
        self._maybe_fail("map", chunk.size, address)
        self.inner._map(address, chunk)

    def _set_access(self, address: int, size: int, writable: bool) -> None:
        self._maybe_fail("set_access", size, address)
        self.inner._set_access(address, size, writable)

    def _unmap(self, address: int, size: int) -> None:
        self._maybe_fail("unmap", size, address)
        self.inner._unmap(address, size)
