"""The `extkv` command as a new user meets it.

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
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import extkv
from extkv import cli

ROOT = Path(extkv.__file__).resolve().parent.parent
#: Subcommands that hand what they do not know to pytest.
PYTEST_COMMANDS = ("check", "bench", "stress")
SUBCOMMANDS = ("info", *PYTEST_COMMANDS, "report", "pool", "peer")


def run_main(capsys, *argv: str) -> str:
    """`extkv ARGV...` in this process: what it printed. --help and --version
    exit through SystemExit(0)."""
    with pytest.raises(SystemExit) as exited:
        cli.main(list(argv))
    assert exited.value.code in (0, None), f"extkv {' '.join(argv)} exited {exited.value.code}"
    return capsys.readouterr().out


def test_version_names_the_installed_version(capsys):
    out = run_main(capsys, "--version")
    assert out.startswith(f"extkv {metadata.version('extkv')}"), out


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

