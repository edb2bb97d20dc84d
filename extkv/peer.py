"""The peer of `SegmentExportConnector`: map another process's KV cache segments.

Theory of operation
-------------------
`import_segments(sock)` receives what `SegmentExportConnector.export_to`
sends (the format is extkv.wire's): a header, then one file descriptor per
chunk. It imports each chunk with the driver for the device the header
names, maps the chunks back to back in one fresh reservation, grants access
over it and exposes a uint8 view of each segment's committed bytes, in
`ImportedSegments`. The import is one `Transaction`: a failing step undoes
the earlier ones, and the received descriptors are closed whatever happens.
`ImportedSegments.close()` unmaps, releases and frees everything; a chunk the
driver refuses to release is kept and retried by the next `close()`.

Access follows the export: a host descriptor of a read-only export can only
be mapped read-only, and on CUDA, where a descriptor carries no access mode,
this peer grants itself read access only unless the header says writable.

What arrives comes from another process and is checked before it is used:
the whole import is over within `timeout` seconds (DEFAULT_PEER_TIMEOUT_S by
default) however the exporter paces its bytes, the header is at most
wire.MAX_HEADER_BYTES and validated field by field (extkv.wire), and a host
descriptor must be a sealed memfd (a regular file is refused: its owner
could truncate it under the mapping).

The exporter's word does not decide this process's memory. Before any
descriptor is received, the chunks' sizes together, and the segments'
committed bytes together (what `digests()` reads), must each be at most
`max_bytes`: by default the importing device's total memory
(`Driver.memory_info()`), since no export of physical memory is larger;
a caller that knows what to expect passes less. A host memfd must have
every page allocated (`st_blocks`), as each extkv chunk has from its
creation: reading a sparse one would allocate its holes here, as much as it
announces. An exporter that punches holes after the import can still do
that, up to `max_bytes`.

Nor does it decide this process's time. `digests(timeout=)` is over within
its timeout: segments are hashed DIGEST_PIECE_BYTES at a time (copied to the
host piece by piece from a GPU, so a digest takes that much host memory
whatever the segments' size), and the deadline is checked between pieces.

`run_peer(path)` is the whole peer as a process (`extkv peer --peer PATH`):
connect, import, answer with the sha256 of each segment's committed bytes,
clean up, all of it within one `timeout`. A failure is answered with
`error_reply`, which names the error's type and what failed, never an
address of this process.
"""

from __future__ import annotations

import ctypes
import hashlib
import socket

import torch

from . import validate
from .deferred_signals import deferred_signals, run_deferred
from .errors import DriverError, StateError
from .vmm import Chunk, Driver, Transaction, UnreleasedChunks, driver_for_import
from .wire import (
    MAX_HEADER_BYTES,
    Deadline,
    ExportHeader,
    close_all,
    close_each as _close_each,
    receive_fds,
    receive_message,
    send_message,
)

#: Seconds one import may take (`import_segments`), and the whole peer
#: (`run_peer`: connect, import, digests, reply).
DEFAULT_PEER_TIMEOUT_S = 120.0
#: Bytes hashed at a time; from a GPU, the host memory a digest takes.
DIGEST_PIECE_BYTES = 64 << 20
#: How long a failed peer tries to tell the exporter why: a few hundred
#: bytes, which a live exporter's socket takes at once.
_ERROR_REPLY_WAIT_S = 1.0


def sha256_hex(tensor: torch.Tensor, *, deadline: Deadline | None = None, name: str = "the tensor") -> str:
    """sha256 (hex) of a tensor's bytes in logical order, on any device,
    hashed DIGEST_PIECE_BYTES at a time; with a `deadline`, checked before
    each piece (DeadlineExceededError naming `name` and how far it got)."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    total = flat.numel()
    hasher = hashlib.sha256()
    for start in range(0, total, DIGEST_PIECE_BYTES):
        if deadline is not None:
            deadline.left(f"hashed {start} of the {total} bytes of {name}")
        # A view of host memory; from a GPU, a copy of this piece only.
        piece = flat[start : start + DIGEST_PIECE_BYTES].cpu()
        # Hashed in place through the buffer protocol: no numpy, no extra
        # copy. `piece` stays referenced until hashing is done.
        hasher.update((ctypes.c_ubyte * piece.numel()).from_address(piece.data_ptr()))
    return hasher.hexdigest()


class ImportedSegments:
    """Segments another process exported, mapped into this one.

    `views[i]` is a uint8 tensor over segment i's committed bytes (empty where
    none are committed); write through them only when `writable`. `close()`
    unmaps and releases everything; the views must not be used afterwards.
    """

    def __init__(
        self,
        driver: Driver,
        reservation: int | None,
        reserved_bytes: int,
        mapped: list[tuple[int, Chunk]],
        unreleased: UnreleasedChunks,
        writable: bool,
    ):
        self.driver = driver
        #: Whether the exporter allowed writing. Host mappings of a read-only
        #: export are read-only: writing through `views` faults.
        self.writable = writable
        self.views: list[torch.Tensor] = []
        self._reservation = reservation
        self._reserved_bytes = reserved_bytes
        self._mapped = mapped
        self._unreleased = unreleased
        self._closed = False

    @property
    def device(self) -> torch.device:
        return self.driver.device

    @property
    def closed(self) -> bool:
        """Whether `close()` has given everything back."""
        return self._closed

    @property
    def segment_sizes(self) -> list[int]:
        return [view.numel() for view in self.views]

    def digests(self, *, timeout: float | None = None) -> list[str]:
        """sha256 (hex) of each segment's committed bytes, all of them within
        `timeout` seconds (None or inf: no limit), or DeadlineExceededError."""
        self._require_open("digests")
        return self._digests(Deadline(validate.timeout("timeout", timeout), "digests()"))

    def _digests(self, deadline: Deadline) -> list[str]:
        return [sha256_hex(view, deadline=deadline, name=f"segment {i}") for i, view in enumerate(self.views)]

    def close(self) -> None:
        """Unmap, release and free everything, signal handlers deferred (an
        unmap and its record are one step). Idempotent; if a driver step
        fails, what was undone stays undone and a retry continues."""
        run_deferred(self._close)

    def _close(self) -> None:
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
            self._unreleased.release(chunk)
        self._unreleased.retry()
        if self._reservation is not None:
            driver.free_reservation(self._reservation, self._reserved_bytes)
            self._reservation = None
        self._closed = True

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
    sock: socket.socket,
    *,
    driver: Driver | None = None,
    timeout: float | None = DEFAULT_PEER_TIMEOUT_S,
    max_bytes: int | None = None,
) -> ImportedSegments:
    """Receive what `SegmentExportConnector.export_to` sends on the other end
    of `sock` and map it here.

    `max_bytes` caps what the export may announce, for its chunks together
    and for its segments' committed bytes together (None: the importing
    device's total memory); a header that announces more is refused with a
    ValueError naming both numbers, before any descriptor is received.

    `driver` overrides the driver chosen from the header (a fault injector in
    tests); it must be of the exporter's kind and granularity. The header and
    the descriptors must all have arrived within `timeout` seconds, however
    the exporter paces them (DeadlineExceededError, a TimeoutError, naming
    how far they got; None or inf waits forever); the socket's own timeout
    is restored afterwards. The received descriptors are closed before this
    returns, on success or failure.
    """
    if not isinstance(sock, socket.socket) or sock.family != socket.AF_UNIX:
        raise ValueError(f"import_segments needs a connected AF_UNIX socket to receive file descriptors, got {sock!r}")
    if driver is not None and not isinstance(driver, Driver):
        raise ValueError(f"driver must be an extkv Driver or None, got {driver!r}")
    timeout = validate.timeout("timeout", timeout)
    if max_bytes is not None:
        max_bytes = validate.integer("max_bytes", max_bytes, what="bytes an import may announce")
    return _import(sock, driver, Deadline(timeout, "import_segments (receiving the export)"), max_bytes)


def _import(sock: socket.socket, driver: Driver | None, deadline: Deadline, max_bytes: int | None) -> ImportedSegments:
    fds: list[int] = []  # the received descriptors, this function's to close
    try:
        previous = sock.gettimeout()
        try:
            message = receive_message(sock, max_bytes=MAX_HEADER_BYTES, deadline=deadline, what="the header")
            header = ExportHeader.from_message(message)
            driver = driver_for_import(header.driver_kind, header.granularity, header.device, driver)
            _check_announced_bytes(header, driver, max_bytes)
            receive_fds(sock, len(header.chunk_sizes), fds, deadline=deadline)
        finally:
            sock.settimeout(previous)
    except BaseException:
        try:
            close_all(fds)
        finally:
            _close_each(fds)  # left open only by an interrupt on the way into close_all
        raise
    # Mapping waits for no one: signal handlers are deferred over it and the
    # closing of the received descriptors, so none raises between an
    # import's step and its undo. Nothing runs between the import and the
    # return that could raise and drop it; a handler that raises at the
    # deferral's end closes it, since the caller never gets it.
    imported = None
    try:
        with deferred_signals():
            try:
                imported = _map_imported(driver, fds, header)
            finally:
                _close_each(fds)
        return imported
    except BaseException:
        close_all(fds)  # where the deferral's entry itself was interrupted
        if imported is not None:
            imported.close()
        raise


def _check_announced_bytes(header: ExportHeader, driver: Driver, max_bytes: int | None) -> None:
    """Refuse a header that announces more than `max_bytes` (None: the
    device's total memory) of chunks, or of committed bytes to read."""
    if max_bytes is None:
        cap, source = driver.memory_info()[1], f"max_bytes=None: the total memory of {driver.device}"
    else:
        cap, source = max_bytes, f"max_bytes={max_bytes}"
    chunk_bytes = sum(header.chunk_sizes)
    # Segments may overlap in one chunk: each overlap is read again.
    segment_bytes = sum(segment.committed_bytes for segment in header.segments)
    if chunk_bytes > cap or segment_bytes > cap:
        raise ValueError(
            f"the export announces {chunk_bytes} bytes in {len(header.chunk_sizes)} chunk(s) and {segment_bytes} "
            f"committed bytes in {len(header.segments)} segment(s), more than the {cap} bytes this import accepts "
            f"of either ({source}); no descriptor was received"
        )


def _map_imported(driver: Driver, fds: list[int], header: ExportHeader) -> ImportedSegments:
    """Import each chunk and map them back to back in one reservation: one
    transaction, each step undone if a later one fails."""
    granule = driver.granularity
    placements, reserved_bytes = [], 0
    for size in header.chunk_sizes:
        placements.append(reserved_bytes)
        reserved_bytes += -(-size // granule) * granule
    reservation: int | None = None
    mapped: list[tuple[int, Chunk]] = []
    unreleased = UnreleasedChunks(driver)
    if header.chunk_sizes:
        with Transaction() as transaction:
            reservation = driver.reserve(reserved_bytes)
            transaction.push(driver.free_reservation, reservation, reserved_bytes)
            for index, (fd, size, placement) in enumerate(zip(fds, header.chunk_sizes, placements)):
                chunk = driver.import_fd(fd, size)
                transaction.push(unreleased.release, chunk)
                driver.refuse_partly_backed(fd, f"chunk {index}")
                address = reservation + placement
                driver.map(address, chunk)
                transaction.push(driver.unmap, address, size)
                mapped.append((address, chunk))
            # Chunk sizes are granule multiples, so the chunks tile the whole
            # reservation: one access call covers them all. The host driver
            # grants read-only access over read-only descriptors.
            driver.set_access(reservation, reserved_bytes, writable=header.writable)
    imported = ImportedSegments(driver, reservation, reserved_bytes, mapped, unreleased, header.writable)
    try:
        imported.views = [
            torch.empty(0, dtype=torch.uint8, device=driver.device)
            if chunk is None
            else driver.view(reservation + placements[chunk] + offset, size)
            for chunk, offset, size in header.segments
        ]
    except BaseException:
        imported.close()
        raise
    return imported


def run_peer(socket_path: str, timeout: float = DEFAULT_PEER_TIMEOUT_S, *, max_bytes: int | None = None) -> None:
    """Connect to an exporter listening at `socket_path`, import its segments,
    answer with their sha256 digests, and clean up. On failure the exporter is
    told why before the error propagates. `timeout` and `max_bytes` are as
    `import_segments` takes them."""
    timeout = validate.timeout("timeout", timeout)
    if max_bytes is not None:
        validate.integer("max_bytes", max_bytes, what="bytes an import may announce")
    # One deadline for all of it: an exporter that paces its bytes, or
    # announces much to hash, keeps this process no longer.
    deadline = Deadline(timeout, f"the peer of {socket_path}")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(deadline.left("connecting"))
        sock.connect(socket_path)
        try:
            with _import(sock, None, deadline, max_bytes) as imported:
                digests = imported._digests(deadline)
            sock.settimeout(deadline.left("replying"))
        except Exception as error:
            sock.settimeout(_ERROR_REPLY_WAIT_S)
            try:
                send_message(sock, {"error": error_reply(error)})
            except OSError:
                pass  # the exporter is gone or not reading; the original error is what matters
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
