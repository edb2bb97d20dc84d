"""Facts of the machine a report speaks for.

Theory of operation
-------------------
extkv.testing.facts gathers the facts: the harness's report header prints
them and the results file of every run records them, so a report names the
devices, driver, versions and VMM granularity that the tests really ran on,
and the extkv build that ran them. This module reads the same facts in the
process that starts a run (the run directory is named after its GPUs) and
renders them as the report's machine section.

A run from a checkout that was never installed records its version as
unknown, but its commit: `build_words` names the version that commit's
pyproject.toml states, read from the git history of the checkout rendering
the report, so a report rendered again later still names both.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from ..testing.facts import machine_facts
from .rundir import checkout_root, read_json

#: What extkv.testing.facts records as the version of a checkout never installed.
UNINSTALLED_VERSION = "unknown (not installed)"


def commit_version(commit: str) -> str | None:
    """The version pyproject.toml states at `commit` (`+dirty` ignored), from
    the git history of the checkout extkv is imported from; None without a
    checkout, git, or that commit."""
    root = checkout_root()
    name = commit.removesuffix("+dirty")
    if root is None or not re.fullmatch(r"[0-9a-f]{7,40}", name):
        return None
    try:
        shown = subprocess.run(["git", "-C", str(root), "show", f"{name}:pyproject.toml"],
                               capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    # The `version` of the [project] table (tomllib is Python 3.11's; extkv runs on 3.10).
    project = re.search(r'(?ms)^\[project\]$(.*?)(?=^\[)', shown.stdout + "\n[") if shown.returncode == 0 else None
    found = re.search(r'(?m)^version\s*=\s*"([^"]+)"', project.group(1)) if project else None
    return found.group(1) if found else None


def build_words(facts: dict) -> str:
    """`extkv 0.1.0 at commit 3b5b5478cece`: the build that ran, as the facts
    recorded it; the version of a checkout never installed from its commit's
    pyproject.toml."""
    version, commit = facts["extkv"], facts.get("extkv_commit")
    if version == UNINSTALLED_VERSION:
        found = commit_version(commit) if commit else None
        version = f"{found} (a checkout, not installed)" if found else "(a checkout, not installed: version unknown)"
    return f"extkv {version}" + (f" at commit {commit}" if commit else "")


def machine_section(facts: dict, worker_gpus: dict[str, str] | None = None) -> str:
    """The report's machine section, in markdown."""
    lines = [
        "## Machine",
        "",
        f"- host: `{facts['host']}`",
        f"- {build_words(facts)}",
        f"- python {facts['python']}, torch {facts['torch']} (CUDA {facts['torch_cuda']}), "
        f"cuda-bindings {facts['cuda-bindings']}, nvidia-ml-py {facts['nvidia-ml-py']}",
        f"- host driver: {facts['host_driver']}, granularity {facts['host_granularity']}",
    ]
    if facts["gpus"]:
        lines += [
            "",
            "| device | GPU | NVIDIA driver | CUDA driver API | VMM granularity |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| cuda:{gpu['index']} | {gpu['label']} | {gpu['driver']} | {gpu['cuda_driver_api']} | {gpu['granularity']} |"
            for gpu in facts["gpus"]
        ]
    else:
        lines.append(f"- no CUDA device: {facts['no_gpu_reason']}")
    if worker_gpus:
        lines += ["", "xdist workers per GPU: " + "; ".join(f"{step}: {pins}" for step, pins in worker_gpus.items())]
    return "\n".join(lines) + "\n"


#: The facts of a run that has no check results (a bench or stress run writes it).
MACHINE_FILE = "machine.json"


def write_machine_facts(run_dir: Path) -> Path:
    """Record this machine's facts in `run_dir` for its report."""
    path = Path(run_dir) / MACHINE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(machine_facts(), indent=1) + "\n")
    return path


def read_machine_facts(run_dir: Path) -> dict | None:
    """The facts `write_machine_facts` recorded in `run_dir`, or None; ValueError naming a garbled file."""
    path = Path(run_dir) / MACHINE_FILE
    if not path.is_file():
        return None
    facts = read_json(path)
    if not isinstance(facts, dict) or "gpus" not in facts:
        raise ValueError(f"{path}: not machine facts (no 'gpus')")
    return facts
