"""The `extkv` command as a new user meets it, and the distribution it ships in.

Theory of operation
-------------------
What a user types first: `extkv --version` (the installed version, and the
commit of a checkout), `--help` of the command and of each subcommand (what
it does; for check, bench and stress, that unknown arguments go to pytest,
with an example), and `extkv info` (the devices, and which cuda-bindings
extkv imports). Help and version run in this process through
`extkv.cli.main`, as the console script calls it. `info` runs in a process of
its own with no GPU visible: it is the host's report, and on a GPU machine
creating CUDA drivers here would leave contexts behind in this process.
Bad input to `report`, `pool` and `peer` (a run directory it cannot read, a
run given twice, a socket path that is no socket, a timeout that is no
duration, a socket where no exporter answers) is one line naming what was
wrong and a non-zero exit status, never a traceback. `extkv budget serve`
runs as a process of its own until SIGTERM, and `extkv budget status`
reads it.

From a checkout, the packaging a user installs: pyproject.toml declares the
license as an SPDX expression with its file, numpy (torch warns at every
import without it), the cuda12 / cuda13 extras that pin cuda-bindings to the
driver's major, and py.typed as package data.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

import pytest

import extkv
from extkv import cli

#: Every test here checks extkv's own tooling: benchmarks, reports, the command line.
pytestmark = pytest.mark.harness

ROOT = Path(extkv.__file__).resolve().parent.parent
#: Subcommands that hand what they do not know to pytest.
PYTEST_COMMANDS = ("check", "bench", "stress")
SUBCOMMANDS = ("info", *PYTEST_COMMANDS, "report", "pool", "budget", "peer")


def run_main(capsys, *argv: str) -> str:
    """`extkv ARGV...` in this process: what it printed. --help and --version
    exit through SystemExit(0)."""
    with pytest.raises(SystemExit) as exited:
        cli.main(list(argv))
    assert exited.value.code in (0, None), f"extkv {' '.join(argv)} exited {exited.value.code}"
    return capsys.readouterr().out


def test_version_names_the_installed_version(capsys):
    out = run_main(capsys, "--version")
    try:
        installed = metadata.version("extkv")
    except metadata.PackageNotFoundError:  # a source tree on PYTHONPATH, never installed
        assert out.startswith("extkv (not installed"), out
    else:
        assert out.startswith(f"extkv {installed}"), out


def test_version_names_the_checkout_commit(capsys):
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip(f"extkv is not imported from a git checkout ({ROOT}) or git is missing")
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    out = run_main(capsys, "--version")
    assert f"commit {head}" in out, out


def test_help_lists_every_subcommand_and_version(capsys):
    out = run_main(capsys, "--help")
    for name in SUBCOMMANDS:
        assert re.search(rf"^\s+{name}\s+\S", out, re.M), f"`extkv --help` does not describe {name}:\n{out}"
    assert "--version" in out


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_subcommand_help_says_what_it_does(capsys, name):
    out = run_main(capsys, name, "--help")
    usage, _, rest = out.partition("\n\n")
    description = rest.split("\n\n")[0]
    assert usage.startswith(f"usage: extkv {name}"), out
    assert len(description.split()) >= 5 and not description.lstrip().startswith(("options:", "positional")), (
        f"`extkv {name} --help` says nothing of what it does:\n{out}"
    )


@pytest.mark.parametrize("name", PYTEST_COMMANDS)
def test_pytest_subcommand_help_says_unknown_arguments_go_to_pytest(capsys, name):
    out = " ".join(run_main(capsys, name, "--help").split())  # argparse wraps lines
    assert f"Arguments `extkv {name}` does not know go to pytest" in out, out
    assert re.search(rf"e\.g\. `extkv {name} [^`]*-k \w+`", out), f"no example of pytest arguments:\n{out}"


def test_info_on_the_host_names_the_driver_and_cuda_bindings():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        [sys.executable, "-m", "extkv", "info"], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("host (Linux virtual memory") and "granularity" in line for line in lines), lines
    assert not any(line.startswith("cuda:") for line in lines), f"a GPU listed with none visible: {lines}"
    try:
        version = metadata.version("cuda-bindings")
    except metadata.PackageNotFoundError:
        assert any(line.startswith("cuda-bindings: not installed") for line in lines), lines
    else:
        assert f"cuda-bindings: {version} (major {version.split('.')[0]})" in result.stdout, lines
    # NVML sees the driver whatever CUDA_VISIBLE_DEVICES says: with a GPU
    # driver the line compares majors, without one it says host only.
    gpu_line = next((line for line in lines if line.startswith("GPU driver: ")), None)
    assert gpu_line is not None, lines
    verdicts = r"(matches|does not match|needs bindings)"
    assert re.search(rf"GPU driver: (none found|CUDA \d+\.\d+ .*: major \d+ {verdicts})", gpu_line), gpu_line


# -- the distribution ------------------------------------------------------------
def _pyproject() -> dict:
    path = ROOT / "pyproject.toml"
    if not path.is_file():
        pytest.skip("an installed extkv has no pyproject.toml to read: checked from a checkout")
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads(path.read_text())


def _requirement(requirements: list[str], name: str) -> str | None:
    return next((r for r in requirements if re.match(rf"{re.escape(name)}\s*([<>=!~;\[]|$)", r)), None)


def test_license_is_an_spdx_expression_with_its_file():
    pyproject = _pyproject()
    project = pyproject["project"]
    assert project["license"] == "Apache-2.0", project["license"]
    assert "LICENSE" in project["license-files"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    # setuptools reads an SPDX string and license-files from 77 on.
    setuptools = _requirement(pyproject["build-system"]["requires"], "setuptools")
    assert setuptools is not None and re.search(r">=\s*(7[7-9]|[89]\d|\d{3,})", setuptools), setuptools


def test_dependencies_include_numpy_and_cuda_bindings_of_any_major():
    dependencies = _pyproject()["project"]["dependencies"]
    assert _requirement(dependencies, "numpy"), f"numpy missing: torch warns at every import without it: {dependencies}"
    bindings = _requirement(dependencies, "cuda-bindings")
    # Bindings installed to match a machine's driver, 12 or 13, satisfy it.
    assert bindings is not None and "<" not in bindings, bindings


@pytest.mark.parametrize(("extra", "pin"), [("cuda12", "cuda-bindings>=12.6,<13"), ("cuda13", "cuda-bindings>=13,<14")])
def test_cuda_extras_pin_the_bindings_major(extra, pin):
    extras = _pyproject()["project"]["optional-dependencies"]
    assert pin in extras.get(extra, []), f"extra {extra} is {extras.get(extra)}, expected {pin}"


def test_py_typed_ships_as_package_data():
    package_data = _pyproject()["tool"]["setuptools"].get("package-data", {})
    assert "py.typed" in package_data.get("extkv", []), package_data
    assert (ROOT / "extkv" / "py.typed").is_file()


def test_version_attribute_matches_pyproject():
    assert extkv.__version__ == _pyproject()["project"]["version"]


def test_report_of_a_directory_it_cannot_read_says_why_without_a_traceback(tmp_path, capsys):
    (tmp_path / "check-run.json").write_text('{"steps": []}')
    assert cli.main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"extkv report: {tmp_path / 'check-run.json'}: no ") and "Traceback" not in err, err
    with pytest.raises(SystemExit) as exited:
        cli.main(["report", str(tmp_path / "nowhere")])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and f"'{tmp_path / 'nowhere'}' does not exist; expected a run directory" in err, err


def test_pool_of_a_malformed_run_says_which_file_without_a_traceback(tmp_path, capsys):
    runs = []
    for name in ("a", "b"):
        run = tmp_path / name
        run.mkdir()
        (run / "bench_cases.json").write_text("[]")
        (run / "bench.json").write_text('{"benchmarks": []}')
        runs.append(str(run))
    assert cli.main(["pool", str(tmp_path / "out"), *runs]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'a' / 'bench_cases.json'}: a JSON list, not the object a results file holds" in err, err
    assert "Traceback" not in err


def bench_run(run_dir: Path) -> Path:
    """A run directory of one measured case, as `extkv bench` leaves it."""
    case = {"case": "grow8-blhnc1-1GiB-recycled", "op": "grow8", "op_what": "growth", "pivot": "memset",
            "contenders": ["extkv", "raw"], "geometry": "blhnc1", "geometry_what": "g", "segments": 1, "blocks": 8,
            "capacity_blocks": 8, "bytes": 1 << 30, "smallest_segment_bytes": 1 << 30, "commits": 8, "replays": 0,
            "state": "recycled", "order": ["extkv", "raw"],
            "results": {name: {"status": "measured", "reason": ""} for name in ("extkv", "raw")}}
    facts = {"profile": "gpu", "profile_what": "w", "device": "cuda:0", "device_description": {}, "host": "h",
             "torch": "t", "granularity": 2 << 20, "rounds": 1, "case_seconds": 8.0, "costly_rounds": 2,
             "elapsed_seconds": 1.0, "budget_seconds": 2.0, "clocks": ["c"], "cpu_time": "thread_time", "cases": [case]}
    benchmarks = [{"name": f"test_bench[{case['case']}-{name}]", "stats": {"data": [0.001]},
                   "extra_info": {"case": case["case"], "contender": name, "process": "main", "cpu": [0.001]}}
                  for name in ("extkv", "raw")]
    run_dir.mkdir()
    (run_dir / "bench_cases.json").write_text(json.dumps(facts))
    (run_dir / "bench.json").write_text(json.dumps({"benchmarks": benchmarks}))
    return run_dir


def test_pool_refuses_a_run_given_twice_or_as_the_pooled_directory(tmp_path, capsys):
    """However the second spelling names it (the same path, through `..`,
    a symlink), a run is pooled with itself only by mistake, and a pooled
    directory that is one of the runs would be written over: refused by
    name, exit status 2, nothing written."""
    a, b = bench_run(tmp_path / "a"), bench_run(tmp_path / "b")
    (tmp_path / "link-to-a").symlink_to(a)
    held = {path: path.read_bytes() for path in (*a.iterdir(), *b.iterdir())}
    out = tmp_path / "out"
    refusals = [
        ([out, a, a], f"{a} is {a} again"),
        ([out, a, b, f"{a}/../a"], f"{a}/../a is {a} again"),
        ([out, a, tmp_path / "link-to-a"], f"{tmp_path / 'link-to-a'} is {a} again"),
        ([a, a, b], f"{a}: the pooled directory must not be one of the runs pooled (it is {a})"),
        ([tmp_path / "link-to-a", a, b], f"the pooled directory must not be one of the runs pooled (it is {a})"),
    ]
    for argv, words in refusals:
        assert cli.main(["pool", *map(str, argv)]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("extkv pool: ") and words in err and err.count("\n") == 1, (argv, err)
        assert not out.exists(), f"extkv pool {argv} wrote {out}"
        assert {path: path.read_bytes() for path in (*a.iterdir(), *b.iterdir())} == held, argv
    assert cli.main(["pool", str(out), str(a), str(b)]) == 0, "two runs pool"


def test_peer_with_a_bad_socket_path_or_timeout_says_why_without_a_traceback(tmp_path, capsys):
    """A SOCKET_PATH that is no socket and a timeout that is no duration are
    usage errors naming the argument (exit status 2); a socket where no
    exporter answers is one line naming it (exit status 1)."""
    regular = tmp_path / "regular"
    regular.write_text("")
    # A short directory: an AF_UNIX address holds at most 107 bytes.
    with tempfile.TemporaryDirectory(prefix="extkv-") as short, socket.socket(socket.AF_UNIX) as bound:
        path = os.path.join(short, "peer.sock")
        bound.bind(path)  # bound, not listening: a connection is refused
        expected = "; expected the Unix socket a SegmentExportConnector listens on"
        usage_errors = [
            ([str(tmp_path / "nowhere")], f"argument --peer: '{tmp_path / 'nowhere'}': No such file or directory{expected}"),
            ([str(regular)], f"argument --peer: '{regular}' is a regular file{expected}"),
            ([str(tmp_path)], f"argument --peer: '{tmp_path}' is a directory{expected}"),
            # The same socket, spelt too long to connect to.
            ([os.path.join(short, "./" * 60 + "peer.sock")], "more than the 107 an AF_UNIX address holds"),
        ]
        for seconds in ("0", "-1", "nan", "inf", "soon"):
            usage_errors.append(([path, "--timeout", seconds], f"argument --timeout: {seconds!r}: expected a finite number of seconds > 0"))
        for argv, words in usage_errors:
            with pytest.raises(SystemExit) as exited:
                cli.main(["peer", "--peer", *argv])
            err = capsys.readouterr().err
            assert exited.value.code == 2 and "extkv peer: error: argument --" in err and words in err, (argv, err)
        assert cli.main(["peer", "--peer", path, "--timeout", "5"]) == 1
        assert capsys.readouterr().err == f"extkv peer: {path}: ConnectionRefusedError: [Errno 111] Connection refused\n"
        bound.listen()  # connects, then hears nothing
        assert cli.main(["peer", "--peer", path, "--timeout", "0.2"]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"extkv peer: {path}: DeadlineExceededError: ") and err.count("\n") == 1, err


def test_budget_serve_runs_until_sigterm_and_status_reads_it():
    """`extkv budget serve` as an operator starts it: a process of its own
    that says where it serves once it listens, answers `extkv budget
    status`, makes a second daemon for its device exit 1 with one line,
    and on SIGTERM stops, exit status 0, its socket removed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    extkv_budget = [sys.executable, "-m", "extkv", "budget"]
    with open("/proc/meminfo") as meminfo:
        total = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemTotal:"))
    # A short directory: an AF_UNIX address holds at most 107 bytes.
    with tempfile.TemporaryDirectory(prefix="extkv-") as short:
        run = os.path.join(short, "run")
        serve = [*extkv_budget, "serve", "--device", "host", "--budget", "80%", "--run-dir", run]
        daemon = subprocess.Popen(serve, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert select.select([daemon.stdout], [], [], 120)[0], "the daemon said nothing within 120 s"
            line = daemon.stdout.readline()
            path = os.path.join(run, "host.sock")
            assert line == f"extkv budget: serving host, budget {int(total * 0.8)} bytes, on {path}\n", line
            status = subprocess.run([*extkv_budget, "status", "--run-dir", run], env=env, capture_output=True,
                                    text=True, timeout=120, check=False)
            assert status.returncode == 0, status.stderr
            assert status.stdout == (f"budget={int(total * 0.8)} granted=0 dead=0 free={int(total * 0.8)} over_budget=0 engines=0 "
                                     f"device=host socket={path}\n(no engine)\n"), status.stdout
            second = subprocess.run(serve, env=env, capture_output=True, text=True, timeout=120, check=False)
            assert second.returncode == 1 and second.stderr.count("\n") == 1, second.stderr
            assert second.stderr.startswith("extkv budget serve: another budget daemon holds "), second.stderr
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(120)
        assert daemon.returncode == 0, daemon.stderr.read()
        assert not os.path.exists(path), "the daemon left its socket behind"
        gone = subprocess.run([*extkv_budget, "status", "--run-dir", run], env=env, capture_output=True, text=True,
                              timeout=120, check=False)
        assert (gone.returncode, gone.stderr) == (1, f"extkv budget status: no budget daemon's socket in {run}\n")


def test_pool_into_a_directory_whose_own_files_cannot_be_read_says_which(tmp_path, capsys):
    """The pooled report reads OUT_DIR whole: a file there that is no
    results file (a FIFO) is named in one line, exit status 2."""
    runs = [str(bench_run(tmp_path / name)) for name in ("a", "b")]
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / "check-fifo.json")
    assert cli.main(["pool", str(out), *runs]) == 2
    err = capsys.readouterr().err
    assert err == f"extkv pool: {out / 'check-fifo.json'}: not a regular file, expected a results file\n", err


def test_reference_runs_check_bench_and_stress_into_one_directory(tmp_path, capsys):
    """`extkv reference` is four runs a user could type (the bench as its
    two parts), into one directory each replacing only its own files; a
    stress bound of no time is refused before anything runs."""
    from extkv import reference_run

    planned = reference_run.steps(tmp_path, 2.5, ["-x"])
    assert [name for name, _ in planned] == ["check", "bench cases", "bench engines", "stress"]
    for name, command in planned:
        assert command[1:4] == ["-m", "extkv", name.split()[0]], command
        assert command[-4:] == ["--report-dir", str(tmp_path), "--overwrite", "-x"], command
    assert planned[1][1][4:6] == ["--part", "cases"] and planned[2][1][4:6] == ["--part", "engines"], planned
    assert planned[3][1][4:6] == ["--minutes", "2.5"], planned[3][1]
    with pytest.raises(SystemExit) as exited:
        cli.main(["reference", "--stress-minutes", "0", "--report-dir", str(tmp_path)])
    assert exited.value.code == 2
    assert "argument --stress-minutes: '0': expected a finite number of minutes > 0" in capsys.readouterr().err
    assert not any(tmp_path.iterdir()), "a refused reference wrote files"
    facts = {"gpus": [{"name": "NVIDIA H200"}]}
    assert reference_run.reference_directory(facts).parts[-3:] == ("reports", "reference", "h200")


@pytest.mark.parametrize("drop", ["device_description", "cases", "elapsed_seconds"])
def test_report_and_pool_of_results_missing_a_field_say_which_in_one_line(tmp_path, capsys, drop):
    """Valid JSON of the wrong shape (a field the report reads is missing)
    is one line naming the run and the field, exit status 2, for
    `extkv report` and `extkv pool` alike."""
    a, b = bench_run(tmp_path / "a"), bench_run(tmp_path / "b")
    for run in (a, b):
        facts = json.loads((run / "bench_cases.json").read_text())
        del facts[drop]
        (run / "bench_cases.json").write_text(json.dumps(facts))
    assert cli.main(["report", str(a)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"extkv report: {a}: bench results not as extkv writes them (no field '{drop}')"), err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert cli.main(["pool", str(tmp_path / "out"), str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert "bench results not as extkv writes them (no field" in err and err.count("\n") == 1, err
