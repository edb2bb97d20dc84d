"""Where every byte of a paged KV cache lives.

Theory of operation
-------------------

A paged KV cache is one big allocation cut into *pages*: the bytes one layer
keeps for one block of ``block_size`` tokens. Five logical axes address a byte:

    L  layer           B  block           H  kv head
    N  token in block  C  bytes of one head's vector (head_size * itemsize)

A `KVCacheLayout` names the order of those axes in memory, outermost first.
Two questions about that order decide everything the extensible cache does:

* Which comes first, L or B?  Layer-outermost layouts (``L...``) give every
  layer a region of its own; block-outermost layouts (``B...``) put all layers
  of one block next to each other.
* Are L and B the two outermost axes ("block compact")?  Then one layer's
  blocks - or one block's layers - are contiguous runs, and committing the
  first n blocks means mapping a *prefix* of a few large ranges.

The extensible cache grows by committing a prefix of blocks, so it thinks in
*segments*: address ranges of ``capacity_blocks * stride`` bytes whose first
``n * stride`` bytes hold blocks ``0..n-1``. Each layout yields segments:

    LBHNC, LBNHC  one segment per layer region; stride = the layer's page
    LHBNC         one segment per (layer, kv head); stride = page / heads
    BLHNC, BLNHC  one segment; stride = all layers' pages of one block
    BHLNC         one segment; stride = all layers' pages of one block

A `KVCacheTensor` describes a run of layers sharing one geometry: layer
``layers[l]`` finds block ``b`` at byte ``offset + l*layer_stride +
b*block_stride`` of the allocation. For the head-outer layouts (LHBNC, BHLNC)
that is where the block's *first head* begins; the other heads follow at a
fixed head stride (see `create_kv_cache_views`).

Inside one layer's page of one block, a full-attention page holds K then V
(the K/V axis sits just outside the H/N/C axes the layout orders); an MLA page
holds one latent vector per token and no V. A state spec (Mamba and friends)
has no per-layer view: such a layer gets the raw buffer and lays itself out.

Cache groups alias, as in vLLM's hybrid allocator: the i-th layer of every
group with the same page size shares one region, because a block id belongs to
one group at a time. Layers with different page sizes get regions of their own.

`pad_kv_cache_segments` moves each layer region of a block-compact
layer-outermost config to a granule boundary, so a defragmenting commit can back
every segment with exactly one physical chunk; `granule_block_alignment` is the
smallest block count at which every segment ends on a granule.
"""

from __future__ import annotations

import copy
import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from . import validate

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


# --------------------------------------------------------------------------
# Argument checks. Every message names the argument, the value and what was
# wanted (extkv.validate): "block_size must be an int >= 1, got 0" beats a bare assert.


def _check_positive(name: str, value: object) -> int:
    return validate.integer(name, value, minimum=1)


def _check_non_negative(name: str, value: object) -> int:
    return validate.integer(name, value)


def _check_dtype(value: object) -> torch.dtype:
    if not isinstance(value, torch.dtype):
        raise ValueError(f"dtype must be a torch.dtype, got {value!r}")
    return value


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of `multiple` that is >= n."""
    n = _check_non_negative("n", n)
    multiple = _check_positive("multiple", multiple)
    return -(-n // multiple) * multiple


# --------------------------------------------------------------------------
# Layouts


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
        order = self.value
        return order.index("H") < max(order.index("L"), order.index("B"))

    @property
    def heads_outer_to_tokens(self) -> bool:
        return self.value.index("H") < self.value.index("N")


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
        object.__setattr__(self, "block_size", _check_positive("block_size", self.block_size))
        object.__setattr__(self, "num_kv_heads", _check_positive("num_kv_heads", self.num_kv_heads))
        object.__setattr__(self, "head_size", _check_positive("head_size", self.head_size))
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
        object.__setattr__(self, "block_size", _check_positive("block_size", self.block_size))
        object.__setattr__(self, "head_size", _check_positive("head_size", self.head_size))
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
        object.__setattr__(self, "block_size", _check_positive("block_size", self.block_size))
        _check_dtype(self.dtype)
        if not isinstance(self.shapes, (tuple, list)) or not self.shapes:
            raise ValueError(
                f"shapes must be a non-empty sequence of shapes, got {self.shapes!r}"
            )
        shapes = []
        for i, shape in enumerate(self.shapes):
            if not isinstance(shape, (tuple, list)):
                raise ValueError(f"shapes[{i}] must be a tuple of ints, got {shape!r}")
            shapes.append(tuple(_check_positive(f"shapes[{i}][{j}]", dim) for j, dim in enumerate(shape)))
        # Lists would make the frozen spec unhashable.
        object.__setattr__(self, "shapes", tuple(shapes))
        if self.page_size_padded is not None:
            object.__setattr__(self, "page_size_padded", _check_positive("page_size_padded", self.page_size_padded))
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
        object.__setattr__(self, "size", _check_non_negative("size", self.size))
        object.__setattr__(self, "layer_stride", _check_non_negative("layer_stride", self.layer_stride))
        object.__setattr__(self, "block_stride", _check_positive("block_stride", self.block_stride))
        object.__setattr__(self, "offset", _check_non_negative("offset", self.offset))
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
        object.__setattr__(self, "num_blocks", _check_non_negative("num_blocks", self.num_blocks))


# --------------------------------------------------------------------------
# Building a config


@dataclass
class _PageClass:
    """Groups whose pages have one size; their i-th layers alias slot i."""

    page_size: int
    num_slots: int = 0
    group_ids: list[int] = field(default_factory=list)


def _page_classes(groups: Sequence[KVCacheGroupSpec]) -> list[_PageClass]:
    classes: dict[int, _PageClass] = {}
    for group_id, group in enumerate(groups):
        page = group.kv_cache_spec.page_size_bytes
        cls = classes.setdefault(page, _PageClass(page))
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
    of first appearance. One `KVCacheTensor` per group. Geometry per layout,
    with P the page size, H the kv heads and n = `num_blocks`:

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
    if not isinstance(layout, KVCacheLayout):
        raise ValueError(f"layout must be a KVCacheLayout, got {layout!r}")
    num_blocks = _check_positive("num_blocks", num_blocks)
    groups = list(groups)
    if not groups:
        raise ValueError("groups must hold at least one KVCacheGroupSpec, got none")
    seen: dict[str, int] = {}
    for group_id, group in enumerate(groups):
        if not isinstance(group, KVCacheGroupSpec):
            raise ValueError(
                f"groups[{group_id}] must be a KVCacheGroupSpec, got {group!r}"
            )
        for name in group.layer_names:
            if name in seen:
                raise ValueError(
                    f"layer {name!r} is in kv cache groups {seen[name]} and {group_id}"
                )
            seen[name] = group_id

    classes = _page_classes(groups)
    specs = [group.kv_cache_spec for group in groups]
    # Head-outer layouts spread a page over per-head slabs; aliasing layers
    # (and, for the shared segment stride, all layers) must agree on them.
    heads = {spec.num_page_heads for spec in specs}
    if layout is KVCacheLayout.LHBNC:
        uneven = any(spec.page_size_bytes % spec.num_page_heads for spec in specs)
        slabs = {spec.page_size_bytes // spec.num_page_heads for spec in specs}
        if uneven or len(slabs) != 1:
            raise ValueError(
                "LHBNC needs one per-head block stride (page / kv heads) for every "
                f"layer; got pages {[s.page_size_bytes for s in specs]} with kv "
                f"heads {[s.num_page_heads for s in specs]}"
            )
    if layout is KVCacheLayout.BHLNC and len(heads) != 1:
        raise ValueError(
            f"BHLNC needs every layer to have the same kv heads, got {sorted(heads)}"
        )

    # Where each page class starts: a byte offset into the allocation for
    # layer-outermost layouts, into one block (or one head row) otherwise.
    starts: list[int] = []
    if layout.is_layer_compact:
        end = 0
        for cls in classes:
            starts.append(end)
            end += cls.num_slots * num_blocks * cls.page_size
        size = end
    else:
        num_heads = heads.pop() if layout is KVCacheLayout.BHLNC else 1
        row = 0
        for cls in classes:
            starts.append(row)
            # Exact: a full-attention page is a whole number of head slabs.
            row += cls.num_slots * cls.page_size // num_heads
        block_stride = row * num_heads
        size = num_blocks * block_stride

    tensors: list[KVCacheTensor] = []
    class_of_group = {
        group_id: (cls, start)
        for cls, start in zip(classes, starts)
        for group_id in cls.group_ids
    }
    for group_id, group in enumerate(groups):
        cls, start = class_of_group[group_id]
        page = cls.page_size
        num_heads = group.kv_cache_spec.num_page_heads
        if layout in (KVCacheLayout.LBHNC, KVCacheLayout.LBNHC):
            strides = dict(layer_stride=num_blocks * page, block_stride=page)
        elif layout is KVCacheLayout.LHBNC:
            strides = dict(
                layer_stride=num_blocks * page, block_stride=page // num_heads
            )
        elif layout is KVCacheLayout.BHLNC:
            strides = dict(layer_stride=page // num_heads, block_stride=block_stride)
        else:
            strides = dict(layer_stride=page, block_stride=block_stride)
        tensor = KVCacheTensor(
            size=size, layers=list(group.layer_names), offset=start, **strides
        )
        _check_element_aligned(group_id, group.kv_cache_spec, tensor)
        tensors.append(tensor)
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups
    )


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
    if not isinstance(layout, KVCacheLayout):
        raise ValueError(f"layout must be a KVCacheLayout, got {layout!r}")
    tensors = config.kv_cache_tensors
    if not tensors:
        raise ValueError("config has no kv_cache_tensors")
    sizes = {tensor.size for tensor in tensors}
    if len(sizes) != 1:
        raise ValueError(
            f"kv cache tensors must describe one allocation, got sizes {sorted(sizes)}"
        )
    size = sizes.pop()
    capacity = _check_positive("config.num_blocks", config.num_blocks)

    if layout.is_block_outermost or not layout.is_block_compact:
        strides = {tensor.block_stride for tensor in tensors}
        if len(strides) != 1:
            raise ValueError(
                f"{layout.name} needs one block stride for every tensor, got "
                f"{sorted(strides)}; only LBHNC and LBNHC allow several"
            )
        stride = strides.pop()
        segment_bytes = capacity * stride
        if size == 0 or size % segment_bytes:
            raise ValueError(
                f"allocation of {size} bytes is not a whole number of "
                f"{capacity}-block segments of {segment_bytes} bytes"
            )
        count = size // segment_bytes
        return [i * segment_bytes for i in range(count)], [stride] * count

    regions: dict[int, int] = {}
    for tensor in tensors:
        for layer_idx in range(len(tensor.layers)):
            offset = tensor.layer_offset(layer_idx)
            if regions.setdefault(offset, tensor.block_stride) != tensor.block_stride:
                raise ValueError(
                    f"tensors alias offset {offset} with block strides "
                    f"{regions[offset]} and {tensor.block_stride}"
                )
    offsets = sorted(regions)
    strides_list = [regions[offset] for offset in offsets]
    if offsets[0] != 0:
        raise ValueError(f"first layer region starts at {offsets[0]}, not 0")
    end = 0
    for offset, stride in zip(offsets, strides_list):
        if offset < end:
            raise ValueError(f"layer region at {offset} overlaps the one before it")
        end = offset + capacity * stride
    if end > size:
        raise ValueError(f"layer regions end at {end}, past the allocation's {size}")
    return offsets, strides_list


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
    if not isinstance(layout, KVCacheLayout):
        raise ValueError(f"layout must be a KVCacheLayout, got {layout!r}")
    granule = _check_positive("granule", granule)
    if layout.is_block_outermost:
        return config
    if not layout.is_block_compact:
        raise ValueError(
            f"{layout.name} has no per-layer segments to pad; padding needs "
            "LBHNC or LBNHC"
        )
    num_blocks = _check_positive("config.num_blocks", config.num_blocks)
    tensors = config.kv_cache_tensors
    if not tensors:
        raise ValueError("config has no kv_cache_tensors")

    # A region's extent is its layer stride: num_blocks pages, plus any
    # padding an earlier call added. Aliasing groups name the same region.
    regions: dict[int, int] = {}
    for tensor in tensors:
        if tensor.layer_stride < num_blocks * tensor.block_stride:
            raise ValueError(
                f"layer_stride {tensor.layer_stride} of layers {tensor.layers} is "
                f"smaller than {num_blocks} blocks of {tensor.block_stride} bytes"
            )
        for layer_idx in range(len(tensor.layers)):
            offset = tensor.layer_offset(layer_idx)
            if regions.setdefault(offset, tensor.layer_stride) != tensor.layer_stride:
                raise ValueError(
                    f"tensors alias offset {offset} with layer strides "
                    f"{regions[offset]} and {tensor.layer_stride}"
                )
    padded_offsets: dict[int, int] = {}
    end = padded_end = 0
    for offset in sorted(regions):
        if offset != end:
            raise ValueError(
                f"layer regions do not tile the allocation: expected one at "
                f"{end}, found {offset}"
            )
        padded_offsets[offset] = padded_end
        end += regions[offset]
        padded_end += round_up(regions[offset], granule)

    padded = copy.copy(config)
    padded.kv_cache_tensors = [
        replace(
            tensor,
            size=padded_end,
            offset=padded_offsets[tensor.offset],
            layer_stride=round_up(tensor.layer_stride, granule),
        )
        for tensor in tensors
    ]
    return padded


def granule_block_alignment(strides: Sequence[int], granule: int) -> int:
    """Smallest block count at which every segment of `strides` ends on a
    granule: the lcm over strides s of ``granule / gcd(s, granule)``."""
    granule = _check_positive("granule", granule)
    strides = list(strides)
    if not strides:
        raise ValueError("strides must hold at least one segment stride, got none")
    alignment = 1
    for i, stride in enumerate(strides):
        stride = _check_positive(f"strides[{i}]", stride)
        alignment = math.lcm(alignment, granule // math.gcd(stride, granule))
    return alignment


def granule_aligned_blocks(num_blocks: int, strides: Sequence[int], granule: int) -> int:
    """`num_blocks` rounded down to a multiple of `granule_block_alignment`:
    the most blocks whose segments all end on a granule (no partly used
    granule at any segment's end)."""
    num_blocks = _check_non_negative("num_blocks", num_blocks)
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
    group_id = _check_non_negative("group_id", group_id)
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
    if not isinstance(layout, KVCacheLayout):
        raise ValueError(f"layout must be a KVCacheLayout, got {layout!r}")
    if not isinstance(tensor, KVCacheTensor):
        raise ValueError(f"tensor must be a KVCacheTensor, got {tensor!r}")
    num_blocks = _check_positive("num_blocks", num_blocks)
    if not spec.has_layer_views:
        return [buffer for _ in tensor.layers]

    block_size = spec.block_size
    if kernel_block_size is None:
        kernel_block_size = block_size
    kernel_block_size = _check_positive("kernel_block_size", kernel_block_size)
    if block_size % kernel_block_size:
        raise ValueError(
            f"kernel_block_size {kernel_block_size} does not divide the block "
            f"size {block_size}"
        )
    splits = block_size // kernel_block_size
    itemsize = spec.dtype.itemsize
    page = spec.page_size_bytes
    heads = spec.num_page_heads

    # slab: the contiguous bytes one layer keeps per block (the page, or one
    # head's share of it); head_stride: distance between those slabs when
    # the layout puts H outside the page.
    if layout.heads_outside_page:
        slab = page // heads
        if layout.is_layer_compact:
            # LHBNC: a layer region is H slabs of blocks, one after another.
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
        else:
            # BHLNC: a block is H rows, each holding every layer's slab.
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
    else:
        slab = page
        head_stride = 0
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

    # Everything below is in elements of spec.dtype.
    block = tensor.block_stride // itemsize if splits == 1 else slab // splits // itemsize
    vec = spec.head_size
    tokens = kernel_block_size
    if isinstance(spec, MLAAttentionSpec):
        shape = [num_blocks * splits, tokens, vec]
        strides = [block, vec, 1]
    elif isinstance(spec, FullAttentionSpec):
        if layout.heads_outside_page:
            kv, token, head = tokens * vec, vec, head_stride // itemsize
        elif layout.heads_outer_to_tokens:
            kv, head, token = heads * tokens * vec, tokens * vec, vec
        else:
            kv, token, head = tokens * heads * vec, heads * vec, vec
        shape = [num_blocks * splits, 2, tokens, heads, vec]
        strides = [block, kv, token, head, 1]
    else:
        raise ValueError(f"no view geometry for spec type {type(spec).__name__}")

    # Reinterpret the whole buffer as dtype; as_strided offsets are absolute
    # within the storage, so start from wherever `buffer` itself starts.
    usable = buffer.numel() - buffer.numel() % itemsize
    if buffer.storage_offset() % itemsize:
        raise ValueError(
            f"buffer starts {buffer.storage_offset()} bytes into its storage, not "
            f"on a {itemsize}-byte {spec.dtype} boundary"
        )
    typed = buffer[:usable].view(spec.dtype)
    extent = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
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
            typed.as_strided(shape, strides, typed.storage_offset() + start)
        )
    return views
