"""Commit ahead: a background worker maps blocks before the engine asks.

Theory of operation
-------------------
An engine that commits while serving pays the whole create, map and zero of
the new blocks in its step. With commit-ahead on
(`ExtensibleKVCache.commit_ahead`), a worker thread keeps blocks mapped and
zeroed past what the engine has committed, so the engine's `commit(n)`
usually finds its blocks ready and only counts them.

Counts, all in blocks:

- *committed*: what the engine has committed (`num_committed_blocks`);
  views, committed tensors and the engine's block ids stop here. The cache
  owns it: extkv.cache writes it, always under the cache's count lock.
- *grown*: what the buffer has mapped and zeroed (its segment sizes); never
  below committed while the cache is awake.
- *ready*: what a commit may count without the reservation's lock: the
  grown blocks while the worker runs and no operation that unmaps or moves
  mapped blocks is in flight; 0 otherwise (off, stopped, asleep, a kept
  error, a remap in flight, a forked child's copy). The worker owns it.
- *target*: ``min(committed + window, max_blocks, ceiling)``: the worker
  grows toward it. Unbudgeted the ceiling is `committable_blocks()`, so a
  commit ahead never eats into `reserved_headroom_bytes`; under a shared
  budget it is the capacity, and each step's reserve asks the daemon,
  waiting while it reclaims from idle engines: the engine's steps go on
  over the blocks already ready meanwhile. The ceiling is read once per
  wake, at the first step that needs it, and kept for the steps that
  follow: the worker's own creates leave it where it was (what they take
  from free memory they add to what the cache holds), and a read of the
  device's free memory per step cost the engine's steps. On the H100, the
  growth loop's p99 step with commit-ahead read 1.101x the no-growth loop
  with a read per 256 MiB step, and 1.035x with none (600 graphed steps,
  32 GiB grown by 28 GiB, least of two rounds).

One small lock, the cache's count lock, guards committed, ready, the fence
and the worker's flags; lock order: the reservation's lock, then the count
lock. The worker waits on the count lock holding nothing else.

The worker grows in steps of at most `step_blocks`, each a plain growth of
the buffer (a transaction: a failed step leaves the buffer as before), made
while it holds the reservation's lock, on a stream of its own
(`Driver.side_stream`); after each step it records a fence there and
publishes the blocks as ready. Between steps the lock is free, so a locked
operation waits for one step at most.

Every change of the worker's life (start, stop, pause, resume, withdraw,
restore) is made by an operation that holds the reservation's lock, so
none of them races another or a step: at most one worker per cache, and
after `free()` returns none is alive. A stop joins the worker while its
caller holds the reservation's lock, which the worker may be waiting for:
the worker therefore waits for that lock in slices of LOCK_POLL_S and gives
up once stopped, so a stop made inside a caller's `with cache.buffer.lock`
(documented as re-entrant for callers) returns.

How the other operations meet the worker:

- a commit within ready is counted without the reservation's lock; the
  engine's current stream waits for the fence of the last step
  (`Driver.wait_for`), so no kernel it queues later touches a block before
  its zeroing has run. Past ready, the locked commit grows the buffer
  itself, as without commit-ahead. Either way a commit that counts new
  blocks wakes the worker to restore the window, and one that counts none
  (an engine commits its count before every step) leaves it asleep: on
  the 2-core host such a commit took 7.75 us of wall time and 8.53 us of
  CPU when it woke the worker, and 4.82 us of both when it did not.
- shrink and defragment withdraw ready first; the blocks past committed
  are discarded with the rest of what they remap, then the window grows
  again (a defragmented prefix stays one chunk per segment; the blocks
  the worker adds after it are chunks of their own). A shrink keeping
  contents releases the worker's blocks with every other chunk holding no
  kept byte; what the worker grows again past the new count is zeroed,
  also where a kept chunk still maps it.
- release_physical pauses the worker (ready 0); recommit maps the
  committed blocks and resumes it.
- free and `commit_ahead(0)` stop and join the worker and synchronize the
  device (its zeroing ran on its own stream). Blocks it left mapped past
  the committed ones stay; a later commit counts them without mapping, and
  a shrink to fewer releases them.

Faults: a step that meets out-of-memory (the engine's own allocations took
the memory, or the budget denied its reserve) idles the worker silently
until the next commit that counts new blocks wakes it: the engine never
asked for those blocks.
So does a budget daemon gone (BudgetUnavailableError): the engine serves
on from the blocks it holds, its commits within ready counted as ever, and
its own first commit past them meets the error itself (growth fails
closed).
A step's reserve that waits holds the reservation's lock meanwhile. A
locked commit, which asks for blocks itself, waits for the daemon's
answer: a reclaim's time, at most its deadline (extkv.budget.ledger's
RECLAIM_DEADLINE_S). A free, a release or a `commit_ahead` has no use for
it: before it waits for the lock it gives the reserve up (every worker of
a cache reserves under the cache's one
extkv.budget.client.AbandonableReserves), refusing the worker's reserves
until it holds the lock, after which it stops, pauses or replaces the
worker before a step can reserve again. The step fails as a denied one
does, idling the worker (a recommit wakes a paused one), and the client
cancels the grant the daemon makes later, so its bytes go back. Any other
error, in a step or around it (reading free memory, making the side
stream), is kept, and the next `commit` raises it (a
`BackgroundGrowthError` naming the step, chained to the driver's error)
before it changes anything; the commit after that runs normally, waking
the worker to try again. The worker's thread never ends while
commit-ahead is on.
"""

from __future__ import annotations

import threading
from typing import Callable

from .budget.client import AbandonableReserves
from .errors import BudgetUnavailableError, DriverError, OutOfMemoryError

#: Bytes the worker maps per step, over every segment: a step holds the
#: reservation's lock, so this bounds how long a foreground operation waits.
#: A one-segment commit of 256 MiB took 0.15 ms on the H200 (CUDA 13.0).
DEFAULT_STEP_BYTES = 256 << 20

#: Seconds between the worker's looks at whether it was stopped while it
#: waits for the reservation's lock. Only a worker blocked behind another
#: operation polls, and a stop made under that lock waits at most this long.
LOCK_POLL_S = 0.005


class BackgroundGrowthError(DriverError):
    """A commit-ahead step failed; raised by the next `commit`."""


class CommitAhead:
    """The worker of one ExtensibleKVCache, which makes, drives and stops
    it, holding the reservation's lock each time. The cache hands it its
    count lock, `grow(n)` (map and zero blocks up to n, reservation lock
    held), the blocks its own growth has zeroed so far and the reserves
    its steps make under, which the cache's stops give up."""

    def __init__(self, cache, window_blocks: int, max_blocks: int, step_blocks: int, *,
                 count_lock: threading.Lock, grow: Callable[[int], None], zeroed: int,
                 ceiling: Callable[[], int], reserves: AbandonableReserves):
        self.cache = cache
        self._grow = grow
        self._ceiling = ceiling
        self._reserves = reserves
        self.window_blocks = window_blocks
        self.max_blocks = max_blocks
        self.step_blocks = step_blocks
        #: Blocks a commit may count without the reservation's lock.
        self.ready = 0 if cache.is_asleep else zeroed
        #: The fence after the last step's zeroing (None: none in flight).
        self.fence: object | None = None
        #: An error of the worker's for the next commit to raise.
        self.error: BaseException | None = None
        #: Steps made: for tests and reports.
        self.steps = 0
        #: A worker started while the cache sleeps waits for its wake.
        self._paused = cache.is_asleep
        self._withdrawn = False
        self._stopping = False
        self._pending = True
        #: The ceiling as the first step of the latest wake that needed it
        #: read it; `_fresh`: a wake came since, and the next such step reads
        #: it again. A step runs only after a wake (the first is the start),
        #: and a read that raised idles the worker until the next one.
        self._ceiling_read = 0
        self._fresh = True
        #: The worker waits on `_work`; `settle` waits on `_idle`; both on
        #: the cache's count lock.
        self._work = threading.Condition(count_lock)
        self._idle = threading.Condition(count_lock)
        self._waiting = False
        self._thread = threading.Thread(target=self._run, name="extkv-commit-ahead", daemon=True)
        self._thread.start()

    # -- the cache's operations, reservation lock held ------------------------------
    def published(self, zeroed: int) -> None:
        """A locked operation left `zeroed` blocks mapped and zeroed."""
        with self._work:
            self._publish(zeroed)

    def _publish(self, zeroed: int) -> None:  # count lock held
        """`zeroed` blocks are ready, unless a pause or a withdrawal holds
        ready at 0; wake the worker."""
        if not (self._withdrawn or self._paused):
            self.ready = zeroed
        self.wake()

    def withdraw(self) -> None:
        """Before an operation that unmaps or moves mapped blocks: no commit
        counts without the lock until `restore`."""
        with self._work:
            self._withdrawn, self.ready = True, 0

    def restore(self, zeroed: int) -> None:
        with self._work:
            self._withdrawn = False
            self._publish(zeroed)

    def pause(self) -> None:
        """The cache sleeps: nothing grows, nothing counts without the lock."""
        with self._work:
            self._paused, self.ready = True, 0

    def resume(self, zeroed: int) -> None:
        with self._work:
            self._paused = False
            self._publish(zeroed)

    def raise_kept_error(self) -> None:
        with self._work:
            error, self.error = self.error, None
            if error is not None:
                self.wake()  # ready stays 0 until a step or a locked commit publishes again
        if error is not None:
            raise BackgroundGrowthError(
                f"a commit-ahead step failed: {error}; nothing of this commit ran, and the next one retries",
                getattr(error, "code", -1), getattr(error, "name", type(error).__name__),
            ) from error

    def stop(self) -> None:
        """Stop the worker and join it. The caller holds the reservation's
        lock, so no step is in flight: the worker is waiting for work, or
        for that lock, which it gives up on within LOCK_POLL_S."""
        with self._work:
            self._stopping, self.ready = True, 0
            self._work.notify()
            self._idle.notify_all()
        self._thread.join()
        # Its zeroing ran on its own stream: done before anyone counts the
        # blocks it left without a fence to wait for.
        self.cache.buffer.driver.synchronize()

    # -- any thread, count lock held ------------------------------------------------
    def wake(self) -> None:
        self._pending = self._fresh = True
        self._work.notify()

    # -- any thread, nothing held -------------------------------------------------------
    def settle(self, timeout: float | None) -> bool:
        """Wait until the worker has nothing to do: see
        `ExtensibleKVCache.settle_commit_ahead`."""
        with self._idle:
            return self._idle.wait_for(lambda: self._stopping or (self._waiting and not self._due()), timeout)

    # -- the thread ---------------------------------------------------------------
    def _due(self) -> bool:  # count lock held
        return self._pending and not self._paused and self.error is None

    def _await_work(self) -> bool:
        """Wait until a step is due (True) or the worker is stopped (False)."""
        with self._work:
            while not (self._stopping or self._due()):
                self._waiting = True
                self._idle.notify_all()
                self._work.wait()
            self._waiting = False
            self._pending = False
            return not self._stopping

    def _keep(self, error: BaseException) -> None:
        with self._work:
            self.error, self.ready = error, 0

    def _run(self) -> None:
        driver = self.cache.buffer.driver
        with self._reserves.abandonable():
            due = self._await_work()
            while due:
                try:
                    with driver.side_stream():
                        while due:
                            self._step_locked(driver)
                            due = self._await_work()
                except Exception as error:  # making or leaving the side stream
                    self._keep(error)
                    due = self._await_work()

    def _step_locked(self, driver) -> None:
        """One step under the reservation's lock, unless stopped first."""
        lock = self.cache.buffer.lock
        while not lock.acquire(timeout=LOCK_POLL_S):
            with self._work:
                if self._stopping:
                    return
        try:
            more = self._step(driver)
        except (OutOfMemoryError, BudgetUnavailableError):
            more = False  # idle until the next commit of new blocks wakes it
        except Exception as error:  # kept for the next commit, which raises it
            self._keep(error)
            more = False
        finally:
            lock.release()
        if more:
            with self._work:
                self._pending = True

    def _target(self) -> int:
        cache = self.cache
        wanted = min(cache.num_committed_blocks + self.window_blocks, self.max_blocks)
        if wanted <= cache.grown_blocks:
            return wanted
        with self._work:
            fresh, self._fresh = self._fresh, False
        if fresh:
            self._ceiling_read = self._ceiling()
        return min(wanted, self._ceiling_read)

    def _step(self, driver) -> bool:
        """One step toward the target, reservation lock held; whether another is due."""
        cache = self.cache
        if self._paused or not cache.is_live:
            return False
        grown, target = cache.grown_blocks, self._target()
        if grown >= target:
            return False
        to = min(target, grown + self.step_blocks)
        self._grow(to)
        fence = driver.fence()
        with self._work:
            # No operation that withdraws or pauses can be in flight: it
            # holds the reservation's lock, as this step does.
            self.fence, self.steps, self.ready = fence, self.steps + 1, to
        return to < target
