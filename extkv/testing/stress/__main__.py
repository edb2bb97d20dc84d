"""The child processes of stress runs: `python -m extkv.testing.stress
walk|pressure|crash-child|budget-engine ...`.

- `walk`: one endurance walk (extkv.testing.stress.walk); prints its tally
  as JSON on its last line, and exits 1 when the walk failed.
- `pressure`: the pressure process (extkv.testing.stress.pressure), told on
  stdin what memory to hold and free.
- `crash-child`: the crash child (extkv.testing.stress.crashes): commits,
  defragments and exports until it is killed.
- `budget-engine`: an engine under a shared budget on a device
  (extkv.testing.stress.budget_engine): says `ready`, waits at its gate, joins
  the daemon and runs random operations until told `stop`, reporting its
  tally as it goes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from ...layout import KVCacheLayout
from .base import warmed_probe
from .budget_engine import ENGINE_BLOCKS, budget_engine_main
from .crashes import crash_child_main
from .pressure import pressure_main
from .tally import StressTally
from .walk import FULL_CHECK_EVERY, run_walk


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m extkv.testing.stress", description="child processes of stress runs")
    commands = parser.add_subparsers(dest="command", required=True)
    walk_command = commands.add_parser("walk", help="one endurance walk; prints its tally as JSON")
    walk_command.add_argument("--device", default="cpu")
    walk_command.add_argument("--kind", default="full")
    walk_command.add_argument("--layout", default="LBHNC", choices=[layout.name for layout in KVCacheLayout])
    walk_command.add_argument("--seed", type=int, default=0)
    bound = walk_command.add_mutually_exclusive_group(required=True)
    bound.add_argument("--seconds", type=float)
    bound.add_argument("--steps", type=int)
    walk_command.add_argument("--full-check-every", type=int, default=FULL_CHECK_EVERY)
    walk_command.add_argument("--least-steps", type=int, default=1, help="with --seconds: steps the walk runs however short they are")
    walk_command.add_argument(
        "--shared-device", action="store_true",
        help="other processes use the device: compare the usage probe only where it reads this process alone",
    )
    pressure_command = commands.add_parser("pressure", help="hold and free memory as told on stdin")
    pressure_command.add_argument("--device", default="cpu")
    crash_command = commands.add_parser("crash-child", help="commit, defragment and export until killed")
    crash_command.add_argument("--device", default="cpu")
    crash_command.add_argument("--seed", type=int, default=0)
    engine_command = commands.add_parser("budget-engine", help="an engine under a shared budget, spoken to by lines")
    engine_command.add_argument("--socket", required=True, help="the budget daemon's socket")
    engine_command.add_argument("--seed", type=int, default=0)
    engine_command.add_argument("--floor", type=int, default=0, help="bytes")
    engine_command.add_argument("--weight", type=float, default=1.0)
    engine_command.add_argument("--layout", default="LBHNC", choices=[layout.name for layout in KVCacheLayout])
    engine_command.add_argument("--capacity", type=int, default=ENGINE_BLOCKS, help="blocks")
    engine_command.add_argument("--gate", default=None, help="a FIFO: join once its writing end opened and closed")
    engine_command.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("EXTKV_TORCH_THREADS", "1")))
    if args.command == "budget-engine":
        return budget_engine_main(args.socket, args.seed, args.floor, args.weight, KVCacheLayout[args.layout],
                                  args.capacity, args.gate, args.device)
    device = torch.device(args.device)
    if args.command == "pressure":
        pressure_main(device)
        return 0
    if args.command == "crash-child":
        crash_child_main(device, args.seed)
        return 0
    tally = StressTally()
    until = None if args.seconds is None else time.monotonic() + args.seconds
    status = 0
    probe = warmed_probe(device)
    try:
        run_walk(
            device, args.kind, KVCacheLayout[args.layout], args.seed, tally, until=until, steps=args.steps,
            full_check_every=args.full_check_every, probe=probe,
            usage_checks=probe.per_process or not args.shared_device,
            least=lambda ran: ran >= args.least_steps, least_what="the least it was given",
            workload=f"walk process ({args.kind}-{args.layout})",
        )
    except Exception as error:  # recorded in the tally, which the parent reads
        print(f"walk failed: {error!r}", file=sys.stderr, flush=True)
        status = 1
    print(json.dumps(tally.to_json()), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
