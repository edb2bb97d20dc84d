"""The store: what every contender of a benchmark is, one verb per operation.

Theory of operation
-------------------
A `Store` is one contender's memory for a KV geometry, given as the
per-block stride of each segment and a capacity in blocks. Segment i
commits `blocks * strides[i]` bytes; every store zeroes exactly the bytes a
commit adds, so each does the work extkv's commit does. Verbs: `open`
(untimed setup: reserve or allocate), `grow(blocks)`, `shrink(blocks)`,
`defragment(preserve)`, `release`, `recommit`, `capture`/`replay` (a CUDA
graph that reads the committed bytes), `close` (untimed: everything given
back). `capture` records a CUDA graph that sums every committed byte
(`CapturedRead`), so a replay reads the memory as a model's kernels would.
A store that has no such verb raises `Unsupported`, and a store that
cannot run on a device says why in `unsupported_reason`: the benchmark
reports it as not run, with that reason, instead of dropping it.
"""

from __future__ import annotations

import abc
from typing import ClassVar, Sequence

import torch

from .primitives import synchronize


class Unsupported(Exception):
    """This contender cannot do this here; the message says why."""


class CapturedRead:
    """A CUDA graph that reads every byte of `views` (a sum per view, as int64)."""

    def __init__(self, views: Sequence[torch.Tensor]):
        device = views[0].device
        if device.type != "cuda":
            raise Unsupported(f"CUDA graphs need a CUDA device, the memory is on {device}")
        odd = [v.numel() for v in views if v.numel() % 8]
        if odd:
            raise ValueError(f"views must hold a multiple of 8 bytes to be read as int64, got sizes {odd}")
        words = [v.view(torch.int64) for v in views]
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # kernels loaded outside the capture
            for word in words:
                word.sum()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.sums = [word.sum() for word in words]

    def replay(self, times: int) -> None:
        for _ in range(times):
            self.graph.replay()


class Store(abc.ABC):
    """One contender's memory for a KV geometry.

    `strides[i]` is segment i's bytes per block, `capacity_blocks` the most
    blocks it holds. `blocks` is the committed count.
    """

    #: Human words for the report.
    what: ClassVar[str] = ""
    #: The process a store needs: "main", or a named special process.
    process: ClassVar[str] = "main"

    def __init__(self, device: torch.device, strides: Sequence[int], capacity_blocks: int):
        self.device = torch.device(device)
        self.strides = [int(s) for s in strides]
        if not self.strides or min(self.strides) <= 0:
            raise ValueError(f"strides must be positive bytes per block, one per segment, got {strides!r}")
        if capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be an int >= 1, got {capacity_blocks!r}")
        self.capacity_blocks = capacity_blocks
        self.blocks = 0
        self._released_blocks = 0
        self._captured: CapturedRead | None = None

    @classmethod
    def unsupported_reason(cls, device: torch.device) -> str | None:
        """Why this store cannot run on `device` in this process, or None."""
        return None

    @property
    def bytes_per_block(self) -> int:
        return sum(self.strides)

    def open(self) -> None:
        """Untimed setup before the first commit."""

    def grow(self, blocks: int) -> None:
        raise Unsupported(f"{type(self).__name__} has no grow")

    def shrink(self, blocks: int) -> None:
        raise Unsupported(f"{type(self).__name__} has no shrink")

    def defragment(self, preserve: bool) -> None:
        raise Unsupported(f"{type(self).__name__} has no defragment")

    def release(self) -> None:
        raise Unsupported(f"{type(self).__name__} has no release")

    def recommit(self) -> None:
        raise Unsupported(f"{type(self).__name__} has no recommit")

    def views(self) -> list[torch.Tensor]:
        """uint8 tensors over the committed bytes (one per segment, or one)."""
        raise Unsupported(f"{type(self).__name__} has no views")

    def capture(self) -> None:
        """Capture a CUDA graph reading the committed bytes as they are now."""
        self._captured = CapturedRead(self.views())

    def replay(self, times: int) -> None:
        if self._captured is None:
            raise RuntimeError("replay() before capture()")
        self._captured.replay(times)

    def synchronize(self) -> None:
        synchronize(self.device)

    def driver_cpu_seconds(self) -> float | None:
        """CPU seconds this store's calls have spent inside the driver so far,
        where it counts them (extkv does); None where it does not."""
        return None

    def close(self) -> None:
        """Give everything back (untimed)."""
        self._captured = None
