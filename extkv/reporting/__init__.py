"""Reports of extkv runs: `reports/<date>-<host>-<gpu>/`.

Theory of operation
-------------------
Every run that proves or measures something (`extkv check`, `extkv bench`,
`extkv stress`) leaves its raw results as files in one run directory: JUnit
XML and JSON. `render_report(run_dir)` turns whatever raw results the
directory holds into `summary.md` and PNG plots, so a report can be rendered
again later (`extkv report DIR`) from the same files.
"""

from __future__ import annotations

from pathlib import Path


def render_report(run_dir: Path) -> Path:
    """Write `summary.md` (and plots) for the raw results in `run_dir`; return its path."""
    raise NotImplementedError("render_report: not built yet")
