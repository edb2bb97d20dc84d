"""extkv: a growable KV-cache backing allocation on virtual memory.

Reserve address space for the largest KV cache once, commit physical memory for
a prefix of blocks on demand, and keep every address fixed, so tensor views and
captured CUDA graphs stay valid while the cache grows, shrinks, is defragmented
or is released for sleep and recommitted.
"""

from .cache import ExtensibleKVCache, measure_kv_cache_blocks
from .errors import DriverError, ExtkvError, OutOfMemoryError, StateError
from .layout import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheLayout,
    KVCacheSpec,
    KVCacheTensor,
    MambaStateSpec,
    MLAAttentionSpec,
    build_kv_cache_config,
    create_kv_cache_views,
    granule_aligned_blocks,
    granule_block_alignment,
    kv_cache_segments,
    layer_kernel_block_size,
    layer_spec_for_tensor,
    pad_kv_cache_segments,
    round_up,
)
from .sizing import (
    KV_CACHE_MARGIN_FLOOR_BYTES,
    KV_CACHE_MARGIN_FRACTION,
    KV_CACHE_NON_TORCH_RESERVE_BYTES,
    KV_CACHE_WARMUP_RESERVE_FRACTION,
    WEIGHT_UPDATE_PEAK_LAYER_FACTOR,
    committable_bytes,
    measure_kv_cache_bytes,
    segment_physical_bytes,
    torch_memory_limit_bytes,
    weight_update_peak_bytes,
)
from .tensor import ExtensibleTensor, MappedChunk
from .usage import UsageProbe, device_memory_info
from .vmm import Driver, FaultInjectingDriver, HostDriver, driver_for

__version__ = "0.1.0"

# sizing.blocks_within is reachable as extkv.sizing.blocks_within; at the top
# level the name would read like ExtensibleKVCache.blocks_within's twin.
__all__ = [
    "Driver",
    "DriverError",
    "ExtensibleKVCache",
    "ExtensibleTensor",
    "ExtkvError",
    "FaultInjectingDriver",
    "FullAttentionSpec",
    "HostDriver",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheLayout",
    "KVCacheSpec",
    "KVCacheTensor",
    "KV_CACHE_MARGIN_FLOOR_BYTES",
    "KV_CACHE_MARGIN_FRACTION",
    "KV_CACHE_NON_TORCH_RESERVE_BYTES",
    "KV_CACHE_WARMUP_RESERVE_FRACTION",
    "MLAAttentionSpec",
    "MambaStateSpec",
    "MappedChunk",
    "OutOfMemoryError",
    "StateError",
    "UsageProbe",
    "WEIGHT_UPDATE_PEAK_LAYER_FACTOR",
    "build_kv_cache_config",
    "committable_bytes",
    "create_kv_cache_views",
    "device_memory_info",
    "driver_for",
    "granule_aligned_blocks",
    "granule_block_alignment",
    "kv_cache_segments",
    "layer_kernel_block_size",
    "layer_spec_for_tensor",
    "measure_kv_cache_blocks",
    "measure_kv_cache_bytes",
    "pad_kv_cache_segments",
    "round_up",
    "segment_physical_bytes",
    "torch_memory_limit_bytes",
    "weight_update_peak_bytes",
]
