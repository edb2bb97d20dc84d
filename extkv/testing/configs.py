"""Small KV cache configs and content patterns shared by the suites.

Pages are a few KiB, so a capacity of a few hundred blocks spans several 2 MiB
granules per segment: commits then cross granule boundaries, fragment, and
share granules between neighbouring segments, which is where the cache's
bookkeeping can go wrong.
"""

from __future__ import annotations

import torch

from ..cache import ExtensibleKVCache
from ..layout import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheLayout,
    MLAAttentionSpec,
    build_kv_cache_config,
    pad_kv_cache_segments,
)

GRANULE = 2 << 20
FULL = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)  # 8 KiB pages
FULL_WIDE = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=96, dtype=torch.float16)  # 12 KiB pages
MLA = MLAAttentionSpec(block_size=16, head_size=576, dtype=torch.bfloat16)  # 18 KiB pages
CAPACITY = 700

#: Config kinds `config_for` builds.
CONFIG_KINDS = ("full", "mla", "mixed", "padded")

#: (config kind, layout) pairs the cache suites run over: every layout, MLA,
#: two strides, and padded regions; unpadded LBHNC segments share granules.
CASES = [
    *[("full", layout) for layout in KVCacheLayout],
    ("mla", KVCacheLayout.LBHNC),
    ("mla", KVCacheLayout.BLNHC),
    ("mixed", KVCacheLayout.LBHNC),
    ("mixed", KVCacheLayout.LBNHC),
    ("padded", KVCacheLayout.LBHNC),
    ("padded", KVCacheLayout.BLHNC),
]
CASE_IDS = [f"{kind}-{layout.name}" for kind, layout in CASES]


def _groups(*specs_and_layers) -> list[KVCacheGroupSpec]:
    return [KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec) for spec, names in specs_and_layers]


def _layers(prefix: str, count: int) -> list[str]:
    return [f"{prefix}.{i}" for i in range(count)]


def config_for(kind: str, layout: KVCacheLayout, capacity: int = CAPACITY) -> KVCacheConfig:
    """full: 3 attention layers; mla: 2 MLA layers; mixed: two page sizes
    (separate regions, two strides); padded: layer regions on granules."""
    if kind == "full":
        return build_kv_cache_config(_groups((FULL, _layers("attn", 3))), capacity, layout)
    if kind == "mla":
        return build_kv_cache_config(_groups((MLA, _layers("mla", 2))), capacity, layout)
    if kind == "mixed":
        return build_kv_cache_config(_groups((FULL, _layers("a", 2)), (FULL_WIDE, _layers("b", 2))), capacity, layout)
    if kind == "padded":
        config = build_kv_cache_config(_groups((FULL_WIDE, _layers("p", 3))), capacity, layout)
        return pad_kv_cache_segments(config, layout, GRANULE)
    raise ValueError(f"config kind {kind!r} is not one of {CONFIG_KINDS}")


def fill_segments(kv_cache: ExtensibleKVCache, seed: int) -> list[torch.Tensor]:
    """Write a distinct, never-zero pattern over each segment's committed
    bytes; return copies of what was written."""
    patterns = []
    for i in range(len(kv_cache.segment_strides)):
        view = kv_cache.buffer.segment_view(i)
        # Byte j is (7j + seed + 31i) % 251 + 1: one period of 251 bytes,
        # tiled, since integer arithmetic over every byte is slow on a CPU.
        period = ((torch.arange(251, dtype=torch.int32) * 7 + seed + 31 * i) % 251 + 1).to(torch.uint8)
        tiles = -(-view.numel() // 251)
        view.copy_(period.to(view.device).repeat(tiles)[: view.numel()])
        patterns.append(view.clone())
    return patterns
