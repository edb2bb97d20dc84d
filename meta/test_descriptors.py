"""The leak check of descriptors that the conformance tests use
(extkv.testing.descriptors): a descriptor left open is reported whatever
else closed meanwhile, a descriptor an earlier test dropped, closed by a
garbage collection during the operation, is no leak, and one the operation
left to the collector is still open. It proves nothing of
the cache: it keeps the leak checks honest."""

from __future__ import annotations

import gc
import os
import socket

import pytest

from extkv.testing.descriptors import left_open, open_descriptors

pytestmark = pytest.mark.harness


class Cycle:
    """Holds a socket pair in a reference cycle: closed only by a collection."""

    def __init__(self):
        self.pair = socket.socketpair()
        self.itself = self


def test_a_descriptor_opened_and_kept_is_reported_by_number_and_target():
    before = open_descriptors()
    kept = os.open("/dev/null", os.O_RDONLY)
    try:
        assert left_open(before) == [f"fd {kept}: /dev/null"]
    finally:
        os.close(kept)
    assert left_open(before) == []


def test_a_leak_is_reported_when_as_many_other_descriptors_closed_meanwhile():
    """The count stays the same, and the leaked descriptor may even take the
    closed one's number: it is still a new file there."""
    earlier = os.open("/dev/null", os.O_RDONLY)
    before = open_descriptors()
    os.close(earlier)
    leaked = os.memfd_create("leaked")
    try:
        assert len(open_descriptors()) == len(before), "the count a leak check compared did not change"
        assert left_open(before) == [f"fd {leaked}: /memfd:leaked (deleted)"]
    finally:
        os.close(leaked)


def test_garbage_an_earlier_test_dropped_closed_by_a_collection_during_the_operation_is_no_leak():
    """The fault a count of descriptors had: an operation that sets off a
    collection closes an earlier test's garbage, and the count falls."""
    gc.disable()  # only the collection planted below may close it
    try:
        Cycle()
        before = open_descriptors()
        gc.collect()  # what the operation set off
        assert len(open_descriptors()) == len(before) - 2, "the planted garbage held no socket pair"
        assert left_open(before) == []
    finally:
        gc.enable()


def test_a_descriptor_left_to_the_collector_is_still_open():
    """An operation that drops a socket into a reference cycle has not
    closed it: no collection is forced before the comparison."""
    gc.disable()
    try:
        before = open_descriptors()
        dropped = Cycle()
        numbers = sorted(end.fileno() for end in dropped.pair)
        del dropped
        assert [entry.split(":")[0] for entry in left_open(before)] == [f"fd {number}" for number in numbers]
    finally:
        gc.enable()
        gc.collect()
