"""Commit ahead: a background worker maps blocks before the engine asks.

Theory of operation
-------------------
An engine that commits while serving pays the whole create, map and zero of
the new blocks in its step. With commit-ahead on
(`ExtensibleKVCache.commit_ahead`), a worker thread keeps blocks mapped and
zeroed past what the engine has committed, so the engine's `commit(n)`
usually finds its blocks ready and only counts them.

Counts, all in blocks:

- *asked*: what the engine has committed (`num_committed_blocks`); views,
  committed tensors and the engine's block ids stop here.
- *grown*: what the buffer has mapped and zeroed (its segment sizes); never
  below asked.
- *target*: ``min(asked + window, max_blocks, committable_blocks())``: the
  worker grows toward it, never past what `committable_blocks()` allows, so
  a commit ahead never eats into `reserved_headroom_bytes`.

The worker grows in steps of at most `step_blocks`, each a plain growth of
the buffer (a transaction: a failed step leaves the buffer as before), made
while it holds the reservation's lock, on a stream of its own
(`Driver.side_stream`); after each step it records a fence there and
publishes the blocks as *ready*. Between steps the lock is free, so a
locked operation waits for one step at most.

The engine's `commit(n)`:

- n within ready: counted without the reservation's lock (`count`, under
  the worker's own small lock), so a step in flight never delays it; the
  engine's current stream waits for the fence of the last step
  (`Driver.wait_for`), so no kernel it queues later touches a block before
  its zeroing has run. No driver call.
- n past ready: the locked commit grows the buffer itself, as without
  commit-ahead (waiting for a step in flight first, by the lock), then
  counts.

Either way the worker is woken to restore the window. An operation that
unmaps or moves mapped blocks (shrink, defragment, release) first
withdraws the ready count, so no commit counts without the lock while it
runs.

How the other operations meet the worker (each holds the lock, so a step in
flight has finished before it starts):

- shrink and defragment: the blocks past asked are discarded with the rest
  of what the operation remaps; then the window grows again (a defragmented
  prefix stays one chunk per segment; the blocks the worker adds after it
  are chunks of their own).
- release_physical: every page goes, and the worker pauses; recommit maps
  the asked blocks and resumes it.
- free, and `commit_ahead(0)`: the worker stops and is joined (outside the
  lock) and the device synchronized, then the cache frees as usual. Blocks
  it left mapped past the committed ones stay, and a later commit counts
  them without mapping; a shrink to fewer releases them.

Faults: a step that meets out-of-memory (the engine's own allocations took
the memory) stops the worker silently until the next commit wakes it: the
engine never asked for those blocks. Any other error of a step is kept, and
the next `commit` raises it (a `BackgroundGrowthError` naming the step,
chained to the driver's error) before it changes anything; the commit
after that runs normally, waking the worker to try again.
"""

from __future__ import annotations

import os
import threading
import time

from .deferred_signals import deferred_signals
from .errors import DriverError, OutOfMemoryError

#: Bytes the worker maps per step, over every segment: a step holds the
#: reservation's lock, so this bounds how long a foreground operation waits.
#: A one-segment commit of 256 MiB took 0.15 ms on the H200 (CUDA 13.0).
DEFAULT_STEP_BYTES = 256 << 20


class BackgroundGrowthError(DriverError):
    """A commit-ahead step failed; raised by the next `commit`."""


class CommitAhead:
    """The worker of one ExtensibleKVCache, which makes and drives it.

    `_counts` (a condition on a lock of its own) guards the published
    counts: `ready`, `fence`, `error`, and the cache's committed count while
    commit-ahead is on. Lock order: the reservation's lock, then `_counts`;
    the worker waits on `_counts` holding neither."""

    def __init__(self, cache, window_blocks: int, max_blocks: int, step_blocks: int):
        self.cache = cache
        self.window_blocks = window_blocks
        self.max_blocks = max_blocks
        self.step_blocks = step_blocks
        #: Blocks a commit may count without the reservation's lock: mapped
        #: and zeroed, and no operation that remaps them in flight.
        self.ready = 0 if cache.is_asleep else cache.grown_blocks
        #: The fence after the last step's zeroing (None: none in flight).
        self.fence: object | None = None
        #: A step's error for the next commit to raise.
        self.error: BaseException | None = None
        #: Steps made: for tests and reports.
        self.steps = 0
        #: A worker started while the cache sleeps waits for its wake.
        self._paused = cache.is_asleep
        self._withdrawn = False
        self._stopping = False
        self._pending = True
        self._counts = threading.Condition(threading.Lock())
        #: The worker, its lock and its stream are this process's: a forked
        #: child (whose caches only free) has no worker to stop.
        self._pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name="extkv-commit-ahead", daemon=True)
        self._thread.start()

    # -- the engine's thread, without the reservation's lock ----------------------
    def count(self, num_blocks: int) -> bool:
        """Count `num_blocks` committed if they are ready, ordering the
        caller's stream after their zeroing; False: the caller takes the
        locked path (blocks not ready, a kept error, an operation in flight)."""
        with deferred_signals(), self._counts:
            if num_blocks > self.ready or self.error is not None:
                return False
            cache = self.cache
            if num_blocks > cache.num_committed_blocks:
                cache.buffer.driver.wait_for(self.fence)
                cache.num_committed_blocks = num_blocks
            self._wake()
            return True

    # -- the cache's operations, reservation lock held ------------------------------
    def counted(self, num_blocks: int) -> None:
        """A locked commit made `num_blocks` committed (grow-only: a count
        raised meanwhile by `count` stays)."""
        with self._counts:
            cache = self.cache
            cache.num_committed_blocks = max(cache.num_committed_blocks, num_blocks)
            if not (self._withdrawn or self._paused):
                self.ready = cache.grown_blocks
            self._wake()

    def withdraw(self) -> None:
        """Before an operation that unmaps or moves mapped blocks: no commit
        counts without the lock until `restore`."""
        with self._counts:
            self._withdrawn, self.ready = True, 0

    def restore(self) -> None:
        with self._counts:
            self._withdrawn = False
            self.ready = 0 if self._paused else self.cache.grown_blocks
            self._wake()

    def pause(self) -> None:
        """The cache sleeps: nothing grows, nothing counts without the lock."""
        with self._counts:
            self._paused = True
            self.ready = 0

    def resume(self) -> None:
        with self._counts:
            self._paused = False
        self.restore()

    def raise_kept_error(self) -> None:
        with self._counts:
            error, self.error = self.error, None
            if error is not None:
                self._wake()
        if error is not None:
            raise BackgroundGrowthError(
                f"a commit-ahead step failed: {error}; nothing of this commit ran, and the next one retries",
                getattr(error, "code", -1), getattr(error, "name", type(error).__name__),
            ) from error

    def _wake(self) -> None:  # `_counts` held
        self._pending = True
        self._counts.notify()

    # -- the thread ---------------------------------------------------------------
    def _run(self) -> None:
        driver = self.cache.buffer.driver
        with driver.side_stream():
            while True:
                with self._counts:
                    while not (self._stopping or (self._pending and not self._paused and self.error is None)):
                        self._counts.wait()
                    if self._stopping:
                        return
                    self._pending = False
                with self.cache.buffer.lock:
                    more = self._step(driver)
                if more:
                    with self._counts:
                        self._pending = True
                # Between steps the reservation's lock is free: let a waiting
                # operation in.
                time.sleep(0)

    def _target(self) -> int:
        cache = self.cache
        wanted = min(cache.num_committed_blocks + self.window_blocks, self.max_blocks)
        if wanted <= cache.grown_blocks:
            return wanted
        return min(wanted, cache.committable_blocks())

    def _step(self, driver) -> bool:
        """One step toward the target, reservation lock held; whether another is due."""
        cache = self.cache
        if not cache.is_live or self._paused:
            return False
        grown, target = cache.grown_blocks, self._target()
        if grown >= target:
            return False
        to = min(target, grown + self.step_blocks)
        try:
            cache.buffer.grow_blocks_(to, True)
        except OutOfMemoryError:
            return False
        except Exception as error:  # kept for the next commit, which raises it
            with self._counts:
                self.error = error
            return False
        fence = driver.fence()
        with self._counts:
            # No operation that withdraws can be in flight: it holds the
            # reservation's lock, as this step does.
            self.fence, self.steps, self.ready = fence, self.steps + 1, to
        return to < target

    def stop(self) -> None:
        """Stop the worker after its step in flight and join it. Call without
        the reservation's lock held: the worker needs it to finish its step."""
        if os.getpid() != self._pid:
            return  # a forked child: `_counts` may have been held at the fork
        with self._counts:
            self._stopping = True
            self.ready = 0
            self._counts.notify()
        if self._thread is not threading.current_thread():
            self._thread.join()
            # Its zeroing ran on its own stream: done before anyone counts
            # the blocks it left without a fence to wait for.
            self.cache.buffer.driver.synchronize()
