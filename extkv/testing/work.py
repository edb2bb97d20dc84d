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

From Python 3.12 the count uses `sys.monitoring` instruction events
instead: there `sys.settrace` misses every opcode of a code object's first
traced call (CPython issues 103615 and 114480; on 3.12.1 one fresh
function counted 0, then 25,012 instructions on its next call), and a
count taken once, as the bench takes it, would miss the first call of
every function the operation reaches. The monitoring tool sees every
thread; only the calling thread's instructions are counted, and the
counter's own frame is left out so that a count holds the operation alone.
"""

from __future__ import annotations

import gc
import sys
import threading
from typing import Callable


def python_instructions(operation: Callable[[], object]) -> int:
    """Bytecode instructions executed by `operation()` and everything it
    calls in Python, on this thread. Counting slows it down many times: use
    it on an operation whose timing does not matter."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        if hasattr(sys, "monitoring"):
            return _count_with_monitoring(operation)
        return _count_with_settrace(operation)
    finally:
        if collecting:
            gc.enable()


def _count_with_settrace(operation: Callable[[], object]) -> int:
    count = 0

    def trace(frame, event, arg):
        nonlocal count
        if event == "opcode":
            count += 1
        else:
            frame.f_trace_opcodes = True
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        operation()
    finally:
        sys.settrace(previous)
    return count


def _count_with_monitoring(operation: Callable[[], object]) -> int:
    monitoring = sys.monitoring
    tool = next((tool for tool in range(6) if monitoring.get_tool(tool) is None), None)
    if tool is None:
        raise RuntimeError("python_instructions needs a free sys.monitoring tool id; all 6 are in use")
    count = 0
    thread = threading.get_ident()
    own = _count_with_monitoring.__code__

    def on_instruction(code, offset):
        nonlocal count
        if code is not own and threading.get_ident() == thread:
            count += 1

    monitoring.use_tool_id(tool, "extkv python_instructions")
    try:
        monitoring.register_callback(tool, monitoring.events.INSTRUCTION, on_instruction)
        monitoring.set_events(tool, monitoring.events.INSTRUCTION)
        try:
            operation()
        finally:
            monitoring.set_events(tool, 0)
    finally:
        monitoring.register_callback(tool, monitoring.events.INSTRUCTION, None)
        monitoring.free_tool_id(tool)
    return count
