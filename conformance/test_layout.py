"""KV cache layouts, placements, views and padding: pure, no device.

Addresses are checked against formulas written out per layout below, not
against the implementation's own stride arithmetic.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extkv.layout import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheLayout,
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

L = KVCacheLayout
KiB, MiB = 1 << 10, 1 << 20
ALL_LAYOUTS = list(KVCacheLayout)
HEAD_OUTER = {L.LHBNC, L.BHLNC}

# 2 * 4 tokens * 2 heads * 4 dims * 4 bytes = 256-byte pages.
FULL = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=4, dtype=torch.int32)
# 4 tokens * 8 dims * 4 bytes = 128-byte pages.
MLA = MLAAttentionSpec(block_size=4, head_size=8, dtype=torch.int32)


def names(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def alloc_size(config: KVCacheConfig) -> int:
    (size,) = {t.size for t in config.kv_cache_tensors}
    return size


def all_views(config, layout, buffer, kernel_block_sizes=None):
    views = {}
    for tensor in config.kv_cache_tensors:
        group_id, spec = layer_spec_for_tensor(config, tensor)
        kernel = layer_kernel_block_size(group_id, kernel_block_sizes)
        made = create_kv_cache_views(
            buffer, spec, config.num_blocks, layout, tensor, kernel_block_size=kernel
        )
        views.update(zip(tensor.layers, made))
    return views


# --------------------------------------------------------------------------
# Layout enum


@pytest.mark.invariant(1)
@pytest.mark.parametrize(
    "layout, block_outermost, layer_compact, block_compact, heads_outside, heads_before_tokens",
    [
        (L.LBHNC, False, True, True, False, True),
        (L.LBNHC, False, True, True, False, False),
        (L.LHBNC, False, True, False, True, True),
        (L.BLHNC, True, False, True, False, True),
        (L.BLNHC, True, False, True, False, False),
        (L.BHLNC, True, False, False, True, True),
    ],
)
def test_layout_properties(
    layout, block_outermost, layer_compact, block_compact, heads_outside, heads_before_tokens
):
    assert layout.is_block_outermost is block_outermost
    assert layout.is_layer_compact is layer_compact
    assert layout.is_block_compact is block_compact
    assert layout.heads_outside_page is heads_outside
    assert layout.heads_outer_to_tokens is heads_before_tokens
    assert KVCacheLayout(layout.name) is layout


@pytest.mark.invariant(1)
def test_layout_members_are_exactly_the_six():
    assert [m.name for m in KVCacheLayout] == [
        "LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"
    ]


# --------------------------------------------------------------------------
# Specs


@pytest.mark.invariant(1)
@pytest.mark.parametrize(
    "spec, page",
    [
        # 2 (K,V) * 16 tokens * 8 heads * 128 dims * 2 bytes
        (FullAttentionSpec(16, 8, 128, torch.bfloat16), 2 * 16 * 8 * 128 * 2),
        (FullAttentionSpec(block_size=1, num_kv_heads=1, head_size=1, dtype=torch.uint8), 2),
        # fp8: one byte per element
        (FullAttentionSpec(16, 1, 64, torch.float8_e4m3fn), 2 * 16 * 64),
        (FullAttentionSpec(4, 2, 4, torch.float32), 256),
        # MLA: 64 tokens * 576 latent dims * 2 bytes, no V
        (MLAAttentionSpec(block_size=64, head_size=576, dtype=torch.bfloat16), 64 * 576 * 2),
        # state: (4*8 + 16) elements * 2 bytes
        (MambaStateSpec(block_size=4, shapes=((4, 8), (16,)), dtype=torch.float16), 96),
        (
            MambaStateSpec(
                block_size=4, shapes=[(4, 8)], dtype=torch.float16, page_size_padded=256
            ),
            256,
        ),
    ],
)
def test_page_size_bytes(spec, page):
    assert spec.page_size_bytes == page


@pytest.mark.invariant(1)
def test_has_layer_views():
    assert FULL.has_layer_views is True
    assert MLA.has_layer_views is True
    assert MambaStateSpec(4, ((2,),), torch.float32).has_layer_views is False


@pytest.mark.invariant(6)
def test_specs_are_frozen_and_hashable():
    with pytest.raises(AttributeError):
        FULL.block_size = 8  # type: ignore[misc]
    state = MambaStateSpec(4, [[2, 3]], torch.float32)
    assert state.shapes == ((2, 3),)
    assert hash(state) == hash(MambaStateSpec(4, ((2, 3),), torch.float32))
    assert FULL == FullAttentionSpec(4, 2, 4, torch.int32)


@pytest.mark.invariant(6)
@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: FullAttentionSpec(0, 1, 1, torch.float16), "block_size must be an int >= 1, got 0"),
        (lambda: FullAttentionSpec(-16, 1, 1, torch.float16), "block_size .* got -16"),
        (lambda: FullAttentionSpec(16.0, 1, 1, torch.float16), "block_size must be an int >= 1, got 16.0"),
        (lambda: FullAttentionSpec(True, 1, 1, torch.float16), "block_size must be an int >= 1, got True"),
        (lambda: FullAttentionSpec(16, 0, 1, torch.float16), "num_kv_heads must be an int >= 1, got 0"),
        (lambda: FullAttentionSpec(16, 1, -2, torch.float16), "head_size must be an int >= 1, got -2"),
        (lambda: FullAttentionSpec(16, 1, 1, "float16"), "dtype must be a torch.dtype, got 'float16'"),
        (lambda: FullAttentionSpec(16, 1, 1, None), "dtype must be a torch.dtype, got None"),
        (lambda: MLAAttentionSpec(16, 0, torch.float16), "head_size must be an int >= 1, got 0"),
        (lambda: MLAAttentionSpec("16", 4, torch.float16), "block_size must be an int >= 1, got '16'"),
        (lambda: MLAAttentionSpec(16, 4, float), "dtype must be a torch.dtype"),
        (lambda: MambaStateSpec(4, (), torch.float16), "shapes must be a non-empty"),
        (lambda: MambaStateSpec(4, ((2, 0),), torch.float16), r"shapes\[0\]\[1\] must be an int >= 1, got 0"),
        (lambda: MambaStateSpec(4, (5,), torch.float16), r"shapes\[0\] must be a tuple of ints, got 5"),
        (lambda: MambaStateSpec(4, ((8,),), torch.float16, page_size_padded=8), "page_size_padded must be >= the state size 16, got 8"),
        (lambda: MambaStateSpec(4, ((8,),), torch.float16, page_size_padded=0), "page_size_padded must be an int >= 1, got 0"),
    ],
)
def test_invalid_specs_raise(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.invariant(6)
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(size=-1, layers=["a"], layer_stride=0, block_stride=1), "size must be an int >= 0, got -1"),
        (dict(size=8, layers=["a"], layer_stride=-4, block_stride=1), "layer_stride must be an int >= 0, got -4"),
        (dict(size=8, layers=["a"], layer_stride=0, block_stride=0), "block_stride must be an int >= 1, got 0"),
        (dict(size=8, layers=["a"], layer_stride=0, block_stride=1, offset=-1), "offset must be an int >= 0, got -1"),
        (dict(size=8, layers=[], layer_stride=0, block_stride=1), r"layers must name at least one layer"),
        (dict(size=8, layers="abc", layer_stride=0, block_stride=1), "layers must be a list of layer names, got 'abc'"),
        (dict(size=8, layers=["a", 3], layer_stride=0, block_stride=1), "layer names must be str, got 3"),
    ],
)
def test_invalid_kv_cache_tensor_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KVCacheTensor(**kwargs)


@pytest.mark.invariant(6)
def test_invalid_group_and_config_raise():
    with pytest.raises(ValueError, match="layer_names must name at least one layer"):
        KVCacheGroupSpec(layer_names=[], kv_cache_spec=FULL)
    with pytest.raises(ValueError, match=r"layer_names repeat a name: \['a', 'a'\]"):
        KVCacheGroupSpec(layer_names=["a", "a"], kv_cache_spec=FULL)
    with pytest.raises(ValueError, match="layer_names must be a list of layer names, got 'a'"):
        KVCacheGroupSpec(layer_names="a", kv_cache_spec=FULL)
    with pytest.raises(ValueError, match="kv_cache_spec must be a KVCacheSpec, got 3"):
        KVCacheGroupSpec(layer_names=["a"], kv_cache_spec=3)
    with pytest.raises(ValueError, match="num_blocks must be an int >= 0, got -1"):
        KVCacheConfig(num_blocks=-1, kv_cache_tensors=[], kv_cache_groups=[])


@pytest.mark.invariant(1)
def test_config_is_mutable_and_tensor_replaceable():
    config = build_kv_cache_config([KVCacheGroupSpec(["a"], FULL)], 4, L.LBHNC)
    config.num_blocks = 2
    assert config.num_blocks == 2
    tensor = replace(config.kv_cache_tensors[0], size=7, layers=["a"])
    assert (tensor.size, tensor.block_stride) == (7, 256)


@pytest.mark.invariant(3, 6)
def test_round_up():
    assert round_up(0, 4) == 0
    assert round_up(1, 4) == 4
    assert round_up(8, 4) == 8
    assert round_up(3 * MiB + 1, 2 * MiB) == 4 * MiB
    with pytest.raises(ValueError, match="multiple must be an int >= 1, got 0"):
        round_up(5, 0)
    with pytest.raises(ValueError, match="n must be an int >= 0, got -1"):
        round_up(-1, 4)


# --------------------------------------------------------------------------
# Builder geometry, hand-computed.
#
# Model: 3 full-attention layers, 256-byte pages (2 heads -> 128-byte head
# slabs), 5 blocks. Size is always 3 * 5 * 256 = 3840.

GEOMETRY = {
    # layout: (layer_stride, block_stride, segment offsets, segment stride)
    L.LBHNC: (5 * 256, 256, [0, 1280, 2560], 256),
    L.LBNHC: (5 * 256, 256, [0, 1280, 2560], 256),
    # one segment per (layer, head): 6 slabs of 5 * 128 bytes
    L.LHBNC: (5 * 256, 128, [0, 640, 1280, 1920, 2560, 3200], 128),
    L.BLHNC: (256, 3 * 256, [0], 768),
    L.BLNHC: (256, 3 * 256, [0], 768),
    # a block is 2 head rows of 3 layers * 128 bytes
    L.BHLNC: (128, 3 * 256, [0], 768),
}


@pytest.mark.invariant(1, 3)
@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_builder_geometry_full_attention(layout):
    config = build_kv_cache_config([KVCacheGroupSpec(names("l", 3), FULL)], 5, layout)
    layer_stride, block_stride, offsets, stride = GEOMETRY[layout]
    (tensor,) = config.kv_cache_tensors
    assert tensor == KVCacheTensor(
        size=3840,
        layers=["l0", "l1", "l2"],
        layer_stride=layer_stride,
        block_stride=block_stride,
        offset=0,
    )
    assert config.num_blocks == 5
    assert kv_cache_segments(config, layout) == (offsets, [stride] * len(offsets))


# MLA: 2 layers, 128-byte pages, one head, 4 blocks; size 2 * 4 * 128 = 1024.
MLA_GEOMETRY = {
    L.LBHNC: (512, 128, [0, 512]),
    L.LBNHC: (512, 128, [0, 512]),
    L.LHBNC: (512, 128, [0, 512]),  # one head: the same as LBHNC
    L.BLHNC: (128, 256, [0]),
    L.BLNHC: (128, 256, [0]),
    L.BHLNC: (128, 256, [0]),
}


@pytest.mark.invariant(1, 3)
@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_builder_geometry_mla(layout):
    config = build_kv_cache_config([KVCacheGroupSpec(["m0", "m1"], MLA)], 4, layout)
    (tensor,) = config.kv_cache_tensors
    layer_stride, block_stride, offsets = MLA_GEOMETRY[layout]
    assert (tensor.size, tensor.layer_stride, tensor.block_stride, tensor.offset) == (
        1024,
        layer_stride,
        block_stride,
        0,
    )
    assert kv_cache_segments(config, layout)[0] == offsets


# Mixed pages: group 0 has 2 full layers (256 B), group 1 has 3 MLA layers
# (128 B); 3 blocks. Size 3 * (2 * 256 + 3 * 128) = 2688.
MIXED = {
    # layout: [(offset, layer_stride, block_stride) for group 0, group 1], segments
    L.LBHNC: (
        [(0, 768, 256), (1536, 384, 128)],
        ([0, 768, 1536, 1920, 2304], [256, 256, 128, 128, 128]),
    ),
    L.LBNHC: (
        [(0, 768, 256), (1536, 384, 128)],
        ([0, 768, 1536, 1920, 2304], [256, 256, 128, 128, 128]),
    ),
    # head slabs: 256 / 2 == 128 / 1, so one stride of 128 and 7 segments
    L.LHBNC: (
        [(0, 768, 128), (1536, 384, 128)],
        ([0, 384, 768, 1152, 1536, 1920, 2304], [128] * 7),
    ),
    L.BLHNC: ([(0, 256, 896), (512, 128, 896)], ([0], [896])),
    L.BLNHC: ([(0, 256, 896), (512, 128, 896)], ([0], [896])),
}


@pytest.mark.invariant(1, 3)
@pytest.mark.parametrize("layout", sorted(MIXED, key=lambda m: m.name))
def test_builder_mixed_page_sizes_get_separate_regions(layout):
    groups = [KVCacheGroupSpec(["a0", "a1"], FULL), KVCacheGroupSpec(names("m", 3), MLA)]
    config = build_kv_cache_config(groups, 3, layout)
    placements, segments = MIXED[layout]
    assert [
        (t.offset, t.layer_stride, t.block_stride) for t in config.kv_cache_tensors
    ] == placements
    assert {t.size for t in config.kv_cache_tensors} == {2688}
    assert [t.layers for t in config.kv_cache_tensors] == [["a0", "a1"], ["m0", "m1", "m2"]]
    assert kv_cache_segments(config, layout) == segments


@pytest.mark.invariant(6)
def test_builder_bhlnc_rejects_mixed_heads():
    groups = [KVCacheGroupSpec(["a"], FULL), KVCacheGroupSpec(["m"], MLA)]
    with pytest.raises(ValueError, match=r"BHLNC needs every layer to have the same kv heads, got \[1, 2\]"):
        build_kv_cache_config(groups, 3, L.BHLNC)


@pytest.mark.invariant(6)
def test_builder_rejects_groups_landing_between_elements():
    # 2 (K,V) * 1 token * 1 head * 1 dim * 2 bytes = 4-byte pages, then an
    # int64 group would start 3 * 4 = 12 bytes in: not on an 8-byte element.
    tiny = FullAttentionSpec(1, 1, 1, torch.int16)
    wide = MLAAttentionSpec(4, 4, torch.int64)
    groups = [KVCacheGroupSpec(["t"], tiny), KVCacheGroupSpec(["w"], wide)]
    with pytest.raises(ValueError, match="kv cache group 1 lands at offset 12, not a multiple of its 8-byte"):
        build_kv_cache_config(groups, 3, L.LBHNC)
    # Wide pages first keep everything aligned.
    config = build_kv_cache_config(groups[::-1], 3, L.LBHNC)
    assert [t.offset for t in config.kv_cache_tensors] == [0, 3 * 128]


@pytest.mark.invariant(6)
def test_builder_lhbnc_rejects_mixed_head_slabs():
    # 256 / 2 = 128 against a 64-byte MLA slab: no single segment stride.
    small_mla = MLAAttentionSpec(block_size=4, head_size=4, dtype=torch.int32)
    groups = [KVCacheGroupSpec(["a"], FULL), KVCacheGroupSpec(["m"], small_mla)]
    with pytest.raises(ValueError, match="LHBNC needs one per-head block stride"):
        build_kv_cache_config(groups, 3, L.LHBNC)
    # The same model is fine where heads stay inside the page.
    config = build_kv_cache_config(groups, 3, L.LBHNC)
    assert len(kv_cache_segments(config, L.LBHNC)[0]) == 2


@pytest.mark.invariant(1)
@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_builder_groups_with_equal_pages_alias(layout):
    # Group 1 (2 layers) aliases the first two of group 0's 3 regions.
    groups = [KVCacheGroupSpec(names("g", 3), FULL), KVCacheGroupSpec(["s0", "s1"], FULL)]
    config = build_kv_cache_config(groups, 5, layout)
    first, second = config.kv_cache_tensors
    assert first.offset == second.offset == 0
    assert (first.layer_stride, first.block_stride) == (second.layer_stride, second.block_stride)
    # Aliasing costs no space: the same 3840 bytes as group 0 alone.
    assert first.size == second.size == 3840
    buffer = torch.zeros(3840, dtype=torch.uint8)
    views = all_views(config, layout, buffer)
    for i in range(2):
        assert views[f"g{i}"].data_ptr() == views[f"s{i}"].data_ptr(), f"g{i} and s{i} start apart"
        views[f"g{i}"].fill_(i + 7)
        assert views[f"s{i}"].shape == views[f"g{i}"].shape, f"s{i} and g{i} differ in shape"
        differing = int((views[f"s{i}"] != i + 7).sum())
        assert differing == 0, (
            f"{differing} of s{i}'s {views[f's{i}'].numel()} elements are not the {i + 7} written through g{i}"
        )


@pytest.mark.invariant(1)
def test_builder_hybrid_state_aliases_attention_when_padded():
    state = MambaStateSpec(4, ((4, 8),), torch.int16, page_size_padded=256)
    groups = [KVCacheGroupSpec(["attn0", "attn1"], FULL), KVCacheGroupSpec(["ssm0"], state)]
    config = build_kv_cache_config(groups, 4, L.LBHNC)
    assert [t.offset for t in config.kv_cache_tensors] == [0, 0]
    assert alloc_size(config) == 2 * 4 * 256
    assert layer_spec_for_tensor(config, config.kv_cache_tensors[1]) == (1, state)
    # The unpadded state page (64 B) is a class of its own instead.
    lone = MambaStateSpec(4, ((4, 8),), torch.int16)
    groups[1] = KVCacheGroupSpec(["ssm0"], lone)
    config = build_kv_cache_config(groups, 4, L.LBHNC)
    assert [t.offset for t in config.kv_cache_tensors] == [0, 2 * 4 * 256]
    assert alloc_size(config) == 2 * 4 * 256 + 4 * 64


@pytest.mark.invariant(6)
@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: build_kv_cache_config([], 4, L.LBHNC), "groups must hold at least one"),
        (lambda: build_kv_cache_config([KVCacheGroupSpec(["a"], FULL)], 0, L.LBHNC), "num_blocks must be an int >= 1, got 0"),
        (lambda: build_kv_cache_config([KVCacheGroupSpec(["a"], FULL)], 4, "LBHNC"), "layout must be a KVCacheLayout, got 'LBHNC'"),
        (lambda: build_kv_cache_config([FULL], 4, L.LBHNC), r"groups\[0\] must be a KVCacheGroupSpec"),
        (
            lambda: build_kv_cache_config(
                [KVCacheGroupSpec(["a", "b"], FULL), KVCacheGroupSpec(["b"], MLA)], 4, L.LBHNC
            ),
            "layer 'b' is in kv cache groups 0 and 1",
        ),
    ],
)
def test_builder_invalid_input_raises(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --------------------------------------------------------------------------
# Views: where every element lands, by explicit formula per layout.


def expected_full_address(layout, spec, tensor, num_blocks, l, kb, kv, t, h, c, kernel):
    """Byte address of element [kb, kv, t, h, c] of layer l's view."""
    e = spec.dtype.itemsize
    n_tok, heads, dim = spec.block_size, spec.num_kv_heads, spec.head_size
    page = 2 * n_tok * heads * dim * e
    splits = n_tok // kernel
    b, j = divmod(kb, splits)
    base = tensor.offset + l * tensor.layer_stride + b * tensor.block_stride
    if layout is L.LBHNC or layout is L.BLHNC:
        # page = splits x [K/V][head][token][dim]
        return base + j * page // splits + ((kv * heads + h) * kernel + t) * dim * e + c * e
    if layout is L.LBNHC or layout is L.BLNHC:
        # page = splits x [K/V][token][head][dim]
        return base + j * page // splits + ((kv * kernel + t) * heads + h) * dim * e + c * e
    slab = page // heads  # one head's share of a page: [K/V][token][dim]
    if layout is L.LHBNC:
        head_base = h * (tensor.layer_stride // heads)
        return base + head_base + j * slab // splits + (kv * kernel + t) * dim * e + c * e
    assert layout is L.BHLNC
    head_base = h * (tensor.block_stride // heads)
    return base + head_base + (kv * kernel + t) * dim * e + c * e


def check_view_addresses(layout, spec, config, buffer, kernel=None):
    """Fill each layer's view with distinct int32 values and find every value
    at its formula address."""
    kernel = kernel or spec.block_size
    views = all_views(config, layout, buffer, [kernel] * len(config.kv_cache_groups))
    as_int = buffer.view(torch.int32)
    checked = 0
    for tensor in config.kv_cache_tensors:
        for l, name in enumerate(tensor.layers):
            view = views[name]
            assert view.dtype == torch.int32, f"layer {name} is {view.dtype}"
            assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr(), (
                f"layer {name}'s view does not alias the buffer's storage"
            )
            values = torch.arange(view.numel(), dtype=torch.int32).reshape(view.shape)
            view.copy_(values + 1_000_000 * (l + 1))
            for index in itertools.product(*(range(d) for d in view.shape)):
                kb, kv, t, h, c = index
                address = expected_full_address(
                    layout, spec, tensor, config.num_blocks, l, kb, kv, t, h, c, kernel
                )
                assert address % 4 == 0, f"layer {name} {index}: address {address} is not int32-aligned"
                assert as_int[address // 4].item() == view[index].item(), (name, index)
                checked += 1
    return checked


@pytest.mark.invariant(1)
@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_full_attention_views_land_at_formula_addresses(layout):
    config = build_kv_cache_config([KVCacheGroupSpec(names("l", 3), FULL)], 3, layout)
    buffer = torch.zeros(alloc_size(config), dtype=torch.uint8)
    views = all_views(config, layout, buffer)
    assert views["l0"].shape == (3, 2, 4, 2, 4)  # (blocks, K/V, tokens, heads, dim)
    checked = check_view_addresses(layout, FULL, config, buffer)
    # Every element of every layer was checked: 3 layers * 3 blocks * 64 elements.
    assert checked == 3 * 3 * 64


@pytest.mark.invariant(1)
@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_views_tile_the_allocation_exactly_once(layout):
    groups = [KVCacheGroupSpec(names("l", 3), FULL)]
    if layout is not L.BHLNC:
        groups.append(KVCacheGroupSpec(names("m", 2), MLA))
    config = build_kv_cache_config(groups, 3, layout)
    buffer = torch.zeros(alloc_size(config), dtype=torch.uint8)
    coverage = torch.zeros(buffer.numel(), dtype=torch.int32)
    for name, view in all_views(config, layout, buffer).items():
        buffer.zero_()
        view.fill_(-1)  # all bytes 0xff
        written = buffer != 0
        assert int(written.sum()) == view.numel() * view.element_size(), (
            f"layer {name} wrote {int(written.sum())} bytes for a "
            f"{view.numel() * view.element_size()}-byte view: its elements overlap"
        )
        coverage += written.int()
    untouched = int((coverage == 0).sum())
    shared = int((coverage > 1).sum())
    assert int(coverage.min()) == 1 and int(coverage.max()) == 1, (
        f"of {buffer.numel()} bytes, {untouched} belong to no layer and {shared} to several"
    )


@pytest.mark.invariant(1)
@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_block_marker_lands_at_offset_plus_strides(layout):
    """Block b of layer l begins at offset + l*layer_stride + b*block_stride."""
    groups = [KVCacheGroupSpec(names("l", 2), FULL)]
    if layout is not L.BHLNC:
        groups.append(KVCacheGroupSpec(names("m", 3), MLA))
    config = build_kv_cache_config(groups, 4, layout)
    buffer = torch.zeros(alloc_size(config), dtype=torch.uint8)
    views = all_views(config, layout, buffer)
    marker = 0x5A5A5A5A
    for tensor in config.kv_cache_tensors:
        for l, name in enumerate(tensor.layers):
            for b in range(config.num_blocks):
                buffer.zero_()
                first = (b,) + (0,) * (views[name].dim() - 1)
                views[name][first] = marker
                start = tensor.offset + l * tensor.layer_stride + b * tensor.block_stride
                assert buffer[start : start + 4].view(torch.int32).item() == marker, (
                    f"layer {name} block {b}: marker not at byte {start}"
                )
                assert int((buffer != 0).sum()) == 4, (
                    f"layer {name} block {b}: marker wrote {int((buffer != 0).sum())} bytes, not 4"
                )


@pytest.mark.invariant(1)
def test_mla_view_shape_and_addresses():
    config = build_kv_cache_config([KVCacheGroupSpec(["m0", "m1"], MLA)], 3, L.BLHNC)
    buffer = torch.zeros(alloc_size(config), dtype=torch.uint8)
    views = all_views(config, L.BLHNC, buffer)
    assert views["m1"].shape == (3, 4, 8)  # (blocks, tokens, latent dim)
    views["m1"][2, 3, 5] = 99
    # offset 0 + layer 1 * 128 + block 2 * 256 + token 3 * 32 + dim 5 * 4
    address = 128 + 2 * 256 + 3 * 32 + 5 * 4
    assert buffer[address : address + 4].view(torch.int32).item() == 99


@pytest.mark.invariant(1)
def test_views_are_typed_and_alias_bfloat16():
    spec = FullAttentionSpec(4, 2, 8, torch.bfloat16)
    config = build_kv_cache_config([KVCacheGroupSpec(["a"], spec)], 2, L.LBNHC)
    buffer = torch.zeros(alloc_size(config), dtype=torch.uint8)
    (view,) = all_views(config, L.LBNHC, buffer).values()
    assert view.dtype == torch.bfloat16 and view.shape == (2, 2, 4, 2, 8)
    view[1, 1, 3, 1, 7] = 1.5
    # block 1 * 256 + V * 128 + token 3 * 32 + head 1 * 16 + dim 7 * 2
    address = 256 + 128 + 3 * 32 + 16 + 14
    got = buffer[address : address + 2].view(torch.bfloat16).item()
    assert got == 1.5


@pytest.mark.invariant(1)
def test_views_over_a_segment_slice_honour_its_start():
    """committed_views passes one segment's storage; offsets are relative to it."""
    config = build_kv_cache_config([KVCacheGroupSpec(["a", "b"], FULL)], 3, L.LBHNC)
    big = torch.zeros(4096, dtype=torch.uint8)
    segment_start = 1024
    segment = big[segment_start : segment_start + 768]
    tensor = config.kv_cache_tensors[0]
    (view,) = create_kv_cache_views(
        segment, FULL, 3, L.LBHNC, replace(tensor, layers=["b"], offset=0)
    )
    view[2, 0, 0, 0, 0] = 42
    address = segment_start + 2 * 256
    assert big[address : address + 4].view(torch.int32).item() == 42
    assert int((big != 0).sum()) == 1  # 42 fits in the low byte


@pytest.mark.invariant(1)
def test_state_layers_get_the_raw_buffer():
    state = MambaStateSpec(4, ((4, 8),), torch.int16, page_size_padded=256)
    groups = [KVCacheGroupSpec(["attn"], FULL), KVCacheGroupSpec(["ssm0"], state)]
    config = build_kv_cache_config(groups, 4, L.LBHNC)
    buffer = torch.zeros(alloc_size(config), dtype=torch.uint8)
    views = all_views(config, L.LBHNC, buffer)
    got_the_buffer = views["ssm0"] is buffer
    assert got_the_buffer, "the state layer got a new tensor, not the raw buffer itself"
    assert views["attn"].dtype == torch.int32


# Kernel blocks: an 8-token block read as two 4-token kernel blocks.
BIG_BLOCK = FullAttentionSpec(block_size=8, num_kv_heads=2, head_size=4, dtype=torch.int32)


@pytest.mark.invariant(1)
@pytest.mark.parametrize("layout", [L.LBHNC, L.LBNHC, L.LHBNC])
def test_kernel_block_split(layout):
    config = build_kv_cache_config([KVCacheGroupSpec(["a", "b"], BIG_BLOCK)], 3, layout)
    buffer = torch.zeros(alloc_size(config), dtype=torch.uint8)
    views = all_views(config, layout, buffer, kernel_block_sizes=[4])
    assert views["a"].shape == (6, 2, 4, 2, 4)
    checked = check_view_addresses(layout, BIG_BLOCK, config, buffer, kernel=4)
    assert checked == 2 * 6 * 64
    # Kernel block 2b+1 starts half a (head) slab after kernel block 2b.
    tensor = config.kv_cache_tensors[0]
    half = tensor.block_stride // 2
    assert views["a"][3].data_ptr() - views["a"][2].data_ptr() == half


@pytest.mark.invariant(6)
@pytest.mark.parametrize("layout", [L.BLHNC, L.BLNHC, L.BHLNC])
def test_kernel_block_split_needs_contiguous_blocks(layout):
    config = build_kv_cache_config([KVCacheGroupSpec(["a", "b"], BIG_BLOCK)], 3, layout)
    buffer = torch.zeros(alloc_size(config), dtype=torch.uint8)
    tensor = config.kv_cache_tensors[0]
    with pytest.raises(ValueError, match="kernel_block_size 4 splits blocks"):
        create_kv_cache_views(buffer, BIG_BLOCK, 3, layout, tensor, kernel_block_size=4)
    # Without a split the same layout is fine.
    assert len(create_kv_cache_views(buffer, BIG_BLOCK, 3, layout, tensor, kernel_block_size=8)) == 2


@pytest.mark.invariant(1)
def test_kernel_block_split_single_layer_block_outermost():
    """One layer alone has contiguous blocks even when blocks are outermost."""
    config = build_kv_cache_config([KVCacheGroupSpec(["a"], BIG_BLOCK)], 3, L.BLHNC)
    buffer = torch.zeros(alloc_size(config), dtype=torch.uint8)
    # 3 blocks * 4 kernel blocks, each 2 * 2 tokens * 2 heads * 4 dims
    assert check_view_addresses(L.BLHNC, BIG_BLOCK, config, buffer, kernel=2) == 12 * 32


@pytest.mark.invariant(6)
def test_view_invalid_input_raises():
    config = build_kv_cache_config([KVCacheGroupSpec(["a"], FULL)], 3, L.LBHNC)
    tensor = config.kv_cache_tensors[0]
    buffer = torch.zeros(768, dtype=torch.uint8)
    with pytest.raises(ValueError, match="kernel_block_size 3 does not divide the block size 4"):
        create_kv_cache_views(buffer, FULL, 3, L.LBHNC, tensor, kernel_block_size=3)
    with pytest.raises(ValueError, match="kernel_block_size must be an int >= 1, got 0"):
        create_kv_cache_views(buffer, FULL, 3, L.LBHNC, tensor, kernel_block_size=0)
    with pytest.raises(ValueError, match="buffer must be a contiguous 1-D uint8 tensor, got dtype torch.float32"):
        create_kv_cache_views(torch.zeros(192), FULL, 3, L.LBHNC, tensor)
    with pytest.raises(ValueError, match=r"spans bytes \[0, 768\) but the buffer holds 767"):
        create_kv_cache_views(buffer[:767], FULL, 3, L.LBHNC, tensor)
    with pytest.raises(ValueError, match="num_blocks must be an int >= 1, got 0"):
        create_kv_cache_views(buffer, FULL, 0, L.LBHNC, tensor)

    with pytest.raises(ValueError, match="offset of 2 bytes is not a multiple of the 4-byte"):
        create_kv_cache_views(buffer, FULL, 2, L.LBHNC, replace(tensor, offset=2))
    with pytest.raises(ValueError, match="block_stride 128 is smaller than the 256-byte slab"):
        create_kv_cache_views(buffer, FULL, 3, L.LBHNC, replace(tensor, block_stride=128))
    with pytest.raises(ValueError, match="spec must be a KVCacheSpec"):
        create_kv_cache_views(buffer, "full", 3, L.LBHNC, tensor)
    with pytest.raises(ValueError, match="tensor must be a KVCacheTensor"):
        create_kv_cache_views(buffer, FULL, 3, L.LBHNC, {"offset": 0})
    with pytest.raises(ValueError, match="buffer starts 1 bytes into its storage"):
        create_kv_cache_views(
            torch.zeros(1024, dtype=torch.uint8)[1:], FULL, 3, L.LBHNC, tensor
        )
    written = int(buffer.count_nonzero())
    assert (buffer.numel(), written) == (768, 0), f"refused calls wrote {written} bytes of the buffer"


# --------------------------------------------------------------------------
# Group lookup


@pytest.mark.invariant(1, 6)
def test_layer_spec_for_tensor_and_kernel_block_size():
    groups = [KVCacheGroupSpec(["a0", "a1"], FULL), KVCacheGroupSpec(["m0"], MLA)]
    config = build_kv_cache_config(groups, 2, L.LBHNC)
    assert layer_spec_for_tensor(config, config.kv_cache_tensors[0]) == (0, FULL)
    assert layer_spec_for_tensor(config, config.kv_cache_tensors[1]) == (1, MLA)
    single = KVCacheTensor(size=1, layers=["a1"], layer_stride=0, block_stride=1)
    assert layer_spec_for_tensor(config, single) == (0, FULL)
    with pytest.raises(ValueError, match="layer 'zz' is in no kv cache group"):
        layer_spec_for_tensor(config, KVCacheTensor(1, ["zz"], 0, 1))
    with pytest.raises(ValueError, match=r"tensor mixes kv cache groups: 'a0' is in group 0 but \['m0'\]"):
        layer_spec_for_tensor(config, KVCacheTensor(1, ["a0", "m0"], 0, 1))

    assert layer_kernel_block_size(1, None) is None
    assert layer_kernel_block_size(1, [16, 32]) == 32
    with pytest.raises(ValueError, match="group_id 2 has no kernel block size"):
        layer_kernel_block_size(2, [16, 32])
    with pytest.raises(ValueError, match="group_id must be an int >= 0, got -1"):
        layer_kernel_block_size(-1, [16])


# --------------------------------------------------------------------------
# Segments of hand-made configs


@pytest.mark.invariant(6)
def test_segments_invalid_configs_raise():
    def config(*tensors, num_blocks=2):
        return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=list(tensors), kv_cache_groups=[])

    with pytest.raises(ValueError, match="config has no kv_cache_tensors"):
        kv_cache_segments(config(), L.LBHNC)
    with pytest.raises(ValueError, match=r"must describe one allocation, got sizes \[8, 16\]"):
        kv_cache_segments(config(KVCacheTensor(8, ["a"], 4, 2), KVCacheTensor(16, ["b"], 4, 2)), L.LBHNC)
    with pytest.raises(ValueError, match="config.num_blocks must be an int >= 1, got 0"):
        kv_cache_segments(config(KVCacheTensor(8, ["a"], 4, 2), num_blocks=0), L.LBHNC)
    with pytest.raises(ValueError, match=r"BLHNC needs one block stride for every tensor, got \[4, 8\]"):
        kv_cache_segments(config(KVCacheTensor(24, ["a"], 4, 4), KVCacheTensor(24, ["b"], 8, 8)), L.BLHNC)
    with pytest.raises(ValueError, match="not a whole number of 2-block segments of 16 bytes"):
        kv_cache_segments(config(KVCacheTensor(24, ["a"], 4, 8)), L.BLHNC)
    with pytest.raises(ValueError, match="tensors alias offset 0 with block strides 4 and 8"):
        kv_cache_segments(config(KVCacheTensor(16, ["a"], 8, 4), KVCacheTensor(16, ["b"], 16, 8)), L.LBHNC)
    with pytest.raises(ValueError, match="first layer region starts at 4, not 0"):
        kv_cache_segments(config(KVCacheTensor(16, ["a"], 8, 4, offset=4)), L.LBHNC)
    with pytest.raises(ValueError, match="layer region at 4 overlaps the one before it"):
        kv_cache_segments(config(KVCacheTensor(16, ["a", "b"], 4, 4)), L.LBHNC)
    with pytest.raises(ValueError, match="layer regions end at 16, past the allocation's 12"):
        kv_cache_segments(config(KVCacheTensor(12, ["a", "b"], 8, 4)), L.LBHNC)


# --------------------------------------------------------------------------
# Padding


@pytest.mark.invariant(3)
def test_padding_puts_every_region_on_a_granule():
    # Full layers: 5 blocks * 256 = 1280 B regions; MLA: 5 * 128 = 640 B.
    groups = [
        KVCacheGroupSpec(names("a", 2), FULL),
        KVCacheGroupSpec(["s0"], FULL),  # aliases a0
        KVCacheGroupSpec(names("m", 2), MLA),
    ]
    config = build_kv_cache_config(groups, 5, L.LBHNC)
    before = [(t.offset, t.layer_stride) for t in config.kv_cache_tensors]
    granule = 1024
    padded = pad_kv_cache_segments(config, L.LBHNC, granule)
    # Regions grow to 2048 (full) and 1024 (MLA): offsets 0, 2048 | 4096, 5120.
    assert [(t.offset, t.layer_stride) for t in padded.kv_cache_tensors] == [
        (0, 2048),
        (0, 2048),
        (4096, 1024),
    ]
    assert {t.size for t in padded.kv_cache_tensors} == {6144}
    offsets, strides = kv_cache_segments(padded, L.LBHNC)
    assert offsets == [0, 2048, 4096, 5120]
    assert all(offset % granule == 0 for offset in offsets), (
        f"segment offsets {offsets} are not all multiples of the {granule}-byte granule"
    )
    # Only address space grows: block strides and block count are unchanged.
    assert strides == [256, 256, 128, 128]
    assert padded.num_blocks == 5
    assert [t.block_stride for t in padded.kv_cache_tensors] == [256, 256, 128]
    # The original is untouched and groups are shared.
    assert [(t.offset, t.layer_stride) for t in config.kv_cache_tensors] == before
    assert padded.kv_cache_groups is config.kv_cache_groups
    # Idempotent.
    again = pad_kv_cache_segments(padded, L.LBHNC, granule)
    assert again.kv_cache_tensors == padded.kv_cache_tensors


@pytest.mark.invariant(1, 3)
def test_padded_views_alias_their_regions():
    config = build_kv_cache_config([KVCacheGroupSpec(names("l", 3), FULL)], 3, L.LBNHC)
    padded = pad_kv_cache_segments(config, L.LBNHC, 1024)
    buffer = torch.zeros(alloc_size(padded), dtype=torch.uint8)
    assert buffer.numel() == 3 * 1024
    assert check_view_addresses(L.LBNHC, FULL, padded, buffer) == 3 * 3 * 64
    # Padding bytes [768, 1024) of every region are touched by no view.
    for region in range(3):
        touched = int(buffer[region * 1024 + 768 : (region + 1) * 1024].count_nonzero())
        assert touched == 0, f"a view wrote {touched} bytes of region {region}'s padding"


@pytest.mark.invariant(3)
@pytest.mark.parametrize("layout", [L.BLHNC, L.BLNHC, L.BHLNC])
def test_padding_block_outermost_is_identity(layout):
    config = build_kv_cache_config([KVCacheGroupSpec(names("l", 3), FULL)], 3, layout)
    same = pad_kv_cache_segments(config, layout, 2 * MiB) is config
    assert same, f"padding a {layout.name} config made a new config"


@pytest.mark.invariant(6)
def test_padding_invalid_input_raises():
    config = build_kv_cache_config([KVCacheGroupSpec(names("l", 3), FULL)], 3, L.LHBNC)
    with pytest.raises(ValueError, match="LHBNC has no per-layer segments to pad"):
        pad_kv_cache_segments(config, L.LHBNC, 1024)
    config = build_kv_cache_config([KVCacheGroupSpec(names("l", 3), FULL)], 3, L.LBHNC)
    with pytest.raises(ValueError, match="granule must be an int >= 1, got 0"):
        pad_kv_cache_segments(config, L.LBHNC, 0)
    gap = KVCacheConfig(3, [KVCacheTensor(4096, ["a"], 768, 256, offset=1024)], [])
    with pytest.raises(ValueError, match="expected one at 0, found 1024"):
        pad_kv_cache_segments(gap, L.LBHNC, 1024)
    short = KVCacheConfig(3, [KVCacheTensor(4096, ["a", "b"], 512, 256)], [])
    with pytest.raises(ValueError, match="layer_stride 512 of layers .* is smaller than 3 blocks of 256 bytes"):
        pad_kv_cache_segments(short, L.LBHNC, 1024)


# --------------------------------------------------------------------------
# Granule alignment: reference facts


@pytest.mark.invariant(3)
@pytest.mark.parametrize(
    "num_blocks, strides, expected_alignment, expected_blocks",
    [
        (1000, [64 * KiB], 32, 992),  # 2 MiB / 64 KiB = 32
        (1000, [96 * KiB], 64, 960),  # gcd(96 KiB, 2 MiB) = 32 KiB -> 64
        (1000, [64 * KiB, 96 * KiB], 64, 960),  # lcm(32, 64)
        (1000, [4 * MiB], 1, 1000),  # every block ends on a granule
        (31, [64 * KiB], 32, 0),
        (64, [96 * KiB, 96 * KiB, 64 * KiB], 64, 64),
    ],
)
def test_granule_alignment_reference_facts(num_blocks, strides, expected_alignment, expected_blocks):
    granule = 2 * MiB
    assert granule_block_alignment(strides, granule) == expected_alignment
    assert granule_aligned_blocks(num_blocks, strides, granule) == expected_blocks


@pytest.mark.invariant(3)
def test_granule_alignment_is_an_lcm_not_a_max():
    # Granule 12: stride 4 needs 3 blocks, stride 6 needs 2; both need 6.
    assert granule_block_alignment([4], 12) == 3
    assert granule_block_alignment([6], 12) == 2
    assert granule_block_alignment([4, 6], 12) == 6
    assert granule_aligned_blocks(17, [4, 6], 12) == 12


@pytest.mark.invariant(6)
def test_granule_alignment_invalid_input_raises():
    with pytest.raises(ValueError, match="strides must hold at least one segment stride"):
        granule_block_alignment([], 2 * MiB)
    with pytest.raises(ValueError, match=r"strides\[1\] must be an int >= 1, got 0"):
        granule_block_alignment([64, 0], 2 * MiB)
    with pytest.raises(ValueError, match="granule must be an int >= 1, got -2"):
        granule_block_alignment([64], -2)
    with pytest.raises(ValueError, match="num_blocks must be an int >= 0, got -1"):
        granule_aligned_blocks(-1, [64], 2 * MiB)


granules = st.sampled_from([4 * KiB, 64 * KiB, 2 * MiB])
strides_st = st.lists(st.integers(1, 8 * MiB), min_size=1, max_size=6)


@pytest.mark.invariant(3)
@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(0, 1 << 20), strides=strides_st, granule=granules)
def test_granule_aligned_blocks_properties(num_blocks, strides, granule):
    alignment = granule_block_alignment(strides, granule)
    aligned = granule_aligned_blocks(num_blocks, strides, granule)
    assert 0 <= aligned <= num_blocks
    assert aligned % alignment == 0
    assert num_blocks - aligned < alignment  # rounded down, not further
    for stride in strides:
        # every segment ends on a granule
        assert (aligned * stride) % granule == 0, (
            f"{aligned} blocks of stride {stride} end {(aligned * stride) % granule} bytes past a granule"
        )


@pytest.mark.invariant(3)
@settings(max_examples=200, deadline=None)
@given(strides=st.lists(st.integers(1, 64 * KiB), min_size=1, max_size=3), granule=st.sampled_from([4 * KiB, 64 * KiB]))
def test_granule_block_alignment_is_the_smallest(strides, granule):
    alignment = granule_block_alignment(strides, granule)
    assert all((alignment * s) % granule == 0 for s in strides), (
        f"{alignment} blocks end off a {granule}-byte granule for strides "
        f"{[s for s in strides if (alignment * s) % granule]}"
    )
    # No smaller positive count works (brute force over every count below
    # it, alignment <= granule; in one tensor, since a Python loop over up to
    # 64 Ki counts per example took seconds; products stay below 2**32).
    counts = torch.arange(1, alignment, dtype=torch.int64)
    aligned = torch.ones_like(counts, dtype=torch.bool)
    for s in strides:
        aligned &= (counts * s) % granule == 0
    smaller = int(counts[aligned][0]) if bool(aligned.any()) else None
    assert smaller is None, f"{smaller} blocks already align, fewer than {alignment}"


# --------------------------------------------------------------------------
# Builder properties: random models on every layout


# Integer dtypes, so that filling with -1 (or 255) sets every byte.
dtypes = st.sampled_from([torch.uint8, torch.int16, torch.int32, torch.int64])


def full_specs(dtype):
    return st.builds(
        FullAttentionSpec,
        block_size=st.integers(1, 4),
        num_kv_heads=st.integers(1, 3),
        head_size=st.integers(1, 4),
        dtype=st.just(dtype),
    )


def mla_specs(dtype):
    return st.builds(
        MLAAttentionSpec,
        block_size=st.integers(1, 4),
        head_size=st.integers(1, 6),
        dtype=st.just(dtype),
    )


@st.composite
def models(draw):
    # One dtype per model: mixed element sizes may misalign (tested apart).
    dtype = draw(dtypes)
    num_groups = draw(st.integers(1, 3))
    groups = []
    for g in range(num_groups):
        spec = draw(st.one_of(full_specs(dtype), mla_specs(dtype)))
        groups.append(KVCacheGroupSpec(names(f"g{g}.", draw(st.integers(1, 3))), spec))
    return groups


@pytest.mark.invariant(1, 3, 6)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(groups=models(), num_blocks=st.integers(1, 4), layout=st.sampled_from(ALL_LAYOUTS), pad=st.booleans())
def test_built_configs_segment_and_tile(groups, num_blocks, layout, pad):
    specs = [g.kv_cache_spec for g in groups]
    heads = {s.num_page_heads for s in specs}
    slabs = {s.page_size_bytes // s.num_page_heads for s in specs}
    if (layout is L.BHLNC and len(heads) > 1) or (layout is L.LHBNC and len(slabs) > 1):
        with pytest.raises(ValueError, match=layout.name):
            build_kv_cache_config(groups, num_blocks, layout)
        return
    config = build_kv_cache_config(groups, num_blocks, layout)
    # Unpadded, the allocation is the pages of each page class's widest group.
    widest: dict[int, int] = {}
    for spec, group in zip(specs, groups):
        page = spec.page_size_bytes
        widest[page] = max(widest.get(page, 0), len(group.layer_names))
    assert alloc_size(config) == num_blocks * sum(p * n for p, n in widest.items())
    if pad and layout.is_block_outermost:
        same = pad_kv_cache_segments(config, layout, 64) is config
        assert same, f"padding a {layout.name} config made a new config"
    elif pad and not layout.is_block_compact:
        with pytest.raises(ValueError, match=f"{layout.name} has no per-layer segments to pad"):
            pad_kv_cache_segments(config, layout, 64)
    elif pad:
        config = pad_kv_cache_segments(config, layout, 64)
    offsets, strides = kv_cache_segments(config, layout)
    size = alloc_size(config)
    # Segments are disjoint, in order, inside the allocation.
    ends = [o + num_blocks * s for o, s in zip(offsets, strides)]
    assert offsets[0] == 0 and ends[-1] <= size, (
        f"segments span [{offsets[0]}, {ends[-1]}) of a {size}-byte allocation"
    )
    assert all(end <= nxt for end, nxt in zip(ends, offsets[1:])), (
        f"segments overlap: offsets {offsets}, ends {ends}"
    )
    if pad and layout.is_layer_compact and layout.is_block_compact:
        assert all(o % 64 == 0 for o in offsets), f"padded segment offsets {offsets} are not all on 64"
    else:
        assert ends[-1] == size, f"segments end at {ends[-1]}, allocation at {size}"  # no gaps without padding
    # Within a group views never overlap; all groups together cover every
    # segment byte, and nothing outside segments.
    buffer = torch.zeros(size, dtype=torch.uint8)
    views = all_views(config, layout, buffer)
    covered = torch.zeros(size, dtype=torch.bool)
    for group in groups:
        count = torch.zeros(size, dtype=torch.int32)
        for name in group.layer_names:
            buffer.zero_()
            views[name].fill_(-1 if views[name].dtype.is_signed else 255)
            count += (buffer != 0).int()
        assert int(count.max()) <= 1, (
            f"{int((count > 1).sum())} bytes belong to several layers of one group"
        )
        covered |= count.bool()
    in_segment = torch.zeros(size, dtype=torch.bool)
    for offset, end in zip(offsets, ends):
        in_segment[offset:end] = True
    uncovered = int((in_segment & ~covered).sum())
    outside = int((covered & ~in_segment).sum())
    assert (uncovered, outside) == (0, 0), (
        f"{uncovered} segment bytes belong to no layer; {outside} layer bytes lie outside every segment"
    )
