"""The leak check of descriptors that the conformance tests use
(extkv.testing.descriptors): a descriptor left open is reported whatever
else closed meanwhile, and a descriptor an earlier test dropped, closed by a
garbage collection during the operation, is no leak. It proves nothing of
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
        assert leaked == earlier or len(open_descriptors()) == len(before)
        assert left_open(before) == [f"fd {leaked}: /memfd:leaked (deleted)"]
    finally:
        os.close(leaked)


def test_garbage_an_earlier_test_dropped_closes_before_the_snapshot_and_is_no_leak():
    gc.disable()  # only the snapshot's own collection may close it
    try:
        Cycle()
        before = open_descriptors()
        assert left_open(before) == []
        Cycle()  # dropped during the operation: closed by the check's collection
        assert left_open(before) == []
    finally:
        gc.enable()
