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

import threading

import torch

from .wrapping import WrappingDriver

#: Clock cycles each zeroing waits behind: 0.1 s at the H200's 1.98 GHz
#: boost clock, longer at lower clocks; far longer than the worker's step and
#: a test's read take to be queued.
SPIN_CYCLES = 200_000_000
#: Bytes the warm-up zeroes behind its spin: one 2 MiB granule.
WARM_UP_BYTES = 2 << 20


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
    """Run the spin once, where it runs at all (CUDA), as a late test meets
    it: in a thread of its own, on the driver's side stream, before a
    zeroing there that the caller's stream waits for. Whatever CUDA loads or
    grows lazily for that path (the spin's module, the side streams, a
    memset there) then does so before a test's leak baseline is taken, not
    during the first test that takes it."""
    if driver.kind != "cuda":
        return
    with torch.cuda.device(driver.device):
        scratch = torch.ones(WARM_UP_BYTES, dtype=torch.uint8, device=driver.device)
        # The side stream does not wait for this one: unsynchronized, the
        # fill can land after the zeroing (seen under a busy H200 check).
        torch.cuda.current_stream().synchronize()
    fences = []

    def spin_and_zero() -> None:
        with torch.cuda.device(driver.device), driver.side_stream():
            torch.cuda._sleep(1)
            driver.zero(scratch.data_ptr(), WARM_UP_BYTES)
            fences.append(driver.fence())

    thread = threading.Thread(target=spin_and_zero, name="extkv-spin-warm-up")
    thread.start()
    thread.join()
    with torch.cuda.device(driver.device):
        driver.wait_for(fences[0])
        if scratch.count_nonzero().item():
            raise RuntimeError("the spin's warm-up zeroing left bytes that are not 0")
    driver.synchronize()
