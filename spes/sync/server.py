"""The SPES parameter server: the gRPC shell that moves tensors between peers and runs the round math.

Each round (keyed by the global step) collects one verified upload per peer, builds the global model with
`spes.sync.merge.build_global` (SPES round or DiLoCo average, outer optimizer, quorum) on its own thread,
persists it under `--state_dir` and serves it to every peer. The round rules live in `spes.sync.rounds`,
persistence in `spes.sync.state`; the handlers here only validate, move bytes and wait on one condition.

    python -m spes.server --total_peers 4 --num_train_experts_per_node 4 --port 50051 \\
        --merge_interval 500 --merge_alpha_start 0.01 --merge_decay_steps 10000 --state_dir server_state

Security: a shared token (env SPES_TOKEN or --token_file) is checked on every call before any handler runs,
TLS/mTLS from PEM files, and nothing received is ever unpickled (see `spes.sync.wire` and README "Security").
Off loopback the server refuses to start without a token, or with a token but no TLS, unless --insecure.
No call can hold it: streams take bounded slots and are closed when idle, one process per peer id
(`spes.sync.admission`); a Join's manifest is bounded (--max_tensors, --max_model_gb) or, given the run's
YAML (`python -m spes.server RUN.yaml`), must equal the model that YAML builds.
"""

from __future__ import annotations

import argparse
import ctypes
import ipaddress
import logging
import math
import signal
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from spes.moe import parse_expert_block
from spes.sync.auth import (
    TOKEN_ENV,
    TokenAuthInterceptor,
    check_peer_identity,
    grpc_common_name,
    read_token,
    tls_common_name,
    token_matches,
)
from spes.sync.buffers import BufferPool
from spes.sync.admission import SESSION_KEY, UNARY_RESERVE, GuardedHealth, Sessions, StreamGuard, Ticket
from spes.sync.merge import MergeConfig, OuterConfig, build_global, download_names
from spes.sync.proto import spes_pb2 as pb
from spes.sync.proto import spes_pb2_grpc as pb_grpc
from spes.sync.protocol import REASON_KEY, Mode, Reason, Refused, Shape, Tensors
from spes.sync.rounds import (
    MAX_MODEL_GB,
    MAX_TENSORS,
    DeadPeerPolicy,
    RoundPolicy,
    RoundState,
    check_join,
    expert_owners,
    manifest_differences,
)
from spes.sync import transport
from spes.sync.state import SavedRound, load_round, save_round
from spes.sync.wire import KEEPALIVE_SERVER_OPTIONS, CorruptChunk, EncodedModel, TensorDecoder, \
    VerifiedChecksums, encode_tensors, grpc_options, read_file, wire_torch_dtype

if TYPE_CHECKING:
    from spes.config import TrainConfig

log = logging.getLogger("spes.server")
T = TypeVar("T")

SERVICE_NAME = "spes.v1.ParameterServer"
DATA_POLL_S = 1.0
DATA_MAX_FRAME_BYTES = 1 << 20
"""Largest control frame the server reads (a hello or a tensor header: a few hundred bytes)."""


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """Everything the parameter server needs; built from the command line by `main`."""

    total_peers: int
    """Number of peers in the run."""
    experts_per_peer: int
    """Experts per ownership block (num_train_experts_per_node); peers must agree."""
    host: str = "0.0.0.0"
    """Interface to bind."""
    port: int = 50051
    """TCP port; 0 lets the OS choose (see `ParameterServer.port`)."""
    mode: Mode = "spes"
    """`spes` (experts from owners, shared averaged, merge warm-up) or `diloco` (average everything)."""
    merge: MergeConfig = field(default_factory=MergeConfig)
    """Expert-merging warm-up (SPES mode only)."""
    outer: OuterConfig = field(default_factory=OuterConfig)
    """DiLoCo outer optimizer (DiLoCo mode only)."""
    round_timeout_s: float = 3600.0
    """Seconds after a round's first upload after which it has timed out (see `dead_peer_policy`)."""
    dead_peer_policy: DeadPeerPolicy = "wait"
    """At the timeout, `wait` fails the waiting downloads naming the missing peers; `quorum` closes the round."""
    min_peers: int | None = None
    """Fewest peers a quorum round needs (None: a majority)."""
    state_dir: str | None = None
    """Directory where every completed round is persisted and from which a restarted server resumes."""
    token: str | None = field(default=None, repr=False)
    """Shared secret every call must carry; None disables authentication. Never logged."""
    tls_cert: str | None = None
    """PEM certificate chain of the server (enables TLS, with `tls_key`)."""
    tls_key: str | None = None
    """PEM private key of the server."""
    tls_client_ca: str | None = None
    """PEM CA bundle; when set, clients must present a certificate it signed (mutual TLS)."""
    tls_peer_ids: bool = False
    """With mutual TLS: a node may only act as the peer its certificate names (common name `peer-<id>`)."""
    max_message_mb: int = 4
    """gRPC message size limit in MiB: chunks are 1 MiB, so a larger message is refused unread."""
    data_port: int = -1
    """TCP port of the raw data plane for tensor payloads (`spes.sync.transport`); 0: OS-chosen, -1: disabled."""
    stream_idle_timeout_s: float = 60.0
    """A stream (either plane) that neither receives nor sends a message for this long is closed, its upload dropped."""
    max_streams: int = 64
    """Upload/Download streams served at once per plane; more are refused with RESOURCE_EXHAUSTED."""
    max_streams_per_peer: int = 6
    """Streams one peer id may hold open at once (both planes together)."""
    peer_liveness_s: float = 10.0
    """A joined peer without a presence stream heard from within this long is live (see `spes.sync.admission`)."""
    max_model_gb: float = MAX_MODEL_GB
    """Largest model (GB of fp32, 1e9 bytes) a Join's manifest may declare when the run's YAML is not given."""
    max_tensors: int = MAX_TENSORS
    """Most tensors a Join's manifest may declare."""
    expected_manifest: dict[str, Shape] | None = field(default=None, repr=False)
    """Every tensor of the run's model (from its YAML, `manifest_of_run`): joins must declare exactly this."""
    insecure: bool = False
    """Allow a non-loopback bind without a token, or with a token but without TLS."""

    def __post_init__(self) -> None:
        if self.total_peers < 1:
            raise ValueError(f"--total_peers must be >= 1, got {self.total_peers}")
        if self.experts_per_peer < 1:
            raise ValueError(f"--num_train_experts_per_node must be >= 1, got {self.experts_per_peer}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if not -1 <= self.data_port <= 65535:
            raise ValueError(f"--data_port must be -1 (disabled) or in [0, 65535], got {self.data_port}")
        if self.mode not in ("spes", "diloco"):
            raise ValueError(f"--mode must be 'spes' or 'diloco', got {self.mode!r}")
        self.policy()  # validates --round_timeout, --dead_peer_policy, --min_peers
        if self.max_message_mb < 2:
            raise ValueError(f"--max_message_mb must be >= 2 (chunks are 1 MiB), got {self.max_message_mb}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls_cert and --tls_key must be given together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls_client_ca (mutual TLS) needs --tls_cert and --tls_key")
        if self.tls_peer_ids and self.tls_client_ca is None:
            raise ValueError("--tls_peer_ids binds peer ids to client certificates: it needs mutual TLS "
                             "(--tls_client_ca, --tls_cert, --tls_key)")
        if self.token is not None and not self.token:
            raise ValueError("the auth token is empty: put a non-empty secret in SPES_TOKEN or --token_file")
        for flag, value in (("--stream_idle_timeout", self.stream_idle_timeout_s), ("--max_model_gb", self.max_model_gb),
                            ("--peer_liveness", self.peer_liveness_s), ("--max_streams", self.max_streams),
                            ("--max_streams_per_peer", self.max_streams_per_peer), ("--max_tensors", self.max_tensors)):
            if not value > 0:
                raise ValueError(f"{flag} must be > 0, got {value}")

    def check_exposure(self) -> None:
        """Refuse to serve off loopback without a token, or a token in clear text, unless `insecure` (ValueError)."""
        if self.insecure or _is_loopback(self.host):
            return
        if self.token is None:
            raise ValueError(f"--host {self.host} is reachable from other machines and no token is set: anyone could "
                             "join the run. Set SPES_TOKEN or --token_file (with --tls_cert/--tls_key), bind "
                             "--host 127.0.0.1, or pass --insecure on a trusted network")
        if self.tls_cert is None:
            raise ValueError(f"--host {self.host} is reachable from other machines and the token would travel in "
                             "clear text: add --tls_cert/--tls_key, or pass --insecure on a trusted network")

    def policy(self) -> RoundPolicy:
        return RoundPolicy(num_peers=self.total_peers, timeout_s=self.round_timeout_s,
                           dead_peer_policy=self.dead_peer_policy, min_peers=self.min_peers)

    def run_identity(self) -> dict[str, Any]:
        """The settings a persisted state must have been written with: those that fix what the model means.

        The merge warm-up, outer optimizer and dead-peer settings may change across a restart.
        """
        return {"total_peers": self.total_peers, "experts_per_peer": self.experts_per_peer, "mode": self.mode}


@dataclass(frozen=True)
class PeerInfo:
    """What a peer announced at Join."""

    wire_dtype: str
    trainable: tuple[str, ...]


class SpesServicer(pb_grpc.ParameterServerServicer):
    """gRPC handlers; all shared state is guarded by `self._cond`."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg, self.policy = cfg, cfg.policy()
        self._cond = threading.Condition()
        self.state = RoundState(cfg.total_peers)
        self._manifest: dict[str, Shape] | None = None
        self._owners: frozenset[int] = frozenset()
        self._peers: dict[int, PeerInfo] = {}
        self._bytes_in = self._bytes_out = self._round_bytes_in = self._logged_bytes_out = 0
        self._rounds_completed = 0
        self._shutting_down = False
        self._aggregator: threading.Thread | None = None
        self._encoded: dict[str, EncodedModel] = {}
        """The latest round's global model per wire dtype, each tensor encoded once for every download."""
        self._pool = BufferPool()
        self._checksums = VerifiedChecksums()
        """Of every staged upload: downloads send the experts taken from it verbatim without hashing them again."""
        self._readers: dict[int, int] = {}
        """Downloads in flight per completed round: its tensors are reused only once none reads them."""
        self._retired: dict[int, list[torch.Tensor]] = {}
        """Superseded global models that downloads still read, by round."""
        self.data_port = 0
        """Port of the running data plane, advertised at Join (0: none); set by `start_server`."""
        self.guard = StreamGuard(idle_timeout_s=cfg.stream_idle_timeout_s, max_streams=cfg.max_streams,
                                 max_per_peer=cfg.max_streams_per_peer)
        self.sessions = Sessions(cfg.peer_liveness_s)
        if cfg.expected_manifest is not None:
            self._learn_manifest(dict(cfg.expected_manifest))
        saved = load_round(cfg.state_dir, cfg.run_identity()) if cfg.state_dir else None
        if saved is not None:
            if cfg.expected_manifest is not None and manifest_differences(cfg.expected_manifest, saved.manifest):
                raise ValueError(f"--state_dir {cfg.state_dir} holds a different model than the run's YAML: "
                                 f"{manifest_differences(cfg.expected_manifest, saved.manifest)}")
            self.state.restore(saved.step, set(saved.peers), saved.global_model, saved.momentum, saved.merged,
                               saved.alpha)
            self._learn_manifest(saved.manifest)
            log.info("resumed from %s: round %d complete (peers %s); waiting for peers to re-join",
                     cfg.state_dir, saved.step, list(saved.peers))

    def _learn_manifest(self, shapes: dict[str, Shape]) -> None:
        self._manifest, self._owners = shapes, expert_owners(list(shapes), self.cfg.mode)

    def _buffer_limits(self) -> Counter[tuple[Shape, torch.dtype]]:
        """What one round takes from the pool: every joined peer's uploads, and the fp32 sums of shared
        tensors uploaded narrower than fp32 (lock held)."""
        assert self._manifest is not None
        limits = Counter((self._manifest[n], wire_torch_dtype(info.wire_dtype))
                         for info in self._peers.values() for n in info.trainable)
        narrow = {n for info in self._peers.values() if info.wire_dtype != "fp32" for n in info.trainable}
        averaged = [n for n in narrow if self.cfg.mode == "diloco" or parse_expert_block(n) is None]
        limits.update((self._manifest[n], torch.float32) for n in averaged)
        return limits

    # -- Join ---------------------------------------------------------------------------------
    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:
        cfg, peer, address = self.cfg, request.peer_id, context.peer()
        try:
            self._check_identity(peer, lambda: grpc_common_name(context))
            shapes, trainable = check_join(
                request, num_peers=cfg.total_peers, experts_per_peer=cfg.experts_per_peer, mode=cfg.mode,
                max_tensors=cfg.max_tensors,
                max_model_gb=None if cfg.expected_manifest is not None else cfg.max_model_gb)
            with self._cond:
                if self._manifest is not None:
                    diff = manifest_differences(self._manifest, shapes)
                    if diff:
                        whose = "the run's YAML" if cfg.expected_manifest is not None else "the run's"
                        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                                      f"peer {peer}'s model differs from {whose}: {diff}")
                if request.dry_run:  # preflight: every check above, nothing registered
                    log.info("preflight of peer %d: its settings and model match the run", peer)
                    return pb.JoinReply(current_round=-1, open_round=-1, data_port=self.data_port,
                                        manifest_checked=self._manifest is not None, dry_run=True)
                if self._manifest is None:
                    self._learn_manifest(shapes)
                    log.info("learned the model manifest from peer %d: %d tensors", peer, len(shapes))
                note = self.sessions.join(peer, _metadata(context, SESSION_KEY), address)
                self._peers[peer] = PeerInfo(request.wire_dtype, tuple(trainable))
                self._pool.set_limits(self._buffer_limits())
                snap = self.state.snapshot()
        except Refused as exc:
            self._abort(context, exc)
        log.info("peer %d joined from %s%s (wire %s, uploads %d tensors)", peer, address, note, request.wire_dtype,
                 len(trainable))
        return pb.JoinReply(current_round=_or_minus_one(snap.completed_round),
                            open_round=_or_minus_one(snap.open_round), data_port=self.data_port)

    # -- Upload -------------------------------------------------------------------------------
    def Upload(self, request_iterator: Iterator[pb.UploadMessage], context: grpc.ServicerContext) -> pb.UploadReply:
        def feed(decoder: TensorDecoder) -> None:
            for message in messages:
                if not message.HasField("chunk"):
                    raise ValueError("UploadMeta sent twice in one upload")
                decoder.feed(message.chunk)

        try:
            with self.guard.grpc_ticket(context) as ticket:
                messages = _watched(request_iterator, ticket)
                first = next(messages, None)
                if first is None or not first.HasField("meta"):
                    raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "an upload must start with its UploadMeta message")
                peer = first.meta.peer_id
                self._check_identity(peer, lambda: grpc_common_name(context))
                ticket.claim(peer)
                self._heard(peer, _metadata(context, SESSION_KEY))
                return self.upload(peer, first.meta.round, feed)
        except Refused as exc:
            self._abort(context, exc)
        except TimeoutError:  # the watchdog already ended the call (DEADLINE_EXCEEDED)
            return pb.UploadReply()

    def upload(self, peer: int, step: int, feed: Callable[[TensorDecoder], None]) -> pb.UploadReply:
        """One upload through the round rules, whatever carries it (gRPC stream or raw-TCP data plane).

        `feed(decoder)` is called only once the upload is admitted and must pass it every tensor; raises `Refused`.
        """
        with self._cond:
            info, manifest = self._joined(peer)
            if self.state.admit(peer, step):
                return self._upload_reply(step, duplicate=True)
        received = self._receive(feed, peer, step, info, manifest)
        if received is None:
            return pb.UploadReply()  # the peer went away mid-upload: nothing was kept
        tensors, checksums = received
        with self._cond:
            if self.state.admit(peer, step):  # a concurrent retry of this upload won the race
                self._pool.give(tensors.values())
                return self._upload_reply(step, duplicate=True)
            self._checksums.record(tensors, checksums, info.wire_dtype)
            if self.state.stage_upload(peer, step, tensors):
                self._close_round(step)
            self._cond.notify_all()
            return self._upload_reply(step, duplicate=False)

    def _receive(self, feed: Callable[[TensorDecoder], None], peer: int, step: int, info: PeerInfo,
                 manifest: dict[str, Shape]) -> tuple[Tensors, dict[str, int]] | None:
        """Decode and verify one upload into kept buffers sized by the manifest: the tensors and their checksums.

        None if the peer went away.
        """
        dtype = wire_torch_dtype(info.wire_dtype)
        buffers = {n: self._pool.take(manifest[n], dtype) for n in info.trainable}
        decoder = TensorDecoder({n: manifest[n] for n in info.trainable}, info.wire_dtype, into=buffers,
                                require_finite=True)
        try:
            feed(decoder)
            tensors = decoder.finish()
        except (grpc.RpcError, OSError):
            log.warning("upload of peer %d for round %d broke off after %d bytes; nothing was kept",
                        peer, step, decoder.bytes_received)
            self._pool.give(buffers.values())
            return None
        except ValueError as exc:
            self._pool.give(buffers.values())
            reason = Reason.CORRUPT if isinstance(exc, CorruptChunk) else Reason.NONE
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"upload of peer {peer} for round {step}: {exc}",
                          reason) from None
        finally:
            with self._cond:
                self._bytes_in += decoder.bytes_received
                self._round_bytes_in += decoder.bytes_received
        return tensors, decoder.checksums

    def _upload_reply(self, step: int, *, duplicate: bool) -> pb.UploadReply:
        snap = self.state.snapshot()
        uploaded = snap.uploaded_peers if snap.open_round == step else snap.round_peers
        return pb.UploadReply(round=step, duplicate=duplicate, uploaded_peers=uploaded)

    # -- aggregation --------------------------------------------------------------------------
    def _close_round(self, step: int) -> None:
        """Hand the open round's uploads to a new aggregation thread (caller holds the lock)."""
        uploads = self.state.take_uploads()
        self._aggregator = threading.Thread(target=self._aggregate, args=(step, uploads),
                                            name=f"aggregate-{step}", daemon=True)
        self._aggregator.start()

    def _aggregate(self, step: int, uploads: dict[int, Tensors]) -> None:
        """Build, persist and publish round `step`, then wake the waiting downloads."""
        cfg, start = self.cfg, time.perf_counter()
        with self._cond:  # NOTE: only this thread replaces these, in `complete` below.
            previous, momentum, peers = self.state.global_model, self.state.outer_momentum, set(self.state.uploaded)
            manifest = dict(self._manifest or {})
        received = [t for upload in uploads.values() for t in upload.values()]
        try:
            built = build_global(
                uploads, num_peers=cfg.total_peers, experts_per_peer=cfg.experts_per_peer, mode=cfg.mode, step=step,
                merge=cfg.merge, outer=cfg.outer, names=list(manifest), previous=previous, momentum=momentum,
                consume=True, empty=self._pool.take)
            global_model, new_momentum, alpha = built.tensors, built.momentum, built.alpha
            del uploads, previous, momentum
            self._pool.give(received, keep=[*global_model.values(), *new_momentum.values()])  # merged or converted
            del received
            if cfg.state_dir:
                saved = SavedRound(step, tuple(sorted(peers)), alpha > 0, alpha, manifest, global_model, new_momentum)
                save_round(cfg.state_dir, saved, cfg.run_identity())
        except Exception as exc:  # report any aggregation or disk failure to the waiting peers
            log.exception("round %d: aggregation failed", step)
            with self._cond:
                self.state.fail(step, f"aggregation of round {step} failed: {exc}")
                self._cond.notify_all()
            return
        with self._cond:
            superseded = self.state.completed_round
            if superseded is not None:
                self._retired[superseded] = list(self.state.global_model.values())
            self.state.complete(step, global_model, new_momentum, merged=alpha > 0, alpha=alpha)
            self._release_retired()
            self._encoded = {}
            self._rounds_completed += 1
            bytes_in, bytes_out = self._round_bytes_in, self._bytes_out - self._logged_bytes_out
            self._round_bytes_in, self._logged_bytes_out = 0, self._bytes_out
            self._cond.notify_all()
        missing = sorted(set(range(cfg.total_peers)) - peers)
        log.info("round %d complete: peers %d%s, in %.1f MiB, out %.1f MiB (since last round), aggregation %.2f s%s, "
                 "merged %s, alpha %.6g", step, len(peers), f" (quorum, missing {missing})" if missing else "",
                 bytes_in / 2**20, bytes_out / 2**20, time.perf_counter() - start,
                 ", persisted" if cfg.state_dir else "", "yes" if alpha > 0 else "no", alpha)

    # -- Download -----------------------------------------------------------------------------
    def Download(self, request: pb.DownloadRequest, context: grpc.ServicerContext) -> Iterator[pb.DownloadMessage]:
        context.add_callback(self._wake)
        try:
            ticket = self.guard.grpc_ticket(context)
        except Refused as exc:
            self._abort(context, exc)
        with ticket:
            try:
                self._check_identity(request.peer_id, lambda: grpc_common_name(context))
                ticket.claim(request.peer_id)
                self._heard(request.peer_id, _metadata(context, SESSION_KEY))
                ticket.wait_for_round(True)
                ready = self.download(request.peer_id, request.round, request.full, context.is_active,
                                      context.time_remaining())
                ticket.wait_for_round(False)
            except Refused as exc:
                self._abort(context, exc)
            if ready is None:
                return
            info, round_info, tensors, encoded = ready
            sent = 0
            try:
                yield pb.DownloadMessage(info=round_info)
                for chunk in encode_tensors(tensors, info.wire_dtype, encoded=encoded):
                    ticket.touch()  # the previous message went out
                    sent += len(chunk.data)
                    yield pb.DownloadMessage(chunk=chunk)
            finally:
                self.download_done(round_info.round, sent)

    def download(self, peer: int, step: int, full: bool, is_active: Callable[[], bool], time_left_s: float | None
                 ) -> tuple[PeerInfo, pb.RoundInfo, Tensors, EncodedModel] | None:
        """Wait for round `step` and select what `peer` gets, whatever carries it; None if the caller went away.

        Raises `Refused`. The caller sends the tensors in their encoded forms (shared by every download of the
        round) and must then call `download_done`, however the sending ends.
        """
        with self._cond:
            info, _ = self._joined(peer)
            if not self._await_round(peer, step, full, is_active, time_left_s):
                return None
            state = self.state
            global_model, merged, alpha = state.global_model, state.merged, state.alpha
            peers = state.completed_peers
            encoded = self._encoded.get(info.wire_dtype)
            if encoded is None:
                known = self._checksums.known(global_model, info.wire_dtype)
                encoded = self._encoded[info.wire_dtype] = EncodedModel(global_model, info.wire_dtype, known)
            self._readers[step] = self._readers.get(step, 0) + 1
        names = list(global_model) if full else download_names(list(global_model), peer, self.cfg.mode, merged)
        round_info = pb.RoundInfo(round=step, merged=merged, alpha=alpha, names=names, peers=sorted(peers))
        return info, round_info, {n: global_model[n] for n in names}, encoded

    def download_done(self, step: int, num_bytes: int) -> None:
        """A download of round `step` ended (sent or broken off) after `num_bytes` of payload."""
        with self._cond:
            self._bytes_out += num_bytes
            self._readers[step] -= 1
            if not self._readers[step]:
                del self._readers[step]
                self._release_retired()

    def _release_retired(self) -> None:
        """Give the pool the superseded rounds no download reads any more (lock held)."""
        read = [t for step, tensors in self._retired.items() if step in self._readers for t in tensors]
        keep = [*self.state.global_model.values(), *self.state.outer_momentum.values(), *read]
        for step in [s for s in self._retired if s not in self._readers]:
            self._pool.give(self._retired.pop(step), keep=keep)

    def _await_round(self, peer: int, step: int, full: bool, is_active: Callable[[], bool],
                     time_left_s: float | None) -> bool:
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
            if state.must_close(self.policy, self._owners):
                log.warning("round %d timed out: closing it with peers %s (--dead_peer_policy quorum)",
                            step, sorted(state.uploaded))
                self._close_round(step)
                continue
            # NOTE: the data plane cannot be woken when its client hangs up, so it polls once a second.
            wait = min(state.seconds_left(self.policy), give_up - time.monotonic(), DATA_POLL_S)
            self._cond.wait(wait)

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # -- raw-TCP data plane (spes.sync.transport) -------------------------------------------------
    def serve_data(self, sock: socket.socket) -> None:
        """One data-plane operation: the same round logic as Upload/Download, the payload as raw bytes.

        Every receive is bounded by --stream_idle_timeout (the socket's timeout, set by the listener).
        """
        hello = transport.recv_hello(sock, DATA_MAX_FRAME_BYTES)
        if not token_matches(hello.get("token"), self.cfg.token):
            log.warning("refused a data-plane connection: missing or wrong token")
            transport.close_after_error(sock, transport.error_frame(
                "UNAUTHENTICATED", "missing or wrong token: set SPES_TOKEN (or token_file) to this run's shared "
                "secret", Reason.UNAUTHENTICATED))
            return
        op, peer, step = hello.get("op"), hello.get("peer_id"), hello.get("step")
        if op == "ping":  # a client checking at join that this port is reachable from where it runs
            transport.send_frame(sock, {"status": "ok"})
            return
        if op == "probe":  # preflight's link test: counted in no traffic figure
            transport.serve_probe(sock, hello)
            return
        try:
            if not isinstance(peer, int) or not isinstance(step, int) or op not in ("upload", "download"):
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                              f"bad data-plane request: op {op!r}, peer_id {peer!r}, step {step!r}")
            self._check_identity(peer, lambda: tls_common_name(sock))
            with self.guard.admit(None, total=False) as ticket:  # NOTE: the listener bounds the total
                ticket.claim(peer)
                self._heard(peer, str(hello.get("session") or ""))
                if op == "upload":
                    self._serve_upload(sock, peer, step)
                else:
                    self._serve_download(sock, peer, step, bool(hello.get("full")), hello.get("timeout_s"))
        except Refused as exc:
            log.warning("refused (%s): %s", exc.code.name, exc)
            transport.close_after_error(sock, transport.error_frame(exc.code.name, str(exc), exc.reason))

    def _serve_upload(self, sock: socket.socket, peer: int, step: int) -> None:
        received = False

        def feed(decoder: TensorDecoder) -> None:
            nonlocal received
            transport.send_frame(sock, {"status": "send"})
            transport.recv_tensors(sock, decoder, len(decoder.expected), DATA_MAX_FRAME_BYTES)
            received = True

        reply = self.upload(peer, step, feed)
        if not received and not reply.duplicate:
            return  # the peer went away mid-upload: nothing was kept, nobody to answer
        transport.send_frame(sock, {"status": "ok", "round": reply.round, "duplicate": reply.duplicate,
                                    "uploaded_peers": list(reply.uploaded_peers)})

    def _serve_download(self, sock: socket.socket, peer: int, step: int, full: bool, timeout_s: object) -> None:
        time_left = float(timeout_s) if isinstance(timeout_s, (int, float)) and timeout_s > 0 else None
        ready = self.download(peer, step, full, lambda: not transport.peer_closed(sock), time_left)
        if ready is None:
            return
        info, round_info, tensors, encoded = ready
        sent = 0
        try:
            transport.send_frame(sock, {"status": "ok", "round": round_info.round, "merged": round_info.merged,
                                        "alpha": round_info.alpha, "names": list(round_info.names),
                                        "peers": list(round_info.peers)})
            sent = transport.send_tensors(sock, tensors, info.wire_dtype, encoded)
        finally:
            self.download_done(round_info.round, sent)

    # -- Probe (preflight link test) -----------------------------------------------------------
    def Probe(self, request_iterator: Iterator[pb.ProbeMessage], context: grpc.ServicerContext
              ) -> Iterator[pb.ProbeMessage]:
        """Read the client's bytes, acknowledge, send `reply_bytes` back; counted in no traffic figure."""
        reply_bytes, received = 0, 0
        for index, message in enumerate(request_iterator):
            if index == 0:
                reply_bytes = message.reply_bytes
            received += len(message.data)
            if received > transport.PROBE_MAX_BYTES or reply_bytes > transport.PROBE_MAX_BYTES:
                self._abort(context, Refused(grpc.StatusCode.INVALID_ARGUMENT,
                                             f"a link test moves at most {transport.PROBE_MAX_BYTES} bytes each way"))
        yield pb.ProbeMessage()
        chunk = bytes(min(reply_bytes, transport.PROBE_CHUNK_BYTES))
        for offset in range(0, reply_bytes, len(chunk) or 1):
            yield pb.ProbeMessage(data=chunk[: reply_bytes - offset])

    # -- Status -------------------------------------------------------------------------------
    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        with self._cond:
            snap = self.state.snapshot()
            return pb.StatusReply(
                current_round=_or_minus_one(snap.completed_round),
                open_round=_or_minus_one(snap.open_round),
                total_peers=self.cfg.total_peers,
                peers_joined=sorted(self._peers),
                peers_uploaded=snap.uploaded_peers,
                bytes_in=self._bytes_in,
                bytes_out=self._bytes_out,
                mode=self.cfg.mode,
                round_peers=snap.round_peers,
                missing_peers=self.state.missing_peers() if snap.open_round is not None else [],
                open_round_age_s=snap.open_age_s,
                dead_peer_policy=self.cfg.dead_peer_policy,
                rounds_completed=self._rounds_completed,
                persistent=self.cfg.state_dir is not None,
            )

    # -- helpers ------------------------------------------------------------------------------
    def _joined(self, peer: int) -> tuple[PeerInfo, dict[str, Shape]]:
        """The peer's Join record (caller holds the lock); refuses peers that have not joined."""
        if peer not in self._peers or self._manifest is None:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          f"peer {peer} has not joined this server: call Join first", Reason.NOT_JOINED)
        return self._peers[peer], self._manifest

    def presence(self, peer: int, session: str, address: str) -> Callable[[], None]:
        """A peer process's presence stream opened (see `spes.sync.admission`); returns what to call when it ends."""
        with self._cond:
            self.sessions.present(peer, session, address)

        def ended() -> None:
            with self._cond:
                self.sessions.absent(peer, session)

        return ended

    def _heard(self, peer: int, session: str) -> None:
        """A call of `session` for `peer`: refresh its liveness, refuse it if another process replaced it."""
        with self._cond:
            self.sessions.heard(peer, session)

    def _check_identity(self, peer: int, common_name: Callable[[], str | None]) -> None:
        """With --tls_peer_ids: the caller's certificate (its common name, from either plane) must name `peer`."""
        if self.cfg.tls_peer_ids:
            check_peer_identity(peer, common_name())

    @staticmethod
    def _abort(context: grpc.ServicerContext, exc: Refused) -> NoReturn:
        log.warning("refused (%s): %s", exc.code.name, exc)
        if exc.reason:
            context.set_trailing_metadata(((REASON_KEY, exc.reason),))
        context.abort(exc.code, str(exc))
        raise AssertionError("unreachable: context.abort raises")

    def shutdown(self, grace_s: float) -> None:
        """Wake every waiting download so it ends with UNAVAILABLE; let a running aggregation finish."""
        with self._cond:
            self._shutting_down = True
            self._cond.notify_all()
            aggregator = self._aggregator
        if aggregator is not None:
            aggregator.join(timeout=grace_s)
        self.guard.stop()


def _metadata(context: grpc.ServicerContext, key: str) -> str:
    """The value of invocation metadata `key` ('' when absent)."""
    return next((str(v) for k, v in (context.invocation_metadata() or ()) if k == key), "")


def _watched(messages: Iterator[pb.UploadMessage], ticket: Ticket) -> Iterator[pb.UploadMessage]:
    """The stream's messages, each one resetting its idle clock; TimeoutError if the watchdog ended it."""
    for message in messages:
        ticket.touch()
        yield message
    ticket.check()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _or_minus_one(value: int | None) -> int:
    return -1 if value is None else value


class ParameterServer:
    """A running server: the gRPC server, its servicer and health service. Stop with `stop()`."""

    def __init__(self, server: grpc.Server, servicer: SpesServicer, health_servicer: health.HealthServicer,
                 port: int, executor: futures.ThreadPoolExecutor,
                 data_plane: transport.DataPlaneListener | None = None) -> None:
        self.server, self.servicer, self.health, self.port = server, servicer, health_servicer, port
        self._executor, self._data_plane = executor, data_plane
        self.data_port = data_plane.port if data_plane is not None else 0
        """The raw data plane's port (0: disabled)."""

    def stop(self, grace_s: float = 2.0) -> None:
        """Stop serving: waiting downloads end with UNAVAILABLE, in-flight calls get `grace_s` seconds."""
        self.health.enter_graceful_shutdown()
        self.servicer.shutdown(grace_s)
        if self._data_plane is not None:
            self._data_plane.stop()
        self.server.stop(grace_s).wait()
        self._executor.shutdown(wait=False)  # NOTE: grpc leaves its handler threads running otherwise


def start_server(cfg: ServerConfig) -> ParameterServer:
    """Restore `cfg.state_dir` if it holds a round, then bind and start the server (non-blocking)."""
    cfg.check_exposure()
    servicer = SpesServicer(cfg)
    try:
        return _serve(cfg, servicer)
    except BaseException:
        servicer.guard.stop()
        raise


def _serve(cfg: ServerConfig, servicer: SpesServicer) -> ParameterServer:
    interceptors = [TokenAuthInterceptor(cfg.token)] if cfg.token is not None else []
    # NOTE: streams hold at most `max_streams` threads (StreamGuard); the rest serve Join, Status and health.
    executor = futures.ThreadPoolExecutor(max_workers=cfg.max_streams + UNARY_RESERVE, thread_name_prefix="spes-rpc")
    server = grpc.server(
        executor,
        interceptors=interceptors,
        # NOTE: no SO_REUSEPORT: a second server on the same port must fail, not share the peers' calls.
        options=[*grpc_options(cfg.max_message_mb), ("grpc.so_reuseport", 0), *KEEPALIVE_SERVER_OPTIONS],
    )
    pb_grpc.add_ParameterServerServicer_to_server(servicer, server)
    health_servicer = GuardedHealth(servicer.guard, servicer.presence)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{cfg.host}:{cfg.port}"
    if cfg.tls_cert is not None and cfg.tls_key is not None:
        credentials = grpc.ssl_server_credentials(
            [(read_file(cfg.tls_key, "--tls_key"), read_file(cfg.tls_cert, "--tls_cert"))],
            root_certificates=read_file(cfg.tls_client_ca, "--tls_client_ca") if cfg.tls_client_ca else None,
            require_client_auth=cfg.tls_client_ca is not None,
        )
        port = _bind(lambda: server.add_secure_port(address, credentials), address, "--port")
    else:
        port = _bind(lambda: server.add_insecure_port(address), address, "--port")
    data_plane = None
    if cfg.data_port >= 0:
        tls = transport.server_tls(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca)
        data_plane = _bind(lambda: transport.DataPlaneListener(
            cfg.host, cfg.data_port, servicer.serve_data, tls=tls, max_connections=cfg.max_streams,
            io_timeout_s=cfg.stream_idle_timeout_s), f"{cfg.host}:{cfg.data_port}", "--data_port")
        servicer.data_port = data_plane.port
    server.start()
    for service in ("", SERVICE_NAME):
        health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    return ParameterServer(server, servicer, health_servicer, port, executor, data_plane)


def _bind(listen: Callable[[], T], address: str, flag: str) -> T:
    """`listen()`, with a failure to bind (grpc: RuntimeError or port 0; sockets: OSError) as one ValueError."""
    try:
        bound = listen()
    except OSError as exc:
        raise ValueError(f"cannot listen on {address} ({exc.strerror}): stop the process using it or pick another "
                         f"{flag}") from None
    except RuntimeError:  # grpc's text adds nothing: it only says that binding failed
        bound = 0
    if bound == 0:
        raise ValueError(f"cannot listen on {address}: is another server using the port? stop it or pick another "
                         f"{flag}")
    return bound


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m spes.server",
        description="SPES parameter server: collects every peer's trained tensors each round, takes each expert "
        "block from its owner, averages the shared parameters (DiLoCo: everything), applies the expert-merging "
        "warm-up on merge rounds, persists the result (--state_dir) and serves the global model back.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="example: SPES_TOKEN=$(cat secret) python -m spes.server --total_peers 4 --num_train_experts_per_node "
        "4 --port 50051 --tls_cert server.crt --tls_key server.key --state_dir server_state. Peers connect with "
        "spes.sync.client.SyncClient; stop with SIGTERM or Ctrl-C (exit 0); restart with the same --state_dir to "
        "resume. See README 'Security'.",
    )
    add = parser.add_argument_group
    parser.add_argument("run", nargs="?", metavar="RUN.yaml", default=None,
                        help="a node YAML of the run (optional): the server then computes the model's manifest "
                        "itself and refuses any node whose model differs; --total_peers, "
                        "--num_train_experts_per_node and --mode default to the YAML's")
    run = add("run")
    run.add_argument("--total_peers", type=int, default=None, help="number of peers (nodes) in the run (required "
                     "without RUN.yaml)")
    run.add_argument("--num_train_experts_per_node", type=int, default=None,
                     help="experts per ownership block; peer p owns experts [p*k, (p+1)*k) of every layer (required "
                     "without RUN.yaml)")
    run.add_argument("--mode", choices=("spes", "diloco"), default=None,
                     help="spes: experts from their owners + averaged shared params; diloco: average everything "
                     "(default: the YAML's, else spes)")
    run.add_argument("--state_dir", default=None,
                     help="persist every completed round here (atomically) and resume from it on restart")
    rounds = add("rounds and dead peers")
    rounds.add_argument("--round_timeout", type=float, default=3600.0,
                        help="seconds after a round's first upload after which it has timed out")
    rounds.add_argument("--dead_peer_policy", choices=("wait", "quorum"), default="wait",
                        help="at the timeout, wait: fail the waiting downloads naming the missing peers; quorum: "
                        "close the round with the peers that arrived (missing owners' experts keep their last value)")
    rounds.add_argument("--min_peers", type=int, default=None,
                        help="fewest peers a quorum round needs (default: a majority)")
    net = add("network")
    net.add_argument("--host", default="0.0.0.0", help="interface to bind")
    net.add_argument("--port", type=int, default=50051, help="TCP port (0: let the OS choose; the log says which)")
    net.add_argument("--max_message_mb", type=int, default=4, help="gRPC message size limit (MiB)")
    net.add_argument("--data_port", type=int, default=-1,
                     help="TCP port of the raw data plane for tensor payloads, ~10x faster than gRPC (0: let the OS "
                     "choose, advertised to peers at Join; -1: disabled, tensors go over gRPC)")
    limits = add("limits (what no peer, careless or hostile, may exceed)")
    limits.add_argument("--stream_idle_timeout", type=float, default=60.0,
                        help="close an upload/download stream (either plane) that sends nothing for this many "
                        "seconds (DEADLINE_EXCEEDED); its partial upload is dropped")
    limits.add_argument("--max_streams", type=int, default=64,
                        help="upload/download streams served at once per plane; more: RESOURCE_EXHAUSTED")
    limits.add_argument("--max_streams_per_peer", type=int, default=6,
                        help="streams one peer id may hold open at once; more: RESOURCE_EXHAUSTED")
    limits.add_argument("--max_model_gb", type=float, default=MAX_MODEL_GB,
                        help="without RUN.yaml: largest model (GB in fp32) a join may declare (the paper's 9B "
                        "upcycled config is 37.7 GB)")
    limits.add_argument("--max_tensors", type=int, default=MAX_TENSORS,
                        help="most tensors a join's manifest may declare (the 9B upcycled config has 591)")
    limits.add_argument("--peer_liveness", type=float, default=10.0,
                        help="a second process joining with a live peer's peer_id is refused (ALREADY_EXISTS); a "
                        "peer is live while its presence stream is open (spes clients keep one), or, a client "
                        "without one, when heard from within this many seconds")
    merge = add("expert-merging warm-up (spes mode)")
    merge.add_argument("--merge_interval", type=int, default=500,
                       help="merge on steps that are multiples of this (<=0: never)")
    merge.add_argument("--merge_alpha_start", type=float, default=0.01,
                       help="merge strength at step 0, decayed linearly")
    merge.add_argument("--merge_decay_steps", type=int, default=10000, help="step at which the merge strength is 0")
    merge.add_argument("--merge_topk", type=int, default=4, help="most similar other experts each is pulled towards")
    outer = add("DiLoCo outer optimizer (diloco mode)")
    outer.add_argument("--outer_optimizer", choices=("none", "nesterov"), default="none",
                       help="none: global = mean of uploads; nesterov: Nesterov SGD on (previous global - mean)")
    outer.add_argument("--outer_lr", type=float, default=0.7, help="outer learning rate")
    outer.add_argument("--outer_momentum", type=float, default=0.9, help="outer Nesterov momentum")
    sec = add("security")
    sec.add_argument("--token_file", default=None,
                     help=f"file holding the run's shared secret (default: env {TOKEN_ENV}; neither: no auth)")
    sec.add_argument("--tls_cert", default=None, help="PEM certificate chain (enables TLS)")
    sec.add_argument("--tls_key", default=None, help="PEM private key for --tls_cert")
    sec.add_argument("--tls_client_ca", default=None, help="PEM CA that must have signed client certificates (mTLS)")
    sec.add_argument("--tls_peer_ids", action="store_true",
                     help="with mTLS, a node may only act as the peer its certificate names (CN peer-<id>)")
    sec.add_argument("--insecure", action="store_true",
                     help="allow a non-loopback --host without a token, or with a token but without TLS (refused "
                     "otherwise: anyone on the network could join, or read the token)")
    parser.add_argument("--log_level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    return parser


def manifest_of_run(path: str) -> tuple[dict[str, Shape], TrainConfig]:
    """The name and shape of every tensor of the run's model (built on the meta device) and the run's config."""
    from spes.config import load_config  # NOTE: lazy, so a server without RUN.yaml never imports the model
    from spes.model import Transformer

    cfg, _ = load_config(path)
    with torch.device("meta"):
        model = Transformer.for_run(cfg)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}, cfg


def _run_settings(args: argparse.Namespace) -> tuple[int, int, Mode, dict[str, Shape] | None]:
    """--total_peers, --num_train_experts_per_node, --mode and the expected manifest: from the flags and RUN.yaml,
    which must agree."""
    given = {"--total_peers": args.total_peers, "--num_train_experts_per_node": args.num_train_experts_per_node,
             "--mode": args.mode}
    manifest = None
    if args.run is not None:
        manifest, run = manifest_of_run(args.run)
        of_run = {"--total_peers": run.spes_config.num_peers, "--num_train_experts_per_node": run.experts_per_peer,
                  "--mode": "diloco" if run.using_dilico else "spes"}
        for flag, value in given.items():
            if value is not None and value != of_run[flag]:
                raise ValueError(f"{flag}={value} disagrees with {args.run}, whose run has {of_run[flag]}: drop the "
                                 "flag or fix the YAML")
        given = of_run
    missing = [flag for flag in ("--total_peers", "--num_train_experts_per_node") if given[flag] is None]
    if missing:
        raise ValueError(f"{' and '.join(missing)} required (or give the run's YAML as RUN.yaml)")
    return given["--total_peers"], given["--num_train_experts_per_node"], given["--mode"] or "spes", manifest


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    total_peers, experts_per_peer, mode, manifest = _run_settings(args)
    return ServerConfig(
        total_peers=total_peers, experts_per_peer=experts_per_peer, host=args.host,
        port=args.port, mode=mode,
        merge=MergeConfig(interval=args.merge_interval, alpha_start=args.merge_alpha_start,
                          decay_steps=args.merge_decay_steps, topk=args.merge_topk),
        outer=OuterConfig(optimizer=args.outer_optimizer, lr=args.outer_lr, momentum=args.outer_momentum),
        round_timeout_s=args.round_timeout, dead_peer_policy=args.dead_peer_policy, min_peers=args.min_peers,
        state_dir=args.state_dir, token=read_token(args.token_file, "--token_file"), tls_cert=args.tls_cert,
        tls_key=args.tls_key, tls_client_ca=args.tls_client_ca, tls_peer_ids=args.tls_peer_ids,
        max_message_mb=args.max_message_mb, data_port=args.data_port,
        stream_idle_timeout_s=args.stream_idle_timeout, max_streams=args.max_streams,
        max_streams_per_peer=args.max_streams_per_peer, peer_liveness_s=args.peer_liveness,
        max_model_gb=args.max_model_gb, max_tensors=args.max_tensors, expected_manifest=manifest,
        insecure=args.insecure,
    )


def limit_malloc_arenas(arenas: int = 2) -> None:
    """Cap glibc's malloc arenas (as MALLOC_ARENA_MAX would) for a long-lived server process.

    NOTE: each data-plane connection runs on a new thread, and glibc gives threads their own arenas (up to
    8 per core), whose freed pages it keeps: measured in bench/bench_soak.py, RSS crept ~40 KiB per round
    without this and stayed flat with it. A no-op off glibc.
    """
    try:
        ctypes.CDLL("libc.so.6").mallopt(-8, arenas)  # -8: M_ARENA_MAX
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    """Run the server until SIGTERM/SIGINT, then shut down cleanly and return 0."""
    limit_malloc_arenas()
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stop.set())
    try:
        cfg = config_from_args(args)
        server = start_server(cfg)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    shown = replace(cfg, port=server.port)  # the token field is repr=False: never logged
    log.info("spes parameter server listening on %s:%d (data plane %s, auth %s, tls %s) %s", cfg.host, server.port,
             server.data_port or "off",
             "on" if cfg.token else "OFF", "mutual" if cfg.tls_client_ca else ("on" if cfg.tls_cert else "off"), shown)
    if cfg.token is None:
        log.warning("no SPES_TOKEN or --token_file: anyone who can reach this port can join the run")
    try:
        stop.wait()
    finally:
        log.info("shutting down")
        server.stop(grace_s=2.0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
