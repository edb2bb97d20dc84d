"""The `extkv` command.

- `extkv --version`: extkv's version as installed (importlib.metadata), and
  the git commit when extkv is imported from a checkout.
- `extkv info`: the devices extkv would use and their drivers, and which
  cuda-bindings it imports: its major must match the driver's CUDA major
  (bindings 13 need a CUDA 13 driver; `extkv[cuda12]` takes bindings 12).
- `extkv check [pytest args]`: the conformance suite on every GPU found (one
  pytest-xdist worker per GPU, then the multi-GPU tests in a step of their
  own), or on the host driver when there is none; writes a report.
- `extkv bench [--quick]`: the benchmarks (`bench/`), each figure a ratio
  to a baseline measured in the same run; writes a report.
- `extkv stress --minutes M [--seed S]`: the nightly stress run (`stress/`);
  writes a report.
- `extkv reference [--stress-minutes M]`: check, bench and stress into this
  machine kind's reference directory, reports/reference/<kind>
  (extkv.reference_run).
- `extkv report DIR`: render a run directory's report again from its raw
  results (JSON, JUnit XML).
- `extkv pool OUT_DIR RUN_DIR RUN_DIR ...`: one bench report over the rounds
  of several runs of one code on one machine (extkv.benchmarking.pool).
- `extkv budget serve --device host|cuda:N --budget 96GiB|80%`: the daemon
  of one device's shared KV budget (extkv.budget.daemon), in the
  foreground until SIGTERM or Ctrl-C; `extkv budget status`: per engine
  of each daemon (or the one of --device), its pid, grant, held bytes, the
  outside reading, floor, cap, weight and reclaims pending, after a line
  for the budget. A value of the wrong form is a usage error (exit status
  2); a daemon that cannot start or cannot be reached is one line naming
  why (exit status 1).
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
import importlib
import os
import sys
from pathlib import Path

from . import cli_arguments as arguments
from .cli_arguments import Parser

#: Subcommands that run pytest: whatever they do not know goes to pytest.
#: Each: the module whose run() runs it, what it does, and an example of
#: pytest arguments. The modules are imported only to run (they import
#: torch), so --help of any subcommand costs none.
_PYTEST_COMMANDS = {
    "check": (
        "extkv.check.run",
        "run the conformance suite on the GPUs found, else on the host, and write a report",
        "extkv check -x -k sizing",
    ),
    "bench": ("extkv.benchmarking.run", "run the benchmarks and write a report", "extkv bench --quick -k commit"),
    "stress": (
        "extkv.stress.run",
        "run the nightly stress suite for a bounded time and write a report",
        "extkv stress --minutes 1 -k walk",
    ),
}
#: Minutes `extkv reference` gives its stress step: long enough that every
#: stress test gets its share of the bound (a 1-minute run leaves 6 of 14
#: tests short).
DEFAULT_STRESS_MINUTES = 5.0
#: `peer --timeout`'s default: extkv.peer's DEFAULT_PEER_TIMEOUT_S, named
#: here so that `extkv peer --help` needs no torch (meta/test_cli.py checks
#: that the two agree).
DEFAULT_PEER_TIMEOUT_S = 120.0


def version_text() -> str:
    """`extkv 0.1.0`, with the commit (and whether the work tree differs from
    it) when extkv is imported from a git checkout: a report or a bug names
    the code that ran, not only the release. The facts are the ones every
    report records (extkv.testing.facts)."""
    from .testing import facts

    version = facts.version_of("extkv")
    text = "extkv (not installed: no version recorded)" if version == facts.NOT_INSTALLED else f"extkv {version}"
    commit = facts.extkv_commit()  # a bare source tree `python -m extkv` runs from has none
    if commit is None:
        return text
    sha, _, dirty = commit.partition("+")
    checkout = Path(__file__).resolve().parent.parent  # the directory above extkv/, whose git extkv_commit asked
    return f"{text} (checkout {checkout}, commit {sha}{', uncommitted changes' if dirty else ''})"


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
    from .testing import facts

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
    import torch

    from . import vmm

    for line in bindings_lines():
        print(line)
    gpus = torch.cuda.device_count() if vmm.cuda_usable() else 0
    for facts in [vmm.driver_for("cpu").describe()] + [vmm.driver_for(f"cuda:{i}").describe() for i in range(gpus)]:
        # GPUDirect RDMA is a GPU's: the host driver's line says nothing of it.
        rdma = f", GPUDirect RDMA {facts['gpudirect_rdma']}" if "gpudirect_rdma" in facts else ""
        print(f"{facts['device']}: {facts['driver']}, granularity {facts['granularity']}{rdma}")
    return 0


def _report(args, _pytest_args) -> int:
    from .report import render_report

    try:
        summary = render_report(Path(args.run_dir))
    except (OSError, ValueError) as error:  # each names the file it could not read
        print(f"extkv report: {error}", file=sys.stderr)
        return 2
    print(f"extkv report: wrote {summary}")
    return 0


def _pool(args, _pytest_args) -> int:
    from .benchmarking.pool import pool
    from .report import render_report

    try:
        pool(args.run_dirs, Path(args.out_dir))
        # OUT_DIR may hold files of its own that the report reads too.
        summary = render_report(Path(args.out_dir))
    except (OSError, ValueError) as error:  # each names the file or directory
        print(f"extkv pool: {error}", file=sys.stderr)
        return 2
    print(f"extkv pool: wrote {summary}")
    return 0


def _peer(args, _pytest_args) -> int:
    from .errors import ExtkvError
    from .peer import run_peer

    try:
        run_peer(args.peer, args.timeout)
    except (OSError, ValueError, ExtkvError) as error:
        # What the exporter sent or did, or the driver: one line, the error's
        # type (as the exporter is told it) and all of its message, which
        # here, in the peer's own stderr, may name its addresses.
        print(f"extkv peer: {args.peer}: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    return 0


def _budget_serve(args, _pytest_args) -> int:
    import signal

    from .budget.daemon import BudgetDaemon
    from .budget.device import open_device
    from .errors import ExtkvError

    try:
        device = open_device(args.device)
        budget = args.budget.bytes_of(device.total_bytes)
        daemon = BudgetDaemon(device, budget, run_dir=args.run_dir, allowed_uids=args.allow_uid,
                              log=lambda line: print(f"extkv budget: {line}", file=sys.stderr, flush=True))
        daemon.start()
    except (OSError, ValueError, ExtkvError) as error:
        print(f"extkv budget serve: {error}", file=sys.stderr)
        return 1
    print(f"extkv budget: serving {device.name}, budget {budget} bytes, on {daemon.socket_path}", flush=True)
    stopping = {number: signal.signal(number, lambda *_: daemon.stop()) for number in (signal.SIGTERM, signal.SIGINT)}
    try:
        daemon.serve_forever()
    finally:
        daemon.close()
        for number, handler in stopping.items():
            signal.signal(number, handler)
    return 0


def _budget_status(args, _pytest_args) -> int:
    import glob

    from .budget.client import read_status, status_lines
    from .budget.device import open_device
    from .budget.protocol import default_run_dir, socket_path
    from .errors import ExtkvError

    run_dir = args.run_dir or default_run_dir()
    try:
        if args.device is not None:
            sockets = [socket_path(run_dir, open_device(args.device).key)]
        else:
            sockets = sorted(glob.glob(os.path.join(glob.escape(run_dir), "*.sock")))
            if not sockets:
                print(f"extkv budget status: no budget daemon's socket in {run_dir}", file=sys.stderr)
                return 1
        reports = [(path, read_status(path, args.timeout)) for path in sockets]
    except (OSError, ValueError, ExtkvError) as error:
        print(f"extkv budget status: {error}", file=sys.stderr)
        return 1
    for path, report in reports:
        lines = status_lines(report)
        print(f"{lines[0]} socket={path}")
        print("\n".join(lines[1:]) if len(lines) > 1 else "(no engine)")
    return 0


def _add_budget(command: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    run_dir = ("the daemons' directory, a directory of this uid's own that no one else can reach (default "
               "$EXTKV_RUN_DIR, else $XDG_RUNTIME_DIR/extkv, else extkv-UID in the temporary directory)")
    actions = command.add_subparsers(dest="budget_command", required=True)
    serve_text = "serve one device's shared KV budget to the engines that connect, until SIGTERM or Ctrl-C"
    serve = actions.add_parser("serve", help=serve_text, description=serve_text[0].upper() + serve_text[1:] + ".")
    serve.add_argument("--device", type=arguments.budget_device, required=True,
                       help="host, cuda:N or a GPU's UUID (read through NVML; no CUDA context is created)")
    serve.add_argument("--budget", type=arguments.budget_size, required=True,
                       help="bytes for all engines' KV caches together: 96GiB, or 80%% of the device's memory")
    serve.add_argument("--run-dir", metavar="DIR", type=arguments.private_run_directory, default=None, help=run_dir)
    serve.add_argument("--allow-uid", metavar="UID", type=arguments.user_id, action="append", default=None,
                       help="a uid whose engines may connect; repeat for several (default: this process's uid only)")
    serve.set_defaults(run=_budget_serve)
    status_text = "print each engine of the budget daemons: pid, grant, held and outside bytes, floor, cap, weight"
    status = actions.add_parser("status", help=status_text, description=status_text[0].upper() + status_text[1:] + ".")
    status.add_argument("--device", type=arguments.budget_device, default=None,
                        help="the daemon of this device only (default: every daemon in the run directory)")
    status.add_argument("--run-dir", metavar="DIR", type=arguments.private_run_directory, default=None, help=run_dir)
    status.add_argument("--timeout", type=arguments.seconds, default=10.0,
                        help="seconds to wait for each daemon (default %(default)s)")
    status.set_defaults(run=_budget_status)
    return {"budget serve": serve, "budget status": status}


def _add_report_dir(command: argparse.ArgumentParser, help: str, overwrite: bool = True) -> None:
    command.add_argument("--report-dir", metavar="DIR", type=arguments.report_directory, default=None, help=help)
    if overwrite:
        command.add_argument(
            "--overwrite", action="store_true", help="let --report-dir hold files, replacing this kind of run's results there"
        )


_RUN_REPORT_DIR = "write the results and the report here (new or empty) instead of a new reports/runs/<date>-<host>-<gpus>/"


def _add_check(command: argparse.ArgumentParser) -> None:
    _add_report_dir(command, _RUN_REPORT_DIR)
    workers = "xdist workers of the host driver's step, 1 to the usable cores"
    command.add_argument("--host-workers", type=arguments.worker_count, default=None, metavar="N", help=workers)
    command.add_argument(
        "--gpu-workers", type=arguments.worker_count, default=None, metavar="N",
        help="xdist workers of each GPU's step, 1 to the usable cores",
    )


def _add_bench(command: argparse.ArgumentParser) -> None:
    from .benchmarking.result_files import PARTS  # names only: no device library

    command.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, two rounds; fails unless the report renders")
    command.add_argument(
        "--part", choices=sorted(PARTS), default=None,
        help="measure one part into --report-dir, leaving the other's results there: the cases (extkv against "
        "raw sequences and peers) or the engines (decode, growth loop, shared budget), each sized to fit ten minutes "
        "of one GPU (default: both, in one run)",
    )
    _add_report_dir(command, _RUN_REPORT_DIR)
    command.add_argument(
        "--rounds", type=arguments.run_count, default=None, metavar="N", help="at most N rounds per case (default: the profile's)"
    )
    command.add_argument(
        "--benchmark-storage", metavar="DIR", default=None,
        help="pytest-benchmark's storage that every run is saved in, for `pytest-benchmark --storage DIR compare` "
        "and --benchmark-compare (default: reports/runs/.benchmarks/<profile>)",
    )


def _add_stress(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--minutes", type=arguments.minutes, required=True, help="time bound of the whole run, report included"
    )
    command.add_argument("--seed", type=int, default=None, help="seed of the run (default: from the clock; printed)")
    _add_report_dir(command, _RUN_REPORT_DIR)


def _add_reference(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--stress-minutes", type=arguments.minutes, default=DEFAULT_STRESS_MINUTES,
        help="minutes for the stress step (default %(default)s)",
    )
    # Its steps replace their own files there (--overwrite), so it may hold files.
    _add_report_dir(
        command, "where the reference goes (default: reports/reference/<this machine's GPUs, or host>)", overwrite=False
    )


def _run_pytest_command(args, pytest_args) -> int:
    from .report import render_report

    # The report's renderer stands above every kind of run: each gets it here.
    return importlib.import_module(_PYTEST_COMMANDS[args.command][0]).run(args, pytest_args, render=render_report)


def _run_reference(args, pytest_args) -> int:
    from . import reference_run

    return reference_run.run(args, pytest_args)


def main(argv: list[str] | None = None) -> int:
    parser = Parser(
        prog="extkv",
        description="extkv: a growable KV-cache allocation on virtual memory (CUDA VMM, or Linux memfd on the host), "
        "and the suites that prove it.",
    )
    parser.add_argument("--version", action=_Version)
    commands = parser.add_subparsers(dest="command", required=True)
    parsers: dict[str, argparse.ArgumentParser] = {}

    def add(name: str, text: str, **kwargs) -> argparse.ArgumentParser:
        # The text twice: in the list of `extkv --help` and atop `extkv NAME --help`.
        parsers[name] = commands.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".", **kwargs)
        return parsers[name]

    add(
        "info", "show the devices and drivers extkv would use, and whether cuda-bindings matches the GPU driver"
    ).set_defaults(run=_info)
    for name, (_, text, example), add_options in zip(
        _PYTEST_COMMANDS, _PYTEST_COMMANDS.values(), (_add_check, _add_bench, _add_stress)
    ):
        command = add(
            name,
            text + "; other arguments go to pytest",
            epilog=f"Arguments `extkv {name}` does not know go to pytest, e.g. `{example}`.",
        )
        add_options(command)
        command.set_defaults(run=_run_pytest_command)
    reference = add(
        "reference",
        "re-make this machine kind's reference run: check, bench and stress into reports/reference/<kind>; "
        "other arguments go to pytest",
    )
    _add_reference(reference)
    reference.set_defaults(run=_run_reference)
    report = add("report", "render a run directory's summary.md and plots again from its raw results")
    report.add_argument(
        "run_dir", metavar="DIR", type=arguments.run_directory_to_render,
        help="a run directory, e.g. reports/runs/2026-11-30-myhost-h200",
    )
    report.set_defaults(run=_report)
    pooled = add("pool", "write one bench report over the rounds of several runs of one code on one machine")
    pooled.add_argument(
        "out_dir", metavar="OUT_DIR", type=arguments.report_directory,
        help="where the pooled run goes (not one of the runs)",
    )
    pooled.add_argument(
        "run_dirs", metavar="RUN_DIR", nargs="+", type=arguments.run_directory, help="bench run directories, two or more"
    )
    pooled.set_defaults(run=_pool)
    budget = add("budget", "serve or show the shared KV budget of the engines on one device")
    parsers.update(_add_budget(budget))
    peer = add(
        "peer", "import the segments a SegmentExportConnector exports, reply with their sha256 digests, clean up"
    )
    peer.add_argument(
        "--peer", metavar="SOCKET_PATH", required=True, type=arguments.socket_path,
        help="Unix socket the exporter listens on",
    )
    peer.add_argument(
        "--timeout",
        type=arguments.seconds,
        default=DEFAULT_PEER_TIMEOUT_S,
        help="seconds to wait on the socket (default %(default)s)",
    )
    peer.set_defaults(run=_peer)
    args, extra = parser.parse_known_args(argv)
    if extra and args.command not in (*_PYTEST_COMMANDS, "reference"):
        parsers[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    if hasattr(args, "overwrite"):
        arguments.refuse_held_report_dir(parsers[args.command], args)
    return args.run(args, extra)


if __name__ == "__main__":
    sys.exit(main())
