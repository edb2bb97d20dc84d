"""The `extkv` command.

- `extkv --version`: extkv's version as installed (importlib.metadata), and
  the git commit when extkv is imported from a checkout.
- `extkv info`: the devices extkv would use and their drivers, and which
  cuda-bindings it imports: its major must match the driver's CUDA major
  (bindings 13 need a CUDA 13 driver; `extkv[cuda12]` takes bindings 12).
- `extkv check [pytest args]`: the conformance suite on every GPU found (one
  pytest-xdist worker per GPU, then the multi-GPU tests in a step of their
  own), or on the host driver when there is none; writes a report.
- `extkv bench [--quick]`: the benchmarks (`reports/`), each figure a ratio
  to a baseline measured in the same run; writes a report.
- `extkv stress --minutes M [--seed S]`: the nightly stress run (`stress/`);
  writes a report.
- `extkv reference [--stress-minutes M]`: check, bench and stress into this
  machine kind's reference directory, reports/reference/<kind>
  (extkv.reporting.reference_run).
- `extkv report DIR`: render a run directory's report again from its raw
  results (JSON, JUnit XML).
- `extkv pool OUT_DIR RUN_DIR RUN_DIR ...`: one bench report over the rounds
  of several runs of one code on one machine (extkv.benchmarking.pool).
- `extkv peer --peer SOCKET_PATH [--timeout S]`: the receiving side of a
  `SegmentExportConnector`, as a process of its own (extkv.peer): import the
  exported segments, reply with the sha256 of each segment's committed bytes,
  clean up. Also `python -m extkv peer ...`. A SOCKET_PATH that is not a
  socket, or a timeout that is not a number of seconds > 0, is a usage
  error (exit status 2); a failed connection or import is one line naming
  the socket and the error (exit status 1).

Each subcommand's --help says what it does; check, bench and stress hand the
arguments they do not know to pytest, and their --help says so with an
example.
"""

from __future__ import annotations

import argparse
import math
import os
import stat
import sys
from pathlib import Path

import torch

from . import vmm
from .benchmarking import run as bench_run
from .benchmarking.pool import pool
from .errors import ExtkvError
from .peer import DEFAULT_PEER_TIMEOUT_S, run_peer
from .reporting import check_run, reference_run, render_report, stress_run
from .reporting.rundir import checkout_root
from .testing import facts

#: Subcommands that run pytest: whatever they do not know goes to pytest.
#: Each: its module, what it does, and an example of pytest arguments.
_PYTEST_COMMANDS = {
    "check": (
        check_run,
        "run the conformance suite on the GPUs found, else on the host, and write a report",
        "extkv check -x -k sizing",
    ),
    "bench": (bench_run, "run the benchmarks and write a report", "extkv bench --quick -k commit"),
    "stress": (
        stress_run,
        "run the nightly stress suite for a bounded time and write a report",
        "extkv stress --minutes 1 -k walk",
    ),
}


def version_text() -> str:
    """`extkv 0.1.0`, with the commit (and whether the work tree differs from
    it) when extkv is imported from a git checkout: a report or a bug names
    the code that ran, not only the release. The facts are the ones every
    report records (extkv.testing.facts)."""
    version = facts.version_of("extkv")
    text = "extkv (not installed: no version recorded)" if version == facts.NOT_INSTALLED else f"extkv {version}"
    commit = facts.extkv_commit()  # a bare source tree `python -m extkv` runs from has none
    if commit is None:
        return text
    sha, _, dirty = commit.partition("+")
    return f"{text} (checkout {checkout_root()}, commit {sha}{', uncommitted changes' if dirty else ''})"


class _Version(argparse.Action):
    """--version, worked out only when asked: it runs git."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(
            option_strings, dest, nargs=0, help="print extkv's version (and commit, from a checkout) and exit"
        )

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit()


def _driver_cuda_version() -> tuple[str, int] | None:
    """(`13.0 (NVIDIA driver 580.95.05)`, 13) from NVML, which needs no
    cuda-bindings (so a mismatch can be named before any bindings call
    fails); None where there is no NVIDIA driver or no GPU."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            if pynvml.nvmlDeviceGetCount() == 0:
                return None
            cuda = pynvml.nvmlSystemGetCudaDriverVersion()
            driver = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # NVML missing or refusing: no GPU extkv could use
        return None
    driver = driver.decode() if isinstance(driver, bytes) else driver
    return f"{cuda // 1000}.{cuda % 1000 // 10} (NVIDIA driver {driver})", cuda // 1000


def bindings_lines() -> list[str]:
    """Which cuda-bindings extkv imports and, where a GPU is present, whether
    its major matches the driver's CUDA major. Bindings of a newer major than
    the driver's fail at their first call (13.x needs a CUDA 13 driver);
    older ones run on a newer driver."""
    version = facts.version_of("cuda-bindings")
    try:
        from cuda.bindings import driver as _  # noqa: F401
        importable = ""
    except ImportError as error:
        importable = f", not importable ({error})"
    if version == facts.NOT_INSTALLED:
        lines = [f"cuda-bindings: not installed{importable}: extkv runs on the host driver only"]
        major = None
    else:
        major = int(version.split(".")[0])
        lines = [f"cuda-bindings: {version} (major {major}){importable}"]
    found = _driver_cuda_version()
    if found is None:
        lines.append("GPU driver: none found (NVML), so no GPU: the host driver only")
        return lines
    cuda, driver_major = found
    # The extras that pin the bindings' major (pyproject.toml); past them, the pin itself.
    pin = f"extkv[cuda{driver_major}]" if driver_major in (12, 13) else f"cuda-bindings {driver_major}.x"
    if major is None:
        verdict = f"needs bindings: install {pin}"
    elif major == driver_major:
        verdict = "matches the bindings' major"
    elif major > driver_major:
        verdict = f"does not match: bindings {major} need a CUDA {major} driver; install {pin}"
    else:
        verdict = f"does not match (bindings {major} run on it; {pin} matches)"
    lines.append(f"GPU driver: CUDA {cuda}: major {driver_major} {verdict}")
    return lines


def _info(args, _pytest_args) -> int:
    for line in bindings_lines():
        print(line)
    gpus = torch.cuda.device_count() if vmm.cuda_usable() else 0
    for facts in [vmm.driver_for("cpu").describe()] + [vmm.driver_for(f"cuda:{i}").describe() for i in range(gpus)]:
        print(f"{facts['device']}: {facts['driver']}, granularity {facts['granularity']}")
    return 0


def _report(args, _pytest_args) -> int:
    try:
        summary = render_report(Path(args.run_dir))
    except (OSError, ValueError) as error:  # each names the file it could not read
        print(f"extkv report: {error}", file=sys.stderr)
        return 2
    print(f"extkv report: wrote {summary}")
    return 0


def _pool(args, _pytest_args) -> int:
    try:
        pool(args.run_dirs, Path(args.out_dir))
        # OUT_DIR may hold files of its own that the report reads too.
        summary = render_report(Path(args.out_dir))
    except (OSError, ValueError) as error:  # each names the file or directory
        print(f"extkv pool: {error}", file=sys.stderr)
        return 2
    print(f"extkv pool: wrote {summary}")
    return 0


#: The longest path an AF_UNIX address holds (sun_path, less its NUL), on Linux.
_UNIX_PATH_MOST_BYTES = 107
#: What a file that is not a socket is, in words, by its stat.S_IS* test.
_FILE_KINDS = [
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISREG, "a regular file"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
]


def _socket_path(text: str) -> str:
    """--peer: the path of a Unix socket, checked before the peer starts so
    that a mistyped path is a usage error naming it, not a traceback from
    connect() (which names no path)."""
    expected = "expected the Unix socket a SegmentExportConnector listens on"
    try:
        status = os.stat(text)
    except (OSError, ValueError) as error:  # ValueError: a NUL in the path
        reason = error.strerror if isinstance(error, OSError) else str(error)
        raise argparse.ArgumentTypeError(f"{text!r}: {reason}; {expected}") from None
    if not stat.S_ISSOCK(status.st_mode):
        kind = next((words for test, words in _FILE_KINDS if test(status.st_mode)), "not a socket")
        raise argparse.ArgumentTypeError(f"{text!r} is {kind}; {expected}")
    if len(os.fsencode(text)) > _UNIX_PATH_MOST_BYTES:
        raise argparse.ArgumentTypeError(
            f"{text!r} is {len(os.fsencode(text))} bytes, more than the {_UNIX_PATH_MOST_BYTES} an AF_UNIX "
            "address holds; name the socket by a shorter path (a relative one, or a symlink)"
        )
    return text


def _seconds(text: str) -> float:
    """--timeout: a number of seconds > 0 (nan is none)."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return seconds


def _peer(args, _pytest_args) -> int:
    try:
        run_peer(args.peer, args.timeout)
    except (OSError, ValueError, ExtkvError) as error:
        # What the exporter sent or did, or the driver: one line, the error's
        # type (as the exporter is told it) and all of its message, which
        # here, in the peer's own stderr, may name its addresses.
        print(f"extkv peer: {args.peer}: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="extkv",
        description="extkv: a growable KV-cache allocation on virtual memory (CUDA VMM, or Linux memfd on the host), "
        "and the suites that prove it.",
    )
    parser.add_argument("--version", action=_Version)
    commands = parser.add_subparsers(dest="command", required=True)

    def add(name: str, text: str, **kwargs) -> argparse.ArgumentParser:
        # The text twice: in the list of `extkv --help` and atop `extkv NAME --help`.
        return commands.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".", **kwargs)

    add(
        "info", "show the devices and drivers extkv would use, and whether cuda-bindings matches the GPU driver"
    ).set_defaults(run=_info)
    for name, (module, text, example) in _PYTEST_COMMANDS.items():
        command = add(
            name,
            text + "; other arguments go to pytest",
            epilog=f"Arguments `extkv {name}` does not know go to pytest, e.g. `{example}`.",
        )
        module.add_arguments(command)
        command.set_defaults(run=module.run)
    reference = add(
        "reference",
        "re-make this machine kind's reference run: check, bench and stress into reports/reference/<kind>; "
        "other arguments go to pytest",
    )
    reference_run.add_arguments(reference)
    reference.set_defaults(run=reference_run.run)
    report = add("report", "render a run directory's summary.md and plots again from its raw results")
    report.add_argument("run_dir", metavar="DIR", help="a run directory, e.g. reports/runs/2026-11-30-myhost-h200")
    report.set_defaults(run=_report)
    pooled = add("pool", "write one bench report over the rounds of several runs of one code on one machine")
    pooled.add_argument("out_dir", metavar="OUT_DIR", help="where the pooled run goes (not one of the runs)")
    pooled.add_argument("run_dirs", metavar="RUN_DIR", nargs="+", help="bench run directories, two or more")
    pooled.set_defaults(run=_pool)
    peer = add(
        "peer", "import the segments a SegmentExportConnector exports, reply with their sha256 digests, clean up"
    )
    peer.add_argument(
        "--peer", metavar="SOCKET_PATH", required=True, type=_socket_path, help="Unix socket the exporter listens on"
    )
    peer.add_argument(
        "--timeout",
        type=_seconds,
        default=DEFAULT_PEER_TIMEOUT_S,
        help="seconds to wait on the socket (default %(default)s)",
    )
    peer.set_defaults(run=_peer)
    args, extra = parser.parse_known_args(argv)
    if extra and args.command not in (*_PYTEST_COMMANDS, "reference"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args.run(args, extra)


if __name__ == "__main__":
    sys.exit(main())
