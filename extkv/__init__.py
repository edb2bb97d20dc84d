"""extkv: a growable KV-cache backing allocation on virtual memory.

Reserve address space for the largest KV cache once, commit physical memory for
a prefix of blocks on demand, and keep every address fixed, so tensor views and
captured CUDA graphs stay valid while the cache grows, shrinks, is defragmented
or is released for sleep and recommitted.

Importing the package costs nothing: each name below is imported from its
module when first used (PEP 562), so `extkv --help`, the pytest plugin and
the reports, which need none of them, do not pay for torch. The imports under
TYPE_CHECKING are the same names for type checkers;
meta/test_cli_input.py checks that the two lists agree.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .cache import ExtensibleKVCache, measure_kv_cache_blocks
    from .connector import (
        KVConnector,
        PeerDisconnectedError,
        PeerRefusedError,
        SegmentExportConnector,
        SegmentNotContiguousError,
        listen_privately,
    )
    from .errors import DeadlineExceededError, DriverError, ExtkvError, OutOfMemoryError, StateError
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
    from .peer import import_segments
    from .ranks import agree_on_committable_blocks, min_over_ranks
    from .reference_model import ReferenceModelRunner
    from .runner import (
        Runner,
        WeightUpdateMemoryError,
        ensure_kv_cache_blocks,
        extend_kv_cache,
        kv_cache_lent_for_weight_update,
        max_layer_reload_bytes,
        num_committable_kv_blocks,
        registers_kv_cache_memory,
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
    from .sleep import SleepController
    from .tensor import ExtensibleTensor, MappedChunk
    from .usage import UsageProbe
    from .vmm import Driver, FaultInjectingDriver, HostDriver, device_memory_info, driver_for
    from .vmm.host import make_undumpable

#: Module (relative to this package) -> the names it gives the package.
_EXPORTS: dict[str, tuple[str, ...]] = {
    ".cache": ("ExtensibleKVCache", "measure_kv_cache_blocks"),
    ".connector": (
        "KVConnector",
        "PeerDisconnectedError",
        "PeerRefusedError",
        "SegmentExportConnector",
        "SegmentNotContiguousError",
        "listen_privately",
    ),
    ".errors": ("DeadlineExceededError", "DriverError", "ExtkvError", "OutOfMemoryError", "StateError"),
    ".layout": (
        "FullAttentionSpec",
        "KVCacheConfig",
        "KVCacheGroupSpec",
        "KVCacheLayout",
        "KVCacheSpec",
        "KVCacheTensor",
        "MambaStateSpec",
        "MLAAttentionSpec",
        "build_kv_cache_config",
        "create_kv_cache_views",
        "granule_aligned_blocks",
        "granule_block_alignment",
        "kv_cache_segments",
        "layer_kernel_block_size",
        "layer_spec_for_tensor",
        "pad_kv_cache_segments",
        "round_up",
    ),
    ".peer": ("import_segments",),
    ".ranks": ("agree_on_committable_blocks", "min_over_ranks"),
    ".reference_model": ("ReferenceModelRunner",),
    ".runner": (
        "Runner",
        "WeightUpdateMemoryError",
        "ensure_kv_cache_blocks",
        "extend_kv_cache",
        "kv_cache_lent_for_weight_update",
        "max_layer_reload_bytes",
        "num_committable_kv_blocks",
        "registers_kv_cache_memory",
    ),
    ".sizing": (
        "KV_CACHE_MARGIN_FLOOR_BYTES",
        "KV_CACHE_MARGIN_FRACTION",
        "KV_CACHE_NON_TORCH_RESERVE_BYTES",
        "KV_CACHE_WARMUP_RESERVE_FRACTION",
        "WEIGHT_UPDATE_PEAK_LAYER_FACTOR",
        "committable_bytes",
        "measure_kv_cache_bytes",
        "segment_physical_bytes",
        "torch_memory_limit_bytes",
        "weight_update_peak_bytes",
    ),
    ".sleep": ("SleepController",),
    ".tensor": ("ExtensibleTensor", "MappedChunk"),
    ".usage": ("UsageProbe",),
    ".vmm": ("Driver", "FaultInjectingDriver", "HostDriver", "device_memory_info", "driver_for"),
    ".vmm.host": ("make_undumpable",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__version__ = "0.1.0"

# sizing.blocks_within is reachable as extkv.sizing.blocks_within; at the top
# level the name would read like ExtensibleKVCache.blocks_within's twin.
__all__ = [
    "agree_on_committable_blocks",
    "build_kv_cache_config",
    "committable_bytes",
    "create_kv_cache_views",
    "DeadlineExceededError",
    "device_memory_info",
    "Driver",
    "driver_for",
    "DriverError",
    "ensure_kv_cache_blocks",
    "extend_kv_cache",
    "ExtensibleKVCache",
    "ExtensibleTensor",
    "ExtkvError",
    "FaultInjectingDriver",
    "FullAttentionSpec",
    "granule_aligned_blocks",
    "granule_block_alignment",
    "HostDriver",
    "import_segments",
    "kv_cache_lent_for_weight_update",
    "KV_CACHE_MARGIN_FLOOR_BYTES",
    "KV_CACHE_MARGIN_FRACTION",
    "KV_CACHE_NON_TORCH_RESERVE_BYTES",
    "kv_cache_segments",
    "KV_CACHE_WARMUP_RESERVE_FRACTION",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheLayout",
    "make_undumpable",
    "KVCacheSpec",
    "KVCacheTensor",
    "KVConnector",
    "layer_kernel_block_size",
    "layer_spec_for_tensor",
    "listen_privately",
    "MambaStateSpec",
    "MappedChunk",
    "max_layer_reload_bytes",
    "measure_kv_cache_blocks",
    "measure_kv_cache_bytes",
    "min_over_ranks",
    "MLAAttentionSpec",
    "num_committable_kv_blocks",
    "OutOfMemoryError",
    "pad_kv_cache_segments",
    "PeerDisconnectedError",
    "PeerRefusedError",
    "ReferenceModelRunner",
    "registers_kv_cache_memory",
    "round_up",
    "Runner",
    "segment_physical_bytes",
    "SegmentExportConnector",
    "SegmentNotContiguousError",
    "SleepController",
    "StateError",
    "torch_memory_limit_bytes",
    "UsageProbe",
    "weight_update_peak_bytes",
    "WEIGHT_UPDATE_PEAK_LAYER_FACTOR",
    "WeightUpdateMemoryError",
]


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module, __name__), name)
    elif importlib.util.find_spec(f"{__name__}.{name}") is not None:
        # A submodule (`extkv.vmm`), an attribute once imported as it would
        # be had the package imported it eagerly.
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # found directly from now on
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
