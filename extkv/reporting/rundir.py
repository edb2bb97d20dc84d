"""Where a run's files go, and where the suites it runs live.

Theory of operation
-------------------
One directory per machine and day: `reports/<YYYY-MM-DD>-<host>-<gpus>/`
(`h200`, `2xh200`, or `host` without a GPU), so a second run on the same
machine the same day adds to, or replaces files in, the same directory. The
root is the checkout's `reports/` when extkv runs from a source checkout
(an editable install), else `./reports` under the current directory.

The suites ship in the distribution as packages of their own (pyproject maps
`extkv_conformance` to `conformance/` and `extkv_benchmarks` to the
`reports/` benchmark modules); from a checkout they are its directories.
`suite_directory` answers either way.
"""

from __future__ import annotations

import datetime
import importlib.util
import re
from collections import Counter
from pathlib import Path

#: Suite directory in a checkout -> the package it is installed as.
SUITE_PACKAGES = {"conformance": "extkv_conformance", "reports": "extkv_benchmarks", "stress": "extkv_stress"}
#: Words dropped from a GPU's name in a run directory's name.
_VENDOR_WORDS = ("nvidia",)


def slug(text: str) -> str:
    """Lower case, runs of anything but letters and digits made one `-`."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def gpu_slug(facts: dict) -> str:
    """`h200`, `2xh200`, `h200-a100`; `host` without a GPU."""
    names = Counter()
    for gpu in facts["gpus"]:
        words = [word for word in slug(gpu["name"]).split("-") if word not in _VENDOR_WORDS]
        names["-".join(words) or "gpu"] += 1
    if not names:
        return "host"
    return "-".join(name if count == 1 else f"{count}x{name}" for name, count in names.items())


def checkout_root() -> Path | None:
    """The source checkout extkv is imported from, or None for an installed package."""
    root = Path(__file__).resolve().parents[2]  # extkv/reporting/rundir.py -> the directory above extkv/
    if (root / "pyproject.toml").is_file() and (root / "conformance").is_dir():
        return root
    return None


def reports_root() -> Path:
    root = checkout_root()
    return (root if root is not None else Path.cwd()) / "reports"


def run_directory(facts: dict, day: datetime.date | None = None, root: Path | None = None) -> Path:
    """`<root>/<YYYY-MM-DD>-<host>-<gpus>` for the machine of `facts` (not created)."""
    day = day or datetime.date.today()
    host = slug(facts["host"].split(".")[0]) or "unknown-host"
    return (root if root is not None else reports_root()) / f"{day.isoformat()}-{host}-{gpu_slug(facts)}"


def suite_directory(suite: str) -> Path:
    """Where suite `suite` (`conformance`, `reports`) lives: the checkout's
    directory, else the installed package's."""
    if suite not in SUITE_PACKAGES:
        raise ValueError(f"suite {suite!r} is not one of {sorted(SUITE_PACKAGES)}")
    root = checkout_root()
    if root is not None:
        return root / suite
    spec = importlib.util.find_spec(SUITE_PACKAGES[suite])
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the {suite} suite is neither beside extkv (no checkout) nor installed as {SUITE_PACKAGES[suite]}; "
            "reinstall extkv"
        )
    return Path(list(spec.submodule_search_locations)[0])
