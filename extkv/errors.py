"""Exceptions raised by extkv.

Everything extkv raises on purpose derives from `ExtkvError`. Bad arguments are
`ValueError` / `IndexError` (also `ExtkvError` subclasses where they come from
extkv's own checks), so callers that already catch the builtin still work.
A driver call that fails becomes a `DriverError` naming the call, the result
code, the size and the address, because "cuMemMap failed" alone is useless when
a 64 GiB reservation fails at one granule out of thousands.
"""

from __future__ import annotations

import sys
import warnings


class ExtkvError(Exception):
    """Base class of every exception extkv raises on purpose."""


class DriverError(ExtkvError, RuntimeError):
    """A virtual-memory driver call failed.

    `code` is the CUresult (CUDA) or errno (host) as an int; `code_name` is its
    symbolic name. `size` and `address` are the arguments of the failed call
    (None where the call takes none).
    """

    def __init__(
        self,
        call: str,
        code: int,
        code_name: str,
        *,
        size: int | None = None,
        address: int | None = None,
        detail: str = "",
    ):
        self.call = call
        self.code = code
        self.code_name = code_name
        self.size = size
        self.address = address
        parts = [f"{call} failed: {code_name} ({code})"]
        if size is not None:
            parts.append(f"size {size} bytes ({size:#x})")
        if address is not None:
            parts.append(f"address {address:#x}")
        message = ", ".join(parts)
        if detail:
            message += f". {detail}"
        super().__init__(message)


class OutOfMemoryError(DriverError):
    """The driver could not create physical memory of the requested size."""


class StateError(ExtkvError, RuntimeError):
    """An operation is not legal in the object's current state (e.g. freed)."""


class DeadlineExceededError(ExtkvError, TimeoutError):
    """An exchange with another process (or a digest) was not over within
    its timeout. The message names the exchange, the timeout and how far it
    got; a `TimeoutError`, so callers that catch the builtin still work."""


def warn_without_raising(message: str, category: type[Warning] = RuntimeWarning, *, stacklevel: int = 1) -> None:
    """Warn of something already done, never raise it: the caller is past a
    step it cannot undo (a descriptor closed, a lock gone without), and
    filters that turn warnings into errors (`-W error`) would make that step
    look refused, and a refused step is retried or undone. Such a warning is
    shown instead, at the caller's caller's line as `warnings.warn` would."""
    try:
        warnings.warn(message, category, stacklevel=stacklevel + 1)
    except Warning as warning:
        caller = sys._getframe(stacklevel)
        warnings.showwarning(warning, category, caller.f_code.co_filename, caller.f_lineno)


class BudgetProtocolError(ExtkvError, ValueError):
    """A message or a call of the shared KV budget (extkv.budget) that its
    protocol does not allow: a malformed field, an unknown engine or ticket,
    a transition its state forbids. The message names the field or the
    engine, the value and what was expected; nothing was changed."""


class BudgetUnavailableError(ExtkvError, ConnectionError):
    """The budget daemon cannot be reached (never started, gone, or it
    refused this process): growth fails closed, while memory already held
    stays usable. The message names the socket and the cause. A client
    whose daemon went away rejoins one that answers again on its socket
    (extkv.budget.client), and growth resumes."""


class BudgetDeniedError(OutOfMemoryError):
    """The budget daemon denied a reservation: granting it would take the
    engines on the device past the budget, or this engine past its cap; or
    its caller gave it up before the answer came (extkv.budget.client's
    AbandonableReserves). An OutOfMemoryError, so a caller that meets a
    driver's out-of-memory meets this the same way; the message names the
    bytes asked and the reason."""

    def __init__(self, nbytes: int, reason: str):
        self.reason = reason
        super().__init__("budget reserve", 0, "BUDGET_DENIED", size=nbytes, detail=reason)
