"""What keeps the parameter server answering under hostile or careless load: stream limits, idle deadlines, sessions.

A synchronous gRPC server serves every call on a thread of a bounded pool, so a stream that never sends its
next message would hold a thread for ever, and enough of them would stop the server (Status included).
`StreamGuard` bounds that:

- every Upload/Download stream (both planes) takes a slot: at most `max_streams` in all and `max_per_peer` for
  one peer id; past either the call is refused at once with RESOURCE_EXHAUSTED (reason `busy`, retried by
  clients with backoff). The pool has `max_streams + UNARY_RESERVE` threads, so Join, Status and the health
  check always find one;
- a watchdog cancels every stream that has neither received nor sent a message for `idle_timeout_s` with
  DEADLINE_EXCEEDED, unless it is waiting for its round (a Download blocked on the other peers is not idle;
  the round timeout and the caller's own deadline bound that wait). The handler then sees the stream end,
  and `Ticket.check` turns that into `TimeoutError`, so a partial upload is discarded like a broken one;
- a stream that moves bytes (an upload, a download being sent, a link test) must keep an average of
  `min_rate` bytes/s once `idle_timeout_s` has passed since it started moving them, so a peer that trickles a
  message every few seconds (never idle) cannot hold a slot either; a ticket with a `deadline` (a data-plane
  connection's handshake) ends at it, whatever it sends.

`PendingSlots` bound the data plane's connections still in their handshake, in all and per address.

`Sessions` tells a second live process claiming a joined peer id from a restarted one. Each `SyncClient`
sends a random per-process session id with every call (gRPC metadata `spes-session`, data-plane field
`session`) and, once joined, keeps one presence stream open: a standard health `Watch` call carrying its
session. The stream lasts exactly as long as the process's connection: it ends at once when the process dies
(its kernel closes the socket) and within the keepalive time (`spes.sync.wire.KEEPALIVE_S`) when the host or
the network goes away. A Join for a peer id whose current session holds a presence stream (or, never having
opened one, was heard from within `liveness_s`) is refused with ALREADY_EXISTS naming both addresses;
otherwise the new process replaces the old one, whose later calls are refused (reason `superseded`). A
presence stream names its run too (metadata `spes-run`): one of another run is refused (reason `other_run`),
so a process left over from an earlier run on the same address never holds a peer id of this one.

Every age here (a stream's silence and byte rate, a handshake's deadline, a peer's silence) is measured on
`Stalls.awake`, which does not count the time this process did not run: a server frozen (SIGSTOP, a paused VM) past
--stream_idle_timeout or --peer_liveness would otherwise wake to end every open stream and give every quiet peer's id
to the next process asking for it, though only the server was away. A peer really gone is still found gone: its
silence counts while the server runs.
"""

from __future__ import annotations

import logging
import threading
import urllib.parse
from collections.abc import Callable, Collection
from dataclasses import dataclass
from functools import partial

import grpc
from grpc_health.v1 import health

from spes.sync.protocol import Reason, Refused
from spes.sync.stalls import STALLS, Stalls

log = logging.getLogger("spes.server")

MAX_MODEL_GB = 48.0
"""Default --max_model_gb, the largest model (fp32) a Join to a server without the run's YAML may declare: the paper's
largest config (configs/upcycled_9b, 9.4B parameters) is 37.7 GB in fp32."""
MAX_TENSORS = 16384
"""Default --max_tensors, the most tensors a Join's manifest may declare: configs/upcycled_9b has 591 tensors."""
UNARY_RESERVE = 16
"""Handler threads beyond the stream slots: Join, Status and the health check never wait behind streams."""
SESSION_KEY = "spes-session"
"""gRPC metadata key carrying a client process's random session id."""
PEER_KEY = "spes-peer"
"""gRPC metadata key naming the peer id a heartbeat (Status call) is sent for."""
RUN_KEY = "spes-run"
"""gRPC metadata key of a presence stream naming the run its process joined: a stream of another run (a process
left over from an earlier run on this port) must not hold a peer id of this one."""


def require_joined(joined: Collection[int], peer: int) -> None:
    """Refuse an Upload or Download of a peer that has not joined (reason not_joined: the client joins again)."""
    if peer not in joined:
        raise Refused(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"peer {peer} has not joined this server: call Join first",
            Reason.NOT_JOINED,
        )


def caller_address(context: grpc.ServicerContext) -> str:
    """Where a gRPC call comes from, as the logs and refusals name it: gRPC URL-encodes its peer string
    (`ipv6:%5B::1%5D:35836`), decoded here once (`ipv6:[::1]:35836`)."""
    return urllib.parse.unquote(context.peer())


def cancel_call(context: grpc.ServicerContext, code: grpc.StatusCode, details: str) -> None:
    """End a server call from another thread with `code` (grpc's public `cancel()` can only say CANCELLED)."""
    try:
        # NOTE: grpc-python's server context has no public way to end a call from another thread with a status;
        # its core call object does (grpc_call_cancel_with_status).
        context._rpc_event.call.cancel(code.value[0], details)
    except AttributeError:
        context.cancel()


class Ticket:
    """One admitted stream: its activity clock, byte rate, peer claim and how the watchdog ends it."""

    def __init__(self, guard: StreamGuard, cancel: Callable[[str], None] | None, deadline: float | None = None) -> None:
        self._guard, self._cancel = guard, cancel
        self.peer: int | None = None
        self.last_active = guard.clock()
        self.waiting = False
        self.expired = False
        self.deadline = deadline
        """`guard.clock()` at which the stream ends, whatever it does (None: none)."""
        self.moving_since: float | None = None
        """When the stream started moving bytes under the rate floor (None: not yet)."""
        self.moved_bytes = 0

    def touch(self) -> None:
        """A message went in or out: the stream is alive."""
        self.last_active = self._guard.clock()

    def moved(self, num_bytes: int) -> None:
        """`num_bytes` of payload went in or out: the stream is alive, and held to the rate floor from its first
        byte on."""
        self.last_active = now = self._guard.clock()
        if self.moving_since is None:
            self.moving_since = now
        self.moved_bytes += num_bytes

    def too_slow(self, now: float) -> str:
        """Why the watchdog ends this stream at `now` (`StreamGuard.clock`; '' when it may go on)."""
        guard = self._guard
        if self.deadline is not None and now > self.deadline:
            return "its handshake did not complete in time"
        if not self.waiting and now - self.last_active > guard.idle_timeout_s:
            return f"no message for --stream_idle_timeout={guard.idle_timeout_s:g} s"
        started = self.moving_since
        if (
            started is not None
            and now - started > guard.idle_timeout_s
            and self.moved_bytes < guard.min_rate * (now - started - guard.idle_timeout_s)
        ):
            return f"it moved {self.moved_bytes} bytes in {now - started:.0f} s, under --min_stream_rate"
        return ""

    def wait_for_round(self, waiting: bool) -> None:
        """While True the stream waits on the round, not on its client, and is never idle."""
        self.waiting = waiting
        self.touch()

    def claim(self, peer: int) -> None:
        """Count this stream against `peer`'s limit (once its peer id is known); raises Refused past it."""
        self._guard._claim(self, peer)

    def check(self) -> None:
        """Raise TimeoutError if the watchdog ended this stream (its end then means nothing was received)."""
        if self.expired:
            raise TimeoutError(f"stream closed: {self.why}")

    def expire(self, why: str) -> None:
        self.expired, self.why = True, why
        if self._cancel is not None:
            self._cancel(f"stream closed ({why}): nothing it sent was kept")

    def close(self) -> None:
        self._guard._release(self)

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


class StreamGuard:
    """Stream slots (total and per peer) and the watchdog of idle, slow and overdue streams; thread-safe. Stop with
    `stop()`."""

    def __init__(
        self,
        *,
        idle_timeout_s: float,
        max_streams: int,
        max_per_peer: int,
        min_rate: float = 0.0,
        stalls: Stalls | None = None,
    ) -> None:
        """`stalls`: whose time not run the streams' ages leave out (default: this process's, `STALLS`)."""
        self.idle_timeout_s, self.max_streams, self.max_per_peer = idle_timeout_s, max_streams, max_per_peer
        self.min_rate = min_rate
        """Bytes/s a stream that moves bytes must average once `idle_timeout_s` has passed."""
        self.clock = (STALLS.watch() if stalls is None else stalls).awake
        """Seconds this process ran (`Stalls.awake`), on which every ticket's ages are kept."""
        self._lock = threading.Lock()
        self._tickets: set[Ticket] = set()
        """Every watched stream; `_counted` of them count against `max_streams`."""
        self._counted: set[Ticket] = set()
        self._per_peer: dict[int, int] = {}
        self._stopping = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="spes-stream-watchdog", daemon=True)
        self._watchdog.start()

    def admit(
        self, cancel: Callable[[str], None] | None, *, total: bool = True, deadline_s: float | None = None
    ) -> Ticket:
        """A slot for a new stream, or Refused RESOURCE_EXHAUSTED; `cancel(details)` ends it when the watchdog
        does (idle, too slow, past its deadline: `deadline_s` from now).

        `total=False`: watched, but not counted against `max_streams` (the data plane's listener bounds its
        connections).
        """
        with self._lock:
            if total and len(self._counted) >= self.max_streams:
                raise Refused(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the server already serves --max_streams={self.max_streams} streams: retry shortly",
                    Reason.BUSY,
                )
            deadline = None if deadline_s is None else self.clock() + deadline_s
            ticket = Ticket(self, cancel, deadline)
            self._tickets.add(ticket)
            if total:
                self._counted.add(ticket)
            return ticket

    def grpc_ticket(self, context: grpc.ServicerContext) -> Ticket:
        """`admit` for a gRPC call, ended with DEADLINE_EXCEEDED when idle."""
        return self.admit(lambda details: cancel_call(context, grpc.StatusCode.DEADLINE_EXCEEDED, details))

    def _claim(self, ticket: Ticket, peer: int) -> None:
        with self._lock:
            if ticket.peer is not None:
                return
            if self._per_peer.get(peer, 0) >= self.max_per_peer:
                raise Refused(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"peer {peer} already has --max_streams_per_peer={self.max_per_peer} streams open: retry shortly",
                    Reason.BUSY,
                )
            self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
            ticket.peer = peer

    def _release(self, ticket: Ticket) -> None:
        with self._lock:
            self._tickets.discard(ticket)
            self._counted.discard(ticket)
            if ticket.peer is not None:
                self._per_peer[ticket.peer] -= 1
                if not self._per_peer[ticket.peer]:
                    del self._per_peer[ticket.peer]
                ticket.peer = None

    @property
    def open_streams(self) -> int:
        with self._lock:
            return len(self._counted)

    def _watch(self) -> None:
        period = min(0.5, self.idle_timeout_s / 4)
        while not self._stopping.wait(period):
            now = self.clock()
            with self._lock:
                ending = [(t, why) for t in self._tickets if not t.expired and (why := t.too_slow(now))]
            for ticket, why in ending:
                log.warning("stream of peer %s closed: %s", "unknown" if ticket.peer is None else ticket.peer, why)
                ticket.expire(why)

    def stop(self) -> None:
        self._stopping.set()
        self._watchdog.join(timeout=2.0)


class PendingSlots:
    """Slots for connections still in their handshake (not yet authenticated): at most `total`, and at most
    `per_address` from one address (a quarter of them unless given), so that a flood from one host leaves the
    others' connections room. Thread-safe."""

    def __init__(self, total: int, per_address: int | None = None) -> None:
        self.total, self.per_address = total, per_address or max(1, total // 4)
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}

    def take(self, address: str) -> bool:
        """A slot for a connection from `address`, or False (past either bound)."""
        with self._lock:
            if sum(self._held.values()) >= self.total or self._held.get(address, 0) >= self.per_address:
                return False
            self._held[address] = self._held.get(address, 0) + 1
            return True

    def release(self, address: str) -> None:
        with self._lock:
            self._held[address] -= 1
            if not self._held[address]:
                del self._held[address]


class GuardedHealth(health.HealthServicer):
    """The gRPC health service. Its Watch streams (long-lived by design) hold slots of the guard; one carrying a
    peer's session (metadata `spes-peer`, `spes-session`, `spes-run`) is that process's presence (`on_presence`,
    which may refuse it).

    Every Watch sends from its own handler thread (grpcio's blocking mode), so a status change only queues the
    latest status for each watcher. grpcio's default mode sends it to every watcher in turn under the service's
    one lock, each send waiting until the client has room for it: a watcher that stopped reading held that lock
    for good (every Check, every new Watch and `stop()`'s NOT_SERVING notice waited on it), and a watch ending
    meanwhile stalled grpc's event thread on it too. A Watch thus holds a pool thread while open, like the other
    streams; its slot in the guard bounds those threads.
    """

    def __init__(
        self,
        guard: StreamGuard,
        on_presence: Callable[[int, str, str, str, Callable[[], str | None]], Callable[[], None]],
        common_name: Callable[[grpc.ServicerContext], str | None],
    ) -> None:
        """`on_presence(peer, session, run, address, common_name)`: a presence stream opened (`common_name()`: of
        the caller's client certificate, for --tls_peer_ids); returns what to call when it ends, or raises Refused.
        `common_name(context)`: a call's (`spes.sync.auth.grpc_common_name`)."""
        super().__init__(experimental_non_blocking=False)
        self._guard, self._on_presence, self._common_name = guard, on_presence, common_name

    def Watch(self, request: object, context: grpc.ServicerContext, send_response_callback: object = None) -> object:
        metadata = dict(context.invocation_metadata() or ())
        peer, session, run = (str(metadata.get(key, "")) for key in (PEER_KEY, SESSION_KEY, RUN_KEY))
        try:
            ticket = self._guard.grpc_ticket(context)
            if peer.isdigit() and session:
                try:
                    ticket.claim(int(peer))
                    ended = self._on_presence(
                        int(peer), session, run, caller_address(context), partial(self._common_name, context)
                    )
                    _when_ended(context, ended)
                except Refused:
                    ticket.close()
                    raise
        except Refused as exc:
            context.abort(exc.code, str(exc))
        ticket.wait_for_round(True)  # a watch waits on the server's state, never idle
        _when_ended(context, ticket.close)
        return super().Watch(request, context, send_response_callback)


def _when_ended(context: grpc.ServicerContext, callback: Callable[[], None]) -> None:
    """Call `callback` when the call ends, or now if it already has (grpc then refuses the callback, and the
    slot or presence it releases would be held for good)."""
    if not context.add_callback(callback):
        callback()


@dataclass
class Session:
    """The process currently acting as a peer id: its session id, address, when it was last heard from (on
    `Sessions.clock`) and how many presence streams it holds open."""

    session: str
    address: str
    last_seen: float
    presence: int = 0
    watched: bool = False
    """It has opened a presence stream: from then on it is live exactly while one is open."""

    def live(self, now: float, liveness_s: float) -> bool:
        return self.presence > 0 if self.watched else now - self.last_seen < liveness_s


class Sessions:
    """Which process is each joined peer id; not thread-safe (the server calls it under its lock)."""

    def __init__(self, liveness_s: float, stalls: Stalls | None = None) -> None:
        """`stalls`: whose time not run a peer's silence leaves out (default: this process's, `STALLS`)."""
        self.liveness_s = liveness_s
        self.clock = (STALLS.watch() if stalls is None else stalls).awake
        """Seconds this process ran (`Stalls.awake`): every session's `last_seen` is on it."""
        self._by_peer: dict[int, Session] = {}

    def join(self, peer: int, session: str, address: str) -> str:
        """Record `session` as peer `peer`; raises Refused ALREADY_EXISTS while another session of it is live.

        Returns a note for the join log ('' for a first join or the same process joining again).
        """
        now = self.clock()
        current = self._by_peer.get(peer)
        note = ""
        if current is not None and current.session == session:
            current.address, current.last_seen = address, now
            return ""
        if current is not None:
            if current.live(now, self.liveness_s):
                raise Refused(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"peer_id {peer} is already joined by a live process at {current.address}; this join came "
                    f"from {address}: give every node its own spes_config.peer_id (a restarted node is admitted "
                    "as soon as its old process's connection is gone)",
                    Reason.DUPLICATE_PEER,
                )
            note = f" (replaces the process at {current.address}, whose connection is gone)"
        self._by_peer[peer] = Session(session, address, now)
        return note

    def present(self, peer: int, session: str, address: str) -> None:
        """A presence stream of `session` opened (a process that is not, or no longer, joined may re-register)."""
        now = self.clock()
        current = self._by_peer.get(peer)
        if current is None or (current.session != session and not current.live(now, self.liveness_s)):
            current = self._by_peer[peer] = Session(session, address, now)
        if current.session == session:
            current.presence += 1
            current.watched, current.last_seen = True, now

    def absent(self, peer: int, session: str) -> None:
        """A presence stream of `session` ended."""
        current = self._by_peer.get(peer)
        if current is not None and current.session == session:
            current.presence -= 1
            current.last_seen = self.clock()

    def heard(self, peer: int, session: str) -> None:
        """A call of `session` for `peer` arrived; refuses a session another process of that peer replaced."""
        current = self._by_peer.get(peer)
        if current is None or not session:
            return
        if current.session != session:
            raise Refused(
                grpc.StatusCode.ALREADY_EXISTS,
                f"peer_id {peer} has been taken over by another process at {current.address}: this process "
                f"stops; give every node its own spes_config.peer_id",
                Reason.SUPERSEDED,
            )
        current.last_seen = self.clock()

    def presence(self) -> list[tuple[int, float, bool]]:
        """(peer, seconds since last heard from, presence stream open) of every peer id a process joined as. A
        process with its stream open is heard from now (the stream is alive): `last_seen` counts only its calls,
        and a node training between rounds read as one silent for minutes. The age leaves out this server's stalls."""
        now = self.clock()
        return [
            (p, 0.0 if s.presence > 0 else now - s.last_seen, s.presence > 0) for p, s in sorted(self._by_peer.items())
        ]

    def forget(self) -> None:
        self._by_peer.clear()
