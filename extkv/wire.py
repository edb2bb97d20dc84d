"""The wire format between `SegmentExportConnector` and its peer.

Theory of operation
-------------------
One connection of a Unix stream socket carries one export. A message is an
8-byte big-endian length and that many bytes of UTF-8 JSON holding one object.
The exporter sends the header message, then one file descriptor per chunk
(SCM_RIGHTS), in batches of at most MAX_FDS_PER_MESSAGE (the kernel's
SCM_MAX_FD), each batch on one byte of its own. The peer answers with one
message: `{"digests": [...]}` (sha256 of each segment's committed bytes, in
segment order) or `{"error": "..."}`.

The header (`ExportHeader`) describes what the descriptors hold:

- `protocol`: PROTOCOL; a peer refuses any other.
- `driver`, `granularity`: the kind of driver that exported the chunks
  ("host" or "cuda") and its granularity; the peer imports with the same.
- `device`: `{"type", "index", "uuid"}` of the exporter's device. A GPU's
  UUID names it in every process, whatever CUDA_VISIBLE_DEVICES renumbers.
- `writable`: whether the descriptors allow writing.
- `chunks`: `[{"size": bytes}]`, in the order the descriptors follow.
- `segments`: one `{"chunk", "offset_in_chunk", "committed_bytes"}` per
  segment, `chunk` indexing `chunks` (null when nothing is committed).

What arrives comes from another process and is checked before it is used:
a message is at most `max_bytes` of JSON (MAX_MESSAGE_BYTES unless the
reader says less; a peer reads a header of MAX_HEADER_BYTES at most),
refused on its length prefix before a byte of it is read, and received at
most _RECEIVE_PIECE_BYTES at a time, so that memory follows what arrives,
never what the prefix announces. It must not nest deeper than the parser
can go, every geometry field of a header is validated, and reading stops
exactly at the byte that carries descriptors, since a read past it would
make the kernel drop them.

Waits are bounded in one of two ways. Given a `Deadline`, a function waits
for each send or recv only as long as the deadline leaves, so the whole
exchange, however the other side paces its reading or its bytes (one every
second keeps every single wait short), is over by then or raises
DeadlineExceededError naming how far it got; the exporter sends under one
and so does the peer receive. Without one, each wait is bounded by the
socket's own timeout, which the caller sets. Every send is MSG_NOSIGNAL: a
peer that hung up is an EPIPE error, never a SIGPIPE that kills a process
which does not ignore it.

The exporter (extkv.connector) and the peer (extkv.peer) both build on this
module; neither imports the other. So does the shared KV budget
(extkv.budget), whose daemon reads many connections from one selectors
loop and cannot wait on any one of them: it frames its replies with
`encode_message` and takes what arrives into a `MessageBuffer`, which
applies the same bounds and checks as `receive_message`, piece by piece.

Both servers read who connected from the kernel (`peer_credentials`,
SO_PEERCRED), and listen in a directory only their uid can reach
(extkv.files.private_directory), or any local user could connect first or
put a file of their own at the socket's path.

This module imports no torch (the driver is a type here only), so the
budget daemon starts without it.
"""

from __future__ import annotations

import array
import json
import os
import socket
import struct
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Sequence

from . import validate
from .deferred_signals import deferred_signals, run_deferred
from .errors import DeadlineExceededError

if TYPE_CHECKING:
    from .vmm import Driver

#: Names the wire format; a peer refuses any other.
PROTOCOL = "extkv-segments/2"
#: Linux refuses more descriptors than this in one SCM_RIGHTS message.
MAX_FDS_PER_MESSAGE = 253
#: A header is a few hundred bytes per segment; anything near this is garbage.
MAX_MESSAGE_BYTES = 64 << 20
#: The most a peer reads of a header: about 20 bytes per chunk and 70 per
#: segment, so room for tens of thousands of segments. Parsed, JSON takes
#: several times its size in Python objects.
MAX_HEADER_BYTES = 4 << 20
#: A message is received at most this many bytes at a time: `recv(n)`
#: allocates n bytes before any arrives.
_RECEIVE_PIECE_BYTES = 1 << 20
#: The longest one wait put on a socket: its timeout refuses more than about
#: 9.2e9 s (OverflowError), and 31 years are as good as forever.
LONGEST_WAIT_S = 1e9
_LENGTH = struct.Struct(">Q")


class SegmentPlacement(NamedTuple):
    """Where one segment's `committed_bytes` lie: `offset_in_chunk` bytes into
    the header's chunk number `chunk` (None when nothing is committed)."""

    chunk: int | None
    offset_in_chunk: int
    committed_bytes: int


@dataclass(frozen=True)
class ExportHeader:
    """The header message, as the exporter describes it and the peer reads it.

    `driver_kind`, `granularity` and `device` are passed on as sent: only the
    peer, choosing its driver, can tell whether they fit.
    """

    driver_kind: str
    granularity: int
    device: dict
    writable: bool
    chunk_sizes: list[int]
    segments: list[SegmentPlacement]

    @classmethod
    def describing(
        cls, driver: Driver, chunk_sizes: list[int], segments: list[SegmentPlacement], writable: bool
    ) -> "ExportHeader":
        """The header for chunks of `driver`."""
        return cls(
            driver_kind=driver.kind,
            granularity=driver.granularity,
            device=driver.device_identity(),
            writable=writable,
            chunk_sizes=chunk_sizes,
            segments=segments,
        )

    def to_message(self) -> dict:
        return {
            "protocol": PROTOCOL,
            "driver": self.driver_kind,
            "device": self.device,
            "granularity": self.granularity,
            "writable": self.writable,
            "chunks": [{"size": size} for size in self.chunk_sizes],
            "segments": [segment._asdict() for segment in self.segments],
        }

    @classmethod
    def from_message(cls, message: dict) -> "ExportHeader":
        """The header `message` carries, every geometry field checked
        (ValueError) before anything is imported."""
        if message.get("protocol") != PROTOCOL:
            raise ValueError(f"peer speaks protocol {message.get('protocol')!r}; expected {PROTOCOL!r}")

        def count(value, what: str) -> int:
            return validate.integer(f"header field {what}", value)

        try:
            writable = validate.flag("header field writable", message["writable"])
            chunk_sizes = [count(chunk["size"], f"chunks[{i}].size") for i, chunk in enumerate(message["chunks"])]
            segments = []
            for i, segment in enumerate(message["segments"]):
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
                segments.append(SegmentPlacement(chunk, offset, size))
            device = message.get("device") or {}
            if not isinstance(device, dict):
                raise TypeError(f"device is a {type(device).__name__}, not an object")
        except (KeyError, TypeError) as error:
            shown = repr(message)
            shown = shown if len(shown) <= 300 else f"{shown[:300]}... ({len(shown)} characters)"
            raise ValueError(f"malformed segment header ({type(error).__name__}: {error}): {shown}") from None
        return cls(
            driver_kind=message.get("driver"),
            granularity=message.get("granularity"),
            device=device,
            writable=writable,
            chunk_sizes=chunk_sizes,
            segments=segments,
        )


class Deadline:
    """When one whole exchange must be over: `seconds` after this is made
    (as `validate.timeout` returns them; None: never). `what` names the
    exchange in the DeadlineExceededError."""

    def __init__(self, seconds: float | None, what: str):
        self.seconds = seconds
        self.what = what
        self._end = None if seconds is None else time.monotonic() + seconds

    def left(self, progress: str = "") -> float | None:
        """The timeout for the next wait: what is left, or None for no limit;
        DeadlineExceededError (naming `progress`) once nothing is."""
        if self._end is None:
            return None
        left = self._end - time.monotonic()
        if left <= 0:
            raise self.exceeded(progress)
        return min(left, LONGEST_WAIT_S)

    def exceeded(self, progress: str = "") -> DeadlineExceededError:
        done = f" ({progress})" if progress else ""
        return DeadlineExceededError(f"{self.what} was not over within the {self.seconds:g} s allowed{done}")


def _wait(sock: socket.socket, deadline: Deadline | None, progress: str) -> None:
    """Give the next wait on `sock` what `deadline` leaves of it. Called
    before the `try` around that wait, so the TimeoutError caught there is
    the socket's, never the deadline's own."""
    if deadline is not None:
        sock.settimeout(deadline.left(progress))


# -- messages -------------------------------------------------------------------
def send_message(
    sock: socket.socket, message: dict, *, deadline: Deadline | None = None, what: str = "a message"
) -> None:
    """Send one length-prefixed JSON message; `deadline` and `what` are as
    `receive_message` takes them."""
    data = memoryview(encode_message(message))
    sent = 0
    while sent < len(data):
        progress = f"sent {sent} of the {len(data)} bytes of {what}"
        _wait(sock, deadline, progress)
        try:
            # MSG_NOSIGNAL: a peer that hung up is an EPIPE error here, never
            # a SIGPIPE that kills a process which does not ignore it.
            sent += sock.send(data[sent:], socket.MSG_NOSIGNAL)
        except TimeoutError:
            if deadline is None:
                raise
            raise deadline.exceeded(progress) from None


def receive_message(
    sock: socket.socket, *, max_bytes: int = MAX_MESSAGE_BYTES, deadline: Deadline | None = None, what: str = "a message"
) -> dict:
    """Receive one message sent by `send_message`: a ValueError, before any
    of it is read, when its length prefix announces more than `max_bytes`.
    With a `deadline`, each wait is given what it leaves, through the
    socket's timeout (the caller restores its own); `what` names the message
    in a DeadlineExceededError."""
    max_bytes = validate.integer("max_bytes", max_bytes)
    (length,) = _LENGTH.unpack(_receive_exactly(sock, _LENGTH.size, deadline, f"the length of {what}"))
    if length > max_bytes:
        raise ValueError(f"message of {length} bytes announced, more than the {max_bytes} allowed (max_bytes)")
    return decode_message(_receive_exactly(sock, length, deadline, what))


def encode_message(message: dict) -> bytes:
    """`message` as it goes on the wire: its length, then its JSON."""
    payload = json.dumps(message).encode()
    return _LENGTH.pack(len(payload)) + payload


def decode_message(payload: bytes) -> dict:
    """The object a message's JSON `payload` holds; ValueError naming what
    is wrong with it otherwise."""
    try:
        message = json.loads(payload)
    except ValueError as error:
        raise ValueError(f"message is not JSON: {error}") from None
    except RecursionError:
        raise ValueError(f"message of {len(payload)} bytes nests JSON arrays or objects too deeply to parse") from None
    if not isinstance(message, dict):
        raise ValueError(f"message must be a JSON object, got {type(message).__name__}")
    return message


class MessageBuffer:
    """Messages of one connection as they arrive in pieces, for a reader
    that cannot wait for the rest (a non-blocking socket in a selectors
    loop): `feed` what arrived, then take the whole messages one by one
    from `next_message()`. A length prefix that announces more than `max_bytes` is a
    ValueError as soon as it is whole, so what the buffer holds is at most
    one message, its prefix and the last piece fed."""

    def __init__(self, max_bytes: int = MAX_MESSAGE_BYTES):
        self.max_bytes = validate.integer("max_bytes", max_bytes)
        self._data = bytearray()

    def feed(self, data: bytes) -> None:
        self._data += data
        if len(self._data) >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(self._data)
            if length > self.max_bytes:
                raise ValueError(f"message of {length} bytes announced, more than the {self.max_bytes} allowed (max_bytes)")

    def next_message(self) -> dict | None:
        """The first whole message fed so far, taken out of the buffer, or
        None until one is whole; ValueError where it is malformed or
        announces too much."""
        if len(self._data) < _LENGTH.size:
            return None
        (length,) = _LENGTH.unpack_from(self._data)
        if length > self.max_bytes:
            raise ValueError(f"message of {length} bytes announced, more than the {self.max_bytes} allowed (max_bytes)")
        end = _LENGTH.size + length
        if len(self._data) < end:
            return None
        payload = bytes(self._data[_LENGTH.size : end])
        del self._data[:end]
        return decode_message(payload)

    @property
    def pending_bytes(self) -> int:
        """Bytes fed that are not yet part of a whole message."""
        return len(self._data)


def _receive_exactly(sock: socket.socket, count: int, deadline: Deadline | None, what: str) -> bytes:
    # Exactly `count` bytes and not one more: a plain recv that reached the
    # byte carrying descriptors would make the kernel drop them.
    received = bytearray()
    while len(received) < count:
        progress = f"received {len(received)} of the {count} bytes of {what}"
        _wait(sock, deadline, progress)
        try:
            part = sock.recv(min(count - len(received), _RECEIVE_PIECE_BYTES))
        except TimeoutError:
            if deadline is None:
                raise
            raise deadline.exceeded(progress) from None
        if not part:
            raise ConnectionError(f"connection closed after {len(received)} of {count} bytes")
        received += part
    return bytes(received)


# -- descriptors ----------------------------------------------------------------
def send_fds(sock: socket.socket, fds: Sequence[int], *, deadline: Deadline | None = None) -> None:
    """Send `fds` (still the caller's to close) in batches the kernel takes;
    `deadline` is as `receive_message` takes it."""
    for start in range(0, len(fds), MAX_FDS_PER_MESSAGE):
        batch = fds[start : start + MAX_FDS_PER_MESSAGE]
        progress = f"sent {start} of the {len(fds)} descriptors"
        _wait(sock, deadline, progress)
        try:
            sent = socket.send_fds(sock, [b"F"], batch, socket.MSG_NOSIGNAL)
        except TimeoutError:
            if deadline is None:
                raise
            raise deadline.exceeded(progress) from None
        if sent != 1:
            raise ConnectionError(f"sending descriptors {start}..{start + len(batch) - 1} failed")


def receive_fds(sock: socket.socket, count: int, fds: list[int], *, deadline: Deadline | None = None) -> None:
    """Receive `count` descriptors sent by `send_fds` into `fds`, which the
    caller owns and closes, on success or failure: a descriptor is in it
    from the moment the kernel hands it over, with signal handlers deferred
    in between, so no interrupt can drop one. `deadline` is as
    `receive_message` takes it."""
    wanted = len(fds) + count
    while len(fds) < wanted:
        expected = min(MAX_FDS_PER_MESSAGE, wanted - len(fds))
        progress = f"received {count - (wanted - len(fds))} of the {count} descriptors"
        _wait(sock, deadline, progress)
        with deferred_signals():
            try:
                data, ancillary, flags, _ = sock.recvmsg(
                    1, socket.CMSG_SPACE(expected * array.array("i").itemsize), socket.MSG_CMSG_CLOEXEC
                )
            except TimeoutError:
                if deadline is None:
                    raise
                raise deadline.exceeded(progress) from None
            batch = array.array("i")
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    batch.frombytes(payload[: len(payload) - len(payload) % batch.itemsize])
            fds.extend(batch)
        if not data:
            raise ConnectionError(f"connection closed after {count - (wanted - len(fds))} of {count} descriptors")
        if flags & socket.MSG_CTRUNC or len(batch) != expected:
            raise ConnectionError(f"expected {expected} descriptors in one message, received {len(batch)}")


def close_all(fds: list[int]) -> None:
    """Close every descriptor of `fds` and empty it, signal handlers
    deferred, so that an interrupt cannot leave some open. One on the way
    in (this call's first instruction, or its run_deferred's) raises before
    any is closed, as at the entry of any Python call: where they must be
    closed whatever happens, follow it with `close_each` in a `finally`."""
    run_deferred(close_each, fds)


def close_each(fds: list[int]) -> None:
    """Close every descriptor of `fds` and empty it (see `close_all`)."""
    while fds:
        os.close(fds.pop())


# -- Unix socket conventions ----------------------------------------------------
def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected AF_UNIX
    socket, as the kernel recorded them when it connected (SO_PEERCRED)."""
    ucred = struct.Struct("3i")
    return ucred.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, ucred.size))
