"""README.md's and docs/*.md's code, run as written, and their links.

Theory of operation
-------------------
A reader copies what the pages show, so every fenced block is checked
against the code it describes, by its language:

- ```python blocks run, each a script in a fresh interpreter, from an empty
  directory, with no GPU visible: on the host driver, as on a machine
  without one, taking no memory from the GPU tests beside them. A first
  line `# needs extkv[EXTRA]` skips the block where EXTRA is not installed.
  Each `# prints: TEXT` comment is a line the block prints, in order, and it
  prints nothing else; a block that raises or asserts fails.
- ```bash blocks must parse (`bash -n`), and every command in them must
  exist: its program (on PATH, or a shell builtin), `python3 -m MODULE`
  importable, `extkv SUBCOMMAND` with options its --help names (or, for a
  subcommand that hands the rest to pytest, pytest's), pytest's and
  pytest-benchmark's options and the paths given to pytest, and extras of
  extkv that pyproject.toml declares. They are not run: they install
  packages or take minutes.
- ```console blocks run: `$ COMMAND`, then its output (stdout and stderr
  together), then `[exit status N]` where it is not 0. In the output, `...`
  in a line matches any text and a line of only `...` any lines.
- ```text blocks illustrate output of runs too long for a test (a verdict);
  they are not run. Any other language fails: nothing goes unchecked by
  being labelled otherwise.

Relative links must reach a file of the checkout and, with `#anchor`, a
heading of it (GitHub's slugs). The README's install and quick start are
also held to .ci/run: CI installs what the README installs, torch first,
and runs the README's test command.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from importlib import util
from pathlib import Path

import pytest

pytestmark = pytest.mark.harness

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
CI = ROOT / ".ci" / "run"
#: Seconds one block or command may take: an example imports torch and commits 192 MiB.
RUN_TIMEOUT_S = 300
LANGUAGES = ("python", "bash", "console", "text")
#: A block's first line naming the extra it needs: `# needs extkv[transformers]`.
NEEDS = re.compile(r"#\s*needs extkv\[(\w+)\]")
PRINTS = re.compile(r"#\s*prints:\s?(.*)$", re.M)
EXIT_STATUS = re.compile(r"\[exit status (\d+)\]")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int        # of the block's first code line
    language: str
    code: str

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def fenced_blocks(page: Path, text: str | None = None) -> list[Block]:
    text = page.read_text() if text is None else text
    return [
        Block(page, text.count("\n", 0, found.start()) + 2, found.group(1), found.group(2))
        for found in re.finditer(r"^```([\w-]*)[ \t]*\n(.*?)^```[ \t]*$", text, re.S | re.M)
    ]


BLOCKS = [block for page in PAGES for block in fenced_blocks(page)]


def blocks_of(language: str) -> list:
    found = [block for block in BLOCKS if block.language == language]
    return [pytest.param(block, id=str(block)) for block in found]


def matches(expected: list[str], printed: str) -> bool:
    """Whether `printed` is `expected`, line by line, with `...` matching
    any text in a line and a line of only `...` any lines."""
    pattern = "".join(
        r"(?:.*\n)*" if line.strip() == "..."
        else re.escape(line.rstrip()).replace(re.escape("..."), ".*") + r"[ \t]*\n"
        for line in expected
    )
    lines = printed.splitlines()
    return re.fullmatch(pattern, "".join(line + "\n" for line in lines)) is not None


def environment() -> dict[str, str]:
    """No GPU, and the extkv under test: a relative PYTHONPATH entry
    (`PYTHONPATH=.` in a checkout) made absolute, since blocks run elsewhere."""
    path = [os.path.abspath(entry) for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join([*path, str(ROOT)])}


def test_the_pages_have_blocks_of_known_languages():
    assert any(block.language == "python" for block in fenced_blocks(README)), "README.md has no python example"
    unknown = [f"{block}: ```{block.language}" for block in BLOCKS if block.language not in LANGUAGES]
    assert not unknown, f"blocks of a language this test does not check (one of {LANGUAGES}): {unknown}"


# -- python ------------------------------------------------------------------

@pytest.mark.parametrize("block", blocks_of("python"))
def test_python_block_prints_what_it_says(block, tmp_path):
    needs = NEEDS.match(block.code)
    if needs is not None:
        # The extra's module shares its name (pyproject's extras).
        pytest.importorskip(needs.group(1), reason=f"{block} needs extkv[{needs.group(1)}], not installed")
    script = tmp_path / "block.py"
    script.write_text(block.code)
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=environment(),
                            capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, (
        f"{block} exited {result.returncode}:\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    )
    said = PRINTS.findall(block.code)
    assert matches(said, result.stdout), (
        f"{block} says it prints\n" + "\n".join(said) + f"\nbut printed\n{result.stdout}"
    )


# -- console -----------------------------------------------------------------

def console_commands(block: Block) -> list[tuple[str, list[str], int]]:
    """(command, expected output lines, expected exit status) of each `$ ` line."""
    commands: list[tuple[str, list[str], int]] = []
    for line in block.code.splitlines():
        if line.startswith("$ "):
            commands.append((line[2:], [], 0))
        elif not commands:
            raise AssertionError(f"{block}: output before any `$ ` command: {line!r}")
        elif EXIT_STATUS.fullmatch(line.strip()):
            command, output, _ = commands[-1]
            commands[-1] = (command, output, int(EXIT_STATUS.fullmatch(line.strip()).group(1)))
        else:
            commands[-1][1].append(line)
    return commands


def argv_of(command: str) -> list[str]:
    """The command as this test runs it: `extkv` and `python3` are the
    extkv and the interpreter under test."""
    words = shlex.split(command)
    if words[0] == "extkv":
        return [sys.executable, "-m", "extkv", *words[1:]]
    if words[0] in ("python", "python3"):
        return [sys.executable, *words[1:]]
    return [shutil.which(words[0], path=search_path()) or words[0], *words[1:]]


def search_path() -> str:
    """PATH, after the directory of the interpreter under test (its virtualenv's scripts)."""
    return os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])


@pytest.mark.parametrize("block", blocks_of("console"))
def test_console_block_prints_what_it_says(block, tmp_path):
    commands = console_commands(block)
    assert commands, f"{block} holds no `$ ` command"
    for command, expected, status in commands:
        result = subprocess.run(argv_of(command), cwd=tmp_path, env=environment(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, timeout=RUN_TIMEOUT_S)
        assert (result.returncode, matches(expected, result.stdout)) == (status, True), (
            f"{block}: `{command}` should exit {status} and print\n" + "\n".join(expected)
            + f"\nbut exited {result.returncode} and printed\n{result.stdout}"
        )


# -- bash --------------------------------------------------------------------

def shell_commands(code: str) -> list[list[str]]:
    """The simple commands of a shell block, each as its words (leading
    `NAME=value` assignments dropped), split at lines, `&&`, `||`, `;`, `|`
    and parentheses."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words: list[str] = []
        for token in [*lexer, ";"]:
            if token.strip("();<>|&"):
                words.append(token)
                continue
            while words and re.fullmatch(r"\w+=.*", words[0]):
                words.pop(0)
            if words:
                commands.append(words)
            words = []
    return commands


@functools.cache
def help_text(*argv: str) -> str:
    result = subprocess.run([*argv_of(shlex.join(argv)), "--help"], cwd=ROOT, env=environment(), capture_output=True,
                            text=True, timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, f"`{shlex.join(argv)} --help` exited {result.returncode}:\n{result.stderr}"
    return result.stdout


def unknown_options(words: list[str], *helps: str) -> list[str]:
    options = [word.split("=")[0] for word in words if re.fullmatch(r"--?[A-Za-z][\w-]*(=.*)?", word)]
    return [f"no option {option}" for option in options
            if not any(re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text) for text in helps)]


def extkv_extras() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def command_problems(words: list[str]) -> list[str]:
    """What does not exist in one command of a shell block; [] when it all does."""
    program, args = words[0], words[1:]
    if program in ("python", "python3") and args[:1] == ["-m"]:
        program, args = args[1], args[2:]
        if util.find_spec(program) is None:
            return [f"no module {program}"]
    elif program != "extkv" and shutil.which(program, path=search_path()) is None:
        builtin = subprocess.run(["bash", "-c", f"type -t {shlex.quote(program)}"], capture_output=True, text=True)
        return [] if builtin.stdout.strip() == "builtin" else [f"no program {program}"]
    if program == "extkv" and args and not args[0].startswith("-"):
        named = args[:1]
        choices = re.search(r"\{([\w,-]+)\}", help_text("extkv", *named))
        if len(args) > 1 and choices and args[1] in choices.group(1).split(","):
            named = args[:2]  # a command of commands: `extkv budget serve`
        own = help_text("extkv", *named)
        passes_on = "go to pytest" in own
        return unknown_options(args[len(named):], own, *([help_text("python3", "-m", "pytest")] if passes_on else []))
    if program == "pytest":
        paths = [arg for arg in args if not arg.startswith("-") and ("/" in arg or arg.endswith(".py"))]
        return unknown_options(args, help_text("python3", "-m", "pytest")) + [
            f"no path {path}" for path in paths if not (ROOT / path.split("::")[0]).exists()
        ]
    if program == "pytest-benchmark":
        subcommand = [arg for arg in args if arg in ("list", "compare")]
        return unknown_options(args, help_text("pytest-benchmark"), *(help_text("pytest-benchmark", *subcommand[:1]),))
    if program == "pip" and args[:1] == ["install"]:
        problems = []
        for arg in args[1:]:
            package = re.fullmatch(r"(\.|extkv)\[([\w,]+)\]", arg)
            if package is not None:
                problems += [f"no extra {extra} in pyproject.toml" for extra in
                             set(package.group(2).split(",")) - extkv_extras()]
        return problems
    return []


@pytest.mark.parametrize("block", blocks_of("bash"))
def test_bash_block_names_commands_that_exist(block):
    parsed = subprocess.run(["bash", "-n"], input=block.code, capture_output=True, text=True)
    assert parsed.returncode == 0, f"{block} does not parse: {parsed.stderr}"
    problems = [f"`{shlex.join(words)}`: {problem}" for words in shell_commands(block.code)
                for problem in command_problems(words)]
    assert not problems, f"{block}: " + "; ".join(problems)


# -- links -------------------------------------------------------------------

def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    prose = re.sub(r"^```.*?^```[ \t]*$", "", page.read_text(), flags=re.S | re.M)
    return {slug(heading) for heading in re.findall(r"^#{1,6} (.+)$", prose, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=[str(page.relative_to(ROOT)) for page in PAGES])
def test_links_reach_a_file_and_heading(page):
    prose = re.sub(r"^```.*?^```[ \t]*$", "", page.read_text(), flags=re.S | re.M)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", prose):
        if re.match(r"[a-z]+:", target):
            continue  # a web address
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no file {linked}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {linked.name}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


# -- the README's first minutes, and CI ---------------------------------------

def section_commands(heading: str) -> list[list[str]]:
    found = re.search(rf"(?ms)^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", README.read_text())
    assert found, f"README.md has no `## {heading}` section"
    return [words for block in fenced_blocks(README, found.group(1)) if block.language == "bash"
            for words in shell_commands(block.code)]


def test_quick_start_is_the_check_and_the_tests():
    commands = [shlex.join(words) for words in section_commands("Quick start")]
    assert commands == ["extkv check", "python3 -m pytest -q"], f"README.md's quick start: {commands}"


def installs(commands: list[list[str]]) -> list[str]:
    """What each `pip install` installs, in order: `torch`, `.[test,report]`."""
    found = []
    for words in commands:
        if words[:3] == ["python3", "-m", "pip"]:
            words = words[2:]
        if words[:2] == ["pip", "install"]:
            found += [word for word in words[2:] if not word.startswith("-") and not word.startswith("http")]
    return found


def test_install_puts_torch_first_then_extkv_with_its_test_extras():
    commands = section_commands("Install")
    assert any("https://download.pytorch.org/whl/cpu" in words for words in commands), (
        "README.md's install gives no CPU build of torch"
    )
    packages = installs(commands)
    extkv = [package for package in packages if package.startswith(".[")]
    assert extkv and {"test", "report"} <= set(extkv[0][2:-1].split(",")), f"extkv's install: {packages}"
    torch = packages.index(next(package for package in packages if package.startswith("torch")))
    assert torch < packages.index(extkv[0]), f"README.md installs extkv before torch: {packages}"


def test_ci_installs_and_tests_as_the_readme_says():
    if not CI.is_file():
        pytest.skip(f"no .ci/run in {ROOT}")
    ci = shell_commands(CI.read_text())
    packages = installs(ci)
    readme = [package for package in installs(section_commands("Install")) if package.startswith(".[")][0]
    assert readme in packages, f".ci/run does not install {readme} as README.md does; it installs {packages}"
    assert any(package.startswith("torch") for package in packages[:packages.index(readme)]), (
        f".ci/run does not install torch before extkv: {packages}"
    )
    tests = section_commands("Quick start")[1]
    assert tests in ci, f".ci/run does not run README.md's test command {shlex.join(tests)!r}"
