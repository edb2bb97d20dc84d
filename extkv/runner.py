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

`Runner` is the small protocol these functions need. `ReferenceModelRunner`
is its one real implementation: a few-layer decoder whose attention reads and
writes a paged KV cache through block tables, driven through every stage.

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
import copy
import logging
from dataclasses import dataclass
from typing import Iterator, Protocol, runtime_checkable

import torch
from torch import nn

from . import validate
from .cache import ExtensibleKVCache, measure_kv_cache_blocks
from .connector import KVConnector
from .errors import ExtkvError, StateError
from .layout import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheLayout,
    build_kv_cache_config,
    create_kv_cache_views,
    pad_kv_cache_segments,
)
from .ranks import agree_on_committable_blocks
from .sizing import WEIGHT_UPDATE_PEAK_LAYER_FACTOR
from .usage import device_memory_info
from .vmm import driver_for

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


def extend_kv_cache(runner: Runner, kv_cache_config: KVCacheConfig, num_blocks: int) -> None:
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
    """
    _check_runner(runner, "extend_kv_cache")
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
    num_blocks = validate.integer("num_blocks", num_blocks, what="a block count")
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

    if num_blocks < kv_cache.num_committed_blocks:
        # Warmup committed more than the measured budget fits (its transient
        # peak beat the reserve); those blocks hold warmup garbage.
        logger.info(
            "Remapping the KV cache from %d to %d blocks to fit the measured budget.",
            kv_cache.num_committed_blocks,
            num_blocks,
        )
    connector = runner.kv_connector
    if connector is not None:
        # The commit may remap registered memory (shrink, defragment).
        connector.unregister_kv_caches()
    kv_cache.commit(num_blocks, defragment=defragment, shrink=True)
    committed = copy.copy(kv_cache_config)
    committed.num_blocks = kv_cache.num_committed_blocks
    runner.kv_cache_config = committed
    logger.info(
        "Extended KV cache to %d blocks (%.2f GiB).", kv_cache.num_committed_blocks, kv_cache.physical_bytes / GiB
    )
    views = kv_cache.committed_views(committed, layout, runner.kernel_block_sizes)
    if views is not None:
        runner.bind_kv_caches(views)
    if connector is not None:
        # Connectors that derive geometry from the config see the committed
        # storages the rebuilt views have.
        connector_config = copy.copy(committed)
        connector_config.kv_cache_tensors = committed_tensors
        connector.register_kv_caches(kv_cache, kv_cache_config=connector_config)


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


def _free_for_torch(device: torch.device) -> int:
    """Memory a new torch allocation could use: free on the device plus what
    torch caches unused."""
    free, _ = device_memory_info(device)
    if device.type == "cuda":
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free


def _release_for_weight_update(
    kv_cache: ExtensibleKVCache,
    model: nn.Module,
    *,
    reclaimable: bool,
    fail_if_short: bool,
    connector: KVConnector | None,
) -> bool:
    """Whether the cache was released to make room; see the caller."""
    if not kv_cache.physical_bytes:
        # Released already (sleep), and whoever released it restores it.
        return False
    layer_bytes = max_layer_reload_bytes(model)
    needed = WEIGHT_UPDATE_PEAK_LAYER_FACTOR * layer_bytes
    free = _free_for_torch(kv_cache.buffer.device)
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
    message = (
        f"Updating weights layer by layer needs about {needed / GiB:.2f} GiB of free device memory, "
        f"at least {layer_bytes / GiB:.2f} GiB for the largest layer alone, but only {free / GiB:.2f} GiB "
        "is free beside the extensible KV cache. Clear the cache first so that the update can borrow its "
        "memory (reclaimable=True), or leave more headroom when sizing the cache."
    )
    if fail_if_short and free < layer_bytes:
        raise WeightUpdateMemoryError(message)
    logger.warning(message)
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
            if (lent or torch_memory_limit is not None) and kv_cache.buffer.device.type == "cuda":
                torch.cuda.empty_cache()
            if lent:
                kv_cache.recommit()
                # Only once the memory is back: a restore registers the mapping.
                if connector is not None:
                    connector.restore_kv_caches()
        finally:
            # Whatever failed above, the cap sized for serving comes back.
            if torch_memory_limit is not None:
                kv_cache.set_torch_memory_limit(torch_memory_limit)


def _batch_sizes(batch_sizes: object) -> list[int]:
    if isinstance(batch_sizes, (str, bytes)) or not hasattr(batch_sizes, "__iter__"):
        raise ValueError(f"batch_sizes must be a list of ints >= 1, got {batch_sizes!r}")
    return [validate.integer(f"batch_sizes[{i}]", b, minimum=1, what="a batch size") for i, b in enumerate(batch_sizes)]


# -- a reference model --------------------------------------------------------
@dataclass(frozen=True)
class TinyDecoderConfig:
    vocab_size: int = 512
    hidden_size: int = 256
    num_layers: int = 3
    num_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 64
    block_size: int = 16
    max_blocks_per_seq: int = 16
    dtype: torch.dtype = torch.float32

    @property
    def max_positions(self) -> int:
        return self.block_size * self.max_blocks_per_seq

    @property
    def kv_cache_spec(self) -> FullAttentionSpec:
        return FullAttentionSpec(
            block_size=self.block_size, num_kv_heads=self.num_kv_heads, head_size=self.head_size, dtype=self.dtype
        )


def paged_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
) -> torch.Tensor:
    """Attention of one new token per sequence over its cached context.

    `query` (batch, heads, head_size); `kv_cache` (blocks, 2, block_size,
    kv_heads, head_size), K then V; `block_tables` (batch, max_blocks) block
    ids, unused entries pointing at the null block; `seq_lens` (batch,) tokens
    in context including the new one. Static shapes throughout, so a CUDA
    graph can capture it."""
    batch, heads, head_size = query.shape
    keys = kv_cache[block_tables, 0].flatten(1, 2)  # (batch, tokens, kv_heads, head_size)
    values = kv_cache[block_tables, 1].flatten(1, 2)
    group = heads // keys.shape[2]
    keys = keys.repeat_interleave(group, dim=2)
    values = values.repeat_interleave(group, dim=2)
    scores = torch.einsum("bhd,bthd->bht", query, keys) * head_size**-0.5
    positions = torch.arange(keys.shape[1], device=query.device)
    scores = scores.masked_fill(positions[None, None, :] >= seq_lens[:, None, None], float("-inf"))
    return torch.einsum("bht,bthd->bhd", scores.softmax(dim=-1), values)


class DecoderLayer(nn.Module):
    def __init__(self, config: TinyDecoderConfig):
        super().__init__()
        self.config = config
        q, kv = config.num_heads * config.head_size, config.num_kv_heads * config.head_size
        self.norm1 = nn.LayerNorm(config.hidden_size)
        self.qkv = nn.Linear(config.hidden_size, q + 2 * kv)
        self.out = nn.Linear(q, config.hidden_size)
        self.norm2 = nn.LayerNorm(config.hidden_size)
        self.mlp = nn.Sequential(
            nn.Linear(config.hidden_size, 4 * config.hidden_size), nn.SiLU(), nn.Linear(4 * config.hidden_size, config.hidden_size)
        )

    def forward(self, hidden, kv_cache, slot_blocks, slot_offsets, block_tables, seq_lens):
        c = self.config
        q_size, kv_size = c.num_heads * c.head_size, c.num_kv_heads * c.head_size
        query, key, value = self.qkv(self.norm1(hidden)).split([q_size, kv_size, kv_size], dim=-1)
        batch = hidden.shape[0]
        kv_cache[slot_blocks, 0, slot_offsets] = key.view(batch, c.num_kv_heads, c.head_size)
        kv_cache[slot_blocks, 1, slot_offsets] = value.view(batch, c.num_kv_heads, c.head_size)
        attended = paged_attention(query.view(batch, c.num_heads, c.head_size), kv_cache, block_tables, seq_lens)
        hidden = hidden + self.out(attended.reshape(batch, q_size))
        return hidden + self.mlp(self.norm2(hidden))


class TinyDecoder(nn.Module):
    """A few decoder layers with paged attention, enough to exercise a KV cache
    the way a serving engine does."""

    def __init__(self, config: TinyDecoderConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.positions = nn.Embedding(config.max_positions, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = nn.LayerNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, tokens, positions, block_tables, seq_lens, kv_caches):
        """One decode step: logits (batch, vocab) for the token at `positions`."""
        block_size = self.config.block_size
        slot_blocks = torch.gather(block_tables, 1, (positions // block_size)[:, None])[:, 0]
        slot_offsets = positions % block_size
        hidden = self.embed(tokens) + self.positions(positions)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden = layer(hidden, kv_cache, slot_blocks, slot_offsets, block_tables, seq_lens)
        return self.lm_head(self.norm(hidden))


@dataclass
class _CapturedDecode:
    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor
    positions: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    logits: torch.Tensor


class ReferenceModelRunner:
    """Drives a TinyDecoder over an ExtensibleKVCache through the lifecycle.

    `capacity_blocks` is the reservation; `connector` an optional KVConnector.
    With `extensible=False` it allocates a plain torch tensor for all blocks
    up front: the baseline that the extensible runner must match bit for bit.
    """

    NULL_BLOCK = 0

    def __init__(
        self,
        device: torch.device | str,
        capacity_blocks: int,
        *,
        config: TinyDecoderConfig = TinyDecoderConfig(),
        layout: KVCacheLayout = KVCacheLayout.LBHNC,
        connector: KVConnector | None = None,
        extensible: bool = True,
        seed: int = 0,
    ):
        capacity_blocks = validate.integer("capacity_blocks", capacity_blocks, minimum=1, what="a block count")
        extensible = validate.flag("extensible", extensible)
        seed = validate.integer("seed", seed, minimum=None)
        if not isinstance(config, TinyDecoderConfig):
            raise ValueError(f"config must be a TinyDecoderConfig, got {config!r}")
        if layout is not KVCacheLayout.LBHNC:
            raise ValueError(f"the reference model's attention reads LBHNC pages, got layout {layout!r}")
        _check_connector("connector", connector)
        self.device = torch.device(device)
        self.config = config
        self.kv_cache_layout = layout
        self.kernel_block_sizes = None
        self.kv_connector = connector
        generator = torch.Generator().manual_seed(seed)
        model = TinyDecoder(config)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
        self.model = model.to(device=self.device, dtype=config.dtype).eval()
        groups = [
            KVCacheGroupSpec(layer_names=[f"layers.{i}.attn" for i in range(config.num_layers)], kv_cache_spec=config.kv_cache_spec)
        ]
        kv_cache_config = build_kv_cache_config(groups, capacity_blocks, layout)
        # Layer regions on granules: a defragmenting commit then backs every
        # segment with exactly one chunk at any block count.
        self.allocated_config = pad_kv_cache_segments(kv_cache_config, layout, driver_for(self.device).granularity)
        self.kv_cache_config = self.allocated_config
        self.extensible_kv_cache = ExtensibleKVCache(self.allocated_config, self.device, layout) if extensible else None
        self.kv_caches: list[torch.Tensor] = []
        self._plain_buffer: torch.Tensor | None = None
        self.graphs: dict[int, _CapturedDecode] = {}

    @property
    def layer_names(self) -> list[str]:
        return list(self.kv_cache_config.kv_cache_groups[0].layer_names)

    def bind_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = [kv_caches[name] for name in self.layer_names]

    # -- stages -------------------------------------------------------------------
    def profile_run(self, max_batch: int) -> int:
        """Run one forward at `max_batch` without a KV cache and keep its
        activation peak as the cache's reserved headroom. Returns the peak."""
        max_batch = validate.integer("max_batch", max_batch, minimum=1, what="a batch size")
        c = self.config
        scratch = torch.zeros(1, 2, c.block_size, c.num_kv_heads, c.head_size, dtype=c.dtype, device=self.device)
        peak = 0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            start = torch.cuda.memory_allocated(self.device)
        self._forward(*self._null_inputs(max_batch), [scratch] * c.num_layers)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) - start
        if self.extensible_kv_cache is not None:
            self.extensible_kv_cache.reserved_headroom_bytes = peak
        return peak

    def allocate_kv_cache(self) -> None:
        """Back the KV cache: the null block only (extensible) or everything
        (plain); either way the model sees views over the whole capacity."""
        size = self.allocated_config.kv_cache_tensors[0].size
        if self.extensible_kv_cache is not None:
            buffer = self.extensible_kv_cache.allocate(size)
        else:
            self._plain_buffer = torch.zeros(size, dtype=torch.uint8, device=self.device)
            buffer = self._plain_buffer
        (tensor,) = self.allocated_config.kv_cache_tensors
        views = create_kv_cache_views(
            buffer, self.config.kv_cache_spec, self.allocated_config.num_blocks, self.kv_cache_layout, tensor
        )
        self.bind_kv_caches(dict(zip(tensor.layers, views)))

    def warmup(self, batch_sizes: list[int]) -> int:
        """Agree across ranks on the committable blocks, commit them, and run
        a decode step per batch size. Returns the blocks committed."""
        batch_sizes = _batch_sizes(batch_sizes)
        if self.extensible_kv_cache is not None:
            agree_on_committable_blocks(self.extensible_kv_cache)
        ensure_kv_cache_blocks(self, num_committable_kv_blocks(self))
        for batch in batch_sizes:
            self._forward(*self._null_inputs(batch), self.kv_caches)
        return self.num_committed_blocks

    def capture_cuda_graphs(self, batch_sizes: list[int]) -> None:
        """Capture one decode step per batch size. The inputs point at the null
        block; replays may point anywhere in the capacity."""
        batch_sizes = _batch_sizes(batch_sizes)
        if self.device.type != "cuda":
            raise ExtkvError(f"CUDA graphs need a CUDA device, this runner is on {self.device}")
        pool = None
        for batch in sorted(batch_sizes, reverse=True):
            tokens, positions, block_tables, seq_lens = (t.clone() for t in self._null_inputs(batch))
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):  # warm the kernels outside capture
                self._forward(tokens, positions, block_tables, seq_lens, self.kv_caches)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(tokens, positions, block_tables, seq_lens, self.kv_caches)
            pool = graph.pool()
            self.graphs[batch] = _CapturedDecode(graph, tokens, positions, block_tables, seq_lens, logits)

    def measure_and_extend(self, *, init_free_memory: int, requested_memory: int) -> int:
        """Size the cache from the memory left after warmup, then extend it."""
        kv_cache = self._require_extensible("measure_and_extend")
        num_blocks = measure_kv_cache_blocks(
            kv_cache, self.device, init_free_memory=init_free_memory, requested_memory=requested_memory
        )
        extend_kv_cache(self, self.allocated_config, num_blocks)
        return num_blocks

    def _require_extensible(self, operation: str) -> ExtensibleKVCache:
        if self.extensible_kv_cache is None:
            raise StateError(f"{operation} needs an extensible KV cache; this runner preallocated a plain one")
        return _check_live(self.extensible_kv_cache, operation)

    def sleep(self) -> None:
        """Release the cache's physical memory (connector unregistered first)."""
        kv_cache = self._require_extensible("sleep")
        if self.kv_connector is not None:
            self.kv_connector.unregister_kv_caches()
        kv_cache.release_physical()

    def wake(self) -> None:
        """Recommit what `sleep` released, zeroed; then restore the connector."""
        kv_cache = self._require_extensible("wake")
        kv_cache.recommit()
        if self.kv_connector is not None:
            self.kv_connector.restore_kv_caches()

    def update_weights(self, state_dict: dict[str, torch.Tensor], *, reclaimable: bool, fail_if_short: bool) -> None:
        """Load `state_dict` layer by layer, each layer staged on the device
        before it replaces the old one (the peak: two copies of a layer)."""
        with kv_cache_lent_for_weight_update(
            self.extensible_kv_cache,
            self.model,
            reclaimable=reclaimable,
            fail_if_short=fail_if_short,
            connector=self.kv_connector,
        ):
            for name, module in self.model.named_modules():
                own = dict(module.named_parameters(recurse=False))
                if not own:
                    continue
                staged = {key: state_dict[f"{name}.{key}" if name else key].to(self.device) for key in own}
                with torch.no_grad():
                    for key, parameter in own.items():
                        parameter.copy_(staged[key])
                del staged

    # -- decode -------------------------------------------------------------------
    @property
    def num_committed_blocks(self) -> int:
        if self.extensible_kv_cache is None:
            return self.allocated_config.num_blocks
        return self.extensible_kv_cache.num_committed_blocks

    def _null_inputs(self, batch: int):
        c = self.config
        return (
            torch.zeros(batch, dtype=torch.int64, device=self.device),
            torch.zeros(batch, dtype=torch.int64, device=self.device),
            torch.full((batch, c.max_blocks_per_seq), self.NULL_BLOCK, dtype=torch.int64, device=self.device),
            torch.ones(batch, dtype=torch.int64, device=self.device),
        )

    @torch.no_grad()
    def _forward(self, tokens, positions, block_tables, seq_lens, kv_caches):
        return self.model(tokens, positions, block_tables, seq_lens, kv_caches)

    def decode(self, tokens, positions, block_tables, seq_lens, *, use_graph: bool = False) -> torch.Tensor:
        """One decode step for a batch: writes the new tokens' K/V into the
        cache and returns the logits. With `use_graph`, replays the captured
        graph of that batch size."""
        if not use_graph:
            return self._forward(tokens, positions, block_tables, seq_lens, self.kv_caches)
        captured = self.graphs.get(tokens.shape[0])
        if captured is None:
            raise ExtkvError(f"no CUDA graph captured for batch size {tokens.shape[0]}; have {sorted(self.graphs)}")
        captured.tokens.copy_(tokens)
        captured.positions.copy_(positions)
        captured.block_tables.copy_(block_tables)
        captured.seq_lens.copy_(seq_lens)
        captured.graph.replay()
        return captured.logits.clone()

    def free(self) -> None:
        """Drop graphs and views and free the cache. Idempotent."""
        self.graphs.clear()
        self.kv_caches = []
        self._plain_buffer = None
        if self.extensible_kv_cache is not None and not self.extensible_kv_cache.buffer.is_freed:
            self.extensible_kv_cache.free()
