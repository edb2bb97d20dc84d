"""The stress workloads' own machinery, beside the scenarios that
conformance/test_stress_ci.py runs on the cache: how a walk under memory
pressure waits for the pressure process, how walk processes that die are
pooled into the tally, how a deadline's share and floor are reckoned, how
the stress report names a bound too short, and the budget stress's outside
sampler, engine child and daemon log. None of it proves an invariant of
the cache: it keeps the stress runs honest."""

from __future__ import annotations

import collections
import errno
import json
import os
import random
import select
import subprocess
import sys
import threading
import time

import pytest

from extkv import ExtensibleKVCache, KVCacheLayout, OutOfMemoryError
from extkv.stress.report import stress_section
from extkv.testing.stress import HOST_STRESS_GRANULE, Floor, PressureProcess, StressTally, run_walk_processes, share_of_bound
from extkv.testing.stress.under_pressure import (
    PRESSURE_KEPT_BLOCKS,
    PRESSURE_PATTERN,
    PRESSURE_SMALL_COMMIT_BYTES,
    PressureEpisode,
    check_block_values,
    write_block_values,
)
from extkv.testing.stress.child import ChildProcess
from extkv.testing.stress.walk import out_of_memory_waiter
from extkv.testing.stress.budget import (
    BUDGET_STRESS_BYTES,
    BUDGET_STRESS_GRANULES,
    ENGINE_LAYOUTS,
    ENGINES,
    LEAST_DAEMON_KILLS,
    LEAST_ENGINE_KILLS,
    LEAST_SAMPLES,
    _daemon_log_counts,
    share_one_budget,
)
from extkv.testing.stress.budget_engine import EngineChild, engine_blocks
from extkv.testing.stress.budget_sampler import OutsideSampler, consistent_bytes
from extkv.budget.client import BudgetClient
from extkv.budget.device import HostDevice
from extkv.budget.ledger import RECLAIM_DEADLINE_S
from extkv.errors import BudgetDeniedError
from extkv.testing.budget import claiming_child, daemon_process, served_daemon, short_run_dir, wait_for_status
from extkv.testing.configs import config_for
from extkv.vmm import HostDriver

#: Every test here checks extkv's own tooling: the stress runs and their report.
pytestmark = pytest.mark.harness

SEED = 20261130


def test_a_walk_under_pressure_waits_for_the_pressure_process_to_release():
    """A commit a walk under pressure saw refused is checked, then retried
    once the pressure process says its cycle released the memory: its
    event, whatever the machine's free memory does meanwhile."""
    tally, seen = StressTally(), []
    with PressureProcess("cpu") as pressure:
        assert pressure.ask("next-release") == "error: not cycling"  # nothing to wait for: an answer, not a hang
        assert pressure.ask(f"cycle hold {HOST_STRESS_GRANULE} 0.01") == "cycling"
        waiter = out_of_memory_waiter(
            tally, lambda: seen.append(("checked", pressure.cycles())), lambda: seen.append(("released", pressure.next_release()))
        )
        waiter(OutOfMemoryError("fallocate", errno.ENOMEM, "ENOMEM", size=1 << 40))
        assert pressure.ask("stop").startswith("stopped ")
    (checked, cycles_then), (released, cycles_after) = seen
    assert (checked, released) == ("checked", "released") and cycles_after > cycles_then, seen
    assert tally.events["real out-of-memory met by a walk's commit"] == 1
    assert tally.events["retried after the pressure process released its memory"] == 1


def test_walk_processes_that_die_without_a_tally_are_each_a_failure_of_the_pooled_tally(monkeypatch):
    """Every walk child dies at its start, before printing a tally (its
    environment's thread count is no number): each is a failure of the
    pooled tally, with the command that reproduces it, and the run raises
    naming both."""
    monkeypatch.setenv("EXTKV_TORCH_THREADS", "none")
    tally = StressTally()
    with pytest.raises(AssertionError, match=r"(?s)^walk process 0: .*; walk process 1: "):
        run_walk_processes("cpu", 2, SEED, tally, steps=1)
    assert len(tally.failures) == 2, tally.failures
    for index, failure in enumerate(tally.failures):
        assert "exited before saying anything" in failure["error"] and "ValueError" in failure["error"], failure["error"]
        assert " walk --device cpu " in failure["reproduction"] and f" --seed {SEED + index} " in failure["reproduction"]
    assert tally.events["walk processes sharing the device"] == 0


def test_a_spent_bound_gives_no_test_seconds():
    """The nightly suite's shares: by weight of what is left, none once it is
    spent (a workload's floor, not a least number of seconds, keeps a test
    meaningful); a test's share never exceeds what is left."""
    assert share_of_bound(40.0, 1.0, 4.0) == 10.0
    assert share_of_bound(40.0, 3.0, 4.0) == 30.0
    assert share_of_bound(40.0, 2.0, 1.0) == 40.0
    assert share_of_bound(0.0, 1.0, 4.0) == 0.0
    assert share_of_bound(-12.0, 1.0, 4.0) == 0.0
    with pytest.raises(ValueError):
        share_of_bound(10.0, 0.0, 4.0)


def test_a_floor_runs_the_least_past_its_deadline():
    ran = 0
    floor = Floor(time.monotonic() - 1.0, lambda: ran >= 3)
    while floor.more():
        ran += 1
    tally = StressTally()
    floor.close(tally, "crashes", f"{ran} crashes")
    assert ran == 3 and floor.too_short
    assert tally.short_bounds == [{"workload": "crashes", "ran": "3 crashes", "seconds": tally.short_bounds[0]["seconds"], "share_s": 0.0}]
    # Bounded by a count instead, a floor never stops a loop, nor reports.
    counted, ran = Floor(None, lambda: ran >= 3), 0
    while counted.more() and ran < 10:
        ran += 1
    assert ran == 10 and not counted.too_short


def test_the_report_names_each_bound_too_short(tmp_path):
    """A test whose least outlasted its share is named in the stress
    section, with what it ran, in how long, of what share."""
    tally = StressTally()
    tally.operations["commit (grow)"] += 1
    tally.bound_too_short("real out-of-memory episodes", "1 whole pressure episode", 6.04, 0.0)
    record = {
        "format": "extkv-stress/1", "nodeid": "stress/test_pressure.py::test_commits_meet_real_out_of_memory[host]",
        "worker": "main", "device": "host", "device_label": None, "outcome": "passed", "failure": "", "skip_reason": None,
        "seed": 1, "budget_s": 0.0, "started": 0.0, "duration_s": 7.5, "tally": tally.to_json(),
    }
    (tmp_path / "stress" / "tests").mkdir(parents=True)
    (tmp_path / "stress" / "tests" / "main--pressure.json").write_text(json.dumps(record))
    section = stress_section(tmp_path)
    assert "- bounds too short: 1 test ran only its least episode" in section, section
    assert (
        "| `test_commits_meet_real_out_of_memory[host]` | host | real out-of-memory episodes | 1 whole pressure episode "
        "| 6.0 s | 0 s | 8 s |"
    ) in section, section


def test_the_recovery_after_an_inconclusive_pressure_episode_leaves_the_kept_blocks_patterned():
    """An episode that other processes' memory decided ends in `recover`,
    and the next episode's first check reads the kept blocks for the
    pattern: recovery ends as a whole episode does, with them patterned,
    though its last shrink remapped them zeroed."""
    layout = KVCacheLayout.BLHNC
    probe = ExtensibleKVCache(config_for("full", layout, 1), HostDriver(HOST_STRESS_GRANULE), layout)
    stride = probe.bytes_per_block
    probe.free()
    capacity = PRESSURE_KEPT_BLOCKS + 2 * -(-PRESSURE_SMALL_COMMIT_BYTES // stride)
    driver = HostDriver(HOST_STRESS_GRANULE)
    kv_cache = ExtensibleKVCache(config_for("full", layout, capacity), driver, layout)
    try:
        with PressureProcess("cpu") as pressure:
            episode = PressureEpisode(kv_cache, driver, pressure, StressTally(), random.Random(SEED), driver.memory_info()[1])
            kv_cache.commit(PRESSURE_KEPT_BLOCKS)
            write_block_values(kv_cache, 0, PRESSURE_KEPT_BLOCKS, PRESSURE_PATTERN)
            episode.recover()
            check_block_values(kv_cache, 0, PRESSURE_KEPT_BLOCKS, PRESSURE_PATTERN, "kept blocks after a recovery")
            assert kv_cache.num_committed_blocks == PRESSURE_KEPT_BLOCKS, kv_cache.num_committed_blocks
    finally:
        kv_cache.free()


def test_a_closed_child_still_answers_its_pid():
    """NVML is read for a stress child's pid once the child is closed and
    reaped (that its GPU memory is gone): the pid must outlive the close."""
    with ChildProcess(["crash-child", "--device", "cpu", "--seed", "1"]) as child:
        pid = child.pid
    assert child.pid == pid > 0


# -- the budget stress's tooling (extkv.testing.stress.budget*) -------------------------
#: A process that holds one extkv chunk of CHUNK bytes (a memfd named as
#: extkv names its chunks) until its stdin closes: a reading known exactly.
HOLD_A_CHUNK = """
import os, sys
fd = os.memfd_create("extkv-chunk")
os.posix_fallocate(fd, 0, int(sys.argv[1]))
print("held", flush=True)
sys.stdin.read()
"""
#: Safety net against a hang, never a synchronization.
HANG_S = 60


def test_the_outside_sampler_keeps_the_largest_sample_and_counts_each():
    """Two known processes: a child holding one chunk of 3 granules and
    this process holding two of one granule, then releasing them. The
    sampler reads each once a pass and every pass past the first is a
    sample; its maximum is the five granules both held, and stays so once
    this process released two, which its latest sample shows."""
    granule = HOST_STRESS_GRANULE
    holder = subprocess.Popen([sys.executable, "-c", HOLD_A_CHUNK, str(3 * granule)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    driver = HostDriver(granule)
    mine = [driver.create(granule) for _ in range(2)]
    reads: collections.Counter = collections.Counter()
    device = HostDevice()

    def counted(pids: list[int]):
        reads.update(pids)
        return device.read_pieces(pids)

    sampler = OutsideSampler(counted)
    try:
        assert holder.stdout.readline() == "held\n"
        sampler.watch(holder.pid)
        sampler.watch(os.getpid())
        sampler.start()
        assert sampler.wait_samples(3, HANG_S)
        assert (sampler.max_bytes, sampler.last_bytes) == (5 * granule, 5 * granule), (sampler.max_bytes, sampler.last_bytes)
        while mine:
            driver.release(mine.pop())
        # Two samples on, the latest pass began after the releases.
        assert sampler.wait_samples(sampler.samples + 2, HANG_S)
        assert (sampler.max_bytes, sampler.last_bytes) == (5 * granule, 3 * granule), (sampler.max_bytes, sampler.last_bytes)
    finally:
        sampler.stop()
        for chunk in mine:
            driver.release(chunk)
        holder.stdin.close()
        holder.wait(HANG_S)
        holder.stdout.close()
    passes = sampler.samples + 1  # the first pass is no sample: it has none before it
    assert reads == {holder.pid: passes, os.getpid(): passes}, (dict(reads), sampler.samples)
    assert sampler.max_plain_bytes == 5 * granule


def test_the_largest_sample_past_the_bound_keeps_each_process_s_readings():
    """Passes read as listed give three samples past a bound of 10 bytes
    (12, 14, 15); the sampler keeps each process's two readings and its
    baseline from the largest, the last, where one process read less the
    second time."""
    passes = iter([{1: {("process", 1): 9}, 2: {("process", 2): 6}},
                   {1: {("process", 1): 10}, 2: {("process", 2): 7}},
                   {1: {("process", 1): 12}, 2: {("process", 2): 7}},
                   {1: {("process", 1): 12}, 2: {("process", 2): 6}}])
    sampler = OutsideSampler(lambda pids: next(passes), bound=10)
    sampler.watch(1, baseline=2)
    sampler.watch(2, baseline=1)
    assert [sampler.sample() for _ in range(4)] == [None, 7 + 5, 8 + 6, 10 + 5]
    assert [total for _, total in sampler.over] == [12, 14, 15]
    assert sampler.largest_over == {1: (12, 12, 2), 2: (7, 6, 1)}, sampler.largest_over


ECHO_LINES = """
import sys
for line in sys.stdin:
    print(line.strip(), flush=True)
"""


def _process_state(pid: int) -> str | None:
    """The state letter /proc gives process `pid` ("T": stopped), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def test_a_still_pass_reads_the_watched_processes_stopped_and_continues_them():
    """With `still`, every pass reads the watched children while each is
    stopped, and each pass is a sample by itself; between passes each runs
    (it echoes a line it is sent); a child killed and reaped meanwhile is
    passed over, its pid never signalled again. Once stopped, the sampler
    holds no pidfd."""
    children = [subprocess.Popen([sys.executable, "-c", ECHO_LINES], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True) for _ in range(2)]
    states: list[dict[int, str | None]] = []

    def read(pids: list[int]):
        states.append({pid: _process_state(pid) for pid in pids})
        return {pid: {("process", pid): 3} for pid in pids}

    def echoes(child: subprocess.Popen) -> bool:
        child.stdin.write("here\n")
        child.stdin.flush()
        return bool(select.select([child.stdout], [], [], HANG_S)[0]) and child.stdout.readline() == "here\n"

    def pidfds() -> int:
        return sum(os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[pidfd]" for fd in os.listdir("/proc/self/fd")
                   if os.path.exists(f"/proc/self/fd/{fd}"))

    before = pidfds()
    sampler = OutsideSampler(read, still=True)
    try:
        for child in children:
            sampler.watch(child.pid, baseline=1)
        for _ in range(3):
            assert sampler.sample() == 2 * (3 - 1)
            assert all(echoes(child) for child in children), "a child did not run again after a still pass"
        assert sampler.samples == 3 and states == [{child.pid: "T" for child in children}] * 3, states
        children[1].kill()
        children[1].wait(HANG_S)
        assert sampler.sample() == 2 * (3 - 1)  # the reaped child's pid is read (as gone) but not stopped
        assert states[-1] == {children[0].pid: "T", children[1].pid: None}, states[-1]
        sampler.forget(children[1].pid)
        assert echoes(children[0])
        sampler.stop()
        assert pidfds() == before, f"{pidfds() - before} pidfds left open once the sampler stopped"
    finally:
        sampler.stop()
        for child in children:
            child.kill()
            child.wait(HANG_S)
            child.stdin.close()
            child.stdout.close()


def test_the_budget_stress_read_with_its_engines_stopped_holds_its_bound_on_the_host():
    """The GPU's way of sampling the budget stress, engines stopped for each
    pass, run on the host's engines through the least episode: engines
    and the daemon SIGKILLed, reclaims answered, every engine stopped and
    continued once a pass. It ends with no failure, every pass a sample
    within the bound, and nothing left behind."""
    tally = StressTally()
    result = share_one_budget(tally, SEED, device="cpu", until=time.monotonic(), still=True)
    assert tally.failures == [], tally.failures[:3]
    assert result.engines_read_stopped and result.samples >= LEAST_SAMPLES, result
    assert (result.engine_kills, result.daemon_kills) == (LEAST_ENGINE_KILLS, LEAST_DAEMON_KILLS), result
    assert 0 < result.sampled_max <= result.bound, result
    assert (result.out_of_memory_inside_budget, result.reclaims_late, result.leaks) == (0, 0, []), result
    assert tally.checks["the ledger holds nothing once every engine ended"] == 1, dict(tally.checks)


def test_a_sample_counts_only_the_chunks_two_passes_in_a_row_read_in_one_process():
    """A chunk released between two passes (pid 1's inode 11), one created
    between them (inode 12), one read in another process the second time
    (inode 40) count nothing; one read smaller the second time counts the
    smaller reading."""
    first = {1: {(0, 10): 4, (0, 11): 4}, 2: {(0, 20): 8}, 3: {(0, 40): 4}}
    second = {1: {(0, 10): 4, (0, 12): 4}, 2: {(0, 20): 6}, 4: {(0, 40): 4}}
    assert consistent_bytes(first, second) == 4 + 6


def test_a_sample_counts_a_whole_process_as_one_piece_less_its_baseline():
    """Pieces as a GPU's NVML reads them, each process's whole reading keyed
    by its pid: each counts the smaller of its two readings less the
    baseline it was watched with (its context), and one read below its
    baseline counts nothing rather than less."""
    first = {1: {("process", 1): 600}, 2: {("process", 2): 520}, 3: {("process", 3): 450}}
    second = {1: {("process", 1): 700}, 2: {("process", 2): 540}, 3: {("process", 3): 400}}
    assert consistent_bytes(first, second, {1: 500, 2: 500, 3: 500}) == 100 + 20 + 0


def test_an_engine_spans_as_many_granules_at_a_gpu_granule_as_on_the_host():
    """The budget stress counts its sizes in the driver's granules: at a
    GPU's 2 MiB an engine's cache (either layout), committed whole, spans
    exactly the granules it spans at HOST_STRESS_GRANULE: more than an
    engine's share of the budget among eight, at most a quarter of it. A
    granule the host's does not divide is refused, naming it."""
    gpu_granule = 2 << 20
    for layout in ENGINE_LAYOUTS:
        spans = []
        for granule in (HOST_STRESS_GRANULE, gpu_granule):
            blocks = engine_blocks(granule)
            cache = ExtensibleKVCache(config_for("full", layout, blocks), HostDriver(granule), layout)
            try:
                spans.append(cache.physical_bytes_for(blocks) / granule)
            finally:
                cache.free()
        assert spans[0] == spans[1] and BUDGET_STRESS_GRANULES / ENGINES < spans[0] <= BUDGET_STRESS_GRANULES / 4, \
            (layout.name, spans)
    with pytest.raises(ValueError, match="granule must be a positive multiple of 65536 bytes, got 98304"):
        engine_blocks(HOST_STRESS_GRANULE * 3 // 2)


def test_a_budget_engine_child_waits_at_its_gate_and_speaks_by_lines():
    """An engine child says `ready`, passes its gate only once the gate's
    writing end opened, reports a tally when it joined, answers a command
    it does not know with an error line, and at `stop` frees its cache,
    sends its last tally (which holds that check) and `stopped`, and exits
    0; the ledger then holds nothing of it."""
    with served_daemon(BUDGET_STRESS_BYTES) as served, short_run_dir() as run_dir:
        os.makedirs(os.path.dirname(run_dir), exist_ok=True)
        gate = os.path.join(os.path.dirname(run_dir), "gate")
        os.mkfifo(gate, 0o600)
        with ChildProcess(["budget-engine", "--socket", served.path, "--seed", str(SEED), "--gate", gate]) as child:
            engine = EngineChild(child, child.pid, SEED, 0, 1.0, KVCacheLayout.LBHNC)
            assert child.line() == "ready"
            opened = time.monotonic()
            os.close(os.open(gate, os.O_WRONLY | os.O_NONBLOCK))
            joined = child.line()
            engine.read_lines([joined])
            assert joined.startswith("tally ") and engine.info["gate_passed_at"] >= opened, (joined, opened)
            # Each command is read before a step, so at least one step runs
            # between the two: a growth, the only operation an empty cache has.
            child.send("frobnicate")
            child.send("stop")
            lines = [child.line()]
            while lines[-1] != "stopped":
                lines.append(child.line())
            engine.read_lines(lines)
            assert child.wait() == 0, child.stderr()
        assert engine.problems == [
            f"engine {engine.pid} said \"error: unknown command 'frobnicate', expected stop or quit\""
        ], engine.problems
        assert engine.failures() == engine.problems and engine.tally.failures == [], engine.tally.failures
        assert engine.tally.operations["commit (grow)"] >= 1, dict(engine.tally.operations)
        assert engine.tally.checks["no chunk left in the engine's process after free"] == 1, dict(engine.tally.checks)
        wait_for_status(served.path, lambda report: not report["engines"], "the stopped engine's lease to end")


def test_an_engine_counts_its_last_tally_and_the_failures_said_after_it():
    """What the parent reads of an engine that was killed: its latest tally
    line (not its first), the `failed` lines that no later tally holds, and
    every line that is no part of the protocol."""
    first, last = StressTally(), StressTally()
    first.operations["commit (grow)"] = 1
    last.operations["commit (grow)"] = 5
    last.fail(AssertionError("x"))

    def tally_line(tally: StressTally) -> str:
        return "tally " + json.dumps({"tally": tally.to_json(), "engine": {"pid": 7}})

    engine = EngineChild(None, 7, SEED, 0, 1.0, KVCacheLayout.LBHNC)
    engine.read_lines(["ready", tally_line(first), "failed x", tally_line(last), "failed y", "bogus"])
    assert engine.tally.operations == {"commit (grow)": 5}, engine.tally.operations
    assert engine.failures() == ["failed y", "engine 7 said 'bogus'"], engine.failures()


def test_the_daemon_log_counts_reclaims_past_their_deadline_and_contradicted_releases():
    """From a real daemon's log: a holder that hears a reclaim and answers
    nothing makes one reclaim past its deadline and one reserve denied at
    its deadline (waited out once); an engine that claims a release it did
    not make, one release the outside reading contradicted."""
    with served_daemon(1000) as served:
        holder, asker = BudgetClient(served.path, timeout=HANG_S), BudgetClient(served.path, timeout=HANG_S)
        answer = threading.Event()

        def stubborn(target: int) -> int:
            answer.wait(HANG_S)
            return 0

        try:
            holder.confirm(holder.reserve(800), 800)
            holder.on_reclaim(stubborn)
            started = time.monotonic()
            with pytest.raises(BudgetDeniedError):
                asker.reserve(300)
            assert time.monotonic() - started >= RECLAIM_DEADLINE_S * 0.99
        finally:
            answer.set()
            holder.close()
            asker.close()
    assert _daemon_log_counts("\n".join(served.log)) == {
        "reclaims_late": 1, "reserves_denied_at_deadline": 1, "rejoins_past_budget": 0, "most_past_budget": 0,
        "releases_contradicted": 0, "found_at_restarts": 0,
    }, served.log
    with served_daemon(BUDGET_STRESS_BYTES) as served:
        with claiming_child(served.path, honest=False):
            # The claim reached the daemon before the child said so, not
            # necessarily before the daemon took it: its log line says when.
            deadline = time.monotonic() + HANG_S
            while not any("still holds" in line for line in served.log):
                assert time.monotonic() < deadline, served.log
                threading.Event().wait(0.01)
    assert _daemon_log_counts("\n".join(served.log))["releases_contradicted"] == 1, served.log


def test_the_daemon_log_file_keeps_every_daemon_and_counts_a_rejoin_past_the_budget():
    """Two daemons in turn on one socket, their lines in one file: the first
    SIGKILLed while an engine holds 4 MiB, the second started with a budget
    of 2 MiB, which counts the engine's process from the first's journal
    until it rejoins, and which its rejoin takes 2 MiB past."""
    mib = 1 << 20
    with short_run_dir() as run_dir:
        log = os.path.join(os.path.dirname(run_dir), "daemon.log")
        os.makedirs(os.path.dirname(run_dir), exist_ok=True)
        with daemon_process(run_dir, 16 * mib, log) as daemon:
            client = BudgetClient(daemon.path, timeout=HANG_S)
            layout = KVCacheLayout.BLHNC
            cache = ExtensibleKVCache(config_for("full", layout), HostDriver(), layout, budget=client)
            cache.commit(cache.blocks_within(4 * mib))
        try:
            with daemon_process(run_dir, 2 * mib, log) as restarted:
                # The client may not yet have read the first daemon's end, so
                # it may still say it is connected: wait for the new ledger.
                wait_for_status(restarted.path, lambda report: any(
                    engine["pid"] == os.getpid() and engine["lease"] == "live" for engine in report["engines"]),
                    "the engine's rejoin")
        finally:
            cache.free()
            client.close()
        with open(log) as lines:
            text = lines.read()
    assert text.count(" joined: ") == 2, text
    counts = _daemon_log_counts(text)
    assert (counts["found_at_restarts"], counts["rejoins_past_budget"], counts["most_past_budget"]) == (1, 1, 2 * mib), text
