"""The bench section of a report: every case as ratios, targets met or missed.

Theory of operation
-------------------
`bench_section(run_dir)` renders what `extkv bench` left in a run directory
(extkv.benchmarking.results) as the Markdown of `summary.md`: how the run
was measured (profile, machine, rounds, clocks, what the driver's probes
answered, every contender in the words its run recorded), the headline
readings at a glance, every target row with its verdict
(extkv.benchmarking.targets), what ran before the rounds of a missed commit
target, the scaling plots (extkv.benchmarking.plots) and every case with
every contender. extkv.report.render_report puts it beside the check and
stress sections.

A run that did not end on its own is partial: its run record
(`bench-run.json`, or a part's own, `bench-run-cases.json`:
extkv.benchmarking.result_files' `record_of`, written by `extkv bench`)
names the signal that ended it, or pytest's exit status where pytest did
not finish (extkv.runs.results' FINISHED_STATUSES). Its section is headed
as partial, says so before any figure, and renders what was measured; the
cases it did not reach read `not run`, their targets `not measured`. A run
without that file (pooled runs, runs of older versions) is read as
complete.

A run that measures nothing worth quoting judges nothing (`not_a_verdict`):
a smoke run (`extkv bench --quick`, profile `quick`: tiny sizes, two
rounds), a run whose rounds `--rounds N` capped (the engine's facts say
`rounds_given`), and a run narrowed by pytest's selection: `-k`, `-m`,
`-x`, ... as the run record has its command, and test paths as the
harness's record of the run says pytest took them
(extkv.runs.results.narrowing). Its section says so before any figure and
shows each ratio alone (extkv.benchmarking.targets.readings_only): no
target met or missed, no count of them.

The shared KV budget's bench (extkv.benchmarking.budget_report) follows
the targets, judged or withheld as the cases are and as the run that
measured it (the engines part's, where it had its own) was selected; a run
that measured no case (`-k budget`) is judged by its own profile.

The section opens with the readings a reader decides on, and ends with how
they were measured; `bench_front` is the short table of the report's front
page (extkv.benchmarking.headline).
"""

from __future__ import annotations

import statistics
from pathlib import Path

from ..runs.results import FINISHED_STATUSES, load_results, narrowing
from .budget_report import budget_section
from .decode_report import decode_section
from .growth_report import growth_section
from .plots import plot
from .result_files import BUDGET_FILE, DECODE_FILE, GROWTH_FILE, record_of
from .results import BenchRun, CaseResult, Entry, carryover, load, ratio, read_json_object
from .sizes import size_label
from .targets import ScalingRow, TargetRow, evaluate, evaluate_scaling, fewest_calls_reason, readings_only

def partial_reason(run_dir: Path, part: str = "cases") -> str | None:
    """Why `part`'s results are partial (`INTERRUPTED by SIGTERM`, `pytest
    ended with exit status 3`); None for a run that ran what it selected or
    recorded no run file."""
    path = Path(run_dir) / record_of(run_dir, part)[0]
    if not path.exists():
        return None
    record = read_json_object(path)
    if record.get("pooled_partial"):
        return "pooled from partial runs (" + "; ".join(record["pooled_partial"]) + ")"
    if record.get("interrupted"):
        return f"INTERRUPTED by {record['interrupted']}"
    if record.get("exit_status") not in FINISHED_STATUSES:
        return f"pytest ended with exit status {record.get('exit_status')}"
    return None


#: Profiles of smoke runs, which prove the pipeline and measure nothing worth quoting.
SMOKE_PROFILES = ("quick",)
def not_a_verdict(run_dir: Path, facts: dict, part: str = "cases") -> str | None:
    """Why the run's figures are readings and no verdict (`profile quick:
    smoke run: ...`, `rounds capped at 3`, `narrowed by -k commit`); None
    for a run that judges its targets."""
    reasons = []
    if facts.get("profile") in SMOKE_PROFILES:
        reasons.append(f"profile {facts['profile']}: {facts.get('profile_what', 'a smoke run')}")
    if facts.get("rounds_given"):
        reasons.append(f"rounds capped at {facts['rounds']}")
    run_name, step = record_of(run_dir, part)
    path, record = Path(run_dir) / run_name, Path(run_dir) / f"{step}.json"
    selected = load_results(record)["selection"]["args"] if record.exists() else None
    narrowed = narrowing(read_json_object(path).get("pytest") or [], selected) if path.exists() else []
    if narrowed:
        reasons.append("narrowed by " + ", ".join(narrowed))
    return "; ".join(reasons) or None


def _pooled_lines(facts: dict) -> list[str]:
    runs = facts.get("pooled_from")
    if not runs:
        return []
    named = ", ".join(f"{run['run']} ({run['elapsed_seconds']:.0f} s)" for run in runs)
    return [f"Pooled (extkv pool): the rounds of {len(runs)} runs of this code, profile and machine, case by "
            f"case, each run's rounds in the order they ran: {named}. The round limits above are per run"
            + (f", as the first run recorded them (the runs' facts differ in {', '.join(facts['pooled_differences'])})"
               if facts["pooled_differences"] else "")
            + "; the earlier and later halves of a case's rounds mostly set one run against the other."]


def _driver_probe_lines(facts: dict) -> list[str]:
    lines = []
    for key, what in (("partial_map", "Maps part of a chunk"), ("partial_access", "Grants access over part of a chunk")):
        probe = facts.get(key)
        if probe:
            answer = {True: "yes", False: "no", None: "not probed"}[probe["supported"]]
            lines.append(f"{what} (probed at the start of the run): {answer} ({probe['how']}).")
    return lines


def _seconds(value: float) -> str:
    if value >= 1:
        return f"{value:.3g} s"
    if value >= 1e-3:
        return f"{value * 1e3:.3g} ms"
    return f"{value * 1e6:.3g} us"


def _times(entry: Entry) -> str:
    return f"{_seconds(min(entry.wall))} / {_seconds(statistics.median(entry.wall))}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _mark(row: TargetRow) -> str:
    """`met`, `MISSED`, `not measured`, or `not judged` in a run that judges nothing."""
    if row.ratio_min is None:
        return "not measured"
    return {True: "met", False: "MISSED", None: "not judged"}[row.met]


def _case_words(case: CaseResult, granularity: int = 0) -> str:
    """"commit lbhnc32 (32 seg) 32GiB recycled"; marked where a segment
    commits less than a granule (see the note in `_facts_lines`)."""
    f = case.facts
    small = " [segments < granule]" if f["smallest_segment_bytes"] < granularity else ""
    return f"{f['op']} {f['geometry']} ({f['segments']} seg) {size_label(f['bytes'])} {f['state']}{small}"


def _contender_lines(run: BenchRun) -> list[str]:
    """What each contender that ran is, in the words its run recorded: a
    floor's words say how it was measured (which memset, which copy)."""
    described = run.facts.get("contenders") or {}
    ran = dict.fromkeys(name for case in run.cases for name in case.facts["contenders"])
    lines = [f"  - *{name}*: {described[name]['what']}" for name in ran if name in described]
    return ["- Contenders:", *lines] if lines else []


def _facts_lines(run: BenchRun) -> list[str]:
    f = run.facts
    device = f["device_description"]
    measured = sum(1 for c in run.cases for _ in c.entries)
    missing = sum(1 for c in run.cases for _ in c.missing)
    lines = [
        f"Profile **{f['profile']}** ({f['profile_what']}) on {device.get('device', f['device'])} "
        f"({device.get('driver', '')}, granularity {device.get('granularity', '?')}), host {f['host']}, torch {f['torch']}.",
        f"{len(run.cases)} cases; {measured} (case, contender) pairs measured, {missing} not. "
        f"Rounds per case <= {f['rounds']} (a case stops adding rounds once it has used {f['case_seconds']:g} s, "
        "at the end of that round, the rounds of its costly peers using none of them; "
        f"{' and '.join(f.get('costly_contenders', ())) or 'the costly peers'} <= {f['costly_rounds']}"
        + (f"; the headline readings ({f['headline_readings']}) "
           f"<= {f['headline_rounds']} rounds within {f['headline_case_seconds']:g} s"
           + (f", the 8-step growths among them <= {f['growth_headline_rounds']} rounds within "
              f"{f['growth_headline_case_seconds']:g} s" if f.get("growth_headline_rounds") else "")
           + ", their least round being what a verdict reads"
           if f.get("headline_rounds") else "")
        + (f"; cases of at most {size_label(f['small_case_bytes'])} >= {f['small_case_rounds']} rounds, "
           "within their seconds" if f.get("small_case_rounds") else "")
        + "); "
        f"measuring took {f['elapsed_seconds']:.0f} s of a "
        f"{f['budget_seconds']:.0f} s budget.",
        *_pooled_lines(f),
        "Clocks: " + "; at the end: ".join(dict.fromkeys(f["clocks"])) + ".",
        *_driver_probe_lines(f),
        "",
        *_contender_lines(run),
        "- Contenders of a case run interleaved, one round each per round, in the orders of a Williams design, so "
        "each meets the driver state every other one leaves equally often (a plain rotation would give each the same "
        "predecessor every round); each round is setup (untimed), the operation up to a device synchronize (timed), "
        "teardown that gives the memory back (untimed).",
        "- *recycled*: memory a previous round released. *fresh*: a new process per case, each contender once, all "
        "keeping their memory until the last has run, so each meets never-used memory.",
        f"- Host CPU time: {f['cpu_time']}.",
        "- ratio = extkv / contender, minimum over rounds of each (min) and median of each (median); verdicts use the "
        "minima. A peer in another process is compared through the case's pivot measured in both processes: "
        "(extkv / pivot here) / (peer / pivot there).",
        "- *[segments < granule]*: a segment commits less than one granule. The raw sequence (one chunk per segment) "
        "starts every segment on a granule of its own, so it maps more bytes than extkv, whose neighbouring segments "
        "share granules; a defragment there may have nothing to move. Such cases occur only at the host and smoke "
        "sizes.",
    ]
    if run.bench_json_problem:
        lines.append(f"- **{run.bench_json_problem}**")
    return lines


def _targets_table(rows: list[TargetRow], granularity: int, judged: bool) -> list[str]:
    lines = ["| target | case | extkv (min / median) | against (min / median) | rounds | ratio min | ratio median | "
             f"bound | {'verdict' if judged else 'reading, not a verdict'} |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        subject, baseline = row.case.entries.get(row.target.subject), row.case.entries.get(row.target.baseline)
        rounds = " / ".join(dict.fromkeys(str(len(entry.wall)) for entry in (subject, baseline) if entry)) or "-"
        lines.append(
            f"| {row.target.name} | {_case_words(row.case, granularity)} | {_times(subject) if subject else '-'} | "
            f"{(row.target.baseline + ' ' + _times(baseline)) if baseline else row.target.baseline + ' -'} | "
            f"{rounds} | {_ratio(row.ratio_min)} | {_ratio(row.ratio_median)} | {row.target.bound_words()} | "
            f"{row.words} |"
        )
    stated = dict.fromkeys(row.target for row in rows)
    return lines + [""] + [f"- *{target.name}*: {target.what}." for target in stated]


#: Heading of the headline readings, and their rows: (words, target, operation, memory).
_HEADLINE_HEADING = ("Commit against the raw driver and memset, defragment against create + copy "
                     "(headline size, ratio of minima)")
_HEADLINE_ROWS = [
    ("one commit against the raw sequence, fresh memory", "commit-raw", "commit", "fresh"),
    ("one commit against the raw sequence, recycled memory", "commit-raw", "commit", "recycled"),
    ("8 commits against the raw sequence", "commit-raw", "grow8", "recycled"),
    ("recommit against the raw sequence", "commit-raw", "recommit", "recycled"),
    ("one commit against memset (segments >= 512 MiB)", "commit-memset", "commit", "recycled"),
    ("8 commits against memset (segments >= 512 MiB)", "commit-memset", "grow8", "recycled"),
    ("preserving defragment against create + copy", "defrag-create-copy", "defrag_preserve", "recycled"),
]


def _headline_table(run: BenchRun, rows: list[TargetRow], scaling: list[ScalingRow]) -> list[str]:
    """The headline readings, one row each, a column per headline geometry;
    the scaling readings below."""
    geometries = [g for g in ("blhnc1", "lbhnc32", "lhbnc256") if any(c.facts["geometry"] == g for c in run.cases)]
    headline = run.facts.get("headline_bytes")
    header = "| reading | " + " | ".join(f"{g} ({_segments(run, g)} seg)" for g in geometries) + " |"
    lines = [header, "|---|" + "---|" * len(geometries)]
    for words, key, op, state in _HEADLINE_ROWS:
        cells = []
        for geometry in geometries:
            found = [
                r for r in rows
                if r.target.key == key and r.case.facts["op"] == op and r.case.facts["geometry"] == geometry
                and r.case.facts["state"] == state and (headline is None or r.case.facts["bytes"] == headline)
            ]
            if not found or found[0].ratio_min is None:
                cells.append("n/a")
                continue
            shown = found[0].target.shown
            alone = "" if found[0].raw_alone is None else f"; raw alone {shown(found[0].raw_alone)}"
            split = "" if found[0].split is None else f"; halves {' / '.join(map(shown, found[0].split))}"
            if found[0].split_in_time is not None:
                split += f"; earlier / later {' / '.join(map(shown, found[0].split_in_time))}"
            # A run that judges nothing shows the ratio alone (its rows have no halves nor raw alone).
            judged = "" if found[0].met is None else f" ({_mark(found[0])}{alone}{split})"
            cells.append(f"{shown(found[0].ratio_min)}{judged}")
        lines.append(f"| {words} | " + " | ".join(cells) + " |")
    lines.append("")
    if any(row.raw_alone is not None for row in rows):
        fewest_calls = fewest_calls_reason(run)
        lines.append("- *raw alone*: where extkv misses a bound, the raw sequence's own ratio to the same baseline: "
                     "what the driver's calls alone cost. Where that misses the bound too, the calls the driver "
                     "requires miss it whoever makes them."
                     + (f" The raw sequence makes the fewest calls the geometry allows: {fewest_calls}."
                        if fewest_calls else ""))
    if any(row.split is not None for row in rows):
        lines.append("- *halves*: the same ratio over the even-numbered and over the odd-numbered rounds alone, where "
                     "one half meets the bound and the other does not: the verdict rests on a round or two.")
    if any(row.split_in_time is not None for row in rows):
        lines.append("- *earlier / later*: the same ratio over the first and over the second half of the rounds alone, "
                     "where one half meets the bound and the other does not: the verdict rests on a stretch of rounds "
                     "in a row, which met a state of the machine the other half did not.")
    for row in scaling:
        sizes = (
            f"{_case_words(row.near)} -> {_case_words(row.far)}" if row.near is not None and row.far is not None else ""
        )
        lines.append(f"- {row.target.what}: **{row.words}** (bound <= {row.target.bound:g}x; {sizes})")
    if run.facts["device"] == "cpu":
        lines.append("- On the host driver the CPU zeroes the memory itself, so its CPU time grows with the bytes by "
                     "nature; these readings are for a GPU run, where zeroing is the device's work.")
    return lines


def _carryover_lines(rows: list[TargetRow], granularity: int) -> list[str]:
    """For each missed commit against the raw sequence, extkv's and the raw
    sequence's least round by whose round ran one and two before it."""
    missed = [row for row in rows if row.target.key == "commit-raw" and row.met is False and row.case.facts["order"]]
    if not missed:
        return []
    names = list(dict.fromkeys(name for row in missed for name in row.case.facts["order"]))
    lines = [f"### What ran before each missed {missed[0].target.name}", "",
             "A release leaves driver state behind that outlasts the allocations after it, so a round's time depends "
             "on whose rounds ran before it (each gave its memory back at its end). Least wall time of the rounds "
             "whose predecessor one (lag 1) or two (lag 2) rounds before was each contender, and how many rounds.", "",
             "| case | contender | lag | " + " | ".join(f"after {name}" for name in names) + " |",
             "|---|---|---|" + "---|" * len(names)]
    for row in missed:
        for lag in (1, 2):
            by = carryover(row.case, lag)
            for name in ("extkv", "raw"):
                cells = [f"{_seconds(min(by[name][before]))} ({len(by[name][before])})"
                         if before in by.get(name, {}) else "-" for before in names]
                lines.append(f"| {_case_words(row.case, granularity)} | {name} | {lag} | " + " | ".join(cells) + " |")
    return lines + [""]


def _segments(run: BenchRun, geometry: str) -> int:
    return next(c.facts["segments"] for c in run.cases if c.facts["geometry"] == geometry)


def _every_case_table(run: BenchRun, rows: list[TargetRow]) -> list[str]:
    granularity = run.facts["granularity"]
    verdicts: dict[tuple[str, str], list[str]] = {}
    for row in rows:
        # On the row of the contender the target compares extkv with.
        where = row.target.baseline if row.target.subject == "extkv" else row.target.subject
        verdicts.setdefault((row.case.id, where), []).append(f"{row.target.name}: {_mark(row)}")
    lines = []
    for op in dict.fromkeys(c.facts["op"] for c in run.cases):
        cases = [c for c in run.cases if c.facts["op"] == op]
        lines += ["", f"#### {op}: {cases[0].facts['op_what']}", "",
                  "| case | contender | wall min / median | CPU min | extkv / this (min / median) | targets |",
                  "|---|---|---|---|---|---|"]
        for case in cases:
            per_commit = case.facts["commits"] if case.facts["op"] == "per_block" else 1
            for name in case.facts["contenders"]:
                entry = case.entries.get(name)
                if entry is None:
                    status, reason = case.missing.get(name, ("not run", ""))
                    lines.append(f"| {_case_words(case, granularity)} | {name} | {status}: {reason} | | | |")
                    continue
                times = _times(entry)
                if per_commit > 1:
                    times += f" (per commit {_seconds(min(entry.wall) / per_commit)})"
                # extkv_grown's row compares it with extkv (the replay target).
                subject, against = ("extkv_grown", "extkv") if name == "extkv_grown" else ("extkv", name)
                ratios = "" if name == "extkv" else (
                    f"{_ratio(ratio(case, subject, against, 'min'))} / {_ratio(ratio(case, subject, against, 'median'))}"
                    + (" (extkv_grown / extkv)" if subject == "extkv_grown" else "")
                )
                lines.append(
                    f"| {_case_words(case, granularity)} | {name} | {times} | {_seconds(min(entry.cpu))} | {ratios} | "
                    f"{', '.join(verdicts.get((case.id, name), []))} |"
                )
    return lines


def judged_rows(run_dir: Path, run: BenchRun) -> tuple[list[TargetRow], list[ScalingRow], str | None]:
    """The run's target and scaling rows, and why they judge nothing (then
    readings only), or None where they judge."""
    rows, scaling = evaluate(run), evaluate_scaling(run)
    withheld = not_a_verdict(run_dir, run.facts)
    if withheld is not None:
        rows, scaling = readings_only(rows, scaling)
    return rows, scaling, withheld


def target_counts(rows: list[TargetRow]) -> str:
    """`54 met, 25 missed, 3 not measured`."""
    met = sum(1 for row in rows if row.met)
    missed = sum(1 for row in rows if row.met is False)
    return f"{met} met, {missed} missed, {len(rows) - met - missed} not measured"


def budget_result(run_dir: Path, run: BenchRun | None) -> tuple[dict, str | None] | None:
    """The shared budget's bench result in `run_dir` and why it judges
    nothing (None: it judges), as `run`'s cases are judged, or, where no
    case was measured, by its own profile; None where it did not run."""
    path = Path(run_dir) / BUDGET_FILE
    if not path.exists():
        return None
    result = read_json_object(path)
    facts = run.facts if run is not None else {"profile": result["profile"]}
    return result, not_a_verdict(Path(run_dir), facts, "engines")


def bench_section(run_dir: Path) -> str | None:
    """Markdown for the bench results in `run_dir` (plots written beside it), or None when there are none."""
    run = load(Path(run_dir))
    budget = budget_result(Path(run_dir), run)
    budget_lines = budget_section(*budget) if budget is not None else []
    decode_lines = _decode_lines(Path(run_dir))
    partial = partial_reason(Path(run_dir))
    heading = "## Benchmarks" + (f" ({partial}: partial results)" if partial else "")
    if run is None:
        if partial:
            return "\n".join([heading, "", f"**{partial} before any case's results were written: nothing "
                               "measured.**", "", *budget_lines, *decode_lines])
        found = budget_lines + decode_lines
        return "\n".join([heading, "", *found]) if found else None
    rows, scaling, withheld = judged_rows(Path(run_dir), run)
    tag = " (partial)" if partial else ""
    counts = "readings only, not a verdict" if withheld else target_counts(rows)
    lines = [heading, "", *_partial_lines(run, partial), *_withheld_lines(withheld),
             f"### {_HEADLINE_HEADING}{tag}", "", *_headline_table(run, rows, scaling), "",
             f"### Targets ({'partial: ' if partial else ''}{counts})", "",
             *_targets_table(rows, run.facts["granularity"], withheld is None), "", *budget_lines,
             *_carryover_lines(rows, run.facts["granularity"])]
    paths, why_not = plot(run, run_dir)
    lines += [f"### Scaling{tag}", ""]
    lines += [f"![{path.stem}]({path.name})" for path in paths] + ([why_not] if why_not else [])
    lines += ["", f"### Every case{tag}", *_every_case_table(run, rows), "", *decode_lines]
    lines += ["", "### How it was measured", "", *_facts_lines(run)]
    return "\n".join(lines)


def _withheld_lines(withheld: str | None) -> list[str]:
    """What the figures of a run that judges nothing are, before any of them."""
    if withheld is None:
        return []
    return [f"**Not a verdict: {withheld}.** The figures below are readings only; no target is judged by them.", ""]


def _partial_lines(run: BenchRun, partial: str | None) -> list[str]:
    """What a partial run's figures are, before any of them."""
    if partial is None:
        return []
    reached = sum(1 for case in run.cases if case.entries)
    return [f"**{partial} before every case was measured: partial results, not a complete run.** "
            f"Cases with a contender measured: {reached} of {len(run.cases)}; a case the run did not reach reads "
            "*not run*, and a target on it *not measured*. The figures are of the rounds measured before the end.",
            ""]


def _decode_lines(run_dir: Path) -> list[str]:
    """The sections of the decode and growth-loop benches, where the run has their results."""
    lines = []
    for name, render in ((DECODE_FILE, decode_section), (GROWTH_FILE, growth_section)):
        path = run_dir / name
        if path.exists():
            lines += render(read_json_object(path))
    return lines
