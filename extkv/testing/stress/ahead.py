"""Decode beside commit-ahead: an engine's growth pattern with the worker on.

Theory of operation
-------------------
`decode_beside_commit_ahead` runs episodes on one cache (over poisoned
memory) with commit-ahead on (extkv.ahead). An episode decodes tokens as an
engine does: the block of each new position is committed just before its
first write, checked to read zero (over poison: zeroing is extkv's, and the
worker's), then written with its pattern (one never-zero byte per block and
segment). Now and then, at seeded random steps, the engine shrinks (a
preemption: every block discarded), sleeps and wakes (every block zero
after), or changes the window; either way decode starts again from block 0.
Every CHECK_EVERY steps and at the end of an episode, once the worker is
idle: every committed block reads back from the driver as mapped and holds
its pattern or zero as the model says, the driver's read-back partitions
the reservation as the bookkeeping does, and the usage probe reads
`physical_bytes`. After the cache is freed the
probe is back at its baseline and no worker thread is left.
"""

from __future__ import annotations

import random
import threading

import torch

from ...cache import ExtensibleKVCache
from ...layout import KVCacheLayout
from ..checks import check_committed_blocks_mapped, check_readback_matches_bookkeeping, read_back_granules
from ..configs import config_for
from ..modelled_cache import capacity_for
from ..models import ContentMismatch, LeakFound
from .base import stress_driver, warmed_probe
from .bounds import Floor
from .tally import StressTally

#: Tokens per block of the workload's sequence, steps of an episode, and
#: how often the whole cache is checked.
TOKENS_PER_BLOCK = 4
EPISODE_STEPS = 400
CHECK_EVERY = 100
#: The least episode count a spent bound still runs.
LEAST_AHEAD_EPISODES = 1
#: Seconds to wait for the worker to go idle before a check.
IDLE_PATIENCE_S = 30.0


def _pattern(block: int, segment: int) -> int:
    return (block * 7 + 31 * segment) % 251 + 1


def _block_rows(kv_cache: ExtensibleKVCache, segment: int, block: int) -> torch.Tensor:
    stride = kv_cache.segment_strides[segment]
    return kv_cache.buffer.segment_view(segment)[block * stride : (block + 1) * stride]


def _wait_idle(kv_cache: ExtensibleKVCache, window: int) -> None:
    """Until the worker has grown its whole window (the capacity caps it)."""
    want = min(kv_cache.num_committed_blocks + window, kv_cache.capacity_blocks)
    if not kv_cache.settle_commit_ahead(IDLE_PATIENCE_S):
        raise AssertionError(f"the worker never went idle in {IDLE_PATIENCE_S} s: grown {kv_cache.grown_blocks} of {want}")
    if kv_cache.physical_bytes and kv_cache.grown_blocks < want:
        raise AssertionError(f"the worker went idle at {kv_cache.grown_blocks} of {want} blocks")


def decode_beside_commit_ahead(
    device: torch.device | str,
    tally: StressTally,
    *,
    seed: int,
    until: float | None = None,
    episodes: int | None = None,
    layout: KVCacheLayout = KVCacheLayout.LBHNC,
) -> int:
    """Episodes until `until` (time.monotonic) or `episodes` of them; returns
    how many ran. `until` is a floor for LEAST_AHEAD_EPISODES."""
    if until is None and episodes is None:
        raise ValueError("decode_beside_commit_ahead needs a bound: until= or episodes=")
    device = torch.device(device)
    rng = random.Random(seed)
    tally.seeds.append(seed)
    probe = warmed_probe(device)
    baseline = probe.read_outside_torch()
    driver = stress_driver(device)
    capacity = 4 * capacity_for("full", layout, driver.granularity)
    kv_cache = ExtensibleKVCache(config_for("full", layout, capacity), driver, layout)
    segments = len(kv_cache.segment_strides)
    written: set[int] = set()
    ran = 0
    floor = Floor(until, lambda: ran >= LEAST_AHEAD_EPISODES)

    def check(where: str, window: int) -> None:
        _wait_idle(kv_cache, window)
        with kv_cache.buffer.lock:
            read_back = read_back_granules(kv_cache.buffer)
            # Before the contents: they are read through the committed blocks.
            check_committed_blocks_mapped(kv_cache, read_back)
            committed = kv_cache.num_committed_blocks
            wrong = 0
            for segment in range(segments if committed else 0):
                rows = kv_cache.buffer.segment_view(segment)[: committed * kv_cache.segment_strides[segment]]
                rows = rows.view(committed, -1)
                expected = torch.tensor(
                    [_pattern(b, segment) if b in written else 0 for b in range(committed)], dtype=torch.uint8
                ).to(rows.device)
                wrong += int((rows != expected[:, None]).any(dim=1).sum())
            if wrong:
                raise ContentMismatch(f"{where}: {wrong} (block, segment) rows differ from the model")
            check_readback_matches_bookkeeping(kv_cache.buffer, read_back)
            measured = probe.read_outside_torch() - baseline
            if measured != kv_cache.physical_bytes:
                raise LeakFound(f"{where}: {probe.source} reads {measured} bytes, the cache maps {kv_cache.physical_bytes}")
        tally.checks["beside commit-ahead: every block, read-back, usage probe"] += 1
        tally.observe_physical(kv_cache.physical_bytes)

    try:
        kv_cache.commit(1)
        window = rng.choice([4, 16, 64])
        kv_cache.commit_ahead(window, step_blocks=rng.choice([1, 4, 16]))
        tally.settings["commit-ahead windows (blocks)"] = "4, 16 or 64"
        while (episodes is None or ran < episodes) and floor.more():
            where = f"episode {ran} (seed {seed})"
            position = 0
            for step in range(EPISODE_STEPS):
                block = position // TOKENS_PER_BLOCK
                if block >= capacity:
                    break
                if position % TOKENS_PER_BLOCK == 0:
                    kv_cache.commit(block + 1)
                    for segment in range(segments):
                        rows = _block_rows(kv_cache, segment, block)
                        if block not in written and bool(rows.any()):
                            raise ContentMismatch(f"{where}, step {step}: block {block} of segment {segment} is not zero before its first write")
                        rows.fill_(_pattern(block, segment))
                    written.add(block)
                    tally.operations["commit-ahead: commit the next block"] += 1
                position += 1
                roll = rng.random()
                if roll < 0.01:
                    kv_cache.commit(rng.randrange(0, block + 1), shrink=True)
                    written.clear()
                    position = 0
                    tally.operations["commit-ahead: shrink (preemption)"] += 1
                elif roll < 0.015:
                    kv_cache.release_physical()
                    kv_cache.recommit()
                    written.clear()
                    position = 0
                    tally.operations["commit-ahead: sleep and wake"] += 1
                elif roll < 0.02:
                    window = rng.choice([4, 16, 64])
                    kv_cache.commit_ahead(window, step_blocks=rng.choice([1, 4, 16]))
                    tally.operations["commit-ahead: new window"] += 1
                if step % CHECK_EVERY == CHECK_EVERY - 1:
                    check(f"{where}, step {step}", window)
            check(f"{where}, end", window)
            ran += 1
            # The next episode starts from an empty cache.
            kv_cache.commit(0, shrink=True)
            written.clear()
    except Exception as error:
        tally.fail(error, f"seed {seed}, episode {ran}")
        raise
    finally:
        kv_cache.free()
    measured = probe.read_outside_torch() - baseline
    left = [t.name for t in threading.enumerate() if t.name == "extkv-commit-ahead"]
    if measured or left:
        error = LeakFound(f"after free: {probe.source} reads {measured} bytes above baseline; workers left: {left}")
        tally.fail(error)
        raise error
    tally.checks["beside commit-ahead: nothing left after free"] += 1
    floor.close(tally, "decode beside commit-ahead", f"{LEAST_AHEAD_EPISODES} episode of {EPISODE_STEPS} steps")
    return ran
