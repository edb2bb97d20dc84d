"""extkv.vmm.PoisoningDriver, the instrument conformance/test_zeroing.py
proves zeroing with: it wraps a driver and fills every chunk it creates with
one non-zero byte, and refuses a byte that would poison nothing. It is a
tool of the checks, so its own test proves no invariant of the cache."""

from __future__ import annotations

import pytest

from extkv.vmm import PoisoningDriver, driver_for

#: Every test here checks extkv's own tooling: an instrument of the checks.
pytestmark = pytest.mark.harness


def test_poisoning_driver_takes_a_non_zero_byte(device):
    inner = driver_for(device)
    for pattern in (0, 256, -1, True, 1.5):
        with pytest.raises(ValueError, match="pattern must be an int >= 1 and <= 255"):
            PoisoningDriver(inner, pattern)
    with pytest.raises(ValueError, match="wraps a Driver"):
        PoisoningDriver(device)
    assert PoisoningDriver(inner, 0x5C).describe()["poison"] == "every created chunk filled with 0x5c"
