"""Where every byte of a paged KV cache lives.

Theory of operation
-------------------

A paged KV cache is one allocation cut into *pages*: the bytes one layer keeps
for one block of ``block_size`` tokens. Five logical axes address a byte:

    L  layer           B  block           H  kv head
    N  token in block  C  bytes of one head's vector (head_size * itemsize)

A `KVCacheLayout` names their order in memory, outermost first. Everything
this module computes follows from one split of that order, written down once
per layout in the table `_GEOMETRY`:

    layout   placing axes | slab axes
    LBHNC    L B          | H N C
    LBNHC    L B          | N H C
    LHBNC    L H B        | N C
    BLHNC    B L          | H N C
    BLNHC    B L          | N H C
    BHLNC    B H L        | N C

The *slab* is what one layer keeps contiguous for one block: the whole page,
or one head's share of it when H is a placing axis. The placing axes nest
around slabs like the dimensions of a C array, so each one's stride is the
slab times the extents of the placing axes inside it (B spans the block
count, H the kv heads). L is the exception that makes models with several
page sizes fit: layers are laid side by side, each page class taking
``slots * layer_stride`` bytes, and the axes outside L span that whole row.
Cache groups alias as in vLLM's hybrid allocator: the i-th layer of every
group with one page size shares slot i, since a block id belongs to one group
at a time.

A `KVCacheTensor` records the result for a run of layers: layer ``layers[l]``
finds block ``b`` at ``offset + l*layer_stride + b*block_stride``. Where H is
a placing axis that is where the block's first head begins; the other heads
follow at a fixed head stride, carved out of the stride of the axis that
encloses H (see `create_kv_cache_views`). Inside a slab a full-attention page
holds K then V, just outside the slab's own axes; an MLA page holds one latent
vector per token and no V; a state spec has no view and gets the raw buffer.

The extensible cache grows by committing a prefix of blocks, so it thinks in
*segments*: ranges of ``capacity_blocks * stride`` bytes whose first
``n * stride`` bytes hold blocks ``0..n-1``. B's stride is a segment's stride
and the placing axes outside B index the segments: one per layer region (LB),
one per layer and head (LHB), one in all (B first). Only the per-layer-region
kind may have segments of several strides and may be padded apart:
`pad_kv_cache_segments` starts each region on a granule so that a
defragmenting commit can back every segment with one physical chunk, and
`granule_block_alignment` is the smallest block count at which every segment
ends on a granule.

The value types (specs, `KVCacheTensor`, groups, config) live in
`extkv.layout_types` and are re-exported here.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import accumulate, pairwise

import torch

from . import validate
from .layout_types import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaStateSpec,
    MLAAttentionSpec,
)

__all__ = [
    "FullAttentionSpec",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheLayout",
    "KVCacheSpec",
    "KVCacheTensor",
    "MLAAttentionSpec",
    "MambaStateSpec",
    "build_kv_cache_config",
    "create_kv_cache_views",
    "granule_aligned_blocks",
    "granule_block_alignment",
    "kv_cache_segments",
    "layer_kernel_block_size",
    "layer_spec_for_tensor",
    "pad_kv_cache_segments",
    "round_up",
]


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of `multiple` that is >= n."""
    n = validate.integer("n", n)
    multiple = validate.integer("multiple", multiple, minimum=1)
    return -(-n // multiple) * multiple


def _check_layout(layout: object) -> KVCacheLayout:
    if not isinstance(layout, KVCacheLayout):
        raise ValueError(f"layout must be a KVCacheLayout, got {layout!r}")
    return layout


# --------------------------------------------------------------------------
# Layouts and their geometry


class KVCacheLayout(enum.Enum):
    """Order of the axes L, B, H, N, C in memory, outermost first."""

    LBHNC = "LBHNC"
    LBNHC = "LBNHC"
    LHBNC = "LHBNC"
    BLHNC = "BLHNC"
    BLNHC = "BLNHC"
    BHLNC = "BHLNC"

    @property
    def is_block_outermost(self) -> bool:
        return self.value[0] == "B"

    @property
    def is_layer_compact(self) -> bool:
        return self.value[0] == "L"

    @property
    def is_block_compact(self) -> bool:
        return set(self.value[:2]) == {"L", "B"}

    @property
    def heads_outside_page(self) -> bool:
        """Whether H is outer to B or L, so one layer's page of one block is
        split into per-head slabs spread through memory."""
        return _GEOMETRY[self].splits_heads

    @property
    def heads_outer_to_tokens(self) -> bool:
        return self.value.index("H") < self.value.index("N")


@dataclass(frozen=True)
class _Geometry:
    """One layout's axis order, split where one layer's slab begins.

    `placing` (outermost first) holds L, B and, when a layout spreads a page
    over heads, H; `slab` holds the rest, ending in C. The properties are the
    facts the builder, the view maker and the segment code read; none of them
    names a layout.
    """

    placing: str
    slab: str

    @property
    def order(self) -> str:
        return self.placing + self.slab

    @property
    def splits_heads(self) -> bool:
        return "H" in self.placing

    @property
    def outside_layer(self) -> str:
        """Placing axes whose stride spans every layer's slot (the row)."""
        return self.placing[: self.placing.index("L")]

    @property
    def inside_layer(self) -> str:
        """Placing axes inside one layer's stride, so per page class."""
        return self.placing[self.placing.index("L") + 1 :]

    @property
    def head_parent(self) -> str:
        """The placing axis whose stride the heads divide (only when
        `splits_heads`)."""
        return self.placing[self.placing.index("H") - 1]

    @property
    def segment_axes(self) -> str:
        """Placing axes outside B: one segment per combination of them."""
        return self.placing[: self.placing.index("B")]

    @property
    def segments_are_layer_regions(self) -> bool:
        # Only then may segments differ in stride and sit apart (padding).
        return self.segment_axes == "L"


_GEOMETRY: dict[KVCacheLayout, _Geometry] = {
    # KVCacheLayout(...) refuses a row whose order is no layout.
    KVCacheLayout(row.order): row
    for row in (
        _Geometry(placing="LB", slab="HNC"),
        _Geometry(placing="LB", slab="NHC"),
        _Geometry(placing="LHB", slab="NC"),
        _Geometry(placing="BL", slab="HNC"),
        _Geometry(placing="BL", slab="NHC"),
        _Geometry(placing="BHL", slab="NC"),
    )
}


def _layer_region_layouts(joiner: str) -> str:
    # Messages name the layouts that would have worked, read from the table
    # so that they cannot fall out of step with it.
    return f" {joiner} ".join(
        layout.name for layout, row in _GEOMETRY.items() if row.segments_are_layer_regions
    )


def _nest(axes: str, unit: int, extents: Mapping[str, int]) -> tuple[dict[str, int], int]:
    """Strides of `axes` (outermost first) nested around `unit` bytes, like
    the dimensions of a C array, and the bytes the outermost one spans."""
    strides: dict[str, int] = {}
    span = unit
    for axis in reversed(axes):
        strides[axis] = span
        span *= extents[axis]
    return strides, span


# --------------------------------------------------------------------------
# Building a config


@dataclass
class _PageClass:
    """Groups whose pages have one size; their i-th layers alias slot i."""

    page_size: int
    heads: int
    num_slots: int = 0
    group_ids: list[int] = field(default_factory=list)


def _page_classes(groups: Sequence[KVCacheGroupSpec]) -> list[_PageClass]:
    classes: dict[int, _PageClass] = {}
    for group_id, group in enumerate(groups):
        spec = group.kv_cache_spec
        cls = classes.setdefault(
            spec.page_size_bytes, _PageClass(spec.page_size_bytes, spec.num_page_heads)
        )
        cls.num_slots = max(cls.num_slots, len(group.layer_names))
        cls.group_ids.append(group_id)
    return list(classes.values())


def build_kv_cache_config(
    groups: Sequence[KVCacheGroupSpec],
    num_blocks: int,
    layout: KVCacheLayout,
) -> KVCacheConfig:
    """Lay out `num_blocks` blocks of every group in one allocation.

    Groups with the same page size alias (group g's i-th layer shares the
    region of every such group's i-th layer); other page sizes follow in order
    of first appearance. One `KVCacheTensor` per group. What the nesting rule
    of the module docstring gives, with P the page size, H the kv heads and
    n = `num_blocks`:

    ========  ==========================  =================  ==============
    layout    region / order              block_stride       layer_stride
    ========  ==========================  =================  ==============
    LBHNC     one region per layer        P                  n * P
    LBNHC     one region per layer        P                  n * P
    LHBNC     region per layer, H then B  P / H              n * P
    BLHNC     block = all layers' pages   sum of pages       P
    BLNHC     block = all layers' pages   sum of pages       P
    BHLNC     block = H rows of layers    sum of pages       P / H
    ========  ==========================  =================  ==============

    Under LHBNC head h of a layer starts ``n * P / H * h`` bytes into its
    region, so every (layer, head) slab is a segment of stride P / H and all
    layers must share P / H. Under BHLNC all layers must share H; head h of a
    block starts ``block_stride / H * h`` bytes into it.
    """
    geometry = _GEOMETRY[_check_layout(layout)]
    num_blocks = validate.integer("num_blocks", num_blocks, minimum=1)
    groups = list(groups)
    if not groups:
        raise ValueError("groups must hold at least one KVCacheGroupSpec, got none")
    owner: dict[str, int] = {}
    for group_id, group in enumerate(groups):
        if not isinstance(group, KVCacheGroupSpec):
            raise ValueError(
                f"groups[{group_id}] must be a KVCacheGroupSpec, got {group!r}"
            )
        for name in group.layer_names:
            if name in owner:
                raise ValueError(
                    f"layer {name!r} is in kv cache groups {owner[name]} and {group_id}"
                )
            owner[name] = group_id
    if geometry.splits_heads:
        _check_head_split(layout, geometry, [group.kv_cache_spec for group in groups])

    classes = _page_classes(groups)
    starts, strides, size = _place(geometry, classes, num_blocks)
    placement = {
        group_id: (start, axis_strides)
        for cls, start, axis_strides in zip(classes, starts, strides)
        for group_id in cls.group_ids
    }
    tensors: list[KVCacheTensor] = []
    for group_id, group in enumerate(groups):
        start, axis_strides = placement[group_id]
        tensor = KVCacheTensor(
            size=size,
            layers=list(group.layer_names),
            layer_stride=axis_strides["L"],
            block_stride=axis_strides["B"],
            offset=start,
        )
        _check_element_aligned(group_id, group.kv_cache_spec, tensor)
        tensors.append(tensor)
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups
    )


def _check_head_split(
    layout: KVCacheLayout, geometry: _Geometry, specs: list[KVCacheSpec]
) -> None:
    # A stride outside L spans every layer, so when H is one of those axes
    # every layer must have the same heads. When H sits inside L instead, B is
    # the innermost placing axis and its stride is the head slab; the layout's
    # segments tile the allocation at one stride, so every layer needs the
    # same slab. Either way a page must split into whole head slabs.
    pages = [spec.page_size_bytes for spec in specs]
    heads = [spec.num_page_heads for spec in specs]
    if "H" in geometry.outside_layer and len(set(heads)) != 1:
        raise ValueError(
            f"{layout.name} needs every layer to have the same kv heads, got "
            f"{sorted(set(heads))}"
        )
    uneven = any(page % count for page, count in zip(pages, heads))
    slabs = {page // count for page, count in zip(pages, heads)}
    if uneven or ("H" in geometry.inside_layer and len(slabs) != 1):
        raise ValueError(
            f"{layout.name} needs one per-head block stride (page / kv heads) for "
            f"every layer; got pages {pages} with kv heads {heads}"
        )


def _place(
    geometry: _Geometry, classes: list[_PageClass], num_blocks: int
) -> tuple[list[int], list[dict[str, int]], int]:
    """Where each page class starts, the stride of every placing axis for
    it, and the allocation's size.

    A class's start is a byte offset within the row that L spans: the whole
    allocation when L is outermost, one block (or one head of it) otherwise.
    """
    starts: list[int] = []
    strides: list[dict[str, int]] = []
    row = 0
    for cls in classes:
        slab = cls.page_size // cls.heads if geometry.splits_heads else cls.page_size
        axis_strides, layer_stride = _nest(
            geometry.inside_layer, slab, {"B": num_blocks, "H": cls.heads}
        )
        axis_strides["L"] = layer_stride
        starts.append(row)
        strides.append(axis_strides)
        row += cls.num_slots * layer_stride
    # _check_head_split made the heads one number wherever H is outside L.
    outer_strides, size = _nest(
        geometry.outside_layer, row, {"B": num_blocks, "H": classes[0].heads}
    )
    for axis_strides in strides:
        axis_strides.update(outer_strides)
    return starts, strides, size


def _check_element_aligned(group_id: int, spec: KVCacheSpec, tensor: KVCacheTensor) -> None:
    # Pages of another dtype placed before this group's can leave its layers
    # between elements; a typed view cannot start there.
    if not spec.has_layer_views:
        return
    itemsize = spec.dtype.itemsize
    placement = {
        "offset": tensor.offset,
        "layer_stride": tensor.layer_stride,
        "block_stride": tensor.block_stride,
    }
    for name, value in placement.items():
        if value % itemsize:
            raise ValueError(
                f"kv cache group {group_id} lands at {name} {value}, not a multiple "
                f"of its {itemsize}-byte {spec.dtype}; pages of the groups before "
                "it must be multiples of that size"
            )


# --------------------------------------------------------------------------
# Segments: what an extensible allocation grows


def _add_layer_regions(regions: dict[int, int], tensor: KVCacheTensor, attribute: str) -> None:
    """Record `tensor`'s `attribute` at the start of each of its layer
    regions; aliasing groups name a region twice and must agree on it."""
    value = getattr(tensor, attribute)
    for layer_idx in range(len(tensor.layers)):
        start = tensor.layer_offset(layer_idx)
        known = regions.setdefault(start, value)
        if known != value:
            raise ValueError(
                f"tensors alias offset {start} with {attribute.replace('_', ' ')}s "
                f"{known} and {value}"
            )


def kv_cache_segments(
    config: KVCacheConfig, layout: KVCacheLayout
) -> tuple[list[int], list[int]]:
    """Offsets and block strides of the segments covering `config`'s allocation.

    A segment holds `config.num_blocks` blocks at one stride; committing n
    blocks maps its first ``n * stride`` bytes. Block-compact layer-outermost
    layouts have one segment per distinct layer region (regions may sit apart
    after padding). Every other layout has one block stride, and the
    allocation is a whole number of equal segments laid end to end.
    """
    geometry = _GEOMETRY[_check_layout(layout)]
    tensors = config.kv_cache_tensors
    if not tensors:
        raise ValueError("config has no kv_cache_tensors")
    sizes = sorted({tensor.size for tensor in tensors})
    if len(sizes) > 1:
        raise ValueError(
            f"kv cache tensors must describe one allocation, got sizes {sizes}"
        )
    size = sizes[0]
    capacity = validate.integer("config.num_blocks", config.num_blocks, minimum=1)
    if geometry.segments_are_layer_regions:
        return _region_segments(tensors, size, capacity)

    # Segments of one stride, end to end: the placements say nothing else, so
    # the stride and the size alone decide them.
    block_strides = sorted({tensor.block_stride for tensor in tensors})
    if len(block_strides) > 1:
        raise ValueError(
            f"{layout.name} needs one block stride for every tensor, got "
            f"{block_strides}; only {_layer_region_layouts('and')} "
            "allow several"
        )
    stride = block_strides[0]
    count, leftover = divmod(size, capacity * stride)
    if count == 0 or leftover:
        raise ValueError(
            f"allocation of {size} bytes is not a whole number of "
            f"{capacity}-block segments of {capacity * stride} bytes"
        )
    return [i * capacity * stride for i in range(count)], [stride] * count


def _region_segments(
    tensors: list[KVCacheTensor], size: int, capacity: int
) -> tuple[list[int], list[int]]:
    # Each layer region is a segment at its own block stride. Padding may
    # leave gaps between regions; overlaps or running past the end may not.
    regions: dict[int, int] = {}
    for tensor in tensors:
        _add_layer_regions(regions, tensor, "block_stride")
    starts = sorted(regions)
    if starts[0]:
        raise ValueError(f"first layer region starts at {starts[0]}, not 0")
    for earlier, later in pairwise(starts):
        if later < earlier + capacity * regions[earlier]:
            raise ValueError(f"layer region at {later} overlaps the one before it")
    end = starts[-1] + capacity * regions[starts[-1]]
    if end > size:
        raise ValueError(f"layer regions end at {end}, past the allocation's {size}")
    return starts, [regions[start] for start in starts]


def pad_kv_cache_segments(
    config: KVCacheConfig, layout: KVCacheLayout, granule: int
) -> KVCacheConfig:
    """Start every layer region on a granule, so that a defragmenting commit
    of any block count can back each segment with one physical chunk.

    Only address space grows; commits map whole granules per segment anyway.
    Block-outermost layouts have one segment at offset 0 and come back as the
    same object. LHBNC has no per-layer segments to pad (ValueError). Padding a
    padded config changes nothing. Returns a shallow copy; `config` is untouched.
    """
    if not isinstance(config, KVCacheConfig):
        raise ValueError(f"config must be a KVCacheConfig, got {config!r}")
    geometry = _GEOMETRY[_check_layout(layout)]
    granule = validate.integer("granule", granule, minimum=1)
    if not geometry.segment_axes:
        return config
    if not geometry.segments_are_layer_regions:
        raise ValueError(
            f"{layout.name} has no per-layer segments to pad; padding needs "
            f"{_layer_region_layouts('or')}"
        )
    num_blocks = validate.integer("config.num_blocks", config.num_blocks, minimum=1)
    if not config.kv_cache_tensors:
        raise ValueError("config has no kv_cache_tensors")

    # A region's extent is its layer stride, which is at least its blocks and
    # more once padded; keying padding on the stride is what makes a second
    # call a no-op.
    extents: dict[int, int] = {}
    for tensor in config.kv_cache_tensors:
        if tensor.layer_stride < num_blocks * tensor.block_stride:
            raise ValueError(
                f"layer_stride {tensor.layer_stride} of layers {tensor.layers} is "
                f"smaller than {num_blocks} blocks of {tensor.block_stride} bytes"
            )
        _add_layer_regions(extents, tensor, "layer_stride")
    starts = sorted(extents)
    # Regions must tile from 0 with no gap, or moving them would change which
    # bytes a layer owns rather than only where they sit.
    for wanted, found in zip([0, *(start + extents[start] for start in starts)], starts):
        if found != wanted:
            raise ValueError(
                f"layer regions do not tile the allocation: expected one at "
                f"{wanted}, found {found}"
            )
    new_starts = list(
        accumulate((round_up(extents[start], granule) for start in starts), initial=0)
    )
    new_start_of = dict(zip(starts, new_starts))
    # Tensors that alias one region share its start, so they move together.
    return replace(
        config,
        kv_cache_tensors=[
            replace(
                tensor,
                offset=new_start_of[tensor.offset],
                size=new_starts[-1],
                layer_stride=round_up(tensor.layer_stride, granule),
            )
            for tensor in config.kv_cache_tensors
        ],
    )


def granule_block_alignment(strides: Sequence[int], granule: int) -> int:
    """Smallest block count at which every segment of `strides` ends on a
    granule: the lcm over strides s of ``granule / gcd(s, granule)``."""
    granule = validate.integer("granule", granule, minimum=1)
    strides = list(strides)
    if not strides:
        raise ValueError("strides must hold at least one segment stride, got none")
    alignment = 1
    for i, stride in enumerate(strides):
        stride = validate.integer(f"strides[{i}]", stride, minimum=1)
        alignment = math.lcm(alignment, granule // math.gcd(stride, granule))
    return alignment


def granule_aligned_blocks(num_blocks: int, strides: Sequence[int], granule: int) -> int:
    """`num_blocks` rounded down to a multiple of `granule_block_alignment`:
    the most blocks whose segments all end on a granule (no partly used
    granule at any segment's end)."""
    num_blocks = validate.integer("num_blocks", num_blocks)
    alignment = granule_block_alignment(strides, granule)
    return num_blocks - num_blocks % alignment


# --------------------------------------------------------------------------
# Finding a layer's group


def layer_spec_for_tensor(
    config: KVCacheConfig, tensor: KVCacheTensor
) -> tuple[int, KVCacheSpec]:
    """Group index and spec of the layers `tensor` places."""
    for group_id, group in enumerate(config.kv_cache_groups):
        names = set(group.layer_names)
        if tensor.layers[0] in names:
            strangers = [name for name in tensor.layers if name not in names]
            if strangers:
                raise ValueError(
                    f"tensor mixes kv cache groups: {tensor.layers[0]!r} is in "
                    f"group {group_id} but {strangers} are not"
                )
            return group_id, group.kv_cache_spec
    raise ValueError(f"layer {tensor.layers[0]!r} is in no kv cache group")


def layer_kernel_block_size(
    group_id: int, kernel_block_sizes: Sequence[int] | None
) -> int | None:
    """Kernel block size the attention backend uses for a group, or None when
    the runner gave none (kernel blocks are then the cache's blocks)."""
    group_id = validate.integer("group_id", group_id)
    if kernel_block_sizes is None:
        return None
    if group_id >= len(kernel_block_sizes):
        raise ValueError(
            f"group_id {group_id} has no kernel block size; kernel_block_sizes "
            f"has {len(kernel_block_sizes)} entries"
        )
    return kernel_block_sizes[group_id]


# --------------------------------------------------------------------------
# Views

# The logical axes of each spec's view, in the order the view's dimensions
# come: B (kernel blocks), K (K then V), N, H, C. A spec type missing here has
# no view geometry.
_VIEW_AXES: tuple[tuple[type[KVCacheSpec], str], ...] = (
    (FullAttentionSpec, "BKNHC"),
    (MLAAttentionSpec, "BNC"),
)


def _head_stride(
    geometry: _Geometry, tensor: KVCacheTensor, num_blocks: int, heads: int, slab: int
) -> int:
    """Bytes between one layer's per-head slabs: a 1/heads share of the
    stride of the axis enclosing H, which must hold what H encloses."""
    if geometry.head_parent == "L":
        # A layer region is `heads` runs of blocks, one run per head.
        if tensor.layer_stride % heads:
            raise ValueError(
                f"layer_stride {tensor.layer_stride} is not a whole number of "
                f"{heads} head slabs"
            )
        head_stride = tensor.layer_stride // heads
        if head_stride < num_blocks * tensor.block_stride:
            raise ValueError(
                f"head slab of {head_stride} bytes cannot hold {num_blocks} "
                f"blocks of {tensor.block_stride} bytes"
            )
        return head_stride
    # A block is `heads` rows, each holding every layer's slab for that head.
    if tensor.block_stride % heads:
        raise ValueError(
            f"block_stride {tensor.block_stride} is not a whole number of "
            f"{heads} head rows"
        )
    head_stride = tensor.block_stride // heads
    if head_stride < slab:
        raise ValueError(
            f"head row of {head_stride} bytes cannot hold a {slab}-byte slab"
        )
    return head_stride


def create_kv_cache_views(
    buffer: torch.Tensor,
    spec: KVCacheSpec,
    num_blocks: int,
    layout: KVCacheLayout,
    tensor: KVCacheTensor,
    kernel_block_size: int | None = None,
) -> list[torch.Tensor]:
    """One strided view per layer of `tensor` over the uint8 `buffer`.

    `buffer` is the allocation, or the part of it that `tensor`'s offsets are
    relative to (one segment). Views alias it: nothing is copied.

    Shapes (logical order, whatever the layout):

    * full attention: ``(blocks, 2, kernel_block_size, num_kv_heads, head_size)``
      where dim 1 is K then V;
    * MLA: ``(blocks, kernel_block_size, head_size)``;

    with ``blocks = num_blocks * block_size // kernel_block_size``. A kernel
    block size k that divides the block size reads each layer's per-block slab
    as ``block_size / k`` consecutive kernel slabs, each laid out like a page
    of k tokens - as attention kernels with smaller blocks expect. That needs
    one layer's blocks to be contiguous (block_stride equal to the slab: LBHNC,
    LBNHC, LHBNC, or one layer alone), since the kernel block index must have
    one stride.

    A spec without layer views (state layers) gets `buffer` itself for each
    layer: it lays itself out over the raw bytes.
    """
    if not isinstance(buffer, torch.Tensor):
        raise ValueError(f"buffer must be a torch.Tensor, got {type(buffer).__name__}")
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError(
            f"buffer must be a contiguous 1-D uint8 tensor, got dtype {buffer.dtype}, "
            f"shape {tuple(buffer.shape)}"
        )
    if not isinstance(spec, KVCacheSpec):
        raise ValueError(f"spec must be a KVCacheSpec, got {spec!r}")
    geometry = _GEOMETRY[_check_layout(layout)]
    if not isinstance(tensor, KVCacheTensor):
        raise ValueError(f"tensor must be a KVCacheTensor, got {tensor!r}")
    num_blocks = validate.integer("num_blocks", num_blocks, minimum=1)
    if not spec.has_layer_views:
        return [buffer for _ in tensor.layers]

    block_size = spec.block_size
    if kernel_block_size is None:
        kernel_block_size = block_size
    kernel_block_size = validate.integer("kernel_block_size", kernel_block_size, minimum=1)
    if block_size % kernel_block_size:
        raise ValueError(
            f"kernel_block_size {kernel_block_size} does not divide the block "
            f"size {block_size}"
        )
    splits = block_size // kernel_block_size
    itemsize = spec.dtype.itemsize
    heads = spec.num_page_heads
    if geometry.splits_heads:
        slab = spec.page_size_bytes // heads
        head_stride = _head_stride(geometry, tensor, num_blocks, heads, slab)
    else:
        slab, head_stride = spec.page_size_bytes, 0
    if tensor.block_stride < slab:
        raise ValueError(
            f"block_stride {tensor.block_stride} is smaller than the {slab}-byte "
            "slab one layer keeps per block"
        )
    if splits > 1 and tensor.block_stride != slab:
        raise ValueError(
            f"kernel_block_size {kernel_block_size} splits blocks, which needs one "
            f"layer's blocks to be contiguous; {layout.name} puts them "
            f"{tensor.block_stride} bytes apart for {slab}-byte slabs"
        )
    byte_values = {
        "offset": tensor.offset,
        "layer_stride": tensor.layer_stride,
        "block_stride": tensor.block_stride,
        "head stride": head_stride,
        "kernel slab": slab // splits,
    }
    for name, value in byte_values.items():
        if value % itemsize:
            raise ValueError(
                f"{name} of {value} bytes is not a multiple of the "
                f"{itemsize}-byte {spec.dtype}"
            )

    view_axes = next(
        (axes for kind, axes in _VIEW_AXES if isinstance(spec, kind)), None
    )
    if view_axes is None:
        raise ValueError(f"no view geometry for spec type {type(spec).__name__}")
    # From here on, strides are in elements of spec.dtype. Within a slab the
    # K/V axis sits outside the axes the layout orders; axes the view lacks
    # (H of an MLA page) have extent 1 and drop out.
    extents = {"K": 2, "N": kernel_block_size, "H": heads, "C": spec.head_size}
    in_slab = "".join(axis for axis in "K" + geometry.slab if axis in view_axes)
    strides, _ = _nest(in_slab, 1, extents)
    if geometry.splits_heads:
        strides["H"] = head_stride // itemsize
    # A split block's kernel blocks are consecutive pieces of one slab.
    strides["B"] = (tensor.block_stride if splits == 1 else slab // splits) // itemsize
    extents["B"] = num_blocks * splits
    shape = [extents[axis] for axis in view_axes]
    element_strides = [strides[axis] for axis in view_axes]

    # Reinterpret the whole buffer as dtype; as_strided offsets are absolute
    # within the storage, so start from wherever `buffer` itself starts.
    usable = buffer.numel() - buffer.numel() % itemsize
    if buffer.storage_offset() % itemsize:
        raise ValueError(
            f"buffer starts {buffer.storage_offset()} bytes into its storage, not "
            f"on a {itemsize}-byte {spec.dtype} boundary"
        )
    typed = buffer[:usable].view(spec.dtype)
    extent = 1 + sum((n - 1) * s for n, s in zip(shape, element_strides))
    views = []
    for layer_idx, name in enumerate(tensor.layers):
        start = tensor.layer_offset(layer_idx) // itemsize
        if (start + extent) * itemsize > buffer.numel():
            raise ValueError(
                f"layer {name!r} spans bytes [{start * itemsize}, "
                f"{(start + extent) * itemsize}) but the buffer holds "
                f"{buffer.numel()}"
            )
        views.append(
            typed.as_strided(shape, element_strides, typed.storage_offset() + start)
        )
    return views
