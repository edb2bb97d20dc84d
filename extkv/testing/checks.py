"""Named checks of ExtensibleTensor invariants, shared by the conformance
suite, the state-machine tests and stress runs. Each raises AssertionError
with a message that says what disagreed, in numbers: never a view's
contents, which may reach unmapped memory.

"Changes nothing" is checked against a `snapshot`: the mapped chunks as
objects (a remap that reuses a handle number or an address still replaces
the `MappedChunk`), the driver's or kernel's read-back of every granule, a
copy of every committed byte, and for a cache its own state (counts, sizes,
torch's cap, sleep, its commit-ahead worker).
"""

from __future__ import annotations

import contextlib

from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import torch

from ..cache import ExtensibleKVCache
from ..tensor import ExtensibleTensor, MappedChunk
from ..usage import UsageProbe
from ..vmm import driver_for
from ..vmm.base import READ_ONLY, Driver
from ..vmm.late import load_spin_kernel


def granule_addresses(tensor: ExtensibleTensor) -> list[int]:
    """First and last byte of every granule of the reservation."""
    g = tensor.granularity
    return [a for i in range(tensor.reserved_bytes // g) for a in (tensor.base + i * g, tensor.base + (i + 1) * g - 1)]


def read_back_granules(tensor: ExtensibleTensor) -> list[Hashable | None]:
    """The driver/kernel's answer for every address of `granule_addresses`."""
    return tensor.driver.chunks_at(granule_addresses(tensor))


def check_readback_matches_bookkeeping(tensor: ExtensibleTensor, read_back: list[Hashable | None] | None = None) -> None:
    """The driver/kernel's view of which chunk backs each granule partitions
    the reservation exactly as the tensor's bookkeeping does. `read_back`:
    a `read_back_granules` taken just before, to spare a second read."""
    g = tensor.granularity
    addresses = granule_addresses(tensor)
    read_back = read_back_granules(tensor) if read_back is None else read_back
    booked: list[int | None] = [None] * (tensor.reserved_bytes // g)
    for number, mapped in enumerate(tensor.mapped_chunks):
        booked[mapped.first_granule : mapped.first_granule + mapped.num_granules] = [number] * mapped.num_granules
    pairs: dict[object, int | None] = {}
    for index, identity in enumerate(read_back):
        granule = index // 2
        expected = booked[granule]
        if (identity is None) != (expected is None):
            raise AssertionError(
                f"granule {granule} at {addresses[index]:#x}: driver reads {identity!r}, bookkeeping says "
                f"{'unmapped' if expected is None else f'chunk #{expected}'}"
            )
        if identity is not None and pairs.setdefault(identity, expected) != expected:
            raise AssertionError(
                f"granule {granule}: driver chunk {identity!r} backs both bookkept chunk #{pairs[identity]} and #{expected}"
            )
    if len(set(pairs.values())) != len(pairs):
        raise AssertionError(f"one bookkept chunk is backed by several driver chunks: {pairs}")


def readback_one_chunk_per_segment(tensor: ExtensibleTensor, sizes: list[int]) -> list[bool]:
    """`segments_backed_by_one_chunk`, computed from driver read-back alone."""
    return read_back_granules_and_one_chunk_per_segment(tensor, sizes, granules=False)[1]


def read_back_granules_and_one_chunk_per_segment(
    tensor: ExtensibleTensor, sizes: list[int], *, granules: bool = True
) -> tuple[list[Hashable | None], list[bool]]:
    """`read_back_granules(tensor)` (empty unless `granules`) and
    `readback_one_chunk_per_segment(tensor, sizes)` from one driver read-back
    of both sets of addresses: on the host each read-back is a parse of
    /proc/self/maps, about 500 lines and 5 ms in a process that has imported
    torch (measured on the 2-core CI host)."""
    g = tensor.granularity
    probes_per_segment = []
    for offset, size in zip(tensor.segment_offsets, sizes):
        probes_per_segment.append(granule_probes(tensor.base + offset, tensor.base + offset + size, g))
    addresses = granule_addresses(tensor) if granules else []
    answers = tensor.driver.chunks_at(addresses + [probe for probes in probes_per_segment for probe in probes])
    read_back, identities = answers[: len(addresses)], iter(answers[len(addresses) :])
    result = []
    for probes in probes_per_segment:
        seen = {next(identities) for _ in probes}
        result.append(not probes or (None not in seen and len(seen) == 1))
    return read_back, result


def granule_probes(start: int, end: int, granule: int) -> list[int]:
    """Addresses that meet every granule of bytes [start, end): the first
    byte, each granule start inside, the last byte."""
    return sorted({start, end - 1, *range(-(-start // granule) * granule, end, granule)}) if end > start else []


def check_committed_blocks_mapped(kv_cache: ExtensibleKVCache, read_back: list[Hashable | None] | None = None) -> None:
    """Every committed block of every segment reads back from the driver or
    kernel as mapped (`granule_probes` over each segment's committed
    prefix): a committed count raised past what is mapped would hand an
    engine blocks over unmapped memory, whatever the bookkeeping says. For
    an awake cache: a sleeping one's blocks are unmapped by design.
    `read_back`: a `read_back_granules` of the buffer taken just before,
    answering for each probe's granule instead of a second read."""
    buffer, committed, g = kv_cache.buffer, kv_cache.num_committed_blocks, kv_cache.buffer.granularity
    probes: list[tuple[int, int]] = []  # (segment, address)
    for segment, (offset, stride) in enumerate(zip(kv_cache.segment_offsets, kv_cache.segment_strides)):
        start = buffer.base + offset
        probes += [(segment, a) for a in granule_probes(start, start + committed * stride, g)]
    if read_back is None:
        answers = buffer.driver.chunks_at([address for _, address in probes])
    else:
        answers = [read_back[2 * ((address - buffer.base) // g)] for _, address in probes]
    unmapped = [probe for probe, identity in zip(probes, answers) if identity is None]
    if unmapped:
        segment, address = unmapped[0]
        block = (address - buffer.base - kv_cache.segment_offsets[segment]) // kv_cache.segment_strides[segment]
        raise AssertionError(
            f"{len(unmapped)} of {len(probes)} probed addresses of the {committed} committed blocks read back "
            f"unmapped; first: segment {segment}, block {block} (the buffer maps {kv_cache.grown_blocks} blocks)"
        )


def check_mapped_as_a_shrink_keeps(
    tensor: ExtensibleTensor, sizes: Sequence[int], read_back: list[Hashable | None] | None = None
) -> None:
    """After `shrink_segments_(sizes)` (a cache's preserving shrink), from
    the driver's or kernel's read-back alone: every granule that holds a
    byte of the first `sizes[i]` bytes of some segment i is mapped, and
    every chunk still mapped backs at least one such granule (one holding
    none should have been released). Reads no byte, so a kept granule a
    defect released is reported, never faulted on."""
    g = tensor.granularity
    kept = {
        index
        for offset, size in zip(tensor.segment_offsets, sizes)
        if size
        for index in range(offset // g, -(-(offset + size) // g))
    }
    read_back = read_back_granules(tensor) if read_back is None else read_back
    granules_of: dict[Hashable, list[int]] = {}
    for index in range(len(read_back) // 2):
        identity = read_back[2 * index]
        if identity is not None:
            granules_of.setdefault(identity, []).append(index)
    unmapped = sorted(index for index in kept if read_back[2 * index] is None)
    if unmapped:
        raise AssertionError(
            f"{len(unmapped)} of the {len(kept)} granules holding kept bytes read back unmapped after the shrink; "
            f"first: granule {unmapped[0]}"
        )
    holding_none = [granules for granules in granules_of.values() if kept.isdisjoint(granules)]
    if holding_none:
        first = min(holding_none)
        raise AssertionError(
            f"{len(holding_none)} driver chunk(s) still mapped hold no kept byte; the first backs granules "
            f"{first[0]} to {first[-1]} ({len(first) * g} bytes), which the shrink should have released"
        )


def check_all_equal(actual: torch.Tensor, expected: torch.Tensor | int, what: str) -> None:
    """`actual` equals `expected` (a tensor of the same length, or one byte
    value for all of it); the message counts the differing bytes."""
    # pytest prints the arguments of every frame of a failure; hidden, this
    # frame cannot print `actual`, a view that may outlive its mapping.
    __tracebackhide__ = True
    if isinstance(expected, torch.Tensor):
        if actual.numel() != expected.numel():
            raise AssertionError(f"{what}: {actual.numel()} bytes, expected {expected.numel()}")
        expected = expected.to(actual.device)
        wanted = "the expected bytes"
    else:
        wanted = f"{expected:#04x}"
    if _all_equal_at_a_glance(actual, expected):
        return
    wrong = int((actual != expected).count_nonzero())
    if wrong:
        raise AssertionError(f"{what}: {wrong} of {actual.numel()} bytes are not {wanted}")


def _all_equal_at_a_glance(actual: torch.Tensor, expected: torch.Tensor | int) -> bool:
    """True when every byte of `actual` is `expected`, found by one pass that
    allocates nothing: the smallest and largest byte for one value, or the
    bytes compared eight at a time (int64) for a tensor. False where neither
    applies, or where a byte differs: the caller then counts, comparing
    elementwise into a new tensor, which over 2 MiB costs 0.7 ms against a
    tensor and 2 ms against a value (0.28 ms and 0.03 ms at a glance, 2-core
    CI host)."""
    if actual.numel() == 0:
        return True
    if not isinstance(expected, torch.Tensor):
        low, high = torch.aminmax(actual)
        return int(low) == expected and int(high) == expected
    if actual.dtype != torch.uint8 or expected.dtype != torch.uint8 or actual.numel() % 8:
        return False
    try:
        return torch.equal(actual.reshape(-1).view(torch.int64), expected.reshape(-1).view(torch.int64))
    except RuntimeError:  # not contiguous, or not 8-byte aligned: no int64 view
        return False


def maps_permissions(address: int) -> str:
    """The kernel's permissions ("rw-s") of the host mapping holding `address`."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, permissions = line.split()[:2]
            start, end = (int(part, 16) for part in span.split("-"))
            if start <= address < end:
                return permissions
    raise AssertionError(f"nothing is mapped at {address:#x}")


def check_mapped_read_only(driver: Driver, views: Sequence[torch.Tensor]) -> None:
    """Every granule of every view (its first byte, each granule start inside
    it, its last byte) reads back from the driver or kernel
    (`Driver.accesses_at`) as mapped read-only: what an import told to be
    read-only must be, whatever its bookkeeping says."""
    probes: list[tuple[int, int]] = []  # (view index, address)
    g = driver.granularity
    for index, view in enumerate(views):
        size = view.numel() * view.element_size()
        probes += [(index, a) for a in granule_probes(view.data_ptr(), view.data_ptr() + size, g)]
    accesses = driver.accesses_at([address for _, address in probes])
    wrong = [(index, address, access) for (index, address), access in zip(probes, accesses) if access != READ_ONLY]
    if wrong:
        index, address, access = wrong[0]
        raise AssertionError(
            f"{len(wrong)} of {len(probes)} probed addresses are not mapped read-only; first: view {index} at "
            f"offset {address - views[index].data_ptr()} reads back {access!r}"
        )


class ContextGrowth(AssertionError):
    """Usage measured outside extkv above what extkv maps, by whole steps a
    device's context may take by itself (`UsageProbe.lazy_growth_step`):
    a leak, or code the device loaded once. extkv.testing.second_run
    tells the two apart by running the test again."""

    def __init__(self, message: str, excess: int):
        super().__init__(message)
        self.excess = excess


def may_be_context_growth(probe: UsageProbe, excess: int) -> bool:
    """Whether a reading `excess` bytes above what extkv maps is whole steps
    of the growth `probe`'s device context takes by itself."""
    step = probe.lazy_growth_step
    return bool(step) and excess > 0 and excess % step == 0


def usage_mismatch(probe: UsageProbe, message: str, excess: int) -> AssertionError:
    """The error for a reading `excess` bytes off what extkv maps: a
    ContextGrowth where it may be the context's own growth, else a plain
    AssertionError."""
    return ContextGrowth(message, excess) if may_be_context_growth(probe, excess) else AssertionError(message)


def check_usage_matches(probe: UsageProbe, baseline: int, tensors: list[ExtensibleTensor]) -> None:
    """Physical usage measured outside extkv, above `baseline`, equals what the
    tensors say they map."""
    measured = probe.read_outside_torch() - baseline
    booked = sum(t.physical_bytes for t in tensors if not t.is_freed)
    if measured != booked:
        raise usage_mismatch(probe, f"{probe.source} reports {measured} bytes above baseline, tensors map {booked}",
                             measured - booked)


#: Warm-ups of workloads in layers above this one (extkv.testing.stress
#: registers its walk), which `warm_up_kernels` runs too: the harness takes
#: every leak baseline after it, and cannot import those layers.
_WORKLOAD_WARM_UPS: list[Callable[[object], None]] = []


def register_workload_warm_up(warm_up: Callable[[object], None]) -> None:
    """Have `warm_up_kernels(device)` also call `warm_up(device)`."""
    if warm_up not in _WORKLOAD_WARM_UPS:
        _WORKLOAD_WARM_UPS.append(warm_up)


def warm_up_kernels(device) -> None:
    """Run once the kernels the suites use, so that CUDA's lazy module loading
    grows the context before leak baselines are taken, not during a test:
    on an H200 the stress workloads' kernels alone grew NVML's reading by 35
    granules, read as a leak by whichever test ran them first."""
    import torch

    a = torch.arange(1 << 16, dtype=torch.int64, device=device).remainder(251).add(1).to(torch.uint8)
    b = torch.empty_like(a).fill_(3)
    b.copy_(a)
    b.zero_()
    b.add_(0)
    for result in (torch.equal(a, b), a.count_nonzero(), torch.all(a == 3), a.sum(), (a != b).any()):
        bool(result) if not isinstance(result, bool) else result
    x = torch.randn(256, 256, device=device)
    (x @ x).softmax(-1).float().sum().item()
    # The byte checks' own kernels, both paths: loaded lazily in the middle
    # of a test, a kernel's first launch waits for the work queued before it
    # (seen on the H200), which orders a read after a zeroing that the code
    # under test left unordered.
    with contextlib.suppress(AssertionError):
        check_all_equal(a, 0, "the warm-up's bytes")
    check_all_equal(a, a.clone(), "the warm-up's bytes")
    for warm_up in _WORKLOAD_WARM_UPS:
        warm_up(device)
    load_spin_kernel(driver_for(device))
    driver_for(device).synchronize()


@dataclass(frozen=True)
class Snapshot:
    """Everything observable about a tensor (and the cache around it)."""

    base: int
    segment_sizes: tuple[int, ...]
    physical_bytes: int
    #: The bookkept chunks themselves; holding them keeps their ids unique.
    mapped_chunks: tuple[MappedChunk, ...]
    #: Driver/kernel read-back at the first and last byte of every granule.
    readback: tuple[Hashable | None, ...]
    #: Copies of each segment's committed bytes.
    contents: tuple[torch.Tensor, ...]
    #: For a cache: its own state, by name (`cache_state`); empty for a bare tensor.
    cache_state: tuple[tuple[str, object], ...]


#: What a cache says of itself beyond its buffer: counts, sizes, the cap it
#: put on torch, its lifecycle, its commit-ahead worker (its window, and
#: its steps: the worker's own count, 0 once it is stopped or started again).
_CACHE_ATTRIBUTES = (
    "num_committed_blocks",
    "capacity_blocks",
    "segment_offsets",
    "segment_strides",
    "torch_memory_limit",
    "reserved_headroom_bytes",
    "warmup_committable_blocks",
    "is_asleep",
    "is_broken",
    "is_freed",
    "commit_ahead_window",
    "commit_ahead_steps",
)


def cache_state(kv_cache: ExtensibleKVCache) -> tuple[tuple[str, object], ...]:
    """The cache's own state, by name (`_CACHE_ATTRIBUTES`)."""
    return tuple((name, getattr(kv_cache, name)) for name in _CACHE_ATTRIBUTES)


def _buffer(target: ExtensibleTensor | ExtensibleKVCache) -> ExtensibleTensor:
    return target.buffer if isinstance(target, ExtensibleKVCache) else target


def snapshot(target: ExtensibleTensor | ExtensibleKVCache) -> Snapshot:
    """The state of a live tensor or cache, taken under its lock."""
    tensor = _buffer(target)
    with tensor.lock:
        own_state = cache_state(target) if isinstance(target, ExtensibleKVCache) else ()
        return Snapshot(
            base=tensor.base,
            segment_sizes=tuple(tensor.segment_sizes),
            physical_bytes=tensor.physical_bytes,
            mapped_chunks=tuple(tensor.mapped_chunks),
            readback=tuple(read_back_granules(tensor)),
            contents=tuple(tensor.segment_view(i).clone() for i in range(len(tensor.segment_sizes))),
            cache_state=own_state,
        )


def check_unchanged(target: ExtensibleTensor | ExtensibleKVCache, before: Snapshot) -> None:
    """`target` is as `before` recorded it: same chunk objects, same read-back,
    same committed bytes, same numbers."""
    now = snapshot(target)
    problems = []
    for field in ("base", "segment_sizes", "physical_bytes"):
        if getattr(now, field) != getattr(before, field):
            problems.append(f"{field} {getattr(before, field)} -> {getattr(now, field)}")
    for (name, old), (_, new) in zip(before.cache_state, now.cache_state):
        if new != old:
            problems.append(f"cache {name} {old!r} -> {new!r}")
    if len(now.mapped_chunks) != len(before.mapped_chunks) or any(
        a is not b for a, b in zip(now.mapped_chunks, before.mapped_chunks)
    ):
        def describe(chunks):
            return [(hex(m.address), m.num_granules, m.chunk.handle, id(m)) for m in chunks]

        problems.append(f"mapped chunks replaced: {describe(before.mapped_chunks)} -> {describe(now.mapped_chunks)}")
    changed = [i for i, (a, b) in enumerate(zip(before.readback, now.readback)) if a != b]
    if changed:
        first = changed[0]
        problems.append(
            f"driver read-back changed at {len(changed)} probe(s), first granule {first // 2}: "
            f"{before.readback[first]!r} -> {now.readback[first]!r}"
        )
    for i, (old, new) in enumerate(zip(before.contents, now.contents)):
        if old.numel() == new.numel() and not torch.equal(old, new):
            problems.append(f"segment {i}: {int((old != new).sum())} of {old.numel()} committed bytes changed")
    if problems:
        raise AssertionError("expected no change, but: " + "; ".join(problems))
