"""The parameter server's round service, free of any transport: what both planes call.

A `Coordinator` holds the run (its spec, joined peers, sessions, the `RoundState`), admits each Join and stream,
and reports the run's status. Its round jobs live beside it: uploads go through the round rules and the run's codec
(`spes.sync.uploads`), each full round is closed (`spes.sync.closing`: built, persisted and published on a thread of
its own) and each download gets what the codec serves (`spes.sync.downloads`). The gRPC handlers
(`spes.sync.plane_grpc`) and the raw-TCP data plane (`spes.sync.plane_tcp`) only move bytes: an upload is a
`feed(decoder)` callback, a download an `Outgoing` the plane sends. All shared state is guarded by one condition;
tensors outlive rounds in `spes.sync.buffers.RoundMemory`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from spes.sync.admission import Sessions, StreamGuard, Ticket
from spes.sync.auth import check_peer_identity
from spes.sync.buffers import RoundMemory, round_limits
from spes.sync.closing import CallParts, RoundCloser, RoundParts
from spes.sync.downloads import Downloads
from spes.sync.fragments import WHOLE
from spes.sync.joins import check_join, check_run
from spes.sync.proto import spes_pb2 as pb
from spes.sync.protocol import Refused, shutting_down
from spes.sync.rounds import Completed, RoundState
from spes.sync.settings import ServerConfig
from spes.sync.state import new_run_id, run_id_of
from spes.sync.status import REPORT_S, describe
from spes.sync.throttle import ThrottledLog
from spes.sync.uploads import Uploads
from spes.sync.wire import wire_torch_dtype

log = logging.getLogger("spes.server")


class Coordinator:
    """The rounds of one run, whatever carries the bytes (thread-safe)."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.spec, self.deploy = cfg.spec, cfg.deploy
        self.codec = cfg.spec.codec_impl.server()
        self._cond = threading.Condition()
        self.state = RoundState(self.spec.num_peers, self.spec.server, lambda after: self.spec.next_round(after))
        self.memory = RoundMemory()
        self.joined: set[int] = set()
        self._logged_in = self._logged_out = 0
        self._logged_round: int | None = None
        """The traffic counters and the round at the last round's log line (None: none logged yet)."""
        self._rounds_completed = 0
        self._shutting_down = False
        self.data_port = 0
        """Port of the running data plane, advertised at Join (0: none); set by `start_server`."""
        self.guard = StreamGuard(
            idle_timeout_s=self.deploy.stream_idle_timeout,
            max_streams=self.deploy.max_streams,
            max_per_peer=self.deploy.max_streams_per_peer,
            min_rate=self.deploy.min_stream_rate * 1024,
        )
        self.sessions = Sessions(self.deploy.peer_liveness)
        self.warn = ThrottledLog(log)
        """What a client can make this server warn about (a wrong token, a refused call), at a bounded rate."""
        parts = RoundParts(self._cond, self.state, self.memory, self.codec)
        self.closer = RoundCloser(parts, self.deploy.state_dir, self._published)
        calls = CallParts(parts, self.closer, self.joined, lambda: self.spec, lambda: self._shutting_down)
        self.uploads, self.downloads = Uploads(calls), Downloads(calls)
        self.spec = self.closer.restore(self.spec)
        self.run_id = run_id_of(self.deploy.state_dir) if self.deploy.state_dir else new_run_id()
        """This run's identity (kept under --state_dir): a node of another run, or a fresh node against a run in
        progress, is refused at Join."""
        self._reporter = threading.Thread(target=self._report, name="spes-status-report", daemon=True)
        self._reporter.start()  # NOTE: last: a constructor that raises leaves no thread, and a report names the run

    # -- Join ---------------------------------------------------------------------------------
    def join(
        self, request: pb.JoinRequest, session: str, address: str, common_name: Callable[[], str | None]
    ) -> pb.JoinReply:
        """Check a Join against the run and register the peer (a dry run registers nothing); raises Refused."""
        peer = request.peer_id
        self.check_identity(peer, common_name)
        with self._cond:
            theirs = check_join(
                request, self.spec, max_tensors=self.deploy.max_tensors, max_model_gb=self.deploy.max_model_gb
            )
            check_run(peer, request.run_id, self.run_id, self.state.completed_round)
            if request.dry_run:  # preflight: every check above, nothing registered
                log.info("preflight of peer %d: its settings and model match the run", peer)
                return pb.JoinReply(
                    current_round=-1,
                    open_round=-1,
                    data_port=self.data_port,
                    manifest_checked=self.spec.manifest is not None,
                    dry_run=True,
                    run_id=self.run_id,
                )
            if not self.spec.complete:
                self.spec = self.spec.completed_by(theirs)
                log.info(
                    "took the model manifest (%d tensors) and sync_steps from peer %d", len(theirs.manifest or {}), peer
                )
            note = self.sessions.join(peer, session, address)
            self.joined.add(peer)
            self.memory.pool.set_limits(round_limits(self.spec, self.joined, wire_torch_dtype(self.codec.raw_dtype)))
            snap = self.state.snapshot()
        log.info("peer %d joined from %s%s (codec %s)", peer, address, note, self.spec.codec)
        return pb.JoinReply(
            current_round=_or_minus_one(snap.completed_round),
            open_round=_or_minus_one(snap.open_round),
            data_port=self.data_port,
            run_id=self.run_id,
        )

    def open_stream(self, ticket: Ticket, peer: int, session: str, common_name: Callable[[], str | None]) -> None:
        """An Upload/Download stream of either plane names `peer`: check who calls, bound its streams, note it.
        Refused once the server is shutting down (`shutting_down`): a stream admitted then could outlast the grace,
        and gRPC's end of it would reach the node as a cancellation."""
        self.check_identity(peer, common_name)
        ticket.claim(peer)
        with self._cond:
            if self._shutting_down:
                raise shutting_down()
            self.sessions.heard(peer, session)

    def _published(self, done: Completed, seconds: float) -> None:
        """Round `done` is the latest (`spes.sync.closing`): count it and log what it did, and the bytes moved since
        the previous line: this round's uploads in, the previous round's downloads out."""
        with self._cond:
            self._rounds_completed += 1
            received, sent = self.uploads.bytes_in, self.downloads.bytes_out
            bytes_in, bytes_out = received - self._logged_in, sent - self._logged_out
            since = "the server started" if self._logged_round is None else f"round {self._logged_round}"
            self._logged_in, self._logged_out, self._logged_round = received, sent, done.round
        missing = sorted(set(range(self.spec.num_peers)) - done.peers)
        log.info(
            "round %d%s complete: peers %d%s, aggregation %.2f s%s, %s; since %s: %.1f MiB in (uploads), "
            "%.1f MiB out (downloads)",
            done.round,
            f" (fragment {done.fragment} of {self.spec.overlap_fragments})" if done.fragment != WHOLE else "",
            len(done.peers),
            f" (quorum, missing {missing})" if missing else "",
            seconds,
            ", persisted" if self.deploy.state_dir else "",
            f"merged yes (alpha {done.alpha:.6g})" if done.merged else "merged no",
            since,
            bytes_in / 2**20,
            bytes_out / 2**20,
        )

    def wake(self) -> None:
        """Let waiting downloads re-check their callers (one went away)."""
        with self._cond:
            self._cond.notify_all()

    # -- Status and peers ---------------------------------------------------------------------
    def status(self) -> pb.StatusReply:
        with self._cond:
            snap = self.state.snapshot()
            return pb.StatusReply(
                current_round=_or_minus_one(snap.completed_round),
                open_round=_or_minus_one(snap.open_round),
                num_peers=self.spec.num_peers,
                peers_joined=sorted(self.joined),
                peers_uploaded=snap.uploaded_peers,
                bytes_in=self.uploads.bytes_in,
                bytes_out=self.downloads.bytes_out,
                mode=self.spec.mode,
                round_peers=snap.round_peers,
                missing_peers=self.state.missing_peers() if snap.open_round is not None else [],
                open_round_age_s=snap.open_age_s,
                dead_peer_policy=self.spec.server.dead_peer_policy,
                rounds_completed=self._rounds_completed,
                persistent=self.deploy.state_dir is not None,
                run_id=self.run_id,
                shutting_down=self._shutting_down,
                presence=[
                    pb.PeerPresence(peer=p, last_seen_s=age, connected=live)
                    for p, age, live in self.sessions.presence()
                ],
            )

    def _report(self) -> None:
        """Every `REPORT_S` while the run waits (a round open, peers yet to join), log what for and whom. Decided and
        logged under the lock: a line decided before a join and logged after it said a peer that had joined was
        awaited."""
        while True:
            with self._cond:
                if self._cond.wait_for(lambda: self._shutting_down, timeout=REPORT_S):
                    return
                if self.state.open_round is not None or len(self.joined) < self.spec.num_peers:
                    log.info("waiting: %s", describe(self.status()))

    def presence(
        self, peer: int, session: str, run: str, address: str, common_name: Callable[[], str | None]
    ) -> Callable[[], None]:
        """A peer process's presence stream of run `run` opened (see `spes.sync.admission`); returns what to call
        when it ends. Refused (reason other_run) for another run: a process left over from it holds no peer id;
        with --tls_peer_ids, refused (PERMISSION_DENIED) unless its certificate names `peer`: a presence holds the
        peer id, so another node's certificate could otherwise keep the peer out (ALREADY_EXISTS) or take it over."""
        with self._cond:
            try:
                self.check_identity(peer, common_name)
                check_run(peer, run, self.run_id, self.state.completed_round)
            except Refused as exc:
                self.warn.warning("presence", "refused a presence stream from %s: %s", address, exc)
                raise
            self.sessions.present(peer, session, address)

        def ended() -> None:
            with self._cond:
                self.sessions.absent(peer, session)

        return ended

    @property
    def stopping(self) -> bool:
        """Whether `shutdown` has begun: no new Upload or Download is served from then on."""
        return self._shutting_down

    def check_identity(self, peer: int, common_name: Callable[[], str | None]) -> None:
        """With --tls_peer_ids: the caller's certificate (its common name, from either plane) must name `peer`."""
        if self.deploy.tls_peer_ids:
            check_peer_identity(peer, common_name())

    def shutdown(self, grace_s: float) -> None:
        """Refuse every new upload and download from now on, and wake every waiting download, with UNAVAILABLE (reason
        shutting_down); let a running aggregation finish. The status reporter has ended when it returns."""
        with self._cond:
            self._shutting_down = True
            self._cond.notify_all()
        self._reporter.join()  # NOTE: no `waiting:` line once stopped (a line it was writing came after)
        self.closer.join(grace_s)
        self.guard.stop()
        self.warn.flush()


def _or_minus_one(value: int | None) -> int:
    return -1 if value is None else value
