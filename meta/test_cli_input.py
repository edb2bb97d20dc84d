"""The `extkv` command refuses bad input before anything runs, and its help costs no torch.

Theory of operation
-------------------
Every subcommand that takes a worker count, a time bound, a directory, or
(`extkv budget`) a device, a budget, a uid or a run directory is given each
kind of bad value (extkv.cli_arguments) in this process through
`extkv.cli.main`, as the console script calls it: each must be exit status
2 with one line on stderr that names the value and what was expected, no
traceback, and nothing created under the test's directory. The values are
refused while parsing, so no run starts, whatever the machine.

What a user types first (`--help`, `--version`, each subcommand's --help)
runs in a process of its own, which then lists the torch modules it holds:
none. extkv's package imports its names lazily; the last test checks that
the lazy names and the ones type checkers read agree.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import extkv
from extkv import cli

pytestmark = pytest.mark.harness

ROOT = Path(extkv.__file__).resolve().parent.parent
#: The cores this process may run on: the most workers a step may have.
CORES = len(os.sched_getaffinity(0))
#: Subcommands whose own subcommands parse their arguments (`extkv budget serve`).
NESTED_COMMANDS = ("budget",)
#: Subcommands that take --report-dir, and what else each needs to parse.
REPORT_DIR_COMMANDS = {"check": [], "bench": [], "stress": ["--minutes", "1"], "reference": []}


def unwritable_directory(tmp_path: Path) -> Path:
    """A directory this process cannot write: mode 0555, or for root (whom
    modes do not stop) /proc/1, which root cannot make entries in either."""
    if os.geteuid() != 0:
        directory = tmp_path / "read-only"
        directory.mkdir()
        directory.chmod(0o555)
        return directory
    if os.access("/proc/1", os.W_OK):
        pytest.skip("no directory here that this process (root) cannot write")
    return Path("/proc/1")


def tree(path: Path) -> set[str]:
    return {str(entry.relative_to(path)) for entry in path.rglob("*")}


def refused(capsys, argv: list[str], value: str, expected: str, where: Path) -> None:
    """`extkv ARGV` exits 2 with one line naming `value` and `expected`, creating nothing under `where`."""
    before = tree(where)
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    err = capsys.readouterr().err
    command = " ".join(argv[:2] if argv[0] in NESTED_COMMANDS else argv[:1])
    assert exited.value.code == 2, (argv, exited.value.code, err)
    assert err.count("\n") == 1 and err.startswith(f"extkv {command}: error: "), (argv, err)
    assert repr(value) in err and expected in err and "Traceback" not in err, (argv, err)
    assert tree(where) == before, f"extkv {' '.join(argv)} created {tree(where) - before}"


@pytest.mark.parametrize("option", ["--host-workers", "--gpu-workers"])
@pytest.mark.parametrize("value", ["0", "-1", "many", "cores+1"])
def test_check_refuses_worker_counts_outside_one_to_the_cores(tmp_path, capsys, option, value):
    value = str(CORES + 1) if value == "cores+1" else value
    expected = f"expected a whole number of workers from 1 to {CORES}"
    refused(capsys, ["check", option, value, "--report-dir", str(tmp_path / "run")], value, expected, tmp_path)


@pytest.mark.parametrize(("command", "option"), [("stress", "--minutes"), ("reference", "--stress-minutes")])
@pytest.mark.parametrize("value", ["inf", "nan", "0", "-1", "-inf", "soon"])
def test_time_bounds_must_be_finite_and_positive(tmp_path, capsys, command, option, value):
    argv = [command, f"{option}={value}", "--report-dir", str(tmp_path / "run")]
    refused(capsys, argv, value, "expected a finite number of minutes > 0", tmp_path)


@pytest.mark.parametrize("value", ["0", "-3", "two"])
def test_bench_refuses_rounds_below_one(tmp_path, capsys, value):
    refused(capsys, ["bench", f"--rounds={value}", "--report-dir", str(tmp_path / "run")], value, "expected a whole number >= 1", tmp_path)


def report_dir_cases(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Each kind of unusable run directory: (path, what the refusal says)."""
    regular = tmp_path / "regular"
    regular.write_text("")
    unwritable = unwritable_directory(tmp_path)
    return {
        "a file": (regular, "is a regular file; expected a directory"),
        "under a file": (regular / "run", f"cannot be made: {regular} is a regular file, not a directory"),
        "unwritable": (unwritable, "is a directory this process cannot write"),
        "under an unwritable directory": (unwritable / "run", f"cannot be made: {unwritable} is a directory this process cannot write"),
    }


@pytest.mark.parametrize("command", sorted(REPORT_DIR_COMMANDS))
@pytest.mark.parametrize("kind", ["a file", "under a file", "unwritable", "under an unwritable directory"])
def test_unusable_report_dirs_are_refused(tmp_path, capsys, command, kind):
    path, expected = report_dir_cases(tmp_path)[kind]
    argv = [command, *REPORT_DIR_COMMANDS[command], "--report-dir", str(path)]
    refused(capsys, argv, str(path), expected, tmp_path)


@pytest.mark.parametrize("command", ["check", "bench", "stress"])
def test_a_report_dir_holding_files_needs_overwrite(tmp_path, capsys, command):
    held = tmp_path / "held"
    held.mkdir()
    (held / "check.json").write_text("{}")
    argv = [command, *REPORT_DIR_COMMANDS[command], "--report-dir", str(held)]
    refused(capsys, argv, str(held), "is not empty (it holds check.json): pass --overwrite", tmp_path)


@pytest.mark.parametrize("kind", ["a file", "under a file", "unwritable", "under an unwritable directory"])
def test_pool_refuses_an_unusable_out_dir(tmp_path, capsys, kind):
    path, expected = report_dir_cases(tmp_path)[kind]
    runs = [tmp_path / "a", tmp_path / "b"]
    for run in runs:
        run.mkdir()
    refused(capsys, ["pool", str(path), *map(str, runs)], str(path), expected, tmp_path)


@pytest.mark.parametrize("kind", ["missing", "a file"])
def test_report_and_pool_refuse_a_run_dir_that_is_no_directory(tmp_path, capsys, kind):
    run = tmp_path / "run"
    expected = "does not exist; expected a run directory"
    if kind == "a file":
        run.write_text("")
        expected = "is a regular file; expected a run directory"
    refused(capsys, ["report", str(run)], str(run), expected, tmp_path)
    (tmp_path / "b").mkdir()
    refused(capsys, ["pool", str(tmp_path / "out"), str(tmp_path / "b"), str(run)], str(run), expected, tmp_path)


def test_report_refuses_a_run_dir_it_cannot_write_its_summary_into(tmp_path, capsys):
    unwritable = unwritable_directory(tmp_path)
    refused(capsys, ["report", str(unwritable)], str(unwritable), "this process cannot write its summary.md into", tmp_path)


BUDGET_EXPECTED = "expected bytes (a whole number, or a number with KiB, MiB, GiB or TiB: 96GiB) or a share"


@pytest.mark.parametrize("value", ["0", "-1", "1.5", "0%", "101%", "nan%", "96GB", "lots", "1e9"])
def test_budget_serve_refuses_a_budget_that_is_no_size(tmp_path, capsys, value):
    argv = ["budget", "serve", "--device", "host", "--budget", value, "--run-dir", str(tmp_path / "run")]
    refused(capsys, argv, value, BUDGET_EXPECTED, tmp_path)


@pytest.mark.parametrize("command", ["serve", "status"])
@pytest.mark.parametrize("value", ["gpu", "cuda:x", "cuda:-1", "cpu:0", ""])
def test_budget_refuses_a_device_it_cannot_serve(tmp_path, capsys, command, value):
    argv = ["budget", command, "--device", value, "--run-dir", str(tmp_path / "run")]
    argv += ["--budget", "1GiB"] if command == "serve" else []
    refused(capsys, argv, value, "expected host, cuda:N or a GPU's UUID (GPU-...)", tmp_path)


@pytest.mark.parametrize("value", ["-1", "root", "1.5", ""])
def test_budget_serve_refuses_an_allowed_uid_that_is_no_uid(tmp_path, capsys, value):
    argv = ["budget", "serve", "--device", "host", "--budget", "1GiB", "--run-dir", str(tmp_path / "run"),
            "--allow-uid", value]
    refused(capsys, argv, value, "expected a user id (a whole number >= 0)", tmp_path)


def run_dir_cases(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Run directories the budget refuses: (path, what the refusal says)."""
    open_to_group = tmp_path / "open"
    open_to_group.mkdir(mode=0o750)
    open_to_group.chmod(0o750)
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(private)
    regular = tmp_path / "regular"
    regular.write_text("")
    return {
        "open to its group": (open_to_group, "has mode 0750, which lets group or others in"),
        "a symlink": (link, "is a symlink, not a directory of its own"),
        "a file": (regular, "is not a directory"),
        "under a file": (regular / "run", f"cannot be made: {regular} is a regular file, not a directory"),
    }


@pytest.mark.parametrize("command", ["serve", "status"])
@pytest.mark.parametrize("kind", ["open to its group", "a symlink", "a file", "under a file"])
def test_budget_refuses_a_run_dir_others_could_reach(tmp_path, capsys, command, kind):
    path, expected = run_dir_cases(tmp_path)[kind]
    argv = ["budget", command, "--run-dir", str(path)] + (["--device", "host", "--budget", "1GiB"] if command == "serve" else [])
    refused(capsys, argv, str(path), expected, tmp_path)


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_budget_status_refuses_a_timeout_that_is_no_duration(tmp_path, capsys, value):
    refused(capsys, ["budget", "status", f"--timeout={value}"], value, "expected a finite number of seconds > 0", tmp_path)


#: What a user types first; none of it needs torch.
LIGHT_COMMANDS = [["--help"], ["--version"]] + [
    [name, "--help"] for name in ("info", "check", "bench", "stress", "reference", "report", "pool", "peer", "budget")
] + [["budget", "serve", "--help"], ["budget", "status", "--help"]]


def test_help_and_version_import_no_torch():
    """One process runs them all, then lists the torch modules it holds."""
    script = (
        "import json, sys\n"
        "from extkv import cli\n"
        f"for argv in {LIGHT_COMMANDS!r}:\n"
        "    try:\n"
        "        cli.main(argv)\n"
        "    except SystemExit as exited:\n"
        "        assert exited.code in (0, None), (argv, exited.code)\n"
        "print(json.dumps(sorted(name for name in sys.modules if name.split('.')[0] == 'torch')))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr
    torch_modules = json.loads(result.stdout.splitlines()[-1])
    assert torch_modules == [], f"`extkv --help` and friends imported {len(torch_modules)} torch modules"


def test_peer_timeout_default_is_extkv_peers():
    from extkv.peer import DEFAULT_PEER_TIMEOUT_S

    assert cli.DEFAULT_PEER_TIMEOUT_S == DEFAULT_PEER_TIMEOUT_S


def test_lazy_names_are_the_ones_type_checkers_read():
    """extkv/__init__.py names each export twice: imports under
    TYPE_CHECKING, and _EXPORTS for the lazy lookup. They must agree, and
    each lazy name must resolve."""
    tree_ = ast.parse((Path(extkv.__file__)).read_text())
    typed = {}
    for node in ast.walk(tree_):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for statement in node.body:
                typed |= {alias.name: "." * statement.level + statement.module for alias in statement.names}
    lazy = {name: module for module, names in extkv._EXPORTS.items() for name in names}
    assert typed == lazy
    assert sorted(extkv.__all__, key=str.lower) == sorted(lazy, key=str.lower)
    for name in lazy:
        assert getattr(extkv, name) is not None
