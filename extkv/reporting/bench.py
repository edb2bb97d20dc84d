"""The bench section of a report: not built yet."""

from __future__ import annotations

from pathlib import Path


def bench_section(run_dir: Path) -> str | None:
    """Markdown for the bench results in `run_dir` (plots written beside it), or None when there are none."""
    return None
