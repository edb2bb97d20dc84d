"""Decode steps of a transformers model over extkv, StaticCache and
DynamicCache (extkv.benchmarking.decode), written to the run directory's
bench_decode.json for the bench's report."""

from __future__ import annotations

import json

import pytest
import torch

from extkv.benchmarking import decode
from extkv.benchmarking.result_files import DECODE_FILE


def test_decode_steps(bench_run):
    pytest.importorskip("transformers", reason="the decode bench needs extkv[transformers], not installed")
    profile, device, run_dir = bench_run
    result = decode.run(device, decode.setting_for(profile, device), progress=lambda line: print(f"bench {line}", flush=True))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / DECODE_FILE).write_text(json.dumps(result, indent=1) + "\n")
    assert set(result["pairs"]) == {f"{kind}-{mode}" for kind, mode in decode.pairs(torch.device(device))}
