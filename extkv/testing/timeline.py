"""A KV cache's life on one device, with physical memory read outside extkv
all the way through.

Theory of operation
-------------------
`run_timeline` drives one realistic-ish cache (16-token blocks, 8 KV heads
of 128, bf16, layer-outermost, so one segment per layer) through the
lifecycle an engine puts it through: allocate, grow in steps as warmup does,
shrink, defragment discarding, grow again, defragment preserving, sleep
(`release_physical`), wake (`recommit`), free. `LIFECYCLE` is that script, as
data. The cache is sized to the device (`GEOMETRY`: a few GiB on a GPU, tens
of MiB on the host driver, never more than a quarter of what is free).

A background thread reads the `UsageProbe` (NVML per process on CUDA, the
kernel's memfd pages on the host) every few milliseconds; each operation
also takes a reading when it starts and when it ends, beside the cache's own
`physical_bytes`. Every reading is the probe's outside-torch usage minus the
reading taken before the cache existed. The readings at each operation's
start and end are its `Mark`: invariant 5 says the two numbers of a mark
agree. The samples in between show what the operation held while it ran (a
preserving defragment briefly holds a segment twice).

`Timeline.write` leaves the whole record as `timeline-<device>.json` in a
report directory; `Timeline.load` reads it back for the report's plot. A
report directory may come from anyone: `load` reads a regular file only,
never through a symlink, at most MOST_TIMELINE_BYTES of it, and checks
every field, so a file that is not what `write` wrote is one ValueError
naming the file and the field.

Only driving the cache needs torch: `timeline_capacity` and `run_timeline`
import the cache, its layout and the drivers when they run, so that reading
a timeline back (`extkv report`) imports no torch.
"""

from __future__ import annotations

import json
import math
import re
import reprlib
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..files import read_regular_file

if TYPE_CHECKING:
    import torch

    from ..layout import FullAttentionSpec, KVCacheLayout
    from ..usage import UsageProbe

#: Format tag of the JSON files.
TIMELINE_FORMAT = "extkv-timeline/1"
#: Glob of the files in a report directory.
TIMELINE_GLOB = "timeline-*.json"
#: Per driver kind: (layers, the most bytes the cache may span).
GEOMETRY = {"cuda": (32, 4 << 30), "host": (2, 64 << 20)}
#: Never span more than this share of the device's free memory.
FREE_SHARE = 0.25
#: Blocks are a multiple of this, so every step of LIFECYCLE is whole.
BLOCK_QUANTUM = 16
#: Seconds between background readings.
SAMPLE_INTERVAL_S = 0.004
#: Seconds the lifecycle waits, at its end, for the sampler's first reading: a net against hangs.
SAMPLER_PATIENCE_S = 60
#: The largest timeline file `Timeline.load` reads: a lifecycle takes a few
#: thousand readings of some 30 bytes each, well under a MiB.
MOST_TIMELINE_BYTES = 64 << 20

#: (label, operation, share of the capacity to commit, commit flags).
LIFECYCLE: list[tuple[str, str, float | None, dict]] = [
    ("allocate", "allocate", None, {}),
    ("grow to 1/8", "commit", 1 / 8, {}),
    ("grow to 1/4", "commit", 1 / 4, {}),
    ("grow to 1/2", "commit", 1 / 2, {}),
    ("grow to 3/4", "commit", 3 / 4, {}),
    ("shrink to 1/4", "commit", 1 / 4, {"shrink": True}),
    ("grow to 1/2", "commit", 1 / 2, {}),
    ("defragment, discarding", "commit", 1 / 2, {"defragment": True}),
    ("grow to full", "commit", 1, {}),
    ("defragment, preserving", "commit", 1, {"defragment": True, "preserve_contents": True}),
    ("release_physical (sleep)", "release_physical", None, {}),
    ("recommit (wake)", "recommit", None, {}),
    ("free", "free", None, {}),
]


@dataclass
class Mark:
    """One operation: when it ran, and both readings at its start and end."""

    operation: str
    start_s: float
    end_s: float
    outside_start: int
    outside_end: int
    physical_bytes_start: int
    physical_bytes_end: int
    committed_blocks_end: int


@dataclass
class Timeline:
    device: str
    source: str
    geometry: dict
    #: (seconds since the first operation, outside usage over the baseline).
    samples: list[tuple[float, int]] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)

    def disagreements(self) -> list[str]:
        """Every mark whose outside reading differs from physical_bytes."""
        found = []
        for mark in self.marks:
            for when, outside, booked in (
                ("start", mark.outside_start, mark.physical_bytes_start),
                ("end", mark.outside_end, mark.physical_bytes_end),
            ):
                if outside != booked:
                    found.append(f"{mark.operation} ({when}): outside {outside} bytes, physical_bytes {booked}")
        return found

    def write(self, directory: Path) -> Path:
        path = Path(directory) / f"timeline-{re.sub(r'[^a-z0-9]+', '-', self.device.lower()).strip('-')}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"format": TIMELINE_FORMAT, **asdict(self)}) + "\n")
        return path

    @classmethod
    def load(cls, path: Path) -> Timeline:
        """Read a file `write` wrote; ValueError naming the file and what
        it lacks otherwise."""
        path = Path(path)
        data = read_regular_file(path, MOST_TIMELINE_BYTES, "a memory timeline")
        try:
            document = json.loads(data)
        except (ValueError, RecursionError) as error:  # nested past the parser's depth: RecursionError
            raise ValueError(f"{path}: not a memory timeline (not JSON: {error})") from None
        try:
            return cls._from_document(document)
        except ValueError as error:
            raise ValueError(f"{path}: not a memory timeline ({error})") from None

    @classmethod
    def _from_document(cls, document: object) -> Timeline:
        """The Timeline `document` holds; ValueError naming the first field
        that is not what `write` writes. Every field is checked here, so a
        garbled file is refused by name, not by a TypeError deep in a plot."""
        if not isinstance(document, dict):
            raise ValueError(f"a JSON {type(document).__name__}, expected an object")
        if document.get("format") != TIMELINE_FORMAT:
            raise ValueError(f"format {_shown(document.get('format'))}, expected {TIMELINE_FORMAT!r}")
        geometry = _field(document, "geometry", dict, "an object")
        for key, kind, words in _GEOMETRY_FIELDS:
            _field(geometry, key, kind, words, "geometry.")
        samples = _field(document, "samples", list, "a list")
        for number, sample in enumerate(samples):
            if not (isinstance(sample, list) and len(sample) == 2 and _is_seconds(sample[0]) and _is_bytes(sample[1])):
                raise ValueError(f"samples[{number}] is {_shown(sample)}, expected [seconds, bytes]")
        marks = []
        for number, mark in enumerate(_field(document, "marks", list, "a list")):
            if not isinstance(mark, dict):
                raise ValueError(f"marks[{number}] is {_shown(mark)}, expected an object")
            marks.append(
                Mark(**{name: _field(mark, name, *_MARK_FIELDS[name], f"marks[{number}].") for name in _MARK_FIELDS})
            )
        return cls(
            device=_field(document, "device", str, "a string"),
            source=_field(document, "source", str, "a string"),
            geometry=geometry,
            samples=[(float(seconds), int(used)) for seconds, used in samples],
            marks=marks,
        )


def _is_seconds(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_bytes(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


#: Each field of a Mark: (its type, the words an error says it should be).
_MARK_FIELDS = {
    "operation": (str, "a string"),
    "start_s": (_is_seconds, "a finite number of seconds"),
    "end_s": (_is_seconds, "a finite number of seconds"),
    "outside_start": (_is_bytes, "an integer number of bytes"),
    "outside_end": (_is_bytes, "an integer number of bytes"),
    "physical_bytes_start": (_is_bytes, "an integer number of bytes"),
    "physical_bytes_end": (_is_bytes, "an integer number of bytes"),
    "committed_blocks_end": (_is_bytes, "an integer number of blocks"),
}
#: What a report reads of the geometry: (key, type, the words an error says).
_GEOMETRY_FIELDS = [
    ("layers", _is_bytes, "an integer"),
    ("capacity_blocks", _is_bytes, "an integer"),
    ("bytes_per_block", _is_bytes, "an integer"),
    ("layout", str, "a string"),
    ("spec", str, "a string"),
]


def _shown(value: object) -> str:
    """`value` for an error message, cut short in length and depth: a
    garbled file may hold anything."""
    return reprlib.repr(value)


def _field(document: dict, name: str, kind, words: str, where: str = ""):
    """document[name], checked to be of `kind` (a type, or a predicate)."""
    if name not in document:
        raise ValueError(f"{where}{name} is missing, expected {words}")
    value = document[name]
    if not (isinstance(value, kind) if isinstance(kind, type) else kind(value)):
        raise ValueError(f"{where}{name} is {_shown(value)}, expected {words}")
    return value


class _Sampler(threading.Thread):
    """Reads `probe` every SAMPLE_INTERVAL_S into `samples` until stopped."""

    def __init__(self, probe: UsageProbe, baseline: int, origin: float, samples: list):
        super().__init__(name="extkv-timeline-sampler", daemon=True)
        self.probe, self.baseline, self.origin, self.samples = probe, baseline, origin, samples
        self.stopped = threading.Event()
        #: Set at its first reading: a lifecycle a busy machine ran before the
        #: sampler got a core waits for it, so every timeline has one.
        self.read_once = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(SAMPLE_INTERVAL_S):
            self.samples.append((time.perf_counter() - self.origin, self.probe.read_outside_torch() - self.baseline))
            self.read_once.set()


def cache_shape() -> tuple[FullAttentionSpec, KVCacheLayout]:
    """(spec, layout) of the timeline's cache: 64 KiB pages, layer-outermost."""
    import torch

    from ..layout import FullAttentionSpec, KVCacheLayout

    return FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16), KVCacheLayout.LBHNC


def timeline_capacity(device: torch.device | str) -> tuple[int, int]:
    """(layers, blocks) of the cache for `device`: GEOMETRY's span, or a
    FREE_SHARE of free memory if less, in whole BLOCK_QUANTUMs."""
    from .. import vmm

    spec, _ = cache_shape()
    driver = vmm.driver_for(device)
    layers, most = GEOMETRY[driver.kind]
    free, _ = driver.memory_info()
    span = min(most, int(free * FREE_SHARE))
    blocks = span // (layers * spec.page_size_bytes) // BLOCK_QUANTUM * BLOCK_QUANTUM
    if blocks < BLOCK_QUANTUM:
        raise ValueError(f"{device} has {free} bytes free: too little for a timeline of {layers} layers")
    return layers, blocks


def run_timeline(device: torch.device | str, probe: UsageProbe, label: str) -> Timeline:
    """Drive a cache through LIFECYCLE on `device`, reading `probe` throughout."""
    from ..cache import ExtensibleKVCache
    from ..layout import KVCacheGroupSpec, build_kv_cache_config

    spec, layout = cache_shape()
    layers, capacity = timeline_capacity(device)
    groups = [KVCacheGroupSpec(layer_names=[f"layers.{i}" for i in range(layers)], kv_cache_spec=spec)]
    config = build_kv_cache_config(groups, capacity, layout)
    timeline = Timeline(
        device=label,
        source=probe.source,
        geometry={
            "layers": layers,
            "capacity_blocks": capacity,
            "bytes_per_block": layers * spec.page_size_bytes,
            "layout": layout.name,
            "spec": f"{spec.block_size}-token blocks, {spec.num_kv_heads} KV heads of {spec.head_size}, {spec.dtype}",
        },
    )
    baseline = probe.read_outside_torch()
    cache = ExtensibleKVCache(config, device, layout)
    origin = time.perf_counter()
    sampler = _Sampler(probe, baseline, origin, timeline.samples)
    sampler.start()

    def reading() -> tuple[float, int, int]:
        booked = 0 if cache.is_freed else cache.physical_bytes
        return time.perf_counter() - origin, probe.read_outside_torch() - baseline, booked

    try:
        for label_, operation, share, flags in LIFECYCLE:
            start_s, outside_start, booked_start = reading()
            if operation == "allocate":
                cache.allocate(cache.size)
            elif operation == "commit":
                cache.commit(int(capacity * share), **flags)
            else:
                getattr(cache, operation)()
            end_s, outside_end, booked_end = reading()
            timeline.marks.append(
                Mark(label_, start_s, end_s, outside_start, outside_end, booked_start, booked_end, cache.num_committed_blocks)
            )
            timeline.samples += [(start_s, outside_start), (end_s, outside_end)]
        if not sampler.read_once.wait(SAMPLER_PATIENCE_S):
            raise AssertionError(f"the background reader took no reading in {SAMPLER_PATIENCE_S} s")
    finally:
        sampler.stopped.set()
        sampler.join()
        cache.free()
    timeline.samples.sort()
    return timeline
