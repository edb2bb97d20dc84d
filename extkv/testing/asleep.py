"""Offloaded KV caches changed while asleep, woken in a child process.

Theory of operation
-------------------
A `SleepController` wake writes an `offload=True` copy back into a KV cache
that a caller may have shrunk, grown, defragmented or freed while it slept;
`extkv.sleep.WHILE_ASLEEP` says what each operation means for the copy. A
wake that wrote a copy past the bytes committed at the wake would reach
unmapped memory: on the host a SIGSEGV of the process, on a GPU an illegal
address that spoils its context. So the scenarios run in a child of the
fork server (extkv.testing.children), which sends numbers through a pipe,
one report per scenario as each ends; the caller gets the child's exit code
beside them, so a wake that kills its process is a failing assertion that
names the signal and the scenario, never a lost test worker.

Each scenario: a cache over a `PoisoningDriver` (every chunk reads 0xA5
until extkv writes it), `COMMITTED` blocks committed and filled with a
pattern of bytes 1..160 (neither zero nor the poison), registered with
`offload=True` and put to sleep at level 1; one operation while asleep;
the wake. Its report counts, over every segment: the pattern bytes of the
blocks the table says come back (`kept`) that differ from the pattern or
are not committed; the non-zero bytes of the committed blocks past them;
and the pattern bytes anywhere mapped past the committed bytes (what a
write past them leaves where a granule is mapped whole). Beside them: the
committed count, the tag's state before the wake (partly asleep where the
operation mapped memory again) and after it, the host bytes the controller still
holds, and an error's type and message. No view's contents are ever
printed: a view may reach unmapped memory.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from ..cache import ExtensibleKVCache
from ..layout import KVCacheLayout
from ..sleep import WHILE_ASLEEP, SleepController
from ..vmm import PoisoningDriver, driver_for
from .children import reap, start_reporting
from .configs import config_for

POISON = 0xA5
#: Blocks committed and copied at the sleep: over a granule of every segment
#: of the "full" config, so a copy written whole past a shrink to `SHRUNK`
#: leaves the granules the shrink kept.
COMMITTED = 300
#: A shrink's count: within the first granule of every segment.
SHRUNK = 10
#: A shrink's count whose end shares a granule with COMMITTED's in every
#: segment of the "full" config's LBHNC and BLHNC layouts (2 MiB granules):
#: a copy written whole past it stays in mapped memory, and only the bytes
#: read past the committed ones show it.
SHRUNK_IN_GRANULE = 290
#: A growth's count, above COMMITTED and within the capacity (700).
GROWN = 450
#: Blocks a commit-ahead worker keeps past the committed ones, and its step.
WINDOW, STEP = 200, 8
#: The first bytes an error is reported with.
ERROR_CHARS = 300


@dataclass(frozen=True)
class Scenario:
    """One operation on the sleeping cache, under its row of WHILE_ASLEEP."""

    row: str
    #: The call's count: `n` in the row.
    n: int
    act: Callable[[ExtensibleKVCache, "_Context"], None]
    #: Blocks committed once awake.
    committed: int
    #: What `wake_up` raises, by type and message; None: nothing.
    error: str | None = None
    #: The tag's state after the act, before the wake: partly asleep where
    #: the act mapped memory again (a growth, a discarding shrink, a recommit).
    asleep_state: str = "asleep"
    #: Measured after a commit back to COMMITTED blocks: a shrink keeping
    #: contents that lands after the wake keeps the chunk straddling its end
    #: whole, and the woken bytes past the end stay there until a growth
    #: zeroes them again; measured before, the outcome would hang on the order.
    regrow: bool = False
    #: A thread or a commit-ahead worker runs beside it: a test of its own.
    concurrent: bool = False
    #: A commit-ahead worker is growing, unsettled, when the cache is put to sleep.
    worker_running: bool = False


@dataclass
class _Context:
    """What a scenario's act may need beside the cache: the controller, and
    a hook the child runs around the wake (a thread racing it)."""

    engine: SleepController
    around_wake: Callable[[Callable[[], None]], None] = lambda wake: wake()


def _commit_after_preserving_shrink(cache: ExtensibleKVCache, context: _Context) -> None:
    cache.commit(SHRUNK, shrink=True, preserve_contents=True)
    cache.commit(COMMITTED)


def _shrink_beside_the_wake(cache: ExtensibleKVCache, context: _Context) -> None:
    """A scheduler thread shrinks keeping contents while the main thread
    wakes; both start at one barrier. Before the wake or after it, the
    outcome is the same: blocks [0, SHRUNK) hold their bytes."""
    start = threading.Barrier(2)
    errors: list[BaseException] = []

    def shrink() -> None:
        try:
            start.wait()
            cache.commit(SHRUNK, shrink=True, preserve_contents=True)
        except BaseException as error:  # reported by the child's main thread
            errors.append(error)

    def around_wake(wake: Callable[[], None]) -> None:
        thread = threading.Thread(target=shrink, name="extkv-asleep-shrink")
        thread.start()
        try:
            start.wait()
            wake()
        finally:
            thread.join()
        if errors:
            raise errors[0]

    context.around_wake = around_wake


PRESERVING_SHRINK = "commit(n, shrink=True, preserve_contents=True)"
PARTLY = "partly asleep"

#: Every scenario by name; each row of WHILE_ASLEEP has at least one.
SCENARIOS: dict[str, Scenario] = {
    "growth": Scenario("commit(n)", GROWN, lambda cache, _: cache.commit(GROWN), GROWN, asleep_state=PARTLY),
    "commit below the count": Scenario("commit(n)", SHRUNK, lambda cache, _: cache.commit(SHRUNK), COMMITTED),
    "preserving shrink": Scenario(
        PRESERVING_SHRINK, SHRUNK, lambda cache, _: cache.commit(SHRUNK, shrink=True, preserve_contents=True), SHRUNK),
    "preserving shrink within a granule": Scenario(
        PRESERVING_SHRINK, SHRUNK_IN_GRANULE,
        lambda cache, _: cache.commit(SHRUNK_IN_GRANULE, shrink=True, preserve_contents=True), SHRUNK_IN_GRANULE),
    "preserving shrink, then growth": Scenario(PRESERVING_SHRINK, SHRUNK, _commit_after_preserving_shrink, COMMITTED,
                                               asleep_state=PARTLY),
    "discarding shrink": Scenario(
        "commit(n, shrink=True)", SHRUNK, lambda cache, _: cache.commit(SHRUNK, shrink=True), SHRUNK,
        asleep_state=PARTLY),
    "discarding defragment": Scenario(
        "commit(n, defragment=True)", COMMITTED, lambda cache, _: cache.commit(COMMITTED, defragment=True), COMMITTED,
        asleep_state=PARTLY),
    "preserving defragment": Scenario(
        "commit(n, defragment=True, preserve_contents=True)", COMMITTED,
        lambda cache, _: cache.commit(COMMITTED, defragment=True, preserve_contents=True), COMMITTED),
    "commit-ahead turned on": Scenario(
        "commit_ahead(window)", WINDOW, lambda cache, _: cache.commit_ahead(WINDOW, step_blocks=STEP), COMMITTED),
    "release_physical": Scenario("release_physical()", 0, lambda cache, _: cache.release_physical(), COMMITTED),
    "recommit": Scenario("recommit()", 0, lambda cache, _: cache.recommit(), COMMITTED, asleep_state=PARTLY),
    "free": Scenario(
        "free()", 0, lambda cache, _: cache.free(), 0,
        error="StateError: SleepController.wake_up(): the ExtensibleKVCache registered under tag 'kv_cache' is "
              "freed; unregister it first. Nothing was changed"),
    # Beside commit-ahead and threads: a worker growing when the cache is put
    # to sleep, and a thread racing the wake.
    "worker running, then preserving shrink": Scenario(
        PRESERVING_SHRINK, SHRUNK, lambda cache, _: cache.commit(SHRUNK, shrink=True, preserve_contents=True), SHRUNK,
        concurrent=True, worker_running=True),
    "preserving shrink beside the wake": Scenario(PRESERVING_SHRINK, SHRUNK, _shrink_beside_the_wake, COMMITTED,
                                                  regrow=True, concurrent=True),
}


def scenarios_of(row: str) -> list[str]:
    """The scenarios of one row of WHILE_ASLEEP, by name, but those with a
    thread or a worker beside them."""
    return [name for name, scenario in SCENARIOS.items() if scenario.row == row and not scenario.concurrent]


def expected_report(name: str) -> dict:
    """What the scenario's report must read: the row's blocks back byte for
    byte, every other committed byte zero, nothing written past the
    committed bytes, the tag partly asleep before the wake where the act
    mapped memory again (else asleep), awake after it, and no host copy held."""
    scenario = SCENARIOS[name]
    if scenario.error is not None:
        return {"state asleep": scenario.asleep_state, "error": scenario.error, "offloaded bytes after unregister": 0}
    return {"state asleep": scenario.asleep_state, "error": None, "committed": scenario.committed,
            "kept": WHILE_ASLEEP[scenario.row].kept(COMMITTED, scenario.n),
            "kept bytes wrong": 0, "non-zero bytes past the kept blocks": 0,
            "pattern bytes past the committed ones": 0, "state": "awake", "offloaded bytes": 0}


def _pattern(size: int, segment: int) -> torch.Tensor:
    period = ((torch.arange(241, dtype=torch.int32) * 7 + 31 * segment) % 160 + 1).to(torch.uint8)  # 1..160
    return period.repeat(-(-size // 241))[:size]


def _in_pattern(data: torch.Tensor) -> int:
    return int(((data >= 1) & (data <= 160)).sum())


def _error(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:ERROR_CHARS]


def measure(cache: ExtensibleKVCache, patterns: list[torch.Tensor], kept: int) -> dict:
    """Counts over every segment (see the module's theory); reads only
    committed bytes and mapped chunks."""
    buffer, committed = cache.buffer, cache.num_committed_blocks
    kept_wrong = nonzero = 0
    for index, (stride, pattern) in enumerate(zip(cache.segment_strides, patterns)):
        view = buffer.segment_view(index)  # exactly the committed bytes
        want = min(kept * stride, pattern.numel())
        readable = min(want, view.numel())
        kept_wrong += (want - readable) + int(view[:readable].cpu().ne(pattern[:readable]).sum())
        nonzero += int(view[want: committed * stride].count_nonzero())
    past = 0
    committed_ranges = [(buffer.base + offset, buffer.base + offset + committed * stride)
                        for offset, stride in zip(buffer.segment_offsets, cache.segment_strides)]
    for mapped in buffer.mapped_chunks:
        start, size = mapped.address, mapped.chunk.size
        data = buffer.driver.view(start, size).cpu().clone()
        for low, high in committed_ranges:
            low, high = max(low, start), min(high, start + size)
            if low < high:
                data[low - start: high - start] = 0
        past += _in_pattern(data)
    return {"committed": committed, "kept": kept, "kept bytes wrong": kept_wrong,
            "non-zero bytes past the kept blocks": nonzero, "pattern bytes past the committed ones": past}


def run_scenario(device: torch.device | str, layout: KVCacheLayout, name: str) -> dict:
    """One scenario, in this process: its report."""
    scenario = SCENARIOS[name]
    driver = PoisoningDriver(driver_for(torch.device(device)), POISON)
    cache = ExtensibleKVCache(config_for("full", layout), driver, layout)
    try:
        cache.commit(COMMITTED)
        patterns = []
        for index, stride in enumerate(cache.segment_strides):
            pattern = _pattern(COMMITTED * stride, index)
            cache.buffer.segment_view(index).copy_(pattern.to(cache.buffer.device))
            patterns.append(pattern)
        driver.synchronize()
        if scenario.worker_running:
            cache.commit_ahead(WINDOW, step_blocks=STEP)  # not settled: it may be mid-step at the sleep
        engine = SleepController()
        engine.register(cache, offload=True)
        engine.sleep(level=1)
        context = _Context(engine)
        scenario.act(cache, context)
        report: dict = {"state asleep": engine.state("kv_cache").value, "error": None}
        try:
            context.around_wake(engine.wake_up)
        except Exception as error:  # reported, compared by the caller
            report["error"] = _error(error)
        if scenario.error is not None:
            engine.unregister(cache)
            report["offloaded bytes after unregister"] = engine.offloaded_bytes
            return report
        if report["error"] is None and scenario.regrow:
            cache.commit(COMMITTED)
        if report["error"] is None:
            # The worker's blocks past the committed ones, mapped once the wake resumed it, are read too.
            if not cache.settle_commit_ahead(60):
                report["error"] = "the commit-ahead worker never settled"
        report.update(measure(cache, patterns, WHILE_ASLEEP[scenario.row].kept(COMMITTED, scenario.n)))
        report.update(state=engine.state("kv_cache").value, **{"offloaded bytes": engine.offloaded_bytes})
        return report
    finally:
        cache.free()


def _child(device: str, layout_name: str, names: list[str], defect: str | None, sender) -> None:
    from . import planted

    plant = planted.DEFECTS[defect].make(driver_for(torch.device(device))) if defect else contextlib.nullcontext()
    with plant:
        for name in names:
            try:
                report = run_scenario(device, KVCacheLayout[layout_name], name)
            except Exception as error:  # outside the wake: reported beside the scenario's name
                report = {"error": "outside the wake: " + _error(error)}
            sender.send((name, report))


def wake_in_child(device: torch.device | str, layout: KVCacheLayout, names: list[str], *,
                  defect: str | None = None, timeout_s: float = 300) -> tuple[int | None, dict[str, dict]]:
    """The scenarios `names`, one after another in a child of the fork
    server (with the planted `defect` entered, a context manager's): its
    exit code and each report it sent before it ended."""
    process, receiver = start_reporting(_child, str(device), layout.name, list(names), defect)
    reports: dict[str, dict] = {}
    try:
        while len(reports) < len(names) and receiver.poll(timeout_s):
            name, report = receiver.recv()
            reports[name] = report
    except EOFError:  # it died before sending every report
        pass
    finally:
        exit_code = reap(process, receiver, timeout_s)
    return exit_code, reports


def exit_described(code: int | None) -> str:
    if code is None:
        return "still running past the timeout (killed)"
    if code < 0:
        return f"killed by signal {-code} ({signal.Signals(-code).name})"
    return f"exit {code}"


def check_wakes_as_promised(device: torch.device | str, layout: KVCacheLayout, names: list[str], *,
                            defect: str | None = None) -> None:
    """Each scenario's report, from a child, reads `expected_report`, and
    the child exits 0. The failure names every scenario that differs, each
    number it read against the one expected, and the child's end."""
    code, reports = wake_in_child(device, layout, names, defect=defect)
    problems = []
    for name in names:
        report, expected = reports.get(name), expected_report(name)
        if report is None:
            problems.append(f"{name}: no report")
            continue
        wrong = {key: (report.get(key), value) for key, value in expected.items() if report.get(key) != value}
        if wrong:
            problems.append(f"{name}: " + ", ".join(f"{key} {got!r}, expected {want!r}"
                                                    for key, (got, want) in wrong.items()))
    if code != 0:
        problems.append(f"the child {exit_described(code)}")
    assert not problems, f"{layout.name}: " + "; ".join(problems)
