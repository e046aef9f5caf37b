"""The parameter server's uploads: admit one through the round rules, decode it through the codec, stage it.

`Uploads` is one job of the `spes.sync.coordinator.Coordinator`, which holds it and whose condition guards
everything here: an upload is admitted by the `RoundState` (a retry of a committed one is answered as a duplicate,
a newer upload of a peer ends its stalled one), decoded into kept buffers by the run's codec against the latest
served model, and staged; the one that completes the round has it closed (`spes.sync.closing`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc

from spes.sync.admission import Ticket, require_joined
from spes.sync.closing import CallParts, PeerCalls
from spes.sync.codecs.base import Payload
from spes.sync.codecs.interface import UploadBase
from spes.sync.fragments import WHOLE
from spes.sync.proto import spes_pb2 as pb
from spes.sync.protocol import Reason, Refused, Tensors, shutting_down
from spes.sync.rounds import Completed
from spes.sync.wire import BaseMismatch, CorruptChunk, TensorDecoder, wire_torch_dtype

log = logging.getLogger("spes.server")


class Uploads(PeerCalls):
    """The uploads of one run; `cond` (the coordinator's) guards `state`, `memory`, `joined` and `bytes_in`.

    An upload received while the server is `stopping` is refused, not staged (the round it completed would be
    aggregated and persisted after the server let go of its --state_dir).
    """

    def __init__(self, parts: CallParts) -> None:
        super().__init__(parts)
        self._uploading: dict[int, Ticket] = {}
        """Per peer, the stream of its upload being received (a newer one supersedes it)."""
        self.bytes_in = 0
        """Payload bytes received by every upload, kept or not."""

    def receive(
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
        `digest` (the codec's `PeerCodec.digest`) tells a retry of a committed upload from a different one. A new
        upload of a peer supersedes its own stalled one (`ticket`: this one's stream, the older's is ended).
        An empty reply (round 0, not a duplicate) means the peer went away mid-upload and nothing was kept.
        """
        with self._cond:
            require_joined(self._joined, peer)
            try:
                self._spec().layout.check(fragment)
            except ValueError as exc:
                raise Refused(
                    grpc.StatusCode.INVALID_ARGUMENT, f"upload of peer {peer} for round {step}: {exc}"
                ) from None
            if self._state.admit(peer, step, fragment, digest):
                return self._upload_reply(step, duplicate=True)
            older = self._uploading.pop(peer, None)
            if older is not None and ticket is not None:
                older.expire(f"superseded by a newer upload of peer {peer}")
            if ticket is not None:
                self._uploading[peer] = ticket
            base = self._state.completed
            if base is not None:
                self._memory.pin(base.round)
        try:
            received = self._decode(feed, peer, step, fragment, base)
        finally:
            with self._cond:
                if base is not None:
                    self._memory.unpin(base.round)
                if ticket is not None and self._uploading.get(peer) is ticket:
                    del self._uploading[peer]
        if received is None:
            return pb.UploadReply()  # the peer went away mid-upload: nothing was kept
        tensors, checksums, relayed = received
        with self._cond:
            if self._stopping():
                self._memory.pool.give(tensors.values())
                raise shutting_down()
            if self._state.admit(peer, step, fragment, digest):  # a concurrent retry of this upload won the race
                self._memory.pool.give(tensors.values())
                return self._upload_reply(step, duplicate=True)
            self._memory.checksums.record({n: tensors[n] for n in checksums}, checksums, self._codec.raw_dtype)
            if self._state.stage_upload(peer, step, tensors, relayed, fragment, digest):
                self._closer.close(step, self._spec())
            self._cond.notify_all()
            return self._upload_reply(step, duplicate=False)

    def _decode(
        self, feed: Callable[[TensorDecoder], None], peer: int, step: int, fragment: int, base: Completed | None
    ) -> tuple[Tensors, dict[str, int], dict[str, Payload]] | None:
        """Decode and verify one upload of what `peer` trains of `fragment` into kept buffers sized by the manifest,
        and turn it into values (the codec): the values, the checksums of those received raw, and the payloads of
        blocks taken verbatim that downloads may relay. None if the peer went away.

        `base`: the latest completed round (pinned), whose served model the codec's payloads must apply to.
        """
        spec = self._spec()
        assert spec.manifest is not None
        names = spec.layout.names(fragment, spec.trainable(peer))
        dtype = wire_torch_dtype(self._codec.raw_dtype)
        buffers = {n: self._memory.pool.take(spec.manifest[n], dtype) for n in names}
        applies_to = UploadBase(base.served if base else None, base.global_model if base else {}, spec.own(peer, names))
        decoder = self._codec.upload_decoder({n: spec.manifest[n] for n in names}, buffers, applies_to)
        log.debug("receiving the upload of peer %d for round %d", peer, step)
        try:
            feed(decoder)
            values, relayed = self._codec.upload_values(decoder, decoder.finish(), applies_to)
        except OSError:  # the peer went away: its socket broke, or it cancelled its gRPC stream (ConnectionError)
            log.warning(
                "upload of peer %d for round %d broke off after %d bytes; nothing was kept",
                peer,
                step,
                decoder.bytes_received,
            )
            self._memory.pool.give(buffers.values())
            return None
        except ValueError as exc:
            self._memory.pool.give(buffers.values())
            code, reason = grpc.StatusCode.INVALID_ARGUMENT, Reason.NONE
            if isinstance(exc, CorruptChunk):
                reason = Reason.CORRUPT
            elif isinstance(exc, BaseMismatch):
                code, reason = grpc.StatusCode.FAILED_PRECONDITION, Reason.BASE_MISMATCH
            raise Refused(code, f"upload of peer {peer} for round {step}: {exc}", reason) from None
        finally:
            with self._cond:
                self.bytes_in += decoder.bytes_received
        # NOTE: a payload the codec applied elsewhere than into its kept buffer left that buffer unused
        self._memory.pool.give(b for n, b in buffers.items() if values.get(n) is not b)
        return values, decoder.checksums, relayed

    def _upload_reply(self, step: int, *, duplicate: bool) -> pb.UploadReply:
        snap = self._state.snapshot()
        uploaded = snap.uploaded_peers if snap.open_round == step else snap.round_peers
        return pb.UploadReply(round=step, duplicate=duplicate, uploaded_peers=uploaded)
