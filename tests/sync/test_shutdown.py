"""A parameter server stopped (SIGTERM: `ParameterServer.stop`) in the middle of a round, then started again on its
--state_dir and port: a peer whose round was in flight, or whose next attempt starts while the server shuts down,
rides it out (retries, re-joins) and the run goes on; none of them exits with an error."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from conftest import wait_until
from spes.sync.plane_grpc import SpesServicer
from spes.sync.proto import spes_pb2 as pb
from spes.sync.protocol import REASON_KEY, Reason, SyncError
from spes.sync.server import ParameterServer
from spes.sync.wire import encode_tensors
from sync_helpers import (
    NO_MERGE,
    check_round,
    join_request,
    joined_clients,
    peer_upload,
    running_server,
    stub_for,
    sync_all,
    tiny_spec,
)

SPEC = tiny_spec(server=NO_MERGE)
HOLD_S = 2.0
"""How long the stopping server's grace is held open (as a round still aggregating would hold it) while a node
retries."""


@pytest.fixture
def cancelled_at_shutdown(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Every gRPC Upload that reaches a server once it is shutting down is cancelled by the server, as gRPC's core
    cancels a call that arrives as its server stops ("CANCELLED" at the client); yields the rounds it cancelled."""
    cancelled: list[int] = []
    upload = SpesServicer.Upload

    def cancelling(self: SpesServicer, messages: Iterator[pb.UploadMessage], context: grpc.ServicerContext) -> object:
        if self.service.stopping:
            first = next(messages)
            cancelled.append(first.meta.round)
            context.abort(grpc.StatusCode.CANCELLED, "CANCELLED")
        return upload(self, messages, context)

    monkeypatch.setattr(SpesServicer, "Upload", cancelling)
    yield cancelled


@contextlib.contextmanager
def shutting_down(server: ParameterServer) -> Iterator[None]:
    """`server` stopping, held in its grace (as by a round still aggregating) until the block ends."""
    release = threading.Event()
    server.service.closer.join = lambda _timeout_s: release.wait(30)  # type: ignore[method-assign]
    stopping = threading.Thread(target=server.stop, kwargs={"grace_s": 0.5})
    stopping.start()
    try:
        wait_until(lambda: server.service.stopping, "the server to begin its shutdown", 10)
        yield
    finally:
        release.set()
        stopping.join(timeout=30)


def reason_of_call(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    """The gRPC status and spes-reason a raw call (a stream drained) failed with."""
    with pytest.raises(grpc.RpcError) as err:
        result = call()
        if not isinstance(result, pb.UploadReply):
            list(result)  # type: ignore[call-overload]
    return err.value.code(), next((str(v) for k, v in err.value.trailing_metadata() or () if k == REASON_KEY), "")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("plane", ["grpc", "tcp"])
def test_a_peer_rides_out_a_server_stopped_mid_round_and_the_run_goes_on(
    tmp_path: Path, plane: str, cancelled_at_shutdown: list[int]
) -> None:
    """Peer 0 has uploaded round 2 and waits for it when the server stops: its download is refused, and its next
    attempts start while the server is still shutting down (the grace held open, as by an aggregation) and are
    refused or cancelled by it; then the server is back on its --state_dir, peer 0 re-joins and uploads again,
    peer 1 uploads, and rounds 2 and 3 complete for both."""
    state = str(tmp_path / "state")
    uploads = {step: {p: peer_upload(SPEC, p, seed=step) for p in range(2)} for step in (1, 2, 3)}
    settings = {"data_plane": plane, "rpc_timeout_s": 5, "round_timeout_s": 60}
    pool = ThreadPoolExecutor(2)
    try:
        with (
            running_server(SPEC, state_dir=state, data_port=0) as (first, addr),
            joined_clients(addr, SPEC, **settings) as clients,
        ):
            sync_all(clients, 1, uploads[1])
            waiting = pool.submit(clients[0].sync, 2, uploads[2][0])
            wait_until(lambda: first.service.status().peers_uploaded == [0], "peer 0's upload of round 2", 10)
            with shutting_down(first):
                time.sleep(HOLD_S)
            with running_server(SPEC, state_dir=state, data_port=0, port=first.port):
                joining = pool.submit(clients[1].sync, 2, uploads[2][1])
                results = {0: waiting.result(timeout=60), 1: joining.result(timeout=60)}
                check_round(results, uploads[2], SPEC, step=2)
                check_round(sync_all(clients, 3, uploads[3]), uploads[3], SPEC, step=3)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    if plane == "grpc":
        assert 2 in cancelled_at_shutdown  # peer 0's retried upload met the stopping server


@pytest.mark.timeout(60)
def test_a_server_shutting_down_refuses_new_uploads_and_downloads_on_either_plane_as_going_away() -> None:
    """Refused UNAVAILABLE, reason shutting_down: retried by the node, and no reason to leave the data plane for
    gRPC (which stops with it)."""
    upload = peer_upload(SPEC, 0, seed=1)
    with (
        running_server(SPEC, data_port=0) as (server, addr),
        joined_clients(addr, SPEC, data_plane="tcp") as clients,
        stub_for(addr) as stub,
    ):
        tcp = clients[0].plane
        assert tcp.name == "tcp"
        with shutting_down(server):
            messages = iter([pb.UploadMessage(meta=pb.UploadMeta(peer_id=0, round=1))])
            going_away = (grpc.StatusCode.UNAVAILABLE, "shutting_down")
            assert reason_of_call(lambda: stub.Upload(messages, timeout=10)) == going_away
            assert (
                reason_of_call(lambda: stub.Download(pb.DownloadRequest(peer_id=0, round=1), timeout=10)) == going_away
            )
            for attempt in (
                lambda: tcp.upload(1, upload, 10.0, digest=1),
                lambda: tcp.download(1, 10.0, full=False, base_round=-1, decoder_for=lambda _info: None),  # type: ignore[arg-type,return-value]
            ):
                with pytest.raises(SyncError) as err:
                    attempt()
                assert (err.value.code, err.value.reason, err.value.retryable) == (
                    *going_away[:1],
                    Reason.SHUTTING_DOWN,
                    True,
                )
                connection = clients[0].connection
                assert not connection.fall_back(err.value, connection.why_lost(err.value)) and connection.plane is tcp
            assert server.service.status().peers_uploaded == []


@pytest.mark.timeout(60)
def test_an_upload_still_arriving_when_the_server_begins_to_stop_is_refused_not_staged() -> None:
    """Staged, it would have completed the round, whose aggregation and state file would come after the server let
    go of its --state_dir."""
    both_in = threading.Event()
    chunks = list(encode_tensors(peer_upload(SPEC, 0, seed=1), "fp32"))

    def held_upload() -> Iterator[pb.UploadMessage]:
        yield pb.UploadMessage(meta=pb.UploadMeta(peer_id=0, round=1))
        yield pb.UploadMessage(chunk=chunks[0])
        both_in.wait(30)
        yield from (pb.UploadMessage(chunk=chunk) for chunk in chunks[1:])

    with running_server(SPEC) as (server, addr), stub_for(addr) as stub, ThreadPoolExecutor(1) as pool:
        for peer in range(2):
            stub.Join(join_request(peer, SPEC), timeout=10)
        uploading = pool.submit(reason_of_call, lambda: stub.Upload(held_upload(), timeout=20))
        # NOTE: admitted and being decoded (past the check a stream meets when it opens)
        wait_until(lambda: 0 in server.service.uploads._uploading, "the upload to be admitted", 10)
        with shutting_down(server):
            both_in.set()
            assert uploading.result(timeout=20) == (grpc.StatusCode.UNAVAILABLE, "shutting_down")
            assert server.service.status().peers_uploaded == []


@pytest.mark.timeout(60)
def test_a_node_that_closes_its_client_mid_round_ends_the_round_at_once_without_retrying() -> None:
    """The node's own stop (`PeerSync.close` while its round waits) cancels the call: that is no server going
    away, and the round ends with the cancellation instead of retries on a closed channel."""
    with (
        running_server(SPEC) as (server, addr),
        joined_clients(addr, SPEC, data_plane="grpc") as clients,
        ThreadPoolExecutor(1) as pool,
    ):
        waiting = pool.submit(clients[0].sync, 1, peer_upload(SPEC, 0, seed=1))
        presence_and_download = 3  # NOTE: each joined client holds a presence stream
        wait_until(lambda: server.service.guard.open_streams == presence_and_download, "peer 0's download", 10)
        clients[0].close()
        with pytest.raises(SyncError) as err:
            waiting.result(timeout=10)
        assert err.value.code == grpc.StatusCode.CANCELLED and not err.value.retryable
