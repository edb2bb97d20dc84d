"""What every run kind reads back from its pytest steps: pytest's exit
statuses, the harness's results files, the options that narrowed a run.

Theory of operation
-------------------
Every run's pytest writes, through the harness, one results file per step
(`check-host.json`, `stress/stress.json`) and ends with an exit status.
Whether a step ran every test it selected (FINISHED_STATUSES) or a signal
stopped it (INTERRUPTED_STATUS) reads the same for every kind; the check's
verdict, the bench section and the stress section each say what it means
for them. `load_step_results` reads one results file, the test a signal
stopped counted as `interrupted`, never as an error of the code under test.
`narrowing` names the options of a recorded pytest command that narrowed
what it ran (`-k walk`, `-x`), and the test paths pytest was given beside
the suite: a narrowed run of any kind judges nothing. Which arguments are
test paths only pytest's own parse of the command knows (`-p NAME`, `-c
FILE`, `-n 2` take a value of their own; plugins add more), so the paths
come from the harness's record of the same run (its selection["args"]),
never from reading the command.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from .rundir import read_json

#: pytest exit statuses a step may end with and still have run every test
#: it selected: all passed, some failed (the records say which), none selected.
FINISHED_STATUSES = (0, 1, 5)
#: pytest's exit status where a signal (KeyboardInterrupt) stopped it.
INTERRUPTED_STATUS = 2
#: Options of pytest that narrow what a run selects or stop it early: those that take a value, and those that do not.
NARROWING_WITH_VALUE = ("-k", "-m", "--deselect", "--ignore", "--ignore-glob", "--maxfail")
NARROWING_FLAGS = ("--lf", "--last-failed", "--sw", "--stepwise", "-x", "--exitfirst")


def narrowing(command: list[str], selected: list[str] | None = None) -> list[str]:
    """The options of a recorded pytest command (`python -m pytest ...`)
    that narrow what it ran (`-k commit`, `-x`), then every test path pytest
    took besides the suite, where the harness recorded the run's selection
    (`selected`: that record's selection["args"], the suite first, as every
    run kind's command names it): `path bench/bench_kv.py::test_bench`."""
    arguments = command[command.index("pytest") + 1:] if "pytest" in command else command
    found = []
    for index, argument in enumerate(arguments):
        option, equals, value = argument.partition("=")
        if option in NARROWING_FLAGS:
            found.append(option)
        elif option in NARROWING_WITH_VALUE:
            found.append(f"{option} {value if equals else ''.join(arguments[index + 1:index + 2])}")
        elif argument[:2] in ("-k", "-m") and len(argument) > 2 and argument[2] != "-":
            found.append(f"{argument[:2]} {argument[2:]}")  # -kcommit
    suite, *paths = selected or [None]
    found += [f"path {path}" for path in paths if path != suite]
    return list(dict.fromkeys(found))


#: The harness's results format (extkv.testing.record.RECORD_FORMAT; the
#: harness needs pytest, which rendering a report does not, so it is not
#: imported here).
CHECK_FORMAT = "extkv-check/2"


def load_results(path: Path) -> dict:
    """One step's results file; ValueError naming the file when it is not one."""
    document = read_json(path)
    if not isinstance(document, dict) or document.get("format") != CHECK_FORMAT:
        found = document.get("format") if isinstance(document, dict) else type(document).__name__
        raise ValueError(f"{path}: not an extkv check results file (format {found!r}, expected {CHECK_FORMAT!r})")
    for key in ("machine", "invariants", "totals", "tests", "exit_status", "devices", "selection"):
        if key not in document:
            raise ValueError(f"{path}: results file without {key!r}")
    return document


def load_step_results(path: Path) -> dict:
    """One step's results file (`load_results`), read as a run a signal may
    have stopped: where it did (pytest's exit status INTERRUPTED_STATUS), the
    test it stopped in, which the harness records as an error without a
    message since no report of it came, is `interrupted` rather than an error
    of the code under test."""
    document = load_results(path)
    if document["exit_status"] != INTERRUPTED_STATUS:
        return document
    tests = {
        nodeid: {**record, "outcome": "interrupted"} if record["outcome"] == "error" and record["message"] is None
        else record
        for nodeid, record in document["tests"].items()
    }
    return {**document, "tests": tests, "totals": Counter(record["outcome"] for record in tests.values())}
