"""What the `extkv` command takes, checked before anything runs.

Theory of operation
-------------------
Each kind of value a subcommand takes has one validator here, an argparse
`type=` that every subcommand taking that value shares: worker counts, time
bounds, run counts, directories to write a run into and directories to read
one from. A refused value is one line on stderr naming it and what was
expected, exit status 2 (`Parser.error`), with nothing created: the checks
look (stat, access) and never make a directory. What depends on two options
at once (a --report-dir that holds files, without --overwrite) is checked
right after parsing through the same `report_dir_problem`, which
extkv.runs.rundir asks again when it makes the directory, since the
file system may have changed in between.

Only the standard library (and extkv.files and extkv.validate, which import
nothing else of extkv) is imported here, so `extkv --help` and every
subcommand's --help cost no torch.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import stat
from pathlib import Path
from typing import NamedTuple

from .files import PRIVATE_DIRECTORY_EXPECTED, private_directory_problem
from .validate import BYTE_SIZE_EXPECTED, byte_size

#: What a file that is not what was expected is, in words, by its stat.S_IS* test.
FILE_KINDS = [
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISREG, "a regular file"),
    (stat.S_ISLNK, "a symlink"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
]
#: The longest path an AF_UNIX address holds (sun_path, less its NUL), on Linux.
UNIX_PATH_MOST_BYTES = 107
#: Names of a directory's entries a refusal shows, before a count of the rest.
SHOWN_NAMES = 5


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line, `extkv check: error:
    argument --host-workers: '0': expected ...`, and exit status 2: the
    usage text argparse prints first is --help's business, and a script
    reading stderr gets the reason alone."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def file_kind(mode: int) -> str:
    return next((words for test, words in FILE_KINDS if test(mode)), "not a regular file or directory")


def usable_cores() -> int:
    """The cores this process may run on (its affinity, not the machine's count)."""
    return len(os.sched_getaffinity(0))


def worker_count(text: str) -> int:
    """--host-workers, --gpu-workers: xdist workers, 1 to the usable cores
    (more only wait for each other and multiply memory)."""
    most = usable_cores()
    try:
        count = int(text)
    except ValueError:
        count = 0
    if not 1 <= count <= most:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a whole number of workers from 1 to {most} (the cores this process may run on)"
        )
    return count


def run_count(text: str) -> int:
    """--rounds: a whole number >= 1."""
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number >= 1")
    return count


def _duration(text: str, unit: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    # `not > 0` refuses nan too; a bound of inf minutes is no bound.
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a finite number of {unit} > 0")
    return value


def minutes(text: str) -> float:
    """--minutes, --stress-minutes: a finite time bound > 0."""
    return _duration(text, "minutes")


def seconds(text: str) -> float:
    """--timeout: a finite number of seconds > 0."""
    return _duration(text, "seconds")


def socket_path(text: str) -> str:
    """`peer --peer`: the path of a Unix socket, checked before the peer
    starts so that a mistyped path is a usage error naming it, not a
    traceback from connect() (which names no path)."""
    expected = "expected the Unix socket a SegmentExportConnector listens on"
    try:
        status = os.stat(text)
    except (OSError, ValueError) as error:  # ValueError: a NUL in the path
        reason = error.strerror if isinstance(error, OSError) else str(error)
        raise argparse.ArgumentTypeError(f"{text!r}: {reason}; {expected}") from None
    if not stat.S_ISSOCK(status.st_mode):
        raise argparse.ArgumentTypeError(f"{text!r} is {file_kind(status.st_mode)}; {expected}")
    if len(os.fsencode(text)) > UNIX_PATH_MOST_BYTES:
        raise argparse.ArgumentTypeError(
            f"{text!r} is {len(os.fsencode(text))} bytes, more than the {UNIX_PATH_MOST_BYTES} an AF_UNIX "
            "address holds; name the socket by a shorter path (a relative one, or a symlink)"
        )
    return text


def _stat(path: str) -> os.stat_result | None | str:
    """`path`'s stat (through symlinks, as the run code follows them), None
    when nothing is there, or why it cannot be looked at."""
    try:
        return os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as error:
        return f"cannot be looked at ({error.strerror})"
    except ValueError as error:  # a NUL in the path
        return f"is no path ({error})"


def report_dir_problem(path: Path | str, may_hold_files: bool) -> str | None:
    """Why `path` cannot be a run's directory, in words that follow its
    name, or None: it must be a directory this process can write (or one it
    can make: its nearest existing ancestor a writable directory), holding
    no files unless `may_hold_files`."""
    path = os.path.abspath(os.fspath(path))
    found = _stat(path)
    if isinstance(found, str):
        return found
    if found is not None:
        if not stat.S_ISDIR(found.st_mode):
            return f"is {file_kind(found.st_mode)}; expected a directory"
        if not os.access(path, os.W_OK | os.X_OK):
            return "is a directory this process cannot write"
        if not may_hold_files:
            try:
                held = sorted(os.listdir(path))
            except OSError as error:
                return f"cannot be listed ({error.strerror})"
            if held:
                shown = ", ".join(held[:SHOWN_NAMES])
                more = f" and {len(held) - SHOWN_NAMES} more" if len(held) > SHOWN_NAMES else ""
                return (
                    f"is not empty (it holds {shown}{more}): pass --overwrite to replace this run's files there, "
                    "or name an empty or new directory"
                )
        return None
    for ancestor in Path(path).parents:
        found = _stat(str(ancestor))
        if found is None:
            continue
        if isinstance(found, str):
            return f"cannot be made: {ancestor} {found}"
        if not stat.S_ISDIR(found.st_mode):
            return f"cannot be made: {ancestor} is {file_kind(found.st_mode)}, not a directory"
        if not os.access(ancestor, os.W_OK | os.X_OK):
            return f"cannot be made: {ancestor} is a directory this process cannot write"
        return None
    return "cannot be made: none of its ancestors exists"


def _refusing(problem: str | None, text: str) -> None:
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{text!r} {problem}")


def report_directory(text: str) -> Path:
    """--report-dir, `pool`'s OUT_DIR: a directory to write a run into, new
    or a writable directory (whether it may hold files is `--overwrite`'s
    call, checked after parsing: `refuse_held_report_dir`)."""
    _refusing(report_dir_problem(text, may_hold_files=True), text)
    return Path(text)


def run_directory(text: str) -> Path:
    """A run directory to read (`pool`'s RUN_DIR): it must be a directory."""
    found = _stat(text)
    if found is None:
        _refusing("does not exist; expected a run directory", text)
    elif isinstance(found, str):
        _refusing(found, text)
    elif not stat.S_ISDIR(found.st_mode):
        _refusing(f"is {file_kind(found.st_mode)}; expected a run directory", text)
    return Path(text)


def run_directory_to_render(text: str) -> Path:
    """`report`'s DIR: a run directory, which its summary.md and plots are
    written into."""
    run_directory(text)
    if not os.access(text, os.W_OK | os.X_OK):
        _refusing("is a run directory this process cannot write its summary.md into", text)
    return Path(text)


def refuse_held_report_dir(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """After parsing: a --report-dir that holds files, without --overwrite,
    is a usage error of `parser` (the subcommand's)."""
    if args.report_dir is None:
        return
    problem = report_dir_problem(args.report_dir, may_hold_files=args.overwrite)
    if problem is not None:
        parser.error(f"argument --report-dir: {str(args.report_dir)!r} {problem}")


# -- extkv budget -----------------------------------------------------------------
#: Binary units a budget may be given in, by their multiple of a byte.
_BUDGET_EXPECTED = f"expected {BYTE_SIZE_EXPECTED} or a share of the device's memory above 0 and at most 100% (80%)"


class BudgetSize(NamedTuple):
    """`--budget`: `nbytes`, or `percent` of the device's total memory."""

    nbytes: int | None
    percent: float | None

    def bytes_of(self, total_bytes: int) -> int:
        """The budget on a device of `total_bytes`."""
        return self.nbytes if self.nbytes is not None else int(total_bytes * self.percent / 100)


def budget_size(text: str) -> BudgetSize:
    """`budget serve --budget`: 96GiB, 1073741824, or 80% of the device."""
    share = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*%\s*", text)
    if share is not None and 0 < float(share.group(1)) <= 100:
        return BudgetSize(None, float(share.group(1)))
    nbytes = byte_size(text)
    if nbytes:
        return BudgetSize(nbytes, None)
    raise argparse.ArgumentTypeError(f"{text!r}: {_BUDGET_EXPECTED}")


def budget_device(text: str) -> str:
    """`budget --device`: host, cuda, cuda:N, or a GPU's UUID."""
    if text == "host" or text.startswith("GPU-") or re.fullmatch(r"cuda(:\d+)?", text):
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: expected host, cuda:N or a GPU's UUID (GPU-...)")


def user_id(text: str) -> int:
    """`budget serve --allow-uid`: a user id, a whole number >= 0."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected a user id (a whole number >= 0)")
    return int(text)


def private_run_directory(text: str) -> str:
    """`budget --run-dir`: a directory of this uid's own that no group or
    other user can reach (0700), or one that can be made."""
    problem = private_directory_problem(text)
    if problem == "does not exist":
        problem = report_dir_problem(text, may_hold_files=True)  # can it be made?
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{text!r} {problem}; {PRIVATE_DIRECTORY_EXPECTED}")
    return text
