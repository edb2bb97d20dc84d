"""A SIGKILLed exporter: a child killed at a random point of its work.

Theory of operation
-------------------
The crash child (`crash_child_main`) exports a patterned cache to a peer,
then commits, defragments and exports to itself in a loop, announcing each
step. `crash_once`, the peer, imports its segments, lets it run, stops it
at a random point of a random operation (SIGSTOP, so the last line it wrote
says where) and SIGKILLs it. The peer must keep reading the same bytes, and
the memory the child held must come back (extkv.testing.stress.reclaim: no
process reaches its memfds any more; NVML no longer lists the child, and
the peer, this process, holds no more than before once it closed its
import). Only the memory of the processes the crash made is read, so other
jobs on the GPU cannot move the verdict.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import time

import torch

from ...cache import ExtensibleKVCache
from ...connector import SegmentExportConnector, listen_privately
from ...layout import KVCacheLayout
from ...peer import import_segments, sha256_hex
from ..configs import config_for, fill_segments
from ..modelled_cache import capacity_for
from ..models import ContentMismatch, LeakFound
from .base import CHILD_TIMEOUT_S, stress_driver, warmed_probe
from .child import ChildProcess
from .reclaim import GPU_RETURN_TOLERANCE, host_memfds_of, nvml_process_used, processes_reaching, wait_for_process_gpu_memory
from .tally import StressTally


#: What the crash child does in a loop; a kill lands during one of them.
CRASH_OPERATIONS = ("commit", "defragment", "export")


def crash_child_main(device: torch.device, seed: int) -> None:
    """The crash child: export a defragmented, patterned cache to the first
    peer that connects, say so with the segments' digests, then commit,
    defragment and export to itself in a loop, announcing each step
    ("begin <operation>", "end <operation>"), until it is killed."""
    rng = random.Random(seed)
    driver = stress_driver(device)
    layout = KVCacheLayout.LBHNC
    capacity = 8 * capacity_for("full", layout, driver.granularity)
    kv_cache = ExtensibleKVCache(config_for("full", layout, capacity), driver, layout)
    kv_cache.commit(capacity // 2, defragment=True)
    fill_segments(kv_cache, seed)
    connector = SegmentExportConnector()
    connector.register_kv_caches(kv_cache)
    with listen_privately() as listener:
        print(f"listening {listener.path}", flush=True)
        listener.socket.settimeout(CHILD_TIMEOUT_S)
        with listener.accept() as connection:
            connector.export_to(connection)
    connector.close()
    digests = [sha256_hex(kv_cache.buffer.segment_view(i)) for i in range(len(kv_cache.segment_strides))]
    print("exported " + json.dumps(digests), flush=True)
    while True:
        operation = rng.choice(CRASH_OPERATIONS)
        print(f"begin {operation}", flush=True)
        if operation == "commit":
            kv_cache.commit(rng.randint(1, capacity), shrink=rng.random() < 0.5)
        elif operation == "defragment":
            kv_cache.commit(rng.randint(1, capacity), defragment=True, preserve_contents=rng.random() < 0.5)
        else:
            kv_cache.commit(kv_cache.num_committed_blocks, defragment=True, preserve_contents=True)
            exporter = SegmentExportConnector()
            exporter.register_kv_caches(kv_cache)
            sender, receiver = socket.socketpair()
            with sender, receiver:
                exporter.export_to(sender)
                with import_segments(receiver, timeout=CHILD_TIMEOUT_S) as imported:
                    imported.digests()
            exporter.close()
        print(f"end {operation}", flush=True)


def crash_once(device: torch.device | str, seed: int, tally: StressTally) -> str:
    """One crash: start the child, import its segments as a peer, let it run,
    stop it at a random point of a random operation and SIGKILL it; the
    peer's bytes must be unchanged, and the memory the child held must come
    back. Returns where the kill landed."""
    device = torch.device(device)
    rng = random.Random(seed)
    tally.seeds.append(seed)
    # This process's context made first (the probe does), so that its own
    # NVML reading before the crash already counts it; None: NVML lists no
    # process of this machine's (a PID namespace hides them).
    per_process = device.type == "cuda" and warmed_probe(device).per_process
    peer_before = nvml_process_used(device, os.getpid()) if per_process else None
    with ChildProcess(["crash-child", "--device", str(device), "--seed", str(seed)]) as child:
        listening = child.line()
        if not listening.startswith("listening "):
            raise AssertionError(f"crash child said {listening!r}, expected 'listening PATH'")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(CHILD_TIMEOUT_S)
            sock.connect(listening.split(" ", 1)[1])
            imported = import_segments(sock, timeout=CHILD_TIMEOUT_S)
        try:
            exported = json.loads(child.line().removeprefix("exported "))
            if imported.digests() != exported:
                raise ContentMismatch("the peer's import differs from what the crash child exported")
            target, skip = rng.choice(CRASH_OPERATIONS), rng.randint(0, 24)
            while skip >= 0:
                if child.line() == f"begin {target}":
                    skip -= 1
            time.sleep(rng.uniform(0, 0.0005))  # into the operation, or past it
            os.kill(child.pid, signal.SIGSTOP)
            last = child.drain()[-1:] or [f"begin {target}"]
            where = f"inside {last[0].split()[1]}" if last[0].startswith("begin") else f"just after {last[0].split()[1]}"
            held = host_memfds_of(child.pid) if device.type == "cpu" else {}
            child_used = nvml_process_used(device, child.pid) if device.type == "cuda" else None
            os.kill(child.pid, signal.SIGKILL)
            child.wait(CHILD_TIMEOUT_S)
            tally.events[f"crash child SIGKILLed {where}"] += 1
            if imported.digests() != exported:
                raise ContentMismatch("the peer's bytes changed when the exporter was killed")
            tally.checks["peer unharmed by the exporter's death (digests)"] += 1
        finally:
            imported.close()
    if device.type == "cpu":
        reaching = processes_reaching(set(held))
        if reaching:
            raise LeakFound(f"after the crash child's death, processes {reaching} still reach its memfds")
        tally.events["bytes the killed children held, returned to the kernel"] += sum(held.values())
        tally.checks["killed child's memfds reached by no process"] += 1
    elif peer_before is None:
        tally.events["GPU memory after a crash not checked: NVML lists no process of this machine's (PID namespace)"] += 1
    else:
        if child_used is not None:
            tally.events["bytes the killed children held (NVML), returned"] += child_used
        # A child still listed after the net, or a peer holding more than
        # before once its import is closed, leaked.
        wait_for_process_gpu_memory(device, child.pid, None, "the killed crash child", CHILD_TIMEOUT_S)
        wait_for_process_gpu_memory(device, os.getpid(), peer_before + GPU_RETURN_TOLERANCE, "the peer, its import closed", CHILD_TIMEOUT_S)
        tally.checks["GPU memory back after the crash (NVML, the child and the peer)"] += 1
    return where
