"""KV connector: hand each committed KV cache segment to another process.

Theory of operation
-------------------
A KV connector moves KV blocks between this engine and others (disaggregated
prefill, offloading). One that registers the cache's memory, for RDMA or for
IPC, needs every registered range backed by one physical chunk, which is why
an engine commits with `defragment=True` when the connector's
`registers_kv_cache_memory` is set. `KVConnector` is the protocol a runner
drives: register once the cache is sized, unregister before its memory is
released, restore once it is recommitted, close at shutdown.

`SegmentExportConnector` is the one real implementation. Registering records,
per segment, the chunk that backs the segment's committed bytes and where in
that chunk the segment starts: a chunk may be larger than its segment, or
shared by neighbouring segments when one commit mapped them as one run.
`export_to(sock)` sends, over a connected Unix stream socket, a JSON header
describing that geometry and one file descriptor per distinct chunk
(SCM_RIGHTS), exported by the driver and closed here once sent: the peer's
import holds its own reference. No byte of the cache goes through the socket;
both processes map the same physical memory.

A registration describes the mapping at the time it was made. If the cache's
memory changes afterwards (released, recommitted, grown), `export_to` refuses
with `StaleRegistrationError` instead of exporting chunks that no longer back
the segments; `restore_kv_caches()` registers the current mapping.

Trust (a peer receives only what it is given and cannot harm the exporter):
- Who: before sending anything, `export_to` reads the connected peer's
  credentials (`SO_PEERCRED`: pid, uid, gid, taken by the kernel at connect
  time) and refuses, with `PeerRefusedError` and nothing sent, a peer whose
  uid is not allowed (by default only this process's uid) or, when
  `allowed_pids` is given, whose pid is not in it. The listening socket must
  live in a private directory, or any local user could connect first:
  `listen_privately()` binds it in a fresh 0700 directory with mode 0600.
- What: exports are read-only unless the connector was built with
  `writable_exports=True`, which trusts every allowed peer to write. A host
  chunk travels as a read-only descriptor of a memfd sealed against shrinking
  and growing (extkv.vmm.host says what that does and does not stop); the
  peer's mapping is then read-only too. On CUDA a POSIX-fd shareable handle
  carries no access mode: the header says `"writable": false` and this peer
  grants itself read access only (`cuMemSetAccess(PROT_READ)`), but the
  exporter cannot enforce that on another peer: CUDA exports are as trusted
  as the peer.

The peer (`import_segments`, or `python -m extkv.peer --peer PATH`)
receives the descriptors, imports each chunk with the driver for the device
the header names, maps the chunks back to back in one fresh reservation,
grants access over it and exposes a uint8 view of each segment's committed
bytes. The import is one transaction: a failing step undoes the earlier ones,
and the received descriptors are closed whatever happens. `close()` unmaps,
releases and frees everything. What arrives is checked before it is used:
every wait on the socket is bounded (`timeout`, DEFAULT_PEER_TIMEOUT_S by
default), a message is at most MAX_MESSAGE_BYTES of JSON that must not nest
deeper than the parser can go, every header field is validated, and a host
descriptor must be a sealed memfd (a regular file is refused: its owner could
truncate it under the mapping). An error reply names the error's type and
what failed, never an address of this process.

Wire format, one connection: a message is an 8-byte big-endian length and that
many bytes of UTF-8 JSON. The exporter sends the header message (geometry,
and `"writable"`: whether the descriptors allow writing), then the
descriptors in batches of at most 253 (the kernel's SCM_MAX_FD), each batch on
one byte of its own. The peer answers with one message: `{"digests": [...]}`
(sha256 of each segment's committed bytes, in segment order) or
`{"error": "..."}`.
"""

from __future__ import annotations

import argparse
import array
import ctypes
import enum
import hashlib
import json
import os
import socket
import struct
import tempfile
from dataclasses import dataclass
from typing import Iterable, Protocol, Sequence, runtime_checkable

import torch

from .cache import ExtensibleKVCache
from .layout import KVCacheConfig
from . import validate
from .errors import DriverError, ExtkvError, StateError
from .tensor import ExtensibleTensor, MappedChunk
from .vmm import Chunk, Driver, HostDriver, Transaction, cuda_usable, driver_for

#: Names the wire format; a peer refuses any other.
PROTOCOL = "extkv-segments/2"
#: Linux refuses more descriptors than this in one SCM_RIGHTS message.
MAX_FDS_PER_MESSAGE = 253
#: A header is a few hundred bytes per segment; anything near this is garbage.
MAX_MESSAGE_BYTES = 64 << 20
_LENGTH = struct.Struct(">Q")
#: Seconds the peer waits on its socket (each wait) before giving up.
DEFAULT_PEER_TIMEOUT_S = 120.0


class SegmentNotContiguousError(ExtkvError, ValueError):
    """A segment's committed bytes span several physical chunks, so it cannot
    be registered as one range."""


class StaleRegistrationError(StateError):
    """The cache's memory changed since it was registered."""


class PeerRefusedError(ExtkvError, PermissionError):
    """The process at the other end of the socket is not allowed to receive
    the export."""


@runtime_checkable
class KVConnector(Protocol):
    """What a model runner needs of a KV connector."""

    #: True when the connector registers the cache's memory (RDMA, IPC), which
    #: needs one physical chunk per segment: commit with defragment=True.
    registers_kv_cache_memory: bool

    def register_kv_caches(self, kv_cache: ExtensibleKVCache, *, kv_cache_config: KVCacheConfig | None = None) -> None:
        """Register the committed memory of `kv_cache`. `kv_cache_config`, when
        given, describes the committed geometry: `num_blocks` committed blocks
        and `kv_cache_tensors` placed as the committed views are
        (`ExtensibleKVCache.committed_kv_cache_tensors`)."""

    def unregister_kv_caches(self) -> None:
        """Forget the registration before the cache's memory is released."""

    def restore_kv_caches(self) -> None:
        """Register again after the memory was released and recommitted."""

    def close(self) -> None:
        """Release whatever the connector holds; idempotent."""


@dataclass(frozen=True)
class SegmentRegistration:
    """Where segment `index`'s committed bytes live: `committed_bytes` at
    `address`, which is `offset_in_chunk` bytes into `mapped_chunk` (None when
    nothing is committed)."""

    index: int
    address: int
    committed_bytes: int
    mapped_chunk: MappedChunk | None
    offset_in_chunk: int


class _State(enum.Enum):
    UNREGISTERED = "unregistered"
    REGISTERED = "registered"
    SUSPENDED = "unregistered (cache kept for restore_kv_caches)"
    CLOSED = "closed"


_LEGAL_IN: dict[str, frozenset[_State]] = {
    "register_kv_caches": frozenset({_State.UNREGISTERED, _State.SUSPENDED}),
    "unregister_kv_caches": frozenset({_State.UNREGISTERED, _State.REGISTERED, _State.SUSPENDED}),
    "restore_kv_caches": frozenset({_State.REGISTERED, _State.SUSPENDED}),
    "export_to": frozenset({_State.REGISTERED}),
    "close": frozenset(_State),
}


class SegmentExportConnector:
    """Exports each committed segment of an ExtensibleKVCache to another
    process as file descriptors of the chunks that back it.

    `writable_exports=True` lets peers write the segments (host descriptors
    open read-write); only for peers trusted with the cache's contents.
    `allowed_uids` (default: this process's uid only) and `allowed_pids`
    (default: any pid) say which peers `export_to` serves; a peer must pass
    both.
    """

    registers_kv_cache_memory = True

    def __init__(
        self,
        *,
        writable_exports: bool = False,
        allowed_uids: Iterable[int] | None = None,
        allowed_pids: Iterable[int] | None = None,
    ) -> None:
        self.writable_exports = validate.flag("writable_exports", writable_exports)
        self.allowed_uids = frozenset({os.getuid()} if allowed_uids is None else _ids("allowed_uids", allowed_uids))
        self.allowed_pids = None if allowed_pids is None else frozenset(_ids("allowed_pids", allowed_pids))
        self._state = _State.UNREGISTERED
        self._kv_cache: ExtensibleKVCache | None = None
        self._registrations: list[SegmentRegistration] = []
        #: The committed geometry given to the last `register_kv_caches`, or None.
        self.kv_cache_config: KVCacheConfig | None = None

    @property
    def registrations(self) -> list[SegmentRegistration]:
        """One entry per segment while registered; empty otherwise."""
        return list(self._registrations)

    @property
    def is_registered(self) -> bool:
        return self._state is _State.REGISTERED

    def register_kv_caches(self, kv_cache: ExtensibleKVCache, *, kv_cache_config: KVCacheConfig | None = None) -> None:
        """Record, per segment, the chunk backing its committed bytes, and keep
        `kv_cache_config` (the committed geometry, see `KVConnector`) as
        `self.kv_cache_config`.

        Raises `SegmentNotContiguousError` (naming the segments) when a
        segment spans several chunks; nothing is registered then.
        """
        self._require("register_kv_caches")
        if not isinstance(kv_cache, ExtensibleKVCache):
            raise ValueError(f"register_kv_caches needs an ExtensibleKVCache, got {kv_cache!r}")
        registrations = _segment_registrations(kv_cache.buffer)
        self._kv_cache = kv_cache
        self._registrations = registrations
        self.kv_cache_config = kv_cache_config
        self._state = _State.REGISTERED

    def unregister_kv_caches(self) -> None:
        """Drop the registration; the cache is kept so that
        `restore_kv_caches()` can register it again. No-op when nothing is
        registered."""
        self._require("unregister_kv_caches")
        self._registrations = []
        if self._kv_cache is not None:
            self._state = _State.SUSPENDED

    def restore_kv_caches(self) -> None:
        """Register the cache's current mapping (after release and recommit)."""
        self._require("restore_kv_caches")
        assert self._kv_cache is not None  # both legal states keep it
        self._registrations = _segment_registrations(self._kv_cache.buffer)
        self._state = _State.REGISTERED

    def close(self) -> None:
        """Forget the cache and any registration. Idempotent. Exported
        descriptors are never kept, so there is nothing else to release."""
        self._require("close")
        self._registrations = []
        self._kv_cache = None
        self._state = _State.CLOSED

    def export_to(self, sock: socket.socket) -> None:
        """Send the registered segments to the process at the other end of
        `sock` (a connected AF_UNIX stream socket): the header, then one
        exported descriptor per distinct chunk, read-only unless
        `writable_exports`. The descriptors exported here are closed before
        returning, whether or not sending succeeded.

        Raises `PeerRefusedError`, having sent nothing, when the peer's
        credentials are not allowed.
        """
        self._require("export_to")
        if sock.family != socket.AF_UNIX:
            raise ValueError(f"export_to needs an AF_UNIX socket to pass file descriptors, got family {sock.family!r}")
        self._check_peer(sock)
        assert self._kv_cache is not None
        buffer = self._kv_cache.buffer
        driver = buffer.driver
        fds: list[int] = []
        try:
            # Held while checking and exporting, so that no other thread's
            # commit remaps the segments in between; not while the peer reads.
            with buffer.lock:
                self._check_current(buffer)
                header, chunks = _header(driver, self._registrations, self.writable_exports)
                for mapped in chunks:
                    fds.append(driver.export_fd(mapped.chunk, writable=self.writable_exports))
            send_message(sock, header)
            _send_fds(sock, fds)
        finally:
            for fd in fds:
                os.close(fd)

    def _check_peer(self, sock: socket.socket) -> None:
        pid, uid, gid = peer_credentials(sock)
        refused = []
        if uid not in self.allowed_uids:
            refused.append(f"uid {uid} is not among the allowed uids {sorted(self.allowed_uids)}")
        if self.allowed_pids is not None and pid not in self.allowed_pids:
            refused.append(f"pid {pid} is not among the allowed pids {sorted(self.allowed_pids)}")
        if refused:
            raise PeerRefusedError(
                f"export_to refused the peer (pid {pid}, uid {uid}, gid {gid}): {'; '.join(refused)}; nothing was sent"
            )

    def _check_current(self, buffer: ExtensibleTensor) -> None:
        """Refuse a registration whose chunks no longer back the segments."""
        if buffer.is_freed:
            raise StaleRegistrationError("the registered KV cache was freed; register a live cache")
        live = {id(mapped) for mapped in buffer.mapped_chunks}
        gone = [r.index for r in self._registrations if r.mapped_chunk is not None and id(r.mapped_chunk) not in live]
        sizes = buffer.segment_sizes
        resized = [r.index for r in self._registrations if sizes[r.index] != r.committed_bytes]
        if gone or resized:
            raise StaleRegistrationError(
                f"the KV cache's memory changed since register_kv_caches (segments {sorted(set(gone + resized))} "
                "were released, remapped or resized); call restore_kv_caches() to register the current mapping"
            )

    def _require(self, operation: str) -> None:
        if self._state not in _LEGAL_IN[operation]:
            raise StateError(f"{operation}() is not allowed: the SegmentExportConnector is {self._state.value}")

    def __repr__(self) -> str:
        return f"SegmentExportConnector({self._state.value}, {len(self._registrations)} segment(s))"


def _ids(name: str, values: Iterable[int]) -> list[int]:
    try:
        items = list(values)
    except TypeError:
        raise ValueError(f"{name} must be an iterable of ints >= 0, got {values!r}") from None
    return [validate.integer(f"{name}[{i}]", value) for i, value in enumerate(items)]


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected AF_UNIX
    socket, as the kernel recorded them when it connected (SO_PEERCRED)."""
    ucred = struct.Struct("3i")
    return ucred.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, ucred.size))


class PrivateListener:
    """A listening AF_UNIX socket (`socket`) bound at `path` inside
    `directory`, made by `listen_privately`. `close()` closes the socket and
    removes the socket file and the directory."""

    def __init__(self, sock: socket.socket, path: str, directory: str):
        self.socket = sock
        self.path = path
        self.directory = directory

    def accept(self) -> socket.socket:
        """The next connection (blocking as the listening socket's timeout says)."""
        connection, _ = self.socket.accept()
        return connection

    def close(self) -> None:
        """Idempotent."""
        self.socket.close()
        for remove, path in ((os.unlink, self.path), (os.rmdir, self.directory)):
            try:
                remove(path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> "PrivateListener":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PrivateListener({self.path!r})"


def listen_privately(parent: str | None = None, *, backlog: int = 1) -> PrivateListener:
    """A listening socket for `export_to`'s peers, `export.sock` in a fresh
    directory under `parent` (default: the temporary directory) that only
    this uid can enter (0700); the socket file is 0600. A Unix socket path
    must fit in 108 bytes, so keep `parent` short."""
    backlog = validate.integer("backlog", backlog, minimum=1)
    # mkdtemp creates the directory 0700 atomically: no other user can reach
    # the socket, even before its own mode is narrowed.
    directory = tempfile.mkdtemp(prefix="extkv-", dir=parent)
    listener = PrivateListener(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), os.path.join(directory, "export.sock"), directory)
    try:
        listener.socket.bind(listener.path)
        os.chmod(listener.path, 0o600)
        listener.socket.listen(backlog)
    except BaseException:
        listener.close()
        raise
    return listener


def _segment_registrations(buffer: ExtensibleTensor) -> list[SegmentRegistration]:
    with buffer.lock:  # one mapping throughout, whatever other threads commit
        return _registrations_of(buffer)


def _registrations_of(buffer: ExtensibleTensor) -> list[SegmentRegistration]:
    sizes = buffer.segment_sizes
    split = [index for index, one in enumerate(buffer.segments_backed_by_one_chunk(sizes)) if not one]
    if split:
        described = ", ".join(f"{index} ({sizes[index]} committed bytes)" for index in split)
        raise SegmentNotContiguousError(
            f"KV cache segment(s) {described} span several physical chunks; a connector that registers "
            "memory needs each segment backed by one chunk: commit with defragment=True "
            "(ExtensibleKVCache.commit(n, defragment=True))"
        )
    mapped_chunks = buffer.mapped_chunks
    registrations = []
    for index, (offset, size) in enumerate(zip(buffer.segment_offsets, sizes)):
        address = buffer.base + offset
        if size == 0:
            registrations.append(SegmentRegistration(index, address, 0, None, 0))
            continue
        owner = next(m for m in mapped_chunks if m.address <= address < m.address + m.chunk.size)
        registrations.append(SegmentRegistration(index, address, size, owner, address - owner.address))
    return registrations


def _header(driver: Driver, registrations: Sequence[SegmentRegistration], writable: bool) -> tuple[dict, list[MappedChunk]]:
    """The header describing `registrations`, and the distinct chunks in the
    order their descriptors follow it."""
    chunk_index: dict[int, int] = {}
    chunks: list[MappedChunk] = []
    segments = []
    for registration in registrations:
        mapped = registration.mapped_chunk
        index = None
        if mapped is not None:
            if id(mapped) not in chunk_index:
                chunk_index[id(mapped)] = len(chunks)
                chunks.append(mapped)
            index = chunk_index[id(mapped)]
        segments.append(
            {
                "chunk": index,
                "offset_in_chunk": registration.offset_in_chunk,
                "committed_bytes": registration.committed_bytes,
            }
        )
    device = driver.device
    header = {
        "protocol": PROTOCOL,
        "driver": driver.kind,
        "device": {"type": device.type, "index": device.index, "uuid": _cuda_uuid(device)},
        "granularity": driver.granularity,
        "writable": writable,
        "chunks": [{"size": mapped.chunk.size} for mapped in chunks],
        "segments": segments,
    }
    return header, chunks


def _cuda_uuid(device: torch.device) -> str | None:
    # The peer may number GPUs differently (CUDA_VISIBLE_DEVICES); the UUID
    # names the same GPU in both processes.
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


# -- messages -------------------------------------------------------------------
def send_message(sock: socket.socket, message: dict) -> None:
    """Send one length-prefixed JSON message."""
    payload = json.dumps(message).encode()
    sock.sendall(_LENGTH.pack(len(payload)) + payload)


def receive_message(sock: socket.socket) -> dict:
    """Receive one message sent by `send_message`."""
    (length,) = _LENGTH.unpack(_receive_exactly(sock, _LENGTH.size))
    if length > MAX_MESSAGE_BYTES:
        raise ValueError(f"message of {length} bytes announced, more than the {MAX_MESSAGE_BYTES} allowed")
    payload = _receive_exactly(sock, length)
    try:
        message = json.loads(payload)
    except ValueError as error:
        raise ValueError(f"message is not JSON: {error}") from None
    except RecursionError:
        raise ValueError(f"message of {length} bytes nests JSON arrays or objects too deeply to parse") from None
    if not isinstance(message, dict):
        raise ValueError(f"message must be a JSON object, got {type(message).__name__}")
    return message


def _receive_exactly(sock: socket.socket, count: int) -> bytes:
    # Exactly `count` bytes and not one more: a plain recv that reached the
    # byte carrying descriptors would make the kernel drop them.
    received = bytearray()
    while len(received) < count:
        part = sock.recv(count - len(received))
        if not part:
            raise ConnectionError(f"connection closed after {len(received)} of {count} bytes")
        received += part
    return bytes(received)


def _send_fds(sock: socket.socket, fds: Sequence[int]) -> None:
    for start in range(0, len(fds), MAX_FDS_PER_MESSAGE):
        batch = fds[start : start + MAX_FDS_PER_MESSAGE]
        if socket.send_fds(sock, [b"F"], batch) != 1:
            raise ConnectionError(f"sending descriptors {start}..{start + len(batch) - 1} failed")


def _receive_fds(sock: socket.socket, count: int) -> list[int]:
    """`count` descriptors sent by `_send_fds`; the caller closes them. On
    failure, those received so far are closed here."""
    fds: list[int] = []
    try:
        while len(fds) < count:
            expected = min(MAX_FDS_PER_MESSAGE, count - len(fds))
            data, ancillary, flags, _ = sock.recvmsg(
                1, socket.CMSG_SPACE(expected * array.array("i").itemsize), socket.MSG_CMSG_CLOEXEC
            )
            batch = array.array("i")
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    batch.frombytes(payload[: len(payload) - len(payload) % batch.itemsize])
            fds.extend(batch)
            if not data:
                raise ConnectionError(f"connection closed after {len(fds)} of {count} descriptors")
            if flags & socket.MSG_CTRUNC or len(batch) != expected:
                raise ConnectionError(f"expected {expected} descriptors in one message, received {len(batch)}")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


# -- the peer ---------------------------------------------------------------------
def sha256_hex(tensor: torch.Tensor) -> str:
    """sha256 (hex) of a tensor's bytes in logical order, on any device."""
    host = tensor.detach().cpu().contiguous()
    nbytes = host.numel() * host.element_size()
    if nbytes == 0:
        return hashlib.sha256().hexdigest()
    # Hashed in place through the buffer protocol: no numpy, no extra copy of
    # a host tensor. `host` stays referenced until hashing is done.
    return hashlib.sha256((ctypes.c_ubyte * nbytes).from_address(host.data_ptr())).hexdigest()


class ImportedSegments:
    """Segments another process exported, mapped into this one.

    `views[i]` is a uint8 tensor over segment i's committed bytes (empty where
    none are committed); write through them only when `writable`. `close()`
    unmaps and releases everything; the views must not be used afterwards.
    """

    def __init__(
        self, driver: Driver, reservation: int | None, reserved_bytes: int, mapped: list[tuple[int, Chunk]], writable: bool
    ):
        self.driver = driver
        #: Whether the exporter allowed writing. Host mappings of a read-only
        #: export are read-only: writing through `views` faults.
        self.writable = writable
        self.views: list[torch.Tensor] = []
        self._reservation = reservation
        self._reserved_bytes = reserved_bytes
        self._mapped = mapped
        self._unreleased: list[Chunk] = []
        self._closed = False

    @property
    def device(self) -> torch.device:
        return self.driver.device

    @property
    def segment_sizes(self) -> list[int]:
        return [view.numel() for view in self.views]

    def digests(self) -> list[str]:
        """sha256 (hex) of each segment's committed bytes."""
        self._require_open("digests")
        return [sha256_hex(view) for view in self.views]

    def close(self) -> None:
        """Unmap, release and free everything. Idempotent; if a driver step
        fails, what was undone stays undone and a retry continues."""
        if self._closed:
            return
        self.views = []
        driver = self.driver
        if self._mapped:
            # Kernels still queued may read these pages.
            driver.synchronize()
        while self._mapped:
            address, chunk = self._mapped[-1]
            driver.unmap(address, chunk.size)
            self._mapped.pop()
            self._unreleased.append(chunk)
            self._release_unreleased()
        self._release_unreleased()
        if self._reservation is not None:
            driver.free_reservation(self._reservation, self._reserved_bytes)
            self._reservation = None
        self._closed = True

    def _release_unreleased(self) -> None:
        while self._unreleased:
            self.driver.release(self._unreleased[-1])
            self._unreleased.pop()

    def _require_open(self, operation: str) -> None:
        if self._closed:
            raise StateError(f"{operation}() is not allowed on closed ImportedSegments")

    def __enter__(self) -> "ImportedSegments":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._mapped)} chunk(s) mapped"
        return f"ImportedSegments({self.device}, {len(self.views)} segment(s), {state})"


def import_segments(
    sock: socket.socket, *, driver: Driver | None = None, timeout: float | None = DEFAULT_PEER_TIMEOUT_S
) -> ImportedSegments:
    """Receive what `SegmentExportConnector.export_to` sends on the other end
    of `sock` and map it here.

    `driver` overrides the driver chosen from the header (a fault injector in
    tests); it must be of the exporter's kind and granularity. Each wait on
    `sock` gives up after `timeout` seconds (`TimeoutError`; None waits
    forever); the socket's own timeout is restored afterwards. The received
    descriptors are closed before this returns, on success or failure.
    """
    if not isinstance(sock, socket.socket) or sock.family != socket.AF_UNIX:
        raise ValueError(f"import_segments needs a connected AF_UNIX socket to receive file descriptors, got {sock!r}")
    if driver is not None and not isinstance(driver, Driver):
        raise ValueError(f"driver must be an extkv Driver or None, got {driver!r}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0):
        raise ValueError(f"timeout must be a number of seconds > 0, or None, got {timeout!r}")
    previous = sock.gettimeout()
    sock.settimeout(timeout)
    try:
        header = receive_message(sock)
        chunk_sizes, segments, writable = _checked_geometry(header)
        fds = _receive_fds(sock, len(chunk_sizes))
    finally:
        sock.settimeout(previous)
    try:
        driver = _driver_for_header(header, driver)
        return _map_imported(driver, fds, chunk_sizes, segments, writable)
    finally:
        for fd in fds:
            os.close(fd)


def _checked_geometry(header: dict) -> tuple[list[int], list[tuple[int | None, int, int]], bool]:
    """(chunk sizes, (chunk, offset_in_chunk, committed_bytes) per segment,
    writable), with every field checked before anything is imported."""
    if header.get("protocol") != PROTOCOL:
        raise ValueError(f"peer speaks protocol {header.get('protocol')!r}; expected {PROTOCOL!r}")

    def count(value, what: str) -> int:
        return validate.integer(f"header field {what}", value)

    try:
        writable = validate.flag("header field writable", header["writable"])
        chunk_sizes = [count(chunk["size"], f"chunks[{i}].size") for i, chunk in enumerate(header["chunks"])]
        segments = []
        for i, segment in enumerate(header["segments"]):
            chunk = segment["chunk"]
            offset = count(segment["offset_in_chunk"], f"segments[{i}].offset_in_chunk")
            size = count(segment["committed_bytes"], f"segments[{i}].committed_bytes")
            if chunk is None:
                if size:
                    raise ValueError(f"header segment {i} has {size} committed bytes but no chunk")
            else:
                count(chunk, f"segments[{i}].chunk")
                if chunk >= len(chunk_sizes):
                    raise ValueError(f"header segment {i} names chunk {chunk}; the header lists {len(chunk_sizes)}")
                if offset + size > chunk_sizes[chunk]:
                    raise ValueError(
                        f"header segment {i} ends at byte {offset + size} of chunk {chunk}, "
                        f"which holds {chunk_sizes[chunk]} bytes"
                    )
            segments.append((chunk, offset, size))
    except (KeyError, TypeError) as error:
        shown = repr(header)
        shown = shown if len(shown) <= 300 else f"{shown[:300]}... ({len(shown)} characters)"
        raise ValueError(f"malformed segment header ({type(error).__name__}: {error}): {shown}") from None
    return chunk_sizes, segments, writable


def _driver_for_header(header: dict, driver: Driver | None) -> Driver:
    kind, granularity, device = header.get("driver"), header.get("granularity"), header.get("device") or {}
    if driver is not None:
        if driver.kind != kind or driver.granularity != granularity:
            raise ValueError(
                f"driver {driver!r} cannot import chunks of a {kind} driver with granularity {granularity}"
            )
        return driver
    if kind == "host":
        default = driver_for("cpu")
        # Chunk sizes are multiples of the exporter's granularity, not
        # necessarily of this process's default.
        return default if default.granularity == granularity else HostDriver(granularity)
    if kind == "cuda":
        driver = driver_for(_local_cuda_device(device))
        if driver.granularity != granularity:
            raise ValueError(
                f"exporter's granularity {granularity} differs from {driver.granularity} on {driver.device}"
            )
        return driver
    raise ValueError(f"header names driver kind {kind!r}; expected 'host' or 'cuda'")


def _local_cuda_device(device: dict) -> torch.device:
    """This process's index for the exporter's GPU."""
    if not cuda_usable():
        raise ValueError("the segments live on a GPU, but this process cannot use CUDA (no GPU or no cuda-python)")
    uuid = device.get("uuid")
    if uuid is None:
        return torch.device("cuda", device.get("index") or 0)
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return torch.device("cuda", index)
    raise ValueError(
        f"the exporter's GPU {uuid} is not visible to this process "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
    )


def _map_imported(
    driver: Driver, fds: list[int], chunk_sizes: list[int], segments: list[tuple[int | None, int, int]], writable: bool
) -> ImportedSegments:
    """Import each chunk and map them back to back in one reservation: one
    transaction, each step undone if a later one fails."""
    granule = driver.granularity
    placements, reserved_bytes = [], 0
    for size in chunk_sizes:
        placements.append(reserved_bytes)
        reserved_bytes += -(-size // granule) * granule
    reservation: int | None = None
    mapped: list[tuple[int, Chunk]] = []
    if chunk_sizes:
        with Transaction() as transaction:
            reservation = driver.reserve(reserved_bytes)
            transaction.push(lambda: driver.free_reservation(reservation, reserved_bytes))
            for fd, size, placement in zip(fds, chunk_sizes, placements):
                chunk = driver.import_fd(fd, size)
                transaction.push(lambda chunk=chunk: driver.release(chunk))
                address = reservation + placement
                driver.map(address, chunk)
                transaction.push(lambda address=address, size=size: driver.unmap(address, size))
                mapped.append((address, chunk))
            # Chunk sizes are granule multiples, so the chunks tile the whole
            # reservation: one access call covers them all. The host driver
            # grants read-only access over read-only descriptors.
            driver.set_access(reservation, reserved_bytes, writable=writable)
    imported = ImportedSegments(driver, reservation, reserved_bytes, mapped, writable)
    try:
        imported.views = [
            torch.empty(0, dtype=torch.uint8, device=driver.device)
            if chunk is None
            else driver.view(reservation + placements[chunk] + offset, size)
            for chunk, offset, size in segments
        ]
    except BaseException:
        imported.close()
        raise
    return imported


# -- entry point --------------------------------------------------------------------
def run_peer(socket_path: str, timeout: float = DEFAULT_PEER_TIMEOUT_S) -> None:
    """Connect to an exporter listening at `socket_path`, import its segments,
    answer with their sha256 digests, and clean up. On failure the exporter is
    told why before the error propagates."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(socket_path)
        try:
            with import_segments(sock, timeout=timeout) as imported:
                digests = imported.digests()
        except Exception as error:
            try:
                send_message(sock, {"error": error_reply(error)})
            except OSError:
                pass  # the exporter is gone; the original error is what matters
            raise
        send_message(sock, {"digests": digests})


def error_reply(error: BaseException) -> str:
    """What the exporter is told about a failed import: the error's type and
    what failed. A `DriverError`'s message names addresses of this process,
    which are nobody else's business (they would help aim an attack on it):
    only its call and result code go back."""
    if isinstance(error, DriverError):
        return f"{type(error).__name__}: {error.call} failed: {error.code_name} ({error.code})"
    return f"{type(error).__name__}: {error}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m extkv.peer",
        description="Peer of SegmentExportConnector: import the exported KV cache segments, "
        "reply with the sha256 of each segment's committed bytes, clean up.",
    )
    parser.add_argument("--peer", metavar="SOCKET_PATH", required=True, help="Unix socket the exporter listens on")
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_PEER_TIMEOUT_S,
        help="seconds to wait on the socket (default %(default)s)",
    )
    args = parser.parse_args(argv)
    run_peer(args.peer, args.timeout)
    return 0

