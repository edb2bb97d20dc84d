"""Facts of the machine a report speaks for.

Theory of operation
-------------------
extkv.testing.facts gathers the facts: the harness's report header prints
them and the results file of every run records them, so a report names the
devices, driver, versions and VMM granularity that the tests really ran on,
and the extkv build that ran them. This module reads the same facts in the
process that starts a run (the run directory is named after its GPUs) and
renders them as the report's machine section.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..testing.facts import machine_facts
from .rundir import read_json


def machine_section(facts: dict, worker_gpus: dict[str, str] | None = None) -> str:
    """The report's machine section, in markdown."""
    lines = [
        "## Machine",
        "",
        f"- host: `{facts['host']}`",
        f"- extkv {facts['extkv']}" + (f" at commit {facts['extkv_commit']}" if facts['extkv_commit'] else ""),
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
