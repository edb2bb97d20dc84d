"""Paths as a report shows them: relative to the checkout or the run, never
the machine's own.

Theory of operation
-------------------
A run records the commands it ran with the absolute paths they were given:
pytest's suite directory, `--junitxml` and `--extkv-report-dir` under the
run directory, the python executable. A report is read on other machines
than the one that made it (the references are committed), where those paths
name nothing and only say where the run happened to be. `portable_command`
rewrites every absolute path of a recorded command: one under the checkout
(the directory holding the suite the command ran, found by
`recorded_checkout`) relative to it, as pytest, which runs there, reads it;
one under the run directory, where the run lay outside the checkout, as
`<run>/...`; any other (an interpreter, a virtualenv) by its name alone.
The recorded files keep their paths: only the rendered text drops them.
"""

from __future__ import annotations

import shlex
from pathlib import PurePosixPath

from .rundir import SUITE_PACKAGES

#: Directory names of the suites, in a checkout and installed.
SUITE_NAMES = frozenset(SUITE_PACKAGES) | frozenset(SUITE_PACKAGES.values())
#: How a path under the run directory (outside the checkout) is shown.
RUN_DIR_SHOWN = "<run>"


def recorded_checkout(arguments: list[str]) -> PurePosixPath | None:
    """The directory holding the suite a recorded command ran: the part of
    its first absolute path argument (not an option) before a suite's name;
    None where no argument names a suite."""
    for argument in arguments:
        if argument.startswith("-") or not argument.startswith("/"):
            continue
        parts = PurePosixPath(argument).parts
        for index in range(len(parts) - 1, 0, -1):
            if parts[index] in SUITE_NAMES:
                return PurePosixPath(*parts[:index])
    return None


def option_value(arguments: list[str], option: str) -> str | None:
    """The value of `option` (`--name=value` or `--name value`) in a recorded command, or None."""
    for index, argument in enumerate(arguments):
        if argument.startswith(option + "="):
            return argument[len(option) + 1:]
        if argument == option and index + 1 < len(arguments):
            return arguments[index + 1]
    return None


def portable_path(value: str, checkout: PurePosixPath | None, run_dir: PurePosixPath | None) -> str:
    """`value` shown without the machine's own directories (see the module's doc)."""
    if not value.startswith("/"):
        return value
    path = PurePosixPath(value)
    if checkout is not None and path.is_relative_to(checkout):
        return str(path.relative_to(checkout))
    if run_dir is not None and path.is_relative_to(run_dir):
        return str(PurePosixPath(RUN_DIR_SHOWN, path.relative_to(run_dir)))
    return path.name


def portable_command(
    arguments: list[str], checkout: PurePosixPath | None = None, run_dir: PurePosixPath | str | None = None
) -> list[str]:
    """`arguments` with every absolute path shown by `portable_path`, also
    the value of an `--option=/path`. `checkout` defaults to the arguments'
    `recorded_checkout`, `run_dir` to their `--extkv-report-dir`."""
    checkout = checkout if checkout is not None else recorded_checkout(arguments)
    run_dir = run_dir if run_dir is not None else option_value(arguments, "--extkv-report-dir")
    run_path = PurePosixPath(run_dir) if run_dir is not None else None
    shown = []
    for argument in arguments:
        option, equals, value = argument.partition("=") if argument.startswith("-") else ("", "", argument)
        shown.append(option + equals + portable_path(value, checkout, run_path) if equals or not option else argument)
    return shown


def portable_command_line(command_line: str, checkout: PurePosixPath | None, run_dir: PurePosixPath | str | None) -> str:
    """A command line as typed (one string), shown by `portable_command`."""
    try:
        arguments = shlex.split(command_line)
    except ValueError:  # unbalanced quotes: a hand-edited record; show no path of it
        return " ".join(portable_path(word, checkout, None) for word in command_line.split())
    return shlex.join(portable_command(arguments, checkout, run_dir))
