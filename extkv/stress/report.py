"""The stress section of a report: what `extkv stress` ran, met and found.

Theory of operation
-------------------
`extkv stress` leaves its raw results under `<run>/stress/`: one file per
test and worker in `tests/` (written by the stress suite's conftest: outcome,
seed, share of the time bound, device, and the test's tally of operations,
checks, events, faults by (operation, step, mode), leaks, content
mismatches and failures with their reproductions), one memory timeline per
worker process (`timeline-<worker>.json`: this process's extkv memory read
by the usage probe and the device's used memory, sampled outside extkv), and
`run.json` (the bound, the seed, the command, the exit status, and the
signal that ended the run before its bound, if one did). A tally's
`short_bounds` are the workloads whose least episode outlasted their share
(a deadline is a floor for one whole episode, not a hard stop): the report
names each, so a short bound reads as the least, not as a full run.
`load_stress` reads them all, and from the harness's record of the same
pytest run (`stress.json`) the tests a signal stopped, which leave no
result of their own; `stress_totals` adds them up per device;
`stress_section` renders the markdown and draws one memory plot per worker
and device, only where the timeline or this module changed since its PNG
was drawn (extkv.runs.plots.draw_unless_current); `stress_front` is its
verdict line on the report's front page.

`stress_verdict` mirrors the check's rule (extkv.check.verdict): the run
passed only where pytest ended with status 0, a test passed, and none
failed, leaked, mismatched or was interrupted; a run a signal ended, or
whose pytest a signal stopped (exit status 2), passed nothing, and its
stopped tests are `interrupted`, never failures. A report shows a run
narrowed by pytest's selection (options, test paths) as judging nothing
(`shown_verdict`), as a narrowed check certifies nothing.

Everything here is plain JSON reading, so a report renders again without the
test extra (pytest, hypothesis) installed.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path, PurePosixPath

from ..faultable import FAULTABLE_STEPS
from .plots import memory_plot, timeline_series, where
from ..runs.portable import option_value, portable_command_line, recorded_checkout
from ..runs.results import INTERRUPTED_STATUS, load_step_results, narrowing
from ..runs.rundir import read_json

#: The stress suite's results format (stress/conftest.py's RESULT_FORMAT;
#: the suite is not importable from here).
STRESS_FORMAT = "extkv-stress/1"
STRESS_DIR = "stress"
RUN_FILE = "run.json"
#: The harness's results step of a stress run: its record is `<step>.json`.
HARNESS_STEP = "stress"
FAULT_MODES = ("failure", "out of memory")
_UNITS = [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"), (1, "bytes")]


def _read(path: Path) -> dict:
    document = read_json(path)
    if not isinstance(document, dict) or document.get("format") != STRESS_FORMAT:
        found = document.get("format") if isinstance(document, dict) else type(document).__name__
        raise ValueError(f"{path}: not an extkv stress results file (format {found!r}, expected {STRESS_FORMAT!r})")
    return document


def load_stress(run_dir: Path) -> dict | None:
    """{"run": run.json or {}, "tests": [records], "interrupted": [the
    harness's records of tests a signal stopped], "selected": [the
    positional arguments pytest took, the suite first, as the harness
    recorded them] or None where it recorded none, "timelines":
    [documents]} from `run_dir/stress/`; None when it holds neither a
    test's result nor run.json."""
    directory = Path(run_dir) / STRESS_DIR
    tests = sorted((directory / "tests").glob("*.json")) if directory.is_dir() else []
    run_file = directory / RUN_FILE
    if not tests and not run_file.is_file():
        return None
    harness_file = directory / f"{HARNESS_STEP}.json"
    harness = load_step_results(harness_file) if harness_file.is_file() else None
    harness_tests = harness["tests"] if harness else {}
    return {
        "run": read_json(run_file) if run_file.is_file() else {},
        "tests": [_read(path) for path in tests],
        "interrupted": [{**record, "nodeid": nodeid} for nodeid, record in harness_tests.items()
                        if record["outcome"] == "interrupted"],
        "selected": harness["selection"]["args"] if harness else None,
        "timelines": [_read(path) for path in sorted(directory.glob("timeline-*.json"))],
    }


def device_of(record: dict) -> str:
    """The device a test ran on, naming the physical GPU where the harness did."""
    return record.get("device_label") or record.get("device") or "host"


def stress_totals(stress: dict) -> dict:
    """Totals over every test, and per device: operations, faults, pairs,
    leaks, content mismatches, failures, outcomes, peak footprint."""

    def empty() -> dict:
        return {
            "operations": Counter(), "checks": Counter(), "events": Counter(), "faults": Counter(),
            "pairs": set(), "unreached": set(), "leaks": [], "content_mismatches": 0, "failures": 0,
            "outcomes": Counter(), "peak_physical_bytes": 0, "seeds": [],
        }

    overall, per_device = empty(), {}
    for record in stress["tests"]:
        tally = record["tally"]
        for totals in (overall, per_device.setdefault(device_of(record), empty())):
            totals["operations"].update(tally["operations"])
            totals["checks"].update(tally["checks"])
            totals["events"].update(tally["events"])
            totals["faults"].update({(o, s, m): c for o, s, m, c in tally["faults"]})
            totals["pairs"] |= {tuple(pair) for pair in tally["pairs_covered"]}
            totals["unreached"] |= {tuple(pair) for pair in tally["unreached"]}
            totals["leaks"] += tally["leaks"]
            totals["content_mismatches"] += tally["content_mismatches"]
            totals["failures"] += len(tally["failures"]) + (record["outcome"] in ("failed", "error") and not tally["failures"])
            totals["outcomes"][record["outcome"]] += 1
            totals["peak_physical_bytes"] = max(totals["peak_physical_bytes"], tally["peak_physical_bytes"])
            totals["seeds"] += tally["seeds"]
    return {"overall": overall, "devices": per_device}


def _bytes(count: int) -> str:
    scale, unit = next((scale, unit) for scale, unit in _UNITS if abs(count) >= scale or scale == 1)
    return f"{count / scale:.1f} {unit}" if scale > 1 else f"{count} bytes"


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes} min {seconds:02d} s"


def _counts(outcomes: Counter, interrupted: int) -> str:
    """`3 passed, 1 failed, 1 interrupted, 0 skipped`: failed and interrupted where any."""
    failed = outcomes["failed"] + outcomes["error"]
    return (f"{outcomes['passed']} passed" + (f", {failed} failed" if failed else "")
            + (f", {interrupted} interrupted" if interrupted else "") + f", {outcomes['skipped']} skipped")


def stress_verdict(stress: dict) -> tuple[bool, str]:
    """(passed, the line that says so and why) of a load_stress document."""
    run, overall = stress["run"], stress_totals(stress)["overall"]
    outcomes, interrupted = overall["outcomes"], len(stress["interrupted"])
    counts = _counts(outcomes, interrupted)
    if run.get("interrupted"):
        return False, f"INTERRUPTED by {run['interrupted']}: not passed (the run ended before its bound); {counts}"
    problems = []
    if not run:
        problems.append(f"no {RUN_FILE}: how the run ended is unknown")
    failed = outcomes["failed"] + outcomes["error"]
    if failed:
        problems.append(f"{failed} failed")
    if interrupted:
        problems.append(f"{interrupted} interrupted")
    for count, what in ((len(overall["leaks"]), "leaks"), (overall["content_mismatches"], "content mismatches"),
                        (0 if failed else overall["failures"], "failures")):
        if count:
            problems.append(f"{count} {what}")
    status = run.get("exit_status")
    if status == INTERRUPTED_STATUS:
        problems.append(f"interrupted (pytest exit status {status})")
    elif run and status != 0:
        problems.append(f"pytest ended with exit status {status}")
    if not outcomes["passed"]:
        problems.append("no test passed")
    if problems:
        return False, f"NOT PASSED: {', '.join(problems)}; {counts}"
    return True, f"PASSED: {counts}"


def _command_line(run: dict) -> str:
    """The command the run was started with, its paths shown relative to the
    checkout or the run (extkv.runs.portable)."""
    pytest = run.get("pytest") or []
    results = option_value(pytest, "--stress-results")
    run_dir = PurePosixPath(results).parent if results else None
    return portable_command_line(run.get("command_line", "extkv stress"), recorded_checkout(pytest), run_dir)


def shown_verdict(stress: dict) -> str:
    """`stress_verdict`'s line as a report shows it: a run narrowed by
    pytest's selection (`-k`, `-x`, ... in its command, test paths in the
    harness's record) and not interrupted passes nothing and judges
    nothing, its counts alone."""
    words = stress_verdict(stress)[1]
    narrowed = narrowing(stress["run"].get("pytest") or [], stress["selected"])
    if not narrowed or stress["run"].get("interrupted"):
        return words
    overall = stress_totals(stress)["overall"]
    return (f"partial run: not a verdict (narrowed by {', '.join(narrowed)}); "
            f"{_counts(overall['outcomes'], len(stress['interrupted']))}")


def stress_front(run_dir: Path) -> list[str] | None:
    """The stress run on a report's front page: its verdict and what it ran,
    in one line; None where `run_dir` holds no stress results."""
    stress = load_stress(Path(run_dir))
    if stress is None:
        return None
    run, overall = stress["run"], stress_totals(stress)["overall"]
    bound = f"bound {run['minutes']} min, " if run.get("minutes") is not None else ""
    return [f"**Stress: {shown_verdict(stress)}** ({bound}{sum(overall['operations'].values()):,} operations, "
            f"{sum(overall['faults'].values()):,} faults injected, {len(overall['leaks'])} leaks, "
            f"{overall['content_mismatches']} content mismatches)."]


def _headline(stress: dict, totals: dict) -> list[str]:
    run, tests = stress["run"], stress["tests"]
    overall = totals["overall"]
    lines = ["## Stress", "", f"- verdict: **{shown_verdict(stress)}**"]
    if run:
        elapsed = run.get("finished", 0) - run.get("started", 0)
        lines.append(
            f"- `{_command_line(run)}`: bound {run.get('minutes')} min, ran {_duration(elapsed)}, "
            f"seed {run.get('seed')}, pytest exit status {run.get('exit_status')}; "
            f"{run.get('layout_of_work', '')}"
        )
        if run.get("interrupted"):
            lines.append(f"- **INTERRUPTED by {run['interrupted']}** before its bound: the counts below are of what "
                         "ran until then")
    lines.append(f"- tests: {_counts(overall['outcomes'], len(stress['interrupted']))}")
    per_device = ", ".join(
        f"{device}: {sum(device_totals['operations'].values()):,}" for device, device_totals in totals["devices"].items()
        if sum(device_totals["operations"].values())
    )
    lines.append(f"- **operations run: {sum(overall['operations'].values()):,}** ({per_device or 'none'})")
    lines.append(
        f"- **faults injected: {sum(overall['faults'].values()):,}**, **(operation, driver step) pairs covered: "
        f"{len(overall['pairs'])}** (pairs an operation never reaches are listed below)"
    )
    lines.append(
        f"- **leaks: {len(overall['leaks'])}**, **content mismatches: {overall['content_mismatches']}**, "
        f"failures: {overall['failures']}"
    )
    lines.append(f"- largest footprint of a stressed cache: {_bytes(overall['peak_physical_bytes'])}")
    short = [record for record in tests if record["tally"].get("short_bounds")]
    if short:
        lines.append(
            f"- bounds too short: {len(short)} {'test ran only its' if len(short) == 1 else 'tests ran only their'} "
            "least episode (listed below)"
        )
    return lines


def _short_bound_lines(tests: list[dict]) -> list[str]:
    """A row per workload whose least episode outlasted its share."""
    rows = [(record, short) for record in tests for short in record["tally"].get("short_bounds", [])]
    if not rows:
        return []
    lines = [
        "", "### Bounds too short", "",
        "A deadline is a floor for one whole episode: these workloads ran only their least, which outlasted "
        "the test's share of the bound; a longer bound runs more of them.",
        "",
        "| test | device | workload | least episode run | took | share of the bound | test ran |",
        "|---|---|---|---|---|---|---|",
    ]
    for record, short in sorted(rows, key=lambda row: (device_of(row[0]), row[0].get("started") or 0)):
        budget = record.get("budget_s")
        lines.append(
            f"| `{record['nodeid'].split('::')[-1]}` | {device_of(record)} | {short['workload']} | {short['ran']} | "
            f"{short['seconds']:.1f} s | {f'{budget:.0f} s' if budget is not None else '-'} | {record['duration_s']:.0f} s |"
        )
    return lines


def _tests_table(tests: list[dict], interrupted: list[dict]) -> list[str]:
    lines = [
        "", "### Tests", "",
        "| test | device | outcome | share of the bound | ran | operations | faults | seed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for record in sorted(tests, key=lambda r: (device_of(r), r.get("started") or 0)):
        tally = record["tally"]
        name = record["nodeid"].split("::")[-1]
        budget = f"{record['budget_s']:.0f} s" if record.get("budget_s") is not None else "-"
        outcome = record["outcome"] if record["outcome"] != "skipped" else f"skipped: {record.get('skip_reason') or ''}"
        lines.append(
            f"| `{name}` | {device_of(record)} | {outcome} | {budget} | {record['duration_s']:.0f} s | "
            f"{tally['operations_total']:,} | {tally['faults_injected']:,} | {record.get('seed') if record.get('seed') is not None else '-'} |"
        )
    # A test a signal stopped left no tally: the harness's record says where it ran and for how long.
    lines += [
        f"| `{record['nodeid'].split('::')[-1]}` | {record.get('device') or '-'} | interrupted | - | "
        f"{record['duration_s']:.0f} s | - | - | - |"
        for record in interrupted
    ]
    return lines


def _counter_table(title: str, counts: Counter, what: str, note: str = "") -> list[str]:
    if not counts:
        return []
    lines = ["", f"### {title}", ""]
    if note:
        lines += [note, ""]
    lines += [f"| {what} | count |", "|---|---|"]
    lines += [f"| {name} | {count:,} |" for name, count in counts.most_common()]
    return lines


def _fault_table(overall: dict) -> list[str]:
    faults, unreached = overall["faults"], overall["unreached"]
    operations = sorted({operation for operation, _, _ in faults} | {operation for operation, _ in unreached})
    if not operations:
        return []
    lines = [
        "", "### Faults injected, by operation and driver step", "",
        "Each cell: faults fired as plain failures / as out-of-memory; `-` where the operation never makes that call. "
        "After each: the state agreed with the driver's read-back and the usage probe, kept bytes were kept, a retry "
        "succeeded and ended where a fault-free run ends, and freeing everything left nothing behind.",
        "",
        "| operation | " + " | ".join(FAULTABLE_STEPS) + " |",
        "|---|" + "---|" * len(FAULTABLE_STEPS),
    ]
    for operation in operations:
        cells = []
        for step in FAULTABLE_STEPS:
            counts = [faults.get((operation, step, mode), 0) for mode in FAULT_MODES]
            cells.append("-" if not any(counts) and (operation, step) in unreached else " / ".join(map(str, counts)))
        lines.append(f"| {operation} | " + " | ".join(cells) + " |")
    return lines


def _memory_lines(stress: dict, run_dir: Path) -> list[str]:
    if not stress["timelines"]:
        return []
    lines = [
        "", "### Memory timeline", "",
        "Read outside extkv: this process's extkv memory by the usage probe (the kernel's memfd pages; NVML per "
        "process), the device's used memory by the kernel (MemTotal - MemAvailable) or the CUDA driver.",
        "",
        "| device | samples | peak, this process's extkv memory | final | peak, device used | final, device used |",
        "|---|---|---|---|---|---|",
    ]
    plots, skipped = [], None
    for timeline in stress["timelines"]:
        for device, samples in timeline_series(timeline).items():
            lines.append(
                f"| {where(timeline, device)} | {len(samples)} | {_bytes(max(p for _, p, _ in samples))} | "
                f"{_bytes(samples[-1][1])} | {_bytes(max(u for _, _, u in samples))} | {_bytes(samples[-1][2])} |"
            )
            name = f"stress-memory-{timeline['worker']}-{device.replace(':', '')}.png"
            missing = memory_plot(timeline, device, run_dir / name)
            if missing is None:
                plots.append(f"![memory on {where(timeline, device)}]({name})")
            else:
                skipped = missing
    lines += [""] + plots + ([f"Plots skipped: {skipped}."] if skipped is not None else [])
    return lines


def _failure_lines(tests: list[dict]) -> list[str]:
    failed = [record for record in tests if record["outcome"] in ("failed", "error") or record["tally"]["failures"]]
    if not failed:
        return []
    lines = ["", "### Failures and their reproductions", ""]
    for record in failed:
        lines += [f"**`{record['nodeid']}`** on {device_of(record)} (seed {record.get('seed')}):", ""]
        for failure in record["tally"]["failures"]:
            lines += ["```", failure["error"][:2000], failure.get("reproduction", "")[:4000], "```", ""]
        if record.get("failure"):
            lines += ["<details><summary>pytest's report</summary>", "", "```", record["failure"][-6000:], "```", "", "</details>", ""]
    return lines


def stress_section(run_dir: Path) -> str | None:
    """Markdown for the stress results in `run_dir` (plots written beside it), or None when there are none."""
    run_dir = Path(run_dir)
    stress = load_stress(run_dir)
    if stress is None:
        return None
    totals = stress_totals(stress)
    overall = totals["overall"]
    settings: dict = {}
    for record in stress["tests"]:
        settings.update(record["tally"]["settings"])
    check_note = (
        "After every step of a walk: the counts, sizes and physical bytes it changed, and the bytes it touched "
        "(new blocks zero over poisoned memory, a written block as written, one chunk per segment read back after a "
        f"defragment); every {settings.get('full check every (steps)', '?')} steps, and after every step of a "
        "Hypothesis machine, everything: addresses, every committed byte, the driver's read-back of every granule, "
        "one chunk per segment, the usage probe."
    )
    lines = _headline(stress, totals)
    lines += _tests_table(stress["tests"], stress["interrupted"])
    lines += _short_bound_lines(stress["tests"])
    lines += _counter_table("Operations", overall["operations"], "operation (each a public operation on a real cache, checked)")
    lines += _counter_table("Checks passed", overall["checks"], "check", check_note)
    lines += _fault_table(overall)
    lines += _counter_table("Events met", overall["events"], "event (pressure, out-of-memory, crashes)")
    if overall["leaks"]:
        lines += ["", "### Leaks", ""] + [f"- {leak}" for leak in overall["leaks"]]
    lines += _memory_lines(stress, run_dir)
    lines += _failure_lines(stress["tests"])
    return "\n".join(lines) + "\n"
