"""The raw-TCP data plane: tensor payloads over a plain (or TLS) socket, gRPC staying the control plane.

gRPC-Python copies every message several times, which caps a round far below what the network can move.
Here a tensor is one small JSON header frame, exactly `num_bytes` raw little-endian bytes and their
XXH3-64 as 8 bytes (`write_raw`), sent straight from the tensor's memory and received with `recv_into`
straight into a buffer sized by the *receiver's* manifest (`TensorDecoder.feed_raw`: the same header checks
as the gRPC path, done before a byte of payload is read, checksum verified after). Nothing received is ever
unpickled.

A connection carries one operation:

    client -> MAGIC, VERSION, {"op": "upload"|"download"|"ping", "peer_id", "step", "full", "token", "timeout_s"}
    upload:   server -> {"status": "send"} | final reply;  client -> tensors;  server -> final reply
    download: server -> {"status": "ok", "round", "merged", "alpha", "names", "peers"} | error;  server -> tensors
    ping:     server -> {"status": "ok"} | error  (a client in `auto` mode checks the port is reachable)
    probe:    hello also has "up_bytes", "down_bytes" (preflight's link test, counted nowhere):
              server -> {"status": "send"} | error;  client -> up_bytes raw;  server -> {"status": "ok"}, down_bytes raw

A control frame is a 4-byte little-endian length and a JSON object of at most `MAX_FRAME_BYTES`. An error
frame is {"status": "error", "code": <gRPC status name>, "reason": <spes-reason>, "message"}, so the
client's retry/re-join/catch-up logic treats both planes alike (see protos/spes.proto for the reasons).
"""

from __future__ import annotations

import contextlib
import json
import logging
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from spes.sync.proto import spes_pb2 as pb
from spes.sync.protocol import PROTOCOL_VERSION, Reason
from spes.sync.wire import KEEPALIVE_S, KEEPALIVE_TIMEOUT_S, Encoded, TensorDecoder, payload_bytes, \
    read_file, write_raw

log = logging.getLogger("spes.transport")

MAGIC = b"SPES"
VERSION = PROTOCOL_VERSION
MAX_FRAME_BYTES = 16 << 20
_LENGTH = struct.Struct("<I")
_PREAMBLE = struct.Struct("<4sH")
_RECV_PIECE = 8 << 20
PROBE_MAX_BYTES = 256 << 20
"""Most bytes a link test (`probe` here, `Probe` over gRPC) moves each way."""
PROBE_CHUNK_BYTES = 1 << 20
Frame = dict[str, Any]


class TransportError(ConnectionError):
    """The other end broke the framing or went away: the connection is unusable, a new one may succeed."""


# -- frames -------------------------------------------------------------------------------------------------------
def recv_exactly(sock: socket.socket, buf: memoryview) -> None:
    """Fill `buf` from the socket (each `recv_into` bounded by the socket's timeout); EOF is a TransportError."""
    filled = 0
    while filled < len(buf):
        got = sock.recv_into(buf[filled : filled + _RECV_PIECE])
        if got == 0:
            raise TransportError(f"connection closed after {filled} of {len(buf)} bytes")
        filled += got


def send_frame(sock: socket.socket, frame: Frame) -> None:
    data = json.dumps(frame, separators=(",", ":")).encode()
    sock.sendall(_LENGTH.pack(len(data)) + data)


def recv_frame(sock: socket.socket, limit: int = MAX_FRAME_BYTES) -> Frame:
    """One JSON control frame; its length is checked against `limit` before anything is allocated or read."""
    head = bytearray(_LENGTH.size)
    recv_exactly(sock, memoryview(head))
    (length,) = _LENGTH.unpack(head)
    if length > limit:
        raise TransportError(f"control frame of {length} bytes exceeds the {limit}-byte limit")
    data = bytearray(length)
    recv_exactly(sock, memoryview(data))
    try:
        frame = json.loads(data)
    except ValueError:
        raise TransportError("control frame is not valid JSON") from None
    if not isinstance(frame, dict):
        raise TransportError(f"control frame is a JSON {type(frame).__name__}, expected an object")
    return frame


def error_frame(code: str, message: str, reason: str = "") -> Frame:
    return {"status": "error", "code": code, "reason": reason, "message": message}


def send_hello(sock: socket.socket, request: Frame) -> None:
    sock.sendall(_PREAMBLE.pack(MAGIC, VERSION))
    send_frame(sock, request)


def recv_hello(sock: socket.socket, limit: int = MAX_FRAME_BYTES) -> Frame:
    """The client's handshake: magic and version first, so a stray connection is refused unread."""
    head = bytearray(_PREAMBLE.size)
    recv_exactly(sock, memoryview(head))
    magic, version = _PREAMBLE.unpack(head)
    if magic != MAGIC or version != VERSION:
        raise TransportError(f"not a SPES data-plane v{VERSION} client (magic {magic!r}, version {version})")
    return recv_frame(sock, limit)


# -- tensors ------------------------------------------------------------------------------------------------------
def send_tensors(sock: socket.socket, tensors: Mapping[str, torch.Tensor], wire_dtype: str,
                 encoded: Mapping[str, Encoded] | None = None) -> int:
    """Send every tensor as a header frame, its raw payload (zero-copy `sendall`) and checksum; returns payload bytes.

    `encoded` holds wire forms and checksums computed once for several receivers (`EncodedModel`).
    """
    sent = 0
    for name, tensor in tensors.items():
        send_frame(sock, {"name": name, "dtype": wire_dtype, "shape": list(tensor.shape),
                          "num_bytes": payload_bytes(tuple(tensor.shape), wire_dtype)})
        sent += write_raw(tensor, wire_dtype, sock.sendall, None if encoded is None else encoded[name])
    return sent


def header_of(frame: Frame) -> pb.TensorHeader:
    """A header frame as a `TensorHeader` for `TensorDecoder`; ValueError when a field has the wrong type."""
    fields = {"name": str, "dtype": str, "shape": list, "num_bytes": int}
    for key, kind in fields.items():
        if not isinstance(frame.get(key), kind) or isinstance(frame.get(key), bool):
            raise ValueError(f"tensor header field {key!r} is missing or not a {kind.__name__}: {frame.get(key)!r}")
    if not all(isinstance(d, int) and not isinstance(d, bool) for d in frame["shape"]):
        raise ValueError(f"tensor header shape {frame['shape']!r} must be a list of integers")
    try:
        return pb.TensorHeader(**{key: frame[key] for key in fields})
    except ValueError as exc:  # e.g. a negative or too large integer
        raise ValueError(f"tensor header {frame.get('name')!r}: {exc}") from None


def recv_tensors(sock: socket.socket, decoder: TensorDecoder, count: int,
                 limit: int = MAX_FRAME_BYTES) -> dict[str, torch.Tensor]:
    """Receive `count` tensors into `decoder`'s manifest-sized buffers; every header is checked before its payload."""
    for _ in range(count):
        decoder.feed_raw(header_of(recv_frame(sock, limit)), lambda buf: recv_exactly(sock, buf))
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
def _probe_size(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= PROBE_MAX_BYTES:
        raise ValueError(f"a link test moves 0 to {PROBE_MAX_BYTES} bytes each way, got {value!r}")
    return value


def send_zeros(sock: socket.socket, num_bytes: int) -> None:
    """Send `num_bytes` zero bytes (link-test payload)."""
    chunk = bytes(min(num_bytes, PROBE_CHUNK_BYTES))
    for offset in range(0, num_bytes, PROBE_CHUNK_BYTES):
        sock.sendall(memoryview(chunk)[: min(PROBE_CHUNK_BYTES, num_bytes - offset)])


def recv_discard(sock: socket.socket, num_bytes: int) -> None:
    """Read and drop exactly `num_bytes` bytes (link-test payload)."""
    sink = memoryview(bytearray(min(num_bytes, PROBE_CHUNK_BYTES)))
    while num_bytes > 0:
        piece = min(num_bytes, len(sink))
        recv_exactly(sock, sink[:piece])
        num_bytes -= piece


def serve_probe(sock: socket.socket, hello: Frame) -> None:
    """The server's side of a link test (the hello is already authenticated)."""
    try:
        up, down = _probe_size(hello.get("up_bytes")), _probe_size(hello.get("down_bytes"))
    except ValueError as exc:
        close_after_error(sock, error_frame("INVALID_ARGUMENT", str(exc)))
        return
    send_frame(sock, {"status": "send"})
    recv_discard(sock, up)
    send_frame(sock, {"status": "ok"})
    send_zeros(sock, down)


# -- TLS ----------------------------------------------------------------------------------------------------------
def server_tls(cert: str | None, key: str | None, client_ca: str | None) -> ssl.SSLContext | None:
    """The data plane's TLS context from the server's PEM files (mutual TLS with `client_ca`); None without TLS."""
    if cert is None or key is None:
        return None
    for path, flag in ((cert, "--tls_cert"), (key, "--tls_key"), (client_ca, "--tls_client_ca")):
        if path is not None:
            read_file(path, flag)  # FileNotFoundError naming the flag
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    if client_ca is not None:
        context.load_verify_locations(cafile=client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_tls(ca: str | None, cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """The client's TLS context from the same files as its gRPC channel (system roots when `ca` is None)."""
    if ca is None and cert is None:
        return None
    context = ssl.create_default_context(cafile=ca)
    if cert is not None and key is not None:
        context.load_cert_chain(cert, key)
    return context


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

    `handle(sock)` owns the (TLS-wrapped) socket for one operation; the listener closes it afterwards.
    Past `max_connections` concurrent connections a new one is refused with RESOURCE_EXHAUSTED, reason "busy"
    (the client retries). Every receive is bounded by `io_timeout_s`; a connection that sends nothing for that
    long is answered DEADLINE_EXCEEDED and closed.
    """

    def __init__(self, host: str, port: int, handle: Callable[[socket.socket], None], *,
                 tls: ssl.SSLContext | None, max_connections: int, io_timeout_s: float) -> None:
        self._handle, self._tls, self._io_timeout_s = handle, tls, io_timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)
        self._stopping = threading.Event()
        self._sock = socket.create_server((host, port), backlog=max_connections)
        self._sock.settimeout(0.2)
        self.port: int = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._accept_loop, name="spes-data-accept", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stopping.is_set():
                    return
                raise
            conn.settimeout(self._io_timeout_s)
            tune(conn)
            if not self._slots.acquire(blocking=False):
                self._refuse_busy(conn)
                continue
            threading.Thread(target=self._serve, args=(conn,), name="spes-data-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            if self._tls is not None:
                conn = self._tls.wrap_socket(conn, server_side=True)
            self._handle(conn)
        except TimeoutError:
            log.warning("data-plane connection idle for %g s: closed (--stream_idle_timeout)", self._io_timeout_s)
            with contextlib.suppress(OSError):
                send_frame(conn, error_frame("DEADLINE_EXCEEDED", f"nothing received for --stream_idle_timeout="
                                             f"{self._io_timeout_s:g} s: connection closed, nothing it sent was kept"))
        except (OSError, TransportError) as exc:
            log.warning("data-plane connection dropped: %s", exc)
        finally:
            conn.close()
            self._slots.release()

    def _refuse_busy(self, conn: socket.socket) -> None:
        """Answer "busy" without a thread: a plain socket takes the short frame at once; a TLS one (whose
        handshake could stall) is closed, which the client also retries."""
        try:
            if self._tls is None:
                conn.settimeout(0.1)
                send_frame(conn, error_frame("RESOURCE_EXHAUSTED", "too many data-plane connections: retry "
                                             "shortly", Reason.BUSY))
        except OSError:
            pass
        finally:
            conn.close()

    def stop(self) -> None:
        self._stopping.set()
        self._sock.close()
        self._thread.join(timeout=2.0)


def close_after_error(sock: socket.socket, frame: Frame, drain_s: float = 5.0) -> None:
    """Send an error frame, then read and drop what the client still sends for up to `drain_s` seconds.

    NOTE: closing with unread bytes makes the kernel send a reset, which can destroy the error frame
    before the client reads it; draining lets the client finish its send and read the reason.
    """
    send_frame(sock, frame)
    deadline = time.monotonic() + drain_s
    sink = bytearray(1 << 20)
    try:
        sock.settimeout(drain_s)
        while time.monotonic() < deadline and sock.recv_into(sink):
            pass
    except OSError:
        pass
