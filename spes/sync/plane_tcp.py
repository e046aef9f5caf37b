"""The raw-TCP data plane, both ends: tensor payloads over a plain (or TLS) socket, gRPC staying the control plane.

gRPC-Python copies every message several times, which caps a round far below what the network can move.
Here a tensor is one small `TensorHeader` frame, exactly `num_bytes` raw little-endian bytes and their
XXH3-64 as 8 bytes (`write_raw`), sent straight from the tensor's memory and received with `recv_into`
straight into a buffer sized by the *receiver's* manifest (`TensorDecoder.feed_raw`: the same header checks
as the gRPC path, done before a byte of payload is read, checksum verified after). Nothing received is ever
unpickled.

A connection carries one operation, opened by the preamble (`MAGIC`, the protocol version) and a `DataHello`;
the server answers with `DataReply` frames (protos/spes.proto, "The raw-TCP data plane", has the exchanges).
A control frame is a 4-byte little-endian length and one serialized message of at most `MAX_FRAME_BYTES`
(`SERVER_MAX_FRAME_BYTES` for what the server reads). A refusal is a `DataError` (gRPC status name, spes-reason,
message), so the client's retry/re-join/catch-up logic treats both planes alike (`spes.sync.protocol.Reason`).
A preamble of another version is refused naming both versions; a peer of version 3 or older gets the refusal
as the JSON error frame it reads (`LEGACY_JSON_VERSION`).

The server's end is `DataHandler` (one operation per connection, over the `Coordinator`, accepted by
`DataPlaneListener`); the client's is `TcpPlane` (`spes.sync.plane.Plane`).

Every wait (a socket's timeout on each receive and each send, the server's handshake deadline) counts only the time
this process ran (`unstalled`, on `Stalls.awake`): a server frozen past them would otherwise wake to close the
connections of peers that were fine.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import select
import socket
import ssl
import struct
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, TypeVar

import grpc
import torch
from google.protobuf.message import DecodeError, Message

from spes.sync.admission import PendingSlots, Ticket
from spes.sync.auth import WRONG_TOKEN, tls_common_name, token_matches
from spes.sync.channel import KEEPALIVE_S, KEEPALIVE_TIMEOUT_S
from spes.sync.fragments import WHOLE
from spes.sync.proto import spes_pb2 as pb
from spes.sync.protocol import (
    PROBE_CHUNK_BYTES,
    PROBE_MAX_BYTES,
    PROTOCOL_VERSION,
    Reason,
    Refused,
    SyncError,
    Tensors,
    classify,
    version_refusal,
)
from spes.sync.stalls import STALLS
from spes.sync.throttle import ThrottledLog
from spes.sync.wire import (
    DIGEST,
    Encoded,
    Item,
    TensorDecoder,
    header_for,
    write_raw,
)

if TYPE_CHECKING:
    from spes.sync.coordinator import Coordinator

log = logging.getLogger("spes.transport")

MAGIC = b"SPES"
VERSION = PROTOCOL_VERSION
LEGACY_JSON_VERSION = 3
"""The last protocol version whose control frames were JSON objects: a peer of it is refused in JSON."""
MAX_FRAME_BYTES = 16 << 20
_LENGTH = struct.Struct("<I")
_PREAMBLE = struct.Struct("<4sH")
_RECV_PIECE = 8 << 20
SERVER_MAX_FRAME_BYTES = 1 << 20
"""Largest control frame the server reads (a hello or a tensor header: a few hundred bytes)."""
M = TypeVar("M", bound=Message)
T = TypeVar("T")


class TransportError(ConnectionError):
    """The other end broke the framing or went away: the connection is unusable, a new one may succeed."""


class FrameError(ValueError):
    """A control frame of the right length that is not the message expected (another protocol, or damage)."""


class WrongVersion(TransportError):
    """A client's preamble names another protocol version (refused with `version_refusal`, then closed)."""

    def __init__(self, version: int) -> None:
        super().__init__(f"a data-plane client of protocol v{version} (this server speaks v{VERSION})")
        self.version = version


# -- waits --------------------------------------------------------------------------------------------------------
def unstalled(wait: Callable[[float], T], timeout_s: float) -> T:
    """`wait(seconds)`, a wait that raises TimeoutError once `seconds` have passed, bounded by `timeout_s` of the time
    this process ran (`Stalls.awake` of its `STALLS`) rather than of the wall clock: a wait that times out is tried
    again for what is left of `timeout_s` on that clock.

    Why: a server frozen (SIGSTOP, a paused VM) past a connection's timeout wakes to find it expired, and would close
    a download it was sending, an upload mid-flight or a connection in its handshake, blaming a peer that was fine:
    only the server was away. Every data-plane wait that ends a connection goes through here (a socket's through
    `_on_socket`); a peer really silent that long still times out once the process has run `timeout_s`."""
    stalls = STALLS.watch()
    start, left = stalls.awake(), timeout_s
    while True:
        try:
            return wait(left)
        except TimeoutError:
            left = timeout_s - (stalls.awake() - start)
            if left <= 0:
                raise


def _on_socket(sock: socket.socket, call: Callable[[], T]) -> T:
    """`call()`, one blocking call on `sock` (a `recv_into`, a `send`: on a timeout it moved nothing, so it can be
    made again), bounded by the socket's timeout on the awake clock (`unstalled`)."""
    timeout = sock.gettimeout()
    if not timeout:  # blocking, or non-blocking: no timeout to keep
        return call()

    def attempt(left: float) -> T:
        if left < timeout:
            sock.settimeout(left)
        return call()

    try:
        return unstalled(attempt, timeout)
    finally:
        if sock.gettimeout() != timeout:
            sock.settimeout(timeout)


# -- frames -------------------------------------------------------------------------------------------------------
def recv_exactly(sock: socket.socket, buf: memoryview) -> None:
    """Fill `buf` from the socket (each `recv_into` bounded by the socket's timeout, `_on_socket`); EOF is a
    TransportError."""
    filled = 0
    while filled < len(buf):
        got = _on_socket(sock, functools.partial(sock.recv_into, buf[filled : filled + _RECV_PIECE]))
        if got == 0:
            raise TransportError(f"connection closed after {filled} of {len(buf)} bytes")
        filled += got


def send_all(sock: socket.socket, data: bytes | memoryview) -> None:
    """`sock.sendall(data)`, but the socket's timeout bounds each wait for the other end to take more bytes
    (`_on_socket`), as it bounds each receive, not the whole send: `sendall` gave up on a large tensor a peer kept
    reading once the server had been frozen past the timeout while sending it."""
    view = memoryview(data).cast("B")
    while view:
        view = view[_on_socket(sock, functools.partial(sock.send, view)) :]


def _send_bytes(sock: socket.socket, data: bytes) -> None:
    send_all(sock, _LENGTH.pack(len(data)) + data)


def send_frame(sock: socket.socket, message: Message) -> None:
    """One control frame: the message's length, then the message."""
    _send_bytes(sock, message.SerializeToString())


def recv_frame(sock: socket.socket, kind: type[M], limit: int = MAX_FRAME_BYTES) -> M:
    """One control frame as a `kind` message; its length is checked against `limit` before anything is allocated
    or read. TransportError when the length is past the limit or the connection ends, FrameError when the bytes
    are not a `kind` message."""
    head = bytearray(_LENGTH.size)
    recv_exactly(sock, memoryview(head))
    (length,) = _LENGTH.unpack(head)
    if length > limit:
        raise TransportError(f"control frame of {length} bytes exceeds the {limit}-byte limit")
    data = bytearray(length)
    recv_exactly(sock, memoryview(data))
    try:
        return kind.FromString(bytes(data))
    except DecodeError:
        raise FrameError(f"a control frame of {length} bytes is not a protocol v{VERSION} {kind.__name__}") from None


def recv_reply(sock: socket.socket, limit: int = MAX_FRAME_BYTES) -> pb.DataReply:
    """One of the server's `DataReply` frames."""
    return recv_frame(sock, pb.DataReply, limit)


def error_reply(code: str, message: str, reason: str = "") -> pb.DataReply:
    return pb.DataReply(error=pb.DataError(code=code, reason=reason, message=message))


def refusal_reply(exc: Refused) -> pb.DataReply:
    return error_reply(exc.code.name, str(exc), exc.reason)


def send_hello(sock: socket.socket, hello: pb.DataHello, version: int = VERSION) -> None:
    """The client's handshake: the preamble (`version` other than this protocol's only in tests), then `hello`."""
    send_all(sock, _PREAMBLE.pack(MAGIC, version))
    send_frame(sock, hello)


def recv_hello(sock: socket.socket, limit: int = MAX_FRAME_BYTES) -> pb.DataHello:
    """The client's handshake: magic and version first, so a stray connection is refused unread.

    TransportError for a stray connection (no magic), `WrongVersion` for a client of another protocol version,
    FrameError for a hello that is not a `DataHello`."""
    head = bytearray(_PREAMBLE.size)
    recv_exactly(sock, memoryview(head))
    magic, version = _PREAMBLE.unpack(head)
    if magic != MAGIC:
        raise TransportError(f"not a SPES data-plane client (magic {magic!r})")
    if version != VERSION:
        raise WrongVersion(version)
    return recv_frame(sock, pb.DataHello, limit)


def refuse_version(sock: socket.socket, version: int) -> None:
    """Refuse a client of another protocol version, naming both, in the framing it reads (JSON up to v3)."""
    refused = version_refusal("a data-plane client", version)
    if version > LEGACY_JSON_VERSION:
        close_after_error(sock, refusal_reply(refused))
        return
    legacy = {"status": "error", "code": refused.code.name, "reason": refused.reason.value, "message": str(refused)}
    close_after_error(sock, json.dumps(legacy).encode())


# -- tensors ------------------------------------------------------------------------------------------------------
def send_tensors(sock: socket.socket, tensors: Mapping[str, Item], wire_dtype: str) -> int:
    """Send every item (`send_tensor`); returns the payload bytes."""
    return sum(send_tensor(sock, name, item, wire_dtype) for name, item in tensors.items())


def send_tensor(sock: socket.socket, name: str, item: Item, wire_dtype: str, encoded: Encoded | None = None) -> int:
    """Send an item as a header frame (`header_for`: its checksum trails the payload, so the header's field stays
    0), its payload (zero-copy `send_all`) and checksum; returns payload bytes.

    `encoded` is its wire form and checksum computed once for several receivers (`EncodedModel`).
    """
    send_frame(sock, header_for(name, item, wire_dtype))
    return write_raw(item, wire_dtype, functools.partial(send_all, sock), encoded)


def framing_bytes(header: pb.TensorHeader) -> int:
    """Bytes the data plane adds to one tensor's payload: its header frame (length + message) and the trailer."""
    return _LENGTH.size + header.ByteSize() + DIGEST.size


def recv_tensors(
    sock: socket.socket,
    decoder: TensorDecoder,
    count: int,
    limit: int = MAX_FRAME_BYTES,
    moved: Callable[[int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Receive `count` tensors into `decoder`'s manifest-sized buffers; every header is checked before its payload
    (a header frame that is not a `TensorHeader` is a FrameError, a ValueError like every refused header).
    `moved(n)` is told of every piece received (a stream's progress)."""

    def read_into(buf: memoryview) -> None:
        recv_exactly(sock, buf)
        if moved is not None:
            moved(len(buf))

    for _ in range(count):
        decoder.feed_raw(recv_frame(sock, pb.TensorHeader, limit), read_into)
    return decoder.finish()


def peer_closed(sock: socket.socket) -> bool:
    """True when the client has hung up (readable with nothing to read); it sends nothing while it waits."""
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return False
    readable, _, _ = select.select([sock], [], [], 0)
    if not readable:
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except (BlockingIOError, ssl.SSLWantReadError):
        return False
    except OSError:
        return True


# -- link test (python -m spes.preflight) -------------------------------------------------------------------------


def send_zeros(sock: socket.socket, num_bytes: int) -> None:
    """Send `num_bytes` zero bytes (link-test payload)."""
    chunk = bytes(min(num_bytes, PROBE_CHUNK_BYTES))
    for offset in range(0, num_bytes, PROBE_CHUNK_BYTES):
        send_all(sock, memoryview(chunk)[: min(PROBE_CHUNK_BYTES, num_bytes - offset)])


def recv_discard(sock: socket.socket, num_bytes: int, moved: Callable[[int], None] | None = None) -> None:
    """Read and drop exactly `num_bytes` bytes (link-test payload); `moved(n)` is told of every piece."""
    sink = memoryview(bytearray(min(num_bytes, PROBE_CHUNK_BYTES)))
    while num_bytes > 0:
        piece = min(num_bytes, len(sink))
        recv_exactly(sock, sink[:piece])
        if moved is not None:
            moved(piece)
        num_bytes -= piece


def serve_probe(sock: socket.socket, hello: pb.DataHello, ticket: Ticket) -> None:
    """The server's side of a link test (the hello is already authenticated; `ticket` watches its rate)."""
    up, down = hello.up_bytes, hello.down_bytes
    if max(up, down) > PROBE_MAX_BYTES:
        message = f"a link test moves 0 to {PROBE_MAX_BYTES} bytes each way, got {up} up and {down} down"
        close_after_error(sock, error_reply("INVALID_ARGUMENT", message))
        return
    send_frame(sock, pb.DataReply(send=True))
    recv_discard(sock, up, ticket.moved)
    send_frame(sock, pb.DataReply(ok=True))
    send_zeros(sock, down)


def tune(sock: socket.socket) -> None:
    """No Nagle delay; TCP keepalive so a vanished other end is noticed within KEEPALIVE_S + KEEPALIVE_TIMEOUT_S."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):  # Linux
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_TIMEOUT_S // 2)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 2)


def connect(host: str, port: int, tls: ssl.SSLContext | None, timeout_s: float) -> socket.socket:
    """A data-plane connection (TLS-wrapped when `tls`), every blocking call bounded by `timeout_s`."""
    sock = socket.create_connection((host, port), timeout=timeout_s)
    tune(sock)
    if tls is None:
        return sock
    try:
        return tls.wrap_socket(sock, server_hostname=host)
    except BaseException:
        sock.close()
        raise


# -- the listener -------------------------------------------------------------------------------------------------
class DataPlaneListener:
    """Accepts data-plane connections on its own thread, one bounded handler thread per connection.

    A connection holds nothing but a pending slot until it is authenticated: at most `max_connections` pending
    ones (a quarter of them from one address, `PendingSlots`), each ended `handshake_s` (of the server's running
    time, `unstalled`) after it was accepted unless its handler has authenticated it by then (its TLS handshake and
    hello included, however slowly a client sends them). `handle(sock, authenticated)` owns the (TLS-wrapped) socket
    for one operation and enters `authenticated()` once the hello's token checks out: that trades the pending slot
    for one of `max_connections` operation slots (refused RESOURCE_EXHAUSTED, reason "busy", when none is free; the
    client retries, then falls back to gRPC). Every receive and send waits at most `io_timeout_s` of the server's
    running time for the other end; a connection that sends nothing for that long is answered DEADLINE_EXCEEDED and
    closed. `warn`: the server's throttled warnings (its own when not given).
    """

    def __init__(
        self,
        host: str,
        port: int,
        handle: Callable[[socket.socket, Callable[[], contextlib.AbstractContextManager[None]]], None],
        *,
        tls: ssl.SSLContext | None,
        max_connections: int,
        io_timeout_s: float,
        handshake_s: float = 10.0,
        warn: ThrottledLog | None = None,
    ) -> None:
        self._handle, self._tls, self._io_timeout_s, self._handshake_s = handle, tls, io_timeout_s, handshake_s
        self._pending = PendingSlots(max_connections)
        self._warn = warn or ThrottledLog(log)
        self._active = threading.BoundedSemaphore(max_connections)
        self._stopping = threading.Event()
        self._sock = socket.create_server((host, port), backlog=max_connections)
        self._sock.settimeout(0.2)
        self.port: int = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._accept_loop, name="spes-data-accept", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        failing = False
        while not self._stopping.is_set():
            try:
                conn, address = self._sock.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stopping.is_set():
                    return
                # NOTE: out of descriptors or buffers (EMFILE, ENFILE, ENOBUFS), or a connection gone before it was
                # accepted: the listener stays, and the kernel's backlog holds the next ones until it can accept
                if not failing:
                    log.warning("data plane: accept failed (%s): retrying every 0.1 s", exc)
                failing = True
                self._stopping.wait(0.1)
                continue
            failing = False
            conn.settimeout(self._io_timeout_s)
            tune(conn)
            if not self._pending.take(address[0]):
                self._refuse_busy(conn)
                continue
            threading.Thread(target=self._serve, args=(conn, address[0]), name="spes-data-conn", daemon=True).start()

    def _serve(self, conn: socket.socket, address: str) -> None:
        pending = [True]
        done = threading.Event()
        """Set once the handshake is over (authenticated, or the connection ended): its deadline is off."""

        @contextlib.contextmanager
        def authenticated() -> Iterator[None]:
            done.set()
            self._pending.release(address)
            pending[0] = False
            if not self._active.acquire(blocking=False):
                raise Refused(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, "too many data-plane operations: retry shortly", Reason.BUSY
                )
            try:
                yield
            finally:
                self._active.release()

        try:
            if self._tls is not None:  # NOTE: wrapped first (no I/O yet): the TLS socket takes over the descriptor
                conn = _tls_server_side(self._tls, conn)
            threading.Thread(
                target=_shut_unless, args=(conn, done, self._handshake_s), name="spes-data-handshake", daemon=True
            ).start()
            if isinstance(conn, ssl.SSLSocket):
                _on_socket(conn, conn.do_handshake)  # NOTE: a handshake that timed out resumes where it stopped
            self._handle(conn, authenticated)
        except TimeoutError:
            self._warn.warning(
                "idle connection",
                "data-plane connection idle for %g s: closed (--stream_idle_timeout)",
                self._io_timeout_s,
            )
            with contextlib.suppress(OSError):
                send_frame(
                    conn,
                    error_reply(
                        "DEADLINE_EXCEEDED",
                        f"nothing received for --stream_idle_timeout="
                        f"{self._io_timeout_s:g} s: connection closed, nothing it sent was kept",
                    ),
                )
        except (OSError, TransportError) as exc:
            self._warn.warning("dropped connection", "data-plane connection dropped: %s", exc)
        finally:
            done.set()
            conn.close()
            if pending[0]:
                self._pending.release(address)

    def _refuse_busy(self, conn: socket.socket) -> None:
        """Answer "busy" without a thread: a plain socket takes the short frame at once; a TLS one (whose
        handshake could stall) is closed, which the client also retries."""
        try:
            if self._tls is None:
                conn.settimeout(0.1)
                send_frame(
                    conn,
                    error_reply("RESOURCE_EXHAUSTED", "too many data-plane connections: retry shortly", Reason.BUSY),
                )
        except OSError:
            pass
        finally:
            conn.close()

    def stop(self) -> None:
        self._stopping.set()
        self._sock.close()
        self._thread.join(timeout=2.0)


def _tls_server_side(tls: ssl.SSLContext, conn: socket.socket) -> ssl.SSLSocket:
    """`conn` as the server's end of a TLS connection, its handshake not begun (`do_handshake` does it).

    A connection reset before it was wrapped fails in `wrap_socket` after the TLS socket has taken over its
    descriptor: left unclosed, held only by the error's traceback (a reference cycle), the descriptor stayed open
    until the garbage collector ran, or for as long as a log record kept the error. Clearing the traceback's frames
    frees that socket, which closes the descriptor now."""
    try:
        return tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
    except OSError as exc:
        traceback.clear_frames(exc.__traceback__)
        raise


def _shut_unless(sock: socket.socket, done: threading.Event, seconds: float) -> None:
    """End `sock` (`_shut`) unless `done` is set within `seconds` of this process's running time (`unstalled`): a
    connection's handshake deadline, which a server frozen past it must not find expired on waking."""

    def wait(left: float) -> None:
        if not done.wait(left):
            raise TimeoutError

    try:
        unstalled(wait, seconds)
    except TimeoutError:
        _shut(sock)


def _shut(sock: socket.socket) -> None:
    """End a connection from another thread: its blocked receive returns at once (the handler then ends it).

    NOTE: the descriptor's shutdown, also under a TLS socket, whose own `shutdown` would drop its TLS state while
    the handler's thread is still using it."""
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


def close_after_error(sock: socket.socket, reply: pb.DataReply | bytes, drain_s: float = 5.0) -> None:
    """Send an error frame (a `DataReply`, or the bytes of another version's), then read and drop what the client
    still sends for up to `drain_s` seconds.

    NOTE: closing with unread bytes makes the kernel send a reset, which can destroy the error frame
    before the client reads it; draining lets the client finish its send and read the reason.
    """
    _send_bytes(sock, reply if isinstance(reply, bytes) else reply.SerializeToString())
    deadline = time.monotonic() + drain_s
    sink = bytearray(1 << 20)
    try:
        sock.settimeout(drain_s)
        while time.monotonic() < deadline and sock.recv_into(sink):
            pass
    except OSError:
        pass


# -- the server's end ---------------------------------------------------------------------------------------------
class DataHandler:
    """Serves one data-plane operation per connection: the same round logic as the gRPC handlers, raw bytes."""

    def __init__(self, service: Coordinator, token: str | None) -> None:
        self.service, self.token = service, token
        self._warn = service.warn

    def __call__(
        self, sock: socket.socket, authenticated: Callable[[], contextlib.AbstractContextManager[None]]
    ) -> None:
        """Every receive and send is bounded by --stream_idle_timeout (the socket's timeout, set by the listener),
        the handshake by the listener's deadline, both on the server's running time (`unstalled`);
        `authenticated()` is entered once the token checks out."""
        try:
            hello = recv_hello(sock, SERVER_MAX_FRAME_BYTES)
        except WrongVersion as exc:
            self._warn.warning("wrong version", "refused %s", exc)
            refuse_version(sock, exc.version)
            return
        except FrameError as exc:
            self._warn.warning("bad hello", "refused a data-plane hello: %s", exc)
            refused = Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{exc} (after a v{VERSION} preamble): this server speaks v{VERSION}; run the same spes "
                "version on the server and every node",
                Reason.WRONG_PROTOCOL,
            )
            close_after_error(sock, refusal_reply(refused))
            return
        if not token_matches(hello.token or None, self.token):
            self._warn.warning("wrong token", "refused a data-plane connection: missing or wrong token")
            close_after_error(
                sock,
                error_reply("UNAUTHENTICATED", WRONG_TOKEN, Reason.UNAUTHENTICATED),
            )
            return
        try:
            with authenticated(), self.service.guard.admit(lambda _why: _shut(sock), total=False) as ticket:
                self._operate(sock, hello, ticket)
        except Refused as exc:
            self._warn.warning(exc.code.name, "refused (%s): %s", exc.code.name, exc)
            close_after_error(sock, refusal_reply(exc))

    def _operate(self, sock: socket.socket, hello: pb.DataHello, ticket: Ticket) -> None:
        """One authenticated operation; its stream is `ticket`'s (watched: idle, too slow; not counted against
        --max_streams, the listener bounds the data plane's operations)."""
        if hello.op == pb.DATA_OP_PING:  # a client checking at join that this port is reachable from where it runs
            send_frame(sock, pb.DataReply(ok=True))
            return
        if hello.op == pb.DATA_OP_PROBE:  # preflight's link test: counted in no traffic figure
            serve_probe(sock, hello, ticket)
            return
        if hello.op not in (pb.DATA_OP_UPLOAD, pb.DATA_OP_DOWNLOAD):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"bad data-plane request: op {hello.op}")
        peer, step = hello.peer_id, hello.step
        self.service.open_stream(ticket, peer, hello.session, lambda: tls_common_name(sock))
        if hello.op == pb.DATA_OP_UPLOAD:
            self._upload(sock, peer, step, hello.fragment, hello.digest, ticket)
        else:
            self._download(sock, peer, step, hello, ticket)

    def _upload(self, sock: socket.socket, peer: int, step: int, fragment: int, digest: int, ticket: Ticket) -> None:
        received = False

        def feed(decoder: TensorDecoder) -> None:
            nonlocal received
            send_frame(sock, pb.DataReply(send=True))
            recv_tensors(sock, decoder, len(decoder.expected), SERVER_MAX_FRAME_BYTES, ticket.moved)
            received = True

        reply = self.service.uploads.receive(peer, step, feed, fragment, digest, ticket)
        if not received and not reply.duplicate:
            return  # the peer went away mid-upload: nothing was kept, nobody to answer
        send_frame(sock, pb.DataReply(uploaded=reply))

    def _download(self, sock: socket.socket, peer: int, step: int, hello: pb.DataHello, ticket: Ticket) -> None:
        time_left = hello.timeout_s if hello.timeout_s > 0 else None
        ticket.wait_for_round(True)
        with self.service.downloads.serve(
            peer, step, hello.full, lambda: not peer_closed(sock), time_left, hello.base_round
        ) as outgoing:
            ticket.wait_for_round(False)
            if outgoing is None:
                return
            send_frame(sock, pb.DataReply(round=outgoing.info))
            try:
                for name, tensor in outgoing.tensors.items():
                    sent = send_tensor(sock, name, tensor, outgoing.wire_dtype, outgoing.encoded[name])
                    outgoing.sent += sent
                    ticket.moved(sent)
            except TimeoutError:  # NOTE: not the idle line's error frame, which would land inside a tensor's bytes
                raise TransportError(
                    f"peer {peer} stopped reading its download of round {step}: nothing went out for "
                    f"--stream_idle_timeout={sock.gettimeout():g} s (a frozen or overloaded node?)"
                ) from None


# -- the client's end ---------------------------------------------------------------------------------------------
class TcpPlane:
    """The client's end: one data-plane connection per operation to the server's host (`Plane`)."""

    name = "tcp"

    def __init__(
        self,
        host: str,
        port: int,
        tls: ssl.SSLContext | None,
        *,
        peer_id: int,
        wire_dtype: str,
        token: str | None,
        session: str,
        rpc_timeout_s: float,
    ) -> None:
        self.host, self.port, self._tls = host, port, tls
        self.peer_id, self.wire_dtype, self._token, self._session = peer_id, wire_dtype, token, session
        self.rpc_timeout_s = rpc_timeout_s

    def ping(self, timeout: float) -> None:
        """Check that the data plane answers from here (a firewall may pass only gRPC); SyncError or OSError if not."""
        with self._connect(pb.DATA_OP_PING, -1, timeout) as sock:
            self._reply(sock, "data-plane ping", "ok")

    def upload(
        self, step: int, tensors: Mapping[str, Item], timeout: float, fragment: int = WHOLE, *, digest: int
    ) -> tuple[int, bool]:
        sock = self._connect(pb.DATA_OP_UPLOAD, step, timeout, fragment=fragment, digest=digest)
        what, sent = f"upload of round {step}", 0
        try:
            with sock:
                if tensors:  # NOTE: a codec may make the first item now, while the server's go is on its way
                    tensors[next(iter(tensors))]
                reply = self._reply(sock, what, "send", "uploaded")
                if reply.HasField("send"):
                    try:
                        sent = send_tensors(sock, tensors, self.wire_dtype)
                    except OSError:
                        pass  # NOTE: the server may have refused mid-stream: its reply says why
                    sock.settimeout(timeout)
                    reply = self._reply(sock, what, "uploaded")
        except OSError as exc:
            raise SyncError(f"{what} broke off: {exc}", grpc.StatusCode.UNAVAILABLE, retryable=True) from None
        return sent, reply.uploaded.duplicate

    def download(
        self,
        step: int,
        timeout: float,
        *,
        full: bool,
        base_round: int,
        decoder_for: Callable[[pb.RoundInfo], TensorDecoder],
    ) -> tuple[pb.RoundInfo, Tensors, int]:
        sock = self._connect(pb.DATA_OP_DOWNLOAD, step, timeout, full=full, base_round=base_round)
        what = f"download of round {step}"
        try:
            with sock:
                sock.settimeout(timeout)  # NOTE: the first reply waits for the whole round
                info = self._reply(sock, what, "round").round
                decoder = decoder_for(info)
                sock.settimeout(min(timeout, self.rpc_timeout_s))
                tensors = recv_tensors(sock, decoder, len(decoder.expected))
        except OSError as exc:
            raise SyncError(f"{what} broke off: {exc}", grpc.StatusCode.UNAVAILABLE, retryable=True) from None
        except (ValueError, TypeError) as exc:  # damaged in transit: fetching it again may succeed
            raise SyncError(f"round {step}: bad download from the server: {exc}", retryable=True) from None
        return info, tensors, decoder.bytes_received

    def probe(self, num_bytes: int) -> tuple[float, float]:
        try:
            with self._connect(
                pb.DATA_OP_PROBE, -1, self.rpc_timeout_s, up_bytes=num_bytes, down_bytes=num_bytes
            ) as sock:
                self._reply(sock, "link test", "send")
                start = time.perf_counter()
                send_zeros(sock, num_bytes)
                self._reply(sock, "link test", "ok")  # the server has read every byte
                up_s = time.perf_counter() - start
                start = time.perf_counter()
                recv_discard(sock, num_bytes)
                return up_s, time.perf_counter() - start
        except OSError as exc:
            raise SyncError(f"link test broke off: {exc}", grpc.StatusCode.UNAVAILABLE) from None

    def _connect(self, op: pb.DataOp, step: int, timeout: float, *, full: bool = False, **extra: int) -> socket.socket:
        """A connection to the server's data plane with the handshake sent; socket errors are retryable."""
        what = f"{pb.DataOp.Name(op).removeprefix('DATA_OP_').lower()} round {step}"
        try:
            sock = connect(self.host, self.port, self._tls, min(timeout, self.rpc_timeout_s))
        except OSError as exc:
            raise SyncError(
                f"{what}: data plane {self.host}:{self.port} unreachable: {exc}",
                grpc.StatusCode.UNAVAILABLE,
                retryable=True,
            ) from None
        hello = pb.DataHello(
            op=op,
            peer_id=self.peer_id,
            step=step,
            full=full,
            token=self._token or "",
            timeout_s=timeout if math.isfinite(timeout) else 0.0,
            session=self._session,
            **extra,
        )
        try:
            send_hello(sock, hello)
        except OSError as exc:
            sock.close()
            raise SyncError(
                f"{what}: data plane handshake failed: {exc}", grpc.StatusCode.UNAVAILABLE, retryable=True
            ) from None
        return sock

    @staticmethod
    def _reply(sock: socket.socket, what: str, *kinds: str) -> pb.DataReply:
        """The server's next reply, which must be one of `kinds` (a `DataReply` field); a refusal as a SyncError."""
        try:
            reply = recv_reply(sock)
        except FrameError as exc:
            raise SyncError(f"{what}: the server's reply is garbled or of another protocol ({exc})") from None
        kind = reply.WhichOneof("kind")
        if kind == "error":
            raise refusal_of(what, reply.error)
        if kind not in kinds:
            raise SyncError(f"{what}: the server answered {kind or 'nothing'}, expected {' or '.join(kinds)}")
        return reply


def refusal_of(what: str, error: pb.DataError) -> SyncError:
    """A data-plane error frame as a SyncError (an unknown code counts as UNKNOWN)."""
    code = grpc.StatusCode.__members__.get(error.code, grpc.StatusCode.UNKNOWN)  # NOTE: a peer's text: members only
    return classify(what, code, error.message, error.reason)
