"""A peer's connection to the parameter server: the gRPC channel, the plane tensor payloads travel on, presence.

A `SyncClient` holds one `Connection`. It opens the channel (TLS when the settings name certificates), tags every
call with the peer id, this process's session and the run's token, and after each Join keeps the presence stream
open (`spes.sync.presence`) and picks the plane: the raw-TCP data plane (`spes.sync.plane_tcp`) at the port the
server advertised, or gRPC (`spes.sync.plane_grpc`) when `data_plane` says so, no port is advertised or (`auto`) it
does not answer. A data plane that stops answering mid-run is asked about over gRPC (`Connection.why_lost`): a server
that no longer knows this peer restarted, and the client joins it again, which finds its new data port; one whose gRPC
is gone too is down as a whole and waited for; only a data plane down (or busy, or stalled) while gRPC lives is left
for gRPC until the next Join finds it again, not one that still answers a ping (the connection alone was lost: this
process or the server was frozen). The channel itself, and telling a server that refuses the client's
certificate from one going down, are `spes.sync.channel`'s.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass
from enum import Enum
from typing import Literal

import grpc

from spes.config import SpesConfig
from spes.sync import plane_tcp
from spes.sync.admission import PEER_KEY, RUN_KEY, SESSION_KEY
from spes.sync.channel import PROBE_TIMEOUT_S, client_tls, host_port, open_channel
from spes.sync.plane import Plane
from spes.sync.plane_grpc import GrpcPlane, failure_of
from spes.sync.presence import Presence
from spes.sync.proto import spes_pb2 as pb
from spes.sync.proto import spes_pb2_grpc as pb_grpc
from spes.sync.protocol import PROBE_MAX_BYTES, Reason, SyncError
from spes.sync.retry import Deadline

log = logging.getLogger("spes.client")

TCP_FALLBACK_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
"""Data-plane failures after which a round goes over gRPC instead (a busy, unreachable or stalled data plane); an
unreachable one only once `Connection.why_lost` found gRPC alive and the server still knowing this peer (a restarted
server is joined again, on the data port it advertises then; one down as a whole is waited for), and neither unless
the data plane fails a ping too (a connection lost while this process or the server was frozen is retried on it)."""
KEEP_WINDOW = 3
"""A lost connection is retried on a data plane that answers pings at most once in this many rpc timeouts."""


class Lost(Enum):
    """What a failure of the data plane lost, as `Connection.why_lost` finds: the one answer both the re-join and the
    fall-back to gRPC act on."""

    CONNECTION = "connection"
    """The data plane answers a ping: only the failed call's connection was lost (this process or the server was
    frozen). Retry on the data plane."""
    RESTARTED = "restarted"
    """gRPC answers but the server does not know this peer: a new process (it forgets every join), maybe on another
    data port. Join again: the Join says where its data plane is now."""
    SERVER_DOWN = "server down"
    """gRPC does not answer either, or the server says it is stopping: it is down or restarting. gRPC goes with it, so
    wait on this plane; the re-join a restarted server asks for finds its data plane."""
    PLANE_DOWN = "plane down"
    """The data plane is busy, or fails a ping while the server is not known to be down (gRPC answers and knows this
    peer, or was not asked: a stalled call), or lost a second connection within `KEEP_WINDOW`: leave it for gRPC."""


@dataclass(frozen=True)
class LinkStats:
    """What `Connection.measure_link` measured: the plane, round-trip time and throughput each way."""

    plane: Literal["tcp", "grpc"]
    rtt_s: float
    up_bytes_per_s: float
    down_bytes_per_s: float


class Connection:
    """Peer `peer_id`'s channel to `settings.server_addr` and the plane its payloads take (not thread-safe)."""

    def __init__(self, settings: SpesConfig, peer_id: int, wire_dtype: str, token: str | None) -> None:
        """`wire_dtype`: the raw dtype of the run's codec; `token`: the run's secret (None: no authentication)."""
        s = settings
        self.settings, self.peer_id, self._wire_dtype, self._token = s, peer_id, wire_dtype, token
        self._session = secrets.token_hex(8)  # this process, told apart from another claiming the same peer id
        self.metadata: tuple[tuple[str, str], ...] = (
            (SESSION_KEY, self._session),
            (PEER_KEY, str(peer_id)),
            *((("authorization", f"Bearer {token}"),) if token else ()),
        )
        """Sent with every call: the session, the peer id and the token (never logged)."""
        # NOTE: checked under data_plane grpc too: gRPC's core meets a file that is no PEM with log lines naming no
        # file, then UNAVAILABLE, which is retried for minutes as if the server were down
        tls = client_tls(s.tls_ca, s.tls_cert, s.tls_key)
        self._data_tls = tls if s.data_plane != "grpc" else None
        self._channel = open_channel(s)
        self.stub = pb_grpc.ParameterServerStub(self._channel)
        self.closed = False
        """Set by `close`: a call cancelled from then on was cancelled by this node (its stop), never retried."""
        self._grpc = GrpcPlane(
            self.stub,
            peer_id=peer_id,
            wire_dtype=wire_dtype,
            metadata=self.metadata,
            rpc_timeout_s=s.rpc_timeout_s,
            closed=lambda: self.closed,
        )
        self.plane: Plane = self._grpc
        """The plane tensor payloads travel on, chosen at join from `data_plane` and what the server offers."""
        self._presence: Presence | None = None
        self._kept_at: float | None = None
        """When a lost connection last left payloads on the data plane (`_lost_only_the_connection`)."""

    def joined(self, reply: pb.JoinReply) -> None:
        """A Join was answered: open the presence stream of the run it joined (once; it reopens itself) and pick
        the plane."""
        if self._presence is None:
            self._presence = Presence(self._channel, (*self.metadata, (RUN_KEY, reply.run_id)), self.peer_id)
            self._presence.start(self.settings.rpc_timeout_s)
        self.use_data_plane(reply)

    def use_data_plane(self, reply: pb.JoinReply) -> None:
        """Pick the plane for tensor payloads from the port the server advertised at Join."""
        tcp = data_plane(
            self.settings, reply, self._data_tls, self.peer_id, self._wire_dtype, self._token, self._session
        )
        self.plane = self._grpc if tcp is None else tcp

    def why_lost(self, failure: SyncError, deadline: Deadline | None = None) -> Lost | None:
        """What `failure` of a call on the data plane lost (None: no loss of it: on gRPC already, `close`d, or a
        failure of another kind). An unreachable data plane (UNAVAILABLE without a word from the server) is asked
        about over gRPC first: a server stopped and started again is unreachable at its old data port exactly like a
        data plane down while gRPC lives, and falling back on a restart would send the round's payloads over the slow
        plane until a re-join. Then, as for a stalled call, the data plane is pinged (`_lost_only_the_connection`).

        Each probe waits at most `PROBE_TIMEOUT_S`, the rpc timeout and what `deadline` (the round's, when given) has
        left: a silent host would otherwise hold the round past its end by a probe's whole timeout. A round with no
        time left, or whose end came during a probe that failed (cut short, it tells nothing), ends with its timeout
        error."""
        if self.closed or self.plane is self._grpc:
            return None
        if failure.reason == Reason.SHUTTING_DOWN:
            return Lost.SERVER_DOWN
        if failure.reason == Reason.BUSY:
            return Lost.PLANE_DOWN
        if failure.code not in TCP_FALLBACK_CODES:
            return None
        if failure.code == grpc.StatusCode.UNAVAILABLE and failure.reason == Reason.NONE:
            try:
                reply = self.stub.Status(pb.StatusRequest(), timeout=self._probe_s(deadline), metadata=self.metadata)
            except grpc.RpcError:
                _probe_failed(deadline)
                return Lost.SERVER_DOWN
            if reply.shutting_down:  # NOTE: a stopping server closes its data plane before its gRPC side
                return Lost.SERVER_DOWN
            if self.peer_id not in reply.peers_joined:
                return Lost.RESTARTED
        return Lost.CONNECTION if self._lost_only_the_connection(deadline) else Lost.PLANE_DOWN

    def fall_back(self, failure: SyncError, lost: Lost | None) -> bool:
        """Whether payloads go over gRPC from now on: when `why_lost` found the data plane down, busy or stalled
        (`lost`) after `failure`; never for a server down (gRPC goes with it: the node waits for it), one restarted
        (the re-join finds its data plane) or a connection lost alone (retried on the data plane)."""
        if lost is not Lost.PLANE_DOWN:
            return False
        log.warning(
            "the server's data plane failed (%s): payloads go over gRPC until the next join finds it again", failure
        )
        self.plane = self._grpc
        return True

    def _lost_only_the_connection(self, deadline: Deadline | None) -> bool:
        """Whether the data plane answers a ping now, so that only the failed call's connection was lost: this process
        or the server was frozen (a VM paused, SIGSTOP, a swap storm) and the server closed the connection idle, or
        the call timed out meanwhile. The call is then retried on the data plane, not sent to gRPC for the rest of the
        run; a second such loss within `KEEP_WINDOW` rpc timeouts falls back (a plane that answers pings but keeps
        losing payloads)."""
        assert isinstance(self.plane, plane_tcp.TcpPlane)
        now = time.monotonic()
        if self._kept_at is not None and now - self._kept_at < KEEP_WINDOW * self.settings.rpc_timeout_s:
            return False
        try:
            self.plane.ping(self._probe_s(deadline))
        except (SyncError, OSError):
            _probe_failed(deadline)
            return False
        log.debug("the data plane answers: only peer %d's connection was lost, the call retries on it", self.peer_id)
        self._kept_at = now
        return True

    def _probe_s(self, deadline: Deadline | None) -> float:
        """How long one probe of `why_lost` may wait: `PROBE_TIMEOUT_S`, the rpc timeout and what `deadline` has left
        (its round-timeout error when nothing)."""
        cap = min(self.settings.rpc_timeout_s, PROBE_TIMEOUT_S)
        return cap if deadline is None else min(cap, deadline.left())

    def measure_link(self, num_bytes: int, pings: int = 5) -> LinkStats:
        """Round-trip time (fastest of `pings` Status calls) and throughput of `num_bytes` each way over the
        plane `sync` uses (after `SyncClient.check_join` or `join`); the server counts none of it."""
        if not 0 < num_bytes <= PROBE_MAX_BYTES:
            raise ValueError(f"a link test moves 1 to {PROBE_MAX_BYTES} bytes each way, got {num_bytes}")
        rtts = []
        timeout = self.settings.rpc_timeout_s
        try:
            for _ in range(pings):
                start = time.perf_counter()
                self.stub.Status(pb.StatusRequest(), timeout=timeout, metadata=self.metadata)
                rtts.append(time.perf_counter() - start)
        except grpc.RpcError as err:
            raise failure_of("link test", err, closed=lambda: self.closed) from None
        up_s, down_s = self.plane.probe(num_bytes)
        return LinkStats(
            plane="tcp" if self.plane.name == "tcp" else "grpc",
            rtt_s=min(rtts),
            up_bytes_per_s=num_bytes / up_s,
            down_bytes_per_s=num_bytes / down_s,
        )

    def close(self) -> None:
        self.closed = True
        if self._presence is not None:
            self._presence.close(self.settings.rpc_timeout_s)
        self._channel.close()


def data_plane(
    s: SpesConfig,
    reply: pb.JoinReply,
    tls: object,
    peer_id: int,
    wire_dtype: str,
    token: str | None,
    session: str,
) -> plane_tcp.TcpPlane | None:
    """The raw-TCP plane to the data port the server advertised at Join, or None for gRPC: `data_plane: grpc`, no
    port advertised, or (`auto`) a port that does not answer from here (a firewall may pass only gRPC)."""
    if s.data_plane == "tcp" and not reply.data_port:
        raise SyncError(
            "data_plane='tcp' but the server advertises no data port: start it with --data_port 0 "
            "(or use data_plane='auto')",
            grpc.StatusCode.FAILED_PRECONDITION,
        )
    if s.data_plane == "grpc" or not reply.data_port:
        return None
    host, _ = host_port(s.server_addr)
    tcp = plane_tcp.TcpPlane(
        host,
        reply.data_port,
        tls,  # type: ignore[arg-type]
        peer_id=peer_id,
        wire_dtype=wire_dtype,
        token=token,
        session=session,
        rpc_timeout_s=s.rpc_timeout_s,
    )
    if s.data_plane == "auto":
        try:
            tcp.ping(min(s.rpc_timeout_s, PROBE_TIMEOUT_S))
        except (SyncError, OSError) as exc:
            log.warning(
                "the server's data plane (port %d) does not answer from here (%s): tensor payloads go over gRPC, "
                "several times slower. Open that port, or set spes_config.data_plane=grpc to skip this check",
                reply.data_port,
                exc,
            )
            return None
    return tcp


def _probe_failed(deadline: Deadline | None) -> None:
    """A probe of `why_lost` failed: once the round's deadline has passed, it may have been cut short by it and tells
    nothing, and the round ends with its timeout error (not a verdict acted on for the rest of the run)."""
    if deadline is not None:
        deadline.left()
