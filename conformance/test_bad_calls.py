"""Invariant 6: every bad call is answered with a clear exception and changes
nothing. One rule for integers everywhere (anything `operator.index` takes,
never a bool), real bools for flags, and a freed cache that refuses every
operation in its own words. "Changes nothing" is checked against a snapshot:
the same chunk objects, the same driver read-back, the same bytes and the same
cache attributes (extkv.testing.checks)."""

from __future__ import annotations

import pytest
import torch

from extkv import (
    ExtensibleKVCache,
    KVCacheLayout,
    StateError,
    measure_kv_cache_blocks,
    measure_kv_cache_bytes,
    pad_kv_cache_segments,
)
from extkv.testing.checks import check_unchanged, snapshot
from extkv.testing.configs import GRANULE, config_for, fill_segments

pytestmark = pytest.mark.invariant(6)

LAYOUT = KVCacheLayout.LBHNC
CAPACITY = 300


class BlockCount:
    """An integer type that is not int, as numpy's and torch's scalars are."""

    def __init__(self, value: int):
        self.value = value

    def __index__(self) -> int:
        return self.value

    def __repr__(self) -> str:
        return f"BlockCount({self.value})"


@pytest.fixture
def cache(build, device):
    return build.cache_for("full", LAYOUT, CAPACITY, device=device)


@pytest.mark.parametrize(
    "flags",
    [dict(shrink="no"), dict(shrink=0), dict(defragment=1), dict(defragment="yes"), dict(defragment=True, preserve_contents=None)],
    ids=lambda flags: ",".join(f"{k}={v!r}" for k, v in flags.items()),
)
def test_flags_must_be_bools(cache, flags):
    cache.commit(40)
    fill_segments(cache, seed=1)
    before = snapshot(cache)
    name = next(k for k, v in flags.items() if not isinstance(v, bool))
    with pytest.raises(ValueError, match=rf"{name} must be a bool \(True or False\), got {flags[name]!r}"):
        cache.commit(10, **flags)
    check_unchanged(cache, before)


def test_zero_new_must_be_a_bool(build, device):
    tensor = build.tensor(4 * GRANULE)
    tensor.resize_segments_([100], zero_new=True)
    tensor.segment_view(0).fill_(7)
    before = snapshot(tensor)
    with pytest.raises(ValueError, match="zero_new must be a bool"):
        tensor.resize_segments_([GRANULE], zero_new=1)
    check_unchanged(tensor, before)


def test_numpy_bools_are_flags(cache):
    numpy = pytest.importorskip("numpy", reason="numpy's bool_ is only there to test where numpy is installed")
    cache.commit(40)
    cache.commit(10, shrink=numpy.True_)
    assert cache.num_committed_blocks == 10
    with pytest.raises(ValueError, match="num_blocks must be an int >= 0"):
        cache.commit(numpy.True_)


def test_preserving_contents_alone_is_refused(cache):
    cache.commit(40)
    fill_segments(cache, seed=2)
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"preserve_contents=True only applies with shrink=True or defragment=True"):
        cache.commit(10, preserve_contents=True)
    check_unchanged(cache, before)


@pytest.mark.parametrize("call, message", [
    (lambda c: c.physical_bytes_after_shrink(41),
     r"num_blocks must be an int >= 0 and <= 40 \(a block count, at most the committed ones\), got 41"),
    (lambda c: c.physical_bytes_after_shrink(True), r"num_blocks must be an int >= 0 and <= 40 .*, got True"),
    (lambda c: c.blocks_kept_within(-1), r"num_bytes must be an int >= 0 \(bytes\), got -1"),
    (lambda c: c.blocks_kept_within(1.5), r"num_bytes must be an int >= 0 \(bytes\), got 1.5"),
], ids=["after-shrink-past-the-count", "after-shrink-bool", "kept-within-negative", "kept-within-float"])
def test_the_preserving_shrinks_sizes_refuse_bad_numbers(cache, call, message):
    cache.commit(40)
    fill_segments(cache, seed=4)
    before = snapshot(cache)
    with pytest.raises(ValueError, match=message):
        call(cache)
    check_unchanged(cache, before)


FREED_CALLS = {
    "allocate": lambda c: c.allocate(c.size),
    "commit": lambda c: c.commit(0),
    "release_physical": lambda c: c.release_physical(),
    "recommit": lambda c: c.recommit(),
    "physical_bytes_for": lambda c: c.physical_bytes_for(1),
    "physical_bytes_after_shrink": lambda c: c.physical_bytes_after_shrink(0),
    "blocks_within": lambda c: c.blocks_within(1 << 20),
    "blocks_kept_within": lambda c: c.blocks_kept_within(1 << 20),
    "committable_blocks": lambda c: c.committable_blocks(),
    "committed_views": lambda c: c.committed_views(config_for("full", LAYOUT, CAPACITY), LAYOUT),
    "committed_kv_cache_tensors": lambda c: c.committed_kv_cache_tensors(config_for("full", LAYOUT, CAPACITY), LAYOUT, 1),
    "set_torch_memory_limit": lambda c: c.set_torch_memory_limit(5),
}


@pytest.mark.parametrize("operation", sorted(FREED_CALLS))
def test_freed_cache_refuses_every_operation(device, operation):
    kv_cache = ExtensibleKVCache(config_for("full", LAYOUT, CAPACITY), device, LAYOUT)
    kv_cache.commit(20)
    kv_cache.set_torch_memory_limit(1 << 30)
    kv_cache.free()
    assert kv_cache.torch_memory_limit is None  # free() lifted the cap
    with pytest.raises(StateError, match=rf"ExtensibleKVCache\.{operation}\(\) is not allowed on a freed cache"):
        FREED_CALLS[operation](kv_cache)
    assert kv_cache.torch_memory_limit is None and kv_cache.num_committed_blocks == 0
    kv_cache.free()  # still idempotent


def test_freed_cache_is_refused_by_measure(device):
    kv_cache = ExtensibleKVCache(config_for("full", LAYOUT, CAPACITY), device, LAYOUT)
    kv_cache.free()
    with pytest.raises(StateError, match="freed"):
        measure_kv_cache_blocks(kv_cache, device, init_free_memory=1 << 30, requested_memory=1 << 30)


def test_integers_follow_one_rule_everywhere(cache):
    """Anything `operator.index` accepts is an integer (numpy and torch scalars
    included); bools never are; the message has one form."""
    three = BlockCount(3)
    cache.commit(three)
    assert cache.num_committed_blocks == 3 and type(cache.num_committed_blocks) is int
    cache.commit(torch.tensor(5))
    assert cache.num_committed_blocks == 5
    assert cache.physical_bytes_for(three) == cache.physical_bytes_for(3)
    assert cache.blocks_within(BlockCount(1 << 22)) == cache.blocks_within(1 << 22)
    assert cache.buffer.segment_view(BlockCount(1)).numel() == cache.buffer.segment_sizes[1]
    cache.set_torch_memory_limit(BlockCount(1 << 30))
    assert cache.torch_memory_limit == 1 << 30
    config = config_for("full", LAYOUT, CAPACITY)
    assert pad_kv_cache_segments(config, LAYOUT, BlockCount(GRANULE)) == pad_kv_cache_segments(config, LAYOUT, GRANULE)
    fill_segments(cache, seed=3)
    before = snapshot(cache)
    for call, name in [
        (lambda: cache.commit(True), "num_blocks"),
        (lambda: cache.physical_bytes_for(True), "num_blocks"),
        (lambda: cache.blocks_within(True), "num_bytes"),
        (lambda: cache.buffer.segment_view(True), "segment index"),
        (lambda: cache.set_torch_memory_limit(True), "torch memory limit"),
        (lambda: pad_kv_cache_segments(config, LAYOUT, True), "granule"),
        (lambda: measure_kv_cache_bytes(
            init_free_memory=True, free_memory=0, committed_bytes=0, requested_memory=0, transient_peak_bytes=0
        ), "init_free_memory"),
    ]:
        with pytest.raises((ValueError, IndexError), match=rf"^{name} must be an int\b.*, got True"):
            call()
    check_unchanged(cache, before)


def test_numpy_integers_are_integers(cache):
    numpy = pytest.importorskip("numpy", reason="numpy's integers are only there to test where numpy is installed")
    cache.commit(numpy.int64(7))
    assert cache.num_committed_blocks == 7
    assert cache.physical_bytes_for(numpy.int32(7)) == cache.physical_bytes


def test_wrong_types_get_clear_errors(cache, device):
    config = config_for("full", LAYOUT, CAPACITY)
    cache.commit(4)
    fill_segments(cache, seed=4)
    before = snapshot(cache)
    for call, message in [
        (lambda: cache.committed_views(config, "LBHNC"), "layout must be a KVCacheLayout"),
        (lambda: cache.committed_kv_cache_tensors(config, "LBHNC", 4), "layout must be a KVCacheLayout"),
        (lambda: cache.committed_views(None, LAYOUT), "kv_cache_config must be a KVCacheConfig, got None"),
        (lambda: measure_kv_cache_blocks(
            "cache", device, init_free_memory=0, requested_memory=0
        ), "measure_kv_cache_blocks needs an ExtensibleKVCache, got 'cache'"),
        (lambda: measure_kv_cache_blocks(
            cache, "gpu please", init_free_memory=0, requested_memory=0
        ), "device must be a torch device, got 'gpu please'"),
    ]:
        with pytest.raises(ValueError, match=message):
            call()
    check_unchanged(cache, before)


def test_measure_refuses_another_device(cache, device):
    other = "cuda:0" if device.type == "cpu" else "cpu"
    cache.commit(4)
    fill_segments(cache, seed=5)
    before = snapshot(cache)
    with pytest.raises(ValueError, match=rf"device {other} is not the KV cache's device {device}"):
        measure_kv_cache_blocks(cache, other, init_free_memory=1 << 30, requested_memory=1 << 30)
    check_unchanged(cache, before)


@pytest.mark.parametrize(
    "value",
    [torch.tensor(True), torch.tensor([5]), torch.tensor([[5]])],
    ids=["torch bool scalar", "one-element vector", "one-element matrix"],
)
def test_tensors_that_index_but_are_no_integer_scalar_are_refused(cache, value):
    """operator.index takes a torch bool scalar (as 1) and a one-element
    tensor of any shape; as a block count or a byte limit each is a bug.
    Refused, and nothing changes."""
    cache.commit(20)
    fill_segments(cache, seed=5)
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"num_blocks must be an int >= 0.*, got tensor\("):
        cache.commit(value)
    with pytest.raises(ValueError, match=r"must be an int .*, got tensor\("):
        cache.set_torch_memory_limit(value)
    assert cache.torch_memory_limit is None
    check_unchanged(cache, before)
    cache.commit(torch.tensor(27))  # a 0-d integer tensor is an integer
    assert cache.num_committed_blocks == 27


def test_a_torch_limit_past_the_device_is_no_cap_not_an_overflow(cache, device):
    """10**400 bytes is more than any device has: the cap is the whole device
    (on CUDA, fraction 1.0, where dividing first overflowed a float after
    the limit was recorded)."""
    cache.set_torch_memory_limit(10**400)
    assert cache.torch_memory_limit == 10**400
    if device.type == "cuda":
        assert torch.cuda.get_per_process_memory_fraction(device) == 1.0
    cache.set_torch_memory_limit(None)
    assert cache.torch_memory_limit is None


def test_placements_past_the_capacity_are_refused(cache):
    """committed_kv_cache_tensors describes committed memory; a block count
    past the capacity would place tensors past the reservation."""
    config = config_for("full", LAYOUT, CAPACITY)
    within = cache.committed_kv_cache_tensors(config, LAYOUT, CAPACITY)
    assert all(tensor.size == CAPACITY * cache.bytes_per_block for tensor in within)
    with pytest.raises(ValueError, match=rf"num_blocks must be an int >= 0 and <= {CAPACITY} \(a block count\), got {CAPACITY + 1}"):
        cache.committed_kv_cache_tensors(config, LAYOUT, CAPACITY + 1)


def test_padding_names_what_is_not_a_config():
    with pytest.raises(ValueError, match="config must be a KVCacheConfig, got None"):
        pad_kv_cache_segments(None, LAYOUT, GRANULE)
