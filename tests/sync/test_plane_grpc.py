"""The gRPC plane (spes.sync.plane_grpc), both ends: `GrpcPlane` against a real in-process server on loopback."""

from __future__ import annotations

import gc
import logging
import threading
import time
import types
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import grpc
import pytest
import torch

from conftest import wait_until
from spes.sync.merge import build_global
from spes.sync.plane_grpc import GrpcPlane
from spes.sync.proto import spes_pb2 as pb
from spes.sync.proto import spes_pb2_grpc as pb_grpc
from spes.sync.protocol import PROBE_MAX_BYTES, Reason, SyncError
from spes.sync.wire import TensorDecoder, encode_tensors, upload_digest
from sync_helpers import NO_MERGE, join_request, peer_upload, running_server, tiny_spec

SPEC = tiny_spec(server=NO_MERGE)
MANIFEST = SPEC.manifest or {}


@contextmanager
def planes(addr: str) -> Iterator[list[GrpcPlane]]:
    """Both peers' gRPC planes on one channel, joined."""
    with grpc.insecure_channel(addr) as channel:
        stub = pb_grpc.ParameterServerStub(channel)
        for peer in range(2):
            stub.Join(join_request(peer), timeout=10)
        yield [GrpcPlane(stub, peer_id=p, wire_dtype="fp32", metadata=(), rpc_timeout_s=10) for p in range(2)]


def expect_for(peer: int, step: int):  # type: ignore[no-untyped-def]
    def expect(info: pb.RoundInfo) -> TensorDecoder:
        assert info.round == step and sorted(info.names) == sorted(SPEC.downloads(peer, merged=False))
        return TensorDecoder({n: MANIFEST[n] for n in info.names}, "fp32")

    return expect


@pytest.mark.timeout(60)
def test_a_round_over_the_grpc_plane_equals_build_global() -> None:
    uploads = {p: peer_upload(SPEC, p, seed=3) for p in range(2)}
    want = build_global(uploads, spec=SPEC, step=1).tensors
    with running_server(SPEC) as (_, addr), planes(addr) as (plane0, plane1):
        assert plane0.upload(1, uploads[0], timeout=10, digest=upload_digest(uploads[0], "fp32")) == (
            sum(t.numel() * 4 for t in uploads[0].values()),
            False,
        )
        assert plane0.upload(1, uploads[0], timeout=10, digest=upload_digest(uploads[0], "fp32"))[
            1
        ]  # the same upload again: a no-op the server reports
        with ThreadPoolExecutor(1) as pool:  # peer 0's download waits for peer 1's upload
            waiting = pool.submit(plane0.download, 1, 10, full=False, base_round=-1, decoder_for=expect_for(0, 1))
            plane1.upload(1, uploads[1], timeout=10, digest=upload_digest(uploads[1], "fp32"))
            info, got, received = waiting.result(timeout=30)
        assert (info.round, list(info.peers), info.merged) == (1, [0, 1], False)
        assert received == sum(t.numel() * 4 for t in got.values())
        for name, tensor in got.items():
            assert torch.equal(tensor, want[name]), name


@pytest.mark.timeout(60)
def test_refusals_arrive_as_sync_errors_with_their_reason() -> None:
    with running_server(SPEC) as (_, addr), grpc.insecure_channel(addr) as channel:
        stub = pb_grpc.ParameterServerStub(channel)
        stranger = GrpcPlane(stub, peer_id=1, wire_dtype="fp32", metadata=(), rpc_timeout_s=10)
        with pytest.raises(SyncError, match="has not joined") as err:
            stranger.download(1, 10, full=False, base_round=-1, decoder_for=expect_for(1, 1))
        assert (err.value.code, err.value.reason, err.value.retryable) == (
            grpc.StatusCode.FAILED_PRECONDITION,
            Reason.NOT_JOINED,
            False,
        )
        for peer in range(2):
            stub.Join(join_request(peer), timeout=10)
        upload = peer_upload(SPEC, 1, seed=1)
        stranger.upload(1, upload, timeout=10, digest=upload_digest(upload, "fp32"))
        with pytest.raises(SyncError, match="round 0 is old: round 1 is open now") as err:
            stranger.upload(0, upload, timeout=10, digest=upload_digest(upload, "fp32"))
        assert err.value.reason == Reason.STALE_ROUND
        with pytest.raises(SyncError, match="round 5 is ahead of the open round 1") as err:
            stranger.upload(5, upload, timeout=10, digest=upload_digest(upload, "fp32"))
        assert err.value.reason == Reason.FUTURE_ROUND


@pytest.mark.timeout(60)
def test_link_test_over_grpc() -> None:
    with running_server(SPEC) as (server, addr), planes(addr) as (plane, _):
        up_s, down_s = plane.probe(3 << 20)
        assert up_s > 0 and down_s > 0
        assert server.service.status().bytes_in == 0  # a link test is counted nowhere
        with pytest.raises(SyncError, match="at most") as err:
            plane.probe(PROBE_MAX_BYTES + 1)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.timeout(60)
def test_an_upload_cut_short_by_its_peer_going_away_is_logged_as_broken_off(caplog: pytest.LogCaptureFixture) -> None:
    """gRPC may report the end of a lost peer's stream before its cancellation: the server waits for the second
    event (`LOST_GRACE_S`) and logs the upload as broken off, not as a malformed one it refused."""
    upload = peer_upload(SPEC, 0, seed=1)
    chunks = list(encode_tensors(upload, "fp32"))
    with running_server(SPEC) as (server, addr), grpc.insecure_channel(addr) as channel:
        stub = pb_grpc.ParameterServerStub(channel)
        stub.Join(join_request(0), timeout=10)
        stub.Join(join_request(1), timeout=10)
        messages = [pb.UploadMessage(meta=pb.UploadMeta(peer_id=0, round=1))]
        call = stub.Upload.future(iter(messages + [pb.UploadMessage(chunk=c) for c in chunks[:-1]]), timeout=10)
        time.sleep(0.2)  # the stream has ended, short; then the peer goes away
        call.cancel()
        wait_until(lambda: "broke off after" in caplog.text, "the server to drop the upload")
        assert "refused" not in caplog.text
        assert not server.service.status().peers_uploaded


def _stalled(messages: list, until: threading.Event) -> Iterator:
    """A request stream that sends `messages`, then neither sends nor ends until `until`."""
    yield from messages
    until.wait(10)


@pytest.mark.timeout(60)
def test_a_stream_its_peer_cancels_leaves_no_reference_cycle_and_logs_no_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A peer that cancels its upload (before its first message, or mid-tensor) or its link test: grpc raises an
    error from the request stream and keeps it in the call's state, and with its traceback that state, the call and
    the handler's frames (an upload's decoder) sat in a reference cycle until CPython's rare full collection: a
    server under churn crept (bench/bench_soak.py). None is left; nothing is logged as an application error."""
    chunks = list(encode_tensors(peer_upload(SPEC, 0, seed=1), "fp32"))
    meta = pb.UploadMessage(meta=pb.UploadMeta(peer_id=0, round=1))
    streams = (  # how to start each, what it sends, what the server has done once it read that
        (lambda stub, it: stub.Upload.future(it, timeout=10), [], ""),
        (
            lambda stub, it: stub.Upload.future(it, timeout=10),
            [meta, pb.UploadMessage(chunk=chunks[0])],
            "receiving the upload of peer 0 for round 1",
        ),
        (lambda stub, it: stub.Probe(it, timeout=10), [pb.ProbeMessage(reply_bytes=8, data=b"1")], ""),
    )
    with running_server(SPEC) as (server, addr), grpc.insecure_channel(addr) as channel:
        stub = pb_grpc.ParameterServerStub(channel)
        for peer in range(2):
            stub.Join(join_request(peer), timeout=10)
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            with caplog.at_level(logging.DEBUG, logger="spes.server"):
                for start, messages, read in streams:
                    until = threading.Event()
                    call = start(stub, _stalled(messages, until))
                    wait_until(lambda: server.service.guard.open_streams == 1, "the server to take the stream")
                    wait_until(lambda: read in caplog.text, "the server to read what the stream sent")  # noqa: B023
                    call.cancel()
                    until.set()
                    wait_until(lambda: server.service.guard.open_streams == 0, "the server to end the stream")
            gc.collect()
            left = [o for o in gc.garbage if type(o) is grpc.RpcError or _a_frame_of_spes(o)]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    assert left == []
    assert "broke off after" in caplog.text and "Exception" not in caplog.text


def _a_frame_of_spes(obj: object) -> bool:
    return isinstance(obj, types.FrameType) and "/spes/" in obj.f_code.co_filename
