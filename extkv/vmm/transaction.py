"""Multi-step driver sequences that leave nothing behind when a step fails.

Theory of operation
-------------------
Backing memory takes several driver steps (reserve, create, map, grant
access), and any of them can fail. `Transaction` is the one way extkv undoes
such a sequence: after each step succeeds, the caller pushes the step that
undoes it; if the `with` block raises, the undo steps run newest first and the
original error propagates. An undo step is a callable and its arguments,
not a closure, because a commit registers two per chunk and thousands of
chunks per call: a closure per step costs more than the bookkeeping it
protects. Every undo step is attempted even if an earlier one
fails, because each releases something different; their failures are added to
the original error as notes (Python >= 3.11) rather than replacing it, since
the step that failed first is what the caller needs to see. They are also
kept on it as `undo_failures` (`undo_failed` asks): after a failed undo the
driver no longer holds what the caller's bookkeeping says, which only the
caller can act on.

Some of what a failed sequence holds cannot always be handed back at once,
and a leak is worse than a late release. `UnreleasedChunks` is the one place
for that: a chunk given to `release` is released now or, if the driver
refuses, kept until its owner's next `retry`. Retrying is safe because a
failed release leaves the chunk exactly as it was. Only releases are retried
later: replaying any other failed undo step is not safe (an unmap replayed
after its reservation was freed would map over address space that belongs to
someone else). A transaction's undo of a create is therefore
`push(unreleased.release, chunk)`, for every owner alike.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Iterable, Sequence

from .base import Chunk, Driver


class Transaction:
    """Undo steps of one multi-step driver sequence, run newest first if the
    `with` block raises."""

    __slots__ = ("_undo_steps",)

    def __init__(self) -> None:
        self._undo_steps: list[tuple[Callable[..., object], tuple[Any, ...]]] = []

    def push(self, undo: Callable[..., object], *args: Any) -> None:
        """Register `undo(*args)` as the undo of the step that just succeeded."""
        self._undo_steps.append((undo, args))

    def settle(self) -> None:
        """The steps so far succeeded and stay: a later failure undoes only
        the steps registered after this (one transaction serves a series of
        independent sequences, such as the runs of one commit)."""
        self._undo_steps.clear()

    def __enter__(self) -> "Transaction":
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        if error is None:
            return
        failures = []
        for undo, args in reversed(self._undo_steps):
            try:
                undo(*args)
            except Exception as undo_error:
                failures.append(undo_error)
                if hasattr(error, "add_note"):  # Python >= 3.11
                    error.add_note(f"while undoing: {undo_error}")
        if failures:
            # Accumulated: a transaction inside another one may have failed to undo too.
            error.undo_failures = [*getattr(error, "undo_failures", ()), *failures]


def undo_failed(error: BaseException) -> bool:
    """Whether a `Transaction` failed to undo a step while `error` propagated."""
    return bool(getattr(error, "undo_failures", None))


class UnreleasedChunks:
    """Chunks owed a release to `driver`, kept until the driver takes them."""

    def __init__(self, driver: Driver) -> None:
        self._driver = driver
        self._chunks: collections.deque[Chunk] = collections.deque()

    def keep(self, chunks: Iterable[Chunk]) -> None:
        """Record chunks to release at the next `retry`, before trying, so that
        a failure in between cannot lose them."""
        self._chunks.extend(chunks)

    def release(self, chunk: Chunk) -> None:
        """Release `chunk` now, with any kept before it; what the driver
        refuses stays kept and the refusal is raised."""
        self._chunks.append(chunk)
        self.retry()

    def retry(self) -> None:
        """Release every kept chunk, oldest first; stops at the first the
        driver refuses (raised), which stays kept with those after it."""
        # Oldest first, so that a tensor releases in address order, as the
        # raw driver sequence does: benchmark contenders then leave the
        # driver in the same state for whoever runs next. On the H200 the
        # order itself costs nothing measurable, neither the release nor the
        # recommit after it (10 rounds each, 32 GiB in 1 to 256 segments).
        while self._chunks:
            self._driver.release(self._chunks[0])
            self._chunks.popleft()


def map_new_chunks_step_by_step(
    driver: Driver,
    runs: Sequence[tuple[int, int, Sequence[tuple[int, int]]]],
    created: list[Chunk],
    give_back: Callable[[Chunk], object],
    zero_after: Sequence[tuple[int, int]],
) -> None:
    """`Driver.map_new_chunks` through the driver's public steps, one by one,
    so that a wrapper's own steps (an injected fault, a poisoned chunk) take
    part and the live counts are kept by the steps themselves."""
    with driver.batch():
        with Transaction() as undo:
            for address, size, zero in runs:
                chunk = driver.create(size)
                undo.push(give_back, chunk)
                driver.map(address, chunk)
                undo.push(driver.unmap, address, size)
                driver.set_access(address, size)
                created.append(chunk)
                undo.settle()
                for low, count in zero:
                    driver.zero(low, count)
        driver.zero_ranges(zero_after)
