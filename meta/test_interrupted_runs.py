"""Ctrl-C or SIGTERM to a run of `extkv check`, `extkv stress`, `extkv
bench` or `extkv reference`, sent to the run's own pid only, as a terminal
or a job scheduler sends it (extkv.runs.steps).

Each run is a real one, in a session of its own, given one extra test that
blocks on a FIFO: the run's pytest has started and stands in that test, the
moment the test writes to a second FIFO this process reads, so the signal
goes out at a known point without a sleep. Every process the run starts
inherits a mark in its environment, by which any left after the run exits
is found in /proc. The run must end whole, exit 128 plus the signal's
number, print one `INTERRUPTED` line, last, and leave a report marked
interrupted in which the stopped test is no failure; the reference's
INTERRUPTED line is its running step's, and its own line closes. Stress,
bench and the reference run on the host driver, whatever GPUs the machine
has: a stress run on a GPU keeps only GPU tests, and the blocking test is
none.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from extkv.benchmarking.cases import PROFILES, catalogue
from extkv.benchmarking.contenders import CONTENDERS
from extkv.runs.rundir import suite_directory

#: Every test here checks extkv's own tooling: its runs and their reports.
pytestmark = pytest.mark.harness

SIGNALS = pytest.mark.parametrize("number", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
BLOCKING = '''
def test_blocks_until_the_run_is_interrupted():
    with open({started!r}, "w") as started:
        started.write("in the test\\n")
    with open({never!r}) as never:  # a FIFO no one opens for writing
        never.read()
'''
#: Set in the environment of a run under test, which every process it
#: starts inherits, to find any of them left after it.
TREE_MARK = "EXTKV_TEST_PROCESS_TREE"
#: Seconds a run may take to reach its blocking test, or to end once
#: signalled: a net against a hang, never a wait for an event.
NET_S = 300


def run_environment(host_only: bool) -> dict[str, str]:
    """This process's environment for a run: without an outer xdist worker's
    variables (the run would pin a GPU and call itself a worker), extkv
    importable from a source tree, and with `host_only` no GPU visible."""
    env = {name: value for name, value in os.environ.items() if not name.startswith(("PYTEST_", "XDIST_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH")]))
    if host_only:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def processes_marked(mark: str) -> list[int]:
    """The pids of live processes whose environment holds TREE_MARK=mark."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/environ", "rb") as file:
                if f"{TREE_MARK}={mark}".encode() in file.read().split(b"\0"):
                    found.append(int(entry))
        except (OSError, ValueError):
            continue  # not a process, ended, or another user's
    return found


def blocking_test(tmp_path: Path, name: str) -> Path:
    """Write the blocking test as tmp_path/NAME, with its two FIFOs."""
    os.mkfifo(tmp_path / "started")
    os.mkfifo(tmp_path / "never")
    path = tmp_path / name
    path.write_text(BLOCKING.format(started=str(tmp_path / "started"), never=str(tmp_path / "never")))
    return path


@dataclass
class Ended:
    status: int
    output: str
    left: list[int]  # processes of the run alive after it exited

    def assert_ended_by(self, number: int, line: str) -> None:
        """Exit status 128 + number, no process left, no traceback, and
        `line` the one INTERRUPTED line, printed last."""
        assert self.status == 128 + number, self.output[-3000:]
        assert self.left == [], f"processes of the run still running after it exited: {self.left}"
        assert "Traceback" not in self.output, self.output[-3000:]
        ending = [said for said in self.output.splitlines() if "INTERRUPTED" in said]
        assert ending == [line], self.output[-3000:]
        assert self.output.splitlines()[-1] == line, self.output[-3000:]


def signalled_in_the_blocking_test(tmp_path: Path, command: list[str], number: int, env: dict[str, str]) -> Ended:
    """Run `command` until its pytest stands in the blocking test, send
    `number` to the run's pid alone, and wait for the run to end."""
    mark = f"{os.getpid()}-{tmp_path.name}"
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env={**env, TREE_MARK: mark}, start_new_session=True)
    said: list[str] = []
    # Read as it comes, so that no run stalls on a full pipe before its test.
    printer = threading.Thread(target=lambda: said.append(run.stdout.read()), daemon=True)
    printer.start()
    seen: list[str] = []
    reader = threading.Thread(target=lambda: seen.append((tmp_path / "started").read_text()))
    reader.start()
    try:
        reader.join(timeout=NET_S)
        if reader.is_alive():
            (tmp_path / "started").write_text("")  # lets the reader go
        assert seen == ["in the test\n"], "the run never reached its test"
        run.send_signal(number)
        run.wait(timeout=NET_S)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
        left = processes_marked(mark)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    printer.join(timeout=NET_S)  # ends once nothing holds the pipe
    assert not printer.is_alive(), "the run's output never ended"
    return Ended(run.returncode, "".join(said), left)


@SIGNALS
def test_a_signal_to_the_check_alone_ends_the_whole_run_with_an_interrupted_report(tmp_path, number):
    """`extkv check` running one test (it blocks on a FIFO), its pytest and
    xdist worker in processes of their own: the signal sent to its pid only
    ends every process of the run, which exits 128 + the signal's number
    with one line and a report marked interrupted, where the stopped test
    is no failure."""
    blocking = blocking_test(tmp_path, "test_blocking.py")
    suite = suite_directory("conformance")  # the check's suite, left out but for the blocking test
    command = [sys.executable, "-m", "extkv", "check", "--report-dir", str(tmp_path / "run"), "--host-workers", "1",
               f"--ignore-glob={suite}/test_*.py", str(blocking)]
    ended = signalled_in_the_blocking_test(tmp_path, command, number, run_environment(host_only=False))
    name, summary = signal.Signals(number).name, tmp_path / "run" / "summary.md"
    ended.assert_ended_by(number, f"extkv check: INTERRUPTED by {name}: nothing certified; report {summary}")
    report = summary.read_text()
    # pytest's controller hears of a test from its xdist worker's reports,
    # which may still be on their way when the signal comes: the stopped test
    # is `interrupted` where one arrived, and a failure nowhere.
    assert re.search(rf"INTERRUPTED by {name}: nothing certified; 0 passed, (1 interrupted, )?0 skipped", report), (
        report[:3000])
    assert "1 failed" not in report and "1 errors" not in report, report[:3000]
    assert json.loads((tmp_path / "run" / "check-run.json").read_text())["interrupted"] == name


@SIGNALS
def test_a_signal_to_the_stress_run_alone_ends_it_whole_with_an_interrupted_verdict(tmp_path, number):
    """`extkv stress` with the blocking test in place of the stress suite:
    the signal to its pid only ends its pytest, which a stopped test leaves
    no stress result of; the report is rendered all the same, its verdict
    interrupted and not passed, the stopped test `interrupted`."""
    blocking = blocking_test(tmp_path, "test_blocking.py")
    command = [sys.executable, "-m", "extkv", "stress", "--minutes", "10", "--report-dir", str(tmp_path / "run"),
               f"--ignore-glob={suite_directory('stress')}/test_*.py", str(blocking)]
    ended = signalled_in_the_blocking_test(tmp_path, command, number, run_environment(host_only=True))
    name, summary = signal.Signals(number).name, tmp_path / "run" / "summary.md"
    ended.assert_ended_by(number, f"extkv stress: INTERRUPTED by {name}: the run ended before its bound; "
                                  f"report {summary}")
    report = summary.read_text()
    assert (f"- verdict: **INTERRUPTED by {name}: not passed (the run ended before its bound); 0 passed, "
            "1 interrupted, 0 skipped**") in report, report[:3000]
    assert re.search(r"(?m)^\| `test_blocks_until_the_run_is_interrupted` \| [^|]+ \| interrupted \|", report), report
    assert "1 failed" not in report, report[:3000]
    recorded = json.loads((tmp_path / "run" / "stress" / "run.json").read_text())
    assert recorded["interrupted"] == name and recorded["exit_status"] == 2, recorded


def smallest_main_process_case() -> str:
    """The quick profile's smallest recycled case whose contenders all run
    in the bench's own process: measured in well under a second."""
    cases = [case for case in catalogue(PROFILES["quick"])
             if case.state == "recycled" and all(CONTENDERS[name].process == "main" for name in case.contenders)]
    return min(cases, key=lambda case: (case.bytes, len(case.contenders))).id


@SIGNALS
def test_a_signal_to_the_bench_alone_ends_it_whole_with_a_partial_report(tmp_path, number):
    """`extkv bench --quick` measuring one case, then standing in the
    blocking test: the signal to its pid only ends its pytest, whose
    measured case still reaches the report; the bench section is headed as
    partial, says so before any figure, and shows the case measured."""
    case = smallest_main_process_case()
    blocking = blocking_test(tmp_path, "bench_blocking.py")
    command = [sys.executable, "-m", "extkv", "bench", "--quick", "--report-dir", str(tmp_path / "run"),
               "--benchmark-storage", str(tmp_path / "storage"), "-k", f"{case} or blocks_until", str(blocking)]
    ended = signalled_in_the_blocking_test(tmp_path, command, number, run_environment(host_only=True))
    name, summary = signal.Signals(number).name, tmp_path / "run" / "summary.md"
    ended.assert_ended_by(number, f"extkv bench: INTERRUPTED by {name}: the run did not measure every case; "
                                  f"report {summary}")
    report = summary.read_text()
    cases = len(catalogue(PROFILES["quick"]))
    assert (f"## Benchmarks (INTERRUPTED by {name}: partial results)\n\n**INTERRUPTED by {name} before every case "
            f"was measured: partial results, not a complete run.** Cases with a contender measured: 1 of {cases};"
            ) in report, report[:3000]
    assert "### Targets (partial: " in report and "### Every case (partial)" in report, report[:3000]
    op, geometry, size, state = case.split("-")
    assert re.search(rf"(?m)^\| {op} {geometry} \(\d+ seg\) {size} {state}[^|]* \| extkv \| [0-9.]+ (us|ms|s) / ",
                     report), report
    assert "1 failed" not in report, report[:3000]
    recorded = json.loads((tmp_path / "run" / "bench-run.json").read_text())
    assert recorded["interrupted"] == name and recorded["exit_status"] == 2, recorded


@SIGNALS
def test_a_signal_to_the_reference_alone_ends_its_step_and_the_reference(tmp_path, number):
    """`extkv reference` standing in its check step's blocking test: the
    signal to its pid only reaches the step as that signal, which ends its
    own pytest and says so in the run's one INTERRUPTED line; the reference
    makes no reference, ends with the same exit status and runs no step
    after."""
    blocking = blocking_test(tmp_path, "test_blocking.py")
    suite = suite_directory("conformance")  # the check's suite, left out but for the blocking test
    command = [sys.executable, "-m", "extkv", "reference", "--report-dir", str(tmp_path / "run"),
               f"--ignore-glob={suite}/test_*.py", str(blocking)]
    ended = signalled_in_the_blocking_test(tmp_path, command, number, run_environment(host_only=True))
    name, summary = signal.Signals(number).name, tmp_path / "run" / "summary.md"
    assert ended.status == 128 + number and ended.left == [], (ended.left, ended.output[-3000:])
    assert "Traceback" not in ended.output, ended.output[-3000:]
    ending = [said for said in ended.output.splitlines() if "INTERRUPTED" in said]
    assert ending == [f"extkv check: INTERRUPTED by {name}: nothing certified; report {summary}"], ended.output[-3000:]
    assert ended.output.splitlines()[-1] == (f"extkv reference: no reference made: its check step ended on {name}; "
                                             f"report {summary}"), ended.output[-3000:]
    assert "extkv reference: bench" not in ended.output, "a step ran after the interrupted one"
    assert json.loads((tmp_path / "run" / "check-run.json").read_text())["interrupted"] == name


ENDING_A_HELD_STEP = """
import json, os, signal, threading
from extkv.runs.steps import end_all, interruptible, start
# As a run starts its steps: inside interruptible(), whose handlers make
# the step's SIGINT default again where this process inherited it ignored
# (a background job's).
with interruptible():
    step = start(["sleep", "1000000"])
    step._waitpid_lock.acquire()  # what a signal landing in that window leaves
    ending = threading.Thread(target=end_all, args=([step],), kwargs={{"grace_s": {net}}}, daemon=True)
    ending.start()
    ending.join(timeout={net})
if ending.is_alive():
    os.killpg(step.pid, signal.SIGKILL)
    os.waitpid(step.pid, 0)
try:
    os.waitpid(step.pid, os.WNOHANG)
    zombie = True
except ChildProcessError:
    zombie = False
print(json.dumps({{"hung": ending.is_alive(), "status": step.returncode, "zombie": zombie}}))
"""


def test_ending_a_step_whose_popen_lock_a_signal_left_held_still_ends_and_reaps_it():
    """A signal whose handler raises inside Popen.wait(timeout) or poll(),
    between the acquire of the Popen's waitpid lock and the try that
    releases it, leaves that lock held (planted here by holding it). Ending
    the steps must not wait on it: end_all returns, the step reaped with
    the status the ending signal gave it. It runs in a child of its own, as
    a run does: end_all also ends every other child of its process, and
    this pytest's children (a forkserver) are not its to end."""
    ran = subprocess.run([sys.executable, "-c", ENDING_A_HELD_STEP.format(net=NET_S)], capture_output=True,
                         text=True, env=run_environment(host_only=True), timeout=3 * NET_S)
    assert ran.returncode == 0, ran.stderr[-3000:]
    result = json.loads(ran.stdout.splitlines()[-1])
    assert not result["hung"], "end_all waited on the step's Popen lock"
    assert result["status"] == -signal.SIGINT, result
    assert not result["zombie"], "the ended step was left unreaped"
