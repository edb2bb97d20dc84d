"""What every run command shares: pytest's options for a suite run from an
installed package.

Theory of operation
-------------------
`extkv check`, `bench` and `stress` each run their suite with pytest. From a
checkout, the checkout's conftest and pyproject.toml give pytest the harness
and its ini options; from an installed package nothing does, so
`installed_suite_options` puts them on the command line (INSTALLED_OPTIONS:
the ini options, repeated).

A run ends by rendering its directory's `summary.md` from every kind's
sections (extkv.report.render_report). The renderer stands above every
kind of run, so no run module imports it: the command line passes it to
each run's `run(..., render=...)`, and an interrupted run hands it on to
`interrupted_report` for its last line.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from .rundir import checkout_root

#: What the checkout's [tool.pytest.ini_options] gives, on the command line
#: for an installed package (the harness arrives through -p there).
INSTALLED_OPTIONS = ["-ra", "--strict-markers", "-o", "timeout=600"]


def installed_suite_options(suite: Path) -> list[str]:
    """What pytest needs to run `suite` from an installed package, where no
    checkout gives it a conftest and ini options; nothing in a checkout."""
    if checkout_root() is not None:
        return []
    return ["-c", os.devnull, "--rootdir", str(suite), "-p", "no:cacheprovider", "-p", "extkv.testing.harness", *INSTALLED_OPTIONS]


def interrupted_report(run_dir: Path, render: Callable[[Path], Path]) -> str:
    """For the one line an interrupted run (check, stress, bench) ends with:
    `report <summary.md>` once `render` has written it from what results
    there are, else why there is none."""
    try:
        return f"report {render(run_dir)}"
    except (OSError, ValueError) as error:
        return f"no report ({error})"
