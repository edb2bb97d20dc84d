"""KV connector conformance: every committed segment of an ExtensibleKVCache,
exported to another process (`python -m extkv.peer --peer`), reads there
byte for byte as it does here, on the host driver and each CUDA device.

The peer answers with the sha256 of each segment's committed bytes; the test
compares them with digests computed here. Patterns differ per segment, so a
swapped segment, a wrong offset within a chunk or a view one byte too long or
short changes a digest. In-process imports (a socket pair) cover the peer's
failure paths with the fault-injecting driver.
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import extkv
from extkv.cache import ExtensibleKVCache
from extkv.connector import (
    KVConnector,
    SegmentExportConnector,
    SegmentNotContiguousError,
    StaleRegistrationError,
    import_segments,
    receive_message,
    send_message,
)
from extkv.errors import DriverError, ExtkvError, StateError
from extkv.layout import (
    KVCacheLayout,
    granule_block_alignment,
)
from extkv.testing.checks import check_usage_matches
from extkv.testing.configs import CAPACITY, GRANULE, config_for, fill_segments
from extkv.vmm import FaultInjectingDriver, driver_for, live_chunks, live_reservations

#: Generous: the peer imports torch (and creates a CUDA context) before it connects.
PEER_TIMEOUT_S = 120
REPO_ROOT = Path(extkv.__file__).resolve().parent.parent


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
def make_cache(device):
    """Build ExtensibleKVCaches that are freed after the test, even on failure."""
    made: list[ExtensibleKVCache] = []

    def make(kind: str, layout: KVCacheLayout, on=None) -> ExtensibleKVCache:
        kv_cache = ExtensibleKVCache(config_for(kind, layout), device if on is None else on, layout)
        made.append(kv_cache)
        return kv_cache

    yield make
    for kv_cache in made:
        kv_cache.free()


@pytest.fixture
def connector():
    connector = SegmentExportConnector()
    yield connector
    connector.close()


def digests_here(kv_cache: ExtensibleKVCache) -> list[str]:
    return [
        hashlib.sha256(kv_cache.buffer.segment_view(i).cpu().numpy().tobytes()).hexdigest()
        for i in range(len(kv_cache.segment_strides))
    ]


def peer_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def run_peer_with(send) -> tuple[dict, int, str]:
    """Start a peer process, let `send(sock)` talk to it, and return its
    reply, exit status and stderr. Every wait is bounded: a hang fails."""
    # A short directory: a Unix socket path must fit in 108 bytes.
    with tempfile.TemporaryDirectory(prefix="extkv-") as directory:
        path = os.path.join(directory, "peer.sock")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(path)
            listener.listen(1)
            listener.settimeout(PEER_TIMEOUT_S)
            peer = subprocess.Popen(
                [sys.executable, "-m", "extkv.peer", "--peer", path, "--timeout", str(PEER_TIMEOUT_S)],
                env=peer_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            try:
                try:
                    connection, _ = listener.accept()
                except socket.timeout:
                    peer.kill()
                    _, stderr = peer.communicate(timeout=PEER_TIMEOUT_S)
                    raise AssertionError(f"peer never connected within {PEER_TIMEOUT_S} s:\n{stderr}") from None
                with connection:
                    connection.settimeout(PEER_TIMEOUT_S)
                    send(connection)
                    reply = receive_message(connection)
                _, stderr = peer.communicate(timeout=PEER_TIMEOUT_S)
            finally:
                if peer.poll() is None:
                    peer.kill()
                    peer.communicate(timeout=PEER_TIMEOUT_S)
    return reply, peer.returncode, stderr


def peer_digests(connector: SegmentExportConnector) -> list[str]:
    reply, returncode, stderr = run_peer_with(connector.export_to)
    assert returncode == 0 and "digests" in reply, f"peer failed (exit {returncode}): {reply}\n{stderr}"
    return reply["digests"]


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def live_counts() -> tuple[dict, dict]:
    nonzero = lambda counts: {kind: count for kind, count in counts.items() if count}  # noqa: E731
    return nonzero(live_chunks), nonzero(live_reservations)


def test_segment_export_connector_is_a_kv_connector():
    connector = SegmentExportConnector()
    assert isinstance(connector, KVConnector)
    assert connector.registers_kv_cache_memory is True
    connector.close()


@pytest.mark.parametrize("name, kind, layout, blocks, segments, chunks, inside", CASES, ids=[c[0] for c in CASES])
def test_peer_reads_every_segment(device, make_cache, connector, usage, name, kind, layout, blocks, segments, chunks, inside):
    baseline = usage.read_outside_torch()
    kv_cache = make_cache(kind, layout)
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
    assert peer_digests(connector) == expected
    check_usage_matches(usage, baseline, [kv_cache.buffer])


def test_peer_reads_live_memory_and_one_wrong_byte_shows(device, make_cache, connector):
    kv_cache = make_cache("full", KVCacheLayout.LBHNC)
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
    assert peer_digests(connector) == after


def fragment(kv_cache: ExtensibleKVCache) -> int:
    """Commit so that every segment spans two chunks; return the block count."""
    alignment = granule_block_alignment(kv_cache.segment_strides, kv_cache.buffer.granularity)
    n = min(alignment + 1, CAPACITY)
    kv_cache.commit(1)
    kv_cache.commit(n)
    return n


def test_fragmented_cache_is_refused_and_nothing_changes(device, make_cache, connector):
    kv_cache = make_cache("padded", KVCacheLayout.LBHNC)
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


def test_restore_after_release_and_recommit_reads_new_bytes(device, make_cache, connector, usage):
    baseline = usage.read_outside_torch()
    kv_cache = make_cache("padded", KVCacheLayout.LBHNC)
    n = 300
    kv_cache.commit(n, defragment=True)
    fill_segments(kv_cache, seed=4)
    connector.register_kv_caches(kv_cache)
    old = connector.registrations

    # What a runner does around sleep or a weight update.
    connector.unregister_kv_caches()
    kv_cache.release_physical()
    check_usage_matches(usage, baseline, [kv_cache.buffer])
    kv_cache.recommit()
    kv_cache.commit(n, defragment=True)
    with pytest.raises(StateError, match="export_to"):
        connector.export_to(None)
    connector.restore_kv_caches()
    # By identity: the new chunks may reuse the old handles' numbers (fds).
    assert all(new.mapped_chunk is not stale.mapped_chunk for new, stale in zip(connector.registrations, old))

    # Recommitted pages read as zero there too; rewrite one segment to show
    # the peer sees this process's latest bytes, not the released ones.
    zeros = [hashlib.sha256(bytes(n * stride)).hexdigest() for stride in kv_cache.segment_strides]
    assert digests_here(kv_cache) == zeros
    view = kv_cache.buffer.segment_view(1)
    view.copy_((torch.arange(view.numel(), device=view.device) % 13 + 1).to(torch.uint8))
    expected = digests_here(kv_cache)
    assert expected[0] == zeros[0] and expected[1] != zeros[1]
    assert peer_digests(connector) == expected
    check_usage_matches(usage, baseline, [kv_cache.buffer])


def test_stale_registration_is_refused_until_restored(device, make_cache, connector):
    kv_cache = make_cache("padded", KVCacheLayout.LBHNC)
    kv_cache.commit(300, defragment=True)
    connector.register_kv_caches(kv_cache)
    chunks = kv_cache.buffer.mapped_chunks

    def grow_within_the_mapped_chunks():
        kv_cache.commit(320)
        assert kv_cache.buffer.mapped_chunks == chunks  # only the registered sizes are stale

    def release_and_recommit():
        kv_cache.release_physical()
        kv_cache.recommit()

    sender, receiver = socket.socketpair()
    with sender, receiver:
        receiver.setblocking(False)
        for change in (grow_within_the_mapped_chunks, release_and_recommit):
            change()
            fill_segments(kv_cache, seed=7)
            fds = fd_count()
            with pytest.raises(StaleRegistrationError, match=r"changed since register_kv_caches.*restore_kv_caches"):
                connector.export_to(sender)
            assert fd_count() == fds
            with pytest.raises(BlockingIOError):
                receiver.recv(1)  # nothing was sent
            connector.restore_kv_caches()
            connector.export_to(sender)
            receiver.setblocking(True)
            with import_segments(receiver) as imported:
                assert imported.digests() == digests_here(kv_cache)
            receiver.setblocking(False)


def test_in_process_import_shares_the_physical_memory(device, make_cache, connector, usage):
    baseline = usage.read_outside_torch()
    kv_cache = make_cache("full", KVCacheLayout.LBHNC)
    kv_cache.commit(37, defragment=True)
    fill_segments(kv_cache, seed=8)
    connector.register_kv_caches(kv_cache)
    sender, receiver = socket.socketpair()
    with sender, receiver:
        connector.export_to(sender)
        with import_segments(receiver) as imported:
            assert imported.segment_sizes == kv_cache.buffer.segment_sizes
            assert imported.views[1].data_ptr() != kv_cache.buffer.segment_view(1).data_ptr()
            imported.views[1][-4:].fill_(0xEE)  # written there, read here
            assert torch.all(kv_cache.buffer.segment_view(1)[-4:] == 0xEE)
            assert imported.digests() == digests_here(kv_cache)
    check_usage_matches(usage, baseline, [kv_cache.buffer])


@pytest.mark.parametrize("step, nth", [("reserve", 1), ("import", 2), ("map", 3), ("set_access", 1)])
def test_failed_import_undoes_every_step(device, make_cache, connector, step, nth):
    kv_cache = make_cache("padded", KVCacheLayout.LBHNC)  # three chunks
    kv_cache.commit(300, defragment=True)
    fill_segments(kv_cache, seed=3)
    connector.register_kv_caches(kv_cache)
    faulty = FaultInjectingDriver(driver_for(device), {step: nth})
    sender, receiver = socket.socketpair()
    with sender, receiver:
        counts, fds = live_counts(), fd_count()
        connector.export_to(sender)
        with pytest.raises(DriverError, match="injected fault"):
            import_segments(receiver, driver=faulty)
        assert faulty.fired == [(step, nth)]
        assert live_counts() == counts and fd_count() == fds  # received descriptors closed too
        # The fault fired once: a fresh export imports completely.
        connector.export_to(sender)
        with import_segments(receiver, driver=faulty) as imported:
            assert imported.digests() == digests_here(kv_cache)
        assert live_counts() == counts and fd_count() == fds


def test_failed_export_sends_nothing_and_closes_what_it_exported(device, make_cache, connector):
    faulty = FaultInjectingDriver(driver_for(device))
    kv_cache = make_cache("padded", KVCacheLayout.LBHNC, on=faulty)
    kv_cache.commit(300, defragment=True)
    fill_segments(kv_cache, seed=6)
    connector.register_kv_caches(kv_cache)
    sender, receiver = socket.socketpair()
    with sender, receiver:
        fds = fd_count()
        faulty.fail_in("export", 2)
        with pytest.raises(DriverError, match="export"):
            connector.export_to(sender)
        assert fd_count() == fds
        receiver.setblocking(False)
        with pytest.raises(BlockingIOError):
            receiver.recv(1)
        receiver.setblocking(True)
        connector.export_to(sender)
        with import_segments(receiver) as imported:
            assert imported.digests() == digests_here(kv_cache)
        assert fd_count() == fds


def test_invalid_calls_raise_and_change_nothing(device, make_cache, connector):
    kv_cache = make_cache("full", KVCacheLayout.LBHNC)
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


def test_driver_export_and_import_check_their_arguments(device):
    driver = driver_for(device)
    granule = driver.granularity
    counts, fds = live_counts(), fd_count()
    for fd, size, message in [
        (-1, granule, "non-negative int file descriptor, got -1"),
        ("3", granule, "file descriptor, got '3'"),
        (True, granule, "file descriptor, got True"),
        (0, 0, "size 0 is not a positive multiple"),
        (0, granule + 1, f"size {granule + 1} is not a positive multiple"),
    ]:
        with pytest.raises(ValueError, match=message):
            driver.import_fd(fd, size)
    assert live_counts() == counts and fd_count() == fds
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
    assert live_counts() == counts and fd_count() == fds


def test_peer_refuses_a_bad_header_and_says_why():
    reply, returncode, stderr = run_peer_with(lambda sock: send_message(sock, {"protocol": "extkv-segments/0"}))
    assert returncode == 1, stderr
    assert reply == {
        "error": "ValueError: peer speaks protocol 'extkv-segments/0'; expected 'extkv-segments/1'"
    }


@pytest.mark.parametrize(
    "header, message",
    [
        ({"protocol": "extkv-segments/1", "chunks": [{"size": 4096}]}, "malformed segment header"),
        (
            {
                "protocol": "extkv-segments/1",
                "chunks": [{"size": GRANULE}],
                "segments": [{"chunk": 0, "offset_in_chunk": GRANULE - 8, "committed_bytes": 9}],
            },
            f"ends at byte {GRANULE + 1} of chunk 0, which holds {GRANULE} bytes",
        ),
        (
            {
                "protocol": "extkv-segments/1",
                "chunks": [],
                "segments": [{"chunk": 1, "offset_in_chunk": 0, "committed_bytes": 9}],
            },
            "names chunk 1; the header lists 0",
        ),
        (
            {
                "protocol": "extkv-segments/1",
                "chunks": [{"size": -1}],
                "segments": [],
            },
            r"chunks\[0\].size must be an int >= 0, got -1",
        ),
    ],
)
def test_import_refuses_malformed_headers_before_importing(header, message):
    counts, fds = live_counts(), fd_count()
    sender, receiver = socket.socketpair()
    with sender, receiver:
        send_message(sender, header)
        with pytest.raises(ValueError, match=message):
            import_segments(receiver)
    assert live_counts() == counts and fd_count() == fds


def test_runner_with_a_registering_connector_defragments_and_exports(device):
    """A runner whose connector registers memory extends with a defragmenting
    commit, so registration succeeds; the peer reads what the model wrote,
    and after sleep/wake the restored registration exports the fresh pages."""
    from extkv.runner import ReferenceModelRunner, ensure_kv_cache_blocks, extend_kv_cache, registers_kv_cache_memory

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
        assert all(kv_cache.buffer.segments_backed_by_one_chunk(kv_cache.buffer.segment_sizes))
        batch = 2
        tables = torch.arange(batch * 16, device=runner.device).view(batch, 16) + 200
        tokens = torch.tensor([3, 5], device=runner.device)
        for position in range(20):
            positions = torch.full((batch,), position, device=runner.device)
            tokens = runner.decode(tokens, positions, tables, positions + 1).argmax(-1)
        assert any(int(kv_cache.buffer.segment_view(i).count_nonzero()) for i in range(len(kv_cache.segment_strides)))
        assert peer_digests(connector) == digests_here(kv_cache)
        runner.sleep()
        runner.wake()
        assert connector.is_registered
        assert peer_digests(connector) == digests_here(kv_cache)
    finally:
        connector.close()
        runner.free()
