"""Facts of the machine a run speaks for: host, versions, the host driver and
each GPU this process sees.

Theory of operation
-------------------
The harness's report header prints these facts and every results file
records them, so a report names the devices, drivers, versions and VMM
granularity the tests really ran on, what each GPU offers that a test may
need (GPUDirect RDMA with VMM, dma-buf export: extkv.vmm.cuda.DEVICE_FEATURES),
and the extkv build (version and, from a checkout, its git commit) that ran
them. Gathering them creates no CUDA context: NVML for the driver versions,
`cuInit` and device attributes for the granularity and the features, torch
only for device names and counts. Nothing here imports pytest, so a process
that only starts a run or renders a report can read them too.
"""

from __future__ import annotations

import functools
import re
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from .gpus import visible_gpu_ids


def gpu_label(gpu_id: str, name: str) -> str:
    """`GPU 1 (NVIDIA H200)`: the physical GPU, as CUDA_VISIBLE_DEVICES names it."""
    return f"GPU {gpu_id} ({name})"


def no_cuda_reason() -> str:
    import torch  # here, not atop: `extkv --version` reads this module's versions without torch

    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False (no GPU or a CPU build of torch)"
    return "cuda-python (cuda-bindings) is not importable"


def cuda_device_count() -> int:
    import torch

    from .. import vmm

    return torch.cuda.device_count() if vmm.cuda_usable() else 0


@functools.lru_cache(maxsize=None)
def machine_facts() -> dict:
    """Host name, versions, the host driver and each GPU this process sees:
    name, physical id and label, NVIDIA driver, CUDA driver API, VMM
    granularity, and True/False for each of extkv.vmm.cuda.DEVICE_FEATURES."""
    import torch

    from .. import vmm

    host = vmm.driver_for("cpu").describe()
    facts = {
        "host": socket.gethostname(),
        "extkv": extkv_version(),
        "extkv_commit": extkv_commit(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda or "none (CPU build)",
        "cuda-bindings": version_of("cuda-bindings"),
        "nvidia-ml-py": version_of("nvidia-ml-py"),
        "host_driver": host["driver"],
        "host_granularity": host["granularity"],
        "gpus": [],
        "no_gpu_reason": None,
    }
    if not vmm.cuda_usable():
        facts["no_gpu_reason"] = no_cuda_reason()
        return facts
    from ..vmm.base import format_granularity
    from ..vmm.cuda import DEVICE_FEATURES, device_offers, query_granularity

    driver, cuda_api = _nvidia_driver_versions()
    gpu_ids = visible_gpu_ids()
    for index in range(torch.cuda.device_count()):
        gpu_id = gpu_ids[index] if index < len(gpu_ids) else str(index)
        name = torch.cuda.get_device_name(index)
        facts["gpus"].append(
            {
                "index": index,
                "id": gpu_id,
                "name": name,
                "label": gpu_label(gpu_id, name),
                "driver": driver,
                "cuda_driver_api": cuda_api,
                "granularity": format_granularity(query_granularity(index)),
                **{feature: device_offers(index, feature) for feature in DEVICE_FEATURES},
            }
        )
    return facts


#: What version_of says of a distribution that is not installed.
NOT_INSTALLED = "not installed"


def version_of(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return NOT_INSTALLED


def extkv_version() -> str:
    """The installed distribution's version; for a checkout on the path that
    was never installed, the version its pyproject.toml states, said so
    (`0.1.0 (a checkout, not installed)`), or `unknown (not installed)`."""
    found = version_of("extkv")
    if found != NOT_INSTALLED:
        return found
    stated = _checkout_version(Path(__file__).resolve().parents[2] / "pyproject.toml")
    return f"{stated} (a checkout, not installed)" if stated else "unknown (not installed)"


def _checkout_version(pyproject: Path) -> str | None:
    """The `version` of pyproject.toml's [project] table (read as text:
    tomllib is Python 3.11's, and extkv runs on 3.10)."""
    try:
        text = pyproject.read_text()
    except OSError:
        return None
    project = re.search(r'(?ms)^\[project\]$(.*?)(?=^\[)', text + "\n[")
    found = re.search(r'(?m)^version\s*=\s*"([^"]+)"', project.group(1)) if project else None
    return found.group(1) if found else None


@functools.lru_cache(maxsize=None)
def extkv_commit() -> str | None:
    """The git commit of the checkout extkv is imported from, `+dirty` when
    its tracked files differ; None for an installed package or without git."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if commit.returncode != 0:
        return None
    return commit.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def _nvidia_driver_versions() -> tuple[str, str]:
    """(NVIDIA driver version, CUDA driver API version) from NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
        api = pynvml.nvmlSystemGetCudaDriverVersion()
        return (driver.decode() if isinstance(driver, bytes) else driver), f"{api // 1000}.{api % 1000 // 10}"
    except Exception as error:
        return f"unknown ({error})", "unknown"
