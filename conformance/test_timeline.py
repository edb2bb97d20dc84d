"""Invariant 5 along a whole lifecycle: a realistic-ish KV cache on each
device (extkv.testing.timeline) goes through allocate, stepwise growth,
shrink, both defragments, sleep, wake and free, while physical memory is
read outside extkv in the background and at every operation's start and end.
At every one of those marks the outside reading equals `physical_bytes`.
With --extkv-report-dir the timeline is left for the report's plot; `extkv
check` runs every GPU test on every GPU, so it draws one per device. A
report directory may come from anyone: a timeline file that is a FIFO, a
symlink, too large or not what `Timeline.write` wrote is refused with one
ValueError naming the file and what was expected."""

from __future__ import annotations

import json
import os
import re
import threading

import pytest

from extkv.testing import timeline as timeline_module
from extkv.testing.harness import DEVICE_PROPERTY
from extkv.testing.timeline import LIFECYCLE, TIMELINE_FORMAT, Mark, Timeline, run_timeline


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


def load_error(path) -> str:
    """The one-line ValueError `Timeline.load(path)` raises. A load still
    blocked after a few seconds (on a FIFO) fails the test, once a writer
    has opened and closed the FIFO to let the read end."""
    outcome: list[BaseException | Timeline] = []

    def load() -> None:
        try:
            outcome.append(Timeline.load(path))
        except BaseException as error:  # handed to the test's thread
            outcome.append(error)

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    loader.join(5)
    if loader.is_alive():
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        loader.join()
        pytest.fail(f"Timeline.load({path}) blocked until a writer came")
    (error,) = outcome
    assert isinstance(error, ValueError), f"Timeline.load({path}) gave {error!r}, not a ValueError"
    message = str(error)
    assert message.startswith(f"{path}: ") and "\n" not in message, message
    return message


@pytest.mark.harness
def test_a_timeline_file_that_write_did_not_write_is_refused_by_name(tmp_path):
    written = Timeline(
        device="host", source="probe", samples=[(0.0, 0), (0.5, 4096)],
        geometry={"layers": 2, "capacity_blocks": 16, "bytes_per_block": 8192, "layout": "LBHNC", "spec": "s"},
        marks=[Mark("allocate", 0.0, 0.5, 0, 4096, 0, 4096, 1)],
    )
    good = json.loads(written.write(tmp_path / "good").read_text())
    assert Timeline.load(tmp_path / "good" / "timeline-host.json") == written

    fifo = tmp_path / "timeline-fifo.json"
    os.mkfifo(fifo)
    assert re.fullmatch(r".*: not a regular file, expected a memory timeline", load_error(fifo))

    huge = tmp_path / "timeline-huge.json"
    with open(huge, "wb") as file:  # sparse: no byte of it is written
        file.truncate(timeline_module.MOST_TIMELINE_BYTES + 1)
    assert f"more than a memory timeline holds ({timeline_module.MOST_TIMELINE_BYTES})" in load_error(huge)

    garbled = [
        ("[]", "a JSON list, expected an object"),
        ("[" * 100_000, "not JSON: maximum recursion depth exceeded"),
        ('{"format": "extkv-timeline/0"}', f"format 'extkv-timeline/0', expected '{TIMELINE_FORMAT}'"),
        ({"samples": [[0.0, 1e400]]}, "samples[0] is [0.0, inf], expected [seconds, bytes]"),
        ({"samples": [[0.0, 1.5]]}, "samples[0] is [0.0, 1.5], expected [seconds, bytes]"),
        ({"marks": [dict(good["marks"][0], start_s="soon")]}, "marks[0].start_s is 'soon', expected a finite number"),
        ({"marks": [7]}, "marks[0] is 7, expected an object"),
        ({"geometry": {"layers": 2}}, "geometry.capacity_blocks is missing, expected an integer"),
        ({"device": None}, "device is None, expected a string"),
    ]
    for number, (change, words) in enumerate(garbled):
        path = tmp_path / f"timeline-garbled-{number}.json"
        path.write_text(change if isinstance(change, str) else json.dumps({**good, **change}))
        message = load_error(path)
        assert message.startswith(f"{path}: not a memory timeline (") and words in message, (words, message)

    # Last: without a bound, reading this would never end.
    for target in (tmp_path / "good" / "timeline-host.json", "/dev/zero"):
        link = tmp_path / f"timeline-link-{len(os.listdir(tmp_path))}.json"
        link.symlink_to(target)
        assert "cannot be read as a memory timeline" in load_error(link)
