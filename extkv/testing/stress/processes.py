"""Several endurance walks at once, each in a child process on one device.

Theory of operation
-------------------
`run_walk_processes` starts walk processes (`python -m extkv.testing.stress
walk ...`), each on its own case of CACHE_MACHINE_CASES and its own seed,
beside each other on the device. Each checks its own cache and its own
leaks, comparing the usage probe only where the probe reads that process
alone, and prints its tally as JSON, which joins the parent's; a child that
dies without one joins it as a failure, and the others are still read. On
a GPU, NVML must no longer list any of them once they are gone: the driver
tore their contexts down, and all they held with it. Only the walk
processes' own readings are compared, so other jobs on the GPU cannot move
the verdict (extkv.testing.stress.reclaim).
"""

from __future__ import annotations

import json

import torch

from ..machines import CACHE_MACHINE_CASES
from .base import CHILD_TIMEOUT_S, warmed_probe
from .child import ChildProcess
from .reclaim import wait_for_process_gpu_memory
from .tally import StressTally
from .walk import FULL_CHECK_EVERY


def run_walk_processes(
    device: torch.device | str,
    count: int,
    seed: int,
    tally: StressTally,
    *,
    seconds: float | None = None,
    steps: int | None = None,
    full_check_every: int = FULL_CHECK_EVERY,
    least_steps: int = 1,
) -> None:
    """`count` walks at once for `seconds` or `steps`, each in a child process
    on `device`, each on its own case of CACHE_MACHINE_CASES; their tallies
    join `tally`. `seconds` is a floor for `least_steps` steps of each walk.
    Each child checks its own leaks; on a GPU, NVML must list none of them
    once they are gone."""
    device = torch.device(device)
    # Whether NVML lists this machine's processes at all: else a child it
    # does not list says nothing (a PID namespace hides them).
    per_process = device.type == "cuda" and warmed_probe(device).per_process
    children = []
    for index in range(count):
        kind, layout = CACHE_MACHINE_CASES[index % len(CACHE_MACHINE_CASES)]
        children.append(
            ChildProcess([
                "walk", "--device", str(device), "--kind", kind, "--layout", layout.name, "--seed", str(seed + index),
                *(["--seconds", str(seconds), "--least-steps", str(least_steps)] if steps is None else ["--steps", str(steps)]),
                "--full-check-every", str(full_check_every), "--shared-device",
            ])
        )
    failures = []
    try:
        for index, child in enumerate(children):
            try:
                result = child.line((seconds or 0) + CHILD_TIMEOUT_S)
                child.wait(CHILD_TIMEOUT_S)
                child_tally = StressTally.from_json(json.loads(result))
            except Exception as error:
                # A child that died, or printed no tally: its failure joins
                # the tally, and the children after it are still read.
                tally.fail(error, child.command)
                failures.append(f"walk process {index}: {error}")
                continue
            tally.add(child_tally)
            tally.events["walk processes sharing the device"] += 1
            if child.returncode != 0:
                failures.append(f"walk process {index} (exit {child.returncode}): {child_tally.failures}")
    finally:
        for child in children:
            child.close()
    if failures:
        raise AssertionError("; ".join(failures))
    if per_process:
        for index, child in enumerate(children):
            wait_for_process_gpu_memory(device, child.pid, None, f"walk process {index}, ended", CHILD_TIMEOUT_S)
        tally.checks["GPU memory back after the walk processes (NVML lists none of them)"] += 1
    elif device.type == "cuda":
        tally.events["GPU memory after the walk processes not checked: NVML lists no process of this machine's (PID namespace)"] += 1
