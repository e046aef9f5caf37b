"""A small loopback TCP proxy for fault injection: delay, cut, corrupt, and watch the bytes between peer and server.

    with TcpProxy(("127.0.0.1", server_port), delay_s=0.01) as proxy:
        client = SyncClient(f"127.0.0.1:{proxy.port}", ...)
        proxy.corrupt_once("up", offset=300_000)       # flip one byte of what clients send
        proxy.cut()                                    # drop every open connection now

Two threads per connection pump bytes; every socket has a timeout and `close()` joins every thread, so a test
that uses it stays bounded. Offsets and byte counts are per direction ("up": client to server, "down": server
to client), summed over all connections.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from types import TracebackType

READ_BYTES = 64 * 1024


class TcpProxy:
    def __init__(self, target: tuple[str, int], *, delay_s: float = 0.0) -> None:
        self.target, self.delay_s = target, delay_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._closed = threading.Event()
        self.refusing = False
        self.bytes = {"up": 0, "down": 0}
        self._corrupt: dict[str, int] = {}
        self.corrupted = {"up": 0, "down": 0}
        self.watchers: list[Callable[[str, int], None]] = []
        self._start(self._accept_loop, "proxy-accept")

    def corrupt_once(self, direction: str, offset: int) -> None:
        """Flip the byte at `offset` of the `direction` stream (counted from now) once."""
        with self._lock:
            self._corrupt[direction] = self.bytes[direction] + offset

    def cut(self) -> None:
        """Drop every open connection at once (both peers see the TCP connection reset or closed)."""
        with self._lock:
            sockets = list(self._sockets)
        self._drop(*sockets)

    def close(self) -> None:
        self._closed.set()
        self.cut()
        for thread in list(self._threads):
            thread.join(timeout=5)
        self._listener.close()

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------
    def _start(self, target: Callable[..., None], name: str, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self.refusing:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            for sock in (client, upstream):
                sock.settimeout(0.2)
            with self._lock:
                self._sockets += [client, upstream]
            self._start(self._pump, "proxy-up", client, upstream, "up")
            self._start(self._pump, "proxy-down", upstream, client, "down")

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        while not self._closed.is_set():
            try:
                data = src.recv(READ_BYTES)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data:
                break
            if self.delay_s:
                time.sleep(self.delay_s)
            data = self._account(direction, data)
            try:
                dst.sendall(data)
            except OSError:
                break
            for watch in list(self.watchers):
                watch(direction, self.bytes[direction])
        self._drop(src, dst)

    def _drop(self, *sockets: socket.socket) -> None:
        with self._lock:
            self._sockets = [s for s in self._sockets if s not in sockets]
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def _account(self, direction: str, data: bytes) -> bytes:
        with self._lock:
            start = self.bytes[direction]
            self.bytes[direction] += len(data)
            target = self._corrupt.get(direction)
            if target is None or not start <= target < start + len(data):
                return data
            del self._corrupt[direction]
            self.corrupted[direction] += 1
        damaged = bytearray(data)
        damaged[target - start] ^= 0xFF
        return bytes(damaged)
