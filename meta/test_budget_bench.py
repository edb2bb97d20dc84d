"""The shared KV budget's bench: its readings exist, and its verdicts are right.

Speed is never asserted: a reading may meet or miss its bound on this
machine. What is: the smoke run through `extkv bench --quick` measures
every reading, the two engines' bursts among them, and reports them as
readings, judging nothing; a run whose commit reaches the target's size
judges every reading, each a number and met or missed; the arithmetic
takes the least round where the target says so (a p99, each side of a
ratio, each side of a difference), the burst that reached least, and the
largest outside sum, which numbers worked by hand pin down; a planted slow
path, a client whose every reserve sleeps far past every bound, is missed
by every reading it is on the path of; an engine that answers every
reclaim `cannot` leaves the next burst's engine short of its reach, which
the bursts' row misses (the budget's denial decides it, not a clock); and
a planted overshoot in a result is missed by the overshoot's row.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time

import pytest

from extkv.benchmarking import budget_bench, budget_bursts
from extkv.benchmarking.budget_report import budget_front, budget_section
from extkv.benchmarking.result_files import BUDGET_FILE
from extkv.benchmarking.targets import BUDGET_TARGETS, evaluate_budget
from extkv.budget.client import BudgetClient
from extkv.testing.children import python_c

pytestmark = pytest.mark.harness

MiB, GiB = 1 << 20, 1 << 30

#: A host run small enough for a test whose commit reaches the commit
#: target's least size, so that every reading is judged: 256 MiB held at
#: most, about 3 s on the 2-core CI host.
JUDGED = budget_bench.Setting("blhnc1", grant_rounds=2, grant_samples=200, commit_bytes=(256 * MiB,),
                              commit_rounds=3, reclaim_bytes=16 * MiB, reclaim_rounds=2, grant_warm_up=10)
#: The planted delay of every reserve: 1,500 times the grant's bound, past
#: the reclaim's 100 ms, and on a 256 MiB commit (0.13 s on the CI host)
#: a ratio past 2x, where the bound is 1.02x.
PLANTED_DELAY_S = 0.15
#: The same run, fewer round trips: each takes the planted delay.
PLANTED = budget_bench.Setting("blhnc1", grant_rounds=1, grant_samples=5, commit_bytes=(256 * MiB,),
                               commit_rounds=2, reclaim_bytes=16 * MiB, reclaim_rounds=2, grant_warm_up=1)


#: Two engines' bursts small enough for a test: a budget of 24 blocks of
#: 2 MiB, floors of 4 and 8 blocks, a block a step; under 2 s on the 2-core
#: CI host.
BURSTS = budget_bursts.BurstSetting("blhnc1", 48 * MiB, (8 * MiB, 16 * MiB), step_blocks=1, ahead_blocks=4,
                                    ahead_step_blocks=2, work_dim=64, work_matmuls=1, work_dtype="float32", rounds=1)


class AnswersCannot(BudgetClient):
    """A planted defect: an engine that never gives back. Whatever handler
    the engine sets, the daemon's every reclaim is answered `cannot`."""

    def on_reclaim(self, handler) -> None:
        super().on_reclaim(None)


class SlowReserves(BudgetClient):
    """A planted slow path: the real client, each reserve sent only after
    PLANTED_DELAY_S. The sleep is the defect, not an ordering."""

    def _reserve(self, nbytes: int, ahead: int) -> tuple[int, int]:
        time.sleep(PLANTED_DELAY_S)
        return super()._reserve(nbytes, ahead)


def rows_of(table: list[str]) -> list[list[str]]:
    """The cells of each body row of the Markdown table in `table`."""
    body = [line for line in table if line.startswith("| ") and not line.startswith("| reading |")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in body]


NUMBER = re.compile(r"^-?[0-9.]+ (us|ms|x|B)$|^-?[0-9.]+x$|^[0-9.]+(KiB|MiB|GiB)$")


def test_the_smoke_run_measures_every_reading_and_reports_readings_only(tmp_path):
    """`extkv bench --quick -k budget` on the host driver: bench_budget.json
    holds every round of every reading, and summary.md's front page and
    bench section show each reading as a number, judged by none."""
    environment = {name: value for name, value in os.environ.items() if not name.startswith("PYTEST_XDIST")}
    environment["CUDA_VISIBLE_DEVICES"] = ""
    argv = ["bench", "--quick", "--report-dir", str(tmp_path / "run"), "--benchmark-storage", str(tmp_path / "storage"),
            "-k", "budget"]
    finished = python_c(f"import sys; from extkv.cli import main; sys.exit(main({argv!r}))", tmp_path / "run",
                        environment)
    assert finished.returncode == 0, finished.stdout[-4000:] + finished.stderr[-4000:]
    result = json.loads((tmp_path / "run" / BUDGET_FILE).read_text())
    quick = budget_bench.QUICK_SETTING
    assert [r["samples"] for side in ("rounds", "floor_rounds") for r in result["grant"][side]] == \
        [quick.grant_samples] * quick.grant_rounds * 2, result["grant"]
    assert [(len(c["budgeted_s"]), len(c["unbudgeted_s"])) for c in result["commits"]] == \
        [(quick.commit_rounds, quick.commit_rounds)] * len(quick.commit_bytes), result["commits"]
    assert {key: len(result["reclaim"][key]) for key in ("grant_s", "handler_shrink_s", "alone_s")} == \
        dict.fromkeys(("grant_s", "handler_shrink_s", "alone_s"), quick.reclaim_rounds), result["reclaim"]
    bursts, quick_bursts = result["bursts"], budget_bursts.QUICK_BURSTS
    assert len(bursts["rounds"]) == quick_bursts.rounds, bursts["rounds"]
    for measured in (rounds[mode] for rounds in bursts["rounds"] for mode in budget_bursts.MODES):
        assert [burst["engine"] for burst in measured["bursts"]] == ["A", "B"] * (quick_bursts.bursts // 2), measured
        assert all(burst["steps_s"] and burst["reach_bytes"] > 0 for burst in measured["bursts"]), measured
        assert measured["p99_s"] > 0 and measured["samples"] > 0, measured

    summary = (tmp_path / "run" / "summary.md").read_text()
    front, _, section = summary.partition("## Benchmarks")
    assert "**Shared KV budget: not a verdict.**" in front, front
    assert "### The shared KV budget (readings only, not a verdict)" in section, section
    assert "**Not a verdict: profile quick" in section, section
    for where, text in (("front page", front), ("bench section", section)):
        rows = rows_of(text.splitlines())
        assert [row[0] for row in rows] == [target.name for target in BUDGET_TARGETS], f"{where}: {rows}"
        for row in rows:
            assert NUMBER.match(row[2]), f"{where}: no number in {row}"
            assert not any(cell.startswith(("met", "MISSED", "missed")) for cell in row), f"{where} judges: {row}"


def judged_rows(result: dict) -> list[list[str]]:
    lines = budget_section(result, None)
    rows = rows_of(lines)
    assert [row[0] for row in rows] == [target.name for target in BUDGET_TARGETS], lines
    return rows


def test_a_run_at_the_targets_sizes_judges_every_reading(tmp_path):
    """Every reading a number and met or missed, whatever this machine reads."""
    lines: list[str] = []
    result = budget_bench.run("cpu", "host", lines.append, setting=JUDGED)
    result["bursts"] = budget_bursts.run("cpu", "host", lines.append, setting=BURSTS)
    rows = evaluate_budget(result)
    assert [row.met in (True, False) and row.value is not None for row in rows] == [True] * 6, rows
    for cells in judged_rows(result):
        assert NUMBER.match(cells[2]) and NUMBER.match(cells[3]), cells
        assert re.match(r"^(met|missed by [0-9.]+(%| points|KiB|MiB|GiB| B)|missed): ", cells[5]), cells
    assert budget_front(result, None)[0].startswith("**Shared KV budget: targets "), budget_front(result, None)
    assert len(lines) == JUDGED.grant_rounds + len(JUDGED.commit_bytes) + JUDGED.reclaim_rounds + BURSTS.rounds, \
        lines


def test_a_planted_slow_reserve_misses_every_reading_that_asks():
    """SlowReserves as the busy engine's client: each reserve waits
    PLANTED_DELAY_S, so the least p99, the ratio of the least commits and
    the least reserve-to-grant past the release alone all miss, while the
    commit on bytes granted ahead, which asks once (untimed) and then
    nothing, pays no delay. (The bursts are not run: their rows say so.)"""
    result = budget_bench.run("cpu", "host", lambda line: None, setting=PLANTED, client_class=SlowReserves)
    rows = evaluate_budget(result)
    (commit,) = result["commits"]
    assert min(commit["ahead_s"]) + PLANTED_DELAY_S / 2 < min(commit["budgeted_s"]), commit
    assert [row.met for row in rows[:5]] == [False] * 3 + [None] * 2, \
        [(row.target.key, row.value, row.words) for row in rows]
    grant, commit, reclaim = (row.value for row in rows[:3])
    assert grant >= PLANTED_DELAY_S and reclaim > BUDGET_TARGETS[2].bound, (grant, reclaim)
    assert "| MISSED |" in "\n".join(budget_front(result, None)), budget_front(result, None)
    assert all(cells[5].startswith("missed by ") for cells in judged_rows(result)[:3]), judged_rows(result)
    assert [row.words for row in rows[3:5]] == ["not measured (no bursts in this run)"] * 2, rows


def test_an_engine_that_answers_cannot_leaves_the_next_burst_short():
    """Both engines' clients AnswersCannot: engine A's first burst meets B
    at its floor and reaches 48 - 16 = 32 MiB; then B's growth needs A's
    bytes, A answers `cannot`, and B is denied at once, holding its floor's
    16 MiB where 48 - 8 = 40 MiB was in reach: short by 24 MiB, past the
    growth step (a step's commit, one 2 MiB block), so the row is missed,
    whatever the steps took."""
    bursts = budget_bursts.run("cpu", "host", lambda line: None, setting=BURSTS, client_class=AnswersCannot)
    measured = bursts["rounds"][0]["budgeted"]
    reach = [(burst["engine"], burst["reach_bytes"] // MiB) for burst in measured["bursts"]]
    assert reach[:2] == [("A", 32), ("B", 16)], reach
    assert measured["bursts"][1]["stopped"].startswith("BudgetDeniedError"), measured["bursts"][1]["stopped"]
    assert measured["reclaims"] == {"A": [], "B": []}, measured["reclaims"]
    result = worked_result()
    result["bursts"] = bursts
    row = evaluate_budget(result)[-2]
    assert row.met is False and "reach 16MiB of 40MiB, short by 24MiB, past a growth step (2MiB)" in row.words, \
        row.words
    assert "engine B 16MiB" in row.parts, row.parts
    assert "| MISSED |" in budget_front(result, None)[-2], budget_front(result, None)


def worked_bursts() -> dict:
    """Two engines' bursts worked by hand, sizes in MiB: a budget of 256,
    floors A 32 and B 64, a growth step of 8. Engine A reached 190 of the
    256 - 64 = 192 in its reach (2 short, within a step), B all 224 of
    256 - 32. The budgeted p99s are 10.5 and 12 ms, the static 10 and 9.5:
    the least over least, 10.5 / 9.5 = 1.105x, misses 1.05x by 5.5 points,
    where each round's own ratio (1.05x, 1.263x) would have met it once.
    The compared steps are each burst's first 3: A's 50 ms fourth step is
    past them, so the slowest compared is its third, 9 ms. Outside, the
    budgeted sums reach 250 and 256: nothing past the budget."""
    def burst(engine: str, steps: list[float], reach: int) -> dict:
        return {"engine": engine, "steps_s": steps, "used_bytes": reach * MiB, "reach_bytes": reach * MiB,
                "stopped": "BudgetDeniedError: ...", "other_held_bytes": 0}

    def mode(p99_s: float, bursts: list[dict], largest: int) -> dict:
        return {"bursts": bursts, "reclaims": {"A": [], "B": []}, "compared": 6, "p50_s": 0.004, "p99_s": p99_s,
                "samples": 100, "max_outside_bytes": largest * MiB, "max_plain_bytes": 258 * MiB, "over_samples": 0}

    return {
        "setting": {"bursts": 2, "rounds": 2, "step_blocks": 1, "work_matmuls": 8, "work_dim": 1024,
                    "work_dtype": "float32", "ahead_blocks": 16, "ahead_step_blocks": 4},
        "geometry_what": "g", "budget_bytes": 256 * MiB, "floors": {"A": 32 * MiB, "B": 64 * MiB},
        "floor_held_bytes": {"A": 32 * MiB, "B": 64 * MiB}, "static_bytes": 128 * MiB, "growth_bytes": 8 * MiB,
        "compared_steps": 3, "outside": "HostDevice()", "baselines": {"A": 0, "B": 0},
        "rounds": [
            {"order": ["budgeted", "static"],
             "budgeted": mode(0.0105, [burst("A", [0.004, 0.005, 0.009, 0.050], 190),
                                       burst("B", [0.004, 0.004, 0.004, 0.004], 224)], 250),
             "static": mode(0.0100, [burst("A", [0.004] * 3, 128), burst("B", [0.004] * 3, 128)], 256)},
            {"order": ["static", "budgeted"],
             "budgeted": mode(0.0120, [burst("A", [0.004] * 4, 192), burst("B", [0.004] * 4, 224)], 256),
             "static": mode(0.0095, [burst("A", [0.004] * 3, 128), burst("B", [0.004] * 3, 128)], 256)},
        ],
    }


def worked_result() -> dict:
    """Numbers worked by hand: the least p99 is at the bound, the mean and
    the slowest over it; the least commits' ratio at 256 MiB is at the
    bound where the medians' is over it, at 1 GiB over it, and a 16 MiB
    commit is under the target's size; the reclaim's least grant less the
    least release alone is 140 ms, where the least of the rounds' own
    differences would be 100 ms; the bursts are `worked_bursts`."""
    return {
        "profile": "host", "device": "cpu", "daemon_device": "host", "torch": "t", "geometry_what": "g",
        "setting": {"grant_rounds": 3, "grant_samples": 100, "commit_rounds": 3, "reclaim_rounds": 2},
        "grant": {"bytes": 2 * MiB, "rounds": [
            {"p50_s": 60e-6, "p99_s": 120e-6, "max_s": 1e-3, "samples": 100},
            {"p50_s": 50e-6, "p99_s": 100e-6, "max_s": 1e-3, "samples": 100},
            {"p50_s": 70e-6, "p99_s": 400e-6, "max_s": 1e-3, "samples": 100},
        ], "floor_rounds": [
            {"p50_s": 40e-6, "p99_s": 90e-6, "max_s": 1e-3, "samples": 100},
            {"p50_s": 30e-6, "p99_s": 95e-6, "max_s": 1e-3, "samples": 100},
            {"p50_s": 35e-6, "p99_s": 80e-6, "max_s": 1e-3, "samples": 100},
        ]},
        "commits": [
            {"bytes": 256 * MiB, "budgeted_s": [0.51, 0.6, 0.7], "unbudgeted_s": [0.5, 0.52, 0.53]},
            {"bytes": GiB, "budgeted_s": [0.4124], "unbudgeted_s": [0.4]},
            {"bytes": 16 * MiB, "budgeted_s": [0.2], "unbudgeted_s": [0.1]},
        ],
        "reclaim": {"bytes": 256 * MiB, "grant_s": [0.30, 0.16], "handler_shrink_s": [0.05, 0.05],
                    "alone_s": [0.02, 0.06]},
        "bursts": worked_bursts(),
    }


def test_the_budget_verdicts_read_the_least_rounds_worked_by_hand():
    rows = evaluate_budget(worked_result())
    read = [(row.target.key, row.label, row.met, row.words) for row in rows]
    assert read == [
        ("budget-grant", "2MiB", True, "met: 100 us"),
        ("budget-commit", "256MiB", True, "met: 1.020x"),
        ("budget-commit", "1GiB", False, "missed by 1.1 points: 1.031x"),
        ("budget-commit", "16MiB", None, "2.000x, not judged: the target is for commits of 256MiB or more"),
        ("budget-reclaim", "256MiB", False, "missed by 40%: 140.00 ms"),
        ("budget-bursts", "256MiB", False, "missed by 5.5 points: 1.105x; reach 190MiB of 192MiB"),
        ("budget-overshoot", "256MiB", True, "met: 0 B"),
    ], read
    assert [row.median for row in rows] == pytest.approx(
        [120e-6, 0.6 / 0.52, 1.031, 2.0, 0.23 - 0.04, 0.01125 / 0.00975, 0]), rows
    assert rows[0].parts == ("p50 50 us at least; 3 rounds of 100, p99 100 us to 400 us; the floor, a bare message "
                             "round trip between two Python processes: p99 80 us, p50 30 us"), rows[0].parts
    assert rows[5].parts == (
        "p99 step budgeted 10.50 ms / static 9.50 ms (least of 2 rounds; medians 11.25 ms / 9.75 ms) over each "
        "burst's first 3 steps; slowest compared step 9.00 ms, step 3 of burst 1 in round 1; least reach: engine A "
        "190MiB (the budget less the other's floor: 192MiB; a static half 128MiB)"), rows[5].parts
    assert rows[6].parts.startswith("largest sum of both engines read from outside 256MiB of a budget of 256MiB over "
                                    "200 samples in 2 rounds (plain sums of a pass at most 258MiB; static halves at "
                                    "most 256MiB)"), rows[6].parts


def test_the_bursts_row_needs_both_its_numbers_worked_by_hand():
    """The p99 ratio at 10.5 / 10 = 1.05x meets the bound; then the reach
    decides: A 2 MiB short passes, 12 MiB short (180 of 192, past the 8 MiB
    step) misses, naming the reach, the shortfall and the step."""
    result = worked_result()
    result["bursts"]["rounds"][1]["static"]["p99_s"] = 0.0100
    row = evaluate_budget(result)[5]
    assert (row.met, row.words) == (True, "met: 1.050x; reach 190MiB of 192MiB"), row
    result["bursts"]["rounds"][0]["budgeted"]["bursts"][0]["reach_bytes"] = 180 * MiB
    row = evaluate_budget(result)[5]
    assert (row.met, row.words) == (
        False, "missed: reach 180MiB of 192MiB, short by 12MiB, past a growth step (8MiB); 1.050x"), row
    assert "| 256MiB | 1.050x | <= 1.05x, reach >= budget - other's floor - a growth step | MISSED |" in \
        "\n".join(budget_front(result, None)), budget_front(result, None)


def test_a_planted_overshoot_is_missed_by_its_bytes():
    """A budgeted round whose outside sum reached 258 MiB of 256: the
    overshoot is 2 MiB, the largest over rounds (the median of 0 and 2 is
    1); a static round's sum past the budget is no overshoot of the budget."""
    result = worked_result()
    result["bursts"]["rounds"][1]["budgeted"]["max_outside_bytes"] = 258 * MiB
    result["bursts"]["rounds"][0]["static"]["max_outside_bytes"] = 300 * MiB
    row = evaluate_budget(result)[6]
    assert (row.value, row.median, row.met, row.words) == (
        2 * MiB, 1 * MiB, False, "missed by 2MiB: 2MiB past the budget"), row
    assert budget_front(result, None)[-1] == \
        "| overshoot: the engines' bytes together past the budget | 256MiB | 2MiB | <= 0 B | MISSED |", \
        budget_front(result, None)


def test_a_run_that_judges_nothing_shows_each_reading_alone():
    withheld = "profile quick: a smoke run"
    lines = budget_section(worked_result(), withheld)
    assert lines[0] == "### The shared KV budget (readings only, not a verdict)", lines
    assert f"**Not a verdict: {withheld}.**" in lines[2], lines
    assert "Bursts: two engine processes, caches of g, alternate 2 bursts" in lines[4], lines
    verdicts = [cells[5] for cells in rows_of(lines)]
    assert verdicts == ["100 us, not judged", "1.020x, not judged", "1.031x, not judged",
                        "2.000x, not judged: the target is for commits of 256MiB or more", "140.00 ms, not judged",
                        "1.105x, not judged", "0 B, not judged"], verdicts
    assert [cells[4] for cells in rows_of(budget_front(worked_result(), withheld))] == ["not judged"] * 7


def test_a_reading_with_no_rounds_is_not_measured():
    result = worked_result()
    result["grant"]["rounds"], result["commits"][0]["budgeted_s"], result["reclaim"]["alone_s"] = [], [], []
    result["grant"]["floor_rounds"] = []
    for rounds in result["bursts"]["rounds"]:
        rounds["static"]["p99_s"], rounds["budgeted"]["samples"] = None, 0
    rows = evaluate_budget(result)
    assert [(row.value, row.met) for row in rows if row.words.startswith("not measured")] == [(None, None)] * 5, rows
    front = budget_front(result, None)
    assert front[0].startswith("**Shared KV budget: targets 0 met, 1 missed, 5 not measured**"), front
    del result["bursts"]
    assert [row.words for row in evaluate_budget(result)[-2:]] == ["not measured (no bursts in this run)"] * 2


def test_a_run_under_a_budget_named_by_the_environment_is_refused(monkeypatch):
    """Every cache given no client asks the daemon EXTKV_BUDGET names, so
    the unbudgeted side would be budgeted: refused before anything starts."""
    monkeypatch.setenv("EXTKV_BUDGET", "/nowhere/host.sock")
    with pytest.raises(ValueError, match=r"unset EXTKV_BUDGET \(it names '/nowhere/host.sock'\)"):
        budget_bench.run("cpu", "quick", lambda line: None)
    with pytest.raises(ValueError, match=r"unset EXTKV_BUDGET \(it names '/nowhere/host.sock'\)"):
        budget_bursts.run("cpu", "quick", lambda line: None)
    with pytest.raises(ValueError, match=r"profile must be one of \['gpu', 'host', 'quick'\], got 'fast'"):
        budget_bench.setting_for("fast")
    with pytest.raises(ValueError, match=r"profile must be one of \['gpu', 'host', 'quick'\], got 'fast'"):
        budget_bursts.setting_for("fast")


@pytest.mark.parametrize("change, message", [
    (dict(floors=(8 * MiB, 24 * MiB)), r"floors must be two byte counts below half the budget \(25165824\), got "
                                       r"\(8388608, 25165824\)"),
    (dict(work_dtype="half-ish"), r"work_dtype must name a torch dtype, got 'half-ish'"),
    (dict(geometry="llama"), r"geometry must be one of \[.*\], got 'llama'"),
])
def test_a_burst_setting_that_cannot_run_is_refused(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(BURSTS, **change)
