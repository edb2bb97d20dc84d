"""tools/busy_check.py's own logic, with stand-ins for `extkv check`: which
runs count as certified, and that no burner or neighbour outlives it, on
any way out. Run as `python3 -m pytest tools -q -p no:cacheprovider`."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from extkv.testing.ctrl_c import PYTHON_HANDLES_CTRL_C
from tools import busy_check

ROOT = Path(__file__).resolve().parents[1]
MiB, GiB = 1 << 20, 1 << 30
#: Neighbours small enough for any test machine.
SMALL = ["--burners", "2", "--memory-bytes", str(64 * MiB), "--gpu-bytes", "0"]
#: Seconds a test waits for a process to end: a net against hangs only.
PATIENCE_S = 60


def stand_in(verdict: str, returncode: int) -> list[str]:
    """A check that prints some output, then `verdict` last, and exits with `returncode`."""
    code = f"print('extkv check: [1/2] host'); print('extkv check: ' + {verdict!r}); raise SystemExit({returncode})"
    return [sys.executable, "-c", code]


def gone(pid: int) -> bool:
    """No such process, or one that has exited and waits to be reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def members(pgid: int) -> list[int]:
    """Live processes of process group `pgid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                found.append(int(entry.name))
    return found


@pytest.mark.parametrize(
    "verdict, returncode, certified",
    [
        ("CERTIFIED host driver (Linux, memfd): invariants 1, 3-8 proven; 900 passed", 0, True),
        ("NOT CERTIFIED host driver (Linux, memfd): 1 failed (invariants 5); 899 passed, 1 failed", 1, False),
        ("partial run: nothing certified (narrowed by -k sizing); 40 passed", 1, False),
        ("CERTIFIED host driver (Linux, memfd): invariants 1, 3-8 proven; 900 passed", 1, False),
    ],
    ids=["certified", "not-certified", "partial", "certified-line-but-failed-exit"],
)
def test_the_script_passes_only_when_every_run_certified(capsys, verdict, returncode, certified):
    assert busy_check.main(["--runs", "2", *SMALL], check=stand_in(verdict, returncode)) == (0 if certified else 1)
    out = capsys.readouterr().out
    assert out.count(f"busy_check: run 1/2: extkv check: {verdict}") == 1, out
    assert out.count(f"busy_check: run 2/2: extkv check: {verdict}") == 1, out
    assert f"busy_check: {2 if certified else 0} of 2 runs certified under load" in out, out


def test_unknown_arguments_go_to_the_check(capsys):
    echo = [sys.executable, "-c", "import sys; print('extkv check: CERTIFIED args ' + ' '.join(sys.argv[1:]))"]
    assert busy_check.main(["--runs", "1", *SMALL, "-k", "sizing", "--host-workers", "2"], check=echo) == 0
    assert "busy_check: run 1/1: extkv check: CERTIFIED args -k sizing --host-workers 2" in capsys.readouterr().out


def test_the_neighbourhood_runs_in_one_group_and_leaves_nothing():
    with busy_check.Neighbourhood(burners=3, memory_bytes=64 * MiB, gpu_bytes=0, gpus=0) as busy:
        pids = [process.pid for process in busy.processes]
        assert len(pids) == 4 and sorted(members(busy.pgid)) == sorted(pids), (pids, members(busy.pgid))
    assert all(gone(pid) for pid in pids), [pid for pid in pids if not gone(pid)]
    assert members(busy.pgid) == []


def test_every_neighbour_is_python_that_compiles():
    """The GPU neighbour runs only where torch sees CUDA: compiled here at least."""
    for name in ("BURNER", "MEMORY_NEIGHBOUR", "GPU_NEIGHBOUR"):
        compile(getattr(busy_check, name), name, "exec")


def test_the_memory_neighbour_stays_within_its_bound():
    assert busy_check.memory_bound(8 * GiB) == 8 * GiB // 10
    assert busy_check.memory_bound(64 * GiB) == 2 * GiB
    with pytest.raises(SystemExit):
        busy_check.parse(["--memory-bytes", str(busy_check.memory_bound(busy_check.mem_total()) + 1)])


def start_script() -> tuple[subprocess.Popen, int, int]:
    """The script with a check that blocks until killed (it reads the stdin
    the test never writes); returns it, the neighbours' group and the
    check's pid, once both are running (read from its output)."""
    blocking = [sys.executable, "-c", "import os, sys; print('extkv check: pid', os.getpid(), flush=True); sys.stdin.read()"]
    # As a terminal starts it: Ctrl-C reaches Python's handler, whatever this test process inherited.
    code = PYTHON_HANDLES_CTRL_C + (
        f"import sys; from tools.busy_check import main; sys.exit(main({['--runs', '1', *SMALL]!r}, check={blocking!r}))"
    )
    script = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    pgid = check = None
    for line in script.stdout:
        if "; process group " in line:
            pgid = int(line.rsplit(" ", 1)[1])
        if line.startswith("extkv check: pid "):
            check = int(line.split()[-1])
            break
    assert pgid is not None and check is not None, "the script never started its check"
    return script, pgid, check


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: signal.Signals(s).name)
def test_a_signal_to_the_script_ends_every_neighbour_and_the_check(signum):
    script, pgid, check = start_script()
    assert len(members(pgid)) == 3, members(pgid)  # 2 burners and the memory neighbour
    os.kill(script.pid, signum)
    out, _ = script.communicate(timeout=PATIENCE_S)
    assert script.returncode == (130 if signum == signal.SIGINT else 128 + signum), out
    assert members(pgid) == [], f"neighbours left after {signal.Signals(signum).name}: {members(pgid)}"
    assert gone(check), "the check outlived the script"


def test_neighbours_of_a_killed_script_end_themselves():
    """SIGKILL leaves the script no cleanup: each neighbour sees its parent
    gone and exits (each one's pidfd turns readable when it does)."""
    script, pgid, _ = start_script()
    pidfds = [os.pidfd_open(pid) for pid in members(pgid)]
    try:
        assert len(pidfds) == 3
        script.kill()
        script.communicate(timeout=PATIENCE_S)  # closes its stdin: the stand-in check reads its end and exits
        for pidfd in pidfds:
            readable, _, _ = select.select([pidfd], [], [], PATIENCE_S)
            assert readable, f"a neighbour of a killed script still runs after {PATIENCE_S} s: {members(pgid)}"
    finally:
        for pidfd in pidfds:
            os.close(pidfd)
    assert members(pgid) == []
