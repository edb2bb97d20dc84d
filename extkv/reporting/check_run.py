"""`extkv check`: the conformance suite on every GPU found, else on the host driver."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import torch

from .. import vmm


def _gpu_count() -> int:
    return torch.cuda.device_count() if vmm.cuda_usable() else 0


def _suite_root() -> Path:
    root = Path(__file__).resolve().parent.parent.parent
    if not (root / "conformance").is_dir():
        raise SystemExit(
            f"extkv check: no conformance/ directory next to the extkv package in {root}; "
            "run it from a source checkout installed with `pip install -e '.[test]'`"
        )
    return root


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options of its own yet: every other argument goes to pytest."""


def run(args: argparse.Namespace, pytest_args: list[str]) -> int:
    root = _suite_root()
    gpus = _gpu_count()
    command = [sys.executable, "-m", "pytest", "conformance", "-q"]
    if gpus > 1:
        command += ["-n", str(gpus)]
    where = f"{gpus} GPU(s) and the host driver" if gpus else "the host driver only (no CUDA GPU found)"
    print(f"extkv check: conformance suite on {where}", flush=True)
    print("$ " + " ".join(command + pytest_args), flush=True)
    return subprocess.call(command + pytest_args, cwd=root, env=os.environ.copy())
