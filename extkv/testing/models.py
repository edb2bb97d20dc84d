"""Plain-Python models of what an ExtensibleTensor and an ExtensibleKVCache
must hold, and the checks that hold the real object against its model.

Theory of operation
-------------------
A model knows nothing of chunks or drivers: committed sizes, the bytes each
position must hold, and which granules must be mapped, computed with its own
arithmetic. Each check compares one side of the real object with the model:
addresses fixed, sizes, contents (including zero where the model says zero,
which over poisoned memory proves extkv zeroed it), and physical bytes as
booked and as the driver reads them back.

The tensor model holds every *mapped* byte, not only committed ones: fresh
chunks hold the driver's poison byte, so a resize that zeroes a neighbour's
bytes or an uncommitted tail is caught as surely as one that zeroes too
little. Without a known poison byte (`fresh_byte=None`) only committed bytes
are compared.

The cache model holds one byte per committed block (every row of a block, in
every segment, is written with one value), and the number of leading blocks
whose segments must each be one chunk: known after a defragmentation, a
shrink, or growth from nothing mapped, and read back from the driver to check.
A preserving shrink keeps whole the chunks straddling the new end, whose
cut the model does not know: it takes their granules past the kept blocks
from the driver, once the read-back showed every chunk left holding a kept
byte, and holds them mapped until a release.

Content differences are `ContentMismatch` and leftovers `LeakFound`, so a
stress run can count them apart from other failures.
"""

from __future__ import annotations

import torch

from ..cache import ExtensibleKVCache
from ..tensor import ExtensibleTensor
from ..vmm import torch_memory
from .checks import readback_one_chunk_per_segment


class ContentMismatch(AssertionError):
    """Bytes of the cache (or of a peer's import of it) differ from what the
    model says they hold."""


class LeakFound(AssertionError):
    """A reservation, chunk or physical byte outlived the cache that held it."""


def granule_span(offset: int, size: int, granule: int) -> range:
    """Granules that bytes [offset, offset+size) touch."""
    return range(offset // granule, -(-(offset + size) // granule)) if size else range(0)


def readback_physical_bytes(tensor: ExtensibleTensor, read_back: list) -> int:
    """Mapped bytes as the driver or kernel reads them back (`read_back` from
    `read_back_granules`): granules whose first byte something backs, times
    the granularity."""
    return sum(identity is not None for identity in read_back[::2]) * tensor.granularity


def _mismatches(actual: torch.Tensor, expected: torch.Tensor) -> int:
    expected = expected.to(actual.device)
    # torch.equal is a fast comparison; counting is only for the message.
    return 0 if torch.equal(actual, expected) else int((actual != expected).count_nonzero())


# -- the tensor -----------------------------------------------------------------
class TensorModel:
    """What an ExtensibleTensor must hold, in plain Python: committed bytes per
    segment, and the bytes of every mapped granule."""

    def __init__(self, capacities: list[int], granule: int, fresh_byte: int | None):
        self.capacities = capacities
        self.granule = granule
        self.fresh_byte = fresh_byte
        self.offsets = [sum(capacities[:i]) for i in range(len(capacities))]
        self.sizes = [0] * len(capacities)
        #: granule index -> its bytes (fresh_byte, or 0 standing for "unknown"
        #: when fresh memory is not known).
        self.memory: dict[int, bytearray] = {}

    def grow(self, sizes: list[int], zero_new: bool) -> None:
        for i, size in enumerate(sizes):
            old = self.sizes[i]
            if size <= old:
                continue
            for index in granule_span(self.offsets[i] + old, size - old, self.granule):
                if index not in self.memory:
                    self.memory[index] = bytearray([self.fresh_byte or 0]) * self.granule
            if zero_new:
                self.write(self.offsets[i] + old, self.offsets[i] + size, 0)
            self.sizes[i] = size

    def write(self, start: int, end: int, value: int) -> None:
        """Bytes [start, end) of the reservation, all mapped, become `value`."""
        g = self.granule
        while start < end:
            index, within = divmod(start, g)
            stop = min(end, (index + 1) * g)
            self.memory[index][within : within + stop - start] = bytes([value]) * (stop - start)
            start = stop

    def read(self, start: int, end: int) -> bytes:
        """Bytes [start, end) of the reservation, all mapped."""
        g = self.granule
        pieces = []
        for index in range(start // g, -(-end // g)):
            low, high = max(start, index * g) - index * g, min(end, (index + 1) * g) - index * g
            pieces.append(bytes(self.memory[index][low:high]))
        return b"".join(pieces)

    def shrink(self, sizes: list[int], mapped: frozenset[int]) -> None:
        """`shrink_segments_(sizes)`: the sizes drop, and the `mapped`
        granules keep their bytes, the rest are gone. Which granules stay
        depends on how the tensor cut its chunks, which the model does not
        know: the caller reads them back from the driver, once it has
        checked that each chunk left holds a kept byte."""
        self.sizes = list(sizes)
        self.memory = {index: data for index, data in self.memory.items() if index in mapped}

    def release(self, kept: frozenset[int] = frozenset()) -> None:
        """Nothing committed; the `kept` granules (a release that failed part
        way left them mapped) keep their bytes."""
        self.sizes = [0] * len(self.capacities)
        self.memory = {index: data for index, data in self.memory.items() if index in kept}


def check_tensor_sizes(tensor: ExtensibleTensor, model: TensorModel) -> None:
    assert tensor.segment_sizes == model.sizes, f"segment sizes {tensor.segment_sizes}, model {model.sizes}"


def check_addresses_fixed(tensor: ExtensibleTensor, offsets: list[int], base: int) -> None:
    """The base, the full view and every committed segment view sit where
    they sat at the start: `base`, and `base + offsets[i]` for segment i."""
    assert tensor.base == base, f"base moved from {base:#x} to {tensor.base:#x}"
    assert tensor.full_view().data_ptr() == base, f"full view at {tensor.full_view().data_ptr():#x}, base {base:#x}"
    for i, offset in enumerate(offsets):
        view = tensor.segment_view(i)
        if view.numel():
            assert view.data_ptr() == base + offset, f"segment {i} at {view.data_ptr():#x}, expected {base + offset:#x}"


def check_tensor_contents(tensor: ExtensibleTensor, model: TensorModel) -> None:
    """Committed bytes as the model says; with a known poison byte, every
    mapped byte too."""
    for i, (offset, size) in enumerate(zip(model.offsets, model.sizes)):
        if size:
            expected = torch.frombuffer(bytearray(model.read(offset, offset + size)), dtype=torch.uint8)
            wrong = _mismatches(tensor.segment_view(i), expected)
            assert wrong == 0, f"segment {i}: {wrong} of {size} committed bytes differ from the model"
    if model.fresh_byte is None:
        return
    g = model.granule
    for index, content in sorted(model.memory.items()):
        wrong = _mismatches(tensor.driver.view(tensor.base + index * g, g), torch.frombuffer(content, dtype=torch.uint8))
        assert wrong == 0, f"granule {index}: {wrong} of {g} mapped bytes differ from the model"


def check_tensor_physical_bytes(tensor: ExtensibleTensor, model: TensorModel, read_back: list) -> None:
    expected = len(model.memory) * model.granule
    assert tensor.physical_bytes == expected, f"physical_bytes {tensor.physical_bytes}, model {expected}"
    read_back = readback_physical_bytes(tensor, read_back)
    assert read_back == expected, f"driver reads back {read_back} mapped bytes, model {expected}"


# -- the KV cache ---------------------------------------------------------------
class CacheModel:
    """What an ExtensibleKVCache must hold, in plain Python."""

    def __init__(self, capacity: int, offsets: list[int], strides: list[int], granule: int):
        self.capacity = capacity
        self.offsets = offsets
        self.strides = strides
        self.granule = granule
        self.committed = 0
        #: False after release_physical until something maps again.
        self.mapped = True
        #: block -> the byte every row of it holds; absent blocks read zero.
        self.values: dict[int, int] = {}
        #: Leading blocks whose segments must each be backed by one chunk.
        self.one_chunk_blocks = 0
        #: Granules mapped past every committed block's: the rest of the
        #: chunks a preserving shrink kept whole, as read back then, until
        #: something releases them.
        self.extra_granules: frozenset[int] = frozenset()

    def sizes(self, num_blocks: int) -> list[int]:
        return [num_blocks * stride for stride in self.strides]

    def block_values(self, num_blocks: int) -> torch.Tensor:
        """The byte each of the first `num_blocks` blocks holds (uint8, on the CPU)."""
        values = torch.zeros(num_blocks, dtype=torch.uint8)
        for block, value in self.values.items():
            if block < num_blocks:
                values[block] = value
        return values

    def granules(self, num_blocks: int) -> set[int]:
        """Granules the first `num_blocks` blocks of every segment touch."""
        return {
            index
            for offset, size in zip(self.offsets, self.sizes(num_blocks))
            for index in granule_span(offset, size, self.granule)
        }

    def physical_bytes(self, *, extra: bool = True) -> int:
        """Mapped bytes: the committed blocks' granules, and (with `extra`)
        those a preserving shrink kept mapped past them."""
        if not self.mapped:
            return 0
        granules = self.granules(self.committed)
        return len(granules | self.extra_granules if extra else granules) * self.granule

    def grow(self, num_blocks: int) -> None:
        """A commit past the committed count: maps and zeroes the new blocks
        (every block, after a release). From nothing mapped, each segment is
        one run of granules, so one chunk."""
        if num_blocks <= self.committed:
            return
        if not self.mapped or self.committed == 0:
            self.one_chunk_blocks = num_blocks
        self.committed = num_blocks
        self.mapped = True

    def remap(self) -> None:
        """recommit() after a release: every committed block, fresh and zero."""
        self.mapped = True
        self.one_chunk_blocks = self.committed

    def shrink_keeping(self, num_blocks: int, mapped: frozenset[int]) -> None:
        """A preserving shrink to `num_blocks` at most the committed count:
        blocks below keep their values; while mapped, the `mapped` granules
        (read back from the driver once checked: every chunk left holds a
        kept byte) stay, those past the kept blocks' granules as extra."""
        self.committed = num_blocks
        self.values = {block: value for block, value in self.values.items() if block < num_blocks}
        self.one_chunk_blocks = min(self.one_chunk_blocks, num_blocks)
        if self.mapped:
            self.extra_granules = frozenset(mapped - self.granules(num_blocks))

    def discard(self, num_blocks: int) -> None:
        """Release everything, then commit `num_blocks` fresh blocks."""
        self.release()
        self.committed = 0
        self.mapped = True
        self.grow(num_blocks)

    def release(self) -> None:
        self.mapped = False
        self.values.clear()
        self.one_chunk_blocks = 0
        self.extra_granules = frozenset()


def check_cache_committed(kv_cache: ExtensibleKVCache, model: CacheModel) -> None:
    assert kv_cache.num_committed_blocks == model.committed, (
        f"{kv_cache.num_committed_blocks} blocks committed, model {model.committed}"
    )
    expected = model.sizes(model.committed) if model.mapped else model.sizes(0)
    sizes = kv_cache.buffer.segment_sizes
    assert sizes == expected, f"segment sizes {sizes}, model {expected}"


#: Bytes of a segment compared at once: a comparison on a GPU allocates a
#: temporary as large as what it compares, and a stress run may leave the
#: device nearly full.
COMPARE_BYTES = 32 << 20


def _rows_hold(rows: torch.Tensor, expected: torch.Tensor) -> bool:
    """Every byte of row i of `rows` (uint8) is `expected[i, 0]`. Compared
    as int64 words where the row length and alignment allow: equal exactly
    when the bytes are, with an eighth of the elements (a 32 MiB slice
    against its expanded values took 14 ms as bytes, 2.4 ms as words, on a
    2-core x86-64 host)."""
    n, stride = rows.shape
    if stride % 8 or rows.storage_offset() % 8 or not rows.is_contiguous():
        return torch.equal(rows, expected.expand(n, stride))
    word = expected.expand(n, 8).contiguous().view(torch.int64)  # each row's byte, 8 times
    return torch.equal(rows.view(torch.int64), word.expand(n, stride // 8))


def check_cache_blocks(
    kv_cache: ExtensibleKVCache, model: CacheModel, first: int, end: int, what: str, *, on_host: bool = False
) -> None:
    """Blocks [first, end) hold the model's value in every row of every
    segment (zero where nothing was written); a difference is a
    `ContentMismatch` that counts the blocks, never prints bytes. `on_host`
    compares copies in host memory (through `host_staging`), taking no
    device memory at all."""
    device = kv_cache.buffer.device
    values = model.block_values(end).to("cpu" if on_host else device)
    for segment, stride in enumerate(model.strides):
        view = kv_cache.buffer.segment_view(segment)
        step = max(COMPARE_BYTES // stride, 1)
        staging = torch_memory.host_staging(device, (min(step, end - first), stride)) if on_host else None
        wrong_rows = zero_rows = 0
        for low in range(first, end, step):
            high = min(low + step, end)
            rows = view[low * stride : high * stride].view(high - low, stride)
            if staging is not None:
                rows = staging[: high - low].copy_(rows)
            expected = values[low:high, None]
            if _rows_hold(rows, expected):
                continue
            wrong = (rows != expected).any(dim=1)
            wrong_rows += int(wrong.count_nonzero())
            zero_rows += int((wrong & (expected[:, 0] == 0)).count_nonzero())
        if wrong_rows:
            raise ContentMismatch(
                f"{what}: segment {segment}: {wrong_rows} of {end - first} blocks from block {first} differ from "
                f"the model, {zero_rows} of them should read zero"
            )


def check_cache_physical_bytes(kv_cache: ExtensibleKVCache, model: CacheModel, read_back: list) -> None:
    expected = model.physical_bytes()
    assert kv_cache.physical_bytes == expected, f"physical_bytes {kv_cache.physical_bytes}, model {expected}"
    read_back = readback_physical_bytes(kv_cache.buffer, read_back)
    assert read_back == expected, f"driver reads back {read_back} mapped bytes, model {expected}"
    if model.mapped:
        booked, prefix = kv_cache.physical_bytes_for(model.committed), model.physical_bytes(extra=False)
        assert booked == prefix, f"physical_bytes_for({model.committed}) = {booked}, model {prefix}"


def check_cache_one_chunk_per_segment(kv_cache: ExtensibleKVCache, model: CacheModel, one: list[bool] | None = None) -> None:
    """`one`: `readback_one_chunk_per_segment` of the model's one-chunk
    prefix, read back just before, to spare a second read."""
    if not model.mapped or model.one_chunk_blocks == 0:
        return
    if one is None:
        one = readback_one_chunk_per_segment(kv_cache.buffer, model.sizes(model.one_chunk_blocks))
    assert all(one), f"after the last defragment, shrink or fresh commit of {model.one_chunk_blocks} blocks: one chunk per segment, read back: {one}"
