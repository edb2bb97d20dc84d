"""Zeroing that the device runs late, around a real driver.

Theory of operation
-------------------
On CUDA, extkv's zeroing is queued on a stream and runs some time after the
call that queued it returns; on a busy GPU, a long time after. extkv promises
that work the engine queues after a commit, or after settling commit-ahead,
sees the zeroed bytes however late they come. On an idle GPU a test of that
passes by luck: the memset has run before the read is even queued.
`LateZeroingDriver(inner)` makes the lateness certain: before each zeroing it
holds the calling thread's current stream on the device (a spin kernel), so a
read not ordered after the zeroing runs first and sees what was there before
it (the pattern, over a `PoisoningDriver`). A stream still held by an earlier
spin gets no second one: its later zeroings already wait behind the first. The host driver's work is done
when its call returns: nothing is queued, nothing can run late, and this
wrapper changes nothing there.
"""

from __future__ import annotations

import torch

from .wrapping import WrappingDriver

#: Clock cycles each zeroing waits behind: 0.1 s at the H200's 1.98 GHz
#: boost clock, longer at lower clocks; far longer than the worker's step and
#: a test's read take to be queued.
SPIN_CYCLES = 200_000_000


class LateZeroingDriver(WrappingDriver):
    """Wraps a driver; each zeroing runs only after a spin on its stream."""

    def __init__(self, inner, spin_cycles: int = SPIN_CYCLES):
        super().__init__(inner)
        self.spin_cycles = spin_cycles
        #: Spins queued so far: a test proves some zeroing was held back.
        self.held = 0
        self._spins: dict[int, torch.cuda.Event] = {}  # by stream handle

    def _zero(self, address: int, size: int) -> None:
        if self.kind == "cuda":
            with torch.cuda.device(self.device):
                self._hold_current_stream()
        self.inner._zero(address, size)

    def _hold_current_stream(self) -> None:
        stream = torch.cuda.current_stream()
        spin = self._spins.get(stream.cuda_stream)
        if spin is not None and not spin.query():
            return
        torch.cuda._sleep(self.spin_cycles)
        spin = torch.cuda.Event()
        spin.record(stream)
        self._spins[stream.cuda_stream] = spin
        self.held += 1


def load_spin_kernel(driver) -> None:
    """Run the spin once where it runs at all (CUDA), so that CUDA's lazy
    module loading grows the context before a test's leak baseline is taken,
    not during the test."""
    if driver.kind == "cuda":
        with torch.cuda.device(driver.device):
            torch.cuda._sleep(1)
