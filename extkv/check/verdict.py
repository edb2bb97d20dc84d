"""What a check run certified: one verdict per device, and the run's.

Theory of operation
-------------------
A device is CERTIFIED when every invariant its kind can prove
(extkv.testing.invariants.DEVICE_KINDS) has at least one passing test on it
and no test on it failed. The run is CERTIFIED when every device it was
asked to check is, nothing failed anywhere else (the multi-GPU step, a
planted defect the checks missed, a collection error, a step that pytest
could not finish), and the suite ran whole: a run narrowed by `-k`, `-m`,
paths, `--deselect`, `--lf` or stopped early by `-x` certifies nothing, and
says so: its device lines are their counts alone, judging no device. A test that errs in setup or teardown is failed like one that errs
in its body. A test a signal stopped is `interrupted`, counted apart from
the failures (the code under test did not fail), and certifies nothing: nor
does its device, its step (pytest's exit status 2) or a run that a signal
ended (`interrupted` in check-run.json), whose last line says so. `extkv check` prints these lines last and exits 0 only on a
CERTIFIED run; the report's front page shows the same lines, the run's
first (`front_lines`).

The shared KV budget has a line of its own beside the devices' and the
planted defects' (`budget_proofs`): each of its proofs
(extkv.testing.invariants.BUDGET_PROOFS) is proven when a test carrying
it (`budget_proof`) passed, none failed or was interrupted, and a planted
defect of it was caught with none missed; a proof short of that reads NOT
PROVEN and the run is not certified. Results written before tests carried
the proof (no `budget_proof` in their records) have no such line.

Everything here reads the merged results (extkv.check.report.load_check)
and `check-run.json` (what `extkv check` ran: the steps and their targets,
the wall time); nothing is measured here.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ..runs.results import FINISHED_STATUSES, INTERRUPTED_STATUS
from ..testing.invariants import BUDGET_PROOFS, DEVICE_KINDS, number_ranges
from .features import feature_lines

#: Options that narrow what a pytest run selects or stop it early, as the
#: harness records them (`selection` in each results file).
NARROWING = {
    "keyword": "-k", "markexpr": "-m", "deselect": "--deselect", "ignore": "--ignore",
    "ignore_glob": "--ignore-glob", "lf": "--lf", "stepwise": "--sw", "maxfail": "-x/--maxfail",
}


@dataclass
class DeviceVerdict:
    label: str                 # the harness's device label: `host`, `GPU 0 (NVIDIA H200)`
    name: str                  # how the verdict names it: `cuda:0 NVIDIA H200 (driver ..., torch ...)`
    kind: str                  # the driver kind: host, cuda
    counts: Counter = field(default_factory=Counter)
    proven: list[int] = field(default_factory=list)
    unproven: list[int] = field(default_factory=list)     # provable here, but no test of it passed
    cannot: dict[int, str] = field(default_factory=dict)  # not provable on this kind, and why
    failed: list[str] = field(default_factory=list)
    failed_invariants: set[int] = field(default_factory=set)

    @property
    def certified(self) -> bool:
        return not self.failed and not self.counts["interrupted"] and not self.unproven and self.counts["passed"] > 0

    def problems(self) -> list[str]:
        """Why this device is not certified; [] when it is."""
        found = []
        if self.failed:
            found.append(f"{len(self.failed)} failed" + (f" (invariants {number_ranges(self.failed_invariants)})"
                                                         if self.failed_invariants else ""))
        if self.counts["interrupted"]:
            found.append(f"{self.counts['interrupted']} interrupted")
        if self.unproven:
            plural = "s" if len(self.unproven) > 1 else ""
            found.append(f"invariant{plural} {number_ranges(self.unproven)} ran no passing test")
        if not self.counts["passed"] and not self.unproven:
            found.append("no test passed")
        return found

    def reading(self) -> str:
        """The device's counts alone, for a run that judges nothing."""
        failed = len(self.failed)
        return (f"{self.name}: {self.counts['passed']} passed" + (f", {failed} failed" if failed else "")
                + (f", {self.counts['interrupted']} interrupted" if self.counts["interrupted"] else "")
                + f", {self.counts['skipped']} skipped")

    def line(self) -> str:
        counts = f"{self.counts['passed']} passed, {self.counts['skipped']} skipped"
        if self.certified:
            return f"{self.name}: invariants {number_ranges(self.proven)} proven{_cannot(self.cannot)}; {counts}"
        return f"{self.name}: NOT CERTIFIED: {', '.join(self.problems())}; {counts}"


def _cannot(cannot: dict[int, str]) -> str:
    if not cannot:
        return ""
    return " (" + "; ".join(f"{number} {reason}" for number, reason in sorted(cannot.items())) + ")"


def device_name(label: str, kind: str, facts: dict) -> str:
    """`host driver (Linux 6.18, memfd)`, `cuda:0 NVIDIA H200 (driver 580.159.04, torch 2.11.0+cu130)`."""
    if kind == "host":
        return f"{DEVICE_KINDS['host'].name} ({facts['host_driver']}, memfd)"
    for gpu in facts["gpus"]:
        if gpu["label"] == label:
            return f"cuda:{gpu['index']} {gpu['name']} (driver {gpu['driver']}, torch {facts['torch']})"
    return label


def device_verdicts(check: dict) -> list[DeviceVerdict]:
    """One verdict per device the run was asked to check (check["devices"])."""
    verdicts = {}
    for label, kind in check["devices"].items():
        cannot = DEVICE_KINDS[kind].cannot
        verdicts[label] = DeviceVerdict(label, device_name(label, kind, check["machine"]), kind, cannot=dict(cannot))
    passed_invariants: dict[str, set[int]] = {label: set() for label in verdicts}
    for key, record in check["tests"].items():
        verdict = verdicts.get(record["device"])
        if verdict is None:
            continue
        verdict.counts[record["outcome"]] += 1
        if record["outcome"] in ("failed", "error"):
            verdict.failed.append(key)
            verdict.failed_invariants.update(record["invariants"])
        elif record["outcome"] == "passed":
            passed_invariants[record["device"]].update(record["invariants"])
    for label, verdict in verdicts.items():
        provable = DEVICE_KINDS[verdict.kind].provable
        verdict.proven = [n for n in provable if n in passed_invariants[label]]
        verdict.unproven = [n for n in provable if n not in passed_invariants[label]]
    return list(verdicts.values())


def narrowed_by(check: dict, targets: dict[str, list[str]] | None) -> list[str]:
    """What narrowed the run (`-k sizing`, `path conformance/test_cache.py`); [] for a whole run.
    `targets`: per step, the paths `extkv check` itself gave it."""
    found = []
    for step, document in check["steps"].items():
        selection = document["selection"]
        for key, flag in NARROWING.items():
            value = selection.get(key)
            if value and f"{flag} {value}" not in found:
                found.append(flag if value is True else f"{flag} {value}")
        own = set((targets or {}).get(step, selection["args"]))
        for path in selection["args"]:
            if path not in own and f"path {path}" not in found:
                found.append(f"path {path}")
    return found


def other_failures(check: dict, verdicts: list[DeviceVerdict], run: dict | None = None) -> list[str]:
    """Failures no device verdict holds: tests on devices outside the verdicts
    (the multi-GPU step), collection errors, steps pytest did not finish or
    that left no results at all."""
    mine = {key for verdict in verdicts for key in verdict.failed}
    problems = [
        f"{record['device']}: {key} {record['outcome']}"
        for key, record in check["tests"].items()
        if record["outcome"] in ("failed", "error") and key not in mine
    ]
    for step, document in check["steps"].items():
        problems += [f"{step}: collection error in {error['nodeid']}" for error in document["collection_errors"]]
        if document["exit_status"] == INTERRUPTED_STATUS:
            problems.append(f"{step}: interrupted (pytest exit status {INTERRUPTED_STATUS})")
        elif document["exit_status"] not in FINISHED_STATUSES:
            problems.append(f"{step}: pytest ended with exit status {document['exit_status']}")
    if run is not None:
        problems += [f"{step}: left no results (see {step}.log)" for step in run["steps"] if step not in check["steps"]]
    return problems


def planted_counts(check: dict) -> tuple[int, int]:
    """(caught, planted): planted-defect tests that passed, of those that ran."""
    ran = [r for r in check["tests"].values() if r["planted_defect"] and r["outcome"] != "skipped"]
    return sum(r["outcome"] == "passed" for r in ran), len(ran)


@dataclass
class BudgetProof:
    """The tests of one of the shared KV budget's proofs: those that prove
    it, and the planted defects that its checks must catch."""

    name: str
    passed: int = 0
    failed: int = 0        # failed or errored
    interrupted: int = 0
    caught: int = 0        # planted defects of it whose test passed
    missed: int = 0        # ... whose test failed or errored
    planted: int = 0       # ... that ran

    def problems(self) -> list[str]:
        """Why this proof is not proven; [] when it is."""
        found = [f"{self.failed} failed"] if self.failed else []
        if self.missed:
            found.append(f"{self.missed} planted defect{'s' if self.missed > 1 else ''} missed")
        if self.interrupted:
            found.append(f"{self.interrupted} interrupted")
        if not self.passed:
            found.append("no passing test")
        if not self.caught and not self.missed:
            found.append("no planted defect caught")
        return found


def budget_proofs(check: dict) -> list[BudgetProof] | None:
    """One per proof of BUDGET_PROOFS, in its order, counted from the tests
    that carry it; None for results whose records carry no `budget_proof`."""
    tests = check["tests"].values()
    if not any("budget_proof" in record for record in tests):
        return None
    proofs = {name: BudgetProof(name) for name in BUDGET_PROOFS}
    for record in tests:
        proof, outcome = proofs.get(record.get("budget_proof")), record["outcome"]
        if proof is None or outcome == "skipped":
            continue
        if record["planted_defect"]:
            proof.planted += 1
            proof.caught += outcome == "passed"
            proof.missed += outcome in ("failed", "error")
        else:
            proof.passed += outcome == "passed"
            proof.failed += outcome in ("failed", "error")
        proof.interrupted += outcome == "interrupted"
    return list(proofs.values())


def budget_line(proofs: list[BudgetProof], narrowed: bool) -> str:
    """`shared KV budget: ledger, grants proven (12 tests), 3 of 3 planted
    defects caught`, or what is not proven and why; for a narrowed run,
    the counts alone."""
    caught, planted = sum(proof.caught for proof in proofs), sum(proof.planted for proof in proofs)
    defects = f"{caught} of {planted} planted defects caught"
    if narrowed:
        failed = sum(proof.failed for proof in proofs)
        return (f"shared KV budget: {sum(proof.passed for proof in proofs)} passed"
                + (f", {failed} failed" if failed else "") + f"; {defects}")
    proven = [proof for proof in proofs if not proof.problems()]
    unproven = [proof for proof in proofs if proof.problems()]
    parts = []
    if unproven:
        why = [f"{proof.name} ({', '.join(proof.problems())})" for proof in unproven]
        parts.append("NOT PROVEN: " + "; ".join(why))
    if proven:
        tests = sum(proof.passed for proof in proven)
        parts.append(f"{', '.join(proof.name for proof in proven)} proven ({tests} tests)")
    return f"shared KV budget: {'; '.join(parts)}, {defects}"


def run_verdict(check: dict, run: dict | None) -> list[str]:
    """The verdict lines, the run's last: one per device, each GPU's
    features' (extkv.check.features), the planted defects', the tests run
    twice (extkv.testing.second_run), the shared KV budget's, then the
    run's. `run`: check-run.json (targets per step, wall seconds), or None."""
    verdicts = device_verdicts(check)
    totals = Counter(record["outcome"] for record in check["tests"].values())
    failed = totals["failed"] + totals["error"]
    counts = f"{totals['passed']} passed" + (f", {failed} failed" if failed else "")
    counts += (f", {totals['interrupted']} interrupted" if totals["interrupted"] else "") + f", {totals['skipped']} skipped"
    if run is not None:
        counts += f" in {run['wall_s']:.0f} s"
    narrowed = narrowed_by(check, run["targets"] if run is not None else None)
    # A narrowed run judges no device: each line is its counts alone.
    lines = [verdict.reading() if narrowed else verdict.line() for verdict in verdicts]
    lines += feature_lines(check, [(verdict.label, verdict.name) for verdict in verdicts if verdict.kind != "host"])
    caught, planted = planted_counts(check)
    if planted:
        lines.append(f"the checks caught {caught} of {planted} planted defects")
    twice = sum(1 for record in check["tests"].values() if record.get("second_run"))
    if twice:
        lines.append(f"{twice} {'test' if twice == 1 else 'tests'} ran twice: the first run read only the context's "
                     "own growth; the second is the outcome (the report lists them)")
    proofs = budget_proofs(check)
    if proofs is not None:
        lines.append(budget_line(proofs, bool(narrowed)))
    if run is not None and run.get("interrupted"):
        lines.append(f"INTERRUPTED by {run['interrupted']}: nothing certified; {counts}")
        return lines
    problems = other_failures(check, verdicts, run)
    unproven = [proof.name for proof in proofs or [] if proof.problems()]
    if unproven:
        problems.append(f"shared KV budget: {', '.join(unproven)} not proven")
    if narrowed:
        lines.append(f"partial run: nothing certified (narrowed by {', '.join(narrowed)}); {counts}")
        return lines
    uncertified = [verdict for verdict in verdicts if not verdict.certified]
    if uncertified or problems or not verdicts:
        what = [f"{verdict.name}: {', '.join(verdict.problems())}" for verdict in uncertified] + problems
        lines.append(f"NOT CERTIFIED {'; '.join(what) or 'no device was checked'}; {counts}")
        return lines
    gpus = [verdict for verdict in verdicts if verdict.kind != "host"]
    named = gpus or verdicts
    certified = named[0].proven if len(named) == 1 else sorted(set.intersection(*(set(v.proven) for v in named)))
    lines.append(
        f"CERTIFIED {_names(named)}: invariants {number_ranges(certified)} proven{_cannot(named[0].cannot)}; {counts}"
    )
    return lines


def front_lines(check: dict, run: dict | None) -> list[str]:
    """The check on a report's front page: the run's verdict line first, in
    bold, then each device's, the planted defects' and the shared KV
    budget's."""
    lines = run_verdict(check, run)
    return [f"**Check: {lines[-1]}**", ""] + [f"- {line}" for line in lines[:-1]]


def _names(verdicts: list[DeviceVerdict]) -> str:
    """`cuda:0, cuda:1 NVIDIA H200 (driver ..., torch ...)` for GPUs of one
    name and driver; every name in full otherwise."""
    names = [verdict.name for verdict in verdicts]
    tails = {name.split(" ", 1)[1] for name in names}
    if len(names) > 1 and len(tails) == 1:
        return ", ".join(name.split(" ", 1)[0] for name in names) + " " + tails.pop()
    return "; ".join(names)
