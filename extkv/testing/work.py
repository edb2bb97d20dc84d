"""Python work counted in bytecode instructions, not seconds.

Theory of operation
-------------------
A claim such as "a commit's bookkeeping does not grow with the granule
count" is about work, and CPU time is a poor witness of work on a real
machine: a large driver call evicts the CPU caches, so the same Python runs
slower after a commit of 64 GiB than after one of 64 MiB (the raw driver
sequence, whose Python is a fixed loop, shows it as much as extkv). Counting
the bytecode instructions the interpreter executes is exact and repeatable:
no cache, clock or neighbouring process changes it. `python_instructions`
traces every Python frame an operation runs (`sys.settrace` with opcode
events) on the calling thread; C code, the driver's included, counts
nothing, which is the point: what is left is extkv's own work. The
garbage collector is off while counting: a collection that happened to
fall inside would add the Python of every finalizer it ran (in a full test
run, those of objects earlier tests left behind).
"""

from __future__ import annotations

import gc
import sys
from typing import Callable


def python_instructions(operation: Callable[[], object]) -> int:
    """Bytecode instructions executed by `operation()` and everything it
    calls in Python, on this thread. Tracing slows it down many times: use it
    on an operation whose timing does not matter."""
    count = 0

    def trace(frame, event, arg):
        nonlocal count
        if event == "opcode":
            count += 1
        else:
            frame.f_trace_opcodes = True
        return trace

    previous = sys.gettrace()
    collecting = gc.isenabled()
    gc.disable()
    sys.settrace(trace)
    try:
        operation()
    finally:
        sys.settrace(previous)
        if collecting:
            gc.enable()
    return count
