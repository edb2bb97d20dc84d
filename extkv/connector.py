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
`export_to(sock)` sends, over a connected Unix stream socket, a header
describing that geometry and one file descriptor per distinct chunk, in the
format extkv.wire defines; each descriptor is exported by the driver and
closed here once sent: the peer's import holds its own reference. No byte of
the cache goes through the socket; both processes map the same physical
memory. The receiving side is extkv.peer (`extkv peer --peer PATH` as a
process of its own).

A registration describes the mapping at the time it was made. If the cache's
memory changes afterwards (released, recommitted, grown), `export_to` refuses
with `StaleRegistrationError` instead of exporting chunks that no longer back
the segments; `restore_kv_caches()` registers the current mapping.

Commit-ahead (extkv.ahead) and a registering connector do not mix: the
worker grows every segment past its committed blocks with chunks of its
own, so no registration stays whole for long. Registering (or restoring) a
cache with commit-ahead on raises `CommitAheadRegisteredError` and registers
nothing; turning it on after registering makes the next `export_to` refuse
as stale, naming commit-ahead. An engine turns it off (`commit_ahead(0)`)
and commits with `defragment=True` before it registers.

A peer does not decide the exporter's time: the whole send of one export
(header and descriptors) is over within `timeout` (DEFAULT_EXPORT_TIMEOUT_S
by default), however slowly the peer reads, or `export_to` raises
DeadlineExceededError naming the peer. What was sent by then is incomplete
and the socket mid-message: the caller closes it. The exported descriptors
are closed either way, and the connector stays registered for the next peer.
A peer that hangs up before the export is sent whole is a
`PeerDisconnectedError` naming it and what was being sent, with the same
cleanup; never SIGPIPE, even in a process that does not ignore it (every
send is MSG_NOSIGNAL). `export_to` returns once the kernel took every byte
and descriptor: whether the peer imports them is for its reply to say.

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
  carries no access mode: the header says `"writable": false` and extkv's
  peer grants itself read access only (`cuMemSetAccess(PROT_READ)`), but the
  exporter cannot enforce that on another peer: CUDA exports are as trusted
  as the peer.
"""

from __future__ import annotations

import enum
import os
import socket
import tempfile
from dataclasses import dataclass
from typing import Iterable, Protocol, Sequence, runtime_checkable

from . import validate
from .cache import ExtensibleKVCache
from .deferred_signals import deferred_signals
from .errors import DeadlineExceededError, ExtkvError, StateError
from .layout import KVCacheConfig
from .tensor import ExtensibleTensor, MappedChunk
from .vmm import Driver
from .wire import (
    Deadline,
    ExportHeader,
    SegmentPlacement,
    close_all,
    close_each,
    peer_credentials,
    send_fds,
    send_message,
)

#: Seconds one export may take to send, header and descriptors. A peer that
#: reads takes them at once: only one that stopped reading meets this.
DEFAULT_EXPORT_TIMEOUT_S = 60.0


class SegmentNotContiguousError(ExtkvError, ValueError):
    """A segment's committed bytes span several physical chunks, so it cannot
    be registered as one range."""


class CommitAheadRegisteredError(StateError):
    """A cache with commit-ahead on was given to a registering connector."""


class StaleRegistrationError(StateError):
    """The cache's memory changed since it was registered."""


class PeerRefusedError(ExtkvError, PermissionError):
    """The process at the other end of the socket is not allowed to receive
    the export."""


class PeerDisconnectedError(ExtkvError, ConnectionError):
    """The process at the other end of the socket hung up before the export
    was sent whole."""


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
        _refuse_commit_ahead("register_kv_caches", kv_cache)
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
        _refuse_commit_ahead("restore_kv_caches", self._kv_cache)
        self._registrations = _segment_registrations(self._kv_cache.buffer)
        self._state = _State.REGISTERED

    def close(self) -> None:
        """Forget the cache and any registration. Idempotent. Exported
        descriptors are never kept, so there is nothing else to release."""
        self._require("close")
        self._registrations = []
        self._kv_cache = None
        self._state = _State.CLOSED

    def export_to(self, sock: socket.socket, *, timeout: float | None = DEFAULT_EXPORT_TIMEOUT_S) -> None:
        """Send the registered segments to the process at the other end of
        `sock` (a connected AF_UNIX stream socket): the header, then one
        exported descriptor per distinct chunk, read-only unless
        `writable_exports`. The descriptors exported here are closed before
        returning, whether or not sending succeeded.

        The whole send is over within `timeout` seconds, however slowly the
        peer reads (DeadlineExceededError, a TimeoutError, naming the peer and
        how far it got: close the socket, which is left mid-message). None
        sets no limit of its own: each wait is then bounded by the socket's
        timeout, if it has one; inf is None. The socket's timeout is restored
        afterwards.

        Raises `PeerRefusedError`, having sent nothing, when the peer's
        credentials are not allowed, and `PeerDisconnectedError` (a
        ConnectionError) naming the peer when it hangs up before everything
        was sent.
        """
        self._require("export_to")
        if sock.family != socket.AF_UNIX:
            raise ValueError(f"export_to needs an AF_UNIX socket to pass file descriptors, got family {sock.family!r}")
        timeout = validate.timeout("timeout", timeout)
        pid, uid, _ = self._check_peer(sock)
        assert self._kv_cache is not None
        buffer = self._kv_cache.buffer
        driver = buffer.driver
        fds: list[int] = []
        try:
            # Held while checking and exporting, so that no other thread's
            # commit remaps the segments in between; not while the peer reads.
            # Signal handlers deferred too: an interrupt between an export
            # and its record would leak the descriptor.
            with deferred_signals(), buffer.lock:
                self._check_current(buffer)
                header, chunks = _export_header(driver, self._registrations, self.writable_exports)
                for mapped in chunks:
                    fds.append(driver.export_fd(mapped.chunk, writable=self.writable_exports))
            # From the first byte sent: waiting for the lock is no peer's doing.
            deadline = None if timeout is None else Deadline(timeout, f"export_to the peer (pid {pid}, uid {uid})")
            previous = sock.gettimeout()
            sending = "the header"
            try:
                send_message(sock, header.to_message(), deadline=deadline, what="the header")
                sending = f"the {len(fds)} descriptor(s)"
                send_fds(sock, fds, deadline=deadline)
            except ConnectionError as error:  # EPIPE, ECONNRESET, or the wire's own
                raise PeerDisconnectedError(
                    f"export_to: the peer (pid {pid}, uid {uid}) hung up while {sending} was being sent "
                    f"({type(error).__name__}: {error}); the export is incomplete (the connector stays registered "
                    "for the next peer)"
                ) from None
            except DeadlineExceededError as error:
                raise DeadlineExceededError(
                    f"{error}; the peer does not read what it is sent: the export is incomplete and the socket "
                    "mid-message, close it (the connector stays registered for the next peer)"
                ) from None
            finally:
                sock.settimeout(previous)
        finally:
            try:
                close_all(fds)
            finally:
                close_each(fds)  # left open only by an interrupt on the way into close_all

    def _check_peer(self, sock: socket.socket) -> tuple[int, int, int]:
        """The peer's (pid, uid, gid), once they are allowed."""
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
        return pid, uid, gid

    def _check_current(self, buffer: ExtensibleTensor) -> None:
        """Refuse a registration whose chunks no longer back the segments."""
        if buffer.is_freed:
            raise StaleRegistrationError("the registered KV cache was freed; register a live cache")
        if buffer.is_inherited:
            raise StaleRegistrationError(
                "the registered KV cache is a forked child's copy: its memory is the parent's and not mapped here; "
                "export from the process that made it"
            )
        if buffer.is_broken:
            raise StaleRegistrationError(
                "the registered KV cache is broken (a failed step's undo failed: its chunks are no longer known to "
                "back its segments); free it and register a new cache"
            )
        live = {id(mapped) for mapped in buffer.mapped_chunks}
        gone = [r.index for r in self._registrations if r.mapped_chunk is not None and id(r.mapped_chunk) not in live]
        sizes = buffer.segment_sizes
        resized = [r.index for r in self._registrations if sizes[r.index] != r.committed_bytes]
        if gone or resized:
            window = self._kv_cache.commit_ahead_window if self._kv_cache is not None else 0
            why = (f"commit-ahead is on (window {window} blocks) and grows them past what was registered; turn it off "
                   "(commit_ahead(0)), commit with defragment=True and " if window else
                   "they were released, remapped or resized; call ")
            raise StaleRegistrationError(
                f"the KV cache's memory changed since register_kv_caches (segments {sorted(set(gone + resized))}): "
                f"{why}restore_kv_caches() to register the current mapping"
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


def _refuse_commit_ahead(operation: str, kv_cache: ExtensibleKVCache) -> None:
    if kv_cache.commit_ahead_window:
        raise CommitAheadRegisteredError(
            f"{operation}: commit-ahead is on (window {kv_cache.commit_ahead_window} blocks); its worker grows every "
            "segment with chunks of its own, which no registration covers: turn it off (commit_ahead(0)) and commit "
            "with defragment=True first; nothing was registered"
        )


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
    registrations = []
    for index, (offset, size) in enumerate(zip(buffer.segment_offsets, sizes)):
        address = buffer.base + offset
        if size == 0:
            registrations.append(SegmentRegistration(index, address, 0, None, 0))
            continue
        owner = buffer.mapped_chunk_at(address)
        registrations.append(SegmentRegistration(index, address, size, owner, address - owner.address))
    return registrations


def _export_header(
    driver: Driver, registrations: Sequence[SegmentRegistration], writable: bool
) -> tuple[ExportHeader, list[MappedChunk]]:
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
        segments.append(SegmentPlacement(index, registration.offset_in_chunk, registration.committed_bytes))
    header = ExportHeader.describing(driver, [mapped.chunk.size for mapped in chunks], segments, writable)
    return header, chunks
