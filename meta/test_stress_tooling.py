"""The stress workloads' own machinery, beside the scenarios that
conformance/test_stress_ci.py runs on the cache: how a walk under memory
pressure waits for the pressure process, how walk processes that die are
pooled into the tally, how a deadline's share and floor are reckoned, and
how the stress report names a bound too short. None of it proves an
invariant of the cache: it keeps the stress runs honest."""

from __future__ import annotations

import errno
import json
import random
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
