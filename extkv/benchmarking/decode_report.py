"""The decode bench's result as Markdown.

Theory of operation
-------------------
extkv.benchmarking.decode times greedy decode over extkv, StaticCache and
DynamicCache and leaves one JSON object per run; `decode_section` writes
it as a table, one row per (cache, mode), each step median beside
StaticCache's in the same mode. It reads only the JSON, so a report
renders it without importing torch or transformers.
"""

from __future__ import annotations


def decode_section(result: dict) -> list[str]:
    """Markdown lines for a result of `decode.run`."""
    s, pairs_ = result["setting"], result["pairs"]
    m = s["model"]
    lines = [
        "### Decode under transformers",
        "",
        f"Greedy decode of a random-initialised Llama ({m['num_hidden_layers']} layers, width {m['hidden_size']}, "
        f"{m['num_attention_heads']} query heads over {m['num_key_value_heads']} KV heads of {m['head_dim']}, "
        f"{s['dtype'].removeprefix('torch.')}) on {result['device']} {result['device_name']}, torch {result['torch']}: "
        f"{s['batch_size']} sequences, {s['prompt']} prompt tokens then {s['steps']} steps, in a cache of "
        f"{s['max_cache_len']} tokens; {s['rounds']} rounds, the pairs in Williams-design order. Step: wall time to the device's "
        "synchronize; least median and least p99 over rounds; ratio against StaticCache in the same mode.",
        "",
        "| cache | mode | median step | p99 step | vs StaticCache (median) | growth steps | growth step median "
        "| other steps median | K/V bytes at the end | bytes the tokens need |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, p in pairs_.items():
        kind, mode = name.split("-")
        static = pairs_.get(f"static-{mode}")
        ratio = f"{p['median_s'] / static['median_s']:.3f}x" if static else "-"
        grow = "-" if p["growth_median_s"] is None else f"{p['growth_median_s'] * 1e3:.3f} ms"
        other = "-" if p["other_median_s"] is None else f"{p['other_median_s'] * 1e3:.3f} ms"
        lines.append(f"| {kind} | {mode} | {p['median_s'] * 1e3:.3f} ms | {p['p99_s'] * 1e3:.3f} ms | {ratio} | "
                     f"{p['growth_steps']} | {grow} | {other} | {p['kv_bytes'] / 2**20:.1f} MiB | "
                     f"{p['needed_bytes'] / 2**20:.1f} MiB |")
    lines.append("")
    return lines
