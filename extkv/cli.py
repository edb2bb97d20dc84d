"""The `extkv` command.

- `extkv info`: the devices extkv would use and their drivers.
- `extkv check [pytest args]`: run the conformance suite on every GPU found
  (one pytest-xdist worker per GPU), or on the host driver when there is none.
- `extkv peer --peer SOCKET_PATH [--timeout S]`: the receiving side of a
  `SegmentExportConnector`, as a process of its own (extkv.peer): import the
  exported segments, reply with the sha256 of each segment's committed bytes,
  clean up. Also `python -m extkv peer ...`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import torch

from . import vmm
from .peer import DEFAULT_PEER_TIMEOUT_S, run_peer


def _gpu_count() -> int:
    return torch.cuda.device_count() if vmm.cuda_usable() else 0


def _info(_args) -> int:
    for facts in [vmm.driver_for("cpu").describe()] + [
        vmm.driver_for(f"cuda:{i}").describe() for i in range(_gpu_count())
    ]:
        print(f"{facts['device']}: {facts['driver']}, granularity {facts['granularity']}")
    return 0


def _suite_root() -> Path:
    root = Path(__file__).resolve().parent.parent
    if not (root / "conformance").is_dir():
        raise SystemExit(
            f"extkv check: no conformance/ directory next to the extkv package in {root}; "
            "run it from a source checkout installed with `pip install -e '.[test]'`"
        )
    return root


def _check(args) -> int:
    root = _suite_root()
    gpus = _gpu_count()
    command = [sys.executable, "-m", "pytest", "conformance", "-q"]
    if gpus > 1:
        command += ["-n", str(gpus)]
    where = f"{gpus} GPU(s) and the host driver" if gpus else "the host driver only (no CUDA GPU found)"
    print(f"extkv check: conformance suite on {where}", flush=True)
    print("$ " + " ".join(command + args.pytest_args), flush=True)
    return subprocess.call(command + args.pytest_args, cwd=root, env=os.environ.copy())


def _peer(args) -> int:
    run_peer(args.peer, args.timeout)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="extkv", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="show the devices and drivers extkv would use").set_defaults(run=_info)
    check = commands.add_parser(
        "check", help="run the conformance suite on the GPUs found, else on the host; other arguments go to pytest"
    )
    check.set_defaults(run=_check)
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
    # Whatever `check` does not know is for pytest (-x, -k EXPR, -rs, ...).
    args, extra = parser.parse_known_args(argv)
    if extra and args.run is not _check:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.pytest_args = extra
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
