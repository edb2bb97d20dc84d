"""Whether a report can draw its plots.

Theory of operation
-------------------
Plots are drawn with matplotlib (the optional `report` extra), imported only
inside the functions that draw, so extkv imports and reports render without
it: `matplotlib_missing()` says why plots are skipped, and each section of
the report prints that instead of its images.
"""

from __future__ import annotations


def matplotlib_missing() -> str | None:
    """None when plots can be drawn, else why not."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        return f"matplotlib is not installed ({error}); install extkv[report] to draw plots"
    return None
