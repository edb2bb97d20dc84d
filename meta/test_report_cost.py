"""`extkv report` reads results and renders them without importing torch,
and renders a committed reference again without drawing.

Theory of operation
-------------------
A report only reads the JSON a run left and draws it, so it must be as
cheap on a laptop without a device as `extkv --help` (meta/test_cli_input.py):
importing torch alone takes seconds. Drawing is the rest of the cost
(matplotlib's import, layout and PNG encoding took 2.9 s of the h200
reference's 3.1 s), and a committed reference's record of its plots
(extkv.runs.plots) says each PNG is already the plot of its results by
today's code, so rendering it again draws nothing. A copy of each reference
run directory (reports/reference/<kind>: check, bench, decode, growth loop,
stress and timeline results) is rendered in a process of its own through
`extkv.cli.main`, which then lists the torch and matplotlib modules it
holds: none. A reference whose plots or plotting code changed is rendered
again where it lives (`extkv report reports/reference/<kind>`), which
redraws its plots and their record.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from extkv.runs.plots import PLOTS_FILE

ROOT = Path(__file__).resolve().parent.parent
REFERENCES = ROOT / "reports" / "reference"
KINDS = sorted(path.name for path in REFERENCES.iterdir() if (path / "summary.md").is_file())


@pytest.mark.harness
@pytest.mark.parametrize("kind", KINDS)
def test_report_of_a_reference_run_imports_no_torch_and_no_matplotlib(tmp_path, kind):
    run_dir = tmp_path / kind
    shutil.copytree(REFERENCES / kind, run_dir)
    script = (
        "import json, sys\n"
        "from extkv import cli\n"
        f"cli.main(['report', {str(run_dir)!r}])\n"
        "print(json.dumps({top: sorted(name for name in sys.modules if name.split('.')[0] == top)\n"
        "                  for top in ('torch', 'matplotlib')}))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr
    assert (run_dir / "summary.md").stat().st_size > 0, "the report wrote no summary.md"
    imported = json.loads(result.stdout.splitlines()[-1])
    assert imported["torch"] == [], f"`extkv report` imported {len(imported['torch'])} torch modules"
    assert imported["matplotlib"] == [], (
        f"`extkv report` of a reference whose plots are current imported {len(imported['matplotlib'])} matplotlib "
        f"modules: its record of its plots ({PLOTS_FILE}) is stale; render {REFERENCES / kind} again"
    )
