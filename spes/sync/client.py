"""The peer's side of the SPES protocol: join the run, then per round upload and download tensors.

One rank per node owns a `SyncClient`; the trainer broadcasts what `sync` returns to its other ranks.

    spec = run_spec(cfg, manifest)                       # the run spec (spes.sync.spec), as the server builds it
    with SyncClient(spec, peer_id=0, settings=cfg.spes_config, token=os.environ["SPES_TOKEN"]) as client:
        client.join()                                    # the server compares the spec and the manifest
        global_tensors, stats = client.sync(step, {n: params[n] for n in spec.trainable(0)})

Every RPC carries a deadline, and a round ends at `round_timeout_s` of this process's running time: time it did not run
(a laptop suspended mid-round, SIGSTOP) is not counted (`spes.sync.retry.Deadline`), so a node that wakes past its
deadline asks the server again and catches up rather than ending. Transient failures (UNAVAILABLE, DEADLINE_EXCEEDED, a
call a stopping server cancelled, bytes that fail their checksum in either direction) are retried with exponential
backoff and jitter, which is safe because the server treats a repeated (peer, round) upload as a no-op. What travels is
the run's codec's (`spes.sync.codecs`): the client holds its peer end (`PeerCodec`: a held-model codec's held model and
error feedback), and a payload the server refuses for its base (it holds another) is sent again as full values. `sync`
also recovers on its own from a server restart: told it has not joined, it joins again; told the server holds no upload
of it for the round, it uploads again. A peer the run has moved past (it restarted from an older checkpoint, or a quorum
round closed without it) catches up: `sync` returns the latest global model, every tensor of it, with
`SyncStats.caught_up` set and `round` the server's step, and the caller continues from there (`catch_up` does the same
at start, before a node trains on from a step the run has passed). Other failures raise `SyncError` carrying the gRPC
status code and the server's explanation. The token is never logged. The channel, the plane payloads take (falling back
to gRPC when the data plane fails) and the presence stream are the client's `spes.sync.connection.Connection`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import TypeVar

import grpc
import torch

from spes.config import SpesConfig
from spes.sync.channel import certificate_refusal
from spes.sync.connection import Connection, Lost
from spes.sync.fragments import WHOLE
from spes.sync.plane import Plane
from spes.sync.proto import spes_pb2 as pb
from spes.sync.protocol import PROTOCOL_VERSION, Manifest, Reason, SyncError, Tensors
from spes.sync.retry import Deadline, retrying
from spes.sync.spec import RunSpec
from spes.sync.wire import TensorDecoder

log = logging.getLogger("spes.client")

T = TypeVar("T")


@dataclass(frozen=True)
class RoundPhases:
    """Where a round's seconds went on this peer (its last attempt's, when it was retried): a round whose upload
    takes longer than its bytes need is bound by the encode, one that waits long for its publication by the other
    peers or the server's aggregation, one whose download is long by the link or the decode."""

    upload_s: float
    """From the start of the upload (its encode included) until the server acknowledged it."""
    publish_s: float
    """From then until the round's announcement arrived: the other peers' uploads and the server's aggregation."""
    download_s: float
    """From then until the download was received and applied."""

    def __add__(self, other: RoundPhases) -> RoundPhases:
        return RoundPhases(
            self.upload_s + other.upload_s, self.publish_s + other.publish_s, self.download_s + other.download_s
        )


@dataclass(frozen=True)
class SyncStats:
    """What one `sync` call cost and what the server did in that round."""

    seconds: float
    bytes_up: int
    bytes_down: int
    round: int
    merged: bool
    alpha: float
    peers: tuple[int, ...] = ()
    """Peers whose uploads built the round (fewer than all when a quorum round closed without some)."""
    caught_up: bool = False
    """True when this peer had fallen behind: the result is the whole global model of round `round`."""
    phases: RoundPhases | None = None
    """Where the seconds went (None on a catch-up)."""

    @classmethod
    def of(
        cls,
        info: pb.RoundInfo,
        start: float,
        sent: int,
        received: int,
        *,
        caught_up: bool,
        phases: RoundPhases | None = None,
    ) -> SyncStats:
        """The stats of a round announced by `info`, begun at `time.perf_counter()` `start`."""
        return cls(
            time.perf_counter() - start,
            sent,
            received,
            info.round,
            info.merged,
            info.alpha,
            tuple(info.peers),
            caught_up,
            phases,
        )


@dataclass(frozen=True)
class ServerStatus:
    """The server's view of the run (`SyncClient.status`); rounds are -1 when there is none."""

    current_round: int
    open_round: int
    num_peers: int
    peers_joined: tuple[int, ...]
    peers_uploaded: tuple[int, ...]
    bytes_in: int
    bytes_out: int
    mode: str
    round_peers: tuple[int, ...] = ()
    missing_peers: tuple[int, ...] = ()
    dead_peer_policy: str = "wait"
    persistent: bool = False
    run_id: str = ""

    @classmethod
    def of(cls, reply: pb.StatusReply) -> ServerStatus:
        return cls(
            current_round=reply.current_round,
            open_round=reply.open_round,
            num_peers=reply.num_peers,
            peers_joined=tuple(reply.peers_joined),
            peers_uploaded=tuple(reply.peers_uploaded),
            bytes_in=reply.bytes_in,
            bytes_out=reply.bytes_out,
            mode=reply.mode,
            round_peers=tuple(reply.round_peers),
            missing_peers=tuple(reply.missing_peers),
            dead_peer_policy=reply.dead_peer_policy,
            persistent=reply.persistent,
            run_id=reply.run_id,
        )


SERVER_SETTING = "spes_config.server_addr"
"""The config key naming the server a client connects to: what a user checks when it cannot be reached."""


class SyncClient:
    """A peer's side of the rounds: join, sync, catch up, recover (thread-compatible, not thread-safe).

    The channel, the plane payloads travel on and the presence stream are its `connection`
    (`spes.sync.connection.Connection`).

    With `reuse_buffers`, downloads land in buffers kept from round to round (no fresh memory to fault in
    per round), so a `sync` result is only valid until the next call: for callers that copy it out at once,
    as the trainer does. On an int8 wire the result is the held model itself, which the caller must not change.
    """

    def __init__(
        self,
        spec: RunSpec,
        peer_id: int,
        settings: SpesConfig | None = None,
        *,
        token: str | None = None,
        reuse_buffers: bool = False,
        run_id: str | None = None,
    ) -> None:
        """A client of peer `peer_id` of the run `spec` (complete: manifest and sync_steps known), connecting as
        `settings` says (server_addr, TLS files, rpc_timeout_s, round_timeout_s, max_retries, data_plane; default:
        `SpesConfig()`'s); `token` is the run's secret (None: no authentication); `run_id` the run this node belongs
        to (its checkpoint's; default: `settings.run_id`, None for a node that starts fresh)."""
        s = SpesConfig() if settings is None else settings
        if not spec.complete:
            raise ValueError("a client needs a complete run spec (its manifest and sync_steps)")
        if not 0 <= peer_id < spec.num_peers:
            raise ValueError(f"peer_id {peer_id} is outside [0, num_peers={spec.num_peers})")
        self.spec, self.peer_id = spec, peer_id
        self.rpc_timeout_s, self.round_timeout_s, self.max_retries = s.rpc_timeout_s, s.round_timeout_s, s.max_retries
        self.run_id = run_id or s.run_id or ""
        """The run this node belongs to: the server's, once joined ("" for a fresh node before its first join)."""
        self.codec = spec.codec_impl.peer()
        """This peer's end of the run's codec (its state: a held model, error feedback)."""
        self.connection = Connection(s, peer_id, self.codec.raw_dtype, token)
        self._manifest: Manifest = dict(spec.manifest or {})
        self._trainable = spec.trainable(peer_id)
        self._own = set(spec.own(peer_id))
        """The trained names this peer downloads only on merge rounds (its expert blocks)."""
        self._joined = False
        self._buffers: dict[str, torch.Tensor] | None = {} if reuse_buffers else None

    @property
    def plane(self) -> Plane:
        """The plane tensor payloads travel on (`Connection.plane`)."""
        return self.connection.plane

    # -- public API ---------------------------------------------------------------------------
    def join(self) -> int:
        """Announce this peer's run spec and model manifest; returns the server's latest completed round (-1 before
        the first one). Raises SyncError when the server refuses (naming what differs)."""
        current = self._join(self._request(dry_run=False))
        self._joined = True
        return current

    def check_join(self, what: str = "preflight join") -> bool:
        """A dry join (`what` in its errors): the server runs every check of `join` (token, certificate, protocol,
        spec, manifest) and registers nothing; then `Connection.measure_link` uses the plane `sync` would. Whether
        the manifest was compared with the run's (False: a server without the run's YAML no peer has joined yet)."""
        request = self._request(dry_run=True)
        reply = self._retrying(
            what,
            lambda timeout: self.connection.stub.Join(request, timeout=timeout, metadata=self.connection.metadata),
            per_attempt_s=self.rpc_timeout_s,
        )
        if not reply.dry_run:
            raise SyncError(
                "the server predates preflight and took this dry join as a real Join (it now counts "
                f"peer {self.peer_id} as joined)",
                grpc.StatusCode.FAILED_PRECONDITION,
                reason=Reason.OLD_SERVER,
            )
        self.connection.use_data_plane(reply)
        return reply.manifest_checked

    def sync(
        self, step: int, tensors: Mapping[str, torch.Tensor], fragment: int = WHOLE
    ) -> tuple[dict[str, torch.Tensor], SyncStats]:
        """Upload this peer's trained `tensors` for round `step`, wait for the round, return the global tensors.

        `fragment` (`spes.sync.fragments`; WHOLE: every tensor): the part of the model the round covers, of which
        `tensors` are exactly the trained ones and the result is what this peer loads (not on a catch-up).

        The result holds CPU tensors in the wire dtype for every name this peer must load: shared tensors
        and the experts it does not own (its own too on merge rounds; everything in DiLoCo mode, and
        everything when `stats.caught_up`, in which case `stats.round` is the step to continue from).
        bf16 tensors stay bf16: the caller's `copy_` into its parameters widens them anyway, and widening
        here would cost a fresh fp32 copy of the download every round. With a held-model codec it is the new held
        model, every tensor (fp32).
        """
        manifest = self._require_joined()
        layout = self.spec.layout
        try:
            layout.check(fragment)
        except ValueError as exc:
            raise ValueError(f"sync() of round {step}: {exc}") from None
        trained = layout.names(fragment, self._trainable)
        check_upload(tensors, manifest, trained)
        start = time.perf_counter()
        deadline = Deadline(self.round_timeout_s)
        ordered = {name: tensors[name] for name in trained}

        def exchange(_timeout: float) -> tuple[int, tuple[pb.RoundInfo, Tensors, int], RoundPhases | None]:
            return self._exchange(step, ordered, manifest, fragment, deadline)

        caught_up = False
        try:
            sent, (info, downloaded, received), phases = self._retrying(
                "sync", exchange, deadline=deadline, recover=lambda failure: self._recover(failure, deadline)
            )
        except SyncError as err:
            if err.reason != Reason.STALE_ROUND:
                raise
            log.warning("peer %d is behind the run (%s): loading the latest global model", self.peer_id, err)
            sent, (info, downloaded, received), caught_up = 0, self._latest(step, manifest, deadline), True
            phases = None
        return downloaded, SyncStats.of(info, start, sent, received, caught_up=caught_up, phases=phases)

    def catch_up(self, step: int) -> tuple[Tensors, SyncStats] | None:
        """The whole global model of the server's latest round when the run has completed one past `step` (a node
        joining ahead of its checkpoint: a replacement, or one resumed from an older save), `caught_up` set; None
        when it has not. Trained on from `step`, the node would be refused as stale only a whole interval later."""
        manifest = self._require_joined()
        latest = self.status().current_round
        if latest <= step:
            return None
        start = time.perf_counter()
        info, downloaded, received = self._latest(step, manifest, Deadline(self.round_timeout_s), latest)
        return downloaded, SyncStats.of(info, start, 0, received, caught_up=True)

    def _exchange(
        self, step: int, ordered: Tensors, manifest: Manifest, fragment: int, deadline: Deadline
    ) -> tuple[int, tuple[pb.RoundInfo, Tensors, int], RoundPhases | None]:
        """One attempt at round `step`: the upload, then the download; and where its seconds went."""
        began = time.perf_counter()
        upload, digest = self.codec.upload(ordered, self._own), self.codec.digest(ordered)
        sent, duplicate = self.plane.upload(step, upload, deadline.left(), fragment, digest=digest)
        if duplicate:
            log.info("round %d: upload of peer %d was already committed", step, self.peer_id)
        uploaded = time.perf_counter()
        announced: list[float] = []
        got = self._download(step, manifest, deadline.left(), full=False, fragment=fragment, at=announced)
        phases = None
        if announced:
            phases = RoundPhases(uploaded - began, announced[-1] - uploaded, time.perf_counter() - announced[-1])
        return sent, got, phases

    def status(self) -> ServerStatus:
        """The server's current round, peers and traffic counters."""
        return ServerStatus.of(self.status_reply())

    def status_reply(self) -> pb.StatusReply:
        """The server's Status as it sent it (`spes.sync.status.describe` reads it)."""
        return self._retrying(
            "status",
            lambda timeout: self.connection.stub.Status(
                pb.StatusRequest(), timeout=timeout, metadata=self.connection.metadata
            ),
            per_attempt_s=self.rpc_timeout_s,
        )

    def close(self) -> None:
        self.connection.close()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- transfers ----------------------------------------------------------------------------
    def _request(self, *, dry_run: bool) -> pb.JoinRequest:
        return pb.JoinRequest(
            peer_id=self.peer_id,
            manifest=[pb.TensorSpec(name=n, shape=s) for n, s in self._manifest.items()],
            protocol=PROTOCOL_VERSION,
            dry_run=dry_run,
            spec=self.spec.to_proto(),
            run_id=self.run_id,
        )

    def _join(self, request: pb.JoinRequest, deadline: Deadline | None = None) -> int:
        """Join (again, within the round's `deadline` when a round asks)."""
        reply = self._retrying(  # NOTE: its retries name the setting to check when the server cannot be reached
            f"join of the parameter server at {SERVER_SETTING}={self.connection.settings.server_addr}",
            lambda timeout: self.connection.stub.Join(request, timeout=timeout, metadata=self.connection.metadata),
            per_attempt_s=self.rpc_timeout_s,
            deadline=deadline,
        )
        self.run_id = reply.run_id or self.run_id
        self.connection.joined(reply)
        return reply.current_round

    def _download(
        self,
        step: int,
        manifest: Manifest,
        timeout: float,
        *,
        full: bool,
        fragment: int = WHOLE,
        at: list[float] | None = None,
    ) -> tuple[pb.RoundInfo, Tensors, int]:
        """One download attempt over the plane in use: RoundInfo, then exactly the announced tensors, validated,
        committed by the codec (what the round served; a held-model codec's full values: its whole held model).
        `at` gets the `time.perf_counter()` at which the RoundInfo arrived."""
        names: list[str] = []
        decoders: list[TensorDecoder] = []

        def decoder_for(info: pb.RoundInfo) -> TensorDecoder:
            if at is not None:
                at.append(time.perf_counter())
            try:
                whole = self.codec.whole(info) and not full
            except ValueError as exc:
                raise SyncError(f"round {step}: {exc}") from None
            names.extend(announced(self.spec, self.peer_id, step, info, full=full, whole=whole, fragment=fragment))
            decoders.append(self.codec.decoder({n: manifest[n] for n in names}, self._buffers))
            return decoders[-1]

        info, _, received = self.plane.download(
            step, timeout, full=full, base_round=self.codec.base_round, decoder_for=decoder_for
        )
        serves = None if full else round_downloads(self.spec, self.peer_id, fragment, merged=info.merged)
        try:
            tensors = self.codec.receive(info, decoders[-1], caught_up=full, serves=serves)
        except ValueError as exc:
            raise SyncError(f"round {step}: bad download from the server: {exc}") from None
        return info, tensors, received

    def _latest(
        self, step: int, manifest: Manifest, deadline: Deadline, latest: int | None = None
    ) -> tuple[pb.RoundInfo, Tensors, int]:
        """Every tensor of the server's latest completed round (`latest`, when the caller has just asked the server),
        for a peer at `step` that fell behind."""
        latest = self.status().current_round if latest is None else latest
        if latest < step:
            raise SyncError(
                f"round {step} was refused as old, yet the server's latest completed round is {latest}: "
                "do all peers use the same sync_steps?",
                grpc.StatusCode.FAILED_PRECONDITION,
            )
        log.warning("peer %d continues from the server's round %d (it was at step %d)", self.peer_id, latest, step)
        return self._retrying(
            "catch-up download",
            lambda timeout: self._download(latest, manifest, timeout, full=True),
            deadline=deadline,
            recover=lambda failure: self._recover(failure, deadline),
        )

    def _recover(self, failure: SyncError, deadline: Deadline) -> bool:
        """React to what the server said: join again after a restart (told so, or its data plane gone and its gRPC
        side not knowing this peer), upload again when it lost the round, full values for another base; gRPC when
        the data plane is busy or gone while gRPC lives (one warning each time), nothing while the server is down.
        What the data plane's failure lost is asked once (`Connection.why_lost`), within the round's `deadline`."""
        lost = self.connection.why_lost(failure, deadline)
        if failure.reason == Reason.NOT_JOINED or lost == Lost.RESTARTED:
            log.warning("the server does not know peer %d (restarted?): joining again", self.peer_id)
            self._join(self._request(dry_run=False), deadline)
            return True
        if failure.reason == Reason.UNKNOWN_ROUND:
            log.warning("the server holds no upload of peer %d for this round: uploading again", self.peer_id)
            return True
        if failure.reason == Reason.BASE_MISMATCH and self.codec.forget():
            log.warning(
                "the server holds another model than peer %d's (%s): sending full values", self.peer_id, failure
            )
            return True
        return self.connection.fall_back(failure, lost)

    # -- helpers ------------------------------------------------------------------------------
    def _require_joined(self) -> Manifest:
        if not self._joined:
            raise SyncError("call join() before sync()")
        return self._manifest

    def _retrying(
        self,
        what: str,
        attempt: Callable[[float], T],
        *,
        per_attempt_s: float | None = None,
        deadline: Deadline | None = None,
        recover: Callable[[SyncError], bool] | None = None,
    ) -> T:
        """`spes.sync.retry.retrying` with this client's retries and round timeout; a server refusing this client's
        certificate, which gRPC reports as one going down, ends it at once (`certificate_refusal`)."""
        return retrying(
            what,
            attempt,
            max_retries=self.max_retries,
            per_attempt_s=per_attempt_s,
            deadline=deadline,
            recover=recover,
            refusal=lambda: certificate_refusal(self.connection.settings),
            closed=lambda: self.connection.closed,
        )


def announced(
    spec: RunSpec, peer: int, step: int, info: pb.RoundInfo, *, full: bool, whole: bool, fragment: int
) -> list[str]:
    """The names the server announced for round `step`, which must be exactly those `peer` expects over `fragment`
    (every tensor for a catch-up); when the codec's full values come (`whole`), every tensor the served model
    holds (with fragments, part of the model until each has had a round), the round's among them."""
    names, manifest = list(info.names), list(spec.manifest or {})
    expected = manifest if full else round_downloads(spec, peer, fragment, merged=info.merged)
    if whole and set(expected) <= set(names) <= set(manifest):
        expected = names
    if info.round != step or sorted(names) != sorted(expected):
        raise SyncError(
            f"round {step}: the server announced round {info.round} with {len(names)} tensors, this peer "
            f"expected round {step} with {len(expected)}"
        )
    return names


def round_downloads(spec: RunSpec, peer: int, fragment: int, *, merged: bool) -> list[str]:
    """What a download of `peer`'s round over `fragment` carries (its own blocks only when the round merged)."""
    return spec.downloads(peer, spec.layout.names(fragment, list(spec.manifest or {})), merged=merged)


def check_upload(tensors: Mapping[str, torch.Tensor], manifest: Manifest, trained: list[str]) -> None:
    """`tensors` must be exactly `trained` (the trainable tensors of the round's fragment), of the manifest's shapes."""
    missing = [n for n in trained if n not in tensors]
    extra = [n for n in tensors if n not in set(trained)]
    if missing or extra:
        raise ValueError(
            f"sync() needs exactly the trainable tensors announced at join (of the round's fragment): "
            f"missing {missing[:5]}, unexpected {extra[:5]}"
        )
    for name in trained:
        if tuple(tensors[name].shape) != manifest[name]:
            raise ValueError(
                f"tensor {name!r} has shape {list(tensors[name].shape)}, the manifest says {list(manifest[name])}"
            )
