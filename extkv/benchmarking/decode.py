"""Decode steps of a transformers model over extkv, StaticCache and DynamicCache.

Theory of operation
-------------------
What an engine pays for extkv inside a model: one step of greedy decode
(one token per sequence) of a random-initialised Llama, timed over three
caches holding the same tokens. `ExtensibleCache` (extkv.integrations
.transformers) reserves `max_cache_len` and maps blocks as tokens arrive;
`StaticCache` allocates `max_cache_len` up front; `DynamicCache` grows by
`torch.cat`. Each runs eager (the model's forward per step) and, where its
addresses stay fixed (extkv and StaticCache; DynamicCache's tensors move
every step), graphed: one decode step captured as a CUDA graph after a warm
step and replayed for every step after it, extkv's `make_room(1)` before
each replay, as an engine's loop does.

A run is `rounds` rounds; in each, every (cache, mode) pair prefills
`prompt` tokens and decodes `steps` steps, the pairs in the rows of a
Williams design (extkv.benchmarking.rounds) so each meets the state every
other leaves. A step's time is wall time from the
step's first host call to the device's synchronize after it, so a step that
commits a new block pays its driver calls. Per pair: the median and p99 of
the steps of each round, then the least median and least p99 over rounds;
ratios are those against StaticCache in the same mode. Growth steps are
extkv's steps whose `make_room` mapped memory; their median is given beside
the median of the others. Memory: the bytes each cache holds for K/V after
the last step (extkv: mapped bytes; StaticCache: its tensors; DynamicCache:
its tensors, what torch.cat left), beside the bytes the tokens need.

The result is one JSON object (`run`), written by bench/bench_decode.py
as result_files.DECODE_FILE in the run directory and rendered by
`decode_section` (extkv.benchmarking.decode_report) in the bench's report.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch

from .primitives import synchronize
from .rounds import round_order

#: The model of the GPU run: 8 Llama layers of width 2048, 16 query heads
#: over 4 KV heads of 128 (grouped-query attention), bf16.
GPU_MODEL = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
                 num_key_value_heads=4, head_dim=128, vocab_size=32000)
#: The host run's model: small enough that a CPU decodes it in seconds.
HOST_MODEL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, vocab_size=512)


@dataclass(frozen=True)
class Setting:
    model: dict
    dtype: torch.dtype
    batch_size: int
    max_cache_len: int
    prompt: int
    steps: int
    rounds: int


#: 4 sequences from 256 to 640 tokens in a 4096-token cache. A round of
#: every pair takes about 25 s on the H200 (eager DynamicCache's first round
#: the most, 50 ms a step at 1,024 steps).
GPU_SETTING = Setting(GPU_MODEL, torch.bfloat16, batch_size=4, max_cache_len=4096, prompt=256, steps=384, rounds=2)
HOST_SETTING = Setting(HOST_MODEL, torch.float32, batch_size=2, max_cache_len=256, prompt=16, steps=48, rounds=2)
#: The smoke run of `extkv bench --quick`, on any device.
QUICK_SETTING = Setting(HOST_MODEL, torch.float32, batch_size=2, max_cache_len=64, prompt=8, steps=12, rounds=1)

def setting_for(profile: str, device: torch.device | str) -> Setting:
    """The setting of a bench profile on `device`."""
    if profile == "quick":
        return QUICK_SETTING
    return GPU_SETTING if torch.device(device).type == "cuda" else HOST_SETTING

CACHES = ("extkv", "static", "dynamic")
MODES = ("eager", "graphed")


def make_model(setting: Setting, device: torch.device):
    import transformers

    config = transformers.LlamaConfig(**setting.model, max_position_embeddings=setting.max_cache_len)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(device=device, dtype=setting.dtype).eval()


def make_cache(kind: str, model, setting: Setting):
    import transformers

    from ..integrations.transformers import ExtensibleCache

    if kind == "extkv":
        return ExtensibleCache(model.config, setting.max_cache_len, device=model.device, dtype=model.dtype,
                               batch_size=setting.batch_size)
    if kind == "static":
        return transformers.StaticCache(config=model.config, max_cache_len=setting.max_cache_len)
    return transformers.DynamicCache(config=model.config)


def kv_bytes(kind: str, cache) -> int:
    """Bytes the cache holds for keys and values now."""
    if kind == "extkv":
        return cache.physical_bytes
    return sum(t.numel() * t.element_size() for layer in cache.layers
               for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if isinstance(t, torch.Tensor))


def needed_bytes(model, setting: Setting, tokens: int) -> int:
    """Bytes `tokens` tokens of every sequence need for K and V, over every layer."""
    c = model.config
    return 2 * c.num_hidden_layers * setting.batch_size * tokens * c.num_key_value_heads * c.head_dim * model.dtype.itemsize


def decode(kind: str, mode: str, model, setting: Setting) -> dict:
    """One round of one (cache, mode): prefill, then `setting.steps` timed
    steps. Returns the step times (s), the growth steps' indices and bytes."""
    device = model.device
    cache = make_cache(kind, model, setting)
    ids = torch.randint(0, model.config.vocab_size, (setting.batch_size, setting.prompt),
                        generator=torch.Generator().manual_seed(1)).to(device)
    times, growth = [], []
    try:
        with torch.no_grad():
            token = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            synchronize(device)
            step = _graphed_step(model, cache, token) if mode == "graphed" else None
            for i in range(setting.steps):
                mapped = cache.physical_bytes if kind == "extkv" else 0
                start = time.perf_counter()
                if step is None:
                    token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
                else:
                    if kind == "extkv":
                        cache.make_room(1)
                    step()
                synchronize(device)
                times.append(time.perf_counter() - start)
                if kind == "extkv" and cache.physical_bytes != mapped:
                    growth.append(i)
        held = kv_bytes(kind, cache)
    finally:
        if kind == "extkv":
            cache.free()
    return {"times": times, "growth": growth, "kv_bytes": held,
            "needed_bytes": needed_bytes(model, setting, setting.prompt + setting.steps + (mode == "graphed"))}


def _graphed_step(model, cache, token):
    """Warm one step on a side stream, capture the next as a CUDA graph;
    returns a call that replays it and feeds its argmax back as input."""
    stream = torch.cuda.Stream(model.device)
    stream.wait_stream(torch.cuda.current_stream(model.device))
    with torch.cuda.stream(stream):
        static = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    torch.cuda.current_stream(model.device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = model(input_ids=static, past_key_values=cache, use_cache=True).logits[:, -1:]
        following = logits.argmax(-1)

    def step():
        graph.replay()
        static.copy_(following)

    return step


def p99(values: list[float]) -> float:
    """The 99th percentile of `values`, by nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def pairs(device: torch.device) -> list[tuple[str, str]]:
    """(cache, mode) pairs this device runs: graphs need CUDA, and fixed addresses."""
    graphed = device.type == "cuda"
    return [(kind, mode) for kind in CACHES for mode in MODES if mode == "eager" or (graphed and kind != "dynamic")]


def run(device: torch.device | str, setting: Setting, progress=print) -> dict:
    """Every pair of `pairs(device)`, `setting.rounds` rounds; the summary per pair."""
    device = torch.device(device)
    model = make_model(setting, device)
    chosen = pairs(device)
    rounds: dict[str, list[dict]] = {f"{k}-{m}": [] for k, m in chosen}
    for r in range(setting.rounds):
        for kind, mode in round_order(chosen, r):
            got = decode(kind, mode, model, setting)
            rounds[f"{kind}-{mode}"].append(got)
            progress(f"decode round {r + 1}/{setting.rounds} {kind} {mode}: median step "
                     f"{statistics.median(got['times']) * 1e3:.3f} ms")
    summary = {}
    for name, seen in rounds.items():
        growth = [t for got in seen for i, t in enumerate(got["times"]) if i in set(got["growth"])]
        other = [t for got in seen for i, t in enumerate(got["times"]) if i not in set(got["growth"])]
        summary[name] = {
            "median_s": min(statistics.median(got["times"]) for got in seen),
            "p99_s": min(p99(got["times"]) for got in seen),
            "growth_steps": sum(len(got["growth"]) for got in seen) // len(seen),
            "growth_median_s": statistics.median(growth) if growth else None,
            "other_median_s": statistics.median(other) if other else None,
            "kv_bytes": seen[-1]["kv_bytes"],
            "needed_bytes": seen[-1]["needed_bytes"],
        }
    return {"format": "extkv-bench-decode/1", "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "host CPU",
            "torch": torch.__version__, "setting": {**setting.__dict__, "dtype": str(setting.dtype)},
            "pairs": summary}
