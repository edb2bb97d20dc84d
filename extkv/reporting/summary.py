"""The check section of a report: what the conformance suite proved, where.

Theory of operation
-------------------
`extkv check` leaves one results file per step in the run directory (the
harness writes them): `check.json` (the suite, on the host driver and one
GPU per xdist worker) and, on a machine of several GPUs, `check-multi-gpu.json`
(the multi-GPU tests, and the per-GPU ones again, in one process that sees
every GPU). `load_check` merges them: a later step's record of a test
replaces an earlier skip of it (the multi-GPU tests skip under xdist) and
otherwise stands beside it, keyed `<nodeid> (<step>)`: the timeline test
ran on one GPU in the first step and on every GPU in the second.

`check_section` renders the merged results: per invariant of DESIGN.md, the
tests run and passed on each device (a test's device is the label the
harness gave it: `host`, `GPU 1 (NVIDIA H200)`, `GPUs 0, 1 (...)`); the
failures by nodeid; the skips grouped by reason; the multi-GPU step's
result; and the memory timeline of each device, with its plot.
"""

from __future__ import annotations

import json
import shlex
from collections import Counter
from pathlib import Path

from ..testing.timeline import Timeline

#: The harness's results format (extkv.testing.harness.RECORD_FORMAT; the
#: harness needs pytest, which rendering a report does not, so it is not
#: imported here).
CHECK_FORMAT = "extkv-check/1"
#: The harness's device label of the host driver (extkv.testing.harness.HOST_LABEL).
HOST_LABEL = "host"
#: Results files of `extkv check`'s steps, in the order they run.
CHECK_STEPS = ("check", "check-multi-gpu")
#: The row of the per-device table that counts every test, with or without invariants.
ALL_TESTS_ROW = "all tests"


def load_results(path: Path) -> dict:
    """One step's results file; ValueError naming the file when it is not one."""
    try:
        document = json.loads(Path(path).read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not JSON ({error})") from None
    if not isinstance(document, dict) or document.get("format") != CHECK_FORMAT:
        found = document.get("format") if isinstance(document, dict) else type(document).__name__
        raise ValueError(f"{path}: not an extkv check results file (format {found!r}, expected {CHECK_FORMAT!r})")
    for key in ("machine", "invariants", "totals", "tests", "exit_status"):
        if key not in document:
            raise ValueError(f"{path}: results file without {key!r}")
    return document


def load_check(run_dir: Path) -> dict | None:
    """The merged results of every check step in `run_dir`; None when it has none.

    Returns {"steps": {step: document}, "tests": {nodeid: record}, "machine": facts,
    "worker_gpus": {worker: label}, "invariants": {"1": "fixed addresses, ...", ...}}.
    """
    steps = {step: load_results(run_dir / f"{step}.json") for step in CHECK_STEPS if (run_dir / f"{step}.json").is_file()}
    if not steps:
        return None
    tests: dict[str, dict] = {}
    for step, document in steps.items():
        for nodeid, record in document["tests"].items():
            earlier = tests.get(nodeid)
            if earlier is None or earlier["outcome"] == "skipped":
                tests[nodeid] = record
            elif record["outcome"] != "skipped":
                tests[f"{nodeid} ({step})"] = record
    first = next(iter(steps.values()))
    return {
        "steps": steps,
        "tests": tests,
        "machine": first["machine"],
        "worker_gpus": first.get("worker_gpus", {}),
        "invariants": first["invariants"],
    }


def device_columns(tests: dict[str, dict]) -> list[str]:
    """Devices in table order: the host, then the rest by name."""
    devices = {record["device"] for record in tests.values()}
    return ([HOST_LABEL] if HOST_LABEL in devices else []) + sorted(devices - {HOST_LABEL})


def invariant_counts(tests: dict[str, dict], invariants: dict[str, str]) -> dict[str, dict[str, Counter]]:
    """{row: {device: Counter(outcome)}} for each invariant ("1".."8") and ALL_TESTS_ROW."""
    rows: dict[str, dict[str, Counter]] = {number: {} for number in invariants}
    rows[ALL_TESTS_ROW] = {}
    for record in tests.values():
        for row in [str(n) for n in record["invariants"]] + [ALL_TESTS_ROW]:
            rows[row].setdefault(record["device"], Counter())[record["outcome"]] += 1
    return rows


def _cell(counts: Counter | None) -> str:
    """`passed/run`, and `(k skipped)`; `-` where the device ran none."""
    if not counts:
        return "-"
    run = counts["passed"] + counts["failed"] + counts["error"]
    text = f"{counts['passed']}/{run}"
    if counts["skipped"]:
        text += f" ({counts['skipped']} skipped)"
    if run > counts["passed"]:
        text = f"**{text}**"
    return text


def _invariant_table(tests: dict[str, dict], invariants: dict[str, str]) -> list[str]:
    devices = device_columns(tests)
    rows = invariant_counts(tests, invariants)
    lines = [
        "| invariant | " + " | ".join(devices) + " |",
        "|---|" + "---|" * len(devices),
    ]
    for row, by_device in rows.items():
        name = ALL_TESTS_ROW if row == ALL_TESTS_ROW else f"{row}. {invariants[row]}"
        lines.append(f"| {name} | " + " | ".join(_cell(by_device.get(device)) for device in devices) + " |")
    return lines


def _totals_line(step: str, document: dict) -> str:
    totals = document["totals"]
    return (
        f"- `{step}`: {sum(totals.values())} tests: {totals['passed']} passed, {totals['failed']} failed, "
        f"{totals['error']} errors, {totals['skipped']} skipped; pytest exit status {document['exit_status']}"
        f" (`pytest {shlex.join(document.get('arguments', []))}`)"
    )


def _multi_gpu_line(check: dict) -> str:
    document = check["steps"].get("check-multi-gpu")
    gpus = len(check["machine"]["gpus"])
    if document is None:
        if gpus < 2:
            return f"not run: this machine has {gpus} GPU(s); the multi-GPU tests need 2"
        return "not run (no check-multi-gpu.json in this directory)"
    ran = {nodeid: record for nodeid, record in document["tests"].items()}
    outcomes = Counter(record["outcome"] for record in ran.values())
    devices = sorted({record["device"] for record in ran.values()})
    verdict = "FAILED" if outcomes["failed"] or outcomes["error"] else "passed" if outcomes["passed"] else "nothing ran"
    return (
        f"{verdict}: {outcomes['passed']} passed, {outcomes['failed'] + outcomes['error']} failed, "
        f"{outcomes['skipped']} skipped, of {len(ran)} tests on {', '.join(devices) or 'no device'}"
    )


def _timeline_lines(timeline: Timeline, image: str | None) -> list[str]:
    lines = [f"### Memory timeline: {timeline.device}", ""]
    if image is not None:
        lines += [f"![memory timeline on {timeline.device}]({image})", ""]
    geometry = timeline.geometry
    lines += [
        f"{geometry['layers']} layers x {geometry['capacity_blocks']} blocks of {geometry['bytes_per_block']} bytes "
        f"({geometry['spec']}, {geometry['layout']}); usage read by {timeline.source}, "
        f"{len(timeline.samples)} readings.",
        "",
        "| operation | ms | outside usage (MiB) | physical_bytes (MiB) | blocks | agree |",
        "|---|---|---|---|---|---|",
    ]
    for mark in timeline.marks:
        agree = mark.outside_end == mark.physical_bytes_end and mark.outside_start == mark.physical_bytes_start
        lines.append(
            f"| {mark.operation} | {(mark.end_s - mark.start_s) * 1e3:.1f} | {mark.outside_end / (1 << 20):.1f} | "
            f"{mark.physical_bytes_end / (1 << 20):.1f} | {mark.committed_blocks_end} | {'yes' if agree else '**NO**'} |"
        )
    return lines + [""]


def check_section(check: dict, timelines: list[tuple[Timeline, str | None]], plots_skipped: str | None) -> str:
    """Markdown for the merged `check` (load_check) and each device's timeline
    with its image name (None: not drawn; `plots_skipped` says why)."""
    tests = check["tests"]
    lines = ["## Check", ""]
    lines += [_totals_line(step, document) for step, document in check["steps"].items()]
    lines += ["", "### Invariants per device", ""]
    lines += [
        "Each cell: tests passed / tests run on that device (skipped ones beside). Under xdist each test runs "
        "once, on the GPU of the worker that took it.",
        "",
    ]
    lines += _invariant_table(tests, check["invariants"])
    lines += ["", "### Multi-GPU step", "", _multi_gpu_line(check), ""]
    failures = {nodeid: record for nodeid, record in tests.items() if record["outcome"] in ("failed", "error")}
    lines += ["### Failures", ""]
    lines += [
        f"- `{nodeid}` ({record['device']}, {record['outcome']}): {record['message']}" for nodeid, record in failures.items()
    ] or ["none"]
    for step, document in check["steps"].items():
        lines += [f"- collection error in `{step}`: `{e['nodeid']}`: {e['message']}" for e in document.get("collection_errors", [])]
    reasons = Counter(record["skip_reason"] for record in tests.values() if record["outcome"] == "skipped")
    lines += ["", "### Skips", ""]
    if reasons:
        lines += ["| tests | reason |", "|---|---|"] + [f"| {count} | {reason} |" for reason, count in reasons.most_common()]
    else:
        lines.append("none")
    lines.append("")
    if plots_skipped is not None:
        lines += [f"Plots skipped: {plots_skipped}.", ""]
    if not timelines:
        lines += ["No memory timeline in this directory (conformance/test_timeline.py did not run here).", ""]
    for timeline, image in timelines:
        lines += _timeline_lines(timeline, image)
    return "\n".join(lines)
