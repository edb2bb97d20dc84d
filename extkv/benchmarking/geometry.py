"""The KV geometries the benchmarks commit.

Theory of operation
-------------------
A `Geometry` is one group of `layers` layers of one attention spec in one
layout: what segments a cache of it has, and how many bytes each takes per
block (`strides`), read from extkv's own layout code (`kv_cache_segments`),
so a contender commits exactly the segments extkv does. `GEOMETRIES` holds
the five a run measures: a Llama-like 32 x 8 x 128 bf16 cache as 1, 32 and
256 segments, 1,024 segments of the same bytes per block, and an MLA cache
with its layer regions padded to granules.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..layout import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheLayout,
    KVCacheSpec,
    MLAAttentionSpec,
    build_kv_cache_config,
    kv_cache_segments,
    pad_kv_cache_segments,
)
from ..testing.configs import GRANULE


@dataclass(frozen=True)
class Geometry:
    """A KV cache shape: one group of `layers` layers of `spec` in `layout`."""

    name: str
    what: str
    spec: KVCacheSpec
    layers: int
    layout: KVCacheLayout
    #: Layer regions start on granules (`pad_kv_cache_segments`).
    padded: bool = False

    def config(self, capacity_blocks: int) -> KVCacheConfig:
        groups = [KVCacheGroupSpec(layer_names=[f"layers.{i}" for i in range(self.layers)], kv_cache_spec=self.spec)]
        config = build_kv_cache_config(groups, capacity_blocks, self.layout)
        return pad_kv_cache_segments(config, self.layout, GRANULE) if self.padded else config

    def strides(self) -> list[int]:
        """Bytes per block of each segment."""
        return list(_strides(self))

    @property
    def segments(self) -> int:
        return len(self.strides())

    @property
    def bytes_per_block(self) -> int:
        return sum(self.strides())


@functools.lru_cache(maxsize=None)
def _strides(geometry: Geometry) -> tuple[int, ...]:
    return tuple(kv_cache_segments(geometry.config(1), geometry.layout)[1])


_LLAMA = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
_NARROW_HEADS = FullAttentionSpec(block_size=16, num_kv_heads=32, head_size=32, dtype=torch.bfloat16)
_MLA = MLAAttentionSpec(block_size=16, head_size=576, dtype=torch.bfloat16)
_LLAMA_WORDS = "32 layers x 8 KV heads x 128, bf16, 16-token blocks (2 MiB per block)"

GEOMETRIES: dict[str, Geometry] = {
    g.name: g
    for g in [
        Geometry("blhnc1", f"{_LLAMA_WORDS}, BLHNC: 1 segment (block-outermost)", _LLAMA, 32, KVCacheLayout.BLHNC),
        Geometry("lbhnc32", f"{_LLAMA_WORDS}, LBHNC: 32 segments (layer-outermost)", _LLAMA, 32, KVCacheLayout.LBHNC),
        Geometry("lhbnc256", f"{_LLAMA_WORDS}, LHBNC: 256 segments (layer, head)", _LLAMA, 32, KVCacheLayout.LHBNC),
        Geometry(
            "lhbnc1024",
            "32 layers x 32 KV heads x 32, bf16, 16-token blocks (2 MiB per block), LHBNC: 1,024 segments",
            _NARROW_HEADS,
            32,
            KVCacheLayout.LHBNC,
        ),
        Geometry(
            "mla61",
            "61 MLA layers (latent 576, bf16, 16-token blocks), LBHNC padded to granules: 61 segments",
            _MLA,
            61,
            KVCacheLayout.LBHNC,
            padded=True,
        ),
    ]
}
