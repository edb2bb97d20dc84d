"""A decode loop whose KV cache grows from an eighth to full: what growth
costs an engine's step, with and without commit-ahead.

Theory of operation
-------------------
The step is a fixed piece of device work standing in for a model's decode
step: on a GPU a CUDA graph of GPU_STEP_MATMULS bf16 matmuls (about 3.3 ms
on the H200), on the host a small float32 matmul. The loop runs `steps`
steps; before each, the engine commits what its sequences need: an eighth
of the capacity at the start, the full capacity at the end, in
`growth_commits` equal commits spread evenly over the loop. A step's time
is wall time from its commit to the device's synchronize after the step,
so a commit made inline is paid by its step. Modes, in the rows of a
Williams design over rounds (extkv.benchmarking.rounds):

- `no growth`: the whole capacity committed before the loop; the floor.
- `inline`: extkv's `commit` on the engine's thread (what an engine does
  without commit-ahead).
- `ahead`: the same commits with commit-ahead on (`commit_ahead(window)`,
  a window of two commits' blocks): the worker maps and zeroes beside the
  steps.
- `per granule`: the raw driver sequence with one handle per granule
  (`GranuleStore`, the kvcached / vAttention strategy), inline.

Two more modes take commit-ahead's worker apart (`BESIDE_MODES`): no cache
grows under the steps; a thread beside them does, at each growth commit,
one half of what the worker does for it, on the raw sequence of the same
segments (extkv.benchmarking.raw):

- `beside driver calls`: create, map and set access for the new granules,
  nothing zeroed (`MapOnlyStore`).
- `beside zeroing`: the new bytes zeroed on a stream of the thread's own,
  as the worker zeroes, on memory mapped before the loop (`ZeroOnlyStore`).

What each adds to the p99 step, beside what `ahead` adds, says where the
worker's cost to the steps lies: in the driver's calls or in the zeroing's
share of the device.

One more (`SHORT_SWITCH_MODE`) runs `ahead` with the interpreter's switch
interval at SHORT_SWITCH_S for the round instead of 5 ms: what it takes off
`ahead`'s p99 is the steps' wait for the GIL behind the worker. Each step
of the worker alternates short driver calls, which let the GIL go, with the
Python between them, which takes it back before a thread waiting for it
wakes; so the loop's thread, back from its synchronize, can wait until the
worker's step ends, and with a short interval it asks for the GIL sooner.
On the H100 (600 steps, two rounds, a ceiling read per worker step) `ahead`
read 1.101x the no-growth p99 and this mode 1.029x.

Between rounds every cache is freed, so each round after the first meets
memory a previous round released (*recycled*): on the H200 a create right
after a large release took 10-150 ms. Each mode but those beside also
runs once in a new process of its own
(`python -m extkv.benchmarking.growth_loop`), on memory never used before
(*fresh*).
Per mode: the least p50 and least p99 over the recycled rounds, the fresh
round's, and what growth added in total (the sum of step times less
`steps` times the no-growth p50), beside the time the device takes to zero
the grown bytes on a plain allocation (its memset floor).
"""

from __future__ import annotations

import json
import queue
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import torch

from ..cache import ExtensibleKVCache
from ..vmm import driver_for
from .decode import p99
from .geometry import GEOMETRIES
from .primitives import synchronize
from .raw import GranuleStore, MapOnlyStore, RawStore, ZeroOnlyStore
from .rounds import round_order

MODES = ("no growth", "inline", "ahead", "per granule")
#: Modes with one half of commit-ahead's worker beside the steps, and no cache growing.
BESIDE_MODES = ("beside driver calls", "beside zeroing")
#: `ahead` with the switch interval at SHORT_SWITCH_S (see the theory).
SHORT_SWITCH_MODE = "ahead, 50 us switch interval"
SHORT_SWITCH_S = 50e-6
#: The modes that take commit-ahead's cost apart; none runs on fresh memory.
APART_MODES = BESIDE_MODES + (SHORT_SWITCH_MODE,)
#: Matmuls of the GPU step: 16 of 4096 x 4096 bf16 took 3.3 ms on the H200.
GPU_STEP_MATMULS = 16
GPU_STEP_SIZE = 4096


@dataclass(frozen=True)
class Setting:
    geometry: str
    capacity_bytes: int
    steps: int
    growth_commits: int
    rounds: int


#: 32 GiB of a 32-layer cache grown from 4 GiB in 28 commits of 1 GiB over
#: 600 steps (one commit every 21 steps).
GPU_SETTING = Setting("lbhnc32", 32 << 30, steps=600, growth_commits=28, rounds=3)
HOST_SETTING = Setting("blhnc1", 256 << 20, steps=120, growth_commits=14, rounds=2)
QUICK_SETTING = Setting("blhnc1", 64 << 20, steps=24, growth_commits=7, rounds=1)


def setting_for(profile: str, device: torch.device | str) -> Setting:
    if profile == "quick":
        return QUICK_SETTING
    return GPU_SETTING if torch.device(device).type == "cuda" else HOST_SETTING


def make_step(device: torch.device):
    """The step: a call that queues a fixed piece of device work."""
    if device.type != "cuda":
        a = torch.randn(256, 256)
        return lambda: a @ a
    a = torch.randn(GPU_STEP_SIZE, GPU_STEP_SIZE, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(a)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        torch.matmul(a, a, out=out)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GPU_STEP_MATMULS):
            torch.matmul(a, a, out=out)
    return graph.replay


def schedule(setting: Setting, capacity: int) -> list[int]:
    """Blocks the engine has committed before each step."""
    start = capacity // 8
    per = -(-(capacity - start) // setting.growth_commits)
    every = setting.steps // (setting.growth_commits + 1)
    return [min(capacity, start + per * min(setting.growth_commits, i // every)) for i in range(setting.steps)]


class Beside:
    """A thread growing `store` to each count `grow` is given, one after
    another, its device work on a stream of its own, as commit-ahead's
    worker grows beside the steps; `close` waits for it and frees the store."""

    def __init__(self, store: RawStore, device: torch.device):
        self.store, self.driver = store, driver_for(device)
        self.counts: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self.grown = store.blocks
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._grow_each, name="growth loop beside", daemon=True)
        self.thread.start()

    def _grow_each(self) -> None:
        try:
            with self.driver.side_stream():
                while (blocks := self.counts.get()) is not None:
                    self.store.grow(blocks)
        except BaseException as error:  # raised by close, on the loop's thread
            self.failure = error

    def grow(self, blocks: int) -> None:
        if blocks > self.grown:
            self.counts.put(blocks)
            self.grown = blocks

    def close(self) -> None:
        self.counts.put(None)
        self.thread.join()
        try:
            if self.failure is not None:
                raise RuntimeError(f"the thread beside the loop failed: {self.failure!r}") from self.failure
        finally:
            self.store.prims.synchronize()
            self.store.close()


def run_mode(mode: str, device: torch.device, setting: Setting, step) -> list[float]:
    """One round of one mode: the step times (s)."""
    geometry = GEOMETRIES[setting.geometry]
    capacity = max(8, setting.capacity_bytes // geometry.bytes_per_block)
    wanted = schedule(setting, capacity)
    times = []
    if mode in BESIDE_MODES:
        store = (MapOnlyStore if mode == "beside driver calls" else ZeroOnlyStore)(device, geometry.strides(), capacity)
        store.open()
        try:
            store.grow(wanted[0])
        except BaseException:
            store.close()
            raise
        beside = Beside(store, device)
        grow, close = beside.grow, beside.close
    elif mode == "per granule":
        store = GranuleStore(device, geometry.strides(), capacity)
        store.open()
        grow, close = store.grow, store.close
    else:
        cache = ExtensibleKVCache(geometry.config(capacity), driver_for(device), geometry.layout)
        grow, close = cache.commit, cache.free
    interval = sys.getswitchinterval()
    try:
        if mode not in BESIDE_MODES:
            grow(capacity if mode == "no growth" else wanted[0])
        if mode in ("ahead", SHORT_SWITCH_MODE):
            cache.commit_ahead(2 * (wanted[-1] - wanted[0]) // setting.growth_commits)
        if mode == SHORT_SWITCH_MODE:
            sys.setswitchinterval(SHORT_SWITCH_S)
        synchronize(device)
        for blocks in wanted:
            start = time.perf_counter()
            grow(blocks)
            step()
            synchronize(device)
            times.append(time.perf_counter() - start)
    finally:
        sys.setswitchinterval(interval)
        close()
    return times


def run_fresh(mode: str, device: torch.device, profile: str) -> list[float]:
    """One round of `mode` in a new process: on memory this process never used."""
    command = [sys.executable, "-m", "extkv.benchmarking.growth_loop", mode, str(device), profile]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=FRESH_TIMEOUT_S)
    if finished.returncode != 0:
        raise RuntimeError(f"the fresh {mode} round exited {finished.returncode}: {finished.stderr[-2000:]}")
    return json.loads(finished.stdout.splitlines()[-1])


def memset_floor(device: torch.device, num_bytes: int) -> float:
    """Seconds the device takes to zero `num_bytes` of a plain allocation."""
    buffer = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    buffer.zero_()
    synchronize(device)
    start = time.perf_counter()
    buffer.zero_()
    synchronize(device)
    seconds = time.perf_counter() - start
    del buffer
    return seconds


def run(device: torch.device | str, profile: str, progress=print) -> dict:
    """Every mode, the profile's rounds on recycled memory and one fresh
    round each; the summary per mode."""
    device = torch.device(device)
    setting = setting_for(profile, device)
    step = make_step(device)
    for _ in range(3):
        step()
    synchronize(device)
    rounds: dict[str, list[list[float]]] = {mode: [] for mode in MODES + APART_MODES}
    for r in range(setting.rounds):
        for mode in round_order(MODES + APART_MODES, r):
            times = run_mode(mode, device, setting, step)
            rounds[mode].append(times)
            progress(f"growth loop round {r + 1}/{setting.rounds} {mode}: p50 {statistics.median(times) * 1e3:.3f} ms, "
                     f"p99 {p99(times) * 1e3:.3f} ms")
    fresh = {}
    for mode in MODES:
        fresh[mode] = run_fresh(mode, device, profile)
        progress(f"growth loop fresh {mode}: p50 {statistics.median(fresh[mode]) * 1e3:.3f} ms, "
                 f"p99 {p99(fresh[mode]) * 1e3:.3f} ms")
    geometry = GEOMETRIES[setting.geometry]
    capacity = max(8, setting.capacity_bytes // geometry.bytes_per_block)
    wanted = schedule(setting, capacity)
    grown_bytes = (wanted[-1] - wanted[0]) * geometry.bytes_per_block
    floor_p50 = min(statistics.median(t) for t in rounds["no growth"])
    summary = {
        mode: {
            "p50_s": min(statistics.median(t) for t in seen),
            "p99_s": min(p99(t) for t in seen),
            "added_s": min(sum(t) - len(t) * floor_p50 for t in seen),
        } | ({"fresh_p50_s": statistics.median(fresh[mode]), "fresh_p99_s": p99(fresh[mode])} if mode in fresh else {})
        for mode, seen in rounds.items()
    }
    return {"format": "extkv-bench-growth/1", "device": str(device), "torch": torch.__version__,
            "setting": setting.__dict__, "grown_bytes": grown_bytes,
            "memset_s": memset_floor(device, grown_bytes), "modes": summary}


#: Seconds a fresh round's process may take.
FRESH_TIMEOUT_S = 300


if __name__ == "__main__":
    # `python -m extkv.benchmarking.growth_loop MODE DEVICE PROFILE`: one
    # round of MODE on fresh memory; its step times as JSON, last line.
    mode, device, profile = sys.argv[1], torch.device(sys.argv[2]), sys.argv[3]
    step = make_step(device)
    print(json.dumps(run_mode(mode, device, setting_for(profile, device), step)))
