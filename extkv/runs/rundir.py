"""Where a run's files go, and where the suites it runs live.

Theory of operation
-------------------
Every run gets a directory of its own, `reports/runs/<YYYY-MM-DD>-<host>-<gpus>/`
(`h200`, `2xh200`, or `host` without a GPU), with `-2`, `-3`, ... added
while that name holds files, so a run never mixes its results with another
run's nor replaces them. `reports/runs/` is git-ignored: the curated
reference runs, one per machine kind, are committed under
`reports/reference/<kind>/` (`extkv reference` makes them). The
root is the checkout's `reports/runs/` when extkv runs from a source
checkout (an editable install), else `./reports/runs` under the current
directory. A directory the user names (`--report-dir`) must be empty or
new, unless `--overwrite` says to replace its results, and any run directory
one this process can write or make: one rule
(extkv.cli_arguments.report_dir_problem), which the command line applies as
it parses and `prepare_run_directory` again as it makes the directory.

The suites ship in the distribution as packages of their own (pyproject maps
`extkv_conformance` to `conformance/` and `extkv_benchmarks` to the
`bench/` benchmark suite); from a checkout they are its directories.
`suite_directory` answers either way.

A run directory may come from anyone, and its entries are nobody's promise:
a report reads results through `read_json` (regular files only, never
through a symlink, bounded in size) and writes every file of its own
(summary.md, each plot) through `write_file`, which replaces the entry of
that name with a new file rather than writing through what is there.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import json
import os
import re
import shutil
from collections import Counter
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

from ..cli_arguments import report_dir_problem
from ..files import read_regular_file

#: Suite directory in a checkout -> the package it is installed as.
SUITE_PACKAGES = {"conformance": "extkv_conformance", "bench": "extkv_benchmarks", "stress": "extkv_stress"}
#: Words dropped from a GPU's name in a run directory's name.
_VENDOR_WORDS = ("nvidia",)


#: The largest results file a report reads; a GPU run's bench_cases.json,
#: the largest, is a few MB.
MOST_RESULT_BYTES = 256 << 20


def read_json(path: Path) -> object:
    """The JSON document in `path`; ValueError naming the file when it is
    none. A run directory may come from anyone, so only a regular file is
    read, never through a symlink, and at most MOST_RESULT_BYTES of it: a
    FIFO named like a results file would block the read, a link to
    /dev/zero never end it."""
    data = read_regular_file(Path(path), MOST_RESULT_BYTES, "a results file")
    try:
        return json.loads(data)
    # ValueError: also an integer of more digits than Python converts;
    # RecursionError: arrays or objects nested past the parser's depth.
    except (ValueError, RecursionError) as error:
        raise ValueError(f"{path}: not JSON ({error})") from None


@contextlib.contextmanager
def results_as_written(where: Path | str, what: str) -> Iterator[None]:
    """Turn the errors a results file of the wrong shape raises in the code
    that reads it (a missing field, a list where a number was written) into
    one ValueError naming `where` and `what` was read: a run directory may
    come from anyone, and a KeyError from deep in a renderer names neither."""
    try:
        yield
    except (KeyError, TypeError, IndexError, AttributeError) as error:
        detail = f"no field {error}" if isinstance(error, KeyError) else f"{type(error).__name__}: {error}"
        raise ValueError(f"{where}: {what} not as extkv writes them ({detail})") from None


def read_json_object(path: Path) -> dict:
    """`read_json` of a file that must hold a JSON object."""
    document = read_json(path)
    if not isinstance(document, dict):
        raise ValueError(f"{path}: a JSON {type(document).__name__}, not the object a results file holds")
    return document


def write_file(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Make `path` a new regular file holding what `write(file)` writes,
    replacing whatever entry has that name: a symlink planted there is
    replaced, not written through (it could point anywhere). The file is
    written under a temporary name in the same directory, then renamed over
    `path`, so a reader never sees half of it; if `write` fails the
    temporary file is removed and `path` is left as it was."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    # O_EXCL refuses an entry already there, a planted symlink included.
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "wb") as file:
            write(file)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def write_text(path: Path, text: str) -> None:
    """`write_file` of `text`, UTF-8."""
    write_file(path, lambda file: file.write(text.encode()))


def save_figure(figure, path: Path, **options) -> Path:
    """Save the matplotlib `figure` as `path` through `write_file` (every
    plot a report draws goes through here); the format is the suffix's, as
    `savefig` would choose from the name, which the temporary file lacks.
    Returns `path`."""
    path = Path(path)
    write_file(path, lambda file: figure.savefig(file, format=path.suffix.lstrip(".").lower() or "png", **options))
    return path


def slug(text: str) -> str:
    """Lower case, runs of anything but letters and digits made one `-`."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def gpu_slug(facts: dict) -> str:
    """`h200`, `2xh200`, `h200-a100`; `host` without a GPU."""
    names = Counter()
    for gpu in facts["gpus"]:
        words = [word for word in slug(gpu["name"]).split("-") if word not in _VENDOR_WORDS]
        names["-".join(words) or "gpu"] += 1
    if not names:
        return "host"
    return "-".join(name if count == 1 else f"{count}x{name}" for name, count in names.items())


def checkout_root() -> Path | None:
    """The source checkout extkv is imported from, or None for an installed package."""
    root = Path(__file__).resolve().parents[2]  # extkv/runs/rundir.py -> the directory above extkv/
    if (root / "pyproject.toml").is_file() and (root / "conformance").is_dir():
        return root
    return None


def reports_root() -> Path:
    """Where new runs go: git-ignored `reports/runs/`."""
    root = checkout_root()
    return (root if root is not None else Path.cwd()) / "reports" / "runs"


def run_directory(facts: dict, day: datetime.date | None = None, root: Path | None = None) -> Path:
    """`<root>/<YYYY-MM-DD>-<host>-<gpus>` for the machine of `facts`, with
    `-2`, `-3`, ... while that directory holds files (not created)."""
    day = day or datetime.date.today()
    host = slug(facts["host"].split(".")[0]) or "unknown-host"
    base = (root if root is not None else reports_root()) / f"{day.isoformat()}-{host}-{gpu_slug(facts)}"
    candidate, number = base, 1
    while candidate.is_dir() and any(candidate.iterdir()):
        number += 1
        candidate = base.with_name(f"{base.name}-{number}")
    return candidate


class RunDirectoryInUse(ValueError):
    """A run's directory cannot be used: it holds files and nobody said to
    replace them, or it is no directory this process can write or make."""


def prepare_run_directory(chosen: Path | None, facts: dict, overwrite: bool, own_files: tuple[str, ...]) -> Path:
    """The run's directory, created: `chosen` (--report-dir) if given, which
    must be empty unless `overwrite`, when this run's own earlier files there
    (`own_files`: glob patterns) are removed first; else a new `run_directory`.
    The command line refused an unusable `chosen` already
    (extkv.cli_arguments); asked again here, where it is made, for what
    changed since and for the default directory, which the user did not
    name: RunDirectoryInUse naming it."""
    if chosen is None:
        directory = run_directory(facts).resolve()
        named = str(directory)
    else:
        directory = Path(chosen).resolve()
        named = f"--report-dir {chosen}"
    problem = report_dir_problem(directory, may_hold_files=chosen is not None and overwrite)
    if problem is not None:
        raise RunDirectoryInUse(f"{named} {problem}")
    if chosen is not None and overwrite:
        for pattern in own_files:
            for path in directory.glob(pattern):
                if path.is_dir():
                    shutil.rmtree(path)
                else:
                    path.unlink()
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def suite_directory(suite: str) -> Path:
    """Where suite `suite` (`conformance`, `bench`) lives: the checkout's
    directory, else the installed package's."""
    if suite not in SUITE_PACKAGES:
        raise ValueError(f"suite {suite!r} is not one of {sorted(SUITE_PACKAGES)}")
    root = checkout_root()
    if root is not None:
        return root / suite
    spec = importlib.util.find_spec(SUITE_PACKAGES[suite])
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the {suite} suite is neither beside extkv (no checkout) nor installed as {SUITE_PACKAGES[suite]}; "
            "reinstall extkv"
        )
    return Path(list(spec.submodule_search_locations)[0])
