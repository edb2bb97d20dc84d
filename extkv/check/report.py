"""The check section of a report: what the conformance suite proved, where.

Theory of operation
-------------------
`extkv check` runs the suite in steps, each a pytest run that leaves one
results file `check*.json` in the run directory (the harness writes them):
the planted defects, the tests that share a device (the host driver's and
each GPU's at once), those that need a device alone, and on a machine of
several GPUs the multi-GPU tests. `check-run.json` (extkv.check.run)
names the steps in order, the paths each was given and the wall time.
`load_check` merges the steps' tests, keyed by nodeid; a nodeid that ran in
two steps (every GPU's step runs every GPU test) is kept once per step, the
later ones as `<nodeid> (<step>)`. A test a signal stopped is `interrupted`,
neither passed nor failed; a run a signal ended (`interrupted` in
check-run.json) has a report even where no step left results.

`check_section` renders the detail below the verdict lines, which head the
report (extkv.report.front, extkv.check.verdict): which invariants
each device kind can prove, per invariant the tests run and passed on each
device, the failures, the skips grouped by reason, test time per file, the
multi-GPU step and the memory timeline of each device, with its plot.
"""

from __future__ import annotations

import shlex
from collections import Counter
from pathlib import Path

from ..runs.portable import portable_command
from ..runs.results import load_step_results
from ..runs.rundir import read_json
from ..testing.invariants import DEVICE_KINDS, INVARIANTS
from ..testing.timeline import Timeline
from .verdict import planted_counts

#: The harness's device label of the host driver (extkv.testing.record.HOST_LABEL).
HOST_LABEL = "host"
#: What `extkv check` writes about the run as a whole.
RUN_FILE = "check-run.json"
#: Results files of check steps.
STEP_GLOB = "check*.json"
#: The step of the multi-GPU tests.
MULTI_GPU_STEP = "check-multi-gpu"
#: The row of the per-device table that counts every test, with or without invariants.
ALL_TESTS_ROW = "all tests"


def load_run(run_dir: Path) -> dict | None:
    """check-run.json of `run_dir`, or None where `extkv check` did not write one."""
    path = Path(run_dir) / RUN_FILE
    if not path.is_file():
        return None
    run = read_json(path)
    for key in ("steps", "targets", "wall_s", "machine", "phases"):
        if not isinstance(run, dict) or key not in run:
            raise ValueError(f"{path}: no {key!r}")
    return run


def load_check(run_dir: Path) -> dict | None:
    """The merged results of every check step in `run_dir`; None when it has
    neither results nor check-run.json.

    Returns {"steps": {step: document}, "tests": {key: record}, "machine": facts,
    "devices": {label: kind}, "worker_gpus": {worker: label}, "invariants": {"1": words, ...},
    "run": check-run.json or None}.
    """
    run_dir = Path(run_dir)
    run = load_run(run_dir)
    paths = {path.stem: path for path in run_dir.glob(STEP_GLOB) if path.name != RUN_FILE}
    order = [step for step in (run["steps"] if run else []) if step in paths] + sorted(set(paths) - set(run["steps"] if run else []))
    steps = {step: load_step_results(paths[step]) for step in order}
    if not steps and run is None:
        return None
    tests: dict[str, dict] = {}
    for step, document in steps.items():
        for nodeid, record in document["tests"].items():
            key = nodeid if nodeid not in tests else f"{nodeid} ({step})"
            tests[key] = {**record, "step": step}
    devices: dict[str, str] = {}
    workers: dict[str, str] = {}
    if run is not None:
        # Every device the run was asked to check, also one whose step left no results.
        devices.update({HOST_LABEL: "host"} | {gpu["label"]: "cuda" for gpu in run["machine"]["gpus"]})
    for step, document in steps.items():
        devices.update(document["devices"])
        pins = Counter(document["worker_gpus"].values())
        if pins:
            workers[step] = ", ".join(f"{count} on {label}" for label, count in pins.items())
    return {
        "steps": steps,
        "tests": tests,
        # The host's step sees no GPU beside GPUs: the run's own facts do.
        "machine": run["machine"] if run else next(iter(steps.values()))["machine"],
        "devices": devices,
        "worker_gpus": workers,
        "invariants": next(iter(steps.values()))["invariants"] if steps else {
            str(number): invariant.words for number, invariant in INVARIANTS.items()
        },
        "run": run,
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
    run = counts["passed"] + counts["failed"] + counts["error"] + counts["interrupted"]
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
        f"{totals['error']} errors, {totals['skipped']} skipped"
        + (f", {totals['interrupted']} interrupted" if totals.get("interrupted") else "")
        + f"; pytest exit status {document['exit_status']}"
        f" (`pytest {shlex.join(portable_command(document.get('arguments', [])))}`)"
    )


def _multi_gpu_line(check: dict) -> str:
    document = check["steps"].get(MULTI_GPU_STEP)
    gpus = len(check["machine"]["gpus"])
    if document is None:
        if gpus < 2:
            return f"not run: this machine has {gpus} GPU(s); the multi-GPU tests need 2"
        return f"not run (no {MULTI_GPU_STEP}.json in this directory)"
    ran = document["tests"]
    outcomes = Counter(record["outcome"] for record in ran.values())
    devices = sorted({record["device"] for record in ran.values()})
    verdict = "FAILED" if outcomes["failed"] or outcomes["error"] else "passed" if outcomes["passed"] else "nothing ran"
    return (
        f"{verdict}: {outcomes['passed']} passed, {outcomes['failed'] + outcomes['error']} failed, "
        f"{outcomes['skipped']} skipped, of {len(ran)} tests on {', '.join(devices) or 'no device'}"
    )


def _capability_table() -> list[str]:
    """Which invariants each kind of device can prove at all, and why not."""
    kinds = list(DEVICE_KINDS.values())
    lines = ["| provable by | " + " | ".join(kind.name for kind in kinds) + " |", "|---|" + "---|" * len(kinds)]
    for number, invariant in INVARIANTS.items():
        cells = [f"no: {kind.cannot[number]}" if number in kind.cannot else "yes" for kind in kinds]
        lines.append(f"| {number}. {invariant.words} | " + " | ".join(cells) + " |")
    return lines


def _file_times(tests: dict[str, dict]) -> list[str]:
    """Test seconds per test file, largest first, with the slowest test of each."""
    seconds: Counter = Counter()
    counts: Counter = Counter()
    slowest: dict[str, tuple[float, str]] = {}
    for key, record in tests.items():
        path = key.split("::")[0]
        seconds[path] += record["duration_s"]
        counts[path] += 1
        if record["duration_s"] > slowest.get(path, (-1.0, ""))[0]:
            slowest[path] = (record["duration_s"], key)
    lines = ["| file | tests | seconds | slowest test (s) |", "|---|---|---|---|"]
    for path, total in seconds.most_common():
        worst, key = slowest[path]
        lines.append(f"| `{path}` | {counts[path]} | {total:.1f} | `{key.split('::', 1)[-1]}` ({worst:.1f}) |")
    return lines


def slowest_tests(tests: dict[str, dict], count: int = 10) -> list[tuple[float, str, str]]:
    """(seconds, key, device) of the `count` slowest tests."""
    ranked = sorted(tests.items(), key=lambda item: -item[1]["duration_s"])[:count]
    return [(record["duration_s"], key, record["device"]) for key, record in ranked]


def _step_wall_lines(run: dict | None) -> list[str]:
    if run is None:
        return []
    lines = [f"- wall time of the whole check: {run['wall_s']:.0f} s"]
    lines += [f"- phase {phase['name']}: {phase['wall_s']:.0f} s" for phase in run["phases"]]
    return lines


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
    # The verdict lines head the report (extkv.report.front); the detail follows here.
    lines = ["## Check", ""]
    caught, planted = planted_counts(check)
    if planted:
        missed = [key for key, r in tests.items() if r["planted_defect"] and r["outcome"] in ("failed", "error")]
        lines += [
            f"The checks caught {caught} of {planted} planted defects (conformance/test_planted_defects.py: "
            "each plants a defect in a broken implementation and passes only when the check under test flags it)"
            + (": missed " + ", ".join(f"`{key}`" for key in missed) if missed else "."),
            "",
        ]
    lines += [_totals_line(step, document) for step, document in check["steps"].items()]
    lines += _step_wall_lines(check["run"])
    lines += ["", "### What each kind of device can prove", ""] + _capability_table()
    lines += ["", "### Invariants per device", ""]
    lines += [
        "Each cell: tests passed / tests run on that device (skipped ones beside). Every GPU runs every GPU "
        "test; the host driver's tests run once.",
        "",
    ]
    lines += _invariant_table(tests, check["invariants"])
    lines += ["", "### Multi-GPU step", "", _multi_gpu_line(check), ""]
    failures = {key: record for key, record in tests.items() if record["outcome"] in ("failed", "error")}
    lines += ["### Failures", ""]
    lines += [
        f"- `{key}` ({record['device']}, {record['outcome']}): {record['message']}" for key, record in failures.items()
    ] or ["none"]
    for step, document in check["steps"].items():
        lines += [f"- collection error in `{step}`: `{e['nodeid']}`: {e['message']}" for e in document["collection_errors"]]
    twice = {key: record for key, record in tests.items() if record.get("second_run")}
    lines += ["", "### Tests run twice", "",
              "A GPU test whose only failure was usage above its baseline by whole steps of the context's own "
              "growth (CUDA loading a kernel's code), extkv's bookkeeping clean, ran once more; the second run "
              "is its outcome.", ""]
    lines += [
        f"- `{key}` ({record['device']}): the first run read {record['second_run']} bytes above its baseline; "
        f"the second {record['outcome']}" for key, record in twice.items()
    ] or ["none"]
    reasons = Counter(record["skip_reason"] for record in tests.values() if record["outcome"] == "skipped")
    lines += ["", "### Skips", ""]
    if reasons:
        lines += ["| tests | reason |", "|---|---|"] + [f"| {count} | {reason} |" for reason, count in reasons.most_common()]
    else:
        lines.append("none")
    lines += ["", "### Test time per file", "", "Seconds summed over the file's tests on every device; "
              "steps and workers run at once, so the wall time above is less.", ""]
    lines += _file_times(tests)
    lines.append("")
    if plots_skipped is not None:
        lines += [f"Plots skipped: {plots_skipped}.", ""]
    if not timelines:
        lines += ["No memory timeline in this directory (conformance/test_timeline.py did not run here).", ""]
    for timeline, image in timelines:
        lines += _timeline_lines(timeline, image)
    return "\n".join(lines)
