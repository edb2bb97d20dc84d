"""README.md's code, run as written.

Theory of operation
-------------------
A new user's first minutes are the README's first screen: two commands, then
a library example. Both are checked here against the code, so they cannot
drift from it:

- every ```python block of README.md runs, in a fresh interpreter of its own
  (one whose first line says `# needs extkv[EXTRA]` only where EXTRA is
  installed)
  (the block is a script: it imports what it uses), from an empty directory,
  with no GPU visible, so it runs on the host driver as it does on a machine
  without one, and takes no memory from the GPU tests beside it. A block that
  raises, asserts or exits nonzero fails its test, with its output;
- the commands of its first ```bash block are the ones CI runs: .ci/run
  installs what the README installs and runs the README's test command.

From an installed package (no README beside extkv) there is nothing to run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import extkv

pytestmark = pytest.mark.harness

ROOT = Path(extkv.__file__).resolve().parent.parent
README = ROOT / "README.md"
CI = ROOT / ".ci" / "run"
#: Seconds one block may take: the example imports torch and commits 192 MiB.
BLOCK_TIMEOUT_S = 300


def fenced_blocks(text: str, language: str) -> list[tuple[int, str]]:
    """(first line number, code) of every ```language block of `text`."""
    return [
        (text.count("\n", 0, found.start()) + 2, found.group(1))
        for found in re.finditer(rf"^```{language}[ \t]*\n(.*?)^```[ \t]*$", text, re.S | re.M)
    ]


def _readme_text() -> str:
    if not README.is_file():
        pytest.skip(f"no README.md beside the extkv package in {ROOT} (an installed extkv): checked from a checkout")
    return README.read_text()


_PYTHON_BLOCKS = fenced_blocks(README.read_text(), "python") if README.is_file() else []


def test_readme_has_a_python_example():
    assert fenced_blocks(_readme_text(), "python"), f"{README} has no ```python block: the library example is gone"


#: A block's first line naming the extra it needs: `# needs extkv[transformers]`.
_NEEDS = re.compile(r"#\s*needs extkv\[(\w+)\]")


@pytest.mark.parametrize(("line", "code"), _PYTHON_BLOCKS, ids=[f"README.md:{line}" for line, _ in _PYTHON_BLOCKS])
def test_python_block_runs(line, code, tmp_path):
    needs = _NEEDS.match(code)
    if needs is not None:
        # The extra's module shares its name (pyproject's extras).
        pytest.importorskip(needs.group(1), reason=f"README.md:{line} needs extkv[{needs.group(1)}], not installed")
    script = tmp_path / f"readme_line_{line}.py"
    script.write_text(code)
    # No GPU: the block picks the host driver, as on a machine without one.
    # It runs in tmp_path, so a relative PYTHONPATH entry (`PYTHONPATH=.` in
    # a checkout) is made absolute: the block imports the extkv under test.
    path = [os.path.abspath(entry) for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join(path)}
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S
    )
    assert result.returncode == 0, (
        f"README.md's python block at line {line} exited {result.returncode}:\n"
        f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    )


def _readme_commands() -> list[str]:
    bash = fenced_blocks(_readme_text(), "bash")
    assert bash, "README.md has no ```bash block: the fresh-machine commands are gone"
    return [line.split("#")[0].strip() for line in bash[0][1].splitlines() if line.split("#")[0].strip()]


def test_readme_commands_install_the_report_extra_and_run_the_suite():
    commands = _readme_commands()
    assert len(commands) == 2, f"README.md's first screen gives two commands (check, tests), found {commands}"
    check, tests = commands
    assert check.endswith("extkv check"), check
    assert tests.endswith("python3 -m pytest -q"), tests
    for command in commands:
        # matplotlib (the report extra) draws the report's plots.
        assert re.search(r"\.\[[^\]]*\breport\b", command), f"{command!r} does not install the report extra"
        assert re.search(r"\.\[[^\]]*\btest\b", command), f"{command!r} does not install the test extra"


def test_ci_runs_the_readme_commands():
    if not CI.is_file():
        pytest.skip(f"no .ci/run in {ROOT} (an installed extkv): checked from a checkout")
    ci = CI.read_text()
    _, tests = _readme_commands()
    install, _, run = tests.partition(" && ")
    what = re.search(r"-e\s+\S+", install).group(0)  # -e '.[test,report]'
    installs = [line for line in ci.splitlines() if "pip install" in line and not line.lstrip().startswith("#")]
    assert any(f" {what}" in line for line in installs), (
        f".ci/run does not install {what} as README.md does; its installs: {installs}"
    )
    assert re.search(rf"^{re.escape(run)}$", ci, re.M), f".ci/run does not run README.md's test command {run!r}"
