"""Rank agreement: every rank of a tensor-parallel group warms up the same shapes.

Theory of operation
-------------------
Before warmup each rank asks its own cache how many blocks it may commit
(`ExtensibleKVCache.committable_blocks`): an answer that depends on the memory
free on *that* rank's device, so ranks disagree. Warmup runs collectives and
captures CUDA graphs for block counts, and a collective whose ranks take
different shapes deadlocks or corrupts; so the ranks must agree on one count.
The only count safe on every rank is the smallest, reduced with
`torch.distributed.all_reduce(op=MIN)`.

Which device the reduction runs on is decided by the group's backend, not the
caller: a backend that reduces CPU tensors (gloo, mpi, ucc, or a mixed
`cpu:gloo,cuda:nccl` group) gets a CPU int64 tensor, which needs no device
synchronization; NCCL reduces CUDA tensors only, so it gets one on the cache's
device (or the current CUDA device).

Without an initialized process group there is one rank, and the agreed count
is the local one.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from . import validate, vmm
from .cache import ExtensibleKVCache

logger = logging.getLogger(__name__)

#: The reduction runs on an int64 tensor; larger counts cannot travel.
MAX_REDUCIBLE_VALUE = (1 << 63) - 1


def _check_value(value) -> int:
    return validate.integer("value", value, maximum=MAX_REDUCIBLE_VALUE, what="fits the int64 reduced across ranks")


def distributed_is_initialized() -> bool:
    """Whether a default process group exists (False where torch was built
    without torch.distributed)."""
    return dist.is_available() and dist.is_initialized()


def _backend_devices(backend: str) -> list[str]:
    """Device types `backend` reduces: `cpu:gloo,cuda:nccl` names them, a
    plain name is looked up in torch's capability table."""
    if ":" in backend:
        return [entry.split(":", 1)[0].strip() for entry in backend.split(",")]
    return list(dist.Backend.backend_capability.get(backend, ["cpu"]))


def reduction_device(group=None, device: torch.device | str | None = None) -> torch.device:
    """The device `min_over_ranks` reduces on for `group`'s backend.

    CPU whenever the backend reduces CPU tensors; otherwise `device`, which
    must then be a CUDA device (None: the current CUDA device).
    """
    backend = str(dist.get_backend(group))
    return vmm.reduction_device(backend, _backend_devices(backend), device)


def min_over_ranks(value: int, group=None, device: torch.device | str | None = None) -> int:
    """The minimum of `value` over the ranks of `group` (default: the world).

    Every rank of `group` must call this (it is a collective). `device` is the
    CUDA device to reduce on for backends that reduce only CUDA tensors
    (NCCL; default the current CUDA device); CPU-capable backends ignore it.
    Without an initialized process group, returns `value`.
    """
    value = _check_value(value)
    if not distributed_is_initialized():
        return value
    if dist.get_rank(group) < 0:
        # all_reduce would return at once on a non-member, leaving the local
        # value looking agreed.
        raise ValueError(f"rank {dist.get_rank()} is not a member of process group {group!r}")
    carrier = torch.tensor([value], dtype=torch.int64, device=reduction_device(group, device))
    dist.all_reduce(carrier, op=dist.ReduceOp.MIN, group=group)
    # .item() waits for the reduction, also where it runs on a CUDA stream.
    return int(carrier.item())


def agree_on_committable_blocks(kv_cache: ExtensibleKVCache, group=None) -> int:
    """Agree across the ranks of `group` on the blocks warmup may commit.

    Each rank reads `kv_cache.committable_blocks()`; the agreed count is the
    minimum over ranks. It is stored in `kv_cache.warmup_committable_blocks`
    and returned. A collective: every rank of `group` must call it.
    """
    if not isinstance(kv_cache, ExtensibleKVCache):
        raise ValueError(f"kv_cache must be an ExtensibleKVCache, got {kv_cache!r}")
    local = kv_cache.committable_blocks()
    cache_device = kv_cache.buffer.device
    # A host cache in a CUDA-only group still reduces on the current GPU.
    agreed = min_over_ranks(local, group, device=kv_cache.buffer.driver.collective_device)
    kv_cache.warmup_committable_blocks = agreed
    if distributed_is_initialized():
        logger.info(
            "Rank %d of %d: %d KV cache blocks committable locally on %s, %d agreed (minimum over ranks) for warmup.",
            dist.get_rank(group),
            dist.get_world_size(group),
            local,
            cache_device,
            agreed,
        )
    else:
        logger.info("Single rank: %d KV cache blocks committable on %s for warmup.", agreed, cache_device)
    return agreed
