"""The harness plugin in a project that does not ask for it: no cost, no names.

Theory of operation
-------------------
pytest loads extkv's `pytest11` entry points in every project of an
environment where extkv is installed. Each test here makes a one-test
project in a temporary directory and runs pytest on it in a process of its
own, with the entry points that pyproject.toml declares installed beside
this checkout (a dist-info directory on PYTHONPATH, read by pytest as any
installed distribution's): what a user gets after `pip install extkv`. The
project's test writes what its process holds after collection; the plugin
must be loaded (else the test proves nothing) and hold no torch and no
extkv module but the entry module, and `--fixtures`, `--markers` and
`--help` must show no name of extkv's but `--extkv...` options.

`-p no:extkv` (the name pytest shows) and `-p no:extkv.testing.harness`
disable it; a project laid out as extkv's checkout is (a root conftest
naming the module in `pytest_plugins`, a suite conftest that activates the
harness) gets the harness by default, and a usage error naming the flag,
not an INTERNALERROR, when it is disabled.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import extkv
from extkv.testing import harness_hooks

pytestmark = pytest.mark.harness

ROOT = Path(extkv.__file__).resolve().parent.parent
#: The modules of extkv a process that loaded the plugin and never activated it may hold.
ENTRY_MODULES = ["extkv", "extkv.testing", "extkv.testing.harness"]

PROBE_TEST = '''
import json, sys

def test_probe(pytestconfig):
    manager = pytestconfig.pluginmanager
    harness = sys.modules.get("extkv.testing.harness")
    held = sorted(name for name in sys.modules if name.split(".")[0] in ("torch", "extkv"))
    json.dump({"loaded": harness is not None and manager.is_registered(harness), "held": held}, open("held.json", "w"))
'''


@pytest.fixture
def project(tmp_path) -> tuple[Path, dict]:
    """(a one-test project, the environment that runs pytest there as if
    extkv were installed)."""
    site = tmp_path / "site"
    pyproject = ROOT / "pyproject.toml"
    paths = [str(ROOT)]
    if pyproject.is_file():
        tomllib = pytest.importorskip("tomllib")
        entry_points = tomllib.loads(pyproject.read_text())["project"]["entry-points"]["pytest11"]
        info = site / "extkv_checkout-0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: extkv-checkout\nVersion: 0\n")
        (info / "entry_points.txt").write_text(
            "[pytest11]\n" + "".join(f"{name} = {value}\n" for name, value in entry_points.items())
        )
        paths.insert(0, str(site))
    directory = tmp_path / "project"
    directory.mkdir()
    (directory / "test_probe.py").write_text(PROBE_TEST)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    env.pop("PYTEST_ADDOPTS", None)
    return directory, env


def pytest_in(directory: Path, env: dict, *arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *arguments],
        cwd=directory, env=env, capture_output=True, text=True, timeout=600, check=False,
    )


def held(directory: Path) -> dict:
    return json.loads((directory / "held.json").read_text())


def test_a_project_that_does_not_ask_pays_no_imports(project):
    directory, env = project
    result = pytest_in(directory, env, "-q")
    assert result.returncode == 0, result.stdout + result.stderr
    found = held(directory)
    assert found["loaded"], "the plugin was not loaded: this run proves nothing of it"
    assert found["held"] == ENTRY_MODULES, f"an inactive plugin imported {sorted(set(found['held']) - set(ENTRY_MODULES))}"


def test_a_project_that_does_not_ask_sees_no_fixture_marker_or_option_of_extkv(project):
    directory, env = project
    fixtures = pytest_in(directory, env, "--fixtures", "-q")
    markers = pytest_in(directory, env, "--markers")
    options = pytest_in(directory, env, "--help")
    for result in (fixtures, markers, options):
        assert result.returncode == 0, result.stdout + result.stderr
    ours = {name for name in dir(harness_hooks) if hasattr(getattr(harness_hooks, name), "_get_wrapped_function")}
    assert {"device", "driver", "build", "no_leaks"} <= ours, "the fixtures of harness_hooks are not what this test reads"
    listed = set(re.findall(r"^(\w+)(?: \[[^\]]*\])? -- ", fixtures.stdout, re.M))
    assert not listed & ours, f"fixtures of extkv in a project that did not ask: {sorted(listed & ours)}"
    assert "extkv" not in fixtures.stdout
    marker_names = {name.split("(")[0] for name in harness_hooks.MARKERS}
    listed_markers = set(re.findall(r"^@pytest\.mark\.(\w+)", markers.stdout, re.M))
    assert not listed_markers & marker_names, f"markers of extkv: {sorted(listed_markers & marker_names)}"
    group = options.stdout.partition("extkv harness:")[2].split("\n\n")[0]
    flags = re.findall(r"^\s+(--[\w-]+)", group, re.M)
    assert flags and all(flag.startswith("--extkv") for flag in flags), flags
    unprefixed = [flag for flag in re.findall(r"^\s+(--[\w-]+)", options.stdout, re.M) if "stress" in flag]
    assert all(flag.startswith("--extkv") for flag in unprefixed), unprefixed


def test_dash_p_no_extkv_keeps_the_plugin_out(project):
    directory, env = project
    result = pytest_in(directory, env, "-q", "-p", "no:extkv")
    assert result.returncode == 0, result.stdout + result.stderr
    found = held(directory)
    # The stand-in of the module's name is loaded from the module, unregistered.
    assert not found["loaded"] and set(found["held"]) <= set(ENTRY_MODULES), found


@pytest.fixture
def checkout_like(project) -> tuple[Path, dict]:
    """A project laid out as extkv's checkout: the root conftest names the
    harness module, a suite's conftest activates it, a test uses `device`."""
    directory, env = project
    (directory / "conftest.py").write_text('pytest_plugins = ["extkv.testing.harness"]\n')
    suite = directory / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(
        "from extkv.testing import harness\n\ndef pytest_configure(config):\n    harness.activate(config)\n"
    )
    (suite / "test_device.py").write_text("def test_device(device):\n    assert str(device) in ('cpu', 'cuda:0')\n")
    return directory, env


def test_a_checkout_layout_gets_the_harness(checkout_like):
    directory, env = checkout_like
    result = pytest_in(directory, env, "-q", "suite", "-k", "host")
    assert result.returncode == 0 and "1 passed" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize("name", ["extkv", "extkv.testing.harness"])
def test_a_disabled_harness_is_a_usage_error_naming_the_flag(checkout_like, name):
    directory, env = checkout_like
    result = pytest_in(directory, env, "-q", "suite", "-p", f"no:{name}")
    output = result.stdout + result.stderr
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, output
    assert f"-p no:{name} disabled the extkv harness" in output and "INTERNALERROR" not in output, output
