"""The vocabulary of a KV cache config, shaped like vLLM's types.

Theory of operation
-------------------

Four kinds of value describe a paged KV cache, and none of them knows about
memory order (that is `extkv.layout`'s business):

* a spec says what one layer keeps per block: its page (`page_size_bytes`)
  and whether the layer gets a typed view or lays itself out over raw bytes
  (`has_layer_views`);
* a `KVCacheTensor` places a run of layers in the shared allocation by three
  numbers: an offset, a layer stride and a block stride;
* a `KVCacheGroupSpec` names the layers that share one spec and one block
  table;
* a `KVCacheConfig` holds the block count, the placements and the groups.

They are keyword-constructible like vLLM's, so engine code reads the same.
Every constructor checks its arguments and keeps the ints it validated, so a
bad number fails where it was written, with a message naming it, rather than
deep inside the geometry. Specs and placements are frozen (specs are hashed
to find aliasing groups); a config is mutable because engines rewrite its
block count and placements as the committed size changes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from . import validate

__all__ = [
    "FullAttentionSpec",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheSpec",
    "KVCacheTensor",
    "MLAAttentionSpec",
    "MambaStateSpec",
]

# --------------------------------------------------------------------------
# Argument checks. Integers go through extkv.validate, whose messages name the
# argument, the value and what was wanted: "block_size must be an int >= 1,
# got 0" beats a bare assert.


def _check_dtype(value: object) -> torch.dtype:
    if not isinstance(value, torch.dtype):
        raise ValueError(f"dtype must be a torch.dtype, got {value!r}")
    return value


# --------------------------------------------------------------------------
# Specs: what one layer stores per block.


class KVCacheSpec:
    """Base of the per-layer specs. Subclasses are frozen dataclasses."""

    block_size: int

    @property
    def page_size_bytes(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def has_layer_views(self) -> bool:
        return True

    @property
    def num_page_heads(self) -> int:
        """Heads a page splits into under head-outer layouts."""
        return 1


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """Standard attention: each page stores K and V for every kv head."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_size", validate.integer("block_size", self.block_size, minimum=1))
        object.__setattr__(self, "num_kv_heads", validate.integer("num_kv_heads", self.num_kv_heads, minimum=1))
        object.__setattr__(self, "head_size", validate.integer("head_size", self.head_size, minimum=1))
        _check_dtype(self.dtype)

    @property
    def page_size_bytes(self) -> int:
        return (
            2
            * self.block_size
            * self.num_kv_heads
            * self.head_size
            * self.dtype.itemsize
        )

    @property
    def num_page_heads(self) -> int:
        return self.num_kv_heads


@dataclass(frozen=True)
class MLAAttentionSpec(KVCacheSpec):
    """Multi-head latent attention: one compressed vector per token, no V."""

    block_size: int
    head_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_size", validate.integer("block_size", self.block_size, minimum=1))
        object.__setattr__(self, "head_size", validate.integer("head_size", self.head_size, minimum=1))
        _check_dtype(self.dtype)

    @property
    def num_kv_heads(self) -> int:
        return 1

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.head_size * self.dtype.itemsize


@dataclass(frozen=True)
class MambaStateSpec(KVCacheSpec):
    """Recurrent state (Mamba, linear attention): opaque bytes per block.

    `shapes` are the state tensors one block holds; the page is their total
    size, or `page_size_padded` when the engine pads pages to match attention
    layers. The layer lays its state out itself over the raw buffer, so it has
    no per-layer view.
    """

    block_size: int
    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype
    page_size_padded: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_size", validate.integer("block_size", self.block_size, minimum=1))
        _check_dtype(self.dtype)
        if not isinstance(self.shapes, (tuple, list)) or not self.shapes:
            raise ValueError(
                f"shapes must be a non-empty sequence of shapes, got {self.shapes!r}"
            )
        shapes = []
        for i, shape in enumerate(self.shapes):
            if not isinstance(shape, (tuple, list)):
                raise ValueError(f"shapes[{i}] must be a tuple of ints, got {shape!r}")
            shapes.append(tuple(validate.integer(f"shapes[{i}][{j}]", dim, minimum=1) for j, dim in enumerate(shape)))
        # Lists would make the frozen spec unhashable.
        object.__setattr__(self, "shapes", tuple(shapes))
        if self.page_size_padded is not None:
            object.__setattr__(self, "page_size_padded", validate.integer("page_size_padded", self.page_size_padded, minimum=1))
            if self.page_size_padded < self.state_bytes:
                raise ValueError(
                    f"page_size_padded must be >= the state size "
                    f"{self.state_bytes}, got {self.page_size_padded}"
                )

    @property
    def state_bytes(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes) * self.dtype.itemsize

    @property
    def page_size_bytes(self) -> int:
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.state_bytes

    @property
    def has_layer_views(self) -> bool:
        return False


# --------------------------------------------------------------------------
# Placements and configs


@dataclass(frozen=True)
class KVCacheTensor:
    """Placement of a run of layers in one shared allocation of `size` bytes.

    Layer ``layers[l]`` finds block b at byte
    ``offset + l*layer_stride + b*block_stride``. Every tensor of a config
    describes the same allocation, so they all carry the same `size`.
    """

    size: int
    layers: list[str]
    layer_stride: int
    block_stride: int
    offset: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", validate.integer("size", self.size))
        object.__setattr__(self, "layer_stride", validate.integer("layer_stride", self.layer_stride))
        object.__setattr__(self, "block_stride", validate.integer("block_stride", self.block_stride, minimum=1))
        object.__setattr__(self, "offset", validate.integer("offset", self.offset))
        if isinstance(self.layers, str) or not isinstance(self.layers, Sequence):
            raise ValueError(
                f"layers must be a list of layer names, got {self.layers!r}"
            )
        if not self.layers:
            raise ValueError("layers must name at least one layer, got []")
        for name in self.layers:
            if not isinstance(name, str):
                raise ValueError(f"layer names must be str, got {name!r}")

    def layer_offset(self, layer_idx: int) -> int:
        """Allocation byte where layer `layers[layer_idx]` finds block 0."""
        return self.offset + layer_idx * self.layer_stride


@dataclass
class KVCacheGroupSpec:
    """Layers that share one spec and one block table."""

    layer_names: list[str]
    kv_cache_spec: KVCacheSpec

    def __post_init__(self) -> None:
        if isinstance(self.layer_names, str) or not isinstance(
            self.layer_names, Sequence
        ):
            raise ValueError(
                f"layer_names must be a list of layer names, got {self.layer_names!r}"
            )
        if not self.layer_names:
            raise ValueError("layer_names must name at least one layer, got []")
        if len(set(self.layer_names)) != len(self.layer_names):
            raise ValueError(f"layer_names repeat a name: {list(self.layer_names)}")
        if not isinstance(self.kv_cache_spec, KVCacheSpec):
            raise ValueError(
                f"kv_cache_spec must be a KVCacheSpec, got {self.kv_cache_spec!r}"
            )


@dataclass
class KVCacheConfig:
    """A KV cache of `num_blocks` blocks: placements and groups.

    Mutable on purpose: engines copy it and change `num_blocks` and
    `kv_cache_tensors` when the committed size changes.
    """

    num_blocks: int
    kv_cache_tensors: list[KVCacheTensor] = field(default_factory=list)
    kv_cache_groups: list[KVCacheGroupSpec] = field(default_factory=list)

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_blocks", validate.integer("num_blocks", self.num_blocks))

