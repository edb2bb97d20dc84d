"""The shared KV budget's bench as Markdown: its readings against their targets.

Theory of operation
-------------------
extkv.benchmarking.budget_bench measures a grant's round trip, the cost
the budget adds to a commit and a reclaim from an idle engine, and leaves
one JSON object per run, with extkv.benchmarking.budget_bursts' two
engines in alternating bursts under "bursts"; extkv.benchmarking.targets
judges each reading (`evaluate_budget`). `budget_section` writes the bench section's part: how
it was measured, then a row per reading with its figure, the median beside
it, the bound and the verdict, and what the figure is made of.
`budget_front` is its short table for the report's front page. A run that
judges nothing (extkv.benchmarking.report's `not_a_verdict`: a smoke run,
a narrowed one) shows each reading alone, headed as not a verdict. Only
the JSON is read, so a report renders it without importing torch.
"""

from __future__ import annotations

from .targets import BUDGET_TARGETS, BudgetRow, budget_readings_only, byte_words, evaluate_budget

HEADING = "### The shared KV budget"


def budget_rows(result: dict, judged: bool) -> list[BudgetRow]:
    """The rows of `result`, readings only unless `judged`."""
    rows = evaluate_budget(result)
    return rows if judged else budget_readings_only(rows)


def budget_counts(rows: list[BudgetRow]) -> str:
    """`2 met, 1 missed` (and how many were not measured)."""
    met = sum(1 for row in rows if row.met)
    missed = sum(1 for row in rows if row.met is False)
    absent = sum(1 for row in rows if row.value is None)
    return f"{met} met, {missed} missed" + (f", {absent} not measured" if absent else "")


def _value(row: BudgetRow, value: float | None) -> str:
    return "-" if value is None else row.target.shown(value)


def _mark(row: BudgetRow) -> str:
    """`met`, `MISSED`, `not measured`, or `not judged` (a run that judges
    nothing, a commit below the target's size)."""
    if row.value is None:
        return "not measured"
    return {True: "met", False: "MISSED", None: "not judged"}[row.met]


def bursts_words(bursts: dict | None) -> str:
    """How the two engines' bursts were run, for the section's paragraph
    ("" for a result without them)."""
    if not bursts:
        return ""
    s = bursts["setting"]
    floors = ", ".join(f"{name} {byte_words(floor)}" for name, floor in bursts["floors"].items())
    return (f" Bursts: two engine processes, caches of {bursts['geometry_what']}, alternate {s['bursts']} bursts "
            f"(A, B, ...) in each of {s['rounds']} rounds, budgeted and static in Williams-design order; a step "
            f"appends {s['step_blocks']} block(s) of KV, writes and reads them back and runs {s['work_matmuls']} "
            f"products of a {s['work_dim']}-square {s['work_dtype']} weight. Budgeted: a budget of "
            f"{byte_words(bursts['budget_bytes'])}, floors {floors}; the busy engine grows through commit-ahead "
            f"({s['ahead_blocks']} blocks ahead in steps of {s['ahead_step_blocks']}) until the budget denies a "
            f"step's commit (a growth step: at most {byte_words(bursts['growth_bytes'])}), the idle one gives back "
            f"all above its floor when asked. Static: each holds {byte_words(bursts['static_bytes'])}, committed up "
            f"front. "
            f"p99 over each burst's first {bursts['compared_steps']} steps, those a static half takes too; outside "
            f"sums every 10 ms ({bursts['outside']}).")


def budget_section(result: dict, withheld: str | None) -> list[str]:
    """Markdown lines for a result of `budget_bench.run`; `withheld`: why
    the run judges nothing (None: it judges)."""
    rows = budget_rows(result, withheld is None)
    s = result["setting"]
    counts = "readings only, not a verdict" if withheld else budget_counts(rows)
    lines = [
        f"{HEADING} ({counts})",
        "",
        *([f"**Not a verdict: {withheld}.** Readings only; no target is judged by them.", ""] if withheld else []),
        f"Profile {result['profile']} on {result['device']} (torch {result['torch']}), the budget daemon serving "
        f"{result['daemon_device']} from a process of its own; caches of {result['geometry_what']}. Grant round trip: "
        f"reserve + confirm of one granule, {s['grant_rounds']} rounds of {s['grant_samples']}. Commit: `commit(N)` "
        f"on a cache just made, to the device's synchronize, budgeted"
        + (", on its footprint granted ahead" if any("ahead_s" in commit for commit in result["commits"]) else "")
        + f" and unbudgeted in Williams-design order over {s['commit_rounds']} rounds. "
        f"Reclaim: the budget exactly what an idle engine (a process of its own) holds; "
        f"a busy engine with that floor reserves it all, and the idle engine's `on_reclaim` shrinks to nothing; "
        f"interleaved over {s['reclaim_rounds']} rounds with the same shrink of an unbudgeted cache alone."
        + bursts_words(result.get("bursts")),
        "",
        "| reading | size | value | median | bound | verdict | made of |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| {row.target.name} | {row.label} | {_value(row, row.value)} | {_value(row, row.median)} | "
                     f"{row.target.bound_words()} | {row.words} | {row.parts} |")
    shown = {row.target.key for row in rows}
    lines += ["", *(f"- *{target.name}*: {target.what}." for target in BUDGET_TARGETS if target.key in shown), ""]
    return lines


def budget_front(result: dict, withheld: str | None) -> list[str]:
    """The front page's lines for the budget's bench."""
    rows = budget_rows(result, withheld is None)
    head = ("**Shared KV budget: not a verdict.** Readings only" if withheld
            else f"**Shared KV budget: targets {budget_counts(rows)}**")
    lines = [f"{head} (profile {result['profile']} on {result['device']}):", "",
             "| reading | size | value | bound | verdict |", "|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row.target.name} | {row.label} | {_value(row, row.value)} | {row.target.bound_words()} | "
                     f"{_mark(row)} |")
    return lines
