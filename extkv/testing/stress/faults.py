"""Every driver step of every operation, faulted.

Theory of operation
-------------------
`enumerate_faults` takes each operation of extkv.testing.stress.faultable's
`OPERATIONS`, from its prepared state, and plans a fault at the 1st, 2nd, ...
call of each driver step, as a plain failure and as out-of-memory
(FAULT_MODES), until the operation completes without reaching it. After each
fault: the state agrees with the driver's read-back and the usage probe,
committed bytes are kept where the contract keeps them, a retry succeeds
and ends exactly where a fault-free run ends (`golden_outcome`: same sizes,
physical bytes, one-chunk layout, bytes, over poisoned memory), and freeing
everything leaves no reservation, chunk, descriptor or byte behind: after
every attempt, the last one too, whose fault the operation never reached.
The tally counts faults by (operation, step, mode) and the pairs no call
reached.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from ... import vmm
from ...errors import DriverError, OutOfMemoryError
from ...layout import KVCacheLayout
from ...peer import sha256_hex
from ...usage import UsageProbe, open_chunk_fds
from ...vmm import FAULTABLE_STEPS, Driver, FaultInjectingDriver, PoisoningDriver
from ..checks import check_readback_matches_bookkeeping, readback_one_chunk_per_segment
from ..machines import CACHE_MACHINE_CASES
from ..modelled_cache import capacity_for
from ..models import ContentMismatch, LeakFound
from .faultable import OPERATIONS, FaultableOperation, Scene
from .tally import StressTally


#: How an injected fault fails its call: a plain DriverError, or OutOfMemoryError.
FAULT_MODES = ("failure", "out of memory")
#: A guard against an operation that never stops making calls of one step.
MAX_CALLS_ENUMERATED = 256
#: Steps after whose failure unmapped chunks may wait for the retry to be
#: released (tensor.release_physical keeps them recorded, not released).
STEPS_THAT_LEAVE_RELEASES_OWED = ("unmap", "release")
#: A call number no operation reaches: a fault planned there never fires.
NEVER = 1 << 62


def chunk_fd_count() -> int:
    """Descriptors of extkv chunks this process holds (exported ones too:
    they reopen the same memfds)."""
    return len(open_chunk_fds())


def live_counts(kind: str) -> tuple[int, int]:
    return vmm.live_reservations[kind], vmm.live_chunks[kind]


def observe(scene: Scene) -> dict:
    """Everything a fault-free run and a failed-then-retried run must agree
    on: sizes, committed count, physical bytes, which segments are one chunk
    (read back), each segment's bytes (as digests), what a peer imported."""
    seen: dict[str, object] = {}
    for name, buffer in (("cache", scene.cache.buffer if scene.cache else None), ("tensor", scene.tensor)):
        if buffer is None:
            continue
        if buffer.is_freed:
            seen[name] = "freed"
            continue
        sizes = buffer.segment_sizes
        seen[name] = {
            "segment sizes": sizes,
            "committed blocks": scene.cache.num_committed_blocks if name == "cache" else None,
            "physical bytes": buffer.physical_bytes,
            "one chunk per segment (read back)": readback_one_chunk_per_segment(buffer, sizes),
            "segment digests": [sha256_hex(buffer.segment_view(i)) for i in range(len(sizes))],
        }
    if scene.imported is not None:
        seen["import"] = scene.imported.digests() if scene.imported.views else "closed"
    return seen


def compare_outcomes(seen: dict, golden: dict, what: str) -> None:
    if seen == golden:
        return
    differences = []
    for name in sorted(set(seen) | set(golden)):
        mine, theirs = seen.get(name), golden.get(name)
        if isinstance(mine, dict) and isinstance(theirs, dict):
            differences += [f"{name} {key}" for key in mine if mine[key] != theirs.get(key)]
        elif mine != theirs:
            differences.append(name)
    error = ContentMismatch if any("digests" in d or d == "import" for d in differences) else AssertionError
    raise error(f"{what}: differs from a fault-free run in {', '.join(differences)}")


def check_after_failure(
    scene: Scene, operation: FaultableOperation, kept: list[torch.Tensor], step: str, probe: UsageProbe, baseline: int, what: str
) -> None:
    """The state a failed operation leaves: the driver's read-back agrees with
    the bookkeeping, the usage probe with `physical_bytes` (after a failed
    unmap or release, chunks already unmapped stay owed a release until the
    retry, so it may read more), a cache's sizes match its committed count
    or nothing, and committed bytes the contract keeps are still there."""
    buffer = scene.buffer
    if buffer is None or buffer.is_freed:
        return
    check_readback_matches_bookkeeping(buffer)
    measured = probe.read_outside_torch() - baseline
    owed = step in STEPS_THAT_LEAVE_RELEASES_OWED and measured > buffer.physical_bytes
    if measured != buffer.physical_bytes and not owed:
        raise LeakFound(f"{what}: {probe.source}: {measured} bytes above baseline, but {buffer.physical_bytes} mapped")
    if scene.cache is not None:
        sizes = buffer.segment_sizes
        counted = [scene.cache.num_committed_blocks * stride for stride in scene.cache.segment_strides]
        assert sizes in (counted, [0] * len(sizes)), f"{what}: segment sizes {sizes}, neither the committed count's {counted} nor released"
    if operation.keeps_contents:
        for i, before in enumerate(kept):
            now = buffer.segment_view(i)
            common = min(now.numel(), before.numel())
            if not torch.equal(now[:common], before[:common].to(now.device)):
                raise ContentMismatch(f"{what}: segment {i}: committed bytes changed by a failed operation that keeps them")


def fault_attempt(
    operation: FaultableOperation,
    scenario: tuple[str, KVCacheLayout],
    real: Driver,
    probe: UsageProbe,
    tally: StressTally,
    step: str,
    nth: int,
    mode: str,
    golden: dict,
) -> bool:
    """Plan a fault at the `nth` call of `step` during `operation`; True when
    the operation reached it. Everything is checked and freed before return,
    and nothing may be left, whether the fault fired or not: the attempt it
    never reached is the operation's fault-free run."""
    kind, layout = scenario
    live, fds, baseline = live_counts(real.kind), chunk_fd_count(), probe.read_outside_torch()
    scene = new_scene(scenario, real, out_of_memory=mode == "out of memory", target_is_importer=operation.target_is_importer)
    try:
        reached = _fault_and_retry(operation, scene, probe, baseline, tally, step, nth, mode, golden,
                                   f"{operation.name}, fault ({mode}) at call {nth} of {step}, {kind}-{layout.name}")
    finally:
        scene.close()
    left = live_counts(real.kind), chunk_fd_count(), probe.read_outside_torch() - baseline
    if left != (live, fds, 0):
        raise LeakFound(
            f"{operation.name}, fault ({mode}) at call {nth} of {step}{'' if reached else ' (never reached)'}: after "
            f"freeing everything, live (reservations, chunks) {live} -> {left[0]}, chunk descriptors {fds} -> "
            f"{left[1]}, {left[2]} bytes above baseline"
        )
    tally.checks["nothing left after a fault and its retry" if reached else "nothing left after a fault-free run"] += 1
    return reached


def _fault_and_retry(
    operation: FaultableOperation, scene: Scene, probe: UsageProbe, baseline: int, tally: StressTally,
    step: str, nth: int, mode: str, golden: dict, what: str,
) -> bool:
    """`fault_attempt` on a new scene, up to its leak check."""
    operation.prepare(scene)
    # Copies of the committed bytes only where the contract keeps them:
    # nothing else reads them (on the host, clones of fresh pages were
    # a sixth of a fault enumeration's time under cProfile).
    kept = scene.committed_bytes() if operation.keeps_contents else []
    scene.target.fail_in(step, nth)
    error: DriverError | None = None
    try:
        operation.call(scene)
    except DriverError as raised:
        error = raised
    if not scene.target.fired:
        # Moved out of reach, so that freeing the scene does not meet it.
        scene.target.fail_in(step, NEVER)
        if error is not None:
            raise error
        if nth == 1:
            tally.unreached.add((operation.name, step))
        return False
    tally.faults[(operation.name, step, mode)] += 1
    tally.operations["operation under an injected fault, retried"] += 1
    if error is not None:
        expected = OutOfMemoryError if mode == "out of memory" else DriverError
        if not isinstance(error, expected) or "injected fault" not in str(error):
            raise AssertionError(f"{what}: raised {error!r}, expected the injected {expected.__name__}") from error
        check_after_failure(scene, operation, kept, step, probe, baseline, what)
        if operation.after_failure is not None:
            operation.after_failure(scene)
        tally.checks["consistent after an injected fault: read-back, usage, kept bytes"] += 1
        operation.call(scene)  # each planned fault fires once: the retry must succeed
    else:
        # CUDA answers an out-of-memory create by emptying torch's cache
        # and creating again, which succeeds past a one-shot fault.
        tally.events["injected out-of-memory absorbed by the create retry"] += 1
    if operation.finish is not None:
        operation.finish(scene)
    compare_outcomes(observe(scene), golden, what)
    tally.checks["retry ends where a fault-free run ends"] += 1
    return True


def new_scene(scenario: tuple[str, KVCacheLayout], real: Driver, *, out_of_memory: bool, target_is_importer: bool) -> Scene:
    kind, layout = scenario
    driver = FaultInjectingDriver(PoisoningDriver(real), out_of_memory=out_of_memory)
    importer = FaultInjectingDriver(real, out_of_memory=out_of_memory)
    return Scene(
        kind, layout, capacity_for(kind, layout, real.granularity), driver, importer,
        importer if target_is_importer else driver,
    )


def golden_outcome(operation: FaultableOperation, scenario: tuple[str, KVCacheLayout], real: Driver) -> dict:
    """`observe` after `operation` ran without a fault."""
    scene = new_scene(scenario, real, out_of_memory=False, target_is_importer=operation.target_is_importer)
    try:
        operation.prepare(scene)
        operation.call(scene)
        if operation.finish is not None:
            operation.finish(scene)
        return observe(scene)
    finally:
        scene.close()


def enumerate_faults(
    real: Driver,
    probe: UsageProbe,
    tally: StressTally,
    *,
    scenarios: list[tuple[str, KVCacheLayout]] = CACHE_MACHINE_CASES[:1],
    operations: list[FaultableOperation] = OPERATIONS,
    until: float | None = None,
    progress: Callable[[str], None] | None = None,
) -> bool:
    """For each scenario and operation: a fault at the 1st, 2nd, ... call of
    every driver step, in both modes, until the operation completes without
    reaching it. `real` is the real driver (host or CUDA) under it all.
    Returns False when `until` (time.monotonic) stopped it first."""
    for scenario in scenarios:
        for operation in operations:
            golden = golden_outcome(operation, scenario, real)
            for mode in FAULT_MODES:
                for step in FAULTABLE_STEPS:
                    if until is not None and time.monotonic() > until:
                        tally.events["fault enumeration stopped by its time bound"] += 1
                        return False
                    nth = 1
                    while fault_attempt(operation, scenario, real, probe, tally, step, nth, mode, golden):
                        nth += 1
                        if nth > MAX_CALLS_ENUMERATED:
                            raise AssertionError(f"{operation.name} made more than {MAX_CALLS_ENUMERATED} {step} calls")
            if progress is not None:
                covered = sum(1 for name, _ in tally.pairs_covered if name == operation.name)
                progress(f"faults: {operation.name} ({scenario[0]}-{scenario[1].name}): {covered} steps covered")
    tally.events["fault enumeration passes completed"] += 1
    return True
