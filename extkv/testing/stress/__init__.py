"""Stress runs: workloads that drive real caches on real drivers for as
long as they are given, their tally, and the processes that press on them
from outside.

Theory of operation
-------------------
Every workload drives real caches on a real driver and adds what it did and
found to one `StressTally`, plain data that becomes a test's raw result
(JSON). The nightly suite (`stress/`) runs the workloads until a time
bound, a floor for the least episode each must run; the conformance suite
runs each briefly with fixed seeds. The modules, each a section of the
work, lowest first:

- `base`: what the workloads run on: poisoned memory over the host driver
  (`HOST_STRESS_GRANULE`) or the device's CUDA driver, a usage probe that
  sees only extkv (`warmed_probe`), the bound on every wait.
- `tally`: `StressTally`, what the workloads did and found.
- `bounds`: a deadline as a floor for a workload's least episode (`Floor`),
  and the nightly bound shared among its tests (`share_of_bound`).
- `timeline`: the memory timeline of a stress run, read from outside extkv
  (`MemoryTimeline`).
- `walk`: the endurance walk, a seeded random walk over a cache and its
  model (`walk`, `run_walk`).
- `faultable`, `faults`: every public operation, from the state it starts
  in (`OPERATIONS`), faulted at every call of every driver step, in both
  modes (`enumerate_faults`).
- `child`: a child process running this package, spoken to by lines;
  `__main__` is what the child runs (`python -m extkv.testing.stress
  walk|pressure|crash-child|budget-engine ...`).
- `pressure`: the pressure process, holding and freeing real memory as told
  (`PressureProcess`); `under_pressure`: real out-of-memory episodes and the
  walk beside the pressure (`meet_real_out_of_memory`,
  `walk_under_pressure`).
- `threads`: several threads mixing operations on one cache
  (`thread_rounds`).
- `ahead`: decode beside commit-ahead, with shrinks, sleeps and new
  windows (`decode_beside_commit_ahead`).
- `crashes`: an exporter SIGKILLed at a random point (`crash_once`);
  `reclaim`: whether the memory a gone child held came back.
- `processes`: several walks in child processes on one device
  (`run_walk_processes`).
- `budget_sampler`: what several processes hold together, read from
  outside every 10 ms (`OutsideSampler`); `budget_engine`: an engine
  child on a device under a shared KV budget, spoken to by lines; `budget_result`:
  what a budget stress run found (`BudgetStressResult`); `budget`: engine
  processes sharing one KV budget through SIGKILLs of engines and of the
  daemon (`share_one_budget`).
- `warm_up`: the workloads' kernels, run once before any usage is compared;
  imported here, so that its registration holds wherever a workload runs.

This package hands on the names the suites use.
"""

from __future__ import annotations

from . import warm_up  # noqa: F401  (registers the workloads' warm-up)
from .ahead import decode_beside_commit_ahead
from .base import HOST_STRESS_GRANULE, stress_driver, warmed_probe
from .budget import BUDGET_STRESS_BYTES, BUDGET_STRESS_GRANULES, OutsideUnreadable, share_one_budget
from .budget_result import BudgetStressResult
from .budget_sampler import OutsideSampler
from .bounds import Floor, share_of_bound
from .crashes import crash_once
from .faultable import OPERATIONS
from .faults import enumerate_faults
from .pressure import PressureProcess
from .processes import run_walk_processes
from .tally import StressTally
from .threads import LEAST_THREAD_ROUNDS, thread_rounds
from .timeline import MemoryTimeline
from .under_pressure import meet_real_out_of_memory, walk_under_pressure
from .walk import FULL_CHECK_EVERY, WALK_EPISODE_OPERATIONS, run_walk, walk, walked_through

__all__ = [
    "BUDGET_STRESS_BYTES",
    "BUDGET_STRESS_GRANULES",
    "FULL_CHECK_EVERY",
    "HOST_STRESS_GRANULE",
    "LEAST_THREAD_ROUNDS",
    "OPERATIONS",
    "WALK_EPISODE_OPERATIONS",
    "BudgetStressResult",
    "Floor",
    "MemoryTimeline",
    "OutsideSampler",
    "OutsideUnreadable",
    "PressureProcess",
    "StressTally",
    "crash_once",
    "decode_beside_commit_ahead",
    "enumerate_faults",
    "meet_real_out_of_memory",
    "run_walk",
    "run_walk_processes",
    "share_of_bound",
    "share_one_budget",
    "stress_driver",
    "thread_rounds",
    "walk",
    "walk_under_pressure",
    "walked_through",
    "warmed_probe",
]
