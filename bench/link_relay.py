"""An emulated internet link: a rate-limiting, delaying TCP relay in front of the parameter server's ports.

    python bench/link_relay.py --target 127.0.0.1 --ports 50051 50052 --peers 4 \
        --peer_mbit 100 --server_mbit 100 --rtt_ms 50

Peer `i` reaches the server through `127.0.0.{10+i}` on the same port numbers (the whole 127.0.0.0/8 range is
loopback, so nothing leaves the machine and the server advertises its real data port unchanged). Every byte
crosses two links in each direction: the peer's own link (`--peer_mbit`, one token bucket per peer and
direction) and the server's link (`--server_mbit`, one token bucket per direction shared by all peers), and
arrives `rtt_ms / 2` after it was sent. A new connection costs one round trip before its first byte. What it
does not model: packet loss, TCP slow start and congestion control on the emulated path (the relay holds the
bandwidth-delay product in its own queues; both kernel sockets see loopback).

Why a relay and not `tc`: `tc ... tbf` limits rate but `netem` (delay) is missing on these machines, shaping
`lo` would slow every process on the machine, and a network namespace needs root. A relay needs nothing and
applies the same link to both planes (gRPC and the raw-TCP data plane).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time

CHUNK = 256 * 1024


class Bucket:
    """A token bucket in reservation form: `reserve(n)` says when `n` more bytes have left the link."""

    def __init__(self, bytes_per_s: float, burst: int = 64 * 1024) -> None:
        self.rate, self.burst = bytes_per_s, burst
        self.tokens = float(burst)
        self.stamp: float | None = None

    def reserve(self, n: int, now: float) -> float:
        idle = 0.0 if self.stamp is None else now - self.stamp
        self.tokens = min(self.burst, self.tokens + idle * self.rate)
        self.stamp = now
        self.tokens -= n
        return now if self.tokens >= 0 else now + -self.tokens / self.rate


class Link:
    """Counts what crossed it; `links` are the buckets a byte passes in order, `delay` the one-way latency."""

    def __init__(self, links: list[Bucket], delay: float) -> None:
        self.links, self.delay, self.bytes = links, delay, 0

    async def pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Carry one direction until its end of stream, which is passed on as a half-close."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                if not data:
                    break
                writer.write(data)
                await writer.drain()

        delivery = asyncio.create_task(deliver())
        try:
            while data := await reader.read(CHUNK):
                for bucket in self.links:
                    now = time.monotonic()
                    await asyncio.sleep(max(0.0, bucket.reserve(len(data), now) - now))
                self.bytes += len(data)
                queue.put_nowait((time.monotonic() + self.delay, data))
        except ConnectionError:
            pass
        queue.put_nowait((time.monotonic() + self.delay, b""))
        try:
            await delivery
            if writer.can_write_eof():
                writer.write_eof()
        except (ConnectionError, OSError):
            pass


async def serve(args: argparse.Namespace) -> None:
    mbit = 1e6 / 8
    delay = args.rtt_ms / 2000
    server_up, server_down = Bucket(args.server_mbit * mbit), Bucket(args.server_mbit * mbit)
    links = []
    servers = []
    for peer in range(args.peers):
        up = Link([Bucket(args.peer_mbit * mbit), server_up], delay)
        down = Link([server_down, Bucket(args.peer_mbit * mbit)], delay)
        links.append((up, down))
        for port in args.ports:

            async def handle(
                reader: asyncio.StreamReader,
                writer: asyncio.StreamWriter,
                port: int = port,
                up: Link = up,
                down: Link = down,
            ) -> None:
                await asyncio.sleep(2 * delay)  # the handshake's round trip
                try:
                    target_reader, target_writer = await asyncio.open_connection(args.target, port)
                except OSError:
                    writer.close()
                    return
                try:
                    await asyncio.gather(up.pump(reader, target_writer), down.pump(target_reader, writer))
                finally:
                    writer.close()
                    target_writer.close()

            servers.append(await asyncio.start_server(handle, f"127.0.0.{10 + peer}", port))
    print("RELAYING", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    await stop.wait()
    for s in servers:
        s.close()
    print(json.dumps({"bytes_up": [u.bytes for u, _ in links], "bytes_down": [d.bytes for _, d in links]}), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="127.0.0.1", help="the server's address")
    p.add_argument("--ports", type=int, nargs="+", required=True, help="the server's ports to relay (both planes)")
    p.add_argument("--peers", type=int, required=True, help="peer i connects through 127.0.0.{10+i}")
    p.add_argument("--peer_mbit", type=float, required=True, help="each peer's link, Mbit/s each way")
    p.add_argument("--server_mbit", type=float, required=True, help="the server's link, shared, Mbit/s each way")
    p.add_argument("--rtt_ms", type=float, default=50.0, help="round-trip time")
    asyncio.run(serve(p.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
