"""The `extkv` command.

- `extkv info`: the devices extkv would use and their drivers.
- `extkv check [pytest args]`: the conformance suite on every GPU found (one
  pytest-xdist worker per GPU, then the multi-GPU tests in a step of their
  own), or on the host driver when there is none; writes a report.
- `extkv bench [--quick]`: the benchmarks (`reports/`), each figure a ratio
  to a baseline measured in the same run; writes a report.
- `extkv stress --minutes M [--seed S]`: the nightly stress run (`stress/`);
  writes a report.
- `extkv report DIR`: render a run directory's report again from its raw
  results (JSON, JUnit XML).
- `extkv pool OUT_DIR RUN_DIR RUN_DIR ...`: one bench report over the rounds
  of several runs of one code on one machine (extkv.reporting.pool).
- `extkv peer --peer SOCKET_PATH [--timeout S]`: the receiving side of a
  `SegmentExportConnector`, as a process of its own (extkv.peer): import the
  exported segments, reply with the sha256 of each segment's committed bytes,
  clean up. Also `python -m extkv peer ...`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from . import vmm
from .peer import DEFAULT_PEER_TIMEOUT_S, run_peer
from .reporting import bench_run, check_run, render_report, stress_run
from .reporting.pool import pool

#: Subcommands that run pytest: whatever they do not know goes to pytest.
_PYTEST_COMMANDS = {
    "check": (check_run, "run the conformance suite on the GPUs found, else on the host, and write a report"),
    "bench": (bench_run, "run the benchmarks and write a report"),
    "stress": (stress_run, "run the nightly stress suite for a bounded time and write a report"),
}


def _info(args, _pytest_args) -> int:
    gpus = torch.cuda.device_count() if vmm.cuda_usable() else 0
    for facts in [vmm.driver_for("cpu").describe()] + [vmm.driver_for(f"cuda:{i}").describe() for i in range(gpus)]:
        print(f"{facts['device']}: {facts['driver']}, granularity {facts['granularity']}")
    return 0


def _report(args, _pytest_args) -> int:
    summary = render_report(Path(args.run_dir))
    print(f"extkv report: wrote {summary}")
    return 0


def _pool(args, _pytest_args) -> int:
    try:
        pool(args.run_dirs, Path(args.out_dir))
    except ValueError as error:
        print(f"extkv pool: {error}", file=sys.stderr)
        return 2
    summary = render_report(Path(args.out_dir))
    print(f"extkv pool: wrote {summary}")
    return 0


def _peer(args, _pytest_args) -> int:
    run_peer(args.peer, args.timeout)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="extkv", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="show the devices and drivers extkv would use").set_defaults(run=_info)
    for name, (module, text) in _PYTEST_COMMANDS.items():
        command = commands.add_parser(name, help=text + "; other arguments go to pytest")
        module.add_arguments(command)
        command.set_defaults(run=module.run)
    report = commands.add_parser("report", help="render a run directory's summary.md and plots again from its raw results")
    report.add_argument("run_dir", metavar="DIR", help="a run directory, e.g. reports/2026-11-30-myhost-h200")
    report.set_defaults(run=_report)
    pooled = commands.add_parser("pool", help="one bench report over the rounds of several runs of one code on one machine")
    pooled.add_argument("out_dir", metavar="OUT_DIR", help="where the pooled run goes (not one of the runs)")
    pooled.add_argument("run_dirs", metavar="RUN_DIR", nargs="+", help="bench run directories, two or more")
    pooled.set_defaults(run=_pool)
    peer = commands.add_parser(
        "peer",
        help="import the segments a SegmentExportConnector exports, reply with their sha256 digests, clean up",
    )
    peer.add_argument("--peer", metavar="SOCKET_PATH", required=True, help="Unix socket the exporter listens on")
    peer.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_PEER_TIMEOUT_S,
        help="seconds to wait on the socket (default %(default)s)",
    )
    peer.set_defaults(run=_peer)
    args, extra = parser.parse_known_args(argv)
    if extra and args.command not in _PYTEST_COMMANDS:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args.run(args, extra)


if __name__ == "__main__":
    sys.exit(main())
