"""`extkv check`'s bytecode tree (extkv.runs.bytecode): where writing
bytecode is forbidden, the run and the processes it starts share a
temporary tree of their own, which goes at the end; anywhere else nothing
changes. The processes started here are real interpreters, which read
their environment at start-up as a run's steps do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from extkv.runs import bytecode
from extkv.runs.bytecode import FORBIDS, PREFIX, run_bytecode

#: Tooling: it proves no invariant of the cache.
pytestmark = pytest.mark.harness

CHILD = """
import sys
sys.path.insert(0, sys.argv[1])
import bytecode_probe
print(sys.pycache_prefix, sys.dont_write_bytecode)
"""


@pytest.fixture
def sources(tmp_path, monkeypatch) -> Path:
    """A module with no bytecode, importable here, deciding in torch's place."""
    sources = tmp_path / "sources"
    sources.mkdir()
    (sources / "bytecode_probe.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(sources))
    monkeypatch.setattr(bytecode, "DECIDING_MODULE", "bytecode_probe")
    return sources


@pytest.fixture
def forbidden(monkeypatch, sources):
    """This process as PYTHONDONTWRITEBYTECODE=1 starts it, with no prefix."""
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setenv(FORBIDS, "1")
    monkeypatch.delenv(PREFIX, raising=False)


def test_where_writing_is_forbidden_the_run_and_its_children_share_a_tree_removed_at_the_end(forbidden, sources):
    said = []
    with run_bytecode(said.append) as tree:
        assert tree is not None and sys.pycache_prefix == tree and sys.dont_write_bytecode is False
        assert os.environ[PREFIX] == tree and FORBIDS not in os.environ
        child = subprocess.run([sys.executable, "-c", CHILD, str(sources)], capture_output=True, text=True,
                               timeout=120, check=False)
        assert child.returncode == 0, child.stderr[-2000:]
        assert child.stdout.split() == [tree, "False"], child.stdout
        written = sorted(Path(tree).rglob("bytecode_probe*.pyc"))
        assert len(written) == 1 and written[0].is_relative_to(Path(tree) / str(sources).lstrip("/")), written
        assert not (sources / "__pycache__").exists(), "bytecode was written beside the source"
    assert not Path(tree).exists(), f"the run's bytecode tree {tree} outlived the run"
    assert (sys.pycache_prefix, sys.dont_write_bytecode) == (None, True)
    assert os.environ[FORBIDS] == "1" and PREFIX not in os.environ
    assert len(said) == 1 and tree in said[0] and "bytecode_probe has none" in said[0], said


def test_where_the_deciding_module_has_bytecode_nothing_changes(forbidden, sources):
    """As where pip wrote torch's bytecode at install: read from there, it is
    faster than anything a run could compile."""
    compiled = subprocess.run([sys.executable, "-m", "py_compile", str(sources / "bytecode_probe.py")],
                              env={**os.environ, FORBIDS: ""}, capture_output=True, text=True, timeout=60)
    assert compiled.returncode == 0 and (sources / "__pycache__").is_dir(), compiled.stderr
    environment, said = dict(os.environ), []
    with run_bytecode(said.append) as tree:
        assert tree is None and sys.pycache_prefix is None and dict(os.environ) == environment
    assert said == []


def test_an_interrupted_run_removes_its_tree_and_restores_the_settings(forbidden):
    with pytest.raises(KeyboardInterrupt):
        with run_bytecode(lambda words: None) as tree:
            raise KeyboardInterrupt
    assert not Path(tree).exists(), tree
    assert (sys.pycache_prefix, sys.dont_write_bytecode, os.environ[FORBIDS]) == (None, True, "1")
    assert PREFIX not in os.environ


@pytest.mark.parametrize(("forbidden_here", "prefix"), [(False, None), (True, "/elsewhere")],
                         ids=["writing allowed", "a prefix set"])
def test_where_bytecode_may_be_written_or_has_a_place_nothing_changes(monkeypatch, sources, forbidden_here, prefix):
    monkeypatch.setattr(sys, "dont_write_bytecode", forbidden_here)
    monkeypatch.setattr(sys, "pycache_prefix", prefix)
    environment, said = dict(os.environ), []
    with run_bytecode(said.append) as tree:
        assert tree is None
        assert (sys.dont_write_bytecode, sys.pycache_prefix) == (forbidden_here, prefix)
        assert dict(os.environ) == environment
    assert said == []


@pytest.fixture
def package(tmp_path, monkeypatch) -> Path:
    """A package of two modules with no bytecode, deciding in torch's place."""
    sources = tmp_path / "package_sources"
    (sources / "bytecode_package").mkdir(parents=True)
    (sources / "bytecode_package" / "__init__.py").write_text("VALUE = 1\n")
    (sources / "bytecode_package" / "never_imported.py").write_text("VALUE = 2\n")
    monkeypatch.syspath_prepend(str(sources))
    monkeypatch.setattr(bytecode, "DECIDING_MODULE", "bytecode_package")
    return sources / "bytecode_package"


def _compiled_in(tree: str, package: Path) -> list[str]:
    """The modules of `package` whose bytecode is in `tree`."""
    return sorted(path.name.split(".")[0] for path in (Path(tree) / str(package).lstrip("/")).rglob("*.pyc"))


def test_on_enough_cores_the_deciding_package_is_compiled_whole_before_anything_imports_it(forbidden, package,
                                                                                           monkeypatch):
    """Every file of the package, imported or not, is in the tree once the run
    begins, so no process of the run compiles it; nothing beside the sources."""
    monkeypatch.setattr(bytecode, "COMPILE_AHEAD_CORES", 1)
    said = []
    with run_bytecode(said.append) as tree:
        assert "bytecode_package" not in sys.modules
        assert _compiled_in(tree, package) == ["__init__", "never_imported"]
        assert not (package / "__pycache__").exists(), "bytecode was written beside the source"
    assert len(said) == 2 and "bytecode_package compiled into it on" in said[1], said


def test_below_enough_cores_the_deciding_package_is_left_to_its_import(forbidden, package, monkeypatch):
    monkeypatch.setattr(bytecode, "COMPILE_AHEAD_CORES", len(os.sched_getaffinity(0)) + 1)
    said = []
    with run_bytecode(said.append) as tree:
        assert _compiled_in(tree, package) == []
    assert len(said) == 1, said
