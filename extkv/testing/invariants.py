"""The eight invariants extkv certifies, which kind of device can prove which, and the shared KV budget's proofs.

Theory of operation
-------------------
This table is the one place that says what `extkv check` certifies. A test
names the invariants it proves with `@pytest.mark.invariant(n, ...)`; the
harness counts, per device, the tests of each invariant that ran and passed;
a device is certified when every invariant its kind can prove has at least
one passing test on it and no test on it failed (extkv.testing.verdict).
What a kind cannot prove is said here with the reason, and the report shows
it: the host driver has no CUDA graphs to replay.

`docs/guarantees.md` states each invariant in full, with the test modules
that prove it; meta/test_invariants_doc.py holds that page to this table.
Device kinds are a driver's `kind` (extkv.vmm: `host`, `cuda`).

The shared KV budget (extkv.budget, docs/budget.md) has a certificate line
of its own, beside the devices': each of its promises, `BUDGET_PROOFS`, is
proven by the tests that carry `@pytest.mark.budget_proof(name)` (besides
the invariants they prove) and by a planted defect of it that the suite
catches (extkv.check.verdict).

Nothing here imports pytest, so a report renders without the test extra.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Invariant:
    number: int
    words: str          # the invariant in a few words, as tables and verdicts print it
    statement: str      # the invariant in one sentence


INVARIANTS: dict[int, Invariant] = {
    invariant.number: invariant
    for invariant in (
        Invariant(1, "fixed addresses, contents survive growth",
                  "The base and every view's data_ptr never move across commits, shrinks, defragments, "
                  "sleeps and recommits, and committed bytes survive growth."),
        Invariant(2, "CUDA graph replay after growth",
                  "A CUDA graph captured before growth reads and writes newly committed blocks when replayed "
                  "after growth and after sleep and recommit, bit for bit as eager execution does."),
        Invariant(3, "shrink/defragment: one chunk per segment, exact footprint",
                  "After a defragmenting commit every segment is backed by one chunk, as the driver reads it "
                  "back; after a shrink the physical footprint is exactly physical_bytes_for(n), and after a "
                  "shrink keeping contents exactly the chunks holding a byte of the blocks kept."),
        Invariant(4, "sleep/recommit returns memory, reads zero",
                  "release_physical returns the memory, as measured outside extkv, and recommit maps fresh "
                  "pages that read zero over poisoned memory, at the same addresses."),
        Invariant(5, "accounting: usage measured outside equals physical_bytes",
                  "Physical usage measured outside extkv (NVML per process, the kernel's memfd pages) equals "
                  "physical_bytes after every operation and returns to its baseline after free()."),
        Invariant(6, "bad input raises and changes nothing",
                  "Every invalid config or call raises an exception that names the value and what was "
                  "expected, and changes nothing."),
        Invariant(7, "concurrency",
                  "Every public operation may be called from several threads; state changes are serialized "
                  "per reservation and the invariants above hold after any interleaving."),
        Invariant(8, "exports cannot harm the exporter",
                  "A peer receives only what it is given and cannot harm the exporter: host chunks are sealed "
                  "before they are shared, exports are read-only unless asked otherwise, and the peer's "
                  "credentials are checked."),
    )
}


@dataclass(frozen=True)
class DeviceKind:
    kind: str                     # a driver's `kind`
    name: str                     # how reports name it
    cannot: dict[int, str]        # invariant -> why this kind cannot prove it

    @property
    def provable(self) -> tuple[int, ...]:
        return tuple(number for number in INVARIANTS if number not in self.cannot)


DEVICE_KINDS: dict[str, DeviceKind] = {
    "host": DeviceKind("host", "host driver", {2: "needs a GPU: the host driver has no CUDA graphs"}),
    "cuda": DeviceKind("cuda", "CUDA driver", {}),
}


#: The shared KV budget's proofs, in the order its certificate line names
#: them: each a promise, in a few words.
#: Features a GPU may lack, by the marker of a test that needs one (named
#: as the feature in extkv.vmm.cuda.DEVICE_FEATURES and in each GPU's
#: machine facts): what a skip and the certificate's line of each GPU call it.
GPU_FEATURES: dict[str, str] = {
    "gpudirect_rdma": "GPUDirect RDMA with VMM",
    "dma_buf": "dma-buf export",
}

BUDGET_PROOFS: dict[str, str] = {
    "ledger": "the engines' grants and dead leases' bytes stay within the budget, on the ledger and read from outside",
    "grants": "no physical create without a covering grant; the ledger holds what each engine's chunks hold",
    "SIGKILL": "an engine that dies counts until its memory is seen gone, and within 2 s of a SIGKILL no longer",
    "restart": "while the daemon is down growth fails closed; restarted, its ledger is what the engines hold as they "
               "rejoin, past the budget too",
    "reclaim": "engines give memory back when asked, never below their floor, and keep their live blocks",
    "hostile peers": "another uid, malformed input, unknown tickets, stale sockets and planted files are refused "
                     "and change nothing else; a release an engine claims and did not make stays counted",
}


def number_ranges(numbers) -> str:
    """`1, 3-8` for [1, 3, 4, 5, 6, 7, 8]; `none` for none."""
    spans: list[list[int]] = []
    for number in sorted(set(numbers)):
        if spans and number == spans[-1][1] + 1:
            spans[-1][1] = number
        else:
            spans.append([number, number])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans) or "none"
