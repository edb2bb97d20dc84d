"""The certificate's line of each GPU's optional features.

Theory of operation
-------------------
Some promises hold only where a GPU offers a feature (GPUDirect RDMA with
VMM, dma-buf export: extkv.testing.invariants.GPU_FEATURES); the tests of
one carry its marker, which the harness records (`gpu_features`) and turns
into a skip reading "not supported here (... = 0)" on a device without it.
A device verdict counts none of this apart: a failed test fails the device
like any other, and a skip is no failure. So that a reader learns whether a
GPU proved them or could not, each GPU gets a line of its features: each
proven (its tests passed, none failed), NOT PROVEN (one failed), or the
skip's own reason where the device lacks it. Results recorded before tests
carried the field, and devices that ran no test of a feature, say nothing
of it.
"""

from __future__ import annotations

from ..testing.invariants import GPU_FEATURES


def feature_lines(check: dict, devices: list[tuple[str, str]]) -> list[str]:
    """One line per GPU in `devices` ((label, name as its verdict names it))
    that ran a test of a feature: `cuda:0 NVIDIA H200 (...): GPUDirect RDMA
    with VMM proven (1 test); dma-buf export proven (1 test)`."""
    lines = []
    for label, name in devices:
        parts = [part for feature in GPU_FEATURES if (part := _feature_part(check, label, feature))]
        if parts:
            lines.append(f"{name}: {'; '.join(parts)}")
    return lines


def _feature_part(check: dict, label: str, feature: str) -> str | None:
    records = [record for record in check["tests"].values()
               if record["device"] == label and feature in (record.get("gpu_features") or ())]
    if not records:
        return None
    words = GPU_FEATURES[feature]
    outcomes = [record["outcome"] for record in records]
    failed = sum(outcome in ("failed", "error") for outcome in outcomes)
    if failed:
        return f"{words} NOT PROVEN ({failed} failed)"
    passed = outcomes.count("passed")
    if passed:
        return f"{words} proven ({passed} test{'s' if passed > 1 else ''})"
    reason = next((record["skip_reason"] for record in records if record["skip_reason"]), None)
    return reason or f"{words}: no test ran"
