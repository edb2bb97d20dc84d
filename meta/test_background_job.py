"""The suite's Ctrl-C tests hold when the suite runs as a background job.

Theory of operation
-------------------
A script that starts the suite with `cmd &` (CI runners and nightly jobs
do) starts it with SIGINT ignored, and Python keeps it ignored. The tests
that prove what Ctrl-C does send SIGINT to themselves or to a child; each
gives the signal Python's handler first (extkv.testing.ctrl_c), so that the
verdict depends on extkv and not on how the suite was started. Here those
tests run in a pytest of their own whose SIGINT is ignored, and must pass
(a test that needs a GPU skips on a host without one).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import extkv

pytestmark = pytest.mark.harness

ROOT = Path(extkv.__file__).resolve().parent.parent
#: Every test that sends SIGINT, by its node id.
SENDS_SIGINT = [
    "conformance/test_host_locks.py::test_ctrl_c_while_waiting_for_the_lock_lands_and_changes_nothing",
    "conformance/test_sleep.py::test_ctrl_c_ends_a_sleep_waiting_for_a_cache_lock_and_changes_nothing",
    "tools/test_busy_check.py::test_a_signal_to_the_script_ends_every_neighbour_and_the_check[SIGINT]",
]
#: Seconds the child run may take; one of those tests, where Ctrl-C does not
#: land, waits 60 s for its safety net before it fails.
PATIENCE_S = 300


def ignore_ctrl_c() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_the_ctrl_c_tests_pass_with_sigint_ignored_as_in_a_background_job():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", *SENDS_SIGINT],
        cwd=ROOT, env=env, preexec_fn=ignore_ctrl_c, capture_output=True, text=True, timeout=PATIENCE_S,
    )
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-2000:]
    assert run.returncode == 0, f"with SIGINT ignored: {summary}\n{run.stdout[-3000:]}"
    assert " passed" in summary and "deselected" not in summary, summary
