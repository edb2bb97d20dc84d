"""Invariant 5 along a whole lifecycle: a realistic-ish KV cache on each
device (extkv.testing.timeline) goes through allocate, stepwise growth,
shrink, both defragments, sleep, wake and free, while physical memory is
read outside extkv in the background and at every operation's start and end.
At every one of those marks the outside reading equals `physical_bytes`.
With --extkv-report-dir the timeline is left for the report's plot; `extkv
check` runs every GPU test on every GPU, so it draws one per device."""

from __future__ import annotations

import pytest

from extkv.testing.harness import DEVICE_PROPERTY
from extkv.testing.timeline import LIFECYCLE, Timeline, run_timeline


@pytest.mark.invariant(5)
def test_usage_outside_equals_physical_bytes_at_every_mark(device, usage, request, report_dir):
    label = dict(request.node.user_properties)[DEVICE_PROPERTY]
    timeline = run_timeline(device, usage, label)
    if report_dir is not None:
        written = Timeline.load(timeline.write(report_dir))
        assert written == timeline, "the timeline read back differs from the one written"
    assert [mark.operation for mark in timeline.marks] == [label_ for label_, *_ in LIFECYCLE]
    assert not timeline.disagreements(), "outside usage != physical_bytes:\n" + "\n".join(timeline.disagreements())
    marks = {mark.operation: mark for mark in timeline.marks}
    full = marks["grow to full"].physical_bytes_end
    capacity = timeline.geometry["capacity_blocks"]
    assert full >= capacity * timeline.geometry["bytes_per_block"], f"grown to {full} bytes, capacity {capacity} blocks"
    assert marks["release_physical (sleep)"].outside_end == 0, "sleep must return every byte"
    assert marks["recommit (wake)"].outside_end == full, "wake must map what sleep returned"
    assert marks["free"].outside_end == 0, "free must return every byte"
    assert len(timeline.samples) > 2 * len(LIFECYCLE), "the background reader took no reading of its own"
