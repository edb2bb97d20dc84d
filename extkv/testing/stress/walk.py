"""The endurance walk: a seeded random walk over a cache and its model.

Theory of operation
-------------------
`walk` drives a `ModelledCache`, the cache beside its plain-Python model
(extkv.testing.modelled_cache), through random operations picked by
WALK_WEIGHTS. Hypothesis's per-step cost caps a state machine at tens of
steps a second; the walk runs the same operations at hundreds. Each step
runs the checks its operation alone could break (counts, sizes, the bytes
it touched, one chunk per segment after a defragment); every
`full_check_every` steps the full invariant runs (every byte, the driver's
read-back, the usage probe). A failure names the seed, the step and the
steps before it, and the command that walks it again (`python -m
extkv.testing.stress walk ... --steps N`).

A walk's deadline is a floor for its least episode (`least`; in the nightly
suite `walked_through`: every operation of WALK_EPISODE_OPERATIONS ran).
`run_walk` walks a fresh cache on `stress_driver(device)` and then requires
that freeing it left nothing behind; under real memory pressure it retries
a commit refused by out-of-memory once the process pressing on memory has
released it (`out_of_memory_waiter`): an event that process sends, never a
reading of the machine's free memory, which other processes move too.
"""

from __future__ import annotations

import collections
import time
from typing import Callable

import torch

from ...errors import OutOfMemoryError
from ...layout import KVCacheLayout
from ...usage import UsageProbe
from ..choices import SeededChoices
from ..modelled_cache import ModelledCache
from ..models import LeakFound
from .base import stress_driver, warmed_probe
from .bounds import Floor
from .tally import StressTally


#: How often each `ModelledCache` operation is picked, relative to the others:
#: a serving engine reads and writes blocks far more often than it resizes.
WALK_WEIGHTS: dict[str, float] = {
    "commit_grow": 8,
    "commit_at_or_below": 3,
    "shrink": 3,
    "shrink_preserving": 3,
    "defragment": 5,
    "release": 2,
    "recommit": 3,
    "write_block": 14,
    "read_block": 10,
    "export_to_peer": 1,
    "free_and_recreate": 0.5,
    "capture_graph": 0.5,
    "replay_graphs": 2,
}
#: Steps between two full checks of everything.
FULL_CHECK_EVERY = 16
#: Steps after which a walk past its deadline gives up on its least episode
#: as unreachable (minutes on the host driver, where a walk runs hundreds of
#: steps a second).
LEAST_STEPS_CAP = 200_000
#: The operations whose running at least once is a walk's least episode in
#: the nightly suite (stress/test_endurance.py asserts each ran).
WALK_EPISODE_OPERATIONS = ("commit (grow)", "commit (shrink)", "commit (defragment, preserving)", "recommit", "write a block")


def walked_through(operations: collections.Counter, names: tuple[str, ...] = WALK_EPISODE_OPERATIONS, least_steps: int = 1):
    """A walk's `least`: at least `least_steps` steps, with every operation
    of `names` run at least once (counted in `operations`)."""
    return lambda steps: steps >= least_steps and all(operations[name] > 0 for name in names)


def walk(
    driven: ModelledCache,
    choices: SeededChoices,
    tally: StressTally,
    *,
    until: float | None = None,
    steps: int | None = None,
    full_check_every: int = FULL_CHECK_EVERY,
    weights: dict[str, float] = WALK_WEIGHTS,
    replay: str = "",
    least: Callable[[int], bool] | None = None,
    least_what: str = "one step",
    workload: str = "walk",
) -> int:
    """Run `driven` through random operations until `until` (time.monotonic)
    or for `steps` steps; return the steps run. `until` is a floor for the
    walk's least episode: past it the walk goes on until `least(steps so
    far)` holds (default: one step), and says in `tally` when that took it
    past `until` (`least_what` names the least). A failure is recorded in
    `tally` with the seed, the step and the steps before it (and `replay`,
    the command that runs this walk again), then raised."""
    if until is None and steps is None:
        raise ValueError("walk needs a bound: until= (a time.monotonic() deadline) or steps=")
    names = list(weights)
    step = 0
    least = least or (lambda ran: ran >= 1)
    floor = Floor(until, lambda: least(step))
    try:
        while (steps is None or step < steps) and floor.more():
            if floor.done_at is None and until is not None and step > LEAST_STEPS_CAP and time.monotonic() > until:
                raise AssertionError(f"{step} steps, past its deadline, and the walk has not done its least: {least_what}")
            choices.step = step
            driven.thorough = step % full_check_every == full_check_every - 1
            possible = [name for name in names if weights[name] > 0 and driven.can(name)]
            operation = choices.random.choices(possible, [weights[name] for name in possible])[0]
            getattr(driven, operation)(choices)
            if driven.thorough:
                driven.check_everything()
            tally.observe_physical(driven.cache.physical_bytes)
            step += 1
    except BaseException as error:
        reproduction = (
            f"seed {choices.seed}, failed at step {step}"
            + (f"; run again: {replay} --steps {step + 1}" if replay else "")
            + "\n"
            + "\n".join(choices.recent)
        )
        if isinstance(error, Exception):
            tally.fail(error, reproduction)
            error.add_note(reproduction)
        raise
    floor.close(tally, workload, f"{step} steps ({least_what})")
    return step


def run_walk(
    device: torch.device | str,
    kind: str,
    layout: KVCacheLayout,
    seed: int,
    tally: StressTally,
    *,
    until: float | None = None,
    steps: int | None = None,
    full_check_every: int = FULL_CHECK_EVERY,
    weights: dict[str, float] = WALK_WEIGHTS,
    probe: UsageProbe | None = None,
    capacity: int | None = None,
    memory_returns: Callable[[], None] | None = None,
    usage_checks: bool = True,
    beside_full_device: bool = False,
    least: Callable[[int], bool] | None = None,
    least_what: str = "one step",
    workload: str = "walk",
) -> int:
    """A walk over a fresh cache of `config_for(kind, layout, capacity)` on
    `stress_driver(device)`; the cache is freed afterwards and must leave
    nothing behind. With `memory_returns`, a commit refused by real
    out-of-memory is checked, then made again once `memory_returns()` has
    returned (it waits for the pressing process's next release);
    `beside_full_device` keeps the checks from taking device memory (no
    snapshots, comparisons on the host). `least`, `least_what`: the walk's
    least episode (see `walk`). Returns the steps run."""
    device = torch.device(device)
    driver = stress_driver(device)
    probe = warmed_probe(device) if probe is None else probe
    tally.seeds.append(seed)
    tally.settings["full check every (steps)"] = full_check_every
    driven = ModelledCache(driver, probe, kind, layout, capacity, operations=tally.operations, checks=tally.checks)
    driven.usage_checks = usage_checks
    driven.snapshot_checks = not beside_full_device
    driven.compare_on_host = beside_full_device
    tally.settings["usage probe compared"] = "yes" if usage_checks else f"no: {probe.source}, other processes share the device"
    if memory_returns is not None:
        driven.on_out_of_memory = out_of_memory_waiter(tally, driven.check_mapping, memory_returns)
    replay = (
        f"python -m extkv.testing.stress walk --device {device} --kind {kind} --layout {layout.name} "
        f"--seed {seed} --full-check-every {full_check_every}"
    )
    try:
        ran = walk(
            driven, SeededChoices(seed), tally, until=until, steps=steps,
            full_check_every=full_check_every, weights=weights, replay=replay,
            least=least, least_what=least_what, workload=workload,
        )
    finally:
        driven.free()
    try:
        driven.check_nothing_left()
    except LeakFound as error:
        tally.fail(error, f"seed {seed}: after the walk's cache was freed")
        raise
    return ran


def out_of_memory_waiter(
    tally: StressTally, check: Callable[[], None], memory_returns: Callable[[], None]
) -> Callable[[OutOfMemoryError], None]:
    """A `ModelledCache.on_out_of_memory` for walks under real pressure: the
    cache must be consistent after the refusal (`check`); then wait for the
    pressing process's next release (`memory_returns`, bounded by that
    process's answer), and let the caller retry the same call. A retry that
    meets out-of-memory again (another process took the memory meanwhile)
    waits for the release after that."""

    def wait_for_memory(error: OutOfMemoryError) -> None:
        tally.events["real out-of-memory met by a walk's commit"] += 1
        check()
        memory_returns()
        tally.events["retried after the pressure process released its memory"] += 1

    return wait_for_memory
