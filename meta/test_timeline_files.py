"""The memory timeline's file, as the report reads it back
(extkv.testing.timeline): a report directory may come from anyone, so a
timeline file that is a FIFO, a symlink, too large or not what
`Timeline.write` wrote is refused with one ValueError naming the file and
what was expected. The timeline itself, and invariant 5 along it, is
conformance/test_timeline.py's."""

from __future__ import annotations

import json
import os
import re
import threading

import pytest

from extkv.testing import timeline as timeline_module
from extkv.testing.timeline import TIMELINE_FORMAT, Mark, Timeline

#: Every test here checks extkv's own tooling: a report's input.
pytestmark = pytest.mark.harness


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
