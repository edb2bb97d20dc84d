"""Which GPU each pytest-xdist worker uses, decided before CUDA initializes.

Worker gwN gets GPU N modulo the number of GPUs. The count comes from NVML,
which does not initialize CUDA, and honours a CUDA_VISIBLE_DEVICES the user
already set (the worker then picks from that list). The choice is applied by
narrowing CUDA_VISIBLE_DEVICES to the one GPU, so in the worker that GPU is
`cuda:0`.
"""

from __future__ import annotations

import os


def visible_gpu_ids() -> list[str]:
    """GPU ids CUDA may use, as CUDA_VISIBLE_DEVICES entries; [] without NVML."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [entry.strip() for entry in listed.split(",") if entry.strip() and entry.strip() != "-1"]
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return [str(i) for i in range(pynvml.nvmlDeviceGetCount())]
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML library or no driver: a CPU-only machine
        return []


def worker_index(worker: str) -> int:
    """`gw3` -> 3."""
    return int(worker.removeprefix("gw"))


def gpu_for_worker(worker: str, gpu_ids: list[str]) -> str | None:
    if not gpu_ids:
        return None
    return gpu_ids[worker_index(worker) % len(gpu_ids)]


def pin_this_worker() -> str | None:
    """In an xdist worker, narrow CUDA_VISIBLE_DEVICES to the worker's GPU and
    return it; None outside xdist or without GPUs."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return None
    gpu = gpu_for_worker(worker, visible_gpu_ids())
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    return gpu
