"""`extkv check` as a certifying team meets it: the verdict it ends with,
the plan that runs every GPU's suite on every GPU, the run directory it
writes into, the harness plugin that stays inert until asked, and a crash of
the code under test that is a failed test rather than a lost run.

The verdict is read from merged results built here record by record (the
report's own merge is tested from real runs in test_reporting.py); the
crash and the plugin run real pytest processes. All of it is tooling: it
proves no invariant of the cache, so `extkv check` does not run it.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import resource
import subprocess
import sys
import threading
from importlib import metadata
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from extkv.check.report import load_check
from extkv.check.run import closing_lines, plan, workers
from extkv.check.verdict import front_lines, run_verdict
from extkv.runs.machine import machine_section
from extkv.runs.rundir import RunDirectoryInUse, prepare_run_directory, run_directory
from extkv.testing import exclusive as exclusive_locks
from extkv.testing.facts import machine_facts
from extkv.testing.invariants import BUDGET_PROOFS, DEVICE_KINDS, INVARIANTS

pytest_plugins = ["pytester"]

#: Every test here checks extkv's own tooling: the check runner, its verdict and the harness.
pytestmark = pytest.mark.harness

H200 = "GPU 0 (NVIDIA H200)"
FACTS = {
    "host": "node-1", "torch": "2.11.0+cu130", "host_driver": "Linux 6.18",
    "gpus": [{"index": 0, "id": "0", "name": "NVIDIA H200", "label": H200, "driver": "580.159.04"}],
}


def record(device: str, invariants: list[int], outcome: str = "passed", planted: str | None = None) -> dict:
    return {"device": device, "invariants": invariants, "outcome": outcome, "planted_defect": planted,
            "duration_s": 0.1, "message": None, "skip_reason": None}


def merged(tests: dict[str, dict], *, devices=("host", H200), selection=None, exit_status=0) -> dict:
    """Merged results as extkv.check.report.load_check returns them, of one step."""
    step = {"selection": selection or {"args": ["conformance"]}, "collection_errors": [], "exit_status": exit_status}
    kinds = {"host": "host", H200: "cuda"}
    return {"steps": {"check-host": step}, "tests": tests, "machine": FACTS,
            "devices": {label: kinds[label] for label in devices}}


def full(device: str, kind: str) -> dict[str, dict]:
    return {f"test_{n}[{device}]": record(device, [n]) for n in DEVICE_KINDS[kind].provable}


RUN = {"steps": ["check-host"], "targets": {"check-host": ["conformance"]}, "wall_s": 104.4}


def test_a_whole_run_with_every_invariant_proven_is_certified_with_counts():
    lines = run_verdict(merged(full("host", "host") | full(H200, "cuda")), RUN)
    assert lines[-1] == ("CERTIFIED cuda:0 NVIDIA H200 (driver 580.159.04, torch 2.11.0+cu130): invariants 1-8 proven; "
                         "15 passed, 0 skipped in 104 s")
    assert lines[0] == "host driver (Linux 6.18, memfd): invariants 1, 3-8 proven (2 needs a GPU: the host driver has no CUDA graphs); 7 passed, 0 skipped"
    host_only = run_verdict(merged(full("host", "host"), devices=("host",)), RUN)
    assert host_only[-1].startswith("CERTIFIED host driver (Linux 6.18, memfd): invariants 1, 3-8 proven (2 needs a GPU")


def test_a_failed_test_names_its_device_and_invariant():
    tests = full("host", "host") | full(H200, "cuda") | {"test_x[cuda:0]": record(H200, [3], "failed")}
    lines = run_verdict(merged(tests), RUN)
    assert lines[-1].startswith("NOT CERTIFIED cuda:0 NVIDIA H200 (driver 580.159.04, torch 2.11.0+cu130): 1 failed (invariants 3)")
    assert "1 failed" in lines[-1] and lines[0].startswith("host driver") and "NOT" not in lines[0]


def test_an_invariant_the_device_can_prove_but_ran_no_test_is_not_certified():
    tests = full("host", "host") | {key: r for key, r in full(H200, "cuda").items() if r["invariants"] != [2]}
    assert "invariant 2 ran no passing test" in run_verdict(merged(tests), RUN)[-1]
    # A GPU that ran nothing at all is not certified either.
    nothing = run_verdict(merged(full("host", "host")), RUN)[-1]
    assert nothing.startswith("NOT CERTIFIED cuda:0") and "invariants 1-8 ran no passing test" in nothing
    # Nor is a skipped test proof.
    skipped = full("host", "host") | {k: {**r, "outcome": "skipped"} for k, r in full(H200, "cuda").items()}
    assert run_verdict(merged(skipped), RUN)[-1].startswith("NOT CERTIFIED")


@pytest.mark.parametrize(
    ("selection", "said"),
    [({"args": ["conformance"], "keyword": "sizing"}, "-k sizing"),
     ({"args": ["conformance"], "markexpr": "gpu"}, "-m gpu"),
     ({"args": ["conformance/test_cache.py"]}, "path conformance/test_cache.py"),
     ({"args": ["conformance"], "maxfail": 1}, "-x/--maxfail 1")],
)
def test_a_narrowed_run_certifies_nothing(selection, said):
    tests = full("host", "host") | full(H200, "cuda")
    last = run_verdict(merged(tests, selection=selection), RUN)[-1]
    assert last.startswith(f"partial run: nothing certified (narrowed by {said})"), last


def test_a_step_pytest_could_not_finish_or_a_missed_planted_defect_fails_the_run():
    tests = full("host", "host") | full(H200, "cuda")
    assert "exit status 3" in run_verdict(merged(tests, exit_status=3), RUN)[-1]
    planted = tests | {"test_planted[host-zeroing-skipped]": record("host", [], "failed", "zeroing-skipped"),
                       "test_planted[host-usage-over-reported]": record("host", [], "passed", "usage-over-reported")}
    lines = run_verdict(merged(planted), RUN)
    assert "the checks caught 1 of 2 planted defects" in lines and lines[-1].startswith("NOT CERTIFIED")


def test_a_step_that_left_no_results_fails_the_run(tmp_path):
    """A GPU whose pytest run died before writing its results is still a
    device the run was asked to check: the run names the step, and the GPU,
    listed by the machine facts of check-run.json, proved nothing."""
    run = {**RUN, "steps": ["check-host", "check-gpu0"], "targets": {**RUN["targets"], "check-gpu0": ["conformance"]},
           "phases": [], "machine": FACTS}
    (tmp_path / "check-run.json").write_text(json.dumps(run))
    host = {"format": "extkv-check/2", "step": "check-host", "machine": {**FACTS, "gpus": []}, "invariants": {},
            "totals": {}, "exit_status": 0, "devices": {"host": "host"}, "selection": {"args": ["conformance"]},
            "collection_errors": [], "worker_gpus": {}, "tests": full("host", "host")}
    (tmp_path / "check-host.json").write_text(json.dumps(host))
    check = load_check(tmp_path)
    assert check["devices"] == {"host": "host", H200: "cuda"}, "the GPU is asked for though its step wrote nothing"
    last = run_verdict(check, run)[-1]
    assert last.startswith("NOT CERTIFIED cuda:0 NVIDIA H200") and "check-gpu0: left no results (see check-gpu0.log)" in last


def test_the_plan_runs_every_gpu_test_on_every_gpu_and_host_tests_once(tmp_path):
    two = {**FACTS, "gpus": FACTS["gpus"] + [{**FACTS["gpus"][0], "index": 1, "id": "1", "label": "GPU 1 (NVIDIA H200)"}]}
    phases = plan(tmp_path, two, 4, 6)
    assert [[step.name for step in phase.steps] for phase in phases] == [
        ["check-host", "check-gpu0", "check-gpu1"], ["check-multi-gpu"]], "every device at once, then the multi-GPU tests"
    steps = {step.name: step for phase in phases for step in phase.steps}
    for gpu in ("0", "1"):
        step = steps[f"check-gpu{gpu}"]
        assert step.env == {"CUDA_VISIBLE_DEVICES": gpu} and step.targets == [str(tmp_path)]
        assert "--extkv-device=gpu" in step.options and step.options[step.options.index("-n") + 1] == "6"
    assert "--extkv-device=host" in steps["check-host"].options
    assert steps["check-host"].env == {"CUDA_VISIBLE_DEVICES": ""}, "beside GPUs the host's run must not touch them"
    assert all("--extkv-lock-dir={run}/locks" in steps[name].options for name in ("check-host", "check-gpu0", "check-gpu1"))
    assert all("-n" in step.options for step in steps.values()), "every step runs under xdist: a crash is a failed test"
    without_gpu = [step.name for phase in plan(tmp_path, {**FACTS, "gpus": []}, 2, 0) for step in phase.steps]
    assert without_gpu == ["check-host"]
    assert "--extkv-device=all" in plan(tmp_path, {**FACTS, "gpus": []}, 2, 0)[0].steps[0].options, "GPU tests show as skipped"
    assert workers(2, 0, None, None) == (2, 0) and workers(16, 1, None, None) == (6, 10) and workers(32, 2, None, None) == (12, 10)


def test_runs_get_a_directory_of_their_own_and_a_named_one_must_be_empty(tmp_path):
    facts = {"host": "node-1", "gpus": []}
    first = run_directory(facts, datetime.date(2026, 12, 1), tmp_path)
    assert first == tmp_path / "2026-12-01-node-1-host"
    first.mkdir()
    assert run_directory(facts, datetime.date(2026, 12, 1), tmp_path) == first, "an empty directory is free"
    (first / "check.json").write_text("{}")
    assert run_directory(facts, datetime.date(2026, 12, 1), tmp_path) == tmp_path / "2026-12-01-node-1-host-2"
    with pytest.raises(RunDirectoryInUse, match=r"is not empty \(it holds check.json\): pass --overwrite"):
        prepare_run_directory(first, facts, False, ("check*.json",))
    assert (first / "check.json").read_text() == "{}", "a refused directory is left as it was"
    (first / "bench.json").write_text("{}")
    assert prepare_run_directory(first, facts, True, ("check*.json",)) == first.resolve()
    assert sorted(path.name for path in first.iterdir()) == ["bench.json"], "--overwrite removes this run's own files only"


@pytest.mark.parametrize("when", ["setup", "teardown"])
def test_a_test_that_errs_in_setup_or_teardown_fails_its_device(when):
    """The harness records a test whose fixture raised, before or after a
    body that passed, as `error`: its device and the run are not certified."""
    tests = full("host", "host") | full(H200, "cuda")
    tests["test_3[cuda:0]"] = {**record(H200, [3], "error"), "message": f"RuntimeError: raised in {when}"}
    lines = run_verdict(merged(tests), RUN)
    assert lines[1].startswith("cuda:0 NVIDIA H200 (driver 580.159.04, torch 2.11.0+cu130): NOT CERTIFIED: 1 failed"), lines
    assert lines[-1].startswith("NOT CERTIFIED cuda:0") and "1 failed" in lines[-1], lines[-1]


def interrupted_step(tmp_path: Path, tests: dict[str, dict]) -> dict:
    """load_check of one host step that a signal stopped (pytest's exit
    status 2), the harness's record of it written as the harness writes it."""
    document = {"format": "extkv-check/2", "step": "check-host", "machine": {**FACTS, "gpus": []}, "invariants": {},
                "totals": {}, "exit_status": 2, "devices": {"host": "host"}, "selection": {"args": ["conformance"]},
                "collection_errors": [], "worker_gpus": {}, "tests": tests}
    (tmp_path / "check-host.json").write_text(json.dumps(document))
    return load_check(tmp_path)


def test_an_interrupted_step_certifies_nothing_and_its_stopped_test_is_no_failure(tmp_path):
    """Every test passed but the one a signal stopped, which the harness
    holds as an error without a message (no report of it came): the test is
    `interrupted`, not failed, and neither the device nor the run is
    certified; a run that a signal ended says so last."""
    tests = full("host", "host")
    tests["test_stopped[host]"] = record("host", [3], "error")
    check = interrupted_step(tmp_path, tests)
    assert check["tests"]["test_stopped[host]"]["outcome"] == "interrupted"
    run = {**RUN, "phases": [], "machine": {**FACTS, "gpus": []}}
    lines = run_verdict(check, run)
    assert lines[0].startswith("host driver (Linux 6.18, memfd): NOT CERTIFIED: 1 interrupted"), lines
    assert lines[-1] == ("NOT CERTIFIED host driver (Linux 6.18, memfd): 1 interrupted; check-host: interrupted "
                         "(pytest exit status 2); 7 passed, 1 interrupted, 0 skipped in 104 s"), lines[-1]
    ended = run_verdict(check, {**run, "interrupted": "SIGTERM"})
    assert ended[-1] == "INTERRUPTED by SIGTERM: nothing certified; 7 passed, 1 interrupted, 0 skipped in 104 s"
    assert not any("failed" in line for line in lines + ended), lines + ended


def budget_tests(outcomes: dict[str, str] | None = None) -> dict[str, dict]:
    """Per budget proof, two tests of it and one planted defect it catches,
    on the host, as the harness records them; `outcomes` overrides some by
    key (`test_grants_1`, `test_grants_planted`)."""
    tests = {}
    for proof in BUDGET_PROOFS:
        for key, planted in ((f"test_{proof}_1", None), (f"test_{proof}_2", None), (f"test_{proof}_planted", proof)):
            tests[key] = {**record("host", [5], (outcomes or {}).get(key, "passed"), planted), "budget_proof": proof}
    return tests


def whole_run(budget: dict[str, dict], **options) -> dict:
    """Every invariant proven on the host and the H200, beside `budget`'s
    tests, every record carrying `budget_proof` as the harness writes it."""
    tests = {key: {**test, "budget_proof": None} for key, test in (full("host", "host") | full(H200, "cuda")).items()}
    return merged(tests | budget, **options)


ALL_PROVEN = "ledger, grants, SIGKILL, restart, reclaim, hostile peers"


def test_a_run_proving_every_budget_proof_has_its_line_and_is_certified():
    lines = run_verdict(whole_run(budget_tests()), RUN)
    budget = f"shared KV budget: {ALL_PROVEN} proven (12 tests), 6 of 6 planted defects caught"
    assert lines[-2:-1] == [budget] and lines[-3] == "the checks caught 6 of 6 planted defects", lines
    assert lines[-1].startswith("CERTIFIED cuda:0 NVIDIA H200"), lines[-1]
    front = front_lines(whole_run(budget_tests()), RUN)
    assert front[0].startswith("**Check: CERTIFIED ") and f"- {budget}" in front, front


def test_a_budget_proof_with_a_failed_test_is_not_proven_and_the_run_not_certified():
    lines = run_verdict(whole_run(budget_tests({"test_grants_2": "failed"})), RUN)
    assert ("shared KV budget: NOT PROVEN: grants (1 failed); ledger, SIGKILL, restart, reclaim, hostile peers proven "
            "(10 tests), 6 of 6 planted defects caught") in lines, lines
    assert lines[-1].startswith("NOT CERTIFIED ") and "shared KV budget: grants not proven" in lines[-1], lines[-1]


def test_a_budget_proof_whose_planted_defect_is_missed_or_absent_is_not_proven():
    missed = run_verdict(whole_run(budget_tests({"test_SIGKILL_planted": "failed"})), RUN)
    assert ("shared KV budget: NOT PROVEN: SIGKILL (1 planted defect missed); ledger, grants, restart, reclaim, "
            "hostile peers proven (10 tests), 5 of 6 planted defects caught") in missed, missed
    assert "shared KV budget: SIGKILL not proven" in missed[-1], missed[-1]
    skipped = {"test_reclaim_1": "skipped", "test_reclaim_2": "skipped", "test_reclaim_planted": "skipped"}
    absent = run_verdict(whole_run(budget_tests(skipped)), RUN)
    assert ("shared KV budget: NOT PROVEN: reclaim (no passing test, no planted defect caught); ledger, grants, "
            "SIGKILL, restart, hostile peers proven (10 tests), 5 of 5 planted defects caught") in absent, absent
    assert absent[-1].startswith("NOT CERTIFIED ") and "reclaim not proven" in absent[-1], absent[-1]
    nothing = run_verdict(whole_run({}), RUN)
    assert nothing[-2].startswith("shared KV budget: NOT PROVEN: ledger (no passing test, no planted defect caught); "), nothing
    assert nothing[-2].endswith(", 0 of 0 planted defects caught") and " proven (" not in nothing[-2], nothing[-2]


def test_results_from_before_budget_proofs_have_no_budget_line_and_a_narrowed_run_counts_only():
    older = run_verdict(merged(full("host", "host") | full(H200, "cuda")), RUN)
    assert not any(line.startswith("shared KV budget") for line in older) and older[-1].startswith("CERTIFIED"), older
    narrowed = run_verdict(whole_run(budget_tests({"test_grants_2": "failed"}),
                                     selection={"args": ["conformance"], "keyword": "budget"}), RUN)
    assert "shared KV budget: 11 passed, 1 failed; 6 of 6 planted defects caught" in narrowed, narrowed
    assert narrowed[-1].startswith("partial run: nothing certified (narrowed by -k budget)"), narrowed[-1]


BUDGET_MARKED = '''
import pytest

@pytest.mark.invariant(5)
@pytest.mark.budget_proof("grants")
def test_proves_grants():
    pass

@pytest.mark.invariant(5)
@pytest.mark.budget_proof("SIGKILL")
@pytest.mark.planted_defect("dead-lease-kept")
def test_catches_a_dead_lease():
    pass

@pytest.mark.invariant(5)
def test_proves_no_budget_proof():
    pass
'''


def test_a_budget_proof_rides_from_its_marker_into_the_results_and_the_verdict(pytester, tmp_path):
    pytester.makepyfile(test_budget=BUDGET_MARKED)
    result = pytester.runpytest_inprocess("-p", "extkv.testing.harness", "--extkv", "-p", "no:cacheprovider",
                                          f"--extkv-report-dir={tmp_path}", "--extkv-report-step=check-host")
    result.assert_outcomes(passed=3)
    check = load_check(tmp_path)
    carried = {key.split("::")[1]: (test["budget_proof"], test["planted_defect"]) for key, test in check["tests"].items()}
    assert carried == {"test_proves_grants": ("grants", None), "test_catches_a_dead_lease": ("SIGKILL", "dead-lease-kept"),
                       "test_proves_no_budget_proof": (None, None)}, carried
    line = next(line for line in run_verdict(check, None) if line.startswith("shared KV budget"))
    assert line == ("shared KV budget: NOT PROVEN: ledger (no passing test, no planted defect caught); grants (no planted "
                    "defect caught); SIGKILL (no passing test); restart (no passing test, no planted defect caught); "
                    "reclaim (no passing test, no planted defect caught); "
                    "hostile peers (no passing test, no planted defect caught), 1 of 1 planted defects caught"), line


def test_a_budget_proof_the_table_does_not_know_is_refused_at_collection(pytester):
    pytester.makepyfile(test_unknown="import pytest\n\n@pytest.mark.budget_proof('speed')\ndef test_fast():\n    pass\n")
    result = pytester.runpytest_inprocess("-p", "extkv.testing.harness", "--extkv", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.outlines
    result.stderr.fnmatch_lines(["*test_fast: write @pytest.mark.budget_proof(name) with name one of ['ledger', *"
                                 "got *speed*"])


def clean_env() -> dict[str, str]:
    # An outer xdist worker's variables would make the inner run pin a GPU
    # and call itself a worker; extkv must be importable where it is a
    # source tree on the path rather than installed.
    env = {name: value for name, value in os.environ.items() if not name.startswith(("PYTEST_", "XDIST_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH")]))
    return env


def installed() -> bool:
    try:
        metadata.version("extkv")
    except metadata.PackageNotFoundError:
        return False
    return True


CRASHING = '''
import ctypes, pytest

@pytest.mark.invariant(4)
def test_reads_unmapped_memory():
    ctypes.string_at(16, 1)   # SIGSEGV, as zeroing unmapped memory would

@pytest.mark.invariant(4)
def test_after_the_crash():
    pass
'''


def test_a_crash_of_the_code_under_test_is_a_failed_test_with_its_name(tmp_path):
    (tmp_path / "test_crash.py").write_text(CRASHING)
    command = [sys.executable, "-m", "pytest", str(tmp_path), "-q", "-p", "no:cacheprovider", "-c", os.devnull,
               "--rootdir", str(tmp_path), "-p", "extkv.testing.harness", "-n", "1", f"--extkv-report-dir={tmp_path}",
               "--extkv-report-step=check-host",
               f"--extkv-progress={tmp_path / 'progress'}"]
    # No core files: the kernel writing one per crashed worker took most of
    # this test's 18.8 s on the H200.
    no_core = lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # noqa: E731
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=clean_env(), preexec_fn=no_core)
    document = json.loads((tmp_path / "check-host.json").read_text())
    tests = {nodeid.split("::")[-1]: test for nodeid, test in document["tests"].items()}
    assert tests["test_reads_unmapped_memory"]["outcome"] == "failed", (result.stdout[-2000:], tests)
    assert "crashed" in tests["test_reads_unmapped_memory"]["message"]
    assert tests["test_reads_unmapped_memory"]["device"] == "host"
    assert tests["test_after_the_crash"]["outcome"] == "passed", "the replaced worker goes on with the rest"
    assert (tmp_path / "progress").read_text().split() == ["2", "2", "1"]


UNRELATED = '''
import os, torch

def test_untouched():
    assert "extkv" not in " ".join(os.environ.get("PYTEST_ADDOPTS", "").split())
    print("threads", torch.get_num_threads(), "visible", os.environ.get("CUDA_VISIBLE_DEVICES"))
'''


def test_the_installed_plugin_is_inert_until_asked(tmp_path):
    """Loaded by its entry point in someone else's project, the harness pins
    no GPU, sets no threads, loads no Hypothesis profile and adds no header,
    skips or leak checks; asked with --extkv it does."""
    (tmp_path / "test_unrelated.py").write_text(UNRELATED)
    # PYTEST_PLUGINS loads the plugin as the entry point does, asking nothing of it.
    # CI set: Hypothesis then loads its own `ci` profile, which is not extkv's.
    env = clean_env() | {"CI": "true", "PYTEST_XDIST_WORKER": "gw1", "CUDA_VISIBLE_DEVICES": "0,1", "PYTEST_PLUGINS": "extkv.testing.harness"}
    run = [str(tmp_path), "-q", "-s", "-p", "no:cacheprovider", "-c", os.devnull, "--rootdir", str(tmp_path)]
    # One interpreter for both sessions: the second asks for the harness.
    code = (
        "import os, sys, torch, hypothesis, pytest\n"
        "threads = torch.get_num_threads()\n"
        "import extkv.testing.harness\n"
        "assert os.environ['CUDA_VISIBLE_DEVICES'] == '0,1', 'pinned on import'\n"
        "assert torch.get_num_threads() == threads, 'threads set on import'\n"
        "assert hypothesis.settings._current_profile != 'extkv-ci', 'profile loaded on import'\n"
        f"inert = pytest.main({run!r})\n"
        "print('BEFORE', threads, 'PROFILE', hypothesis.settings._current_profile, flush=True)\n"
        "print('ASKED', flush=True)\n"
        f"asked = pytest.main({run + ['--extkv']!r})\n"
        "print('PROFILE', hypothesis.settings._current_profile, flush=True)\n"
        "sys.exit(inert or asked)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    inert, asked = result.stdout.split("ASKED")
    if installed():
        assert "extkv.testing.harness" in [entry.name for entry in entry_points(group="pytest11")], "no pytest11 entry point"
    before = inert.split("BEFORE ")[1].split()[0]
    assert f"threads {before} visible 0,1" in inert, "inert, the harness set torch's threads or pinned a GPU:\n" + inert
    lines = inert.split("BEFORE")[0].splitlines()
    assert not [line for line in lines if line.startswith("extkv") or "extkv invariants" in line], (
        "an inert harness prints no header and no summary:\n" + inert)
    assert "PROFILE extkv-ci" not in inert, "inert, the harness loaded its Hypothesis profile"
    assert "threads 1 visible 1" in asked, "asked for, the harness sets one torch thread and pins worker gw1's GPU:\n" + asked
    assert "PROFILE extkv-ci" in asked, "asked for, the harness loads its Hypothesis profile"


#: Seconds a thread may take to get locks that are free: a net against
#: hangs only, since a busy machine may keep a thread from running for long.
LOCK_PATIENCE_S = 60


def enters(directory: Path, exclusive: bool, gpu_id: str | None, release: threading.Event) -> threading.Event:
    """A thread that takes a test's locks, sets the returned event once it holds them, then holds them until `release`."""
    entered = threading.Event()

    def take() -> None:
        with exclusive_locks.held(directory, exclusive, gpu_id):
            entered.set()
            release.wait(2 * LOCK_PATIENCE_S)

    threading.Thread(target=take, daemon=True).start()
    return entered


def test_an_exclusive_test_waits_for_the_tests_of_its_device_only(tmp_path):
    """flock locks of two descriptors conflict within one process too, so threads stand in for workers."""
    host_running, gpu_running, done = threading.Event(), threading.Event(), threading.Event()
    assert enters(tmp_path, False, None, host_running).wait(LOCK_PATIENCE_S), "a host test takes its shared lock at once"
    assert enters(tmp_path, False, "0", gpu_running).wait(LOCK_PATIENCE_S), "a GPU test beside it too"
    gpu_alone = enters(tmp_path, True, "0", done)
    assert not gpu_alone.wait(0.3), "a GPU's exclusive test must wait for that GPU's running test"
    assert enters(tmp_path, False, "1", done).wait(LOCK_PATIENCE_S), "another GPU's test does not wait for it"
    gpu_running.set()
    assert gpu_alone.wait(LOCK_PATIENCE_S), "the GPU's exclusive test runs once its GPU's test ended"
    host_alone = enters(tmp_path, True, None, done)
    assert not host_alone.wait(0.3), "a host exclusive test waits for every test of the machine"
    host_running.set()
    assert not host_alone.wait(0.3), "...the GPU tests too: they share the machine's memory"
    done.set()
    assert host_alone.wait(LOCK_PATIENCE_S)
    assert exclusive_locks.plan(True, None) == [("machine.lock", fcntl.LOCK_EX)]
    assert exclusive_locks.plan(True, "0") == [("machine.lock", fcntl.LOCK_SH), ("gpu-0.lock", fcntl.LOCK_EX)]


def test_the_terminal_ends_with_the_slowest_tests_the_report_its_plots_and_the_verdict(tmp_path):
    tests = full("host", "host") | full(H200, "cuda")
    tests["test_3[host]"]["duration_s"] = 9.5
    for name in ("timeline-host.png", "bench_scaling_bytes.png"):
        (tmp_path / name).write_bytes(b"\x89PNG")
    lines = closing_lines(merged(tests), RUN, tmp_path / "summary.md")
    assert lines[0] == "slowest tests:" and lines[1] == "     9.5 s  test_3[host]  [host]" and len(lines[1:11]) == 10
    at = lines.index(f"report {tmp_path / 'summary.md'}")
    assert lines[at + 1 : at + 3] == [f"plot {tmp_path / 'bench_scaling_bytes.png'}", f"plot {tmp_path / 'timeline-host.png'}"]
    assert lines[at + 3 :] == run_verdict(merged(tests), RUN), "the verdict lines come last"
    assert lines[-1].startswith("CERTIFIED cuda:0")


def test_reports_name_the_extkv_build_and_torch_cuda():
    facts = machine_facts()
    assert facts["extkv"] and facts["torch_cuda"], facts
    section = machine_section(facts)
    assert f"- extkv {facts['extkv']}" in section and f"torch {facts['torch']} (CUDA {facts['torch_cuda']})" in section
    if (Path(__file__).resolve().parents[1] / ".git").exists():
        assert facts["extkv_commit"] and f"at commit {facts['extkv_commit']}" in section


def test_every_invariant_has_words_and_a_statement():
    assert sorted(INVARIANTS) == list(range(1, 9))
    assert all(invariant.words and invariant.statement.endswith(".") for invariant in INVARIANTS.values())
    assert set(DEVICE_KINDS) == {"host", "cuda"} and DEVICE_KINDS["host"].provable == (1, 3, 4, 5, 6, 7, 8)


ORDERED = '''
import pytest

def test_plain():
    pass

@pytest.mark.planted_defect("late")
def test_planted_late():
    pass

@pytest.mark.exclusive
def test_alone():
    pass
'''


def test_a_run_orders_the_planted_defects_first_and_the_exclusive_tests_last(pytester):
    pytester.makepyfile(test_order=ORDERED)
    result = pytester.runpytest_inprocess("-p", "extkv.testing.harness", "--extkv", "-p", "no:cacheprovider", "--co", "-q")
    collected = [line.split("::")[1] for line in result.outlines if "::" in line]
    assert collected == ["test_planted_late", "test_plain", "test_alone"], result.outlines



GPU_FEATURES = '''
import pytest

@pytest.mark.gpudirect_rdma
def test_rdma():
    pass

@pytest.mark.dma_buf
def test_dma_buf():
    pass

@pytest.mark.gpu
def test_any_gpu():
    pass

@pytest.mark.gpudirect_rdma
def test_rdma_on(device):
    pass
'''
RDMA_ATTRIBUTE = "CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED"


@pytest.mark.parametrize(
    ("gpus", "skipped"),
    [
        ([], {"test_rdma": "GPUDirect RDMA with VMM needs a CUDA GPU: ", "test_dma_buf": "dma-buf export needs a CUDA GPU: ",
              "test_any_gpu": "needs a CUDA GPU: "}),
        ([{"gpudirect_rdma": False, "dma_buf": True}],
         {"test_rdma": f"GPUDirect RDMA with VMM: not supported here (GPU 0 (NVIDIA T4): {RDMA_ATTRIBUTE} = 0)"}),
        ([{"gpudirect_rdma": True, "dma_buf": True}], {}),
    ],
    ids=["no GPU", "a GPU without GPUDirect RDMA with VMM", "a GPU with both"],
)
def test_a_gpu_feature_marker_skips_where_the_gpu_lacks_it_and_says_why(pytester, monkeypatch, gpus, skipped):
    """The markers of GPU features (gpudirect_rdma, dma_buf) read each GPU's
    machine facts, made up here; a test on the host driver never has them."""
    from extkv.testing import harness_hooks

    made_up = [{"index": i, "id": str(i), "name": "NVIDIA T4", "label": f"GPU {i} (NVIDIA T4)", "driver": "580.1",
                "cuda_driver_api": "13.0", "granularity": "2 MiB", **offers} for i, offers in enumerate(gpus)]
    monkeypatch.setattr(harness_hooks, "machine_facts", lambda: {**machine_facts(), "gpus": made_up})
    monkeypatch.setattr(harness_hooks, "cuda_device_count", lambda: len(made_up))
    pytester.makepyfile(test_features=GPU_FEATURES)
    # The cuda:0 case of test_rdma_on would read usage from a GPU this machine may not have.
    result = pytester.runpytest_inprocess(
        "-p", "extkv.testing.harness", "--extkv", "-p", "no:cacheprovider", "-rs", "-k", "not cuda"
    )
    said = {
        report.nodeid.split("::")[1]: report.longrepr[2].removeprefix("Skipped: ")
        for report in result.reprec.getreports("pytest_runtest_logreport") if report.skipped
    }
    host = "GPUDirect RDMA with VMM: not supported here (the host driver: its memory is no GPU's)"
    expected = {**skipped, "test_rdma_on[host]": "GPUDirect RDMA with VMM needs a CUDA GPU: " if not gpus else host}
    assert said.keys() == expected.keys(), f"skipped {sorted(said)}, expected {sorted(expected)}: {result.outlines}"
    for test, reason in expected.items():
        assert said[test].startswith(reason), f"{test} skipped saying {said[test]!r}, not {reason!r}"
    result.assert_outcomes(passed=4 - len(expected), skipped=len(expected))


PARALLEL = '''
import os
import pytest

@pytest.mark.exclusive
def test_alone(request):
    directory = request.config.getoption("--extkv-lock-dir")
    print("LOCK DIR", directory)
    assert os.environ.get("EXTKV_ALONE_ON_DEVICE") == "1" and os.path.isdir(directory)

@pytest.mark.parametrize("n", range(3))
def test_shared(request, n):
    assert os.path.isdir(request.config.getoption("--extkv-lock-dir"))
'''


def test_a_parallel_run_without_a_lock_directory_keeps_its_exclusive_tests_alone(pytester):
    """`pytest -n N` with no --extkv-lock-dir: the run makes one, its workers
    take their locks there, and it is gone when the run ends."""
    pytester.makepyfile(test_parallel=PARALLEL)
    result = pytester.runpytest_subprocess("-p", "extkv.testing.harness", "--extkv", "-p", "no:cacheprovider", "-n", "2", "-rA")
    result.assert_outcomes(passed=4)
    directory = next(line.split("LOCK DIR ")[1] for line in result.outlines if "LOCK DIR " in line)
    assert not Path(directory).exists(), f"the run's lock directory {directory} outlived it"


def featured(outcome: str, feature: str, device: str = H200, skip_reason: str | None = None) -> dict:
    return record(device, [3]) | {"outcome": outcome, "gpu_features": [feature], "skip_reason": skip_reason}


def test_each_gpu_s_features_have_a_line_proven_not_supported_or_not_proven():
    name = "cuda:0 NVIDIA H200 (driver 580.159.04, torch 2.11.0+cu130)"
    both = {"test_rdma[cuda:0]": featured("passed", "gpudirect_rdma"), "test_dma_buf[cuda:0]": featured("passed", "dma_buf")}
    lines = run_verdict(merged(full("host", "host") | full(H200, "cuda") | both), RUN)
    assert f"{name}: GPUDirect RDMA with VMM proven (1 test); dma-buf export proven (1 test)" in lines, lines
    assert lines[-1].startswith("CERTIFIED "), lines[-1]
    lacking = "GPUDirect RDMA with VMM: not supported here (GPU 0: CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED = 0)"
    without = both | {"test_rdma[cuda:0]": featured("skipped", "gpudirect_rdma", skip_reason=lacking)}
    lines = run_verdict(merged(full("host", "host") | full(H200, "cuda") | without), RUN)
    assert f"{name}: {lacking}; dma-buf export proven (1 test)" in lines and lines[-1].startswith("CERTIFIED "), lines
    broken = both | {"test_dma_buf[cuda:0]": featured("failed", "dma_buf")}
    lines = run_verdict(merged(full("host", "host") | full(H200, "cuda") | broken), RUN)
    assert f"{name}: GPUDirect RDMA with VMM proven (1 test); dma-buf export NOT PROVEN (1 failed)" in lines, lines
    assert lines[-1].startswith("NOT CERTIFIED "), lines[-1]
    older = run_verdict(merged(full("host", "host") | full(H200, "cuda")), RUN)
    assert not any("GPUDirect" in line or "dma-buf" in line for line in older), older


def test_a_feature_marker_reaches_the_run_s_records(pytester):
    pytester.makeconftest("from extkv.testing import harness\n\ndef pytest_configure(config):\n    harness.activate(config)\n")
    pytester.makepyfile(test_featured="""
import pytest

@pytest.mark.invariant(3)
@pytest.mark.gpudirect_rdma
def test_needs_rdma():
    pass
""")
    result = pytester.runpytest_inprocess("-p", "no:randomly", f"--extkv-report-dir={pytester.path / 'out'}",
                                          "--extkv-report-step=check-host", "--extkv-device=all")
    assert result.ret == 0, result.stdout.str()
    (document,) = [json.loads(path.read_text()) for path in (pytester.path / "out").glob("check-host.json")]
    (test,) = document["tests"].values()
    assert (test["outcome"], test["gpu_features"]) == ("skipped", ["gpudirect_rdma"]), test
    assert test["skip_reason"].startswith("GPUDirect RDMA with VMM"), test["skip_reason"]
