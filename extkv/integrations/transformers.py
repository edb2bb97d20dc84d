"""ExtensibleCache: a Hugging Face transformers `Cache` whose keys and values
live in one ExtensibleKVCache.

Theory of operation
-------------------
Tokens, blocks and segments. The cache is reserved once for `batch_size`
sequences of `max_cache_len` tokens. Each sequence's positions are cut into
chunks of `block_size` tokens, and chunk c of batch row b is block
``1 + c * batch_size + b`` of the ExtensibleKVCache; block 0 is the null
block. Chunk c of every row comes before chunk c + 1 of any row, so the
blocks a batch needs for its first t tokens are always a prefix of the
blocks, and a prefix is what an ExtensibleKVCache commits. Its layout here is
LBHNC: each model layer is one segment (a region of the reservation, started
on a granule so that a defragment can back it with one chunk), and a block of
a segment holds K then V of `block_size` tokens, head-major: each KV head's
tokens side by side. Committing n blocks backs the first n blocks of every
layer.

Why whole blocks. A block is the unit everything here counts in: the
ExtensibleKVCache commits blocks (mapping whole granules under them) and the
block table below names blocks, so a chunk's block is committed before its
first token is written, and its other tokens find it there. What a block
holds never moves, so the tensors of every layer keep their addresses for
the cache's life.

The margin. When a step's tokens need a chunk that is not committed yet, the
cache commits through `margin` tokens past them (in whole blocks, at most
max_cache_len). Commits are driver calls (a block that starts a new granule
maps and zeroes it), so with a margin they come at most once every `margin`
tokens rather than at every block, for at most `margin` tokens of blocks
committed past what the sequences hold. Steps between commits make no
driver call. Under a shared budget each chunk of the margin is committed
by a commit of its own, so that a reclaim can give it back a chunk at a
time (below).

Static shapes. Like StaticCache, each layer's `update` returns keys and values
of shape (batch, kv heads, max_cache_len, head_dim) and `get_mask_sizes` says
max_cache_len, so the attention mask hides the positions not yet written and
no shape ever changes. They are gathered through a block table on the device,
(batch_size, chunks + 1) block ids: a chunk not committed yet points at the
null block, so no step, however it is driven, reads or writes unmapped
memory, and the last column is the null block too, where a position past the
end lands instead of past the table. The table, the rows each layer gathers
(the table's blocks as rows of one head's tokens), the layers' position
counters and the block views keep their addresses; growth writes the new
chunks' ids into the table, and their rows into the gathered ones, in place.
A decode step captured as a CUDA graph therefore reads and writes blocks
committed after its capture when it is replayed.

Host and device. Layer 0's `update` runs the host step first, `make_room`:
check that the sequence fits max_cache_len, commit if it needs to, count the
tokens. While a CUDA graph is being captured it is skipped, since a commit's
zeroing would be captured with the step; a replay then writes its tokens
without any host code, so a caller who replays a captured step calls
`make_room(n)` before each replay of n tokens. `get_seq_length()` is a
tensor on the device, as StaticCache's is, so that position ids computed
from it inside a graph advance on replay; `seq_length` is the host's count.

torch.compile. Every `update` is left out of compiled graphs
(torch.compiler.disable) and runs eagerly between them, so the host step
runs every step, also under mode="reduce-overhead". A compiled graph that
took the block views as inputs would functionalize their writes into a copy
of the whole reservation, unmapped pages included, which faults. The cost:
a graph break in every layer, so the model's attention compiles once per
layer, and past torch._dynamo.config.recompile_limit layers (8 by default)
the rest run uncompiled; raise that limit for deeper models.

Sleep and wake. `release_physical()` gives every page back to the driver and
keeps the addresses; while the cache sleeps, an update raises StateError
(its blocks are unmapped). `recommit()` maps the same blocks again as zeroed
pages at the same addresses and empties the cache: the caller re-prefills
what it wants to continue from, the prompt and the tokens generated so far
(`model.generate(all_ids, past_key_values=cache)` or one forward of them).
CUDA graphs captured before the sleep stay valid after the wake.

Others may put `kv_cache` to sleep too: a SleepController holding it (or
its reservation), or its own `release_physical()`. Every update, and
`make_room` and `reset`, first checks that every committed block is
mapped, so an update over released memory raises StateError before it
touches a block (a touch would kill the process). The tokens are gone
after such a sleep whatever its wake brings back, so after a
wake (the reservation's `release_count` says there was a release)
a cache that held tokens refuses to continue, with StateError, until
`reset()`; then the caller re-prefills, as after `recommit()`. A cache that
held none takes the woken blocks as they are.

The shared budget. Under a shared KV budget (extkv.budget: `budget=` a
BudgetClient, or the client of the daemon EXTKV_BUDGET names, as
ExtensibleKVCache takes it) every commit asks the daemon first, and the
cache answers the daemon's reclaims with `on_reclaim(target_bytes)`,
which it registers on the client, holding itself weakly so that a lease
outliving the cache keeps nothing mapped. A client has one handler, the
last cache's made on it: an engine that keeps several caches on one lease
registers a handler of its own that asks each cache's `on_reclaim`. What
it gives, never a token of a generation that may go on:

1. The margin: blocks committed past the chunks the sequences hold, which
   no token occupies. The cache shrinks from the top, keeping contents
   (`commit(n, shrink=True, preserve_contents=True)`), to the largest block
   count whose footprint after such a shrink frees the target (a chunk
   straddling the new top stays whole: `blocks_kept_within`), never below
   those chunks (an empty cache keeps its null block only). The blocks
   holding tokens (a prefix too: rows share positions) stay mapped as they
   are: nothing is staged, copied or mapped again. Each chunk of the
   margin was committed alone, so the shrink takes the margin a chunk at
   a time (a physical chunk holding a kept block stays whole). The chunks
   above the new top point at the null block again and are committed
   anew, zeroed, when tokens reach them.
2. A generation the caller declared done (`finish_generation()`): all of
   it, the null block included, since nothing will read it; no copy is
   made. The cache is then given back: an update raises StateError until
   `reset()`, which maps the null block again (asking the budget).
3. Otherwise nothing: a target the margin cannot cover is answered 0,
   nothing changed (the daemon hears `cannot`), rather than a part of it,
   which the asker could not use. A single finished row cannot be freed:
   its blocks are interleaved with the other rows' (a prefix shrink takes
   chunks of every row), so the caller finishes a generation, not a row.

`finish_generation()` refuses updates from then on, whether or not a
reclaim came, so what the caller sees never depends on the daemon's
timing. A margin shrink creates nothing, so it never waits on the budget
and never meets the driver's out-of-memory. A release that fails part way
(a driver error) still keeps every token: the count drops before any
chunk goes, the chunks above it point at the null block, and the error
reaches the budget client, which warns and answers `cannot`; generation
goes on.

Threads. The budget client runs `on_reclaim` on a thread of its own,
while a generate may be running on another. Every update (and
`make_room`, `reset`, `finish_generation`, sleep, wake, `free`) holds the
cache's `lock` (re-entrant), as `on_reclaim` does, so a reclaim runs
between two layers' updates, never inside one: a step's positions lie
below the margin, which `make_room` counted at layer 0, and the keys and
values each update hands out are a gathered copy, so the shrink moves
nothing any layer still reads. A caller who replays a captured CUDA graph
holds `lock` from its `make_room` through the replay. A reclaim that
arrives while the cache's own growth waits on the budget waits for that
growth to end (the daemon never asks the asker itself).

How it differs from StaticCache and DynamicCache. StaticCache allocates
max_cache_len tokens of every layer up front; this cache reserves that as
address space only and maps memory as tokens arrive, with the same static
shapes, so a CUDA graph sees what it sees over StaticCache (torch.compile
sees less: see above).
DynamicCache grows by `torch.cat` every step, so its tensors move and no
graph over them survives a step; its memory follows the tokens exactly, where
this cache's follows them in whole blocks and granules, and is reported as
`committed_bytes` (the blocks) and `physical_bytes` (what is mapped). What it
costs: each layer's update gathers its keys and values over max_cache_len
positions into a transient of one layer (StaticCache hands out its tensors in
place); a sliding-window layer keeps every token, as a full-attention one
does, and the mask applies the window (both transformers caches keep only the
window), because one ExtensibleKVCache commits the same blocks in every
layer. Beam search, batch reordering and cropping are not supported.
"""

from __future__ import annotations

import enum
import threading
import weakref
from typing import Callable

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs

from .. import validate
from ..budget.client import BudgetClient
from ..budget.driver import BudgetedDriver
from ..cache import ExtensibleKVCache
from ..deferred_signals import deferred_signals
from ..errors import StateError
from ..layout import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    KVCacheLayout,
    build_kv_cache_config,
    create_kv_cache_views,
    pad_kv_cache_segments,
)
from ..vmm import Driver, driver_for

__all__ = ["DEFAULT_BLOCK_SIZE", "DEFAULT_MARGIN", "ExtensibleCache", "ExtensibleLayer"]

#: Tokens per block: vLLM's default page.
DEFAULT_BLOCK_SIZE = 16
#: Tokens committed past those a step needs: four 16-token blocks, so a commit
#: (a driver call) comes once every 64 tokens at most.
DEFAULT_MARGIN = 64
#: K/V of a block head-major: a layer's blocks are then rows of one head's
#: `block_size` tokens (K's heads, then V's, block after block), and one
#: index_select of rows hands out keys and values as StaticCache holds them,
#: (batch, heads, positions, head_dim) contiguous. Measured on the H200
#: (8-layer bf16 Llama, 4 sequences, 4096 positions, 4 KV heads of 128):
#: with token-major blocks gathered by advanced indexing the graphed decode
#: step took 3.78 ms against StaticCache's 2.59 ms; the gather took 37 us per
#: K or V, and the copy that repeats KV heads for grouped-query attention
#: 25 us more than over StaticCache's tensors.
LAYOUT = KVCacheLayout.LBHNC
#: Layer types whose cache is keys and values per token. Chunked attention is
#: a mask over them, as a sliding window is.
_KV_LAYER_TYPES = {"full_attention": False, "sliding_attention": True, "chunked_attention": True}
MiB = float(1 << 20)


class _State(enum.Enum):
    LIVE = "live"
    FINISHED = "finished (finish_generation() declared its generation done; reset() starts another)"
    GIVEN_BACK = "given back (a budget reclaim took every block; reset() maps the null block again for another generation)"
    ASLEEP = "asleep (its memory released; recommit() wakes it)"
    FREED = "freed"


def _text_config(config):
    get_text_config = getattr(config, "get_text_config", None)
    if get_text_config is None:
        raise ValueError(
            f"config must be the model's transformers config (a PreTrainedConfig, e.g. model.config), got {config!r}"
        )
    return get_text_config(decoder=True)


def _head_geometry(text_config) -> tuple[int, int]:
    """(kv heads, head_dim) of the attention layers, as the model reads them
    from its config."""
    heads = validate.integer(
        "config.num_attention_heads", getattr(text_config, "num_attention_heads", None), minimum=1, what="heads"
    )
    kv_heads = getattr(text_config, "num_key_value_heads", None)
    kv_heads = validate.integer("config.num_key_value_heads", heads if kv_heads is None else kv_heads, minimum=1)
    head_dim = getattr(text_config, "head_dim", None)
    if head_dim is None:
        hidden = validate.integer("config.hidden_size", getattr(text_config, "hidden_size", None), minimum=1)
        head_dim = hidden // heads
    return kv_heads, validate.integer("config.head_dim", head_dim, minimum=1)


def _largest_count_within(kv_cache: ExtensibleKVCache, least: int, keep_bytes: int) -> int | None:
    """The largest block count from `least` to the committed ones whose
    footprint after a shrink keeping contents is at most `keep_bytes`
    (`blocks_kept_within`); None if there is none."""
    count = kv_cache.blocks_kept_within(keep_bytes) if keep_bytes >= 0 else -1
    return count if count >= least else None


def _reclaims_answered_by(cache: "ExtensibleCache") -> Callable[[int], int]:
    """A budget client's reclaim handler that calls `cache.on_reclaim`
    while the cache lives and answers 0 once it is gone. It holds the cache
    weakly: a lease may outlive the cache (EXTKV_BUDGET's lasts as long as
    the process), and a cache dropped without `free()` must still be
    collected, its memory with it."""
    on_reclaim = weakref.WeakMethod(cache.on_reclaim)

    def answer(target_bytes: int) -> int:
        handler = on_reclaim()
        return 0 if handler is None else handler(target_bytes)

    return answer


class ExtensibleLayer(CacheLayerMixin):
    """One model layer of an ExtensibleCache: its blocks are one segment of
    the cache's ExtensibleKVCache. Made by ExtensibleCache, not directly."""

    # Static shapes, as StaticLayer's: transformers then masks a one-token
    # step over every position instead of dropping the mask, and generate
    # compiles its decode steps on a GPU.
    is_compileable = True
    is_croppable = False

    def __init__(self, cache: ExtensibleCache, index: int, is_sliding: bool, sliding_window: int | None, blocks):
        super().__init__()
        self._cache = cache
        self.index = index
        self.is_sliding = is_sliding
        self.sliding_window = sliding_window
        self.max_cache_len = cache.max_cache_len
        self.batch_size = cache.batch_size
        self.num_heads = cache.num_kv_heads
        self.dtype, self.device = cache.dtype, cache.device
        # (capacity blocks, block_size, kv heads, head_dim) each, over the
        # whole reservation: only committed blocks may be touched, which the
        # block table sees to.
        self._keys, self._values = blocks[:, 0], blocks[:, 1]
        # The same bytes as rows of one head's block_size tokens: row
        # (block * 2 + k_or_v) * heads + head. A view, never a copy: a copy
        # would read the uncommitted blocks, which are unmapped.
        self._rows = blocks.permute(0, 1, 3, 2, 4).view(-1, cache.block_size * cache.head_dim)
        # A tensor, as StaticLayer's: a graph replay advances it.
        self.cumulative_length = torch.zeros((), dtype=torch.int64, device=cache.device)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Check the states against the cache's geometry (the blocks exist
        from construction on)."""
        self._cache._check_states(self.index, key_states, value_states)
        self.is_initialized = True

    @torch.compiler.disable
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the new tokens' keys and values at the step's positions and
        return the layer's keys and values over max_cache_len positions.
        ExtensibleCache.update calls it, having found the step's positions
        at layer 0 (every layer writes the same ones)."""
        cache = self._cache
        cache._check_states(self.index, key_states, value_states)
        self.is_initialized = True
        blocks, offsets = cache._step_positions
        self._keys.index_put_((blocks, offsets), key_states.transpose(1, 2))
        self._values.index_put_((blocks, offsets), value_states.transpose(1, 2))
        self.cumulative_length.add_(key_states.shape[-2])
        # One index_select of the rows the table names (cache._gather_rows)
        # reads only those rows and writes a fresh contiguous (K or V, batch,
        # heads, chunks * block_size, head_dim).
        shape = (2, self.batch_size, self.num_heads, -1, key_states.shape[-1])
        gathered = torch.index_select(self._rows, 0, cache._gather_rows).view(shape)[..., : self.max_cache_len, :]
        return gathered[0], gathered[1]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv length, kv offset) of the mask: every position, from 0."""
        return self.max_cache_len, 0

    def get_seq_length(self) -> torch.Tensor:
        """Tokens this layer holds, as a tensor on the device."""
        return self.cumulative_length

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        raise NotImplementedError(
            "reset the ExtensibleCache, not one of its layers: its layers hold one sequence length together"
        )

    def _unsupported(self, what: str):
        raise NotImplementedError(
            f"ExtensibleCache does not {what}: its batch rows and positions are fixed blocks; "
            "use DynamicCache for beam search, contrastive search and assisted decoding"
        )

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._unsupported("reorder its batch (beam search)")

    def crop(self, tokens_to_remove: int) -> None:
        self._unsupported("crop")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._unsupported("repeat its batch")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._unsupported("select batch rows")

    def offload(self):
        self._unsupported("offload to the CPU")

    def prefetch(self):
        self._unsupported("offload to the CPU")

    def _drop_blocks(self) -> None:
        """Forget the block views: after `free` they point at nothing."""
        self._keys = self._values = self._rows = None

    def _zero_committed(self, num_blocks: int) -> None:
        self._keys[:num_blocks].zero_()
        self._values[:num_blocks].zero_()

    def __repr__(self) -> str:
        kind = "sliding" if self.is_sliding else "full"
        return f"ExtensibleLayer({self.index}, {kind})"


class ExtensibleCache(Cache):
    """A transformers Cache over one ExtensibleKVCache reserved for
    `batch_size` sequences of `max_cache_len` tokens of the model `config`
    describes (the model's config: layer count, layer types, KV heads and
    head_dim come from it), on `device` (a torch device, or an extkv Driver)
    in `dtype` (the model's). Blocks of `block_size` tokens are committed as
    tokens arrive, `margin` tokens ahead (module docstring). `budget`: the
    engine's BudgetClient of a shared KV budget (default: the client of the
    daemon EXTKV_BUDGET names, if set); every commit asks it first, and
    its reclaims are answered by `on_reclaim`.

    Pass it to `model.generate(..., past_key_values=cache)` or to the model's
    forward in a decode loop of your own; `finish_generation()` once a
    generation is done, so a reclaim may take its memory, and `free()` it
    when done with the cache.
    """

    def __init__(
        self,
        config,
        max_cache_len: int,
        *,
        device: torch.device | str | Driver,
        dtype: torch.dtype = torch.float32,
        batch_size: int = 1,
        block_size: int = DEFAULT_BLOCK_SIZE,
        margin: int = DEFAULT_MARGIN,
        budget: BudgetClient | None = None,
    ):
        text_config = _text_config(config)
        self._max_cache_len = validate.integer("max_cache_len", max_cache_len, minimum=1, what="tokens")
        self._batch_size = validate.integer("batch_size", batch_size, minimum=1, what="sequences")
        self.block_size = validate.integer("block_size", block_size, minimum=1, what="tokens")
        self.margin = validate.integer("margin", margin, what="tokens")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point torch.dtype (the model's), got {dtype!r}")
        if budget is not None and not isinstance(budget, BudgetClient):
            raise ValueError(f"budget must be an extkv.budget.BudgetClient or None, got {budget!r}")
        self.dtype = dtype
        #: Held by every update and state change and by `on_reclaim` (see
        #: the module's theory: threads).
        self.lock = threading.RLock()
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text_config)
        # transformers 5.17 gives one kwargs dict for all layers; later
        # releases give one per layer (heterogeneous configs).
        per_layer_kwargs = layer_kwargs if isinstance(layer_kwargs, list) else [layer_kwargs] * len(layer_types)
        unsupported = sorted({kind for kind in layer_types if kind not in _KV_LAYER_TYPES})
        if unsupported:
            raise ValueError(
                f"the model's layer types {unsupported} keep no per-token keys and values; ExtensibleCache "
                f"holds layers of the types {sorted(_KV_LAYER_TYPES)}"
            )
        if not layer_types:
            raise ValueError("the model's config has no attention layers (num_hidden_layers is 0)")
        self.num_kv_heads, self.head_dim = _head_geometry(text_config)
        driver = driver_for(device)
        self.device, self._driver = driver.device, driver
        #: Chunks of block_size tokens per sequence.
        self.num_chunks = -(-self._max_cache_len // self.block_size)
        spec = FullAttentionSpec(
            block_size=self.block_size, num_kv_heads=self.num_kv_heads, head_size=self.head_dim, dtype=dtype
        )
        names = [f"layers.{index}" for index in range(len(layer_types))]
        capacity = self._blocks_for(self.num_chunks)
        group = KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec)
        kv_cache_config = build_kv_cache_config([group], capacity, LAYOUT)
        kv_cache_config = pad_kv_cache_segments(kv_cache_config, LAYOUT, driver.granularity)
        (placement,) = kv_cache_config.kv_cache_tensors
        self._seq_length = 0
        self._open_chunks = 0
        # A signal between the reservation and the assignment would lose it.
        with deferred_signals():
            self.kv_cache = ExtensibleKVCache(kv_cache_config, driver, LAYOUT, budget=budget)
            self._state = _State.LIVE
        #: Whether the daemon of a shared budget asks this cache's `on_reclaim` (`_open_through` says why it matters).
        self._reclaimed_by_budget = isinstance(self.kv_cache.buffer.driver, BudgetedDriver)
        #: The reservation's `release_count` when this cache last knew what its blocks hold.
        self._releases_seen = self.kv_cache.buffer.release_count
        try:
            reservation = self.kv_cache.allocate(placement.size)  # commits the null block
            blocks = create_kv_cache_views(reservation, spec, capacity, LAYOUT, placement)
            #: Block id of each (batch row, chunk); the last column and chunks
            #: not committed yet hold the null block.
            self.block_table = torch.zeros(self._batch_size, self.num_chunks + 1, dtype=torch.int64, device=self.device)
            #: The layers' rows (ExtensibleLayer._rows) the table names, in the
            #: order of the keys and values each update hands out: (K or V,
            #: batch row, head, chunk), flattened; kept beside the table.
            self._gather_rows = self._rows_named(self.block_table[:, :-1])
            layers = [
                ExtensibleLayer(self, index, _KV_LAYER_TYPES[kind], kwargs.get("sliding_window"), layer_blocks)
                for index, (kind, kwargs, layer_blocks) in enumerate(zip(layer_types, per_layer_kwargs, blocks))
            ]
            del reservation, blocks
            super().__init__(layers=layers)
            #: Where the current step writes (`_positions_of_step`), found at
            #: layer 0 for every layer.
            self._step_positions = self._positions_of_step(0)
        except BaseException:
            self.kv_cache.free()
            self._state = _State.FREED
            raise
        budgeted_driver = self.kv_cache.buffer.driver
        if self._reclaimed_by_budget:
            budgeted_driver.client.on_reclaim(_reclaims_answered_by(self))

    def _rows_named(self, blocks: torch.Tensor) -> torch.Tensor:
        """The rows of `blocks` (batch, chunks), flattened in (K or V, batch
        row, head, chunk) order."""
        heads = self.num_kv_heads
        first = torch.arange(2 * heads, device=blocks.device).view(2, 1, heads, 1)
        return (blocks[None, :, None, :] * (2 * heads) + first).reshape(-1)

    def _blocks_for(self, chunks: int) -> int:
        """Blocks committed when every batch row has `chunks` chunks: the null
        block and `chunks` rows of `batch_size` blocks."""
        return 1 + chunks * self._batch_size

    # -- state ------------------------------------------------------------------
    def _require(self, operation: str, *legal: _State) -> None:
        if self._state not in legal:
            raise StateError(f"ExtensibleCache.{operation}() is not allowed: the cache is {self._state.value}")

    @property
    def is_freed(self) -> bool:
        return self._state is _State.FREED

    def _require_mapped(self, operation: str, *legal: _State) -> None:
        """StateError unless in a state of `legal` (default: live) with every
        committed block mapped, however the memory was released."""
        self._require(operation, *(legal or (_State.LIVE,)))
        if self._memory_released():
            raise StateError(
                f"ExtensibleCache.{operation}() is not allowed: its ExtensibleKVCache is asleep, its memory released "
                "by a SleepController or by release_physical(); wake it the same way first"
            )

    def _require_blocks(self, operation: str) -> None:
        """`_require_mapped`, and StateError if anyone released the blocks
        since this cache last knew their contents while it held tokens."""
        self._require_mapped(operation)
        releases = self.kv_cache.buffer.release_count
        if releases != self._releases_seen:
            if self._seq_length:
                raise StateError(
                    f"ExtensibleCache.{operation}() is not allowed: its ExtensibleKVCache was released and mapped "
                    "again (by a SleepController, release_physical() or a shrink), so the keys and values of its "
                    f"{self._seq_length} tokens are gone; call "
                    "reset() and re-prefill the prompt and the tokens generated so far"
                )
            self._releases_seen = releases

    @property
    def is_asleep(self) -> bool:
        """Asleep by its own `release_physical()`, or its memory released by another."""
        if self._state in (_State.ASLEEP, _State.FREED):
            return self._state is _State.ASLEEP
        return self._memory_released()

    def _memory_released(self) -> bool:
        """Whether committed blocks are unmapped: the cache released, or
        only its reservation (a SleepController holding the buffer)."""
        kv_cache = self.kv_cache
        return kv_cache.is_asleep or kv_cache.grown_blocks < kv_cache.num_committed_blocks

    # -- what transformers asks -------------------------------------------------
    @property
    def max_cache_len(self) -> int:
        """Tokens each sequence may hold."""
        return self._max_cache_len

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def seq_length(self) -> int:
        """Tokens of each sequence the host has counted (what `make_room`
        made room for)."""
        return self._seq_length

    def _check_states(self, layer_idx: int, key_states, value_states) -> None:
        """ValueError unless the states are what this cache was built for,
        StateError unless its blocks are there and hold what it wrote (before
        any is touched). Called by every update."""
        self._require_blocks("update")
        wanted = (self._batch_size, self.num_kv_heads, self.head_dim)
        for name, states in (("key_states", key_states), ("value_states", value_states)):
            if not isinstance(states, torch.Tensor) or states.dim() != 4:
                raise ValueError(
                    f"layer {layer_idx}: {name} must be a 4-D tensor (batch, kv heads, tokens, head_dim), "
                    f"got {type(states).__name__} of shape {tuple(getattr(states, 'shape', ()))}"
                )
            shape = tuple(states.shape)
            if (shape[0], shape[1], shape[3]) != wanted:
                raise ValueError(
                    f"layer {layer_idx}: {name} of shape {shape} (batch, kv heads, tokens, head_dim) do not fit "
                    f"this cache's batch_size {self._batch_size}, {self.num_kv_heads} kv heads and head_dim "
                    f"{self.head_dim}: build the cache from the model's config and the batch you run"
                )
            if states.dtype != self.dtype or states.device != self.device:
                raise ValueError(
                    f"layer {layer_idx}: {name} are {states.dtype} on {states.device}; this cache holds "
                    f"{self.dtype} on {self.device} (pass the model's dtype and device)"
                )
        if key_states.shape[2] != value_states.shape[2]:
            raise ValueError(
                f"layer {layer_idx}: key_states hold {key_states.shape[2]} tokens, value_states "
                f"{value_states.shape[2]}; both must hold the step's tokens"
            )

    @torch.compiler.disable
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if type(layer_idx) is not int or not 0 <= layer_idx < len(self.layers):
            raise ValueError(
                f"layer_idx {layer_idx!r} is not one of this cache's {len(self.layers)} layers (0 to "
                f"{len(self.layers) - 1}): build the cache from the config of the model that runs it"
            )
        with self.lock:
            if layer_idx == 0:
                self._begin_step(key_states, value_states)
                self._step_positions = self._positions_of_step(key_states.shape[-2])
            return self.layers[layer_idx].update(key_states, value_states)

    def _positions_of_step(self, new: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block of each batch row, offset in it) of the step's `new`
        positions, on the device from layer 0's counter, so that a graph
        replay finds the next ones. A position past max_cache_len finds the
        table's last column, the null block."""
        positions = self.layers[0].cumulative_length + torch.arange(new, device=self.device)
        chunks = torch.clamp(positions // self.block_size, max=self.num_chunks)
        return self.block_table[:, chunks], positions % self.block_size

    def _begin_step(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """The host step of layer 0's update: checks, then room for the
        step's tokens (skipped while a CUDA graph is being captured)."""
        self._check_states(0, key_states, value_states)
        stale = [layer.index for layer in self.layers if not layer.is_initialized]
        if stale and self._seq_length:
            raise ValueError(
                f"the model updated {stale[0]} of this cache's {len(self.layers)} layers in its last step "
                f"(layers {stale} never): build the cache from the config of the model that runs it"
            )
        if self._capturing():
            return
        self.make_room(key_states.shape[-2])

    def _capturing(self) -> bool:
        return self._driver.is_capturing()

    @torch.compiler.disable
    def make_room(self, num_tokens: int = 1) -> None:
        """The host side of a step of `num_tokens` new tokens per sequence:
        check that they fit max_cache_len, commit their blocks (and `margin`
        tokens more) and count them. Layer 0's update calls it; call it
        yourself before each replay of a captured CUDA graph, which writes its
        tokens without any host code (holding `lock` through the replay
        where a shared budget may reclaim)."""
        with self.lock:
            self._make_room(num_tokens)

    def _make_room(self, num_tokens: int) -> None:
        self._require_blocks("make_room")
        num_tokens = validate.integer("num_tokens", num_tokens, what="tokens per sequence")
        end = self._seq_length + num_tokens
        if end > self._max_cache_len:
            raise ValueError(
                f"a sequence of {end} tokens ({self._seq_length} cached and {num_tokens} new) is past this cache's "
                f"max_cache_len {self._max_cache_len}; build it with a max_cache_len of at least {end}"
            )
        committed = self.kv_cache.num_committed_blocks
        if committed < self._blocks_for(self._open_chunks):
            raise StateError(
                f"the ExtensibleKVCache under this cache holds {committed} blocks, but its block table points at "
                f"{self._blocks_for(self._open_chunks)}: it was shrunk under a live ExtensibleCache"
            )
        if end > self._open_chunks * self.block_size:
            chunks = min(-(-(end + self.margin) // self.block_size), self.num_chunks)
            self._open_through(chunks, min(-(-end // self.block_size), chunks))
        self._seq_length = end

    def _open_through(self, chunks: int, holding: int) -> None:
        """Commit the blocks of the first `chunks` chunks of every row, then
        point the table at them: the table never names an unmapped block.
        Under a shared budget the chunks past the first `holding` (the
        margin) are committed one by one: a reclaim's shrink keeps contents,
        so it gives back whole physical chunks only, and one of those per
        chunk of the margin lets it take the margin a chunk at a time, where
        one for the whole margin and the tokens below it could give nothing.
        The commits of one step cost one driver call per granule each, a
        step that opens the margin `margin / block_size` of them."""
        for count in (range(holding, chunks + 1) if self._reclaimed_by_budget else (chunks,)):
            self.kv_cache.commit(self._blocks_for(count))
        rows = torch.arange(self._batch_size)[:, None]
        columns = torch.arange(self._open_chunks, chunks)[None, :]
        self.block_table[:, self._open_chunks : chunks] = (1 + columns * self._batch_size + rows).to(self.device)
        self._gather_rows.copy_(self._rows_named(self.block_table[:, :-1]))
        self._open_chunks = chunks

    # -- memory -----------------------------------------------------------------
    @property
    def committed_bytes(self) -> int:
        """Bytes of the committed blocks (the null block included), over every
        layer: what the cache holds while awake."""
        return self.kv_cache.num_committed_blocks * self.kv_cache.bytes_per_block

    @property
    def physical_bytes(self) -> int:
        """Bytes mapped now, whole granules per layer: `committed_bytes`
        rounded up, 0 asleep or freed."""
        return self.kv_cache.physical_bytes

    def release_physical(self) -> None:
        """Sleep: give every page back to the driver, keeping the addresses.
        Updates raise StateError until `recommit`."""
        with self.lock:
            self._require("release_physical", _State.LIVE, _State.ASLEEP)
            self.kv_cache.release_physical()
            self._state = _State.ASLEEP

    def recommit(self) -> None:
        """Wake: map the blocks committed before the sleep again, zeroed, at
        the same addresses, and empty the cache. Re-prefill to continue."""
        with self.lock:
            self._require("recommit", _State.ASLEEP)
            self.kv_cache.recommit()
            self._empty()
            self._releases_seen = self.kv_cache.buffer.release_count
            self._state = _State.LIVE

    def reset(self) -> None:
        """Empty the cache and zero its committed blocks (Cache.reset); what
        a SleepController's wake asks for before a re-prefill, and what starts
        another generation after `finish_generation()`. A cache a budget
        reclaim took is given its null block again first (the budget is asked;
        a denial raises BudgetDeniedError and changes nothing)."""
        with self.lock:
            self._require_mapped("reset", _State.LIVE, _State.FINISHED, _State.GIVEN_BACK)
            if self._state is _State.GIVEN_BACK:
                self.kv_cache.commit(1)  # every chunk not open points at the null block
            for layer in self.layers:
                layer._zero_committed(self.kv_cache.num_committed_blocks)
            self._empty()
            self._releases_seen = self.kv_cache.buffer.release_count
            self._state = _State.LIVE

    def finish_generation(self) -> None:
        """Declare the generation done: its tokens stay until a budget
        reclaim takes all of its memory (module docstring), and updates raise
        StateError until `reset()`, whether or not one came. Idempotent."""
        with self.lock:
            self._require("finish_generation", _State.LIVE, _State.FINISHED, _State.GIVEN_BACK)
            if self._state is _State.LIVE:
                self._state = _State.FINISHED

    def _empty(self) -> None:
        self._seq_length = 0
        for layer in self.layers:
            layer.cumulative_length.zero_()

    def free(self) -> None:
        """Release the reservation and every page. Idempotent; every other
        operation raises StateError afterwards."""
        with self.lock:
            if self._state is _State.FREED:
                return
            for layer in self.layers:
                layer._drop_blocks()
            self.kv_cache.free()
            self._state = _State.FREED

    # -- the shared budget --------------------------------------------------------
    def on_reclaim(self, target_bytes: int) -> int:
        """Give at least `target_bytes` of physical memory back to the shared
        budget: the bytes freed, or 0 with nothing changed (module docstring:
        the margin of a live generation, all of a finished one, else
        nothing). The budget client calls it from its own thread; it holds
        `lock`. The freed bytes reach the daemon as the shrink's own
        `returned`."""
        target_bytes = validate.integer("target_bytes", target_bytes, what="bytes")
        with self.lock:
            if not target_bytes or self._state not in (_State.LIVE, _State.FINISHED, _State.GIVEN_BACK):
                return 0
            if self._memory_released():  # asleep under another's hand: nothing mapped to give
                return 0
            if self._state is _State.LIVE:
                return self._shrink_into_margin(target_bytes)
            before = self.kv_cache.physical_bytes
            if before:
                self._give_back_every_block()
            return before - self.kv_cache.physical_bytes

    def _shrink_into_margin(self, target_bytes: int) -> int:
        """Free `target_bytes` from the margin of a live generation, keeping
        every token; 0 and nothing changed where the margin cannot."""
        kv_cache = self.kv_cache
        holding = self._blocks_for(-(-self._seq_length // self.block_size))
        before = kv_cache.physical_bytes
        new_top = _largest_count_within(kv_cache, holding, before - target_bytes)
        if new_top is None:
            return 0
        knew_contents = kv_cache.buffer.release_count == self._releases_seen
        try:
            # Every block below the top stays mapped as it is, the tokens'
            # among them, also when a release fails part way.
            kv_cache.commit(new_top, shrink=True, preserve_contents=True)
        finally:
            # The count dropped before any chunk went, if it did at all:
            # the chunks past it point at the null block again.
            self._close_chunks_from((kv_cache.num_committed_blocks - 1) // self._batch_size)
            if knew_contents:  # what was lost before this reclaim stays for the next update to refuse
                self._releases_seen = kv_cache.buffer.release_count
        return before - kv_cache.physical_bytes

    def _give_back_every_block(self) -> None:
        """Shrink to no block, the null block included: the generation is
        done (or given back already, a release left unfinished), so nothing
        is staged."""
        try:
            self.kv_cache.commit(0, shrink=True)
        finally:
            self._forget_blocks()

    def _forget_blocks(self) -> None:
        """Given back: the blocks are released, so no chunk is open and no
        token held."""
        self._close_chunks_from(0)
        self._empty()
        self._releases_seen = self.kv_cache.buffer.release_count
        self._state = _State.GIVEN_BACK

    def _close_chunks_from(self, chunks: int) -> None:
        """Point the table's chunks from `chunks` on at the null block again:
        their blocks are past the committed ones."""
        if chunks >= self._open_chunks:
            return
        self.block_table[:, chunks : self._open_chunks] = 0
        self._gather_rows.copy_(self._rows_named(self.block_table[:, :-1]))
        self._open_chunks = chunks

    def __repr__(self) -> str:
        return (
            f"ExtensibleCache({len(self.layers)} layers, {self._seq_length}/{self._max_cache_len} tokens x "
            f"{self._batch_size}, {self.kv_cache.num_committed_blocks}/{self._blocks_for(self.num_chunks)} blocks, "
            f"{self.physical_bytes / MiB:.1f} MiB physical, {self.device}, {self._state.value})"
        )
