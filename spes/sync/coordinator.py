"""The parameter server's round service, free of any transport: what both planes call.

A `Coordinator` holds the run (manifest, joined peers, sessions, the `RoundState`), admits each stream, takes
uploads through the round rules, builds every round with `spes.sync.merge.build_global` on its own thread,
persists it (`spes.sync.state`) and hands each download the tensors it needs. The gRPC handlers
(`spes.sync.plane_grpc`) and the raw-TCP data plane (`spes.sync.plane_tcp`) only move bytes: an upload is a
`feed(decoder)` callback, a download an `Outgoing` the plane sends. All shared state is guarded by one condition.

On an int8 wire (`spes.sync.deltas`) an upload's deltas become values against the completed round's global and
held models, and each round also makes the next held model and the deltas the up-to-date peers download.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import torch

from spes.moe import parse_expert_block
from spes.sync.admission import Sessions, StreamGuard, Ticket
from spes.sync.auth import check_peer_identity
from spes.sync.buffers import BufferPool
from spes.sync.compress import Int8Payload, upload_values
from spes.sync.deltas import NO_BASE, HeldRound, next_held
from spes.sync.fragments import WHOLE, Layout
from spes.sync.merge import build_global, download_names
from spes.sync.proto import spes_pb2 as pb
from spes.sync.protocol import INT8, Manifest, Reason, Refused, Shape, Tensors, values_dtype
from spes.sync.rounds import RoundState, check_join, manifest_differences
from spes.sync.state import SavedRound, load_round, save_round
from spes.sync.wire import (
    BaseMismatch,
    CorruptChunk,
    Delta,
    EncodedModel,
    Item,
    TensorDecoder,
    VerifiedChecksums,
    finite,
    wire_torch_dtype,
)

if TYPE_CHECKING:
    from spes.sync.server import ServerConfig

log = logging.getLogger("spes.server")

WAIT_POLL_S = 1.0
"""A waiting download re-checks its caller this often (the data plane cannot be woken when its client hangs up)."""


@dataclass(frozen=True)
class PeerInfo:
    """What a peer announced at Join."""

    wire_dtype: str
    trainable: tuple[str, ...]


@dataclass(frozen=True)
class Base:
    """Int8 wire: the completed round an upload's deltas apply to (pinned while they are turned into values)."""

    global_model: Tensors
    held: HeldRound


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
        self.cfg, self.policy = cfg, cfg.policy()
        self.num_peers = cfg.num_peers
        self.int8 = cfg.wire_dtype == INT8
        self._cond = threading.Condition()
        self.state = RoundState(self.num_peers)
        self._manifest: Manifest | None = None
        self._layout: Layout | None = None
        """How the run cuts its model into fragments (`spes.sync.fragments`), as the first peer to join said."""
        self.peers: dict[int, PeerInfo] = {}
        self._bytes_in = self._bytes_out = self._round_bytes_in = self._logged_bytes_out = 0
        self._rounds_completed = 0
        self._shutting_down = False
        self._aggregator: threading.Thread | None = None
        self._encoded: dict[str, EncodedModel] = {}
        """The latest round's global model per wire dtype (int8 wire: its deltas, and its held model as full
        values), each tensor encoded once for every download."""
        self._pool = BufferPool()
        self._checksums = VerifiedChecksums()
        """Of every staged upload: downloads send the experts taken from it verbatim without hashing them again."""
        self._readers: dict[int, int] = {}
        """Downloads in flight per completed round: its tensors are reused only once none reads them."""
        self._retired: dict[int, list[torch.Tensor]] = {}
        """Superseded global models that downloads still read, by round."""
        self.data_port = 0
        """Port of the running data plane, advertised at Join (0: none); set by `start_server`."""
        self.guard = StreamGuard(
            idle_timeout_s=cfg.stream_idle_timeout_s, max_streams=cfg.max_streams, max_per_peer=cfg.max_streams_per_peer
        )
        self.sessions = Sessions(cfg.peer_liveness_s)
        if cfg.expected_manifest is not None:
            self._manifest = dict(cfg.expected_manifest)
        saved = load_round(cfg.state_dir, cfg.run_identity()) if cfg.state_dir else None
        if saved is not None:
            if cfg.expected_manifest is not None and manifest_differences(cfg.expected_manifest, saved.manifest):
                raise ValueError(
                    f"--state_dir {cfg.state_dir} holds a different model than the run's YAML: "
                    f"{manifest_differences(cfg.expected_manifest, saved.manifest)}"
                )
            held = HeldRound(saved.step, saved.held or saved.global_model, {}, None) if self.int8 else None
            self.state.restore(
                saved.step,
                set(saved.peers),
                saved.global_model,
                saved.momentum,
                saved.merged,
                saved.alpha,
                held,
                saved.fragment,
            )
            self._manifest = saved.manifest
            self._layout = Layout.of(saved.manifest, saved.fragments, saved.sync_steps, cfg.mode)
            log.info(
                "resumed from %s: round %d complete (peers %s); waiting for peers to re-join",
                cfg.state_dir,
                saved.step,
                list(saved.peers),
            )

    def _buffer_limits(self) -> Counter[tuple[Shape, torch.dtype]]:
        """What one round takes from the pool: every joined peer's uploads, and the fp32 sums of shared
        tensors uploaded narrower than fp32 (lock held)."""
        assert self._manifest is not None
        limits = Counter(
            (self._manifest[n], wire_torch_dtype(values_dtype(info.wire_dtype)))
            for info in self.peers.values()
            for n in info.trainable
        )
        narrow = {n for info in self.peers.values() if values_dtype(info.wire_dtype) != "fp32" for n in info.trainable}
        averaged = [n for n in narrow if self.cfg.mode == "diloco" or parse_expert_block(n) is None]
        limits.update((self._manifest[n], torch.float32) for n in averaged)
        return limits

    # -- Join ---------------------------------------------------------------------------------
    def join(
        self, request: pb.JoinRequest, session: str, address: str, common_name: Callable[[], str | None]
    ) -> pb.JoinReply:
        """Check a Join against the run and register the peer (a dry run registers nothing); raises Refused."""
        cfg, peer = self.cfg, request.peer_id
        self.check_identity(peer, common_name)
        shapes, trainable = check_join(
            request,
            num_peers=self.num_peers,
            experts_per_peer=cfg.experts_per_peer,
            mode=cfg.mode,
            wire_dtype=cfg.wire_dtype,
            max_tensors=cfg.max_tensors,
            max_model_gb=None if cfg.expected_manifest is not None else cfg.max_model_gb,
        )
        with self._cond:
            if self._manifest is not None:
                diff = manifest_differences(self._manifest, shapes)
                if diff:
                    whose = "the run's YAML" if cfg.expected_manifest is not None else "the run's"
                    raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"peer {peer}'s model differs from {whose}: {diff}")
            count = max(request.fragments, 1)
            layout = Layout.of(shapes, count, request.sync_steps if count > 1 else 0, cfg.mode)
            if self._layout is not None and (layout.count, layout.sync_steps) != (
                self._layout.count,
                self._layout.sync_steps,
            ):
                raise Refused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"peer {peer} synchronizes {layout.count} fragment(s) with sync_steps={layout.sync_steps}, the "
                    f"run's peers {self._layout.count} with sync_steps={self._layout.sync_steps}: set "
                    "spes_config.sync_steps and overlap_fragments alike in every node's YAML",
                )
            if request.dry_run:  # preflight: every check above, nothing registered
                log.info("preflight of peer %d: its settings and model match the run", peer)
                return pb.JoinReply(
                    current_round=-1,
                    open_round=-1,
                    data_port=self.data_port,
                    manifest_checked=self._manifest is not None,
                    dry_run=True,
                )
            if self._manifest is None:
                self._manifest = shapes
                log.info("learned the model manifest from peer %d: %d tensors", peer, len(shapes))
            if self._layout is None:
                self._layout = layout
            note = self.sessions.join(peer, session, address)
            self.peers[peer] = PeerInfo(request.wire_dtype, tuple(trainable))
            self._pool.set_limits(self._buffer_limits())
            snap = self.state.snapshot()
        log.info(
            "peer %d joined from %s%s (wire %s, uploads %d tensors)",
            peer,
            address,
            note,
            request.wire_dtype,
            len(trainable),
        )
        return pb.JoinReply(
            current_round=_or_minus_one(snap.completed_round),
            open_round=_or_minus_one(snap.open_round),
            data_port=self.data_port,
        )

    def open_stream(self, ticket: Ticket, peer: int, session: str, common_name: Callable[[], str | None]) -> None:
        """An Upload/Download stream of either plane names `peer`: check who calls, bound its streams, note it."""
        self.check_identity(peer, common_name)
        ticket.claim(peer)
        with self._cond:
            self.sessions.heard(peer, session)

    # -- Upload -------------------------------------------------------------------------------
    def upload(
        self, peer: int, step: int, feed: Callable[[TensorDecoder], None], fragment: int = WHOLE
    ) -> pb.UploadReply:
        """One upload of `fragment` of the model through the round rules, whatever carries it (gRPC stream or
        raw-TCP data plane).

        `feed(decoder)` is called only once the upload is admitted and must pass it every tensor; raises `Refused`.
        An empty reply (round 0, not a duplicate) means the peer went away mid-upload and nothing was kept.
        """
        with self._cond:
            info, manifest = self._joined(peer)
            assert self._layout is not None  # learned with the manifest
            try:
                self._layout.check(fragment)
            except ValueError as exc:
                raise Refused(
                    grpc.StatusCode.INVALID_ARGUMENT, f"upload of peer {peer} for round {step}: {exc}"
                ) from None
            if self.state.admit(peer, step, fragment):
                return self._upload_reply(step, duplicate=True)
            base = self._pin_base() if self.int8 else None
            names = self._layout.names(fragment, info.trainable)
        try:
            received = self._receive(feed, peer, step, names, info, manifest, base)
        finally:
            if base is not None:
                self._unpin(base.held.round)
        if received is None:
            return pb.UploadReply()  # the peer went away mid-upload: nothing was kept
        tensors, checksums, relayed = received
        with self._cond:
            if self.state.admit(peer, step, fragment):  # a concurrent retry of this upload won the race
                self._pool.give(tensors.values())
                return self._upload_reply(step, duplicate=True)
            self._checksums.record({n: tensors[n] for n in checksums}, checksums, values_dtype(info.wire_dtype))
            if self.state.stage_upload(peer, step, tensors, relayed, fragment):
                self._close_round(step)
            self._cond.notify_all()
            return self._upload_reply(step, duplicate=False)

    def _receive(
        self,
        feed: Callable[[TensorDecoder], None],
        peer: int,
        step: int,
        names: list[str],
        info: PeerInfo,
        manifest: Manifest,
        base: Base | None,
    ) -> tuple[Tensors, dict[str, int], dict[str, Int8Payload]] | None:
        """Decode and verify one upload of the tensors `names` into kept buffers sized by the manifest: the tensors,
        the checksums of those received raw, and (int8 wire) the payloads of its verbatim blocks. None if the peer
        went away.

        `base` (int8 wire): the completed round, whose held model the deltas must apply to (None: none completed).
        """
        dtype = values_dtype(info.wire_dtype)
        buffers = {n: self._pool.take(manifest[n], wire_torch_dtype(dtype)) for n in names}
        delta_base = None if info.wire_dtype != INT8 else NO_BASE if base is None else base.held.round
        decoder = TensorDecoder(
            {n: manifest[n] for n in names}, dtype, into=buffers, require_finite=True, delta_base=delta_base
        )
        try:
            feed(decoder)
            tensors = decoder.finish()
            values, relayed = self._delta_values(peer, decoder.deltas, base)
        except (grpc.RpcError, OSError):
            log.warning(
                "upload of peer %d for round %d broke off after %d bytes; nothing was kept",
                peer,
                step,
                decoder.bytes_received,
            )
            self._pool.give(buffers.values())
            return None
        except ValueError as exc:
            self._pool.give(buffers.values())
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
        self._pool.give(buffers[n] for n in values)  # received as deltas: their raw buffers went unused
        return {**tensors, **values}, decoder.checksums, relayed

    def _delta_values(
        self, peer: int, deltas: Mapping[str, Delta], base: Base | None
    ) -> tuple[Tensors, dict[str, Int8Payload]]:
        """An upload's int8 deltas as values (`compress.upload_values`: the peer's own blocks H + delta, averaged
        tensors G + delta), and the payloads of its own blocks (relayed to the others unless a merge changes them).

        ValueError naming a tensor that holds NaN or Inf once its delta is applied.
        """
        if not deltas:
            return {}, {}
        assert base is not None  # the decoder refuses every delta when no round has completed
        payloads = {n: d.payload for n, d in deltas.items()}
        own = set(deltas) - set(download_names(list(deltas), peer, self.cfg.mode, merged=False))
        values = upload_values(payloads, base.global_model, base.held.tensors, own)
        for name, value in values.items():
            if not finite(value):
                raise ValueError(
                    f"tensor {name!r} holds NaN or Inf values once its int8 delta is applied: this peer's training "
                    "diverged"
                )
        return values, {n: payloads[n] for n in own}

    def _upload_reply(self, step: int, *, duplicate: bool) -> pb.UploadReply:
        snap = self.state.snapshot()
        uploaded = snap.uploaded_peers if snap.open_round == step else snap.round_peers
        return pb.UploadReply(round=step, duplicate=duplicate, uploaded_peers=uploaded)

    # -- aggregation --------------------------------------------------------------------------
    def _close_round(self, step: int) -> None:
        """Hand the open round's uploads to a new aggregation thread (caller holds the lock)."""
        uploads, relayed = self.state.take_uploads()
        self._aggregator = threading.Thread(
            target=self._aggregate,
            args=(step, uploads, relayed, self.state.fragment),
            name=f"aggregate-{step}",
            daemon=True,
        )
        self._aggregator.start()

    def _aggregate(
        self, step: int, uploads: dict[int, Tensors], relayed: dict[str, Int8Payload], fragment: int
    ) -> None:
        """Build, persist and publish round `step` over `fragment` (int8 wire: with its held model), then wake the
        waiting downloads. The tensors a fragment's round does not cover keep their values of the rounds before."""
        cfg, start = self.cfg, time.perf_counter()
        with self._cond:  # NOTE: only this thread replaces these, in `complete` below.
            previous, momentum, peers = self.state.global_model, self.state.outer_momentum, set(self.state.uploaded)
            previous_held = self.state.held
            manifest = dict(self._manifest or {})
            layout = self._layout
        assert layout is not None
        received = [t for upload in uploads.values() for t in upload.values()]
        try:
            merge_at, mergeable = layout.merged_names(step, fragment, manifest)
            built = build_global(
                uploads,
                num_peers=self.num_peers,
                experts_per_peer=cfg.experts_per_peer,
                mode=cfg.mode,
                step=merge_at,
                mergeable=mergeable,
                merge=cfg.merge,
                outer=cfg.outer,
                names=layout.names(fragment, manifest),
                previous=previous,
                momentum=momentum,
                consume=True,
                empty=self._pool.take,
            )
            alpha = built.alpha
            carried = {**previous, **built.tensors}  # NOTE: a fragment's round leaves the other tensors as they were
            global_model = {n: carried[n] for n in manifest if n in carried}
            new_momentum = {**momentum, **built.momentum}
            held = None
            if self.int8:  # NOTE: a merge changed the experts after they were uploaded: nothing is relayed then
                held = next_held(step, global_model, previous_held, relayed if alpha == 0 else {})
            del uploads, previous, momentum, previous_held, relayed
            kept = [*global_model.values(), *new_momentum.values(), *(held.tensors.values() if held else ())]
            self._pool.give(received, keep=kept)  # merged or converted
            del received
            if cfg.state_dir:
                saved = SavedRound(
                    step,
                    tuple(sorted(peers)),
                    alpha > 0,
                    alpha,
                    manifest,
                    global_model,
                    new_momentum,
                    held.tensors if held else {},
                    fragment,
                    layout.count,
                    layout.sync_steps,
                )
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
                self._retired[superseded] = list(self._round_tensors())
            self.state.complete(step, global_model, new_momentum, merged=alpha > 0, alpha=alpha, held=held)
            self._release_retired()
            self._encoded = {}
            self._rounds_completed += 1
            bytes_in, bytes_out = self._round_bytes_in, self._bytes_out - self._logged_bytes_out
            self._round_bytes_in, self._logged_bytes_out = 0, self._bytes_out
            self._cond.notify_all()
        missing = sorted(set(range(self.num_peers)) - peers)
        log.info(
            "round %d%s complete: peers %d%s, in %.1f MiB, out %.1f MiB (since last round), aggregation %.2f s%s, "
            "merged %s, alpha %.6g",
            step,
            f" (fragment {fragment} of {layout.count})" if fragment != WHOLE else "",
            len(peers),
            f" (quorum, missing {missing})" if missing else "",
            bytes_in / 2**20,
            bytes_out / 2**20,
            time.perf_counter() - start,
            ", persisted" if cfg.state_dir else "",
            "yes" if alpha > 0 else "no",
            alpha,
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
        base_round: int = NO_BASE,
    ) -> Iterator[Outgoing | None]:
        """Wait for round `step` and select what `peer` gets, whatever carries it (None: the caller went away).

        Raises `Refused`. The plane sends `Outgoing.info`, then the tensors in their encoded forms (shared by
        every download of the round), adding to `Outgoing.sent`; however that ends, leaving the block counts the
        bytes and lets the round's tensors be reused once no download reads them. `base_round` (int8 wire): the
        round of the held model the peer holds.
        """
        with self._cond:
            info, _ = self._joined(peer)
            if not self._await_round(peer, step, full, is_active, time_left_s):
                outgoing = None
            else:
                outgoing = self._outgoing(peer, step, full, info.wire_dtype, base_round)
                self._readers[step] = self._readers.get(step, 0) + 1
        if outgoing is None:
            yield None
            return
        try:
            yield outgoing
        finally:
            with self._cond:
                self._bytes_out += outgoing.sent
            self._unpin(step)

    def _outgoing(self, peer: int, step: int, full: bool, wire_dtype: str, base_round: int) -> Outgoing:
        """What a download of the completed round `step` sends `peer` (lock held).

        The global model in the peer's wire dtype; on an int8 wire the deltas, for a peer holding the held model
        they apply to, else the new held model's full values (every tensor).
        """
        state = self.state
        items: Mapping[str, Item] = state.global_model
        view, dtype, delta_base = wire_dtype, wire_dtype, NO_BASE
        if state.held is not None:
            dtype = values_dtype(wire_dtype)
            if not full and state.held.base is not None and base_round == state.held.base:
                items, view, delta_base = state.held.deltas, INT8, state.held.base
            else:
                items, view, full = state.held.tensors, "held", True
        encoded = self._encoded.get(view)
        if encoded is None:
            known = self._checksums.known({n: t for n, t in items.items() if isinstance(t, torch.Tensor)}, dtype)
            encoded = self._encoded[view] = EncodedModel(items, dtype, known)
        names = list(state.global_model)
        if full and self._manifest is not None and len(names) < len(self._manifest):
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"peer {peer} asks for the whole global model, but round {step} holds only the fragments that have "
                f"had a round so far ({len(names)} of {len(self._manifest)} tensors): a node that falls behind "
                "before every fragment has had one (step sync_steps) must start the run again",
            )
        if not full:
            assert self._layout is not None
            names = download_names(
                self._layout.names(state.completed_fragment, names), peer, self.cfg.mode, state.merged
            )
        round_info = pb.RoundInfo(
            round=step,
            merged=state.merged,
            alpha=state.alpha,
            names=names,
            peers=sorted(state.completed_peers),
            base_round=delta_base,
        )
        return Outgoing(round_info, {n: items[n] for n in names}, encoded, dtype)

    def _pin_base(self) -> Base | None:
        """Int8 wire: the completed round deltas apply to, kept from the pool until `_unpin` (lock held)."""
        step, held = self.state.completed_round, self.state.held
        if step is None or held is None:
            return None
        self._readers[step] = self._readers.get(step, 0) + 1
        return Base(self.state.global_model, held)

    def _unpin(self, step: int) -> None:
        """A reader of round `step` (a download, or an upload's deltas) is done with its tensors."""
        with self._cond:
            self._readers[step] -= 1
            if not self._readers[step]:
                del self._readers[step]
                self._release_retired()

    def _round_tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor the completed round holds (lock held): global model, outer momentum, held model."""
        yield from self.state.global_model.values()
        yield from self.state.outer_momentum.values()
        if self.state.held is not None:
            yield from self.state.held.tensors.values()

    def _release_retired(self) -> None:
        """Give the pool the superseded rounds no reader reads any more (lock held)."""
        read = [t for step, tensors in self._retired.items() if step in self._readers for t in tensors]
        keep = [*self._round_tensors(), *read]
        # NOTE: one `give`: a tensor a fragment's rounds carried over sits in several retired rounds, given once
        done = [t for step in [s for s in self._retired if s not in self._readers] for t in self._retired.pop(step)]
        self._pool.give(done, keep=keep)

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
            if state.must_close(self.policy, self._uncopied_owners()):
                log.warning(
                    "round %d timed out: closing it with peers %s (--dead_peer_policy quorum)",
                    step,
                    sorted(state.uploaded),
                )
                self._close_round(step)
                continue
            wait = min(state.seconds_left(self.policy), give_up - time.monotonic(), WAIT_POLL_S)
            self._cond.wait(wait)

    def _uncopied_owners(self) -> frozenset[int]:
        """Peers owning expert blocks the open round covers of which the global model holds no copy yet (lock
        held): a quorum round cannot close without them (the run's first round, or the first of a fragment's)."""
        if self._layout is None or self._manifest is None or self.cfg.mode != "spes":
            return frozenset()
        held = self.state.global_model
        covered = self._layout.names(self.state.fragment, self._manifest)
        return frozenset(p.block for n in covered if n not in held and (p := parse_expert_block(n)) is not None)

    def wake(self) -> None:
        """Let waiting downloads re-check their callers (one went away)."""
        with self._cond:
            self._cond.notify_all()

    # -- Status -------------------------------------------------------------------------------
    def status(self) -> pb.StatusReply:
        with self._cond:
            snap = self.state.snapshot()
            return pb.StatusReply(
                current_round=_or_minus_one(snap.completed_round),
                open_round=_or_minus_one(snap.open_round),
                num_peers=self.num_peers,
                peers_joined=sorted(self.peers),
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

    # -- peers --------------------------------------------------------------------------------
    def _joined(self, peer: int) -> tuple[PeerInfo, Manifest]:
        """The peer's Join record (caller holds the lock); refuses peers that have not joined."""
        if peer not in self.peers or self._manifest is None:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"peer {peer} has not joined this server: call Join first",
                Reason.NOT_JOINED,
            )
        return self.peers[peer], self._manifest

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
        if self.cfg.tls_peer_ids:
            check_peer_identity(peer, common_name())

    def shutdown(self, grace_s: float) -> None:
        """Wake every waiting download so it ends with UNAVAILABLE; let a running aggregation finish."""
        with self._cond:
            self._shutting_down = True
            self._cond.notify_all()
            aggregator = self._aggregator
        if aggregator is not None:
            aggregator.join(timeout=grace_s)
        self.guard.stop()


def _or_minus_one(value: int | None) -> int:
    return -1 if value is None else value
