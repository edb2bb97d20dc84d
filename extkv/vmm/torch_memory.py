"""Torch's caching allocator, the one room where extkv talks to it.

Theory of operation
-------------------
Torch keeps freed device memory cached for reuse, so what a device reports
free understates what a new allocation could get, and a cache that grows must
sometimes ask torch to give its cached memory back. Sizing also caps how much
torch may cache once the KV cache is sized. Every such call (read what torch
reserves and uses, return its cache, set or lift its cap, read its peak) lives
here, keyed by the device, so the cache and the runner never ask which kind of
device they run on. On the host torch has no caching allocator: it reserves
nothing, caches nothing, and a cap can only be recorded, which `set_cap` says
by returning False.
"""

from __future__ import annotations

import torch


def _is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def reserved(device: torch.device) -> int:
    """Bytes torch's allocator holds from the device, used or cached."""
    return int(torch.cuda.memory_reserved(device)) if _is_cuda(device) else 0


def allocated(device: torch.device) -> int:
    """Bytes of live torch tensors on the device."""
    return int(torch.cuda.memory_allocated(device)) if _is_cuda(device) else 0


def cached_unused(device: torch.device) -> int:
    """Bytes torch holds but no tensor uses: free for torch, not for others."""
    return reserved(device) - allocated(device)


def release_cached(device: torch.device) -> bool:
    """Return torch's cached, unused memory to the driver once queued work is
    done. False where there is no such cache."""
    if not _is_cuda(device):
        return False
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return True


def set_cap(device: torch.device, num_bytes: int | None, total_bytes: int) -> bool:
    """Cap what torch reserves on `device` at `num_bytes` of its `total_bytes`
    (None lifts the cap). False where torch has no cap to set."""
    if not _is_cuda(device):
        return False
    # min() before dividing: a cap past the device (10**400 bytes) is no cap, not an OverflowError.
    fraction = 1.0 if num_bytes is None else min(num_bytes, total_bytes) / total_bytes
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return True


def start_peak(device: torch.device) -> int:
    """Start measuring torch's allocation peak; returns what is allocated now."""
    if not _is_cuda(device):
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return allocated(device)


def peak_since(device: torch.device, start: int) -> int:
    """Bytes torch's allocations peaked above `start` since `start_peak`
    (0 where torch does not count, as on the host)."""
    if not _is_cuda(device):
        return 0
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device)) - start


def host_staging(device: torch.device, shape: tuple[int, ...]) -> torch.Tensor:
    """A uint8 host tensor of `shape` that `device` copies into at full
    speed: page-locked beside a GPU (torch's host allocator caches it, so
    asking again for the same size is cheap), plain memory on the host.
    Checks that compare device memory on the host copy through it; with
    pageable destinations, the 46 GiB a CI pressure walk compares took
    11.5 s of copies on the H200."""
    return torch.empty(shape, dtype=torch.uint8, pin_memory=_is_cuda(device))
