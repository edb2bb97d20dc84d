"""The random-interrupt workload's count of interrupts that land inside
extkv (extkv.testing.interrupts.lands_in_library). conformance/test_interrupts.py
proves invariant 6 by 1,000 such interrupts with no inconsistent state; this
holds the count to frames of extkv's own code, so that those 1,000 are what
they say. It checks the workload, not the cache."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import extkv.validate

from extkv import ExtensibleTensor
from extkv.testing.checks import check_all_equal
from extkv.testing.interrupts import lands_in_library

#: Every test here checks extkv's own tooling: a workload's count.
pytestmark = pytest.mark.harness


def frame_raised_in(call) -> object:
    """The frame in which `call` raised its exception: a real frame, as a
    signal handler is given the one an interrupt arrived in."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 - any exception: only its frame matters
        traceback = error.__traceback__
        while traceback.tb_next is not None:
            traceback = traceback.tb_next
        return traceback.tb_frame
    raise AssertionError(f"{call} raised nothing")


def test_the_random_interrupt_run_counts_only_interrupts_that_land_in_extkv_code():
    """`inside`, which the random-interrupt run of conformance/test_interrupts.py
    must bring to 1,000, counts a frame of extkv's own code; a frame of
    extkv.testing (the workload), of torch, of the standard library or of
    this test is outside, and so is none."""
    in_extkv = frame_raised_in(lambda: ExtensibleTensor(-1))
    elsewhere = {
        "extkv.testing": frame_raised_in(lambda: check_all_equal(torch.zeros(1, dtype=torch.uint8), 1, "a byte")),
        "torch": frame_raised_in(lambda: torch.testing.assert_close(torch.zeros(1), torch.ones(1))),
        "the standard library": frame_raised_in(lambda: json.loads("{")),
        "this test": sys._getframe(),
    }
    assert in_extkv.f_code.co_filename == str(Path(extkv.validate.__file__)), in_extkv.f_code.co_filename
    assert lands_in_library(in_extkv)
    counted = [where for where, frame in elsewhere.items() if lands_in_library(frame)]
    assert counted == [], f"interrupts in {counted} counted as landing in extkv"
    assert not lands_in_library(None)
