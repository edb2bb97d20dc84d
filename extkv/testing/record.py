"""One pytest run's results, as the harness keeps them: per test its outcome,
invariants, device and duration; the terminal's per-invariant summary; the
progress file and `<step>.json`.

Theory of operation
-------------------
`RunRecord` is a pytest plugin object the harness registers when it is
active. Every report of every test folds into one record per nodeid as it
arrives; under xdist the controlling process receives every worker's
reports, user_properties included, so it alone writes files. A test's
device, invariants and planted defect ride on its user_properties from
collection on (extkv.testing.harness), and so does the shared KV budget's
proof it carries (`budget_proof`). A test whose worker crashed has none:
xdist reports it from the controller, and its device is read from its
nodeid (`[cuda:1-...]`) or is the run's own device.

- `--extkv-progress FILE`: one line of counts (`done total failed`),
  rewritten in place as tests finish (at most every PROGRESS_EVERY_S) and at
  the end, so that `extkv check` can say how far each of its parallel runs
  is.
- `--extkv-report-dir DIR`: at the end, `DIR/<step>.json`: the tests, the
  totals, the invariants table, the devices of the run with their kinds,
  what selected its tests (paths, -k, -m, ...: a narrowed run certifies
  nothing), and the machine facts.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import time
from pathlib import Path

import pytest

from .facts import machine_facts
from .invariants import INVARIANTS

#: Names of the user_properties every test report carries (also written
#: into JUnit XML as testcase properties).
INVARIANTS_PROPERTY = "extkv_invariants"
DEVICE_PROPERTY = "extkv_device"
WORKER_PROPERTY = "extkv_worker"
PLANTED_PROPERTY = "extkv_planted_defect"
BUDGET_PROOF_PROPERTY = "extkv_budget_proof"
GPU_FEATURES_PROPERTY = "extkv_gpu_features"
#: The bytes a test's first run read above its baseline, where it ran twice
#: (extkv.testing.second_run); on the reports of its second run only.
SECOND_RUN_PROPERTY = "extkv_second_run"
#: Label of everything that runs on the host driver or needs no device.
HOST_LABEL = "host"
#: Format tag of the `<step>.json` files written here.
RECORD_FORMAT = "extkv-check/2"
#: Outcomes a test's record can have. A failing call is "failed"; a failing
#: setup or teardown (the leak check runs there) is "error", as in JUnit XML.
OUTCOMES = ("passed", "failed", "error", "skipped")


def device_of_nodeid(nodeid: str, gpus: list[dict], default: str) -> str:
    """The device label a crashed test ran on, from its parameters."""
    found = re.search(r"\[(?:[^\]]*-)?cuda:(\d+)\b", nodeid)
    if found:
        index = int(found.group(1))
        return gpus[index]["label"] if index < len(gpus) else f"cuda:{index} (no GPU)"
    if re.search(r"\[(?:[^\]]*-)?host\b", nodeid):
        return HOST_LABEL
    return default


#: Seconds between two rewrites of the progress file. `extkv check` reads it
#: every 15 s; rewritten after every test, it cost the controlling process of
#: a host check 2.5 s of CPU time beside its two workers on 2 cores.
PROGRESS_EVERY_S = 1.0


class RunRecord:
    """Every test's reports, folded into one record per nodeid."""

    def __init__(self, config, default_device: str, device_kinds: dict[str, str], worker_gpus: dict[str, str]):
        self.config = config
        self.default_device = default_device
        self.device_kinds = device_kinds        # device label -> driver kind, for every device of the run
        self.worker_gpus = worker_gpus
        self.tests: dict[str, dict] = {}
        self.collection_errors: list[dict] = []
        self.collected = 0
        self.started = datetime.datetime.now(datetime.timezone.utc)
        self._failed: set[str] = set()  # nodeids failed or errored, for the progress line
        self._progress_due = 0.0  # time.monotonic() of the next progress rewrite

    @property
    def controlling(self) -> bool:
        return not hasattr(self.config, "workerinput")

    # -- collection counts, for the progress file ----------------------------
    def pytest_collection_finish(self, session):
        if self.controlling:
            self.collected = len(session.items)

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids):
        self.collected = max(self.collected, len(ids))

    # -- folding reports ------------------------------------------------------
    def pytest_runtest_logreport(self, report):
        properties = dict(report.user_properties)
        record = self.tests.get(report.nodeid)
        if record is None:
            record = self.tests[report.nodeid] = {
                "outcome": None,
                "invariants": properties.get(INVARIANTS_PROPERTY, []),
                "device": properties.get(DEVICE_PROPERTY)
                or device_of_nodeid(report.nodeid, machine_facts()["gpus"], self.default_device),
                "worker": properties.get(WORKER_PROPERTY),
                "planted_defect": properties.get(PLANTED_PROPERTY),
                "budget_proof": properties.get(BUDGET_PROOF_PROPERTY),
                "gpu_features": properties.get(GPU_FEATURES_PROPERTY, []),
                "second_run": None,
                "duration_s": 0.0,
                "skip_reason": None,
                "message": None,
            }
        record["duration_s"] = round(record["duration_s"] + report.duration, 6)
        if properties.get(SECOND_RUN_PROPERTY):
            record["second_run"] = properties[SECOND_RUN_PROPERTY]
        if report.failed:
            if record["outcome"] != "failed":
                record["outcome"] = "failed" if report.when in ("call", "???") else "error"
            record["message"] = record["message"] or failure_message(report)
        elif report.skipped and record["outcome"] not in ("failed", "error"):
            record["outcome"] = "skipped"
            record["skip_reason"] = skip_reason(report)
        elif report.when == "call" and record["outcome"] is None:
            record["outcome"] = "passed"
        if record["outcome"] in ("failed", "error"):
            self._failed.add(report.nodeid)
        if report.when == "teardown" or report.when == "???" or (report.failed and report.when == "setup"):
            self._write_progress(now=False)

    def pytest_collectreport(self, report):
        if report.failed:
            self.collection_errors.append({"nodeid": report.nodeid, "message": failure_message(report)})

    def _write_progress(self, *, now: bool = True) -> None:
        """Rewrite the progress file; unless `now`, only if PROGRESS_EVERY_S
        passed since the last rewrite."""
        path = self.config.getoption("--extkv-progress")
        if path is None or not self.controlling:
            return
        clock = time.monotonic()
        if not now and clock < self._progress_due:
            return
        self._progress_due = clock + PROGRESS_EVERY_S
        temporary = f"{path}.tmp"
        with open(temporary, "w") as file:
            file.write(f"{len(self.tests)} {max(self.collected, len(self.tests))} {len(self._failed)}\n")
        os.replace(temporary, path)

    # -- the terminal and the results file --------------------------------------
    def pytest_terminal_summary(self, terminalreporter):
        counted = [record for record in self.tests.values() if record["invariants"]]
        if not counted:
            return
        terminalreporter.write_sep("-", "extkv invariants proven by this run")
        for number, invariant in INVARIANTS.items():
            outcomes = [record["outcome"] for record in counted if number in record["invariants"]]
            counts = {kind: outcomes.count(kind) for kind in OUTCOMES}
            failed = counts["failed"] + counts["error"]
            verdict = "FAILED" if failed else "proven" if counts["passed"] else "not proven"
            terminalreporter.write_line(
                f"invariant {number} ({invariant.words}): {len(outcomes)} tests, {counts['passed']} passed, "
                f"{failed} failed, {counts['skipped']} skipped -> {verdict}"
            )

    def selection(self) -> dict:
        """What chose this run's tests: the paths it was given and every
        option that narrows a selection or stops a run early, where set."""
        option = self.config.option
        found = {"args": [str(argument) for argument in self.config.args]}
        for name in ("keyword", "markexpr", "deselect", "ignore", "ignore_glob", "lf", "stepwise", "maxfail"):
            value = getattr(option, name, None)
            if value:
                found[name] = value if isinstance(value, (bool, int, str)) else " ".join(map(str, value))
        return found

    def pytest_sessionfinish(self, session, exitstatus):
        self._write_progress()
        directory = self.config.getoption("--extkv-report-dir")
        if directory is None or not self.controlling:
            return
        path = Path(directory) / f"{self.config.getoption('--extkv-report-step')}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tests = {nodeid: {**record, "outcome": record["outcome"] or "error"} for nodeid, record in self.tests.items()}
        outcomes = [record["outcome"] for record in tests.values()]
        document = {
            "format": RECORD_FORMAT,
            "step": self.config.getoption("--extkv-report-step"),
            "arguments": list(self.config.invocation_params.args),
            "selection": self.selection(),
            "started": self.started.isoformat(timespec="seconds"),
            "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "exit_status": int(exitstatus),
            "machine": machine_facts(),
            "worker_gpus": self.worker_gpus,
            "devices": self.device_kinds,
            "invariants": {str(number): invariant.words for number, invariant in INVARIANTS.items()},
            "totals": {kind: outcomes.count(kind) for kind in OUTCOMES},
            "collection_errors": self.collection_errors,
            "tests": tests,
        }
        path.write_text(json.dumps(document, indent=1) + "\n")
        reporter = self.config.pluginmanager.getplugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"extkv: results written to {path}")


def skip_reason(report) -> str:
    if isinstance(report.longrepr, tuple):
        return report.longrepr[2].removeprefix("Skipped: ")
    return str(report.longrepr)


def failure_message(report) -> str:
    """The one line that says what failed (pytest's crash line), shortened."""
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    return text.strip().splitlines()[0][:500] if text.strip() else "(no message)"
