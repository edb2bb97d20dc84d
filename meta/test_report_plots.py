"""A report draws a plot only where its results or its drawing code changed.

A PNG drawn again is a new file (extkv.runs.rundir.write_file renames a
new file over the old), so a PNG whose inode is unchanged after a rendering
was not drawn by it. A copy of the host reference (a check timeline, two
bench plots and a stress plot) rendered twice draws everything once and
nothing the second time; one value changed in the results a plot is drawn
from draws that plot again and no other. `draw_unless_current` itself is
driven with a drawing module of the test's own, whose source is changed,
and with its record and its PNG spoiled.
"""

from __future__ import annotations

import json
import shutil
import types
from pathlib import Path

import pytest

from extkv.report import render_report
from extkv.runs.plots import PLOTS_FILE, draw_unless_current, matplotlib_missing
from extkv.runs.rundir import write_text

#: Every test here checks extkv's own tooling: benchmarks, reports, the command line.
pytestmark = [
    pytest.mark.harness,
    pytest.mark.skipif(matplotlib_missing() is not None, reason=str(matplotlib_missing())),
]

REFERENCE_RUN = Path(__file__).resolve().parents[1] / "reports" / "reference" / "host"
PLOTS = ("timeline-host.png", "bench_scaling_bytes.png", "bench_scaling_segments.png", "stress-memory-main-cpu.png")


def inodes(run_dir: Path) -> dict[str, int]:
    return {name: (run_dir / name).stat().st_ino for name in PLOTS}


def drawn_by(run_dir: Path) -> list[str]:
    """The plots that rendering `run_dir` once drew, by their inodes."""
    before = inodes(run_dir)
    render_report(run_dir)
    after = inodes(run_dir)
    return sorted(name for name in PLOTS if after[name] != before[name])


@pytest.fixture
def reference(tmp_path) -> Path:
    run_dir = tmp_path / "host"
    shutil.copytree(REFERENCE_RUN, run_dir)
    return run_dir


def test_a_report_rendered_again_draws_no_plot(reference):
    (reference / PLOTS_FILE).unlink()
    assert drawn_by(reference) == sorted(PLOTS), "without a record of its plots, a report draws every one"
    files = {path.name: path.stat().st_ino for path in reference.iterdir() if path.name != "summary.md"}
    assert drawn_by(reference) == [], "the second rendering drew again plots whose results had not changed"
    assert {path.name: path.stat().st_ino for path in reference.iterdir() if path.name != "summary.md"} == files, (
        "the second rendering wrote a file other than summary.md"
    )


def change_a_timeline_sample(run_dir: Path) -> None:
    path = run_dir / "timeline-host.json"
    document = json.loads(path.read_text())
    document["samples"][1][1] += 4096
    path.write_text(json.dumps(document))


def change_a_stress_sample(run_dir: Path) -> None:
    path = run_dir / "stress" / "timeline-main.json"
    document = json.loads(path.read_text())
    document["samples"][1][2] += 4096
    path.write_text(json.dumps(document))


def change_the_bench_device(run_dir: Path) -> None:
    path = run_dir / "bench_cases.json"
    document = json.loads(path.read_text())
    document["device"] = "cpu, renamed"
    path.write_text(json.dumps(document))


@pytest.mark.parametrize("change, redrawn", [
    (change_a_timeline_sample, ["timeline-host.png"]),
    (change_a_stress_sample, ["stress-memory-main-cpu.png"]),
    (change_the_bench_device, ["bench_scaling_bytes.png", "bench_scaling_segments.png"]),
])
def test_a_changed_value_draws_again_the_plots_drawn_from_it_and_no_other(reference, change, redrawn):
    assert drawn_by(reference) == [], "the committed reference's record of its plots is stale"
    change(reference)
    assert drawn_by(reference) == redrawn
    assert drawn_by(reference) == []


def test_changed_drawing_code_a_spoiled_record_or_a_replaced_png_draws_again(tmp_path):
    code = tmp_path / "drawing.py"
    code.write_text("# draws one way\n")
    module = types.ModuleType("drawing")
    module.__file__ = str(code)
    png = tmp_path / "plot.png"
    drawings = []

    def draw(path: Path) -> None:
        drawings.append(path.name)
        write_text(path, f"drawing {len(drawings)}")

    def drew(inputs: object) -> bool:
        before = len(drawings)
        assert draw_unless_current(png, inputs, (module,), draw) is None
        return len(drawings) > before

    assert drew({"points": [1, 2]}), "no PNG yet"
    assert not drew({"points": [1, 2]}), "the same inputs by the same code"
    assert drew({"points": [1, 3]}), "a changed input"
    code.write_text("# draws another way\n")
    assert drew({"points": [1, 3]}), "changed drawing code"
    write_text(png, "a PNG from elsewhere")
    assert drew({"points": [1, 3]}), "a PNG other than the one drawn"
    png.unlink()
    assert drew({"points": [1, 3]}), "the PNG removed"
    (tmp_path / PLOTS_FILE).write_text("{not json")
    assert drew({"points": [1, 3]}), "a garbled record"
    assert not drew({"points": [1, 3]}), "the record written anew"
