"""The gRPC plane, both ends: the server's handlers over the `Coordinator`, and the client's `GrpcPlane`.

gRPC carries every control call (Join, Status, health) and, when the raw-TCP data plane (`spes.sync.plane_tcp`)
is off or unreachable, the tensor payloads too: an Upload is a client stream of `UploadMeta` then chunks, a
Download a server stream of `RoundInfo` then chunks (`spes.sync.wire` frames the tensors). A refusal aborts the
call with its gRPC status, and its `Reason` as trailing metadata `spes-reason` (protos/spes.proto).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack
from typing import TYPE_CHECKING, NoReturn, TypeVar

import grpc

from spes.sync.admission import SESSION_KEY, Ticket, caller_address
from spes.sync.auth import grpc_common_name
from spes.sync.channel import tls_cause
from spes.sync.fragments import WHOLE
from spes.sync.proto import spes_pb2 as pb
from spes.sync.proto import spes_pb2_grpc as pb_grpc
from spes.sync.protocol import (
    PROBE_CHUNK_BYTES,
    PROBE_MAX_BYTES,
    REASON_KEY,
    Refused,
    SyncError,
    Tensors,
    classify,
)
from spes.sync.wire import Item, TensorDecoder, encode_tensors

if TYPE_CHECKING:
    from spes.sync.coordinator import Coordinator

log = logging.getLogger("spes.server")

LOST_GRACE_S = 1.0
"""How long an upload stream that ended short waits to learn whether its connection was lost: gRPC reports the
end of the stream and the call's cancellation as two events, and the end may come first."""


# -- server -------------------------------------------------------------------------------------------------------
class SpesServicer(pb_grpc.ParameterServerServicer):
    """The gRPC handlers: validate the call, move its bytes, and leave the rounds to the `Coordinator`."""

    def __init__(self, service: Coordinator) -> None:
        self.service = service

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:
        try:
            return self.service.join(
                request, _metadata(context, SESSION_KEY), caller_address(context), lambda: grpc_common_name(context)
            )
        except Refused as exc:
            self._abort(context, exc)

    def Upload(self, request_iterator: Iterator[pb.UploadMessage], context: grpc.ServicerContext) -> pb.UploadReply:
        ended = threading.Event()
        context.add_callback(ended.set)  # runs once the call is over: here, only if the peer cancelled or went away

        def feed(decoder: TensorDecoder) -> None:
            for message in messages:
                if not message.HasField("chunk"):
                    raise ValueError("UploadMeta sent twice in one upload")
                decoder.feed(message.chunk)
            if not decoder.complete and (ended.wait(LOST_GRACE_S) or not context.is_active()):
                raise ConnectionError("the peer's connection closed before its upload ended")

        try:
            with self.service.guard.grpc_ticket(context) as ticket:
                messages = _watched(request_iterator, ticket)
                first = next(messages, None)
                if first is None or not first.HasField("meta"):
                    raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "an upload must start with its UploadMeta message")
                self._open(ticket, first.meta.peer_id, context)
                meta = first.meta
                return self.service.uploads.receive(meta.peer_id, meta.round, feed, meta.fragment, meta.digest, ticket)
        except Refused as exc:
            self._abort(context, exc)
        except (TimeoutError, ConnectionError):  # the watchdog ended the call, or the peer did: no one reads a reply
            return pb.UploadReply()

    def Download(self, request: pb.DownloadRequest, context: grpc.ServicerContext) -> Iterator[pb.DownloadMessage]:
        context.add_callback(self.service.wake)
        try:
            ticket = self.service.guard.grpc_ticket(context)
        except Refused as exc:
            self._abort(context, exc)
        with ticket, ExitStack() as stack:
            try:
                self._open(ticket, request.peer_id, context)
                ticket.wait_for_round(True)
                outgoing = stack.enter_context(
                    self.service.downloads.serve(
                        request.peer_id,
                        request.round,
                        request.full,
                        context.is_active,
                        context.time_remaining(),
                        request.base_round,
                    )
                )
            except Refused as exc:
                self._abort(context, exc)
            if outgoing is None:  # NOTE: a stream ended without a word read as a bad download, not as the deadline
                context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED, f"round {request.round} did not complete within the call's time"
                )
                raise AssertionError("unreachable: context.abort raises")
            ticket.wait_for_round(False)
            yield pb.DownloadMessage(info=outgoing.info)
            for chunk in encode_tensors(outgoing.tensors, outgoing.wire_dtype, encoded=outgoing.encoded):
                ticket.moved(len(chunk.data))  # the previous message went out
                outgoing.sent += len(chunk.data)
                yield pb.DownloadMessage(chunk=chunk)

    def Probe(
        self, request_iterator: Iterator[pb.ProbeMessage], context: grpc.ServicerContext
    ) -> Iterator[pb.ProbeMessage]:
        """Read the client's bytes, acknowledge, send `reply_bytes` back; counted in no traffic figure, but a stream
        like any other: it takes a slot and is held to the idle and rate limits."""
        try:
            ticket = self.service.guard.grpc_ticket(context)
        except Refused as exc:
            self._abort(context, exc)
        with ticket:
            reply_bytes, received = 0, 0
            try:
                for index, message in enumerate(_watched(request_iterator, ticket)):
                    if index == 0:
                        reply_bytes = message.reply_bytes
                    received += len(message.data)
                    if received > PROBE_MAX_BYTES or reply_bytes > PROBE_MAX_BYTES:
                        refused = f"a link test moves at most {PROBE_MAX_BYTES} bytes each way"
                        self._abort(context, Refused(grpc.StatusCode.INVALID_ARGUMENT, refused))
            except (TimeoutError, ConnectionError):  # the call is over: nobody reads the reply
                return
            yield pb.ProbeMessage()
            chunk = bytes(min(reply_bytes, PROBE_CHUNK_BYTES))
            for offset in range(0, reply_bytes, len(chunk) or 1):
                ticket.moved(len(chunk))
                yield pb.ProbeMessage(data=chunk[: reply_bytes - offset])

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        return self.service.status()

    def _open(self, ticket: Ticket, peer: int, context: grpc.ServicerContext) -> None:
        self.service.open_stream(ticket, peer, _metadata(context, SESSION_KEY), lambda: grpc_common_name(context))

    def _abort(self, context: grpc.ServicerContext, exc: Refused) -> NoReturn:
        self.service.warn.warning(exc.code.name, "refused (%s): %s", exc.code.name, exc)
        if exc.reason:
            context.set_trailing_metadata(((REASON_KEY, exc.reason.value),))
        context.abort(exc.code, str(exc))
        raise AssertionError("unreachable: context.abort raises")


def _metadata(context: grpc.ServicerContext, key: str) -> str:
    """The value of invocation metadata `key` ('' when absent)."""
    return next((str(v) for k, v in (context.invocation_metadata() or ()) if k == key), "")


M = TypeVar("M", pb.UploadMessage, pb.ProbeMessage)


def _watched(messages: Iterator[M], ticket: Ticket) -> Iterator[M]:
    """The stream's messages, each one counted by the ticket (its idle clock and byte rate); TimeoutError if the
    watchdog ended it, ConnectionError if the peer cancelled it (went away)."""
    cancelled = False
    try:
        for message in messages:
            ticket.moved(message.ByteSize())
            yield message
    except grpc.RpcError as err:
        # NOTE: grpc keeps the error it raises for a cancelled call in the call's state, and the error's traceback
        # holds that state: a reference cycle that kept the handler's locals (an upload's decoder) and grpc's call
        # until CPython's rare full collection. Its traceback goes; what is raised below has no context
        err.__traceback__ = None
        cancelled = True
    ticket.check()
    if cancelled:
        raise ConnectionError("the peer cancelled its stream")


# -- client -------------------------------------------------------------------------------------------------------
def failure_of(
    what: str,
    err: grpc.RpcError,
    refusal: Callable[[], str | None] | None = None,
    closed: Callable[[], bool] | None = None,
) -> SyncError:
    """Classify a gRPC error: its code, the server's reason, and whether a retry may succeed (none mends a refused
    TLS handshake: `tls_cause`, with `refusal`).

    A call cancelled by the server is retried like an unreachable one: gRPC's core cancels a call that reaches a
    server as it stops. One this client cancelled (`closed()`: it closed its channel, the node is stopping) is not.
    """
    details = err.details() or ""
    code = err.code()
    if code == grpc.StatusCode.UNAVAILABLE and (cause := tls_cause(details, refusal)) is not None:
        return SyncError(f"{what} failed (UNAVAILABLE): {cause} ({details})", grpc.StatusCode.UNAVAILABLE)
    if code == grpc.StatusCode.CANCELLED and not _cancelled_here(err, closed):
        return SyncError(
            f"{what} failed (CANCELLED): the server ended the call ({details}), as a stopping server does",
            code,
            retryable=True,
        )
    reason = next((str(v) for k, v in (err.trailing_metadata() or ()) if k == REASON_KEY), "")
    return classify(what, code, details, reason)


def _cancelled_here(err: grpc.RpcError, closed: Callable[[], bool] | None) -> bool:
    """Whether this client cancelled the call: it cancelled the call itself, or closed its channel (`closed()`)."""
    return (isinstance(err, grpc.Future) and err.cancelled()) or (closed is not None and closed())


class GrpcPlane:
    """The client's end: tensor payloads as gRPC streams on its channel (see `spes.sync.plane.Plane`)."""

    name = "grpc"

    def __init__(
        self,
        stub: pb_grpc.ParameterServerStub,
        *,
        peer_id: int,
        wire_dtype: str,
        metadata: tuple[tuple[str, str], ...],
        rpc_timeout_s: float,
        closed: Callable[[], bool] | None = None,
    ) -> None:
        """`closed()`: whether the client closed the channel (a call it cancelled so is not retried)."""
        self._stub, self.peer_id, self.wire_dtype = stub, peer_id, wire_dtype
        self._metadata, self.rpc_timeout_s, self._closed = metadata, rpc_timeout_s, closed

    def upload(
        self, step: int, tensors: Mapping[str, Item], timeout: float, fragment: int = WHOLE, *, digest: int
    ) -> tuple[int, bool]:
        sent, failed = 0, []
        meta = pb.UploadMeta(peer_id=self.peer_id, round=step, fragment=fragment, digest=digest)

        def messages() -> Iterator[pb.UploadMessage]:
            nonlocal sent
            yield pb.UploadMessage(meta=meta)
            try:
                for chunk in encode_tensors(tensors, self.wire_dtype):
                    sent += len(chunk.data)
                    yield pb.UploadMessage(chunk=chunk)
            except ValueError as exc:  # NOTE: an item made while sending refused (not finite): grpc would hide it
                failed.append(exc)
                raise

        try:
            reply = self._stub.Upload(messages(), timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            if failed:
                raise failed[0] from None
            raise failure_of(f"upload of round {step}", err, closed=self._closed) from None
        return sent, reply.duplicate

    def download(
        self,
        step: int,
        timeout: float,
        *,
        full: bool,
        base_round: int,
        decoder_for: Callable[[pb.RoundInfo], TensorDecoder],
    ) -> tuple[pb.RoundInfo, Tensors, int]:
        request = pb.DownloadRequest(peer_id=self.peer_id, round=step, full=full, base_round=base_round)
        responses = self._stub.Download(request, timeout=timeout, metadata=self._metadata)
        try:
            first = next(responses, None)
            if first is None or not first.HasField("info"):
                raise SyncError(f"round {step}: the server's download did not start with its RoundInfo")
            info = first.info
            decoder = decoder_for(info)
            for message in responses:
                if not message.HasField("chunk"):
                    raise SyncError(f"round {step}: a second RoundInfo arrived inside the download")
                decoder.feed(message.chunk)
            tensors = decoder.finish()
        except grpc.RpcError as err:
            raise failure_of(f"download of round {step}", err, closed=self._closed) from None
        except ValueError as exc:  # damaged or cut short in transit: fetching it again may succeed
            raise SyncError(f"round {step}: bad download from the server: {exc}", retryable=True) from None
        finally:
            responses.cancel()
        return info, tensors, decoder.bytes_received

    def probe(self, num_bytes: int) -> tuple[float, float]:
        def messages() -> Iterator[pb.ProbeMessage]:
            yield pb.ProbeMessage(reply_bytes=num_bytes)
            chunk = bytes(min(num_bytes, PROBE_CHUNK_BYTES))
            for offset in range(0, num_bytes, len(chunk)):
                yield pb.ProbeMessage(data=chunk[: num_bytes - offset])

        start = time.perf_counter()
        responses = self._stub.Probe(messages(), timeout=self.rpc_timeout_s, metadata=self._metadata)
        try:
            next(responses)  # the server's acknowledgement: it has read every byte
            up_s = time.perf_counter() - start
            start = time.perf_counter()
            received = sum(len(message.data) for message in responses)
        except grpc.RpcError as err:
            raise failure_of("link test", err, closed=self._closed) from None
        finally:
            responses.cancel()
        if received != num_bytes:
            raise SyncError(f"link test: the server sent {received} bytes back, asked for {num_bytes}")
        return up_s, time.perf_counter() - start
