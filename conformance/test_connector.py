"""KV connector conformance: every committed segment of an ExtensibleKVCache,
exported to another process (`python -m extkv peer --peer`, or the same
code in a process forked from one that imported it once), reads there byte
for byte as it does here, on the host driver and each CUDA device.

The peer answers with the sha256 of each segment's committed bytes; the test
compares them with digests computed here. Patterns differ per segment, so a
swapped segment, a wrong offset within a chunk or a view one byte too long or
short changes a digest. In-process imports (a socket pair) cover the peer's
failure paths with the fault-injecting driver.

Invariant 8 (exports cannot harm the exporter) is tested against real peers:
a forked process that attacks the descriptors it received (truncate, punch,
write, map writable, reopen through /proc), peers whose credentials the
connector refuses, peers that connect and never read or die mid-export, and
hand-made exports a careful peer must refuse (nested JSON, files that are
not sealed memfds, sparse memfds, more bytes than the peer accepts, silence,
a header paced a byte at a time to outlast the peer's timeout).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import json
import math
import mmap
import os
import re
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

import extkv
from extkv.cache import ExtensibleKVCache
from extkv.connector import (
    DEFAULT_EXPORT_TIMEOUT_S,
    KVConnector,
    PeerDisconnectedError,
    PeerRefusedError,
    SegmentExportConnector,
    SegmentNotContiguousError,
    CommitAheadRegisteredError,
    StaleRegistrationError,
    listen_privately,
    peer_credentials,
)
from extkv.errors import DeadlineExceededError, DriverError, ExtkvError, StateError
from extkv.layout import (
    KVCacheLayout,
    granule_block_alignment,
)
from extkv.peer import import_segments, run_peer
from extkv.testing.checks import check_mapped_read_only, check_usage_matches, maps_permissions
from extkv.testing.configs import CAPACITY, GRANULE, config_for, fill_segments
from extkv.testing.descriptors import left_open, open_descriptors
from extkv.testing.readings import InjectedReadingsDriver
from extkv.vmm import FaultInjectingDriver, driver_for, live_chunks, live_reservations
from extkv.vmm.base import READ_WRITE
from extkv.wire import MAX_HEADER_BYTES, PROTOCOL, receive_message, send_message

#: Generous: the peer imports torch (and creates a CUDA context) before it connects.
PEER_TIMEOUT_S = 120
REPO_ROOT = Path(extkv.__file__).resolve().parent.parent
#: Where a test needs what only host chunks promise (read-only descriptors,
#: seals), whatever the `device` parameter: `build.cache_for(..., device=HOST)`.
HOST = torch.device("cpu")


# (id, config kind, layout, blocks to commit, expected segments, expected
# distinct chunks, whether some segment starts inside its chunk)
CASES = [
    ("block-outermost", "full", KVCacheLayout.BLHNC, 300, 1, 1, False),
    ("LBHNC-padded", "padded", KVCacheLayout.LBHNC, 300, 3, 3, False),
    ("LBHNC-unpadded", "full", KVCacheLayout.LBHNC, 37, 3, 3, True),
    # Near capacity the segments' prefixes touch: one chunk backs all three.
    ("LBHNC-unpadded-shared-chunk", "full", KVCacheLayout.LBHNC, 650, 3, 1, True),
]


@pytest.fixture
def connector():
    connector = SegmentExportConnector()
    yield connector
    connector.close()


@pytest.fixture
def channel():
    """(sender, receiver): a connected pair of Unix sockets, closed after
    the test."""
    sender, receiver = socket.socketpair()
    with sender, receiver:
        yield sender, receiver


def digest(view: torch.Tensor) -> str:
    # Computed apart from the connector's own digest (a copy of the bytes,
    # not a buffer over them), so a bug there does not cancel out here.
    host = view.cpu().contiguous()
    return hashlib.sha256(ctypes.string_at(host.data_ptr(), host.numel())).hexdigest()


def digests_here(kv_cache: ExtensibleKVCache) -> list[str]:
    return [digest(kv_cache.buffer.segment_view(i)) for i in range(len(kv_cache.segment_strides))]


def peer_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


#: A process that imports the peer's code once (extkv.cli, and with it
#: torch), then forks one child per request line and runs in it what `python
#: -m extkv peer ...` runs: `extkv.cli.main(argv)`, an uncaught exception
#: printed to stderr and exit status 1, as the interpreter does. Each peer is
#: still a process of its own, with its own pid, address space and (on CUDA)
#: context: nothing here touches CUDA before the fork. A fresh interpreter
#: spends about 2 s of CPU importing torch before it connects (1.9-2.2 s,
#: `time python -m extkv peer --help` on the 2-core CI host); a fork takes
#: milliseconds. Replies, one JSON line each: {"pid": N} after the fork,
#: {"returncode": N} once the child is reaped (negative: killed by a signal,
#: as Popen says).
ZYGOTE = r"""
import json, os, sys, traceback
import torch
import extkv.cli

# A CUDA context does not survive a fork: the children create their own.
assert not torch.cuda.is_initialized(), "importing extkv.cli initialized CUDA"
while True:
    line = sys.stdin.readline()
    if not line:
        break
    request = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.dup2(os.open(os.devnull, os.O_RDWR), 0)
            os.dup2(0, 1)
            os.dup2(os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 2)
            code = extkv.cli.main(request["argv"])
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
            if not isinstance(exit.code, (int, type(None))):
                print(exit.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    sys.stdout.write(json.dumps({"pid": pid}) + "\n")
    sys.stdout.flush()
    _, status = os.waitpid(pid, 0)
    sys.stdout.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
    sys.stdout.flush()
"""


class PeerZygote:
    """The `ZYGOTE` process, started once per module: `start(argv)` forks a
    peer from it (one at a time)."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.started = 0
        self.pending = b""
        self.process = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE], env=peer_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )

    def reply(self, key: str) -> int:
        """The zygote's next reply line, which must carry `key`; every wait is bounded."""
        fd = self.process.stdout.fileno()
        while b"\n" not in self.pending:
            ready, _, _ = select.select([fd], [], [], PEER_TIMEOUT_S)
            if not ready:
                raise AssertionError(f"the peer zygote sent nothing within {PEER_TIMEOUT_S} s")
            data = os.read(fd, 4096)
            if not data:
                raise AssertionError(f"the peer zygote exited with status {self.process.wait(PEER_TIMEOUT_S)}")
            self.pending += data
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)[key]

    def start(self, argv: list[str]) -> "ForkedPeer":
        self.started += 1
        stderr = self.directory / f"peer-{self.started}.stderr"
        self.process.stdin.write((json.dumps({"argv": argv, "stderr": str(stderr)}) + "\n").encode())
        self.process.stdin.flush()
        return ForkedPeer(self, self.reply("pid"), stderr)

    def close(self) -> None:
        # Its peers are all reaped (one at a time, each waited for) and it
        # holds nothing else: killed, it skips a second of torch's teardown.
        self.process.stdin.close()
        self.process.kill()
        self.process.wait(PEER_TIMEOUT_S)
        self.process.stdout.close()


class ForkedPeer:
    """A peer forked by a `PeerZygote`."""

    def __init__(self, zygote: PeerZygote, pid: int, stderr: Path):
        self.zygote, self.pid, self.stderr = zygote, pid, stderr
        self.returncode: int | None = None

    def wait(self) -> tuple[int, str]:
        """Exit status and stderr, once the peer exits."""
        if self.returncode is None:
            self.returncode = self.zygote.reply("returncode")
        stderr = self.stderr.read_text()
        self.stderr.unlink()
        return self.returncode, stderr

    def kill(self) -> None:
        if self.returncode is None:
            # Not reaped yet: the zygote reaps it only after this, and says so.
            os.kill(self.pid, signal.SIGKILL)


class CommandLinePeer:
    """`python -m extkv peer ...` in a fresh interpreter: the command itself."""

    def __init__(self, argv: list[str]):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "extkv", *argv],
            env=peer_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.returncode: int | None = None

    def wait(self) -> tuple[int, str]:
        _, stderr = self.process.communicate(timeout=PEER_TIMEOUT_S)
        self.returncode = self.process.returncode
        return self.returncode, stderr

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()


@pytest.fixture(scope="module")
def peers(tmp_path_factory):
    """A `PeerZygote` for this module's peers. Started before any test that
    counts descriptors uses it: its pipes are open throughout."""
    zygote = PeerZygote(tmp_path_factory.mktemp("peers"))
    yield zygote
    zygote.close()


def run_peer_with(send, peers: PeerZygote | None, *, timeout: float = PEER_TIMEOUT_S) -> tuple[dict, int, str]:
    """Start a peer process (forked from `peers`, or with None the
    `python -m extkv peer` command in a fresh interpreter) with `--timeout
    timeout`, let `send(sock)` talk to it, and return its reply, exit status
    and stderr. Every wait is bounded: a hang fails."""
    with listen_privately() as listener:
        listener.socket.settimeout(PEER_TIMEOUT_S)
        argv = ["peer", "--peer", listener.path, "--timeout", str(timeout)]
        peer = CommandLinePeer(argv) if peers is None else peers.start(argv)
        try:
            try:
                connection = listener.accept()
            except socket.timeout:
                peer.kill()
                _, stderr = peer.wait()
                raise AssertionError(f"peer never connected within {PEER_TIMEOUT_S} s:\n{stderr}") from None
            with connection:
                connection.settimeout(PEER_TIMEOUT_S)
                send(connection)
                reply = receive_message(connection)
            returncode, stderr = peer.wait()
        finally:
            if peer.returncode is None:
                peer.kill()
                peer.wait()
    return reply, returncode, stderr


def peer_digests(connector: SegmentExportConnector, peers: PeerZygote | None) -> list[str]:
    reply, returncode, stderr = run_peer_with(connector.export_to, peers)
    assert returncode == 0 and "digests" in reply, f"peer failed (exit {returncode}): {reply}\n{stderr}"
    return reply["digests"]


def live_counts() -> tuple[dict, dict]:
    nonzero = lambda counts: {kind: count for kind, count in counts.items() if count}  # noqa: E731
    return nonzero(live_chunks), nonzero(live_reservations)


@pytest.mark.invariant(8)
def test_segment_export_connector_is_a_kv_connector():
    connector = SegmentExportConnector()
    assert isinstance(connector, KVConnector)
    assert connector.registers_kv_cache_memory is True
    connector.close()


@pytest.mark.invariant(5, 8)
@pytest.mark.parametrize("name, kind, layout, blocks, segments, chunks, inside", CASES, ids=[c[0] for c in CASES])
@pytest.mark.long
def test_peer_reads_every_segment(device, build, connector, peers, usage, name, kind, layout, blocks, segments, chunks, inside):
    baseline = usage.read_outside_torch()
    kv_cache = build.cache_for(kind, layout)
    kv_cache.commit(blocks, defragment=True)
    fill_segments(kv_cache, seed=len(name))
    connector.register_kv_caches(kv_cache)

    registrations = connector.registrations
    assert len(registrations) == segments
    assert len({id(r.mapped_chunk) for r in registrations}) == chunks
    assert any(r.offset_in_chunk for r in registrations) == inside
    for registration, stride in zip(registrations, kv_cache.segment_strides):
        mapped = registration.mapped_chunk
        assert registration.committed_bytes == blocks * stride
        assert mapped.address + registration.offset_in_chunk == registration.address
        assert registration.offset_in_chunk + registration.committed_bytes <= mapped.chunk.size

    expected = digests_here(kv_cache)
    assert len(set(expected)) == len(expected)  # distinct: a swapped segment shows
    assert peer_digests(connector, peers) == expected
    check_usage_matches(usage, baseline, [kv_cache.buffer])


@pytest.mark.invariant(8)
@pytest.mark.long
def test_peer_reads_live_memory_and_one_wrong_byte_shows(device, build, connector):
    kv_cache = build.cache_for("full", KVCacheLayout.LBHNC)
    kv_cache.commit(37, defragment=True)  # segments start inside their chunks
    fill_segments(kv_cache, seed=1)
    connector.register_kv_caches(kv_cache)
    before = digests_here(kv_cache)
    # The last committed byte of the last segment and the first of the
    # second: the edges a wrong offset or length would miss.
    kv_cache.buffer.segment_view(2)[-1:].add_(1)
    kv_cache.buffer.segment_view(1)[:1].add_(1)
    after = digests_here(kv_cache)
    assert [b == a for b, a in zip(before, after)] == [True, False, False]
    # The command itself, in a fresh interpreter; the other peers are forked.
    assert peer_digests(connector, None) == after


def fragment(kv_cache: ExtensibleKVCache) -> int:
    """Commit so that every segment spans two chunks; return the block count."""
    alignment = granule_block_alignment(kv_cache.segment_strides, kv_cache.buffer.granularity)
    n = min(alignment + 1, CAPACITY)
    kv_cache.commit(1)
    kv_cache.commit(n)
    return n


@pytest.mark.invariant(6)
def test_fragmented_cache_is_refused_and_nothing_changes(device, build, connector):
    kv_cache = build.cache_for("padded", KVCacheLayout.LBHNC)
    n = fragment(kv_cache)
    chunks = kv_cache.buffer.mapped_chunks
    with pytest.raises(SegmentNotContiguousError, match=r"segment\(s\) 0 \(.*, 1 \(.*, 2 \(.*defragment=True") as raised:
        connector.register_kv_caches(kv_cache)
    assert isinstance(raised.value, ValueError) and isinstance(raised.value, ExtkvError)
    assert not connector.is_registered and connector.registrations == []
    assert kv_cache.buffer.mapped_chunks == chunks and kv_cache.num_committed_blocks == n
    with pytest.raises(StateError, match="export_to.*unregistered"):
        connector.export_to(None)
    # Committed as a registering connector needs, the same cache registers.
    kv_cache.commit(n, defragment=True)
    connector.register_kv_caches(kv_cache)
    assert connector.is_registered and len(connector.registrations) == 3


@pytest.mark.invariant(1, 4, 5, 8)
@pytest.mark.long
def test_restore_after_release_and_recommit_reads_new_bytes(device, build, connector, peers, usage):
    baseline = usage.read_outside_torch()
    kv_cache = build.cache_for("padded", KVCacheLayout.LBHNC)
    n = 300
    kv_cache.commit(n, defragment=True)
    fill_segments(kv_cache, seed=4)
    connector.register_kv_caches(kv_cache)
    old = connector.registrations
    segments = range(len(kv_cache.segment_strides))
    pointers = [kv_cache.buffer.segment_view(i).data_ptr() for i in segments]

    # What a runner does around sleep or a weight update.
    connector.unregister_kv_caches()
    kv_cache.release_physical()
    check_usage_matches(usage, baseline, [kv_cache.buffer])
    kv_cache.recommit()
    kv_cache.commit(n, defragment=True)
    assert [kv_cache.buffer.segment_view(i).data_ptr() for i in segments] == pointers, "the recommit moved a segment"
    with pytest.raises(StateError, match="export_to"):
        connector.export_to(None)
    connector.restore_kv_caches()
    # By identity: the new chunks may reuse the old handles' numbers (fds).
    same = [new.index for new, stale in zip(connector.registrations, old) if new.mapped_chunk is stale.mapped_chunk]
    assert not same, f"segments still registered with the chunk from before the remap: {same}"

    # Recommitted pages read as zero there too; rewrite one segment to show
    # the peer sees this process's latest bytes, not the released ones.
    zeros = [hashlib.sha256(bytes(n * stride)).hexdigest() for stride in kv_cache.segment_strides]
    assert digests_here(kv_cache) == zeros
    view = kv_cache.buffer.segment_view(1)
    view.copy_((torch.arange(view.numel(), device=view.device) % 13 + 1).to(torch.uint8))
    expected = digests_here(kv_cache)
    assert expected[0] == zeros[0] and expected[1] != zeros[1]
    assert peer_digests(connector, peers) == expected
    check_usage_matches(usage, baseline, [kv_cache.buffer])


@pytest.mark.invariant(6, 8)
def test_stale_registration_is_refused_until_restored(device, build, connector, channel):
    kv_cache = build.cache_for("padded", KVCacheLayout.LBHNC)
    kv_cache.commit(300, defragment=True)
    connector.register_kv_caches(kv_cache)
    chunks = kv_cache.buffer.mapped_chunks

    def grow_within_the_mapped_chunks():
        kv_cache.commit(320)
        assert kv_cache.buffer.mapped_chunks == chunks  # only the registered sizes are stale

    def release_and_recommit():
        kv_cache.release_physical()
        kv_cache.recommit()

    def shrink_keeping_contents():
        mapped = kv_cache.buffer.mapped_chunks
        kv_cache.commit(250, shrink=True, preserve_contents=True)
        now = kv_cache.buffer.mapped_chunks
        assert len(now) == len(mapped) and all(a is b for a, b in zip(now, mapped))  # the same chunks, smaller sizes

    sender, receiver = channel
    receiver.setblocking(False)
    for change in (grow_within_the_mapped_chunks, release_and_recommit, shrink_keeping_contents):
        change()
        fill_segments(kv_cache, seed=7)
        fds = open_descriptors()
        with pytest.raises(StaleRegistrationError, match=r"changed since register_kv_caches.*restore_kv_caches"):
            connector.export_to(sender)
        assert not left_open(fds)
        with pytest.raises(BlockingIOError):
            receiver.recv(1)  # nothing was sent
        connector.restore_kv_caches()
        connector.export_to(sender)
        receiver.setblocking(True)
        with import_segments(receiver) as imported:
            assert imported.digests() == digests_here(kv_cache)
        receiver.setblocking(False)


@pytest.mark.invariant(6, 8)
def test_a_registering_connector_refuses_commit_ahead_and_exports_once_it_is_off(device, build, connector, channel):
    """Commit-ahead grows segments with chunks no registration covers: a
    cache with it on is not registered (nor restored), one that turns it on
    after registering is not exported, and with it off again (and a
    defragmenting commit) the peer reads every segment."""
    # Free memory as the test sets it: the worker's window must not depend
    # on what the rest of the machine holds.
    readings = InjectedReadingsDriver(driver_for(device), free=64 << 30, total=128 << 30)
    kv_cache = build.cache_for("padded", KVCacheLayout.LBHNC, device=readings)
    kv_cache.commit(300, defragment=True)
    kv_cache.commit_ahead(64)
    assert kv_cache.settle_commit_ahead(60) and kv_cache.grown_blocks == 364
    with pytest.raises(CommitAheadRegisteredError, match=r"register_kv_caches: commit-ahead is on \(window 64 blocks\)"):
        connector.register_kv_caches(kv_cache)
    assert not connector.is_registered and connector.registrations == []

    # Off, the blocks it mapped past the committed ones stay: a defragmenting
    # commit releases them with the rest.
    kv_cache.commit_ahead(0)
    kv_cache.commit(300, defragment=True)
    assert kv_cache.grown_blocks == 300
    connector.register_kv_caches(kv_cache)
    kv_cache.commit_ahead(64)
    assert kv_cache.settle_commit_ahead(60) and kv_cache.grown_blocks > 300
    sender, receiver = channel
    receiver.setblocking(False)
    fds = open_descriptors()
    with pytest.raises(StaleRegistrationError, match=r"commit-ahead is on \(window 64 blocks\)"):
        connector.export_to(sender)
    assert not left_open(fds)
    with pytest.raises(BlockingIOError):
        receiver.recv(1)  # nothing was sent
    with pytest.raises(CommitAheadRegisteredError, match="restore_kv_caches: commit-ahead is on"):
        connector.restore_kv_caches()

    kv_cache.commit_ahead(0)
    kv_cache.commit(300, defragment=True)
    fill_segments(kv_cache, seed=11)
    connector.restore_kv_caches()
    connector.export_to(sender)
    receiver.setblocking(True)
    with import_segments(receiver) as imported:
        assert imported.digests() == digests_here(kv_cache)


@pytest.mark.invariant(8)
def test_a_broken_cache_is_not_exported(device, build, connector, channel):
    """A growth whose access grant and undo unmap both fail breaks the cache:
    its chunks are no longer known to back its segments, so nothing of it
    is sent, and the registration says why."""
    faulty = FaultInjectingDriver(driver_for(device))
    kv_cache = build.cache_for("padded", KVCacheLayout.LBHNC, device=faulty)
    kv_cache.commit(300, defragment=True)
    connector.register_kv_caches(kv_cache)
    faulty.fail_in("set_access", 1)
    faulty.fail_in("unmap", 1)
    with pytest.raises(DriverError, match="injected fault"):
        kv_cache.commit(600)
    assert kv_cache.is_broken
    sender, receiver = channel
    receiver.setblocking(False)
    fds = open_descriptors()
    with pytest.raises(StaleRegistrationError, match="is broken"):
        connector.export_to(sender)
    assert not left_open(fds)
    with pytest.raises(BlockingIOError):
        receiver.recv(1)  # nothing was sent


@pytest.mark.invariant(5, 8)
def test_in_process_import_shares_the_physical_memory(device, build, usage, channel):
    baseline = usage.read_outside_torch()
    kv_cache = build.cache_for("full", KVCacheLayout.LBHNC)
    kv_cache.commit(37, defragment=True)
    fill_segments(kv_cache, seed=8)
    connector = SegmentExportConnector(writable_exports=True)
    connector.register_kv_caches(kv_cache)
    sender, receiver = channel
    connector.export_to(sender)
    with import_segments(receiver) as imported:
        assert imported.writable is True
        assert imported.segment_sizes == kv_cache.buffer.segment_sizes
        assert imported.views[1].data_ptr() != kv_cache.buffer.segment_view(1).data_ptr()
        if device.type == "cpu":
            assert maps_permissions(imported.views[1].data_ptr()) == "rw-s"
        imported.views[1][-4:].fill_(0xEE)  # written there, read here
        assert torch.all(kv_cache.buffer.segment_view(1)[-4:] == 0xEE)
        assert imported.digests() == digests_here(kv_cache)
    connector.close()
    check_usage_matches(usage, baseline, [kv_cache.buffer])


@pytest.mark.invariant(8)
def test_exports_are_read_only_by_default(build, connector, channel):
    """The peer's host mapping is read-only, read back from the kernel; the
    exporter's own mapping stays writable and the peer sees its writes."""
    kv_cache = build.cache_for("padded", KVCacheLayout.LBHNC, device=HOST)
    kv_cache.commit(300, defragment=True)
    fill_segments(kv_cache, seed=9)
    connector.register_kv_caches(kv_cache)
    sender, receiver = channel
    connector.export_to(sender)
    with import_segments(receiver) as imported:
        assert imported.writable is False
        for i, view in enumerate(imported.views):
            assert maps_permissions(view.data_ptr()) == "r--s"
            assert maps_permissions(kv_cache.buffer.segment_view(i).data_ptr()) == "rw-s"
        kv_cache.buffer.segment_view(2)[:3].fill_(0)
        assert torch.all(imported.views[2][:3] == 0)
        assert imported.digests() == digests_here(kv_cache)


@pytest.mark.invariant(8)
def test_an_import_told_read_only_is_mapped_read_only(device, build, connector, channel):
    """Read back from the kernel or the driver (`Driver.accesses_at`), not
    taken from the header: every granule of a read-only import is mapped
    read-only, on each device, while the exporter's own mapping stays
    read-write."""
    kv_cache = build.cache_for("padded", KVCacheLayout.LBHNC)
    kv_cache.commit(300, defragment=True)
    connector.register_kv_caches(kv_cache)
    sender, receiver = channel
    connector.export_to(sender)
    with import_segments(receiver) as imported:
        assert imported.writable is False
        check_mapped_read_only(imported.driver, imported.views)
        own = [kv_cache.buffer.segment_view(i).data_ptr() for i in range(len(imported.views))]
        assert kv_cache.buffer.driver.accesses_at(own) == [READ_WRITE] * len(own)


# What a peer tries on every chunk descriptor it received; each entry is "ok"
# or the errno name the kernel answered.
def _attempt(action) -> str:
    try:
        action()
    except OSError as error:
        return errno.errorcode[error.errno]
    return "ok"


def _attack(fd: int, size: int) -> dict[str, str]:
    libc = ctypes.CDLL(None, use_errno=True)
    FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x1, 0x2

    def punch_hole(target):
        if libc.fallocate(target, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, ctypes.c_long(0), ctypes.c_long(size)):
            raise OSError(ctypes.get_errno(), "fallocate(PUNCH_HOLE)")

    def read_mapping():
        with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) as mapping:
            mapping[size - 1]

    results = {
        "link": "memfd" if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:") else "other",
        "map readable": _attempt(read_mapping),
        "ftruncate to 0": _attempt(lambda: os.ftruncate(fd, 0)),
        "punch hole": _attempt(lambda: punch_hole(fd)),
        "map writable": _attempt(lambda: mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE).close()),
        "write": _attempt(lambda: os.pwrite(fd, b"x", 0)),
    }
    # What /proc allows beyond the descriptor: a read-write reopen of the
    # same memfd. The seals must still hold on that one.
    try:
        reopened = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
    except OSError as error:
        results["reopen read-write"] = errno.errorcode[error.errno]
        return results
    results["reopen read-write"] = "ok"
    results["reopened: ftruncate to 0"] = _attempt(lambda: os.ftruncate(reopened, 0))
    results["reopened: grow"] = _attempt(lambda: os.ftruncate(reopened, 2 * size))
    os.close(reopened)
    return results


def _hostile_peer(sock: socket.socket, uid: int | None) -> None:
    """The forked peer: become `uid` (if given), receive the export, attack
    every descriptor, reply with the results. Never returns."""
    status = 1
    try:
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            # A credential change makes the process non-dumpable, which
            # would close /proc/self/fd to it for a reason other than the
            # memfd's mode; the reopen must meet the mode.
            PR_SET_DUMPABLE = 4
            ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
        header = receive_message(sock)
        _, fds, _, _ = socket.recv_fds(sock, 1, len(header["chunks"]))
        results = [_attack(fd, chunk["size"]) for fd, chunk in zip(fds, header["chunks"])]
        send_message(sock, {"uid": os.getuid(), "results": results})
        status = 0
    finally:
        os._exit(status)


def attack_from_peer(connector: SegmentExportConnector, uid: int | None) -> dict:
    """Export to a forked peer process that attacks what it receives; its report."""
    mine, theirs = socket.socketpair()
    with mine:
        pid = os.fork()
        if pid == 0:
            mine.close()
            _hostile_peer(theirs, uid)
        theirs.close()
        try:
            mine.settimeout(PEER_TIMEOUT_S)
            connector.export_to(mine)
            return receive_message(mine)
        finally:
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0


ANOTHER_UID = 65534  # nobody


@pytest.mark.invariant(8)
@pytest.mark.parametrize("uid", [None, ANOTHER_UID], ids=["same-uid", "another-uid"])
def test_peer_cannot_truncate_punch_or_write_a_read_only_export(build, connector, uid):
    """Invariant 8 on the host: through what it receives, a peer process can
    read the chunks but not truncate, punch, write or map them writable; the
    seals hold even where /proc lets it reopen the memfd read-write (same
    uid), and a peer under another uid cannot reopen it at all. The exporter
    reads every byte afterwards, unchanged."""
    if uid is not None and os.getuid() != 0:
        pytest.skip("starting a peer under another uid needs root")
    kv_cache = build.cache_for("padded", KVCacheLayout.LBHNC, device=HOST)
    kv_cache.commit(300, defragment=True)
    fill_segments(kv_cache, seed=10)
    if uid is not None:
        connector = SegmentExportConnector(allowed_uids={os.getuid()})  # the socket pair is this process's
    connector.register_kv_caches(kv_cache)
    before = digests_here(kv_cache)

    report = attack_from_peer(connector, uid)

    assert report["uid"] == (os.getuid() if uid is None else uid)
    refused = {
        "link": "memfd",
        "map readable": "ok",
        "ftruncate to 0": "EINVAL",  # not open for writing
        "punch hole": "EBADF",
        "map writable": "EACCES",
        "write": "EBADF",
    }
    if uid is None:
        # Documented limit: the same uid may reopen; the seals still hold.
        refused |= {"reopen read-write": "ok", "reopened: ftruncate to 0": "EPERM", "reopened: grow": "EPERM"}
    else:
        refused |= {"reopen read-write": "EACCES"}  # the memfd is 0600
    assert report["results"] == [refused] * 3
    assert digests_here(kv_cache) == before
    connector.close()


@pytest.mark.invariant(5, 6)
@pytest.mark.parametrize("step, nth", [("reserve", 1), ("import", 2), ("map", 3), ("set_access", 1)])
def test_failed_import_undoes_every_step(device, build, connector, step, nth, channel):
    kv_cache = build.cache_for("padded", KVCacheLayout.LBHNC)  # three chunks
    kv_cache.commit(300, defragment=True)
    fill_segments(kv_cache, seed=3)
    connector.register_kv_caches(kv_cache)
    faulty = FaultInjectingDriver(driver_for(device), {step: nth})
    sender, receiver = channel
    counts, fds = live_counts(), open_descriptors()
    connector.export_to(sender)
    with pytest.raises(DriverError, match="injected fault"):
        import_segments(receiver, driver=faulty)
    assert faulty.fired == [(step, nth)]
    assert live_counts() == counts and not left_open(fds)  # received descriptors closed too
    # The fault fired once: a fresh export imports completely.
    connector.export_to(sender)
    with import_segments(receiver, driver=faulty) as imported:
        assert imported.digests() == digests_here(kv_cache)
    assert live_counts() == counts and not left_open(fds)


@pytest.mark.invariant(5, 6)
def test_failed_import_attempts_every_undo_and_raises_the_first_failure(build, connector, channel):
    """An undo step that fails stops none of the others, and the step that
    failed first is what the caller sees; the undo's failure is a note on it.
    On the host, freeing the reservation unmaps what the failed undo left."""
    kv_cache = build.cache_for("padded", KVCacheLayout.LBHNC, device=HOST)  # three chunks
    kv_cache.commit(300, defragment=True)
    connector.register_kv_caches(kv_cache)
    faulty = FaultInjectingDriver(driver_for("cpu"), {"set_access": 1, "unmap": 2})
    sender, receiver = channel
    counts, fds = live_counts(), open_descriptors()
    connector.export_to(sender)
    with pytest.raises(DriverError, match=r"^set_access \(injected fault at call 1\)") as raised:
        import_segments(receiver, driver=faulty)
    assert live_counts() == counts and not left_open(fds)
    assert faulty.fired == [("set_access", 1), ("unmap", 2)]
    assert faulty.calls["release"] == 3 and faulty.calls["unmap"] == 3
    if sys.version_info >= (3, 11):
        (note,) = raised.value.__notes__
        assert note.startswith("while undoing: unmap (injected fault at call 2) failed: INJECTED_FAULT (-1)")


@pytest.mark.invariant(5, 8)
def test_failed_export_sends_nothing_and_closes_what_it_exported(device, build, connector, channel):
    faulty = FaultInjectingDriver(driver_for(device))
    kv_cache = build.cache_for("padded", KVCacheLayout.LBHNC, device=faulty)
    kv_cache.commit(300, defragment=True)
    fill_segments(kv_cache, seed=6)
    connector.register_kv_caches(kv_cache)
    sender, receiver = channel
    fds = open_descriptors()
    faulty.fail_in("export", 2)
    with pytest.raises(DriverError, match="export"):
        connector.export_to(sender)
    assert not left_open(fds)
    receiver.setblocking(False)
    with pytest.raises(BlockingIOError):
        receiver.recv(1)
    receiver.setblocking(True)
    connector.export_to(sender)
    with import_segments(receiver) as imported:
        assert imported.digests() == digests_here(kv_cache)
    assert not left_open(fds)


@pytest.mark.invariant(6)
def test_invalid_calls_raise_and_change_nothing(device, build, connector):
    kv_cache = build.cache_for("full", KVCacheLayout.LBHNC)
    kv_cache.commit(37, defragment=True)
    with pytest.raises(StateError, match="restore_kv_caches"):
        connector.restore_kv_caches()
    with pytest.raises(ValueError, match="needs an ExtensibleKVCache, got 'cache'"):
        connector.register_kv_caches("cache")
    assert not connector.is_registered
    connector.unregister_kv_caches()  # nothing registered: nothing to do
    connector.register_kv_caches(kv_cache)
    registrations = connector.registrations
    with pytest.raises(StateError, match="register_kv_caches.*registered"):
        connector.register_kv_caches(kv_cache)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as inet:
        with pytest.raises(ValueError, match="AF_UNIX"):
            connector.export_to(inet)
    assert connector.is_registered and connector.registrations == registrations
    connector.close()
    connector.close()  # idempotent
    for call in (lambda: connector.register_kv_caches(kv_cache), connector.restore_kv_caches):
        with pytest.raises(StateError, match="closed"):
            call()


@pytest.mark.invariant(6, 8)
def test_driver_export_and_import_check_their_arguments(device):
    driver = driver_for(device)
    granule = driver.granularity
    counts, fds = live_counts(), open_descriptors()
    for fd, size, message in [
        (-1, granule, r"fd must be an int >= 0 \(a file descriptor\), got -1"),
        ("3", granule, r"\(a file descriptor\), got '3'"),
        (True, granule, r"\(a file descriptor\), got True"),
        (0, 0, "size 0 is not a positive multiple"),
        (0, granule + 1, f"size {granule + 1} is not a positive multiple"),
    ]:
        with pytest.raises(ValueError, match=message):
            driver.import_fd(fd, size)
    assert live_counts() == counts and not left_open(fds)
    chunk = driver.create(granule)
    exported = driver.export_fd(chunk)
    try:
        assert exported != chunk.handle
        if device.type == "cpu":
            # Mapping past the end of a memfd would fault on first touch.
            with pytest.raises(ValueError, match=f"fd {exported} holds {granule} bytes, fewer than the {2 * granule}"):
                driver.import_fd(exported, 2 * granule)
        imported = driver.import_fd(exported, granule)
        assert live_chunks[driver.kind] == counts[0].get(driver.kind, 0) + 2
        driver.release(imported)
    finally:
        os.close(exported)
        driver.release(chunk)
    assert live_counts() == counts and not left_open(fds)


@pytest.mark.invariant(6)
@pytest.mark.long
def test_peer_refuses_a_bad_header_and_says_why():
    # The command itself, in a fresh interpreter: its exit status on a failure.
    reply, returncode, stderr = run_peer_with(lambda sock: send_message(sock, {"protocol": "extkv-segments/1"}), None)
    assert returncode == 1, stderr
    assert reply == {
        "error": "ValueError: peer speaks protocol 'extkv-segments/1'; expected 'extkv-segments/2'"
    }


@pytest.mark.invariant(6, 8)
@pytest.mark.parametrize(
    "header, message",
    [
        ({"protocol": "extkv-segments/2", "writable": False, "chunks": [{"size": 4096}]}, "malformed segment header"),
        # A long header is shown cut short: the message may travel back to the exporter.
        (
            {"protocol": "extkv-segments/2", "writable": False, "chunks": [{"size": 4096}] * 1000},
            r"malformed segment header \(KeyError: 'segments'\): \{.{290,300}\.\.\. \(\d+ characters\)$",
        ),
        (
            {
                "protocol": "extkv-segments/2",
                "writable": False,
                "chunks": [{"size": GRANULE}],
                "segments": [{"chunk": 0, "offset_in_chunk": GRANULE - 8, "committed_bytes": 9}],
            },
            f"ends at byte {GRANULE + 1} of chunk 0, which holds {GRANULE} bytes",
        ),
        (
            {
                "protocol": "extkv-segments/2",
                "writable": False,
                "chunks": [],
                "segments": [{"chunk": 1, "offset_in_chunk": 0, "committed_bytes": 9}],
            },
            "names chunk 1; the header lists 0",
        ),
        (
            {
                "protocol": "extkv-segments/2",
                "writable": False,
                "chunks": [{"size": -1}],
                "segments": [],
            },
            r"header field chunks\[0\].size must be an int >= 0, got -1",
        ),
        # A segment's chunk index at and past the bounds of the chunk list.
        *(
            (
                {
                    "protocol": "extkv-segments/2",
                    "writable": False,
                    "chunks": [{"size": GRANULE}, {"size": GRANULE}],
                    "segments": [{"chunk": chunk, "offset_in_chunk": 0, "committed_bytes": 9}],
                },
                message,
            )
            for chunk, message in (
                (2, r"^header segment 0 names chunk 2; the header lists 2$"),
                (1 << 64, rf"^header segment 0 names chunk {1 << 64}; the header lists 2$"),
                (-1, r"^header field segments\[0\].chunk must be an int >= 0, got -1$"),
                (-(1 << 64), rf"^header field segments\[0\].chunk must be an int >= 0, got -{1 << 64}$"),
                (True, r"^header field segments\[0\].chunk must be an int >= 0, got True$"),
                (1.0, r"^header field segments\[0\].chunk must be an int >= 0, got 1.0$"),
            )
        ),
    ],
)
def test_import_refuses_malformed_headers_before_importing(header, message, channel):
    counts, fds = live_counts(), open_descriptors()
    sender, receiver = channel
    send_message(sender, header)
    with pytest.raises(ValueError, match=message):
        import_segments(receiver)
    assert live_counts() == counts and not left_open(fds)


def host_header(chunk_sizes: list[int], segments: list[tuple[int, int, int]]) -> dict:
    """A well-formed header of a host export, for hand-made exports."""
    return {
        "protocol": PROTOCOL,
        "driver": "host",
        "device": {"type": "cpu", "index": None, "uuid": None},
        "granularity": GRANULE,
        "writable": False,
        "chunks": [{"size": size} for size in chunk_sizes],
        "segments": [
            {"chunk": chunk, "offset_in_chunk": offset, "committed_bytes": size} for chunk, offset, size in segments
        ],
    }


@pytest.mark.invariant(6, 8)
def test_import_refuses_deeply_nested_json_with_a_value_error(channel):
    counts, fds = live_counts(), open_descriptors()
    sender, receiver = channel
    payload = b"[" * 100_000
    sender.sendall(struct.pack(">Q", len(payload)) + payload)
    with pytest.raises(ValueError, match=r"message of 100000 bytes nests JSON arrays or objects too deeply"):
        import_segments(receiver)
    assert live_counts() == counts and not left_open(fds)


@pytest.mark.invariant(6, 8)
@pytest.mark.parametrize("kind", ["regular file", "unsealed memfd"])
def test_import_refuses_a_descriptor_that_is_not_a_sealed_memfd(kind, channel):
    """A regular file, or a memfd without seals, could be truncated by its
    sender under the importer's mapping: refused before anything is mapped."""
    counts, fds = live_counts(), open_descriptors()
    if kind == "regular file":
        fd, path = tempfile.mkstemp(prefix="extkv-")
        os.unlink(path)
    else:
        fd = os.memfd_create("extkv-chunk", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, GRANULE)
        sender, receiver = channel
        send_message(sender, host_header([GRANULE], [(0, 0, GRANULE)]))
        socket.send_fds(sender, [b"F"], [fd])
        with pytest.raises(ValueError, match=r"is not a memfd sealed with F_SEAL_SHRINK\|F_SEAL_GROW"):
            import_segments(receiver)
    finally:
        os.close(fd)
    assert live_counts() == counts and not left_open(fds)


def hostile_memfd(size: int, *, allocated: bool) -> int:
    """A memfd sealed as an extkv chunk is, `size` bytes long, with every
    page allocated or none (sparse: nothing is allocated until read)."""
    fd = os.memfd_create("hostile-export", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        if allocated:
            os.posix_fallocate(fd, 0, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


@pytest.mark.invariant(6, 8)
def test_import_caps_what_the_exporter_announces_before_receiving_a_descriptor():
    """A hostile exporter announces more than the peer accepts: by default
    more than the device's total memory, or more than the caller's
    `max_bytes`, in chunks or in segments (overlapping ones are read once
    each). Refused on the header's word, naming both numbers, before any
    descriptor is received; a sparse memfd within the cap is refused too,
    before any of it is read. The wire refuses a message on its length."""
    counts, fds = live_counts(), open_descriptors()
    total = driver_for("cpu").memory_info()[1]
    over = (total // GRANULE + 1) * GRANULE  # one granule more than all memory
    cases = [
        # (memfd size, allocated, header, max_bytes, refusal)
        (
            over,
            False,
            host_header([over], [(0, 0, over)]),
            None,
            f"the export announces {over} bytes in 1 chunk(s) and {over} committed bytes in 1 segment(s), more "
            f"than the {total} bytes this import accepts of either (max_bytes=None: the total memory of cpu); "
            "no descriptor was received",
        ),
        (
            2 * GRANULE,
            True,
            host_header([2 * GRANULE], [(0, 0, 2 * GRANULE)]),
            GRANULE,
            f"the export announces {2 * GRANULE} bytes in 1 chunk(s) and {2 * GRANULE} committed bytes in 1 "
            f"segment(s), more than the {GRANULE} bytes this import accepts of either (max_bytes={GRANULE})",
        ),
        (
            GRANULE,
            True,
            host_header([GRANULE], [(0, 0, GRANULE)] * 3),
            2 * GRANULE,
            f"the export announces {GRANULE} bytes in 1 chunk(s) and {3 * GRANULE} committed bytes in 3 segment",
        ),
        (
            4 * GRANULE,
            False,
            host_header([4 * GRANULE], [(0, 0, 4 * GRANULE)]),
            None,
            f"chunk 0 is a sparse memfd: 0 of its {4 * GRANULE} bytes are allocated",
        ),
    ]
    for size, allocated, header, max_bytes, refusal in cases:
        fd = hostile_memfd(size, allocated=allocated)
        try:
            sender, receiver = socket.socketpair()
            with sender, receiver:
                send_message(sender, header)
                socket.send_fds(sender, [b"F"], [fd])
                with pytest.raises(ValueError, match=re.escape(refusal)):
                    import_segments(receiver, max_bytes=max_bytes, timeout=PEER_TIMEOUT_S)
                if "sparse" not in refusal:
                    # Refused on the header: its descriptor is still in the socket.
                    _, passed, _, _ = socket.recv_fds(receiver, 1, 1)
                    assert len(passed) == 1 and os.fstat(passed[0]).st_ino == os.fstat(fd).st_ino
                    os.close(passed[0])
            assert os.fstat(fd).st_blocks == (size // 512 if allocated else 0)  # nothing was read
        finally:
            os.close(fd)
        assert live_counts() == counts and not left_open(fds), refusal

    # Within its cap the same kind of export imports.
    fd = hostile_memfd(2 * GRANULE, allocated=True)
    try:
        sender, receiver = socket.socketpair()
        with sender, receiver:
            send_message(sender, host_header([2 * GRANULE], [(0, 0, 2 * GRANULE)]))
            socket.send_fds(sender, [b"F"], [fd])
            with import_segments(receiver, max_bytes=2 * GRANULE) as imported:
                assert imported.digests() == [hashlib.sha256(bytes(2 * GRANULE)).hexdigest()]
            with pytest.raises(ValueError, match=r"max_bytes must be an int >= 0 \(bytes an import may announce\), got -1"):
                import_segments(receiver, max_bytes=-1)
    finally:
        os.close(fd)

    # The wire reads a length prefix, never what it announces past the cap.
    sender, receiver = socket.socketpair()
    with sender, receiver:
        receiver.settimeout(5)  # a reader that waited for the payload would hang
        for length, max_bytes in ((1000, 100), (MAX_HEADER_BYTES + 1, None)):
            sender.sendall(struct.pack(">Q", length) + b"x" * 16)
            with pytest.raises(ValueError, match=f"message of {length} bytes announced, more than the "):
                if max_bytes is None:
                    import_segments(receiver, timeout=5)  # a header is at most MAX_HEADER_BYTES
                else:
                    receive_message(receiver, max_bytes=max_bytes)
            assert receiver.recv(16) == b"x" * 16  # left where it was
    assert live_counts() == counts and not left_open(fds)


@pytest.mark.invariant(8)
def test_peer_error_reply_names_no_address(peers):
    """The peer's mmap of a write-only descriptor fails with a DriverError
    that names the address; the reply says what failed, not where."""
    driver = driver_for("cpu")
    chunk = driver.create(GRANULE)
    write_only = os.open(f"/proc/self/fd/{chunk.handle}", os.O_WRONLY | os.O_CLOEXEC)
    try:

        def send(sock):
            send_message(sock, host_header([GRANULE], [(0, 0, GRANULE)]))
            socket.send_fds(sock, [b"F"], [write_only])

        reply, returncode, stderr = run_peer_with(send, peers)
    finally:
        os.close(write_only)
        driver.release(chunk)
    assert returncode == 1
    assert reply == {"error": "DriverError: mmap(MAP_FIXED, memfd) failed: EACCES (13)"}
    assert "address 0x" in stderr  # the peer's own report keeps it


@pytest.mark.invariant(6, 8)
def test_import_gives_up_when_the_exporter_stalls_and_restores_the_timeout(channel):
    counts, fds = live_counts(), open_descriptors()
    sender, receiver = channel
    for sent in ("nothing", "the header but no descriptors"):
        if sent != "nothing":
            send_message(sender, host_header([GRANULE], [(0, 0, GRANULE)]))
        # Without the timeout this would wait forever: the error is the proof.
        with pytest.raises(TimeoutError):
            import_segments(receiver, timeout=0.2)
        assert receiver.gettimeout() is None, sent
    assert live_counts() == counts and not left_open(fds)


#: What no argument of seconds may be, and the form every refusal takes.
NOT_TIMEOUTS = [math.nan, -math.inf, -1.0, 0, True, False, "1", torch.tensor(1.0), [1]]


def no_timeout(name: str, value) -> str:
    return re.escape(f"{name} must be a number of seconds > 0, or None or inf for no limit, got {value!r}")


@pytest.mark.invariant(6, 8)
def test_timeouts_take_inf_as_no_limit_and_refuse_what_is_no_duration(build, connector, channel):
    """inf, like None, waits as long as it takes, and so does a finite number
    of seconds too long for a socket's clock; never an OverflowError. A
    bool, nan, 0 or less, a string or a tensor is refused with a ValueError
    naming the argument and the value, before anything is read."""
    kv_cache = build.cache_for("full", KVCacheLayout.LBHNC, device=HOST)
    kv_cache.commit(37, defragment=True)
    fill_segments(kv_cache, seed=12)
    connector.register_kv_caches(kv_cache)
    expected = digests_here(kv_cache)
    counts, fds = live_counts(), open_descriptors()
    sender, receiver = channel
    for timeout in (math.inf, 1e300, 10**400, None, 60):
        connector.export_to(sender, timeout=timeout)
        assert sender.gettimeout() is None, timeout
        with import_segments(receiver, timeout=timeout) as imported:
            assert imported.digests(timeout=timeout) == expected, timeout
            for refused in NOT_TIMEOUTS:
                with pytest.raises(ValueError, match=no_timeout("timeout", refused)):
                    imported.digests(timeout=refused)
        assert receiver.gettimeout() is None, timeout
    for timeout in NOT_TIMEOUTS:
        with pytest.raises(ValueError, match=no_timeout("timeout", timeout)):
            import_segments(receiver, timeout=timeout)
        with pytest.raises(ValueError, match=no_timeout("timeout", timeout)):
            connector.export_to(sender, timeout=timeout)
    receiver.setblocking(False)
    with pytest.raises(BlockingIOError):
        receiver.recv(1)  # each import read its export to the end; a refused export sent nothing
    assert live_counts() == counts and not left_open(fds)

    # The peer's whole run (what `extkv peer --timeout inf` calls), in a thread.
    for timeout in NOT_TIMEOUTS:
        with pytest.raises(ValueError, match=no_timeout("timeout", timeout)):
            run_peer("/nonexistent/extkv.sock", timeout)
    with listen_privately() as listener:
        listener.socket.settimeout(10)  # the peer connects at once, or failed
        failures: list[BaseException] = []

        def peer():
            try:
                run_peer(listener.path, math.inf)
            except BaseException as error:
                failures.append(error)

        thread = threading.Thread(target=peer)
        thread.start()
        try:
            with listener.accept() as connection:
                connection.settimeout(PEER_TIMEOUT_S)
                connector.export_to(connection)
                reply = receive_message(connection)
        except socket.timeout:
            raise AssertionError(f"the peer never connected: {failures}") from None
        finally:
            thread.join(PEER_TIMEOUT_S)
    assert not failures and reply == {"digests": expected}
    assert live_counts() == counts and not left_open(fds)


def message_bytes(message: dict) -> bytes:
    """`message` as `send_message` puts it on the wire."""
    payload = json.dumps(message).encode()
    return struct.pack(">Q", len(payload)) + payload


#: A paced exporter's bytes are this far apart: far below any timeout of a
#: single wait, while a header of a few hundred bytes takes seconds.
PACE_S = 0.02


def paced_send(sock: socket.socket, payload: bytes, fd: int) -> bool:
    """Send `payload` one byte every PACE_S, then `fd`, as an exporter that
    keeps each of the peer's waits short and the whole import long. False
    when the peer hung up first."""
    try:
        for i in range(len(payload)):
            sock.send(payload[i : i + 1])
            time.sleep(PACE_S)
        socket.send_fds(sock, [b"F"], [fd])
    except OSError:
        return False
    return True


@pytest.mark.invariant(6, 8)
def test_an_import_and_its_digests_are_over_within_their_timeouts():
    """An exporter that sends its header a byte at a time keeps every wait
    short; the import still gives up once its timeout has passed, naming how
    far it got, not when the last byte arrives. So do digests."""
    counts, fds = live_counts(), open_descriptors()
    header = message_bytes(host_header([GRANULE], [(0, 0, GRANULE)]))
    assert len(header) * PACE_S > 4  # paced, the header alone takes seconds
    memfd = hostile_memfd(GRANULE, allocated=True)
    sender, receiver = socket.socketpair()
    try:
        exporter = threading.Thread(target=paced_send, args=(sender, header, memfd))
        started = time.monotonic()
        exporter.start()
        try:
            with pytest.raises(DeadlineExceededError) as raised:
                import_segments(receiver, timeout=0.5).close()
            elapsed = time.monotonic() - started
        finally:
            receiver.close()  # the exporter's next byte meets a peer that hung up
            exporter.join(PEER_TIMEOUT_S)
        gave_up = re.fullmatch(
            rf"import_segments \(receiving the export\) was not over within the 0.5 s allowed "
            rf"\(received (\d+) of the {len(header) - 8} bytes of the header\)",
            str(raised.value),
        )
        assert gave_up, str(raised.value)
        assert isinstance(raised.value, TimeoutError) and isinstance(raised.value, ExtkvError)
        # Not a bound on seconds, which a busy machine stretches: the bytes it had when it gave up.
        assert elapsed >= 0.5 and int(gave_up[1]) < len(header) - 8, f"gave up after {elapsed:.2f} s, {gave_up[1]} bytes"

        # Given at once, the same export imports; its digests get a deadline of their own.
        at_once, importer = socket.socketpair()
        with at_once, importer:
            at_once.sendall(header)
            socket.send_fds(at_once, [b"F"], [memfd])
            with import_segments(importer, timeout=PEER_TIMEOUT_S) as imported:
                with pytest.raises(
                    DeadlineExceededError,
                    match=rf"^digests\(\) was not over within the 1e-09 s allowed \(hashed 0 of the {GRANULE} bytes of segment 0\)$",
                ):
                    imported.digests(timeout=1e-9)
                assert imported.digests(timeout=PEER_TIMEOUT_S) == [hashlib.sha256(bytes(GRANULE)).hexdigest()]
    finally:
        sender.close()
        os.close(memfd)
    assert live_counts() == counts and not left_open(fds)


@pytest.mark.invariant(8)
def test_the_peer_process_is_over_within_its_timeout_however_the_exporter_paces_it(peers):
    """`extkv peer --timeout 1` against an exporter that paces its header:
    the peer tells the exporter it gave up, and why, a second after it
    started, not after the header's last byte."""
    header = message_bytes(host_header([GRANULE], [(0, 0, GRANULE)]))
    memfd = hostile_memfd(GRANULE, allocated=True)
    hung_up = []

    def send(sock):
        hung_up.append(not paced_send(sock, header, memfd))

    try:
        reply, returncode, stderr = run_peer_with(send, peers, timeout=1)
    finally:
        os.close(memfd)
    assert returncode == 1, stderr
    gave_up = re.fullmatch(
        r"DeadlineExceededError: the peer of \S+ was not over within the 1 s allowed "
        r"\(received (\d+) of the (\d+) bytes of the header\)",
        reply["error"],
    )
    assert gave_up, reply
    # Not a bound on seconds, which a busy machine stretches: the bytes it had when it gave up.
    assert int(gave_up[1]) < int(gave_up[2]) == len(header) - 8, reply
    assert hung_up == [True], "the peer took the whole paced export"


@pytest.mark.invariant(6)
def test_import_refuses_what_is_not_a_unix_socket_or_a_driver():
    sender, receiver = socket.socketpair()
    with sender, receiver, socket.socket(socket.AF_INET, socket.SOCK_STREAM) as inet:
        for sock in (None, "/tmp/extkv.sock", inet):
            with pytest.raises(ValueError, match="import_segments needs a connected AF_UNIX socket"):
                import_segments(sock)
        with pytest.raises(ValueError, match="driver must be an extkv Driver or None, got 'cpu'"):
            import_segments(receiver, driver="cpu")


@pytest.mark.invariant(8)
@pytest.mark.parametrize("refusal", ["another uid", "another pid"])
def test_export_refuses_a_peer_it_does_not_allow_and_sends_nothing(build, peers, refusal):
    kv_cache = build.cache_for("full", KVCacheLayout.LBHNC, device=HOST)
    kv_cache.commit(37, defragment=True)
    if refusal == "another uid":
        connector = SegmentExportConnector(allowed_uids={os.getuid() + 1})
    else:
        connector = SegmentExportConnector(allowed_pids={os.getpid()})
    connector.register_kv_caches(kv_cache)

    def send(sock):
        pid, uid, gid = peer_credentials(sock)
        assert pid != os.getpid() and uid == os.getuid()
        fds = open_descriptors()
        with pytest.raises(PeerRefusedError) as raised:
            connector.export_to(sock)
        assert isinstance(raised.value, PermissionError) and isinstance(raised.value, ExtkvError)
        why = (
            f"uid {uid} is not among the allowed uids [{os.getuid() + 1}]"
            if refusal == "another uid"
            else f"pid {pid} is not among the allowed pids [{os.getpid()}]"
        )
        assert str(raised.value) == (
            f"export_to refused the peer (pid {pid}, uid {uid}, gid {gid}): {why}; nothing was sent"
        )
        assert not left_open(fds)
        sock.shutdown(socket.SHUT_WR)  # the peer reads end of file, and may still answer

    reply, returncode, stderr = run_peer_with(send, peers)
    assert returncode == 1
    assert reply == {"error": "ConnectionError: connection closed after 0 of 8 bytes"}, stderr
    assert connector.is_registered
    connector.close()


def fill_send_buffer(sock: socket.socket) -> None:
    """Send zeros until `sock` takes no more: what a peer that stopped
    reading leaves there, so that the next send has to wait for it."""
    sock.setblocking(False)
    try:
        while True:
            sock.send(bytes(1 << 16))
    except BlockingIOError:
        pass
    finally:
        sock.setblocking(True)


class SilentPeer:
    """A forked process that connects to `path`, then reads nothing until
    it is killed (`kill()`, idempotent)."""

    def __init__(self, path: str):
        self.pid = os.fork()
        if self.pid == 0:
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                    sock.connect(path)
                    time.sleep(PEER_TIMEOUT_S)
            finally:
                os._exit(0)

    def kill(self) -> None:
        if self.pid is not None:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            self.pid = None


def export_in_a_thread(connector: SegmentExportConnector, sock: socket.socket, **arguments) -> tuple[threading.Thread, list]:
    """Start `connector.export_to(sock, **arguments)` in a thread; the list
    gets what it raised (None when it returned)."""
    outcome: list = []

    def export():
        try:
            connector.export_to(sock, **arguments)
        except BaseException as error:
            outcome.append(error)
        else:
            outcome.append(None)

    thread = threading.Thread(target=export, daemon=True)
    thread.start()
    return thread, outcome


@pytest.mark.invariant(8)
def test_export_to_a_peer_that_never_reads_gives_up_within_its_timeout(build, connector, peers):
    """A peer process that connects and reads nothing cannot hold the
    exporter: export_to gives up once its timeout has passed, naming the
    peer, closes every descriptor it exported, restores the socket's
    timeout, and the next peer is served."""
    assert DEFAULT_EXPORT_TIMEOUT_S == 60
    kv_cache = build.cache_for("padded", KVCacheLayout.LBHNC, device=HOST)
    kv_cache.commit(300, defragment=True)
    fill_segments(kv_cache, seed=13)
    connector.register_kv_caches(kv_cache)
    with listen_privately() as listener:
        listener.socket.settimeout(PEER_TIMEOUT_S)
        peer = SilentPeer(listener.path)
        try:
            with listener.accept() as connection:
                fill_send_buffer(connection)
                connection.settimeout(PEER_TIMEOUT_S)  # each wait's own bound, longer than the test
                fds = open_descriptors()
                started = time.monotonic()
                thread, outcome = export_in_a_thread(connector, connection, timeout=0.5)
                thread.join(PEER_TIMEOUT_S / 2)  # a net against hangs: the peer reads nothing, so only the deadline ends it
                elapsed = time.monotonic() - started
                if thread.is_alive():
                    peer.kill()  # its end closes, and the stuck send fails
                    thread.join(PEER_TIMEOUT_S)
                    raise AssertionError(f"export_to still waited for a peer that never reads after {elapsed:.1f} s")
                (error,) = outcome
                assert isinstance(error, DeadlineExceededError) and isinstance(error, TimeoutError), repr(error)
                assert re.fullmatch(
                    rf"export_to the peer \(pid {peer.pid}, uid {os.getuid()}\) was not over within the 0.5 s "
                    r"allowed \(sent \d+ of the \d+ bytes of the header\); the peer does not read what it is "
                    r"sent: the export is incomplete and the socket mid-message, close it \(the connector stays "
                    r"registered for the next peer\)",
                    str(error),
                ), str(error)
                assert elapsed >= 0.5, f"gave up after {elapsed:.2f} s"
                assert not left_open(fds)  # the exported descriptors are closed
                assert connection.gettimeout() == PEER_TIMEOUT_S  # restored
        finally:
            peer.kill()
    assert connector.is_registered
    assert peer_digests(connector, peers) == digests_here(kv_cache)


@pytest.mark.invariant(8)
def test_a_peer_that_hangs_up_mid_export_is_named_and_the_next_is_served(build, connector, peers):
    """A peer process that dies while export_to waits to send it the header
    is a PeerDisconnectedError (a ConnectionError) naming its pid and what
    was being sent, not a bare BrokenPipeError; every exported descriptor is
    closed and the next peer reads the cache. Nor does a hang-up kill an
    exporter that does not ignore SIGPIPE, as Python does."""
    kv_cache = build.cache_for("padded", KVCacheLayout.LBHNC, device=HOST)
    kv_cache.commit(300, defragment=True)
    fill_segments(kv_cache, seed=14)
    connector.register_kv_caches(kv_cache)
    with listen_privately() as listener:
        listener.socket.settimeout(PEER_TIMEOUT_S)
        peer = SilentPeer(listener.path)
        try:
            with listener.accept() as connection:
                fill_send_buffer(connection)  # export_to has to wait for the peer to read
                fds = open_descriptors()
                thread, outcome = export_in_a_thread(connector, connection, timeout=PEER_TIMEOUT_S)
                time.sleep(0.2)  # into the wait (a hang-up before it is refused the same way)
                pid = peer.pid
                peer.kill()
                thread.join(PEER_TIMEOUT_S)
                (error,) = outcome
                assert isinstance(error, PeerDisconnectedError), repr(error)
                assert isinstance(error, ConnectionError) and isinstance(error, ExtkvError)
                assert re.fullmatch(
                    rf"export_to: the peer \(pid {pid}, uid {os.getuid()}\) hung up while the header was being "
                    r"sent \((BrokenPipeError|ConnectionResetError): \[Errno \d+\] [\w ]+\); the export is "
                    r"incomplete \(the connector stays registered for the next peer\)",
                    str(error),
                ), str(error)
                assert not left_open(fds)
        finally:
            peer.kill()
    assert connector.is_registered
    assert peer_digests(connector, peers) == digests_here(kv_cache)

    # An exporter where SIGPIPE kills (its default action), forked: the
    # hang-up is the same error there, and the exporter lives on. A forked
    # child's copy of a cache is not its own, so it makes its cache there.
    mine, theirs = socket.socketpair()
    theirs.close()
    with mine:
        child = os.fork()
        if child == 0:
            code = 1
            try:
                signal.signal(signal.SIGPIPE, signal.SIG_DFL)
                kv_cache = ExtensibleKVCache(config_for("full", KVCacheLayout.LBHNC, 8), HOST, KVCacheLayout.LBHNC)
                kv_cache.commit(4, defragment=True)
                exporter = SegmentExportConnector()
                exporter.register_kv_caches(kv_cache)
                try:
                    exporter.export_to(mine)
                except PeerDisconnectedError:
                    code = 0
            finally:
                os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"the exporter exited with {os.waitstatus_to_exitcode(status)}"


@pytest.mark.invariant(6, 8)
def test_export_serves_an_allowed_peer_and_checks_its_arguments(build):
    kv_cache = build.cache_for("full", KVCacheLayout.LBHNC, device=HOST)
    kv_cache.commit(37, defragment=True)
    fill_segments(kv_cache, seed=11)
    default = SegmentExportConnector()
    assert default.allowed_uids == {os.getuid()} and default.allowed_pids is None
    assert default.writable_exports is False
    default.close()
    sender, receiver = socket.socketpair()  # both ends are this process
    with sender, receiver:
        allowed = SegmentExportConnector(allowed_pids={os.getpid()}, allowed_uids=[os.getuid(), os.getuid() + 1])
        allowed.register_kv_caches(kv_cache)
        allowed.export_to(sender)
        with import_segments(receiver) as imported:
            assert imported.digests() == digests_here(kv_cache)
        allowed.close()

        refusing = SegmentExportConnector(allowed_uids={os.getuid() + 1})
        refusing.register_kv_caches(kv_cache)
        with pytest.raises(PeerRefusedError, match=f"pid {os.getpid()}, uid {os.getuid()}"):
            refusing.export_to(sender)
        receiver.setblocking(False)
        with pytest.raises(BlockingIOError):
            receiver.recv(1)  # nothing was sent
        refusing.close()

    for arguments, message in [
        ({"allowed_uids": [-1]}, r"allowed_uids\[0\] must be an int >= 0, got -1"),
        ({"allowed_uids": 0}, "allowed_uids must be an iterable of ints >= 0, got 0"),
        ({"allowed_pids": ["1"]}, r"allowed_pids\[0\] must be an int >= 0, got '1'"),
        ({"allowed_pids": [True]}, r"allowed_pids\[0\] must be an int >= 0, got True"),
        ({"writable_exports": "yes"}, r"writable_exports must be a bool \(True or False\), got 'yes'"),
    ]:
        with pytest.raises(ValueError, match=message):
            SegmentExportConnector(**arguments)


@pytest.mark.invariant(6, 8)
def test_listen_privately_binds_where_only_this_uid_can_reach():
    with listen_privately() as listener:
        directory, sock = os.stat(listener.directory), os.stat(listener.path)
        assert stat.S_ISDIR(directory.st_mode) and stat.S_IMODE(directory.st_mode) == 0o700
        assert stat.S_ISSOCK(sock.st_mode) and stat.S_IMODE(sock.st_mode) == 0o600
        assert directory.st_uid == sock.st_uid == os.getuid()
        assert os.path.dirname(listener.path) == listener.directory
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(listener.path)
            with listener.accept() as connection:
                assert peer_credentials(connection) == (os.getpid(), os.getuid(), os.getgid())
    assert not os.path.exists(listener.directory)
    listener.close()  # idempotent

    # A parent whose socket path would not fit in 108 bytes: nothing is left behind.
    with tempfile.TemporaryDirectory(prefix="d" * 100) as parent:
        with pytest.raises(OSError, match="AF_UNIX path too long"):
            listen_privately(parent)
        assert os.listdir(parent) == []
    with pytest.raises(ValueError, match="backlog must be an int >= 1, got 0"):
        listen_privately(backlog=0)


@pytest.mark.invariant(8)
@pytest.mark.long
def test_runner_with_a_registering_connector_defragments_and_exports(device, peers):
    """A runner whose connector registers memory extends with a defragmenting
    commit, so registration succeeds; the peer reads what the model wrote,
    and after sleep/wake the restored registration exports the fresh pages."""
    from extkv import ReferenceModelRunner, ensure_kv_cache_blocks, extend_kv_cache, registers_kv_cache_memory

    connector = SegmentExportConnector()
    runner = ReferenceModelRunner(device, 256, connector=connector)
    try:
        runner.allocate_kv_cache()
        ensure_kv_cache_blocks(runner, 200)  # after the null block: two chunks per segment
        kv_cache = runner.extensible_kv_cache
        assert registers_kv_cache_memory(runner)
        assert not all(kv_cache.buffer.segments_backed_by_one_chunk(kv_cache.buffer.segment_sizes))
        extend_kv_cache(runner, runner.allocated_config, 256)
        assert connector.is_registered
        one_chunk = kv_cache.buffer.segments_backed_by_one_chunk(kv_cache.buffer.segment_sizes)
        assert all(one_chunk), f"segments backed by one chunk: {one_chunk}"
        batch = 2
        tables = torch.arange(batch * 16, device=runner.device).view(batch, 16) + 200
        tokens = torch.tensor([3, 5], device=runner.device)
        for position in range(20):
            positions = torch.full((batch,), position, device=runner.device)
            tokens = runner.decode(tokens, positions, tables, positions + 1).argmax(-1)
        assert any(int(kv_cache.buffer.segment_view(i).count_nonzero()) for i in range(len(kv_cache.segment_strides)))
        assert peer_digests(connector, peers) == digests_here(kv_cache)
        runner.sleep()
        runner.wake()
        assert connector.is_registered
        assert peer_digests(connector, peers) == digests_here(kv_cache)
    finally:
        connector.close()
        runner.free()


@pytest.mark.invariant(8)
def test_a_forked_child_cannot_export_its_parents_cache(build, connector):
    """A forked child's copy of a cache maps none of the parent's memory (its
    descriptors name /dev/null): its export is refused by name, not a
    driver error from sealing /dev/null."""
    kv_cache = build.cache_for("full", KVCacheLayout.LBHNC, device=HOST)
    kv_cache.commit(4, defragment=True)
    connector.register_kv_caches(kv_cache)
    mine, theirs = socket.socketpair()
    with mine, theirs:
        child = os.fork()
        if child == 0:
            code = 1
            try:
                connector.export_to(mine)
            except StaleRegistrationError as error:
                code = 0 if "forked child's copy" in str(error) else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"the child's export exited with {os.waitstatus_to_exitcode(status)}"
