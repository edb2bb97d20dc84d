"""extkv.testing.work.python_instructions, the count of Python bytecode
instructions that conformance/test_tensor.py holds a commit's work to (and
the benchmarks report): it counts the operation alone, in full on a first
call, and in the calling thread only. It measures; it proves no invariant
of the cache."""

from __future__ import annotations

import gc
import threading

import pytest

from extkv.testing.work import python_instructions

#: Every test here checks extkv's own tooling: a measuring instrument.
pytestmark = pytest.mark.harness


class _FinalizedCycle:
    def __init__(self):
        self.itself = self  # a cycle: only the collector frees it

    def __del__(self):
        sum(i for i in range(50))


def test_the_instruction_count_holds_no_finalizer_a_collection_would_run():
    """A count is of the operation alone: garbage waiting for the collector
    (what earlier tests leave) must not add its finalizers' Python."""
    def allocate():  # enough new containers to set off a collection
        return [[] for _ in range(5000)]

    alone = python_instructions(allocate)
    for _ in range(300):
        _FinalizedCycle()
    with_garbage = python_instructions(allocate)
    assert gc.isenabled(), "the count must give the collector back"
    gc.collect()
    assert with_garbage == alone, f"{with_garbage} instructions with garbage waiting vs {alone} without"


def test_the_instruction_count_of_a_first_call_equals_the_next_calls():
    """The bench counts an operation once: a function's first call must count
    in full (Python 3.12's settrace drops every opcode of it)."""
    def fresh():
        return [[] for _ in range(100)]

    first = python_instructions(fresh)
    assert first > 0 and first == python_instructions(fresh), f"first call {first} vs next {python_instructions(fresh)}"


def test_the_instruction_count_leaves_out_other_threads():
    """A background thread running Python (commit-ahead's worker, say) adds
    nothing to the calling thread's count."""
    def allocate():
        return [[[] for _ in range(1000)] for _ in range(20)]

    alone = python_instructions(allocate)
    stop = threading.Event()
    started = threading.Event()

    def spin():
        started.set()
        while not stop.is_set():
            sum(range(10))

    other = threading.Thread(target=spin)
    other.start()
    try:
        started.wait()
        beside = python_instructions(allocate)
    finally:
        stop.set()
        other.join()
    assert beside == alone, f"{beside} instructions beside a busy thread vs {alone} alone"
