"""How many bytes the KV cache may take: pure arithmetic, no device.

An extensible KV cache is sized twice. During warmup it may only commit what
leaves room for the activations warmup is about to hit (`committable_bytes`).
After warmup, with torch's cache emptied, the engine knows what everything else
really uses and gives the cache the rest of its budget (`measure_kv_cache_bytes`).
Both keep a *margin* free on top of the measured transients, because a
measurement taken once is a sample, not a bound.

Every function here takes plain byte counts, so tests can feed made-up numbers
and the cache feeds real ones.

Worked example (one 140 GiB device)
-----------------------------------

Before loading, 140 GiB are free. The engine asks for 90% of it:
``requested_memory`` = 126 GiB. After loading and warmup, with 2 GiB of KV cache
committed and torch's cache emptied, 40 GiB are free; warmup's transient peak
was 4 GiB.

* everything but the KV cache uses 140 - 40 - 2 = 98 GiB;
* the device headroom is 40 free + 2 committed = 42 GiB;
* margin = max(1 GiB floor, 0.75 * 4 GiB) = 3 GiB;
* available = min(126 - 98, 42 - 3) = min(28, 39) = 28 GiB;
* less the 4 GiB transient peak, kept free in full: **24 GiB** for the cache.

With ``requested_memory`` = 140 GiB (all of it) the device binds instead:
min(42, 39) - 4 = **35 GiB**, and 3 GiB of margin stay free beside the peak.

During warmup the same device, with 2 GiB committed, 40 GiB free and the
profiled peak (``reserved_headroom_bytes``) at 4 GiB, may commit up to

* headroom = 42 GiB;
* reserve = max(4 GiB, 10% of 42 GiB) = 4.2 GiB;
* margin = max(1 GiB, 0.75 * 4.2 GiB) = 3.15 GiB;
* budget = 42 - 3.15 - 4.2 = **34.65 GiB** of physical KV cache.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

from . import validate

__all__ = [
    "KV_CACHE_MARGIN_FLOOR_BYTES",
    "KV_CACHE_MARGIN_FRACTION",
    "KV_CACHE_NON_TORCH_RESERVE_BYTES",
    "KV_CACHE_WARMUP_RESERVE_FRACTION",
    "WEIGHT_UPDATE_PEAK_LAYER_FACTOR",
    "blocks_within",
    "committable_bytes",
    "measure_kv_cache_bytes",
    "segment_physical_bytes",
    "torch_memory_limit_bytes",
    "weight_update_peak_bytes",
]

GiB = 1 << 30
MiB = 1 << 20

# Smallest margin kept free beside the measured transients: allocator
# fragmentation and the first real steps' workspaces are not in a warmup sample.
KV_CACHE_MARGIN_FLOOR_BYTES = 1 * GiB

# Margin as a share of the measured transient peak, when that is larger than
# the floor: a sample of the peak understates the worst batch.
KV_CACHE_MARGIN_FRACTION = 0.75

# Share of the headroom warmup must leave free when no profiled peak is known
# yet (or a smaller one is), so early commits cannot starve warmup itself.
KV_CACHE_WARMUP_RESERVE_FRACTION = 0.1

# Device memory kept outside torch's cap once the cache is sized. Some memory
# is taken after warmup by code that never goes through torch's caching
# allocator, so torch's own statistics cannot see it coming: NCCL's channel and
# proxy buffers (created lazily per communicator and peer), CUDA modules loaded
# lazily on a kernel's first launch (CUDA_MODULE_LOADING=LAZY, the default),
# cuBLAS/cuBLASLt and other libraries' own device allocations. Tens of MiB
# each; 256 MiB covers them with room, and is under 0.2% of an H200.
KV_CACHE_NON_TORCH_RESERVE_BYTES = 256 * MiB

# A layerwise weight update holds the old and the new copy of one layer at
# once (the new one is loaded, then swapped in), so it needs twice the
# largest layer free.
WEIGHT_UPDATE_PEAK_LAYER_FACTOR = 2


def _check_bytes(name: str, value: object) -> int:
    return validate.integer(name, value)


def _check_count(name: str, value: object) -> int:
    return validate.integer(name, value)


def _check_fraction(name: str, value: object, *, at_most_one: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    upper = 1.0 if at_most_one else math.inf
    # Written so that NaN fails too; inf would overflow int() later.
    if not (0 <= value <= upper and math.isfinite(value)):
        wanted = "in [0, 1]" if at_most_one else "finite and >= 0"
        raise ValueError(f"{name} must be {wanted}, got {value}")
    return float(value)


def measure_kv_cache_bytes(
    *, init_free_memory: int, free_memory: int, committed_bytes: int, requested_memory: int,
    transient_peak_bytes: int = 0, margin_floor_bytes: int = KV_CACHE_MARGIN_FLOOR_BYTES,
    margin_fraction: float = KV_CACHE_MARGIN_FRACTION,
) -> int:
    """The final KV cache budget in bytes (never negative), from two limits.

    The *request* limit: of `requested_memory`, the engine keeps what it took
    since `init_free_memory` was read (everything that stopped being free,
    except the cache's own `committed_bytes`), and the cache gets the rest.
    The *device* limit: what is free plus what the cache holds, less a safety
    margin, the larger of `margin_floor_bytes` and `margin_fraction` of the
    transient peak. The smaller limit wins, and the transient peak itself is
    then kept free on top. A request that leaves room anyway is not cut by
    the margin: the margin protects the device, not the request.
    """
    init_free_memory = _check_bytes("init_free_memory", init_free_memory)
    free_memory = _check_bytes("free_memory", free_memory)
    committed_bytes = _check_bytes("committed_bytes", committed_bytes)
    requested_memory = _check_bytes("requested_memory", requested_memory)
    transient_peak_bytes = _check_bytes("transient_peak_bytes", transient_peak_bytes)
    margin_floor_bytes = _check_bytes("margin_floor_bytes", margin_floor_bytes)
    margin_fraction = _check_fraction("margin_fraction", margin_fraction)

    # Negative when memory taken before init was given back since: the
    # request limit then grows, as it should.
    taken_by_engine = init_free_memory - free_memory - committed_bytes
    request_limit = requested_memory - taken_by_engine
    safety_margin = max(margin_floor_bytes, int(margin_fraction * transient_peak_bytes))
    device_limit = free_memory + committed_bytes - safety_margin
    return max(min(request_limit, device_limit) - transient_peak_bytes, 0)


def committable_bytes(
    free_memory: int,
    physical_bytes: int,
    reserved_headroom_bytes: int,
    *,
    warmup_reserve_fraction: float = KV_CACHE_WARMUP_RESERVE_FRACTION,
    margin_floor_bytes: int = KV_CACHE_MARGIN_FLOOR_BYTES,
    margin_fraction: float = KV_CACHE_MARGIN_FRACTION,
) -> int:
    """Physical bytes the cache may hold during warmup (0 when none).

    The headroom is free memory plus what the cache already holds. Warmup
    keeps free a reserve, the larger of `reserved_headroom_bytes` (the
    profiled peak) and a share of the headroom, plus a margin over that
    reserve as `measure_kv_cache_bytes` keeps over the measured peak.
    The caller turns the bytes into blocks and never goes below what it has
    already committed.
    """
    free_memory = _check_bytes("free_memory", free_memory)
    physical_bytes = _check_bytes("physical_bytes", physical_bytes)
    reserved_headroom_bytes = _check_bytes(
        "reserved_headroom_bytes", reserved_headroom_bytes
    )
    warmup_reserve_fraction = _check_fraction(
        "warmup_reserve_fraction", warmup_reserve_fraction, at_most_one=True
    )
    margin_floor_bytes = _check_bytes("margin_floor_bytes", margin_floor_bytes)
    margin_fraction = _check_fraction("margin_fraction", margin_fraction)

    headroom = free_memory + physical_bytes
    reserve = max(reserved_headroom_bytes, int(headroom * warmup_reserve_fraction))
    margin = max(margin_floor_bytes, int(reserve * margin_fraction))
    return max(headroom - margin - reserve, 0)


def _check_strides(strides: Sequence[int], granule: int) -> tuple[list[int], int]:
    granule = validate.integer("granule", granule, minimum=1)
    strides = list(strides)
    if not strides:
        raise ValueError("strides must hold at least one segment stride, got none")
    return [validate.integer(f"strides[{i}]", stride, minimum=1) for i, stride in enumerate(strides)], granule


def segment_physical_bytes(
    num_blocks: int, strides: Sequence[int], granule: int, offsets: Sequence[int] | None = None
) -> int:
    """Bytes a commit of `num_blocks` maps: every segment's first
    ``num_blocks * stride`` bytes rounded out to whole granules.

    With the segments' byte `offsets` in the allocation (ascending), a granule
    that two neighbouring segments share is counted once, as it is mapped
    once; without them every segment is rounded on its own (an upper bound).
    """
    num_blocks = _check_count("num_blocks", num_blocks)
    strides, granule = _check_strides(strides, granule)
    if offsets is None:
        return sum(-(-num_blocks * stride // granule) * granule for stride in strides)
    offsets = list(offsets)
    if len(offsets) != len(strides) or offsets != sorted(offsets):
        raise ValueError(f"offsets must be ascending, one per stride; got {offsets} for {len(strides)} strides")
    granules = counted_below = 0  # granules below index counted_below are counted
    for offset, stride in zip(offsets, strides):
        if num_blocks == 0:
            break
        first = max(offset // granule, counted_below)
        end = -(-(offset + num_blocks * stride) // granule)
        granules += max(end - first, 0)
        counted_below = max(counted_below, end)
    return granules * granule


def blocks_within(
    num_bytes: int,
    strides: Sequence[int],
    granule: int,
    capacity_blocks: int,
    offsets: Sequence[int] | None = None,
) -> int:
    """Most blocks (up to `capacity_blocks`) whose physical footprint
    (`segment_physical_bytes`, granule rounding included) fits in
    `num_bytes`. Negative budgets fit nothing."""
    num_bytes = validate.integer("num_bytes", num_bytes, minimum=None)
    capacity_blocks = _check_count("capacity_blocks", capacity_blocks)
    strides, granule = _check_strides(strides, granule)
    if num_bytes <= 0:
        return 0
    # Rounding only adds bytes, so bytes // bytes_per_block bounds the answer;
    # the footprint grows with the block count, so bisect below it.
    lo, hi = 0, min(num_bytes // sum(strides), capacity_blocks)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if segment_physical_bytes(mid, strides, granule, offsets) <= num_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def torch_memory_limit_bytes(
    *, free_memory: int, memory_reserved: int, kv_growth_bytes: int, ipc_reserve_bytes: int = 0,
    non_torch_reserve_bytes: int = KV_CACHE_NON_TORCH_RESERVE_BYTES,
) -> int:
    """Cap for torch's caching allocator once the cache is sized.

    Torch keeps what it reserves now and may grow into what stays free after
    the cache grows by `kv_growth_bytes`, less the memory kept for multimodal
    IPC and for allocations outside torch. Never below what it reserves now.
    """
    free_memory = _check_bytes("free_memory", free_memory)
    memory_reserved = _check_bytes("memory_reserved", memory_reserved)
    # Signed: an extend that shrinks the cache frees memory torch may grow into.
    kv_growth_bytes = validate.integer("kv_growth_bytes", kv_growth_bytes, minimum=None)
    ipc_reserve_bytes = _check_bytes("ipc_reserve_bytes", ipc_reserve_bytes)
    non_torch_reserve_bytes = _check_bytes(
        "non_torch_reserve_bytes", non_torch_reserve_bytes
    )
    left_free = free_memory - kv_growth_bytes - ipc_reserve_bytes - non_torch_reserve_bytes
    return memory_reserved + max(left_free, 0)


def weight_update_peak_bytes(largest_layer_bytes: int) -> int:
    """Free memory a layerwise weight update needs at its peak."""
    largest_layer_bytes = _check_bytes("largest_layer_bytes", largest_layer_bytes)
    return WEIGHT_UPDATE_PEAK_LAYER_FACTOR * largest_layer_bytes
