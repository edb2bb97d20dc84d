"""The growth-loop bench's result as Markdown.

Theory of operation
-------------------
extkv.benchmarking.growth_loop times a decode loop whose cache grows from
an eighth to full, per mode (no growth, inline, ahead, per granule, the
two halves of commit-ahead's worker beside the steps, and ahead with a
short switch interval), and
leaves one JSON object per run; `growth_section` writes it as a table,
each mode's p99 beside the no-growth loop's and what growth added beside
the memset of the grown bytes. It reads only the JSON, so a report renders
it without importing torch.
"""

from __future__ import annotations


def growth_section(result: dict) -> list[str]:
    """Markdown lines for a result of `growth_loop.run`."""
    s, modes = result["setting"], result["modes"]
    floor = modes["no growth"]
    lines = [
        "### A decode loop growing from an eighth to full",
        "",
        f"{s['steps']} steps on {result['device']} (torch {result['torch']}), the cache ({s['geometry']}, "
        f"{s['capacity_bytes'] / 2**30:g} GiB) grown by {result['grown_bytes'] / 2**30:.3g} GiB in "
        f"{s['growth_commits']} commits; {s['rounds']} rounds on recycled memory, modes in Williams-design order, "
        "least p50 and p99 over them; one round of each mode in a new process, on fresh memory. "
        f"Zeroing the grown bytes on a plain allocation takes {result['memset_s'] * 1e3:.2f} ms.",
        "",
        "| mode | p50 step | p99 step | p99 vs no growth | growth added in total | vs the memset of the grown bytes "
        "| fresh memory: p50 / p99 |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, m in modes.items():
        added = f"{m['added_s'] * 1e3:.2f} ms"
        versus = "-" if mode == "no growth" else f"{m['added_s'] / result['memset_s']:.2f}x"
        fresh = (f"{m['fresh_p50_s'] * 1e3:.3f} ms / {m['fresh_p99_s'] * 1e3:.3f} ms" if "fresh_p50_s" in m
                 else "not run")
        lines.append(f"| {mode} | {m['p50_s'] * 1e3:.3f} ms | {m['p99_s'] * 1e3:.3f} ms | "
                     f"{m['p99_s'] / floor['p99_s']:.3f}x | {added} | {versus} | {fresh} |")
    lines += [
        "",
        "*growth added in total*: the steps' time past the no-growth loop's p50, summed over a round (the least "
        "round). The no-growth row is what step-to-step variation alone adds, the floor under every other row.",
    ]
    if any(mode.startswith("beside") for mode in modes):
        lines += [
            "",
            "*beside driver calls* and *beside zeroing*: no cache grows under the steps; at each growth commit a "
            "thread does one half of commit-ahead's worker on the raw sequence of the same segments, the driver's "
            "calls alone (create, map, set access; nothing zeroed) or the zeroing alone (on a stream of its own, "
            "over memory mapped before the loop). Set beside the *ahead* row, they say where the worker's cost to "
            "the steps lies.",
        ]
    if any(mode.endswith("switch interval") for mode in modes):
        lines += [
            "",
            "*ahead, 50 us switch interval*: *ahead* with the interpreter's switch interval at 50 us instead of 5 ms "
            "for the round. What it takes off *ahead*'s p99 is the steps' wait for the GIL behind the worker, whose "
            "steps alternate short driver calls with Python.",
        ]
    lines.append("")
    return lines
