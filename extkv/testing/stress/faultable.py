"""The public operations a fault enumeration faults, and what each works on.

Theory of operation
-------------------
`OPERATIONS` lists every public operation that makes driver calls, each a
`FaultableOperation`: the state it starts from (`prepare`, chosen so that it
makes several calls of each driver step it makes at all: a fragmented cache,
a registered or imported one, a fragmented tensor), the call, and whether
the contract keeps committed bytes when it fails. Each works on a `Scene`:
the cache or tensor over poisoned memory under a fault injector, a peer's
driver (the importer) over the same real driver, the connector and the
sockets between them, and which of the two drivers the fault goes to.
extkv.testing.stress.faults runs them.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Callable

import torch

from ...cache import ExtensibleKVCache
from ...connector import SegmentExportConnector
from ...layout import KVCacheLayout
from ...peer import ImportedSegments, import_segments
from ...tensor import ExtensibleTensor
from ...vmm import FaultInjectingDriver
from ..configs import config_for, fill_segments
from .base import CHILD_TIMEOUT_S


@dataclass
class Scene:
    """What one fault attempt works on. `driver` backs the cache or tensor
    (poisoned memory under a fault injector), `importer` is a peer's driver
    over the same real driver; faults are planned on `target`, one of the
    two. The other fields are filled by an operation's `prepare`."""

    kind: str
    layout: KVCacheLayout
    capacity: int
    driver: FaultInjectingDriver
    importer: FaultInjectingDriver
    target: FaultInjectingDriver
    cache: ExtensibleKVCache | None = None
    tensor: ExtensibleTensor | None = None
    connector: SegmentExportConnector | None = None
    sockets: tuple[socket.socket, socket.socket] | None = None
    imported: ImportedSegments | None = None

    @property
    def buffer(self) -> ExtensibleTensor | None:
        return self.cache.buffer if self.cache is not None else self.tensor

    def committed_bytes(self) -> list[torch.Tensor]:
        buffer = self.buffer
        if buffer is None or buffer.is_freed:
            return []
        return [buffer.segment_view(i).clone() for i in range(len(buffer.segment_sizes))]

    def close(self) -> None:
        """Free everything; the first failure is raised after every step ran."""
        failure: Exception | None = None
        steps = [
            self.imported.close if self.imported is not None else None,
            self.connector.close if self.connector is not None else None,
            self.cache.free if self.cache is not None else None,
            self.tensor.free if self.tensor is not None else None,
        ]
        for step in filter(None, steps):
            try:
                step()
            except Exception as error:
                failure = failure or error
        for sock in self.sockets or ():
            sock.close()
        if failure is not None:
            raise failure


def new_cache(scene: Scene) -> None:
    scene.cache = ExtensibleKVCache(config_for(scene.kind, scene.layout, scene.capacity), scene.driver, scene.layout)


def fragmented_cache(scene: Scene) -> None:
    """Two growths, each followed by a pattern over every committed byte:
    every segment spans several chunks."""
    new_cache(scene)
    scene.cache.commit(scene.capacity // 4)
    fill_segments(scene.cache, seed=1)
    scene.cache.commit(scene.capacity // 2)
    fill_segments(scene.cache, seed=2)


def released_cache(scene: Scene) -> None:
    fragmented_cache(scene)
    scene.cache.release_physical()


def registered_cache(scene: Scene) -> None:
    new_cache(scene)
    scene.cache.commit(scene.capacity // 2, defragment=True)
    fill_segments(scene.cache, seed=3)
    scene.connector = SegmentExportConnector()
    scene.connector.register_kv_caches(scene.cache)
    scene.sockets = socket.socketpair()


def imported_cache(scene: Scene) -> None:
    registered_cache(scene)
    export_and_import(scene)


def export_and_import(scene: Scene) -> None:
    scene.connector.export_to(scene.sockets[0])
    scene.imported = import_segments(scene.sockets[1], driver=scene.importer, timeout=CHILD_TIMEOUT_S)


def fragmented_tensor(scene: Scene) -> None:
    """Three segments, the middle one starting mid-granule, each grown twice
    with a pattern written after each growth."""
    g = scene.driver.granularity
    scene.tensor = ExtensibleTensor(7 * g, device=scene.driver, segment_capacities=[g * 5 // 2, g * 3 // 2, 3 * g])
    for sizes, seed in (([g // 2, g // 4, g // 2], 1), ([2 * g, g, 2 * g], 2)):
        scene.tensor.resize_segments_(sizes)
        for i in range(len(sizes)):
            view = scene.tensor.segment_view(i)
            view.copy_((torch.arange(view.numel(), dtype=torch.int32, device=view.device) * 7 + seed + 31 * i).remainder(251).add(1).to(torch.uint8))


def nothing_sent(scene: Scene) -> None:
    """A failed export sent nothing: the peer's end has nothing to read."""
    receiver = scene.sockets[1]
    receiver.setblocking(False)
    try:
        receiver.recv(1)
    except BlockingIOError:
        return
    finally:
        receiver.setblocking(True)
    raise AssertionError("a failed export_to sent something to the peer")


@dataclass(frozen=True)
class FaultableOperation:
    """A public operation, the state it starts from (`prepare`), the call,
    and whether the contract keeps committed bytes when it fails
    (`keeps_contents`). `after_failure` checks what only this operation
    promises; `finish` completes an outcome to compare (an export is
    compared by what a fault-free peer imports)."""

    name: str
    prepare: Callable[[Scene], None]
    call: Callable[[Scene], object]
    keeps_contents: bool
    target_is_importer: bool = False
    after_failure: Callable[[Scene], None] | None = None
    finish: Callable[[Scene], None] | None = None


def clean_import(scene: Scene) -> None:
    scene.imported = import_segments(scene.sockets[1], timeout=CHILD_TIMEOUT_S)


#: Every public operation that makes driver calls, from a state where it
#: makes several of each kind it makes at all.
OPERATIONS: list[FaultableOperation] = [
    FaultableOperation("ExtensibleKVCache()", lambda scene: None, new_cache, keeps_contents=False),
    FaultableOperation("allocate", new_cache, lambda scene: scene.cache.allocate(scene.cache.size), keeps_contents=False),
    FaultableOperation(
        "commit (grow, clamped)", fragmented_cache,
        lambda scene: scene.cache.commit(scene.capacity + scene.capacity // 4), keeps_contents=True,
    ),
    FaultableOperation(
        "commit (shrink)", fragmented_cache, lambda scene: scene.cache.commit(scene.capacity // 8, shrink=True),
        keeps_contents=False,
    ),
    FaultableOperation(
        "commit (shrink, preserving)", fragmented_cache,
        lambda scene: scene.cache.commit(scene.capacity // 8, shrink=True, preserve_contents=True),
        keeps_contents=True,
    ),
    FaultableOperation(
        "commit (defragment, discarding)", fragmented_cache,
        lambda scene: scene.cache.commit(scene.capacity // 2, defragment=True), keeps_contents=False,
    ),
    FaultableOperation(
        "commit (defragment, preserving)", fragmented_cache,
        lambda scene: scene.cache.commit(scene.capacity // 2, defragment=True, preserve_contents=True),
        keeps_contents=True,
    ),
    FaultableOperation(
        "commit (defragment, preserving, growing)", fragmented_cache,
        lambda scene: scene.cache.commit(3 * scene.capacity // 4, defragment=True, preserve_contents=True),
        keeps_contents=True,
    ),
    FaultableOperation("release_physical", fragmented_cache, lambda scene: scene.cache.release_physical(), keeps_contents=False),
    FaultableOperation("recommit", released_cache, lambda scene: scene.cache.recommit(), keeps_contents=False),
    FaultableOperation("free", fragmented_cache, lambda scene: scene.cache.free(), keeps_contents=False),
    FaultableOperation(
        "SegmentExportConnector.export_to", registered_cache,
        lambda scene: scene.connector.export_to(scene.sockets[0]), keeps_contents=True,
        after_failure=nothing_sent, finish=clean_import,
    ),
    FaultableOperation("import_segments", registered_cache, export_and_import, keeps_contents=True, target_is_importer=True),
    FaultableOperation(
        "ImportedSegments.close", imported_cache, lambda scene: scene.imported.close(), keeps_contents=True,
        target_is_importer=True,
    ),
    FaultableOperation(
        "ExtensibleTensor.resize_segments_", fragmented_tensor,
        lambda scene: scene.tensor.resize_segments_(scene.tensor.segment_capacities, zero_new=True), keeps_contents=True,
    ),
    FaultableOperation(
        "ExtensibleTensor.shrink_segments_", fragmented_tensor,
        # Sizes of their own, not of the sizes now: the retry asks for the same.
        lambda scene: scene.tensor.shrink_segments_([scene.driver.granularity * share // 8 for share in (5, 3, 9)]),
        keeps_contents=True,
    ),
    FaultableOperation(
        "ExtensibleTensor.defragment_segment_", fragmented_tensor,
        lambda scene: scene.tensor.defragment_segment_(0), keeps_contents=True,
    ),
]
