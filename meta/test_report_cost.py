"""`extkv report` reads results and renders them without importing torch.

Theory of operation
-------------------
A report only reads the JSON a run left and draws it, so it must be as
cheap on a laptop without a device as `extkv --help` (meta/test_cli_input.py):
importing torch alone takes seconds. A copy of a reference run directory
(reports/reference/host: check, bench, decode, growth loop, stress and
timeline results) is rendered in a process of its own through
`extkv.cli.main`, which then lists the torch modules it holds: none.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
REFERENCE_RUN = ROOT / "reports" / "reference" / "host"


@pytest.mark.harness
def test_report_of_a_reference_run_imports_no_torch(tmp_path):
    run_dir = tmp_path / "host"
    shutil.copytree(REFERENCE_RUN, run_dir)
    script = (
        "import json, sys\n"
        "from extkv import cli\n"
        f"cli.main(['report', {str(run_dir)!r}])\n"
        "print(json.dumps(sorted(name for name in sys.modules if name.split('.')[0] == 'torch')))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr
    assert (run_dir / "summary.md").stat().st_size > 0, "the report wrote no summary.md"
    torch_modules = json.loads(result.stdout.splitlines()[-1])
    assert torch_modules == [], f"`extkv report` imported {len(torch_modules)} torch modules"
