"""A cache under the shared KV budget: no physical create without a grant.

A cache given `budget=` (extkv.budget.driver.BudgetedDriver around the
real host driver) reserves from a real daemon (extkv.testing.budget) before
every create of a commit, a recommit, a commit-ahead step and a preserving
defragment's scratch, confirms what it created and returns what it
releases (a shrink keeping contents asks nothing and returns exactly the
chunks it released): at every quiescent point the daemon's ledger holds exactly the
cache's physical bytes. A counting wrapper under the budgeted driver reads
the ledger at each create and finds a grant covering it (the checks are
extkv.testing.budget's; conformance/test_planted_defects.py runs them over
a driver that creates without asking and one that never says what it
released, and they must fail). A denied reserve
is an OutOfMemoryError that changes nothing; a forked child cannot grow on
its parent's lease; a daemon gone leaves growth failing closed and what is
held usable; what the cache calls committable is what the budget grants,
never what the device reads as free. A stop, a free or a release gives up
a commit-ahead step's reserve waiting on a reclaim rather than wait for
the daemon, and the grant the daemon makes later goes back.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from typing import Callable

import pytest

from extkv import ExtensibleKVCache, KVCacheLayout, OutOfMemoryError, SleepController, measure_kv_cache_blocks
from extkv.budget import ledger
from extkv.budget.client import BudgetClient, read_status
from extkv.budget.driver import BudgetedDriver
from extkv.errors import BudgetDeniedError, BudgetUnavailableError, DriverError
from extkv.testing.budget import (
    CancelsSeen,
    CoveredCreates,
    check_ledger_holds,
    ledger_held,
    served_daemon,
    wait_for_status,
)
from extkv.testing.checks import check_unchanged, snapshot
from extkv.testing.configs import config_for
from extkv.testing.readings import InjectedReadingsDriver
from extkv.vmm import HostDriver
from extkv.vmm.faults import FaultInjectingDriver

pytestmark = [pytest.mark.invariant(5), pytest.mark.budget_proof("grants")]

LAYOUT = KVCacheLayout.LBHNC
#: Seconds a client waits for the daemon.
TIMEOUT_S = 60
#: A reclaim deadline, and a client's wait, that no test waits out: a wait
#: that ends only by either fails the test at TIMEOUT_S instead.
NEVER_S = 10 * TIMEOUT_S


#: Bytes a client keeps granted ahead where a test asks for some: one
#: growth step of the test's cache (a 2 MiB chunk in each of 3 segments).
AHEAD = 6 << 20


class CountedReserves(BudgetClient):
    """The real client, counting the reserves it sends."""

    def __init__(self, *args, **kwargs):
        self.reserves = 0
        super().__init__(*args, **kwargs)

    def _reserve(self, nbytes: int, ahead: int) -> tuple[int, int]:
        self.reserves += 1
        return super()._reserve(nbytes, ahead)


@contextlib.contextmanager
def budgeted_cache(budget: int, make_driver=lambda client: HostDriver(), ahead: int = 0):
    """(the served daemon, a client of it keeping `ahead` bytes granted
    ahead, a cache over `make_driver(client)` under that client) for a
    budget of `budget` bytes; the cache is freed on the way out."""
    with served_daemon(budget) as served, CountedReserves(served.path, timeout=TIMEOUT_S, ahead=ahead) as client:
        cache = ExtensibleKVCache(config_for("full", LAYOUT), make_driver(client), LAYOUT, budget=client)
        try:
            yield served, client, cache
        finally:
            cache.free()


@contextlib.contextmanager
def idle_and_busy_engines(budget: int,
                          busy_client: Callable[[str], BudgetClient] = lambda path: BudgetClient(path, timeout=TIMEOUT_S)):
    """(idle cache, its client, busy cache, its client) under one daemon of
    `budget` bytes, each engine a lease of its own, the busy one's client
    made by `busy_client(socket path)`; the idle one holds all of the
    budget. Both are freed on the way out."""
    with served_daemon(budget) as served, BudgetClient(served.path, timeout=TIMEOUT_S) as client_idle, \
            busy_client(served.path) as client_busy:
        idle = ExtensibleKVCache(config_for("full", LAYOUT), HostDriver(), LAYOUT, budget=client_idle)
        busy = ExtensibleKVCache(config_for("full", LAYOUT), HostDriver(), LAYOUT, budget=client_busy)
        try:
            idle.commit(idle.blocks_within(budget))
            yield idle, client_idle, busy, client_busy
        finally:
            if not busy.buffer.is_freed:
                busy.free()
            idle.free()


def shrunk_to_nothing(cache: ExtensibleKVCache) -> int:
    """A reclaim handler's answer: the bytes a shrink of `cache` to no blocks freed."""
    before = cache.physical_bytes
    cache.commit(0, shrink=True)
    return before - cache.physical_bytes


def check_idle_engine_ledger(idle: ExtensibleKVCache, client: BudgetClient) -> None:
    """The idle engine's ledger holds its cache's bytes, read once its
    reclaim handler's shrink has ended. The busy engine is granted as soon
    as enough of the shrink's releases were returned, while the handler,
    on its client's thread, may still be releasing the rest; the shrink
    holds the reservation's lock throughout, so taking it waits for that."""
    with idle.buffer.lock:
        check_ledger_holds(client, idle.physical_bytes, "after the idle engine's reclaim")


@pytest.mark.parametrize("ahead", [0, AHEAD], ids=["nothing-ahead", "bytes-ahead"])
def test_the_ledger_holds_exactly_the_cache_s_physical_bytes_through_its_life(ahead):
    with budgeted_cache(1 << 30, ahead=ahead) as (_, client, cache):
        steps = [
            ("commit 100", lambda: cache.commit(100)),
            ("commit 300", lambda: cache.commit(300)),
            ("shrink to 50", lambda: cache.commit(50, shrink=True)),
            ("commit 400", lambda: cache.commit(400)),
            ("preserving shrink to 90", lambda: cache.commit(90, shrink=True, preserve_contents=True)),
            ("commit 200", lambda: cache.commit(200)),
            ("shrink to 50", lambda: cache.commit(50, shrink=True)),
            ("preserving defragment", lambda: cache.commit(50, defragment=True, preserve_contents=True)),
            ("release", cache.release_physical),
            ("recommit", cache.recommit),
        ]
        for name, step in steps:
            step()
            check_ledger_holds(client, cache.physical_bytes, f"after {name}")
        cache.free()
        check_ledger_holds(client, 0, "after free")


@pytest.mark.parametrize("ahead", [0, AHEAD], ids=["nothing-ahead", "bytes-ahead"])
def test_no_physical_create_happens_without_a_covering_grant(ahead):
    with budgeted_cache(1 << 30, lambda client: CoveredCreates(HostDriver(), client), ahead) as (_, client, cache):
        counting = cache.buffer.driver.inner
        for step in (lambda: cache.commit(120), lambda: cache.commit(40, shrink=True),
                     lambda: cache.commit(40, defragment=True, preserve_contents=True),
                     cache.release_physical, cache.recommit):
            step()
        cache.commit_ahead(200, step_blocks=50)
        assert cache.settle_commit_ahead(TIMEOUT_S), "the commit-ahead worker did not settle"
        assert cache.grown_blocks == 240
        check_ledger_holds(client, cache.physical_bytes, "after commit-ahead settled")
    assert counting.creates > 5, f"{counting.creates} creates: the test saw too few to prove anything"


def test_a_preserving_shrink_returns_exactly_the_bytes_it_released_and_asks_for_nothing():
    """The chunks it releases go back as any release's do (the host daemon
    checks each return against the engine's memfd pages as it arrives), and
    it creates nothing, so the budget is never asked."""
    with budgeted_cache(1 << 30, lambda client: CoveredCreates(HostDriver(), client)) as (_, client, cache):
        counting = cache.buffer.driver.inner
        for n in (1, 100, 300, 700):
            cache.commit(n)
        for n in (650, 250, 37, 0):
            held, _ = ledger_held(client)
            physical, creates = cache.physical_bytes, counting.creates
            cache.commit(n, shrink=True, preserve_contents=True)
            released = physical - cache.physical_bytes
            assert released > 0 or n == 650, f"the shrink to {n} released nothing"
            now, open_tickets = ledger_held(client)
            assert (held - now, open_tickets) == (released, 0), (
                f"shrink to {n}: the ledger fell by {held - now} bytes with {open_tickets} open tickets; "
                f"the shrink released {released}")
            assert counting.creates == creates, f"the shrink to {n} created {counting.creates - creates} chunks"
            check_ledger_holds(client, cache.physical_bytes, f"after the preserving shrink to {n}")


def test_a_commit_the_budget_denies_raises_out_of_memory_and_changes_nothing():
    with budgeted_cache(8 << 20) as (_, client, cache):
        cache.commit(10)
        before, ledger = snapshot(cache), ledger_held(client)
        with pytest.raises(BudgetDeniedError) as denied:
            cache.commit(cache.capacity_blocks)
        assert isinstance(denied.value, OutOfMemoryError)
        check_unchanged(cache, before)
        assert ledger_held(client) == ledger, f"the ledger moved from {ledger} to {ledger_held(client)}"
        cache.commit(20)  # still usable
        check_ledger_holds(client, cache.physical_bytes, "after the next commit")


@pytest.mark.parametrize("ahead", [0, AHEAD], ids=["nothing-ahead", "bytes-ahead"])
def test_a_forked_child_cannot_grow_on_its_parent_s_lease(ahead):
    with budgeted_cache(1 << 30, ahead=ahead) as (_, client, cache):
        cache.commit(10)
        assert client.ahead_bytes == ahead  # the child's commit would fit in them
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report what its growth met, then leave without cleanup
            try:
                ExtensibleKVCache(config_for("full", LAYOUT), HostDriver(), LAYOUT, budget=client).commit(10)
                outcome = b"grew"
            except BudgetUnavailableError:
                outcome = b"refused"
            except BaseException as error:  # noqa: BLE001 - any other outcome is the test's failure
                outcome = repr(error).encode()[:200]
            os.write(write, outcome)
            os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as pipe:
            outcome = pipe.read()
        os.waitpid(pid, 0)
        assert outcome == b"refused", f"the forked child's commit: {outcome!r}"
        cache.commit(30)  # the parent's lease is its own still
        check_ledger_holds(client, cache.physical_bytes, "after the parent's commit")


def test_growth_fails_closed_once_the_daemon_is_gone_and_what_is_held_stays_usable():
    with budgeted_cache(1 << 30) as (served, _, cache):
        cache.commit(10)
        cache.buffer.segment_view(0)[:4096].fill_(7)
        served.stop()
        before = snapshot(cache)
        with pytest.raises(BudgetUnavailableError, match=served.path):
            cache.commit(cache.capacity_blocks)
        check_unchanged(cache, before)
        assert int(cache.buffer.segment_view(0)[:4096].sum()) == 7 * 4096


@pytest.mark.invariant(7)
def test_with_the_daemon_gone_commit_ahead_idles_and_its_ready_blocks_stay_committable():
    """The worker meets a daemon gone as it meets out of memory: it idles.
    The engine serves on from what it holds, committing every block the
    worker grew before (mapped and granted), and its own first commit past
    them fails closed, BudgetUnavailableError, changing nothing; no commit
    raises the worker's failure in its place."""
    with budgeted_cache(1 << 30) as (served, _, cache):
        cache.commit(10)
        cache.commit_ahead(200, step_blocks=50)
        assert cache.settle_commit_ahead(TIMEOUT_S), "the commit-ahead worker did not settle"
        grown = cache.grown_blocks
        assert grown == 210 < cache.blocks_within(cache.physical_bytes) < cache.capacity_blocks, (
            grown, cache.physical_bytes)  # the next steps past the mapped granule must create
        served.stop()
        for n in (50, 100, 150, grown):  # each wakes the worker, whose step needs the daemon
            cache.commit(n)
            assert cache.settle_commit_ahead(TIMEOUT_S), f"the worker did not settle after the commit of {n}"
        before = snapshot(cache)
        with pytest.raises(BudgetUnavailableError, match=served.path):
            cache.commit(cache.capacity_blocks)
        check_unchanged(cache, before)


def test_a_create_outside_a_reservation_is_refused_before_the_driver_is_called():
    with served_daemon(1 << 30) as served, BudgetClient(served.path, timeout=TIMEOUT_S) as client:
        driver = BudgetedDriver(HostDriver(), client)
        with pytest.raises(DriverError, match="outside a granted reservation"):
            driver.create(driver.granularity)
        check_ledger_holds(client, 0, "after the refused create")


@pytest.mark.parametrize("step", ["create", "map"])
def test_a_commit_failing_part_way_leaves_the_ledger_holding_what_exists(step):
    """The driver runs out part way through a commit (the second create, or
    the second map): what was reserved and not created goes back, and the
    ledger holds the bytes of every chunk that exists (mapped, or kept
    unmapped for the retry); the commit, retried, completes and the ledger
    holds exactly the cache's physical bytes."""
    faulty = FaultInjectingDriver(HostDriver(), {step: 2}, out_of_memory=True)
    with budgeted_cache(1 << 30, lambda client: CoveredCreates(faulty, client)) as (_, client, cache):
        counting = cache.buffer.driver.inner
        with pytest.raises(OutOfMemoryError):
            cache.commit(100)
        assert faulty.fired, "no fault fired: the test proved nothing"
        check_ledger_holds(client, counting.mapped, f"after the {step} that failed")
        cache.commit(100)
        check_ledger_holds(client, cache.physical_bytes, "after the commit retried")


def test_committable_blocks_follow_the_budget_never_the_device_s_free_memory():
    """Under a budget a cache sizes its growth (`committable_blocks`, which
    engines read) by what the budget grants now:
    a device reading far above or below it changes nothing, so engines
    sizing at once never race on it; another engine's grant lowers it."""
    readings = InjectedReadingsDriver(HostDriver(), free=1 << 50, total=1 << 50)
    with budgeted_cache(8 << 20, lambda client: readings) as (served, _, cache):
        assert cache.committable_blocks() == cache.blocks_within(8 << 20) < cache.capacity_blocks
        readings.set_readings(free=0, total=1 << 50)
        assert cache.committable_blocks() == cache.blocks_within(8 << 20)
        with BudgetClient(served.path, timeout=TIMEOUT_S) as other:
            other.confirm(other.reserve(2 << 20), 2 << 20)
            assert cache.committable_blocks() == cache.blocks_within(6 << 20)
            cache.commit(cache.committable_blocks())  # all of it is granted, without a wait


def test_commit_ahead_waits_out_a_reclaim_so_the_engine_s_commits_find_their_blocks_ready():
    """An idle engine holds the whole budget: nothing is granted without a
    wait. The busy engine's commit-ahead worker asks anyway, its reserve
    waits while the daemon reclaims from the idle one, and the window
    grows with no commit of the busy engine's asking: its next commits
    find their blocks ready instead of waiting for the reclaim themselves."""
    budget = 12 << 20  # two granules in each of the 3 segments
    with idle_and_busy_engines(budget) as (idle, client_idle, busy, client_busy):
        client_idle.on_reclaim(lambda target: shrunk_to_nothing(idle))
        assert (idle.physical_bytes, busy.committable_blocks()) == (budget, 0), (
            f"the idle engine holds {idle.physical_bytes} of {budget} bytes: nothing to wait out")
        window = busy.blocks_within(budget // 2)
        busy.commit_ahead(window)
        assert busy.settle_commit_ahead(TIMEOUT_S), "the commit-ahead worker did not settle"
        assert (busy.grown_blocks, busy.num_committed_blocks) == (window, 0), (
            f"commit-ahead grew {busy.grown_blocks} blocks of a {window}-block window over 0 committed, "
            f"with the idle engine holding {idle.physical_bytes} bytes")
        busy.commit(window)
        check_ledger_holds(client_busy, busy.physical_bytes, "after the busy engine's commit")
        check_idle_engine_ledger(idle, client_idle)


@pytest.mark.invariant(7)
@pytest.mark.parametrize("stop", ["commit_ahead(0)", "free()", "release_physical()"])
def test_an_operation_racing_the_answer_to_the_worker_s_waiting_reserve_ends_whole(stop):
    """The busy engine's worker waits on its reserve while the idle engine's
    reclaim handler has not returned. A stop, a free or a release from
    another thread and the handler's answer then start at one barrier.
    Before the answer, the operation gives the reserve up, and the client
    cancels the grant that follows; after it, it meets a worker that was
    granted. Either way it ends, no worker is left where it stops one, and
    once the cancel, if any, reached the daemon, the ledger holds exactly
    what each cache holds."""
    budget = 12 << 20
    with idle_and_busy_engines(budget) as (idle, client_idle, busy, client_busy):
        asked, answer, answered = threading.Event(), threading.Event(), threading.Event()
        start = threading.Barrier(2)

        def give_back_when_told(target: int) -> int:
            asked.set()
            assert answer.wait(TIMEOUT_S), "the test never let the reclaim answer"
            freed = shrunk_to_nothing(idle)
            answered.set()
            return freed

        outcome: list[BaseException | None] = []

        def operate() -> None:
            try:
                start.wait(TIMEOUT_S)
                {"commit_ahead(0)": lambda: busy.commit_ahead(0), "free()": busy.free,
                 "release_physical()": busy.release_physical}[stop]()
                outcome.append(None)
            except BaseException as error:  # noqa: BLE001 - compared below
                outcome.append(error)

        try:
            client_idle.on_reclaim(give_back_when_told)
            busy.commit_ahead(busy.blocks_within(budget // 2))
            assert asked.wait(TIMEOUT_S), "the worker's reserve never made the daemon ask the idle engine"
            operation = threading.Thread(target=operate)
            operation.start()
            start.wait(TIMEOUT_S)
            answer.set()
            operation.join(TIMEOUT_S)
            assert not operation.is_alive(), f"{stop} did not end once the reclaim was answered"
            assert outcome == [None], f"{stop} raised {outcome!r}"
            if stop != "release_physical()":
                assert "extkv-commit-ahead" not in [thread.name for thread in threading.enumerate()], (
                    f"a commit-ahead worker outlived {stop}")
            else:
                assert busy.settle_commit_ahead(TIMEOUT_S), "the commit-ahead worker did not settle"
            assert answered.wait(TIMEOUT_S), "the idle engine's reclaim handler did not return"
            # Read after the shrink's returns, which let the daemon grant the busy engine's reserve.
            check_idle_engine_ledger(idle, client_idle)
            wait_for_status(client_busy.socket_path,
                            lambda report: not any(engine["open_tickets"] for engine in report["engines"]),
                            "the grant to a reserve given up cancelled", TIMEOUT_S)
            check_ledger_holds(client_busy, 0 if busy.buffer.is_freed else busy.physical_bytes, f"after {stop}")
        finally:
            answer.set()


@pytest.mark.invariant(7)
@pytest.mark.parametrize("stop", ["commit_ahead(0)", "free()", "release_physical()", "SleepController.sleep()"])
def test_an_operation_gives_up_the_worker_s_reserve_waiting_on_a_reclaim_and_its_grant_goes_back(stop, monkeypatch):
    """The busy engine's worker waits on its reserve, holding the
    reservation's lock, while the idle engine's reclaim handler holds its
    answer back until a stop, a free or a release from another thread has
    returned: the operation gives the reserve up, not waiting for an answer
    that only the handler, the reclaim deadline or the client's timeout
    could bring (the last two far past TIMEOUT_S). Then the handler
    answers, the daemon grants the reserve given up, and the busy client
    cancels that grant: each ledger holds exactly what its cache holds,
    with no ticket open. No worker is left where the operation stops it; a
    released cache's worker (by the cache's own word or a sleep controller's),
    not left stuck, grows its window once recommitted."""
    monkeypatch.setattr(ledger, "RECLAIM_DEADLINE_S", NEVER_S)
    asleep = stop in ("release_physical()", "SleepController.sleep()")
    budget = 12 << 20
    with idle_and_busy_engines(budget, lambda path: CancelsSeen(path, timeout=NEVER_S)) as (
            idle, client_idle, busy, client_busy):
        asked, answer = threading.Event(), threading.Event()

        def give_back_once_the_operation_returned(target: int) -> int:
            asked.set()
            assert answer.wait(NEVER_S), "the test never let the reclaim answer"
            return shrunk_to_nothing(idle)

        outcome: list[BaseException | None] = []

        def operate() -> None:
            try:
                {"commit_ahead(0)": lambda: busy.commit_ahead(0), "free()": busy.free,
                 "release_physical()": busy.release_physical, "SleepController.sleep()": controller.sleep}[stop]()
                outcome.append(None)
            except BaseException as error:  # noqa: BLE001 - compared below
                outcome.append(error)

        controller = SleepController()
        controller.register(busy, "kv")
        try:
            client_idle.on_reclaim(give_back_once_the_operation_returned)
            window = busy.blocks_within(budget // 2)
            busy.commit_ahead(window)
            assert asked.wait(TIMEOUT_S), "the worker's reserve never made the daemon ask the idle engine"
            operation = threading.Thread(target=operate)
            operation.start()
            operation.join(TIMEOUT_S)
            assert not operation.is_alive(), f"{stop} waited for the daemon's answer to the worker's reserve"
            assert outcome == [None], f"{stop} raised {outcome!r}"
            answer.set()
            assert client_busy.cancel_sent.wait(TIMEOUT_S), "the grant of the reserve given up was never cancelled"
            if not asleep:
                assert "extkv-commit-ahead" not in [thread.name for thread in threading.enumerate()], (
                    f"a commit-ahead worker outlived {stop}")
            check_ledger_holds(client_busy, 0 if busy.buffer.is_freed else busy.physical_bytes, f"after {stop}")
            check_idle_engine_ledger(idle, client_idle)
            if asleep:
                busy.recommit() if stop == "release_physical()" else controller.wake_up()
                assert busy.settle_commit_ahead(TIMEOUT_S), "the commit-ahead worker did not settle"
                assert busy.grown_blocks == window, (
                    f"commit-ahead grew {busy.grown_blocks} blocks of a {window}-block window after the recommit")
                check_ledger_holds(client_busy, busy.physical_bytes, "after the recommit")
        finally:
            answer.set()


def test_measure_kv_cache_blocks_sizes_a_budgeted_cache_by_its_grant_and_leaves_torch_uncapped():
    """The post-warmup sizing of a budgeted cache is what the budget grants
    it, whatever the device reads as free or the engine requested: a device
    reading of 0 free bytes or of a petabyte gives the same count, and torch's
    cap is left as it was (the budget is the KV caches' alone)."""
    readings = InjectedReadingsDriver(HostDriver(), free=0, total=1 << 50)
    with budgeted_cache(8 << 20, lambda client: readings) as (served, _, cache):
        cache.commit(cache.blocks_within(2 << 20))
        for free in (0, 1 << 50):
            readings.set_readings(free=free, total=1 << 50)
            sized = measure_kv_cache_blocks(cache, cache.buffer.device, init_free_memory=1 << 50,
                                            requested_memory=1 << 20)
            assert (sized, cache.torch_memory_limit) == (cache.blocks_within(8 << 20), None), (
                f"{free} bytes read free: sized {sized} blocks with torch capped at {cache.torch_memory_limit}; "
                f"the budget grants {cache.blocks_within(8 << 20)} blocks")


def test_commits_within_the_bytes_granted_ahead_ask_nothing_and_the_ledger_holds_them():
    """A client keeping bytes ahead asks for them beside its first create;
    the commits they cover send nothing, the ledger holds the chunks and
    what is kept ahead, and a reserve is sent again only once they run out."""
    with budgeted_cache(1 << 30, ahead=AHEAD) as (_, client, cache):
        cache.commit(10)  # 3 chunks of 2 MiB, and 24 MiB ahead
        assert (client.reserves, client.ahead_bytes) == (1, AHEAD)
        check_ledger_holds(client, cache.physical_bytes, "after the first commit")
        grown = cache.physical_bytes
        for blocks in range(100, 700, 100):
            cache.commit(blocks)
            check_ledger_holds(client, cache.physical_bytes, f"after commit {blocks}")
            if cache.physical_bytes - grown <= AHEAD:
                assert (client.reserves, client.ahead_bytes) == (1, AHEAD - (cache.physical_bytes - grown))
        assert client.reserves > 1 and cache.physical_bytes - grown > AHEAD, "the bytes ahead never ran out"
        reserves = client.reserves
        # A plain shrink releases every chunk, keeping AHEAD of them ahead and
        # returning the rest, then maps 10 fresh blocks from what it kept.
        cache.commit(10, shrink=True)
        assert (client.reserves, client.ahead_bytes, cache.physical_bytes) == (reserves, 0, AHEAD)
        check_ledger_holds(client, cache.physical_bytes, "after a shrink")
        for _ in range(3):  # a release and its recommit: the bytes go ahead and come back, asking nothing
            cache.release_physical()
            assert client.ahead_bytes == AHEAD
            check_ledger_holds(client, 0, "after release")
            cache.recommit()
            check_ledger_holds(client, cache.physical_bytes, "after recommit")
        assert client.reserves == reserves


def test_a_reclaim_takes_the_bytes_granted_ahead_before_the_engine_gives_any_block():
    """The idle engine's bytes ahead are held, so they are reclaimed as held
    bytes; its client gives them back first, and the engine's handler is
    asked only for the rest: here for nothing."""
    with served_daemon(24 << 20) as served, \
            BudgetClient(served.path, timeout=TIMEOUT_S, weight=0.25, ahead=AHEAD) as client_idle, \
            BudgetClient(served.path, timeout=TIMEOUT_S) as client_busy:
        idle = ExtensibleKVCache(config_for("full", LAYOUT), HostDriver(), LAYOUT, budget=client_idle)
        busy = ExtensibleKVCache(config_for("full", LAYOUT), HostDriver(), LAYOUT, budget=client_busy)
        asked: list[int] = []
        client_idle.on_reclaim(lambda target: asked.append(target) or shrunk_to_nothing(idle))
        try:
            idle.commit(10)  # 6 MiB and 6 MiB ahead: 12 of 24 MiB
            held = idle.physical_bytes
            # 14 MiB, 2 more than is free; the shares of weights 1/4 and 1
            # leave the idle engine 10 MiB, so 2 come back: from the bytes ahead.
            busy.commit(busy.blocks_within(14 << 20))
            assert busy.physical_bytes == 14 << 20
            assert asked == [] and idle.physical_bytes == held and idle.num_committed_blocks == 10
            assert client_idle.ahead_bytes == AHEAD - (2 << 20)
            check_ledger_holds(client_idle, held, "after the reclaim")
            check_ledger_holds(client_busy, busy.physical_bytes, "after the busy engine's commit")
        finally:
            busy.free()
            idle.free()



@pytest.mark.parametrize("text, ahead", [("6MiB", 6 << 20), ("1.5MiB", 3 << 19), ("4096", 4096), ("", 0), (" ", 0)])
def test_the_environment_s_client_keeps_the_bytes_extkv_budget_ahead_names(monkeypatch, text, ahead):
    with served_daemon(1 << 30) as served:
        monkeypatch.setenv("EXTKV_BUDGET", served.path)
        monkeypatch.setenv("EXTKV_BUDGET_AHEAD", text)
        with BudgetClient.from_environment() as client:
            assert client.ahead == ahead


@pytest.mark.invariant(5, 6)
@pytest.mark.parametrize("text", ["lots", "-1MiB", "1.5", "6 MB"])
def test_bytes_ahead_the_environment_cannot_read_are_refused_naming_the_variable(monkeypatch, text):
    with served_daemon(1 << 30) as served:
        monkeypatch.setenv("EXTKV_BUDGET", served.path)
        monkeypatch.setenv("EXTKV_BUDGET_AHEAD", text)
        with pytest.raises(ValueError, match=rf"^EXTKV_BUDGET_AHEAD must be bytes \(a whole number, or a number with "
                                             rf"KiB, MiB, GiB or TiB: 96GiB\), got '{re.escape(text)}'$"):
            BudgetClient.from_environment()
        assert read_status(served.path)["engines"] == []
