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
(`Driver.side_stream`); after each step it records a fence there. So a
foreground operation waits for at most one step, never for the whole
window, and nothing else of the cache changes while a step runs.

The engine's `commit(n)`:

- n within grown: asked becomes n; the engine's current stream waits for
  the fence of the last step (`Driver.wait_for`), so no kernel it queues
  later touches a block before its zeroing has run. No driver call.
- n past grown: the commit grows the buffer itself, as without
  commit-ahead (waiting for a step in flight first, by the lock), then
  counts.

Either way the worker is woken to restore the window.

How the other operations meet the worker (each holds the lock, so a step in
flight has finished before it starts):

- shrink and defragment: the blocks past asked are discarded with the rest
  of what the operation remaps; then the window grows again (a defragmented
  prefix stays one chunk per segment; the blocks the worker adds after it
  are chunks of their own).
- release_physical: every page goes, and the worker pauses; recommit maps
  the asked blocks and resumes it.
- free, and `commit_ahead(0)`: the worker stops and is joined (outside the
  lock), then the cache frees as usual.

Faults: a step that meets out-of-memory (the engine's own allocations took
the memory) stops the worker silently until the next commit wakes it: the
engine never asked for those blocks. Any other error of a step is kept, and
the next `commit` raises it (a `BackgroundGrowthError` naming the step,
chained to the driver's error) before it changes anything; the commit
after that runs normally, waking the worker to try again.
"""

from __future__ import annotations

import threading
import time

from .errors import DriverError, OutOfMemoryError

#: Bytes the worker maps per step, over every segment: a step holds the
#: reservation's lock, so this bounds how long a foreground operation waits.
#: A one-segment commit of 256 MiB took 0.15 ms on the H200 (CUDA 13.0).
DEFAULT_STEP_BYTES = 256 << 20


class BackgroundGrowthError(DriverError):
    """A commit-ahead step failed; raised by the next `commit`."""


class CommitAhead:
    """The worker of one ExtensibleKVCache, which makes and drives it; every
    method but `stop` runs with the cache's buffer lock held."""

    def __init__(self, cache, window_blocks: int, max_blocks: int, step_blocks: int):
        self.cache = cache
        self.window_blocks = window_blocks
        self.max_blocks = max_blocks
        self.step_blocks = step_blocks
        #: The fence after the last step's zeroing (None: none in flight).
        self.fence: object | None = None
        #: A step's error for the next commit to raise.
        self.error: BaseException | None = None
        #: While the cache sleeps (released, not recommitted) nothing grows.
        self.paused = False
        #: Steps made, and blocks they mapped: for tests and reports.
        self.steps = 0
        self.grown_blocks = 0
        self._wake = threading.Condition(cache.buffer.lock)
        self._stopping = False
        self._pending = True
        self._thread = threading.Thread(target=self._run, name="extkv-commit-ahead", daemon=True)
        self._thread.start()

    # -- called by the cache, lock held -------------------------------------
    def wake(self) -> None:
        self._pending = True
        self._wake.notify()

    def raise_kept_error(self) -> None:
        error, self.error = self.error, None
        if error is not None:
            raise BackgroundGrowthError(
                f"a commit-ahead step failed: {error}; nothing of this commit ran, and the next one retries",
                getattr(error, "code", -1), getattr(error, "name", type(error).__name__),
            ) from error

    def _target(self) -> int:
        cache = self.cache
        wanted = min(cache.num_committed_blocks + self.window_blocks, self.max_blocks)
        if wanted <= cache.grown_blocks:
            return wanted
        return min(wanted, cache.committable_blocks())

    # -- the thread ---------------------------------------------------------------
    def _run(self) -> None:
        driver = self.cache.buffer.driver
        with driver.side_stream():
            while True:
                with self._wake:
                    while not (self._stopping or (self._pending and not self.paused and self.error is None)):
                        self._wake.wait()
                    if self._stopping:
                        return
                    self._pending = self._step(driver)
                # Between steps the lock is free: let a waiting operation in.
                time.sleep(0)

    def _step(self, driver) -> bool:
        """One step toward the target; whether another is due."""
        cache = self.cache
        if not cache.is_live:
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
            self.error = error
            return False
        self.fence = driver.fence()
        self.steps += 1
        self.grown_blocks += to - grown
        return to < target

    def stop(self) -> None:
        """Stop the worker after its step in flight and join it. Call without
        the lock held: the worker needs it to finish its step."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not threading.current_thread():
            self._thread.join()
