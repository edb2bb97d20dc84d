"""The stress section of a report: not built yet."""

from __future__ import annotations

from pathlib import Path


def stress_section(run_dir: Path) -> str | None:
    """Markdown for the stress results in `run_dir` (plots written beside it), or None when there are none."""
    return None
