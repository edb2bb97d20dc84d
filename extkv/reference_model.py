"""A reference model runner: the Runner protocol's one real implementation.

Theory of operation
-------------------
`TinyDecoder` (extkv.tiny_decoder) is a few decoder layers whose attention
reads and writes a paged KV cache through block tables, with static shapes
so that a CUDA graph can capture a decode step. `ReferenceModelRunner`
drives it through the lifecycle
of extkv.runner the way a serving engine does: profile, allocate, warm up,
capture graphs, size and extend, serve, sleep and wake, update weights. With
`extensible=False` it allocates a plain tensor for every block up front, the
baseline that the extensible runner must match bit for bit.

The runner's stages, as data: `_STAGES` names, for every operation, the
stages it is legal in and the stage it leads to. An operation called in
another stage raises `StateError` naming the operation and the stage, and
changes nothing; a failing operation leaves the stage as it was.

Requests and the shared budget
------------------------------
The runner keeps the engine's block bookkeeping: `add_request` gives a
request the lowest free blocks (never the null block), growing the cache
through `extend_kv_cache` when they lie past the committed ones;
`block_tables` builds decode's rows from it; `finish_request` frees them.
Under a shared KV budget (`budget=`, extkv.budget) the daemon may ask the
runner to give memory back: `on_reclaim(target_bytes)` picks the largest
block count whose footprint after a shrink keeping contents frees the
target (`blocks_kept_within`: chunks straddling the new top stay whole),
preempts requests, newest first, only while the live blocks do not fit
below it, copies the live blocks above it onto free blocks below it on
the device, every segment of each, and shrinks from the top keeping the
blocks below (`commit(n, shrink=True, preserve_contents=True)`): nothing
is staged in host memory, written back or created.

Threads: every stage operation, the request bookkeeping and `on_reclaim`
hold `lock` (re-entrant), so a reclaim from the budget client's thread
runs between two steps. An engine that builds block tables and decodes
holds `lock` around the pair, so no reclaim moves blocks in between. A
reclaim that arrives while the runner's own growth waits on the budget
waits for that growth to end (the daemon never asks the asker itself).
"""

from __future__ import annotations

import enum
import functools
import threading
from dataclasses import dataclass
from typing import Hashable, Iterable

import torch

from . import validate
from .cache import ExtensibleKVCache, measure_kv_cache_blocks
from .budget.client import BudgetClient
from .connector import KVConnector
from .errors import ExtkvError, StateError
from .layout import (
    KVCacheGroupSpec,
    KVCacheLayout,
    build_kv_cache_config,
    create_kv_cache_views,
    pad_kv_cache_segments,
)
from .ranks import agree_on_committable_blocks
from .runner import ensure_kv_cache_blocks, extend_kv_cache, kv_cache_lent_for_weight_update, num_committable_kv_blocks
from .tiny_decoder import TinyDecoder, TinyDecoderConfig
from .vmm import Driver, canonical_device, driver_for, torch_memory


class _Stage(enum.Enum):
    CREATED = "created (no KV cache allocated yet)"
    ALLOCATED = "allocated"
    ASLEEP = "asleep (KV cache memory released)"
    FREED = "freed"


_ANY_LIVE = frozenset({_Stage.CREATED, _Stage.ALLOCATED, _Stage.ASLEEP})
#: operation -> (stages it is legal in, stage it leads to; None: stays).
_STAGES: dict[str, tuple[frozenset[_Stage], _Stage | None]] = {
    "profile_run": (frozenset({_Stage.CREATED}), None),
    "allocate_kv_cache": (frozenset({_Stage.CREATED}), _Stage.ALLOCATED),
    "warmup": (frozenset({_Stage.ALLOCATED}), None),
    "capture_cuda_graphs": (frozenset({_Stage.ALLOCATED}), None),
    "measure_and_extend": (frozenset({_Stage.ALLOCATED}), None),
    "decode": (frozenset({_Stage.ALLOCATED}), None),
    "add_request": (frozenset({_Stage.ALLOCATED}), None),
    "finish_request": (frozenset({_Stage.ALLOCATED}), None),
    "sleep": (frozenset({_Stage.ALLOCATED}), _Stage.ASLEEP),
    "wake": (frozenset({_Stage.ASLEEP}), _Stage.ALLOCATED),
    "update_weights": (_ANY_LIVE, None),
    "free": (frozenset(_Stage), _Stage.FREED),
}


def _staged(method):
    """Run `method` only in a stage `_STAGES` allows, then move to the stage
    it leads to; all under the runner's lock, so a reclaim runs between
    operations."""
    name = method.__name__
    legal, leads_to = _STAGES[name]

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self.lock:
            if self._stage not in legal:
                raise StateError(f"ReferenceModelRunner.{name}() is not allowed: the runner is {self._stage.value}")
            result = method(self, *args, **kwargs)
            if leads_to is not None:
                self._stage = leads_to
            return result

    return run


def _batch_sizes(batch_sizes: object) -> list[int]:
    if isinstance(batch_sizes, (str, bytes)) or not hasattr(batch_sizes, "__iter__"):
        raise ValueError(f"batch_sizes must be a list of ints >= 1, got {batch_sizes!r}")
    return [validate.integer(f"batch_sizes[{i}]", b, minimum=1, what="a batch size") for i, b in enumerate(batch_sizes)]


@dataclass
class _CapturedDecode:
    graph: object  # what Driver.capture_graph returns: replay() and pool()
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
    `driver` backs the extensible cache (default: the device's own); every
    memory reading of the lifecycle is the cache's driver's, so a test may
    pass one whose readings it sets (extkv.testing.readings). `budget`: the
    engine's BudgetClient; every physical create of the cache asks it, and
    its reclaims are answered by `on_reclaim`.
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
        driver: Driver | None = None,
        budget: BudgetClient | None = None,
    ):
        capacity_blocks = validate.integer("capacity_blocks", capacity_blocks, minimum=1, what="a block count")
        extensible = validate.flag("extensible", extensible)
        seed = validate.integer("seed", seed, minimum=None)
        if not isinstance(config, TinyDecoderConfig):
            raise ValueError(f"config must be a TinyDecoderConfig, got {config!r}")
        if layout is not KVCacheLayout.LBHNC:
            raise ValueError(f"the reference model's attention reads LBHNC pages, got layout {layout!r}")
        if connector is not None and not isinstance(connector, KVConnector):
            raise ValueError(f"connector must be a KVConnector or None, got {connector!r}")
        if driver is not None and not (isinstance(driver, Driver) and driver.device == canonical_device(device)):
            raise ValueError(f"driver must be a Driver of {canonical_device(device)} or None, got {driver!r}")
        if budget is not None and not (isinstance(budget, BudgetClient) and extensible):
            raise ValueError(f"budget must be a BudgetClient of an extensible runner, or None, got {budget!r} "
                             f"with extensible={extensible}")
        driver = driver_for(device) if driver is None else driver
        self.device, self._driver = torch.device(device), driver
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
        self.allocated_config = pad_kv_cache_segments(kv_cache_config, layout, driver.granularity)
        self.kv_cache_config = self.allocated_config
        self.extensible_kv_cache = (
            ExtensibleKVCache(self.allocated_config, driver, layout, budget=budget) if extensible else None
        )
        self.kv_caches: list[torch.Tensor] = []
        self._plain_buffer: torch.Tensor | None = None
        self.graphs: dict[int, _CapturedDecode] = {}
        #: Held by every stage operation, the request bookkeeping and
        #: `on_reclaim` (see the module's theory).
        self.lock = threading.RLock()
        #: Each running request's blocks, in order; oldest request first.
        self._requests: dict[Hashable, list[int]] = {}
        #: Requests `on_reclaim` preempted, in order: the engine schedules
        #: them again from their tokens, as vLLM recomputes a preempted request.
        self.preempted: list[Hashable] = []
        self._stage = _Stage.CREATED
        if budget is not None:
            budget.on_reclaim(self.on_reclaim)

    @property
    def layer_names(self) -> list[str]:
        return list(self.kv_cache_config.kv_cache_groups[0].layer_names)

    def bind_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = [kv_caches[name] for name in self.layer_names]

    # -- stages -------------------------------------------------------------------
    @_staged
    def profile_run(self, max_batch: int) -> int:
        """Run one forward at `max_batch` without a KV cache and keep its
        activation peak as the cache's reserved headroom. Returns the peak."""
        max_batch = validate.integer("max_batch", max_batch, minimum=1, what="a batch size")
        c = self.config
        scratch = torch.zeros(1, 2, c.block_size, c.num_kv_heads, c.head_size, dtype=c.dtype, device=self.device)
        start = torch_memory.start_peak(self.device)
        self._forward(*self._null_inputs(max_batch), [scratch] * c.num_layers)
        peak = torch_memory.peak_since(self.device, start)
        if self.extensible_kv_cache is not None:
            self.extensible_kv_cache.reserved_headroom_bytes = peak
        return peak

    @_staged
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

    @_staged
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

    @_staged
    def capture_cuda_graphs(self, batch_sizes: list[int]) -> None:
        """Capture one decode step per batch size. The inputs point at the null
        block; replays may point anywhere in the capacity."""
        batch_sizes = _batch_sizes(batch_sizes)
        if not self._driver.supports_graphs:
            raise ExtkvError(f"CUDA graphs need a CUDA device, this runner is on {self.device}")
        pool = None
        for batch in sorted(batch_sizes, reverse=True):
            tokens, positions, block_tables, seq_lens = (t.clone() for t in self._null_inputs(batch))
            graph, logits = self._driver.capture_graph(
                functools.partial(self._forward, tokens, positions, block_tables, seq_lens, self.kv_caches), pool=pool
            )
            pool = graph.pool()
            self.graphs[batch] = _CapturedDecode(graph, tokens, positions, block_tables, seq_lens, logits)

    @_staged
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
        return self.extensible_kv_cache

    @_staged
    def sleep(self) -> None:
        """Release the cache's physical memory (connector unregistered first)."""
        kv_cache = self._require_extensible("sleep")
        if self.kv_connector is not None:
            self.kv_connector.unregister_kv_caches()
        kv_cache.release_physical()

    @_staged
    def wake(self) -> None:
        """Recommit what `sleep` released, zeroed; then restore the connector."""
        kv_cache = self._require_extensible("wake")
        kv_cache.recommit()
        if self.kv_connector is not None:
            self.kv_connector.restore_kv_caches()

    @_staged
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

    @_staged
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

    # -- requests ---------------------------------------------------------------
    @_staged
    def add_request(self, request_id: Hashable, num_blocks: int) -> list[int]:
        """Give `request_id` the `num_blocks` lowest free blocks, committing
        (through `extend_kv_cache`) any past the committed ones; returns them."""
        num_blocks = validate.integer(
            "num_blocks", num_blocks, minimum=1, maximum=self.config.max_blocks_per_seq, what="a block count")
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is running already, with blocks {self._requests[request_id]}")
        live = self._live_blocks()
        capacity = self.allocated_config.num_blocks
        free = [block for block in range(self.NULL_BLOCK + 1, capacity) if block not in live][:num_blocks]
        if len(free) < num_blocks:
            raise ExtkvError(f"request {request_id!r} needs {num_blocks} blocks; {len(free)} of the capacity "
                             f"of {capacity} are free")
        if free[-1] >= self.num_committed_blocks:
            extend_kv_cache(self, self.allocated_config, free[-1] + 1)
        self._requests[request_id] = free
        return list(free)

    @_staged
    def finish_request(self, request_id: Hashable) -> None:
        """Free the blocks of `request_id` (a running request)."""
        if request_id not in self._requests:
            raise ValueError(f"request {request_id!r} is not running; running: {list(self._requests)}")
        del self._requests[request_id]

    def request_blocks(self, request_id: Hashable) -> list[int]:
        """The blocks of running request `request_id`, in order."""
        with self.lock:
            if request_id not in self._requests:
                raise ValueError(f"request {request_id!r} is not running; running: {list(self._requests)}")
            return list(self._requests[request_id])

    @property
    def running_requests(self) -> list[Hashable]:
        """Running requests, oldest first."""
        with self.lock:
            return list(self._requests)

    def block_tables(self, request_ids: Iterable[Hashable]) -> torch.Tensor:
        """Decode's block tables for running `request_ids`: one row each,
        padded with the null block. Hold `lock` from here through the decode."""
        with self.lock:
            rows = [self.request_blocks(request_id) for request_id in request_ids]
            table = torch.full((len(rows), self.config.max_blocks_per_seq), self.NULL_BLOCK, dtype=torch.int64)
            for row, blocks in zip(table, rows):
                row[: len(blocks)] = torch.tensor(blocks, dtype=torch.int64)
            return table.to(self.device)

    def _live_blocks(self) -> set[int]:
        return {block for blocks in self._requests.values() for block in blocks}

    # -- the shared budget --------------------------------------------------------
    def on_reclaim(self, target_bytes: int) -> int:
        """Free at least `target_bytes` of the cache's physical memory; the
        bytes freed, or 0 (nothing changed) where even keeping only the null
        block would not free that much, or the runner holds no live cache.

        The new top is the largest block count whose footprint after a
        preserving shrink frees the target (`blocks_kept_within`).
        Requests are preempted, newest first (vLLM's scheduler preempts
        from the end of its running queue), only while the live blocks do
        not fit below the top; preempted ids go to `preempted`. The live
        blocks above the top are copied on the device onto the lowest free
        blocks below it, in every segment, each request's blocks updated;
        then the shrink (`extend_kv_cache` with `preserve_contents`) keeps
        every block below the top, so nothing is staged or written back.
        A shrink that fails part way still keeps them, so the requests
        survive it. Thread-safe: it holds `lock`. The budget client calls
        it; the freed bytes reach the daemon as the shrink's own
        `returned`."""
        target_bytes = validate.integer("target_bytes", target_bytes, what="bytes")
        with self.lock:
            kv_cache = self.extensible_kv_cache
            if self._stage is not _Stage.ALLOCATED or kv_cache is None or not target_bytes:
                return 0
            before = kv_cache.physical_bytes
            new_top = self._top_freeing(kv_cache, before - target_bytes)
            if new_top is None:
                return 0
            while len(self._live_blocks()) > new_top - 1:  # the null block stays below the top
                newest = next(reversed(self._requests))
                del self._requests[newest]
                self.preempted.append(newest)
            moves = self._moves_below(new_top)
            self._move_blocks(kv_cache, {block: to for block, to in moves.items() if block != to})
            for blocks in self._requests.values():
                blocks[:] = [moves[block] for block in blocks]
            # The shrink synchronizes the device before it unmaps anything
            # the copies read.
            extend_kv_cache(self, self.allocated_config, new_top, preserve_contents=True)
            return before - kv_cache.physical_bytes

    @staticmethod
    def _top_freeing(kv_cache: ExtensibleKVCache, keep_bytes: int) -> int | None:
        """The largest block count, at least 1 and at most the committed
        ones, whose footprint after a preserving shrink is at most
        `keep_bytes`; None if there is none."""
        count = kv_cache.blocks_kept_within(keep_bytes) if keep_bytes >= 0 else 0
        return count if count >= 1 else None

    def _moves_below(self, new_top: int) -> dict[int, int]:
        """Each live block's id once the cache holds `new_top` blocks: those
        below stay, those at or above take the lowest free ids below."""
        live = self._live_blocks()
        free = iter(block for block in range(self.NULL_BLOCK + 1, new_top) if block not in live)
        return {block: block if block < new_top else next(free) for block in live}

    @staticmethod
    def _move_blocks(kv_cache: ExtensibleKVCache, moves: dict[int, int]) -> None:
        """Copy each block of `moves` onto the block it maps to, in every
        segment, on the device: one gather and one scatter per segment."""
        if not moves:
            return
        sources, targets = zip(*sorted(moves.items()))
        for segment, stride in enumerate(kv_cache.segment_strides):
            rows = kv_cache.buffer.segment_view(segment).view(-1, stride)
            source = torch.tensor(sources, dtype=torch.int64, device=rows.device)
            target = torch.tensor(targets, dtype=torch.int64, device=rows.device)
            rows.index_copy_(0, target, rows.index_select(0, source))

    @_staged
    def free(self) -> None:
        """Drop graphs, views and requests and free the cache. Idempotent."""
        self.graphs.clear()
        self._requests.clear()
        self.kv_caches = []
        self._plain_buffer = None
        if self.extensible_kv_cache is not None:
            self.extensible_kv_cache.free()
