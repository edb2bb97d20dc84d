"""The pressure process: a second process holding real memory as told.

Theory of operation
-------------------
`PressureProcess` starts `pressure_main` in a child process on a device and
tells it, a line at a time, to hold or free real memory there, as
extkv.vmm.pressure holds it for that device (memfd pages on the host, not
named as extkv's chunks, so no probe counts them; torch allocations on a
GPU). It holds a given amount (`hold`), fills the device down to a given
free amount (`fill`), releases, or cycles take, hold, free in a thread of
its own. While it cycles, `next-release` answers once the cycle after the
question has released its memory: a workload that met out-of-memory waits
for that event, not for the machine's free memory to rise, which other
processes move too. The workloads that meet its pressure are
extkv.testing.stress.under_pressure's.
"""

from __future__ import annotations

import sys
import threading

import torch

from ... import vmm
from ...vmm.pressure import pressure_memory
from .child import ChildProcess


def host_pressure_bound() -> int:
    """The most a host pressure process holds: an eighth of the machine's
    memory, at most 2 GiB, well below what the machine has."""
    _, total = vmm.device_memory_info("cpu")
    return min(2 << 30, total // 8)


class MemoryHolder:
    """Real memory of `device` held by the pressure process, in the pieces
    the device's pressure memory takes (extkv.vmm.pressure)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.memory = pressure_memory(device)
        self.pieces: list = []
        self.held = 0

    def _take(self, size: int) -> bool:
        """Allocate one piece; False when the device has no more."""
        piece = self.memory.take(size)
        if piece is None:
            return False
        self.pieces.append(piece)
        self.held += size
        return True

    def hold(self, nbytes: int) -> int:
        """Hold about `nbytes` more (whole pieces); returns what is held."""
        target = self.held + nbytes
        while self.held < target and self._take(min(self.memory.hold_piece, target - self.held)):
            pass
        return self.held

    def fill(self, leave: int) -> int:
        """Allocate until the device's free memory is at most `leave` bytes,
        in pieces of at most the device's `largest_piece` that each fit what
        is free, a piece the device refuses halved down to its
        `smallest_piece`. On a 141 GB H200 that is about 17 allocations a
        fill, where pieces of 256 MiB were about 540."""
        smallest, largest = self.memory.smallest_piece, self.memory.largest_piece
        while True:
            free, _ = vmm.device_memory_info(self.device)
            if free <= leave:
                return self.held
            piece = min(free - leave, largest)
            while not self._take(piece):
                if piece <= smallest:
                    return self.held
                piece = max(piece // 2, smallest)

    def release(self) -> None:
        self.memory.give_back(self.pieces)
        self.held = 0


def pressure_main(device: torch.device) -> None:
    """The pressure process: one command a line on stdin, one answer a line
    on stdout.

    hold N        hold N more bytes             -> held <bytes held>
    fill L        allocate until L bytes free   -> held <bytes held>
    release       free everything               -> released
    cycle MODE N SECONDS  in a thread: hold N (MODE hold) or fill to N free
                  (MODE fill) for SECONDS, release for SECONDS, again -> cycling
    cycles        cycles completed so far       -> cycles <cycles>
    next-release  wait until the cycle releases its memory next -> released <cycles>
    stop          end the cycle, release        -> stopped <cycles>
    quit          exit
    """
    holder = MemoryHolder(device)
    stop = threading.Event()
    cycler: threading.Thread | None = None
    cycles = 0
    #: Notified at every release of the cycle, and when the cycle ends.
    released = threading.Condition()
    #: Whether the cycle ended (set under `released`: a waiter woken by the
    #: end must see it, and the thread is still alive while it notifies).
    ended = False

    def cycle(mode: str, amount: int, seconds: float) -> None:
        nonlocal cycles, ended
        try:
            while not stop.is_set():
                holder.hold(amount) if mode == "hold" else holder.fill(amount)
                stop.wait(seconds)
                holder.release()
                with released:
                    cycles += 1
                    released.notify_all()
                stop.wait(seconds)
        finally:
            with released:  # a waiter for the next release must not wait for a cycle that ended
                ended = True
                released.notify_all()

    def next_release() -> str:
        with released:
            seen = cycles
            released.wait_for(lambda: cycles > seen or cycler is None or ended)
            return f"released {cycles}" if cycles > seen else "error: not cycling"

    def answer(text: str) -> None:
        print(text, flush=True)

    answer("ready")
    for line in sys.stdin:
        command, *arguments = line.split()
        if command == "hold":
            answer(f"held {holder.hold(int(arguments[0]))}")
        elif command == "fill":
            answer(f"held {holder.fill(int(arguments[0]))}")
        elif command == "release":
            holder.release()
            answer("released")
        elif command == "cycle":
            stop.clear()
            with released:
                ended = False
            cycler = threading.Thread(target=cycle, args=(arguments[0], int(arguments[1]), float(arguments[2])), daemon=True)
            cycler.start()
            answer("cycling")
        elif command == "cycles":
            answer(f"cycles {cycles}")
        elif command == "next-release":
            answer(next_release())
        elif command == "stop":
            stop.set()
            if cycler is not None:
                cycler.join()
            holder.release()
            answer(f"stopped {cycles}")
        elif command == "quit":
            break
        else:
            answer(f"error: unknown command {command!r}")


class PressureProcess(ChildProcess):
    """`pressure_main` in a child process on `device`."""

    def __init__(self, device: torch.device | str):
        super().__init__(["pressure", "--device", str(device)])
        ready = self.line()
        if ready != "ready":
            self.kill()
            raise AssertionError(f"pressure process said {ready!r}, expected 'ready'")

    def held(self, command: str) -> int:
        reply = self.ask(command)
        if not reply.startswith("held "):
            raise AssertionError(f"pressure process answered {command!r} with {reply!r}")
        return int(reply.split()[1])

    def next_release(self) -> int:
        """Wait until the cycle's next release of its memory; returns the
        cycles completed then."""
        reply = self.ask("next-release")
        if not reply.startswith("released "):
            raise AssertionError(f"pressure process answered 'next-release' with {reply!r}")
        return int(reply.split()[1])

    def cycles(self) -> int:
        """Cycles (take, hold, free) the pressure process completed so far."""
        reply = self.ask("cycles")
        if not reply.startswith("cycles "):
            raise AssertionError(f"pressure process answered 'cycles' with {reply!r}")
        return int(reply.split()[1])
