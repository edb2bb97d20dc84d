"""Whether a report can draw its plots, and drawing each only when it changed.

Theory of operation
-------------------
Plots are drawn with matplotlib (the optional `report` extra), imported only
inside the functions that draw, so extkv imports and reports render without
it: `matplotlib_missing()` says why plots are skipped, and each section of
the report prints that instead of its images.

A plot is a pure function of the results it is drawn from and of the code
that draws it, and drawing is most of what rendering a report costs:
`extkv report` of a copy of reports/reference/h200 took 3.1 s wall, of
which importing matplotlib.pyplot took 0.4 s and the layout and PNG
encoding of its five figures most of the rest, against 0.17 s for all else
(2-core x86 host, Python 3.11, matplotlib 3.11.2). So `draw_unless_current`
draws a PNG only where the run directory's record of its plots (PLOTS_FILE)
does not say that the PNG there was drawn from these very inputs by this
very code: per PNG name, the record keeps a SHA-256 of the inputs (as
canonical JSON) together with the source of each module that draws them,
and a SHA-256 of the PNG written. A changed input, a changed drawing
module, or a PNG replaced, removed or planted as a symlink draws it again;
matplotlib is imported only then. matplotlib's own version is no part of
the record: another version draws the same data by the same code into the
same plot, and a committed reference then renders again with its PNGs
left as they are, whatever matplotlib its reader has.

A run directory may come from anyone: a record that is missing, garbled or
of another format is read as recording nothing, which costs a drawing and
a record written anew, never a failed report. The PNG's own hash ties each
entry to the file it was written with: a record names no other PNG as
current.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import ModuleType
from typing import Callable

from ..files import read_regular_file
from .rundir import read_json, write_text

#: The run directory's record of the plots drawn into it.
PLOTS_FILE = "plots.json"
PLOTS_FORMAT = "extkv-plots/1"
#: The largest PNG whose hash is compared; a larger one is drawn again. The
#: largest plot of the references is 270 KB (h200's bench_scaling_segments.png).
MOST_PLOT_BYTES = 64 << 20


def matplotlib_missing() -> str | None:
    """None when plots can be drawn, else why not."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        return f"matplotlib is not installed ({error}); install extkv[report] to draw plots"
    return None


def _drawing_key(inputs: object, code: tuple[ModuleType, ...]) -> str:
    """SHA-256 of `inputs` (JSON data) drawn by the modules `code`, each by its source."""
    sources = {module.__name__: hashlib.sha256(Path(module.__file__).read_bytes()).hexdigest() for module in code}
    canonical = json.dumps({"code": sources, "inputs": inputs}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _recorded(run_dir: Path) -> dict:
    """PNG name -> {"drawn_from", "png"} from the run directory's record; {}
    where it holds none that reads as one."""
    try:
        document = read_json(run_dir / PLOTS_FILE)
    except ValueError:  # missing, not a regular file, not JSON: a plain redraw
        return {}
    if not isinstance(document, dict) or document.get("format") != PLOTS_FORMAT:
        return {}
    plots = document.get("plots")
    return plots if isinstance(plots, dict) else {}


def _png_hash(path: Path) -> str | None:
    try:
        return hashlib.sha256(read_regular_file(path, MOST_PLOT_BYTES, "a plot")).hexdigest()
    except ValueError:  # missing, a symlink, too large: not the PNG the record vouches for
        return None


def draw_unless_current(
    path: Path, inputs: object, code: tuple[ModuleType, ...], draw: Callable[[Path], object]
) -> str | None:
    """Make the PNG `path` the plot of `inputs` (JSON data) by `code` (the
    modules whose source draws it): `draw(path)` draws it unless the record
    beside it says the PNG there already is that plot. None where the PNG is
    the plot now, else why it could not be drawn (matplotlib_missing)."""
    path = Path(path)
    key = _drawing_key(inputs, code)
    entry = _recorded(path.parent).get(path.name)
    if isinstance(entry, dict) and entry.get("drawn_from") == key:
        png = _png_hash(path)
        if png is not None and entry.get("png") == png:
            return None
    missing = matplotlib_missing()
    if missing is not None:
        return missing
    draw(path)
    plots = _recorded(path.parent)
    plots[path.name] = {"drawn_from": key, "png": _png_hash(path)}
    record = {"format": PLOTS_FORMAT, "plots": plots}
    write_text(path.parent / PLOTS_FILE, json.dumps(record, indent=1, sort_keys=True) + "\n")
    return None
