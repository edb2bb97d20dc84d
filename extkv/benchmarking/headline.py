"""The benchmarks on a report's front page: extkv against each contender, in one short table.

Theory of operation
-------------------
A reader deciding whether to turn extkv on asks what it costs against the
floors (the raw driver sequence, memset) and against the other designs
(torch_memory_saver, torch's expandable segments, one handle per granule as
kvcached and vAttention map pages, allocate + copy, one up-front
allocation). `bench_front` answers in a table of `FRONT_ROWS`, one row per
(contender, operation): extkv's time over the contender's, least round of
each, at the headline size on each headline geometry, the bound where a
target states one (extkv.benchmarking.targets), and the target's met and
missed over every size the run measured. A row without a target shows its
ratios only. A run that judges nothing (extkv.benchmarking.report's
`not_a_verdict`) shows the ratios alone, headed as not a verdict. Every
figure is the bench section's (extkv.benchmarking.report), which follows
with the method and every case. Below the table, the shared KV budget's
readings and verdicts, where its bench ran (extkv.benchmarking.budget_report).
"""

from __future__ import annotations

from pathlib import Path

from .budget_report import budget_front
from .report import budget_result, judged_rows, partial_reason, target_counts
from .results import BenchRun, load, ratio
from .sizes import size_label
from .targets import TARGETS, TargetRow

#: Geometries of the headline columns, in order.
HEADLINE_GEOMETRIES = ("blhnc1", "lbhnc32", "lhbnc256")

#: (contender in a reader's words, operation in a reader's words, target key
#: or None, contender, operation). Of a target, its subject and baseline;
#: of none, extkv over the contender.
FRONT_ROWS = [
    ("raw driver sequence", "commit", "commit-raw", "raw", "commit"),
    ("raw driver sequence", "8-step growth", "commit-raw", "raw", "grow8"),
    ("raw driver sequence", "recommit after release", "commit-raw", "raw", "recommit"),
    ("raw unmap + release", "release", "release-raw", "raw", "release"),
    ("raw create + device copy", "preserving defragment", "defrag-create-copy", "raw", "defrag_preserve"),
    ("memset (the zeroing floor)", "commit", "commit-memset", "memset", "commit"),
    ("memset (the zeroing floor)", "8-step growth", "commit-memset", "memset", "grow8"),
    ("torch_memory_saver", "release (pause)", "release-tms", "tms", "release"),
    ("torch_memory_saver", "recommit (resume + zero)", None, "tms", "recommit"),
    ("torch expandable_segments", "8-step growth", "growth-expandable", "expandable", "grow8"),
    ("one handle per 2 MiB granule (kvcached, vAttention)", "8-step growth", "growth-granule", "per_granule", "grow8"),
    ("allocate + copy", "8-step growth", None, "allocate_copy", "grow8"),
    ("one up-front allocation", "commit", None, "upfront", "commit"),
    ("extkv before growth", "CUDA graph replay after growth", "replay-unchanged", "extkv", "replay"),
]


def _headline_case(run: BenchRun, op: str, geometry: str):
    headline = run.facts.get("headline_bytes")
    return next((case for case in run.cases if case.facts["op"] == op and case.facts["geometry"] == geometry
                 and case.facts["state"] == "recycled" and (headline is None or case.facts["bytes"] == headline)), None)


def _cell(run: BenchRun, rows: list[TargetRow], key: str | None, contender: str, op: str, geometry: str) -> str:
    case = _headline_case(run, op, geometry)
    if case is None or contender not in case.facts["contenders"]:
        return "-"
    if key is None:
        value = ratio(case, "extkv", contender, "min")
        return "not run" if value is None else f"{value:.2f}x"
    row = next((row for row in rows if row.target.key == key and row.case is case), None)
    if row is None:
        # A case the target does not apply to (memset's, where a segment commits under 512 MiB).
        value = ratio(case, "extkv", contender, "min")
        return "not run" if value is None else f"({value:.2f}x)"
    if row.ratio_min is None:
        return "not run"
    shown = row.target.shown(row.ratio_min)
    return shown if row.met is not False else f"**{shown}**"


def _verdict(rows: list[TargetRow], key: str | None, op: str) -> str:
    """Met and missed of target `key` on `op` over every size; why not measured where none was."""
    if key is None:
        return "no target"
    mine = [row for row in rows if row.target.key == key and row.case.facts["op"] == op]
    if not mine:
        return "-"
    measured = [row for row in mine if row.ratio_min is not None]
    if not measured:
        # `not measured (tms: torch_memory_saver is not importable here: ModuleNotFoundError: ...; extkv: ...)`:
        # the first reason, to its first clause's end.
        reason = mine[0].words.removeprefix("not measured (").removesuffix(")").split("; ")[0]
        return "not measured (" + ": ".join(reason.split(": ")[:2]) + ")"
    if all(row.met is None for row in measured):
        return "not judged"
    met = sum(1 for row in measured if row.met)
    words = f"{met} met" + (f", **{len(measured) - met} missed**" if len(measured) > met else "")
    return words + (f", {len(mine) - len(measured)} not measured" if len(mine) > len(measured) else "")


def front_table(run: BenchRun, rows: list[TargetRow], judged: bool) -> list[str]:
    """The table of `FRONT_ROWS` for `run`'s rows (readings only unless `judged`)."""
    geometries = [g for g in HEADLINE_GEOMETRIES if any(c.facts["geometry"] == g for c in run.cases)]
    segments = {c.facts["geometry"]: c.facts["segments"] for c in run.cases}
    bounds = {target.key: target.bound_words() for target in TARGETS}
    header = ["extkv against", "operation", "bound", *(f"{segments[g]} seg" for g in geometries)]
    header += ["verdict, every size"] if judged else []
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for who, what, key, contender, op in FRONT_ROWS:
        cells = [_cell(run, rows, key, contender, op, geometry) for geometry in geometries]
        if all(cell == "-" for cell in cells) and not any(r.target.key == key and r.case.facts["op"] == op for r in rows):
            continue  # neither a headline case nor a target of it in this run
        row = [who, what, bounds[key] if key else "-", *cells] + ([_verdict(rows, key, op)] if judged else [])
        lines.append("| " + " | ".join(row) + " |")
    return lines


def bench_front(run_dir: Path) -> list[str] | None:
    """The front page's bench lines for `run_dir`, or None where it has no bench results."""
    run = load(Path(run_dir))
    budget = budget_result(Path(run_dir), run)
    budget_lines = budget_front(*budget) if budget is not None else []
    partial = partial_reason(Path(run_dir))
    if run is None:
        if not budget_lines:
            return None
        return [f"**{partial}: partial results.** " + budget_lines[0], *budget_lines[1:]] if partial else budget_lines
    rows, scaling, withheld = judged_rows(Path(run_dir), run)
    facts = run.facts
    device = facts.get("device_description", {}).get("device", facts.get("device", "?"))
    where = f"profile {facts['profile']} on {device}, headline {size_label(facts['headline_bytes'])}" \
        if facts.get("headline_bytes") else f"profile {facts['profile']} on {device}"
    if withheld is not None:
        lines = [f"**Benchmarks: not a verdict: {withheld}.** Readings only ({where}):"]
    else:
        scaled = [row for row in scaling if row.met is not None]
        lines = [f"**Benchmarks: targets {target_counts(rows)}**"
                 + (f"; scaling readings {sum(r.met for r in scaled)} met of {len(scaled)}" if scaled else "")
                 + f" ({where})."]
    if partial:
        lines[0] = f"**{partial}: partial results.** " + lines[0]
    lines += ["", "extkv's time over the contender's, least round of each, at the headline size; a column per "
              "geometry (segments per commit); in parentheses where the target does not apply to the case"
              + ("; the verdict counts every size measured." if withheld is None else "."), ""]
    return lines + front_table(run, rows, judged=withheld is None) + ([""] + budget_lines if budget_lines else [])
