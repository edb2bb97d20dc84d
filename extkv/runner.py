"""Lifecycle of an extensible KV cache inside a model runner.

Theory of operation
-------------------
A serving engine cannot size its KV cache until warmup, CUDA graph capture and
the first batches have shown what else needs memory. With an extensible cache
the runner goes through these stages, each a function here with the meaning
the reference gives it:

1. profile: one forward at the largest batch; its activation peak becomes the
   cache's `reserved_headroom_bytes`.
2. allocate: the cache reserves address space for its capacity and commits
   only the null block; the model gets views over the whole reservation, so
   kernels and graphs may address any block that is committed later.
3. warmup: ranks agree on how many blocks may be committed now
   (`num_committable_kv_blocks`); warmup steps commit what they touch
   (`ensure_kv_cache_blocks`); CUDA graphs are captured.
4. size: `measure_kv_cache_blocks` reads the memory left after warmup and caps
   torch's caching allocator.
5. extend: `extend_kv_cache` commits the final size (defragmenting when a
   connector registers the memory), rebuilds views over the committed bytes at
   the same addresses, and registers the connector.
6. serve; sleep (`release_physical`) and wake (`recommit`); a layer-by-layer
   weight update inside `kv_cache_lent_for_weight_update`.

`Runner` is the small protocol these functions need. Its one real
implementation, `ReferenceModelRunner` (extkv.reference_model), drives a
few-layer paged-attention decoder through every stage.

Every function checks its arguments before it changes anything: a runner
that is not one, a cache or connector of the wrong type, a count that is not
a non-negative int, a flag that is not a bool are `ValueError`s naming the
value; a runner without an extensible cache, or a freed cache, where one is
needed is a `StateError`.

Deliberate differences from the reference
-----------------------------------------
- Engine state is passed in, not looked up: the functions take the runner
  (`registers_kv_cache_memory(runner)`, not a vLLM config) and the weight
  update takes its `connector` as an argument instead of a process-global KV
  transfer group. Free memory for a weight update is read on the cache's
  device, not the current one. Not even the largest layer fitting is a
  `WeightUpdateMemoryError` (a `RuntimeError`, as in the reference).
- Two configs after `extend_kv_cache`, as in the reference, but never by
  mutating the caller's: `runner.kv_cache_config` becomes a copy of the
  allocated config with the committed `num_blocks` and the *allocated*
  `kv_cache_tensors`, because `committed_views` locates each layer's segment
  from its placement in the allocation. The connector gets another copy whose
  `kv_cache_tensors` are `committed_kv_cache_tensors(...)`, the storages the
  rebuilt views really have (`register_kv_caches(kv_cache,
  kv_cache_config=...)`).
- The connector's `num_blocks` is the count actually committed: a request
  past the capacity is clamped by `commit`, and the connector is told the
  clamped count (the reference hands it the request).
- The reference creates its connector during the extension; ours exists
  already, so it is unregistered before the commit (which may shrink or
  defragment, remapping what it registered) and registered afterwards. If the
  commit itself fails, the connector stays unregistered.
- `kv_cache_lent_for_weight_update` checks its arguments when called, not
  when the context is entered, and puts torch's memory cap back on every
  way out: when the body, the recommit or the connector's restore raises,
  the cap is restored and that error propagates (the reference leaves the
  cap lifted when the recommit or the restore fails). A failed recommit
  skips the connector's restore: there is no memory to register.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import replace
from typing import Iterator, Protocol, runtime_checkable

import torch
from torch import nn

from . import validate
from .cache import ExtensibleKVCache
from .connector import KVConnector
from .errors import ExtkvError, StateError
from .layout import KVCacheConfig, KVCacheLayout
from .sizing import WEIGHT_UPDATE_PEAK_LAYER_FACTOR
from .vmm import torch_memory

logger = logging.getLogger(__name__)

GiB = float(1 << 30)


@runtime_checkable
class Runner(Protocol):
    """What the lifecycle functions need from a model runner."""

    device: torch.device
    kv_cache_config: KVCacheConfig
    kv_cache_layout: KVCacheLayout
    kernel_block_sizes: list[int] | None
    extensible_kv_cache: ExtensibleKVCache | None
    kv_connector: KVConnector | None

    def bind_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Point every attention layer at its view of the KV cache."""


# -- argument checks -----------------------------------------------------------
def _check_runner(runner: object, function: str) -> Runner:
    """`runner` if it is a model runner, else a ValueError naming it."""
    if not isinstance(runner, Runner):
        missing = [name for name in _RUNNER_MEMBERS if not hasattr(runner, name)]
        raise ValueError(
            f"{function} needs a model runner (the Runner protocol), got {runner!r}, which lacks {', '.join(missing)}"
        )
    kv_cache = runner.extensible_kv_cache
    if kv_cache is not None and not isinstance(kv_cache, ExtensibleKVCache):
        raise ValueError(f"runner.extensible_kv_cache must be an ExtensibleKVCache or None, got {kv_cache!r}")
    _check_connector("runner.kv_connector", runner.kv_connector)
    return runner


_RUNNER_MEMBERS = (
    "device",
    "kv_cache_config",
    "kv_cache_layout",
    "kernel_block_sizes",
    "extensible_kv_cache",
    "kv_connector",
    "bind_kv_caches",
)


def _check_connector(name: str, connector: object) -> None:
    if connector is not None and not isinstance(connector, KVConnector):
        raise ValueError(
            f"{name} must be a KVConnector (registers_kv_cache_memory, register_kv_caches, "
            f"unregister_kv_caches, restore_kv_caches, close) or None, got {connector!r}"
        )


def _check_live(kv_cache: ExtensibleKVCache, function: str) -> ExtensibleKVCache:
    if kv_cache.buffer.is_freed:
        raise StateError(f"{function}: the extensible KV cache was freed")
    return kv_cache


def _check_model(model: object) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {model!r}")
    return model


# -- the reference's runner-level functions -----------------------------------
def registers_kv_cache_memory(runner: Runner) -> bool:
    """Whether the runner's KV connector registers the committed memory (RDMA,
    IPC export), which needs each segment backed by one physical chunk."""
    connector = _check_runner(runner, "registers_kv_cache_memory").kv_connector
    if connector is None:
        return False
    return validate.flag(f"{type(connector).__name__}.registers_kv_cache_memory", connector.registers_kv_cache_memory)


def num_committable_kv_blocks(runner: Runner) -> int:
    """Blocks warmup may address: all of them for a standard cache; for an
    extensible one the count agreed across ranks, so every rank warms up the
    same shapes."""
    kv_cache = _check_runner(runner, "num_committable_kv_blocks").extensible_kv_cache
    if kv_cache is None:
        return runner.kv_cache_config.num_blocks
    return _check_live(kv_cache, "num_committable_kv_blocks").warmup_committable_blocks


def ensure_kv_cache_blocks(runner: Runner, num_blocks: int) -> None:
    """Commit enough of an extensible KV cache to address `num_blocks` blocks."""
    kv_cache = _check_runner(runner, "ensure_kv_cache_blocks").extensible_kv_cache
    num_blocks = validate.integer("num_blocks", num_blocks, what="a block count")
    if kv_cache is not None:
        _check_live(kv_cache, "ensure_kv_cache_blocks").commit(num_blocks)


def extend_kv_cache(runner: Runner, kv_cache_config: KVCacheConfig, num_blocks: int, *,
                    preserve_contents: bool = False) -> None:
    """Commit the final size once post-warmup memory is known.

    Afterwards the runner matches one that allocated `num_blocks` up front
    (clamped to the capacity, as `commit` does): views are rebuilt over the
    committed bytes (same addresses), and the connector is registered against
    the final memory with a config describing it (`num_blocks` committed,
    `kv_cache_tensors` from `committed_kv_cache_tensors`). `kv_cache_config`
    is the config the cache was allocated from; `runner.kv_cache_config`
    becomes a copy of it with the committed `num_blocks` and the allocated
    tensors (see the module header). Arguments are checked before anything
    changes; a connector is unregistered before the commit remaps memory.
    With `preserve_contents`, a shrink keeps the first `num_blocks` blocks'
    bytes (`commit(..., shrink=True, preserve_contents=True)`), as does the
    defragment a connector needs: what a runner answering a reclaim of the
    shared budget passes.
    """
    _check_runner(runner, "extend_kv_cache")
    preserve_contents = validate.flag("preserve_contents", preserve_contents)
    kv_cache = runner.extensible_kv_cache
    if kv_cache is None:
        raise StateError(
            "extend_kv_cache needs a runner with an extensible KV cache; runner.extensible_kv_cache is None"
        )
    _check_live(kv_cache, "extend_kv_cache")
    if not isinstance(kv_cache_config, KVCacheConfig):
        raise ValueError(
            f"kv_cache_config must be the KVCacheConfig the cache was allocated from, got {kv_cache_config!r}"
        )
    # A budget of no block would shrink the cache below its null block, and
    # views of no block cannot be built: refused before anything changes.
    num_blocks = validate.integer("num_blocks", num_blocks, minimum=1, what="a block count; the budget holds none")
    layout = runner.kv_cache_layout
    if layout is not kv_cache.layout:
        raise ValueError(
            f"runner.kv_cache_layout is {layout!r}, but the KV cache was allocated with {kv_cache.layout!r}"
        )
    sizes = sorted({tensor.size for tensor in kv_cache_config.kv_cache_tensors})
    if sizes != [kv_cache.size]:
        raise ValueError(
            f"kv_cache_config does not describe this cache's allocation: its kv_cache_tensors have sizes {sizes}, "
            f"the cache backs {kv_cache.size} bytes; pass the config the cache was allocated from"
        )
    defragment = registers_kv_cache_memory(runner)
    final_blocks = min(num_blocks, kv_cache.capacity_blocks)
    # Computed before anything changes: a config the cache cannot place fails here.
    committed_tensors = kv_cache.committed_kv_cache_tensors(kv_cache_config, layout, final_blocks)

    connector = runner.kv_connector
    if connector is not None:
        connector.unregister_kv_caches()  # a shrink or defragment remaps what it registered
    if num_blocks < kv_cache.num_committed_blocks:
        # Warmup's transient peak beat the reserve, so it committed more than
        # the measured budget holds; the surplus holds only warmup garbage.
        logger.info("Shrinking the KV cache from %d to %d blocks.", kv_cache.num_committed_blocks, num_blocks)
    kv_cache.commit(num_blocks, defragment=defragment, shrink=True, preserve_contents=preserve_contents)
    runner.kv_cache_config = replace(kv_cache_config, num_blocks=kv_cache.num_committed_blocks)
    views = kv_cache.committed_views(runner.kv_cache_config, layout, runner.kernel_block_sizes)
    if views is not None:
        runner.bind_kv_caches(views)
    if connector is not None:
        # What a connector reads off the config must be the storages the
        # rebuilt views have, not the allocation's.
        connector.register_kv_caches(
            kv_cache, kv_cache_config=replace(runner.kv_cache_config, kv_cache_tensors=committed_tensors)
        )
    logger.info(
        "KV cache extended: %d of %d blocks committed, %.2f GiB physical.",
        kv_cache.num_committed_blocks,
        kv_cache.capacity_blocks,
        kv_cache.physical_bytes / GiB,
    )


def max_layer_reload_bytes(model: nn.Module) -> int:
    """Bytes of the largest layer a layer-by-layer update reloads at once:
    the largest child module, looking inside ModuleLists and Sequentials."""
    largest = 0
    pending = list(_check_model(model).children())
    while pending:
        module = pending.pop()
        if isinstance(module, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            pending.extend(module.children())
            continue
        largest = max(largest, sum(p.numel() * p.element_size() for p in module.parameters()))
    return largest


def _free_for_torch(kv_cache: ExtensibleKVCache) -> int:
    """Memory a new torch allocation on the cache's device could use: free on
    the device plus what torch caches unused."""
    free, _ = kv_cache.buffer.driver.memory_info()
    return free + torch_memory.cached_unused(kv_cache.buffer.device)


def _release_for_weight_update(
    kv_cache: ExtensibleKVCache,
    model: nn.Module,
    *,
    reclaimable: bool,
    fail_if_short: bool,
    connector: KVConnector | None,
) -> bool:
    """Whether the cache was released to make room; see the caller."""
    if kv_cache.is_asleep or not kv_cache.physical_bytes:
        # Asleep (blocks committed meanwhile are mapped, yet it sleeps) or
        # holding nothing: whoever put it to sleep wakes it, and a recommit
        # after the update would wake it behind their back.
        return False
    layer_bytes = max_layer_reload_bytes(model)
    needed = WEIGHT_UPDATE_PEAK_LAYER_FACTOR * layer_bytes
    free = _free_for_torch(kv_cache)
    if free >= needed:
        return False
    if reclaimable:
        logger.info(
            "Releasing the KV cache's memory for a weight update: %.2f GiB free, about %.2f GiB needed.",
            free / GiB,
            needed / GiB,
        )
        if connector is not None:
            connector.unregister_kv_caches()
        kv_cache.release_physical()
        return True
    not_even_one_layer = free < layer_bytes
    shortfall = (
        f"Updating weights layer by layer needs about {needed / GiB:.2f} GiB of free device memory, "
        f"at least {layer_bytes / GiB:.2f} GiB for the largest layer alone, but only {free / GiB:.2f} GiB "
        "is free beside the extensible KV cache. Clear the cache first so that the update can borrow its "
        "memory (reclaimable=True), or leave more headroom when sizing the cache."
    )
    if not_even_one_layer and fail_if_short:
        raise WeightUpdateMemoryError(shortfall)
    logger.warning(shortfall)
    return False


class WeightUpdateMemoryError(ExtkvError, RuntimeError):
    """Not even the largest layer fits beside the KV cache; nothing was changed."""


def kv_cache_lent_for_weight_update(
    kv_cache: ExtensibleKVCache | None,
    model: nn.Module,
    *,
    reclaimable: bool,
    fail_if_short: bool,
    connector: KVConnector | None = None,
) -> contextlib.AbstractContextManager[None]:
    """Make room for a layer-by-layer weight update of `model` in the context.

    Only an extensible cache (None: a standard one) leaves free memory short,
    since it keeps free just the transients warmup measured. When short, the
    cache's physical memory is lent to the update if it holds nothing worth
    keeping (`reclaimable`) and recommitted, zeroed, afterwards (then
    `connector` is restored); otherwise the context fails before any weight
    changes when not even the largest layer fits and `fail_if_short`, or
    warns. Torch's memory cap is lifted inside and put back on every way out,
    also when the body, the recommit or the connector's restore raises (that
    error propagates). Arguments are checked here, at the call.
    """
    if kv_cache is not None:
        if not isinstance(kv_cache, ExtensibleKVCache):
            raise ValueError(f"kv_cache must be an ExtensibleKVCache or None (a standard cache), got {kv_cache!r}")
        _check_live(kv_cache, "kv_cache_lent_for_weight_update")
    _check_model(model)
    reclaimable = validate.flag("reclaimable", reclaimable)
    fail_if_short = validate.flag("fail_if_short", fail_if_short)
    _check_connector("connector", connector)
    return _lent_for_weight_update(
        kv_cache, model, reclaimable=reclaimable, fail_if_short=fail_if_short, connector=connector
    )


@contextlib.contextmanager
def _lent_for_weight_update(
    kv_cache: ExtensibleKVCache | None,
    model: nn.Module,
    *,
    reclaimable: bool,
    fail_if_short: bool,
    connector: KVConnector | None,
) -> Iterator[None]:
    if kv_cache is None:
        yield
        return
    # Fails before changing anything (except a connector whose unregister
    # succeeded when the release itself fails).
    lent = _release_for_weight_update(
        kv_cache, model, reclaimable=reclaimable, fail_if_short=fail_if_short, connector=connector
    )
    torch_memory_limit = kv_cache.torch_memory_limit
    try:
        # Weight processing allocates through torch beyond the cap sized for serving.
        if torch_memory_limit is not None:
            kv_cache.set_torch_memory_limit(None)
        yield
    finally:
        try:
            if lent or torch_memory_limit is not None:
                torch_memory.release_cached(kv_cache.buffer.device)
            if lent:
                kv_cache.recommit()
                # Only once the memory is back: a restore registers the mapping.
                if connector is not None:
                    connector.restore_kv_caches()
        finally:
            # Whatever failed above, the cap sized for serving comes back.
            if torch_memory_limit is not None:
                kv_cache.set_torch_memory_limit(torch_memory_limit)
