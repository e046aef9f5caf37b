"""The parameter server's round service, free of any transport: what both planes call.

A `Coordinator` holds the run (its spec, joined peers, sessions, the `RoundState`), admits each stream, takes
uploads through the round rules and the run's codec, has each full round closed (`spes.sync.closing`: built,
persisted and published on a thread of its own) and hands each download what the codec serves. The gRPC handlers
(`spes.sync.plane_grpc`) and the raw-TCP data plane (`spes.sync.plane_tcp`) only move bytes: an upload is a
`feed(decoder)` callback, a download an `Outgoing` the plane sends. All shared state is guarded by one condition;
tensors outlive rounds in `spes.sync.buffers.RoundMemory`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import grpc

from spes.sync.admission import Sessions, StreamGuard, Ticket
from spes.sync.auth import check_peer_identity
from spes.sync.buffers import RoundMemory, round_limits
from spes.sync.closing import RoundCloser
from spes.sync.codecs.base import Payload
from spes.sync.fragments import WHOLE
from spes.sync.joins import check_join
from spes.sync.proto import spes_pb2 as pb
from spes.sync.protocol import Reason, Refused, Tensors
from spes.sync.rounds import Completed, RoundState
from spes.sync.settings import ServerConfig
from spes.sync.state import new_run_id, run_id_of
from spes.sync.status import REPORT_S, describe
from spes.sync.wire import BaseMismatch, CorruptChunk, EncodedModel, Item, TensorDecoder, wire_torch_dtype

log = logging.getLogger("spes.server")

WAIT_POLL_S = 1.0
"""A waiting download re-checks its caller this often (the data plane cannot be woken when its client hangs up)."""


@dataclass
class Outgoing:
    """One download for a plane to send: the round's `RoundInfo`, then `tensors` in their shared encoded forms."""

    info: pb.RoundInfo
    tensors: Mapping[str, Item]
    encoded: EncodedModel
    wire_dtype: str
    sent: int = 0
    """Payload bytes the plane has sent so far (counted in the server's traffic once the download ends)."""


class Coordinator:
    """The rounds of one run, whatever carries the bytes (thread-safe)."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.spec, self.deploy = cfg.spec, cfg.deploy
        self.codec = cfg.spec.codec_impl.server()
        self._cond = threading.Condition()
        self.state = RoundState(self.spec.num_peers, self.spec.server, lambda after: self.spec.next_round(after))
        self.memory = RoundMemory()
        self.joined: set[int] = set()
        self._uploading: dict[int, Ticket] = {}
        """Per peer, the stream of its upload being received (a newer one supersedes it)."""
        self._bytes_in = self._bytes_out = self._round_bytes_in = self._logged_bytes_out = 0
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
        self.closer = RoundCloser(
            self._cond, self.state, self.memory, self.codec, self.deploy.state_dir, self._published
        )
        self.spec = self.closer.restore(self.spec)
        self._reporter = threading.Thread(target=self._report, name="spes-status-report", daemon=True)
        self._reporter.start()
        self.run_id = run_id_of(self.deploy.state_dir) if self.deploy.state_dir else new_run_id()
        """This run's identity (kept under --state_dir): a node of another run, or a fresh node against a run in
        progress, is refused at Join."""

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
            self._check_run(peer, request.run_id)
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

    def _check_run(self, peer: int, theirs: str) -> None:
        """A node of this run, or a fresh node while the run has no completed round (lock held); refuses any other
        (reason other_run), saying what to do: two runs are never mixed."""
        if theirs == self.run_id:
            return
        done = self.state.completed_round
        if not theirs and done is None:
            return
        held = f"run {self.run_id}" + (f" at round {done}" if done is not None else " (no round yet)")
        if not theirs:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"peer {peer} starts a fresh run, but this server holds {held}: to continue that run resume the node "
                f"from its checkpoint (--resume=auto), or join it afresh with spes_config.run_id={self.run_id}; for a "
                "new run start the server with a fresh --state_dir",
                Reason.OTHER_RUN,
            )
        raise Refused(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"peer {peer} belongs to run {theirs} (its checkpoint or spes_config.run_id), but this server holds "
            f"{held}: restart the server with that run's --state_dir, or start the node fresh (without --resume) "
            "for this one",
            Reason.OTHER_RUN,
        )

    def open_stream(self, ticket: Ticket, peer: int, session: str, common_name: Callable[[], str | None]) -> None:
        """An Upload/Download stream of either plane names `peer`: check who calls, bound its streams, note it."""
        self.check_identity(peer, common_name)
        ticket.claim(peer)
        with self._cond:
            self.sessions.heard(peer, session)

    # -- Upload -------------------------------------------------------------------------------
    def upload(
        self,
        peer: int,
        step: int,
        feed: Callable[[TensorDecoder], None],
        fragment: int = WHOLE,
        digest: int = 0,
        ticket: Ticket | None = None,
    ) -> pb.UploadReply:
        """One upload of `fragment` of the model through the round rules, whatever carries it (gRPC stream or
        raw-TCP data plane).

        `feed(decoder)` is called only once the upload is admitted and must pass it every tensor; raises `Refused`.
        `digest` (`spes.sync.wire.upload_digest`) tells a retry of a committed upload from a different one. A new
        upload of a peer supersedes its own stalled one (`ticket`: this one's stream, the older's is ended).
        An empty reply (round 0, not a duplicate) means the peer went away mid-upload and nothing was kept.
        """
        with self._cond:
            self._require_joined(peer)
            try:
                self.spec.layout.check(fragment)
            except ValueError as exc:
                raise Refused(
                    grpc.StatusCode.INVALID_ARGUMENT, f"upload of peer {peer} for round {step}: {exc}"
                ) from None
            if self.state.admit(peer, step, fragment, digest):
                return self._upload_reply(step, duplicate=True)
            older = self._uploading.pop(peer, None)
            if older is not None and ticket is not None:
                older.expire(f"superseded by a newer upload of peer {peer}")
            if ticket is not None:
                self._uploading[peer] = ticket
            base = self.state.completed
            if base is not None:
                self.memory.pin(base.round)
        try:
            received = self._receive(feed, peer, step, fragment, base)
        finally:
            with self._cond:
                if base is not None:
                    self.memory.unpin(base.round)
                if ticket is not None and self._uploading.get(peer) is ticket:
                    del self._uploading[peer]
        if received is None:
            return pb.UploadReply()  # the peer went away mid-upload: nothing was kept
        tensors, checksums, relayed = received
        with self._cond:
            if self.state.admit(peer, step, fragment, digest):  # a concurrent retry of this upload won the race
                self.memory.pool.give(tensors.values())
                return self._upload_reply(step, duplicate=True)
            self.memory.checksums.record({n: tensors[n] for n in checksums}, checksums, self.codec.raw_dtype)
            if self.state.stage_upload(peer, step, tensors, relayed, fragment, digest):
                self.closer.close(step, self.spec)
            self._cond.notify_all()
            return self._upload_reply(step, duplicate=False)

    def _receive(
        self, feed: Callable[[TensorDecoder], None], peer: int, step: int, fragment: int, base: Completed | None
    ) -> tuple[Tensors, dict[str, int], dict[str, Payload]] | None:
        """Decode and verify one upload of what `peer` trains of `fragment` into kept buffers sized by the manifest,
        and turn it into values (the codec): the values, the checksums of those received raw, and the payloads of
        blocks taken verbatim that downloads may relay. None if the peer went away.

        `base`: the latest completed round (pinned), whose served model the codec's payloads must apply to.
        """
        spec = self.spec
        assert spec.manifest is not None
        names = spec.layout.names(fragment, spec.trainable(peer))
        dtype = wire_torch_dtype(self.codec.raw_dtype)
        buffers = {n: self.memory.pool.take(spec.manifest[n], dtype) for n in names}
        decoder = self.codec.upload_decoder(
            {n: spec.manifest[n] for n in names}, buffers, base.served if base else None
        )
        try:
            feed(decoder)
            raw = decoder.finish()
            values, relayed = self.codec.upload_values(
                decoder, raw, spec.own(peer, names), base.global_model if base else {}, base.served if base else None
            )
        except (grpc.RpcError, OSError):
            log.warning(
                "upload of peer %d for round %d broke off after %d bytes; nothing was kept",
                peer,
                step,
                decoder.bytes_received,
            )
            self.memory.pool.give(buffers.values())
            return None
        except ValueError as exc:
            self.memory.pool.give(buffers.values())
            code, reason = grpc.StatusCode.INVALID_ARGUMENT, Reason.NONE
            if isinstance(exc, CorruptChunk):
                reason = Reason.CORRUPT
            elif isinstance(exc, BaseMismatch):
                code, reason = grpc.StatusCode.FAILED_PRECONDITION, Reason.BASE_MISMATCH
            raise Refused(code, f"upload of peer {peer} for round {step}: {exc}", reason) from None
        finally:
            with self._cond:
                self._bytes_in += decoder.bytes_received
                self._round_bytes_in += decoder.bytes_received
        self.memory.pool.give(buffers[n] for n in decoder.coded)  # came coded: their raw buffers went unused
        return values, decoder.checksums, relayed

    def _upload_reply(self, step: int, *, duplicate: bool) -> pb.UploadReply:
        snap = self.state.snapshot()
        uploaded = snap.uploaded_peers if snap.open_round == step else snap.round_peers
        return pb.UploadReply(round=step, duplicate=duplicate, uploaded_peers=uploaded)

    def _published(self, done: Completed, seconds: float) -> None:
        """Round `done` is the latest (`spes.sync.closing`): count it and log what it did and moved."""
        with self._cond:
            self._rounds_completed += 1
            bytes_in, bytes_out = self._round_bytes_in, self._bytes_out - self._logged_bytes_out
            self._round_bytes_in, self._logged_bytes_out = 0, self._bytes_out
        missing = sorted(set(range(self.spec.num_peers)) - done.peers)
        log.info(
            "round %d%s complete: peers %d%s, in %.1f MiB, out %.1f MiB (since last round), aggregation %.2f s%s, "
            "merged %s, alpha %.6g",
            done.round,
            f" (fragment {done.fragment} of {self.spec.overlap_fragments})" if done.fragment != WHOLE else "",
            len(done.peers),
            f" (quorum, missing {missing})" if missing else "",
            bytes_in / 2**20,
            bytes_out / 2**20,
            seconds,
            ", persisted" if self.deploy.state_dir else "",
            "yes" if done.merged else "no",
            done.alpha,
        )

    # -- Download -----------------------------------------------------------------------------
    @contextmanager
    def download(
        self,
        peer: int,
        step: int,
        full: bool,
        is_active: Callable[[], bool],
        time_left_s: float | None,
        base_round: int = -1,
    ) -> Iterator[Outgoing | None]:
        """Wait for round `step` and select what `peer` gets, whatever carries it (None: the caller went away).

        Raises `Refused`. The plane sends `Outgoing.info`, then the tensors in their encoded forms (shared by
        every download of the round), adding to `Outgoing.sent`; however that ends, leaving the block counts the
        bytes and lets the round's tensors be reused once no download reads them. `base_round`: the round of the
        model the peer holds (a held-model codec sends it deltas against that).
        """
        with self._cond:
            self._require_joined(peer)
            if not self._await_round(peer, step, full, is_active, time_left_s):
                outgoing = None
            else:
                outgoing = self._outgoing(peer, step, full, base_round)
                self.memory.pin(step)
        if outgoing is None:
            yield None
            return
        try:
            yield outgoing
        finally:
            with self._cond:
                self._bytes_out += outgoing.sent
                self.memory.unpin(step)

    def _outgoing(self, peer: int, step: int, full: bool, base_round: int) -> Outgoing:
        """What a download of the completed round `step` sends `peer` (lock held): the codec's selection, every
        tensor for a catch-up, else the round's download names."""
        done, spec = self.state.completed, self.spec
        assert done is not None and spec.manifest is not None
        selection = self.codec.select(done.served, full=full, base_round=base_round)
        names = list(selection.items) if selection.whole else list(done.global_model)
        if full and len(names) < len(spec.manifest):
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"peer {peer} asks for the whole global model, but round {step} holds only the fragments that have "
                f"had a round so far ({len(names)} of {len(spec.manifest)} tensors): a node that falls behind "
                "before every fragment has had one (step sync_steps) must start the run again",
            )
        if not selection.whole:
            names = spec.downloads(peer, spec.layout.names(done.fragment, names), merged=done.merged)
        info = pb.RoundInfo(
            round=step,
            merged=done.merged,
            alpha=done.alpha,
            names=names,
            peers=sorted(done.peers),
            base_round=selection.base_round,
        )
        encoded = self.memory.encoded(selection.key, selection.items, self.codec.raw_dtype)
        return Outgoing(info, {n: selection.items[n] for n in names}, encoded, self.codec.raw_dtype)

    def _await_round(
        self, peer: int, step: int, full: bool, is_active: Callable[[], bool], time_left_s: float | None
    ) -> bool:
        """Wait (lock held) until round `step` is the latest completed one; False if the caller went away.

        A round that timed out is closed here under `quorum` when it can be; otherwise the wait fails
        with a message naming the missing peers. `time_left_s` is the caller's own deadline (None: none).
        """
        state = self.state
        give_up = math.inf if time_left_s is None else time.monotonic() + time_left_s
        while True:
            if self._shutting_down:
                raise Refused(grpc.StatusCode.UNAVAILABLE, "the parameter server is shutting down")
            if not is_active() or time.monotonic() >= give_up:
                return False
            if state.check_download(peer, step, full):
                return True
            if state.must_close(self._uncopied_owners()):
                log.warning(
                    "round %d timed out: closing it with peers %s (server.dead_peer_policy quorum)",
                    step,
                    sorted(state.uploaded),
                )
                self.closer.close(step, self.spec)
                continue
            self._cond.wait(min(state.seconds_left(), give_up - time.monotonic(), WAIT_POLL_S))

    def _uncopied_owners(self) -> frozenset[int]:
        """Peers owning expert blocks the open round covers of which the global model holds no copy yet (lock
        held): a quorum round cannot close without them (the run's first round, or the first of a fragment's)."""
        spec, done = self.spec, self.state.completed
        if spec.manifest is None or spec.mode != "spes":
            return frozenset()
        held = done.global_model if done else {}
        covered = spec.layout.names(self.state.fragment, spec.manifest)
        return frozenset(owner for n in covered if n not in held and (owner := spec.owner(n)) is not None)

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
                bytes_in=self._bytes_in,
                bytes_out=self._bytes_out,
                mode=self.spec.mode,
                round_peers=snap.round_peers,
                missing_peers=self.state.missing_peers() if snap.open_round is not None else [],
                open_round_age_s=snap.open_age_s,
                dead_peer_policy=self.spec.server.dead_peer_policy,
                rounds_completed=self._rounds_completed,
                persistent=self.deploy.state_dir is not None,
                run_id=self.run_id,
                presence=[
                    pb.PeerPresence(peer=p, last_seen_s=age, connected=live)
                    for p, age, live in self.sessions.presence()
                ],
            )

    def _report(self) -> None:
        """Every `REPORT_S` while the run waits (a round open, peers yet to join), log what for and whom."""
        while True:
            with self._cond:
                if self._cond.wait_for(lambda: self._shutting_down, timeout=REPORT_S):
                    return
                waiting = self.state.open_round is not None or len(self.joined) < self.spec.num_peers
            if waiting:
                log.info("waiting: %s", describe(self.status()))

    def _require_joined(self, peer: int) -> None:
        """Refuse a peer that has not joined (caller holds the lock)."""
        if peer not in self.joined:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"peer {peer} has not joined this server: call Join first",
                Reason.NOT_JOINED,
            )

    def presence(self, peer: int, session: str, address: str) -> Callable[[], None]:
        """A peer process's presence stream opened (see `spes.sync.admission`); returns what to call when it ends."""
        with self._cond:
            self.sessions.present(peer, session, address)

        def ended() -> None:
            with self._cond:
                self.sessions.absent(peer, session)

        return ended

    def check_identity(self, peer: int, common_name: Callable[[], str | None]) -> None:
        """With --tls_peer_ids: the caller's certificate (its common name, from either plane) must name `peer`."""
        if self.deploy.tls_peer_ids:
            check_peer_identity(peer, common_name())

    def shutdown(self, grace_s: float) -> None:
        """Wake every waiting download so it ends with UNAVAILABLE; let a running aggregation finish."""
        with self._cond:
            self._shutting_down = True
            self._cond.notify_all()
        self.closer.join(grace_s)
        self.guard.stop()


def _or_minus_one(value: int | None) -> int:
    return -1 if value is None else value
