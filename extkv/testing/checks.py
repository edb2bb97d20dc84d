"""Named checks of ExtensibleTensor invariants, shared by the conformance
suite, the state-machine tests and stress runs. Each raises AssertionError
with a message that says what disagreed."""

from __future__ import annotations

from ..tensor import ExtensibleTensor
from ..usage import UsageProbe


def granule_addresses(tensor: ExtensibleTensor) -> list[int]:
    """First and last byte of every granule of the reservation."""
    g = tensor.granularity
    return [a for i in range(tensor.reserved_bytes // g) for a in (tensor.base + i * g, tensor.base + (i + 1) * g - 1)]


def check_readback_matches_bookkeeping(tensor: ExtensibleTensor) -> None:
    """The driver/kernel's view of which chunk backs each granule partitions
    the reservation exactly as the tensor's bookkeeping does."""
    g = tensor.granularity
    addresses = granule_addresses(tensor)
    read_back = tensor.driver.chunks_at(addresses)
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
    g = tensor.granularity
    result = []
    for offset, size in zip(tensor.segment_offsets, sizes):
        if size == 0:
            result.append(True)
            continue
        start, end = tensor.base + offset, tensor.base + offset + size
        probes = sorted({start, end - 1, *range(-(-start // g) * g, end, g)})
        identities = set(tensor.driver.chunks_at(probes))
        result.append(None not in identities and len(identities) == 1)
    return result


def maps_permissions(address: int) -> str:
    """The kernel's permissions ("rw-s") of the host mapping holding `address`."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, permissions = line.split()[:2]
            start, end = (int(part, 16) for part in span.split("-"))
            if start <= address < end:
                return permissions
    raise AssertionError(f"nothing is mapped at {address:#x}")


def check_usage_matches(probe: UsageProbe, baseline: int, tensors: list[ExtensibleTensor]) -> None:
    """Physical usage measured outside extkv, above `baseline`, equals what the
    tensors say they map."""
    measured = probe.read_outside_torch() - baseline
    booked = sum(t.physical_bytes for t in tensors if not t.is_freed)
    if measured != booked:
        raise AssertionError(f"{probe.source} reports {measured} bytes above baseline, tensors map {booked}")


def warm_up_kernels(device) -> None:
    """Run once the kernels the suites use, so that CUDA's lazy module loading
    grows the context before leak baselines are taken, not during a test."""
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
    if device.type == "cuda":
        torch.cuda.synchronize(device)
