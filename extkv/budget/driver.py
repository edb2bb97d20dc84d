"""A driver that asks the budget before it creates physical memory.

Theory of operation
-------------------
Every physical create of a cache (a commit, a recommit, a commit-ahead
step, a preserving defragment's scratch) goes through
`Driver.map_new_chunks`, which first calls `admit(size, chunks)` with the
new bytes of the whole operation and runs the creates inside it.
`BudgetedDriver(inner, client)` wraps that one entry: it reserves `size`
bytes from the budget daemon (extkv.budget.client) before anything else,
so that a refusal (BudgetDeniedError, an OutOfMemoryError) changes nothing,
or draws them from what its client holds granted ahead (`BudgetClient(...,
ahead=)`), a create that asks nothing;
then it enters the inner driver's own admission (the host driver's
machine-wide commit lock comes after the reservation, never around it: a
reservation may wait while the daemon asks other engines to shrink, and
their shrinks must not queue behind this commit's lock); and on the way
out it confirms the bytes really created, the rest of the reservation
kept ahead (up to the client's `ahead`) or given back at once, whether the
block ended well or not.

Each create is counted against the reservation of the admission the
calling thread is inside (a commit-ahead worker commits from its own
thread): a create outside one, or past its bytes, is refused before the
driver is called, so no physical memory exists without a covering grant.
A release of a chunk this driver created gives the bytes back (its
client keeps up to `ahead` of them granted ahead, and returns the rest),
unless the admission it was created under is still open (an
undo inside a failing commit): then the confirm counts only the chunks that
remain, so the ledger never hears of bytes it was not yet told it holds.
An imported chunk (another process's memory) is no part of this
engine's grant and is not reported.

The driver tells its client what it holds (`held_bytes`: the bytes of the
chunks it created and has not released), which the client sends in the
`hello` with which it rejoins a daemon that restarted. Each release names
the lease under which the held bytes were last read, so that a release the
rejoin's hello already left out is not returned to the new daemon too
(extkv.budget.client's theory).

`budgeted(device, budget)` is what a cache does with its `budget=`
argument: the device's driver wrapped around that client, or, with none
given, around the process's one client of the daemon EXTKV_BUDGET names
(one lease per engine process, made at the first cache that asks; a forked
child makes its own); with neither, the device as it was.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator

from ..errors import DriverError
from ..vmm import driver_for
from ..vmm.base import Chunk, Driver
from ..vmm.wrapping import WrappingDriver
from .client import BudgetClient


class _Admission:
    """What one `admit` block of one thread creates under: `ticket`, or
    None for bytes granted ahead; `granted`: the bytes it may create;
    `created`: the bytes of its chunks that exist, until it is confirmed."""

    __slots__ = ("ticket", "granted", "created", "confirmed")

    def __init__(self, ticket: int | None, granted: int):
        self.ticket, self.granted, self.created, self.confirmed = ticket, granted, 0, False


class BudgetedDriver(WrappingDriver):
    """Wraps `inner`; every physical create is covered by a grant of `client`."""

    def __init__(self, inner: Driver, client):
        super().__init__(inner)
        self.client = client
        self._thread = threading.local()
        #: The admission each chunk this driver created and has not released was created under.
        self._own: dict[int, _Admission] = {}
        self._own_lock = threading.Lock()
        self._held = 0  # the bytes of those chunks
        self._lease = client.track_held(self.held_bytes)  # the lease its releases are returned under

    @contextlib.contextmanager
    def admit(self, size: int, chunks: int = 1) -> Iterator[None]:
        if not size:  # nothing to create: nothing to ask for
            with self.inner.admit(size, chunks):
                yield
            return
        ticket, granted, lease = self.client.draw(size)
        admission = _Admission(ticket, size)  # the operation creates `size`; the rest is ahead
        outer = getattr(self._thread, "admission", None)
        self._thread.admission = admission
        try:
            with self.inner.admit(size, chunks):
                yield
        finally:
            self._thread.admission = outer
            with self._own_lock:
                admission.confirmed = True
                created = admission.created
            self.client.settle_draw(ticket, granted, created, lease)

    def _create(self, size: int) -> Chunk:
        admission = getattr(self._thread, "admission", None)
        if admission is None or admission.created + size > admission.granted:
            covered = "no reservation" if admission is None else (
                (f"reservation {admission.ticket}" if admission.ticket else "bytes granted ahead")
                + f" of {admission.granted} bytes, {admission.created} of them created")
            raise DriverError("create", 0, "EXTKV_NO_GRANT", size=size,
                              detail=f"a physical create outside a granted reservation ({covered})")
        chunk = self.inner._create(size)
        with self._own_lock:
            admission.created += size
            self._own[chunk.handle] = admission
            self._held += size
        return chunk

    def _release(self, chunk: Chunk) -> None:
        self.inner._release(chunk)
        with self._own_lock:
            admission = self._own.pop(chunk.handle, None)
            unconfirmed = admission is not None and not admission.confirmed
            if admission is not None:
                self._held -= chunk.size
            if unconfirmed:  # an undo inside the admission: its confirm will not count the chunk
                admission.created -= chunk.size
            lease = self._lease
        if admission is not None and not unconfirmed:
            self.client.give_back(chunk.size, lease)

    def held_bytes(self, lease: int) -> int:
        """The bytes of the chunks this driver created and has not released,
        read for the hello of `lease`, under which the releases from now on
        are returned (extkv.budget.client's `track_held`)."""
        with self._own_lock:
            self._lease = lease
            return self._held


#: The process's client of the daemon EXTKV_BUDGET names, once a cache asked.
_environment_client: BudgetClient | None = None
_environment_lock = threading.Lock()


def _forget_environment_client() -> None:
    global _environment_client, _environment_lock
    _environment_client, _environment_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_environment_client)


def environment_client() -> BudgetClient | None:
    """The process's one client of the daemon EXTKV_BUDGET names (made at
    the first call), or None where it is unset or empty."""
    global _environment_client
    with _environment_lock:
        if _environment_client is None:
            _environment_client = BudgetClient.from_environment()
        return _environment_client


def budgeted(device, budget: BudgetClient | None):
    """`device` as a cache given `budget=` uses it: its driver wrapped in a
    BudgetedDriver of `budget`, else of the EXTKV_BUDGET client, else
    `device` unchanged."""
    client = budget if budget is not None else environment_client()
    if client is None:
        return device
    if not isinstance(client, BudgetClient):
        raise ValueError(f"budget must be an extkv.budget.BudgetClient or None, got {client!r}")
    return BudgetedDriver(driver_for(device), client)
