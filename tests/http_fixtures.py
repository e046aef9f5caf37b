"""An HTTP file server on loopback for the tests of token files at URLs (`spes.remote_files`, `spes.remote_ranges`):
GET of whole files and of byte ranges (`Range: bytes=N-` and `bytes=N-M`, answered 206 with a Content-Range, or
416 past the end), as static file servers and CDNs answer, with the misbehaviours a test asks for."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Served:
    """What the server holds (path -> bytes), what it was asked (method, path, Range header), and the paths whose
    next answer stops halfway through the body."""

    files: dict[str, bytes] = field(default_factory=dict)
    asked: list[tuple[str, str, str | None]] = field(default_factory=list)
    cut: set[str] = field(default_factory=set)
    whole: set[str] = field(default_factory=set)
    """Paths answered whole whatever the range asked (a server without range requests)."""
    unsized: set[str] = field(default_factory=set)
    """Paths answered without a Content-Length (the body ends when the connection closes)."""
    unsized_ranges: set[str] = field(default_factory=set)
    """Paths whose range answers name no file size (`bytes 0-9/*`, and no Content-Range on a 416)."""
    failing: dict[str, int] = field(default_factory=dict)
    """Paths whose next N answers are 503 (a server or CDN edge briefly down)."""
    url: str = ""


class _Files(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as real servers: a client reuses its connection

    def setup(self) -> None:
        super().setup()
        # NOTE: headers and body leave in two writes; without this Nagle holds the body for the client's delayed ACK
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        served: Served = self.server.served  # type: ignore[attr-defined]
        ranged = self.headers.get("Range")
        served.asked.append((self.command, self.path, ranged))
        if served.failing.get(self.path):
            served.failing[self.path] -= 1
            return self.send_error(503)
        body = served.files.get(self.path)
        if body is None:
            return self.send_error(404)
        start, end = 0, len(body) - 1
        ranges = bool(ranged) and self.path not in served.whole
        if ranges:
            first, _, last = ranged.removeprefix("bytes=").partition("-")
            start, end = int(first), min(int(last) if last else end, end)
            ranges = not last or int(last) >= start  # NOTE: an invalid range is ignored (RFC 9110): the whole file
            start, end = (start, end) if ranges else (0, len(body) - 1)
            if ranges and start >= len(body):
                self.send_response(416)
                if self.path not in served.unsized_ranges:
                    self.send_header("Content-Range", f"bytes */{len(body)}")
                self.send_header("Content-Length", "0")
                return self.end_headers()
        self.send_response(206 if ranges else 200)
        if ranges:
            size = "*" if self.path in served.unsized_ranges else len(body)
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        if self.path in served.unsized:
            self.close_connection = True
        else:
            self.send_header("Content-Length", str(end + 1 - start))
        self.end_headers()
        if self.path in served.cut:
            served.cut.discard(self.path)
            self.wfile.write(body[start : start + (end + 1 - start) // 2])
            self.close_connection = True
            return
        self.wfile.write(body[start : end + 1])

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def http_server() -> Iterator[Served]:
    """A file server on 127.0.0.1 (port 0) for the `with` block; what it holds and was asked."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    server.daemon_threads = True
    server.served = Served(url=f"http://127.0.0.1:{server.server_address[1]}")  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.served  # type: ignore[attr-defined]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
