"""Tests of the parameter server over real gRPC with raw stubs: refusals, rounds, auth, health, shutdown."""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import wait_until
from spes.atomic import lock_holder
from spes.config import ServerSection
from spes.moe import parse_expert_block
from spes.sync import downloads, wire
from spes.sync.client import SyncError
from spes.sync.merge import build_global
from spes.sync.proto import spes_pb2 as pb
from spes.sync.proto import spes_pb2_grpc as pb_grpc
from spes.sync.server import config_of, describe_run, spec_of_run, start_server
from spes.sync.settings import DeployConfig, ServerConfig, build_parser, command_from_args
from spes.sync.wire import checksum, encode_tensors
from sync_helpers import (
    NO_MERGE,
    TOKEN,
    check_round,
    join_request,
    joined_clients,
    make_client,
    peer_upload,
    running_server,
    stub_for,
    sync_all,
    tiny_spec,
)

REPO = Path(__file__).resolve().parents[2]
SPEC = tiny_spec()
SPEC10 = tiny_spec(sync_steps=10)
"""A round every 10 steps, for the tests that name rounds 10, 20, ..."""
MANIFEST = SPEC.manifest or {}
StatusCode = grpc.StatusCode


def upload_messages(peer: int, step: int, chunks: list[pb.TensorChunk]) -> Iterator[pb.UploadMessage]:
    yield pb.UploadMessage(meta=pb.UploadMeta(peer_id=peer, round=step))
    for chunk in chunks:
        yield pb.UploadMessage(chunk=chunk)


def good_chunks(peer: int, seed: int = 0) -> list[pb.TensorChunk]:
    return list(encode_tensors(peer_upload(SPEC, peer, seed), "fp32"))


def expect_code(code: StatusCode, match: str, call: object, *args: object, **kwargs: object) -> str:
    """Expect the call to fail with `code` and details matching `match`; returns its spes-reason ('' if none)."""
    with pytest.raises(grpc.RpcError) as err:
        result = call(*args, timeout=10, **kwargs)  # type: ignore[operator]
        if not isinstance(result, (pb.JoinReply, pb.UploadReply, pb.StatusReply)):
            list(result)  # drain a server stream
    assert err.value.code() == code, err.value.details()
    assert re.search(match, err.value.details()), err.value.details()
    return next((v for k, v in err.value.trailing_metadata() or () if k == "spes-reason"), "")


def finish_round(addr: str, step: int) -> None:
    """Both peers upload good tensors for `step` and download the result."""
    with stub_for(addr) as stub:
        for peer in range(2):
            assert not stub.Upload(upload_messages(peer, step, good_chunks(peer, step)), timeout=10).duplicate
        for peer in range(2):
            messages = list(stub.Download(pb.DownloadRequest(peer_id=peer, round=step), timeout=10))
            assert messages[0].info.round == step and len(messages) > 1


@pytest.mark.timeout(60)
def test_bad_joins_are_refused_and_change_nothing() -> None:
    with running_server() as (server, addr), stub_for(addr) as stub:
        first = stub.Join(join_request(0), timeout=10)
        assert (first.current_round, first.open_round) == (-1, -1)
        expect_code(StatusCode.INVALID_ARGUMENT, r"peer_id 2 is outside \[0, 2\)", stub.Join, join_request(2))
        expect_code(
            StatusCode.FAILED_PRECONDITION,
            "peer 1 has experts_per_block = 3 but the run has experts_per_block = 2: set "
            "spes_config.num_train_experts_per_node",
            stub.Join,
            join_request(1, spec=tiny_spec(k=3)),
        )
        expect_code(
            StatusCode.FAILED_PRECONDITION, "mode = 'diloco'", stub.Join, join_request(1, spec=tiny_spec(mode="diloco"))
        )
        expect_code(
            StatusCode.FAILED_PRECONDITION,
            "num_peers = 3",
            stub.Join,
            join_request(1, spec=tiny_spec(num_peers=3, num_blocks=2)),
        )
        fp8 = join_request(1)
        fp8.spec.codec = "fp8"
        expect_code(
            StatusCode.INVALID_ARGUMENT, "config key 'spes_config.codec' = 'fp8' is not a codec", stub.Join, fp8
        )
        reshaped = {**MANIFEST, "embed.weight": (17, 8)}
        expect_code(
            StatusCode.INVALID_ARGUMENT,
            r"'embed.weight' has shape \[17, 8\], the run's is \[16, 8\]",
            stub.Join,
            join_request(1, manifest=reshaped),
        )
        extra = {**MANIFEST, "rogue.weight": (2,)}
        expect_code(StatusCode.INVALID_ARGUMENT, "unknown 'rogue.weight'", stub.Join, join_request(1, manifest=extra))
        greedy = join_request(1)
        greedy.spec.block_owners[:] = [1, 1]  # peer 1 claims peer 0's experts too
        expect_code(StatusCode.FAILED_PRECONDITION, r"block_owners = \[1, 1\] but the run has", stub.Join, greedy)
        assert stub.Status(pb.StatusRequest(), timeout=10).peers_joined == [0]
        assert stub.Join(join_request(1), timeout=10).current_round == -1
        finish_round(addr, 1)
        assert server.service.state.completed_round == 1


@pytest.mark.timeout(60)
def test_bad_uploads_are_refused_and_the_round_still_completes(tmp_path: Path) -> None:
    with running_server() as (server, addr), stub_for(addr) as stub:
        expect_code(
            StatusCode.FAILED_PRECONDITION, "peer 0 has not joined", stub.Upload, upload_messages(0, 1, good_chunks(0))
        )
        for peer in range(2):
            stub.Join(join_request(peer), timeout=10)
        chunks = good_chunks(0)

        wrong_shape = list(encode_tensors({"embed.weight": torch.zeros(8, 16)}, "fp32"))
        expect_code(
            StatusCode.INVALID_ARGUMENT,
            r"'embed.weight': shape \[8, 16\] on the wire, expected \[16, 8\]",
            stub.Upload,
            upload_messages(0, 1, wrong_shape),
        )
        not_owned = list(encode_tensors({"blocks.0.ffn.experts.w1.1": torch.zeros(2, 8, 4)}, "fp32"))
        expect_code(
            StatusCode.INVALID_ARGUMENT,
            "'blocks.0.ffn.experts.w1.1' is not expected",
            stub.Upload,
            upload_messages(0, 1, not_owned),
        )

        marker = tmp_path / "pwned"

        class Exploit:
            def __reduce__(self) -> tuple[object, tuple[str]]:
                return (os.system, (f"touch {marker}",))

        evil = pickle.dumps(Exploit())
        header = pb.TensorHeader(
            name="embed.weight", dtype="fp32", shape=[16, 8], num_bytes=len(evil), checksum=checksum(evil)
        )
        evil_chunk = pb.TensorChunk(header=header, offset=0, data=evil, checksum=checksum(evil))
        expect_code(
            StatusCode.INVALID_ARGUMENT, "'embed.weight': header says", stub.Upload, upload_messages(0, 1, [evil_chunk])
        )
        assert not marker.exists()

        expect_code(
            StatusCode.INVALID_ARGUMENT,
            r"stream ended before 1 expected tensor\(s\) arrived",
            stub.Upload,
            upload_messages(0, 1, chunks[:-1]),
        )
        corrupted = [pb.TensorChunk() for _ in chunks]
        for copy, chunk in zip(corrupted, chunks):
            copy.CopyFrom(chunk)
        corrupted[3].data = bytes(len(corrupted[3].data))
        reason = expect_code(
            StatusCode.INVALID_ARGUMENT, "fails its checksum", stub.Upload, upload_messages(0, 1, corrupted)
        )
        assert reason == "corrupt"  # the client sends such an upload again
        for bad in (float("nan"), -float("inf")):
            poisoned = torch.zeros(16, 8)
            poisoned[3, 5] = bad
            first = list(encode_tensors({"embed.weight": poisoned}, "fp32"))
            expect_code(
                StatusCode.INVALID_ARGUMENT,
                "'embed.weight' holds NaN or Inf values",
                stub.Upload,
                upload_messages(0, 1, first + chunks[1:]),
            )
        twice = chunks[:1] + chunks
        expect_code(StatusCode.INVALID_ARGUMENT, "'embed.weight' sent twice", stub.Upload, upload_messages(0, 1, twice))
        expect_code(
            StatusCode.INVALID_ARGUMENT,
            "must start with its UploadMeta",
            stub.Upload,
            iter([pb.UploadMessage(chunk=chunks[0])]),
        )

        assert server.service.state.snapshot().open_round is None  # nothing was committed
        finish_round(addr, 1)


@pytest.mark.timeout(60)
def test_old_future_and_repeated_rounds() -> None:
    with running_server(SPEC10) as (server, addr), stub_for(addr) as stub:
        for peer in range(2):
            stub.Join(join_request(peer, spec=SPEC10), timeout=10)
        finish_round(addr, 10)
        expect_code(
            StatusCode.FAILED_PRECONDITION,
            "round 5 is old: round 10 has already completed",
            stub.Upload,
            upload_messages(0, 5, good_chunks(0)),
        )
        again = stub.Upload(upload_messages(0, 10, good_chunks(0)), timeout=10)
        assert again.duplicate and list(again.uploaded_peers) == [0, 1]

        assert not stub.Upload(upload_messages(0, 20, good_chunks(0)), timeout=10).duplicate
        assert stub.Upload(upload_messages(0, 20, good_chunks(0)), timeout=10).duplicate  # idempotent
        expect_code(
            StatusCode.FAILED_PRECONDITION,
            r"round 30 is ahead of the open round 20, which still waits "
            r"for peers \[1\]",
            stub.Upload,
            upload_messages(1, 30, good_chunks(1)),
        )
        assert stub.Upload(upload_messages(1, 10, good_chunks(1)), timeout=10).duplicate  # still committed
        expect_code(
            StatusCode.FAILED_PRECONDITION,
            "round 5 is old: round 20 is open",
            stub.Upload,
            upload_messages(1, 5, good_chunks(1)),
        )
        expect_code(
            StatusCode.FAILED_PRECONDITION,
            "holds no upload of peer 1 for round 99",
            stub.Download,
            pb.DownloadRequest(peer_id=1, round=99),
        )
        expect_code(
            StatusCode.FAILED_PRECONDITION,
            "holds no upload of peer 1 for round 20",
            stub.Download,
            pb.DownloadRequest(peer_id=1, round=20),
        )
        status = stub.Status(pb.StatusRequest(), timeout=10)
        assert (status.current_round, status.open_round, list(status.peers_uploaded)) == (10, 20, [0])
        assert stub.Upload(upload_messages(1, 20, good_chunks(1)), timeout=10).uploaded_peers == [0, 1]
        messages = list(stub.Download(pb.DownloadRequest(peer_id=0, round=20), timeout=10))
        assert messages[0].info.round == 20
        assert server.service.state.staged == {}  # uploads are freed once the round is built


def global_ptrs(server: object) -> set[int]:
    return {t.data_ptr() for t in server.service.state.completed.global_model.values()}  # type: ignore[attr-defined]


@pytest.mark.timeout(60)
def test_upload_buffers_are_reused_but_never_while_a_download_reads_them() -> None:
    """A round's global model lives in its uploads' buffers. Later uploads reuse them (no fresh memory per
    round), except while a download of that round is still being sent: then its bytes must stay put."""
    with running_server() as (server, addr), stub_for(addr) as stub:
        for peer in range(2):
            stub.Join(join_request(peer), timeout=10)
        finish_round(addr, 1)
        # NOTE: round 1's tensors held here, so fresh memory cannot land where they were (the allocator reuses freed
        # addresses: comparing addresses alone would take fresh memory at a freed buffer's address for reuse)
        first = list(server.service.state.completed.global_model.values())
        finish_round(addr, 2)
        finish_round(addr, 3)
        reused = {t.data_ptr() for t in first} & global_ptrs(server)
        assert reused, "round 3 was received into fresh memory, not round 1's buffers"

        service = server.service
        with service.downloads.serve(0, 3, True, lambda: True, 5.0) as outgoing:  # a download of round 3, not done yet
            assert outgoing is not None
            held = outgoing.tensors
            before = {n: t.clone() for n, t in held.items()}
            read = {t.data_ptr() for t in held.values()}
            for step in (4, 5, 6):
                finish_round(addr, step)
                assert not read & global_ptrs(server)
            assert all(torch.equal(held[n], before[n]) for n in held)
            assert 3 in service.memory._retired
        assert not service.memory._retired and not service.memory._readers


@pytest.mark.timeout(60)
def test_download_waits_then_times_out_on_the_server_round_timeout() -> None:
    with running_server(tiny_spec(server=ServerSection(round_timeout_s=0.5))) as (_, addr), stub_for(addr) as stub:
        for peer in range(2):
            stub.Join(join_request(peer), timeout=10)
        stub.Upload(upload_messages(0, 1, good_chunks(0)), timeout=10)
        start = time.monotonic()
        reason = expect_code(
            StatusCode.DEADLINE_EXCEEDED,
            r"round 1 did not complete within server.round_timeout_s=0.5 s of its first upload: still waiting for "
            r"peers \[1\]",
            stub.Download,
            pb.DownloadRequest(peer_id=0, round=1),
        )
        assert reason == "round_timeout" and 0.4 < time.monotonic() - start < 5
        status = stub.Status(pb.StatusRequest(), timeout=10)
        assert (status.open_round, list(status.missing_peers), status.dead_peer_policy) == (1, [1], "wait")
        stub.Upload(upload_messages(1, 1, good_chunks(1)), timeout=10)  # the round stayed open: a late peer
        assert list(stub.Download(pb.DownloadRequest(peer_id=0, round=1), timeout=10))[0].info.peers == [0, 1]


@pytest.mark.timeout(60)
def test_shutdown_wakes_waiting_downloads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The waiting download ends at once: woken by the shutdown, not by its own re-check (made 30 s here) nor by
    the end of the grace period (made 20 s here, so that a download cancelled only then cannot pass for a woken
    one on a slow machine)."""
    monkeypatch.setattr(downloads, "WAIT_POLL_S", 30.0)
    with running_server() as (server, addr), stub_for(addr) as stub:
        for peer in range(2):
            stub.Join(join_request(peer), timeout=10)
        stub.Upload(upload_messages(0, 1, good_chunks(0)), timeout=10)
        codes: list[StatusCode] = []

        def wait_for_round() -> None:
            try:
                list(stub.Download(pb.DownloadRequest(peer_id=0, round=1), timeout=30))
            except grpc.RpcError as err:
                codes.append(err.code())

        waiter = threading.Thread(target=wait_for_round)
        waiter.start()
        wait_until(lambda: server.service.guard.open_streams == 1, "the download's stream to be admitted", 10)
        assert waiter.is_alive() and not codes  # it waits for round 1, which peer 1 never uploads
        start = time.monotonic()
        server.stop(grace_s=20.0)
        waiter.join(timeout=10)
        assert codes == [StatusCode.UNAVAILABLE] and time.monotonic() - start < 10  # half the grace


@pytest.mark.timeout(60)
def test_a_health_watcher_that_never_reads_blocks_neither_health_nor_stop() -> None:
    """A Watch client that reads nothing (no receive window: the server's first status can never go out) once held
    the health service's lock for good: every Check and Watch after it, and `stop()`, waited for ever (CI saw
    stop() hang sending NOT_SERVING). Each watch now sends from its own thread, outside that lock."""
    server = start_server(ServerConfig(SPEC, DeployConfig(host="127.0.0.1", port=0)))
    addr = f"127.0.0.1:{server.port}"
    request = health_pb2.HealthCheckRequest(service="spes.v1.ParameterServer")
    stalled = grpc.insecure_channel(addr, options=[("grpc.http2.lookahead_bytes", 0), ("grpc.http2.bdp_probe", 0)])
    stopped = threading.Event()
    try:
        never_read = health_pb2_grpc.HealthStub(stalled).Watch(request)
        # its handler has run (it holds a stream slot): the first status waits for a window that never opens
        wait_until(lambda: server.service.guard.open_streams == 1, "the stalled watch to be admitted", 10)
        with grpc.insecure_channel(addr) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            assert health.Check(request, timeout=5).status == health_pb2.HealthCheckResponse.SERVING
            watch = health.Watch(request, timeout=5)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()
        threading.Thread(target=lambda: (server.stop(grace_s=0.5), stopped.set()), daemon=True).start()
        # the alternative is a stop that never returns: any bound well inside the test's timeout tells them apart
        assert stopped.wait(30), "ParameterServer.stop() hung on a health watcher that never reads"
        with pytest.raises(grpc.RpcError):
            next(never_read)
    finally:
        stalled.close()
        if not stopped.is_set():
            server.server.stop(0)


@pytest.mark.timeout(60)
def test_every_call_needs_the_token_and_health_reports_serving() -> None:
    with running_server(SPEC, token=TOKEN) as (server, addr), grpc.insecure_channel(addr) as channel:
        stub = pb_grpc.ParameterServerStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        for metadata in ((), (("authorization", "Bearer nope"),), (("authorization", TOKEN),)):
            expect_code(
                StatusCode.UNAUTHENTICATED, "missing or wrong token", stub.Join, join_request(0), metadata=metadata
            )
            expect_code(
                StatusCode.UNAUTHENTICATED,
                "missing or wrong token",
                stub.Upload,
                upload_messages(0, 1, good_chunks(0)),
                metadata=metadata,
            )
            expect_code(
                StatusCode.UNAUTHENTICATED,
                "missing or wrong token",
                stub.Download,
                pb.DownloadRequest(peer_id=0, round=1),
                metadata=metadata,
            )
            expect_code(
                StatusCode.UNAUTHENTICATED, "missing or wrong token", stub.Status, pb.StatusRequest(), metadata=metadata
            )
            expect_code(
                StatusCode.UNAUTHENTICATED,
                "missing or wrong token",
                health.Check,
                health_pb2.HealthCheckRequest(),
                metadata=metadata,
            )
        assert not server.service.joined
        good = (("authorization", f"Bearer {TOKEN}"),)
        reply = health.Check(
            health_pb2.HealthCheckRequest(service="spes.v1.ParameterServer"), timeout=10, metadata=good
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert stub.Join(join_request(0), timeout=10, metadata=good).current_round == -1


def status_fields(stub: pb_grpc.ParameterServerStub, metadata: tuple = ()) -> dict[str, object]:
    """Status minus what the clock drives (open_round_age_s, each peer's last_seen_s)."""
    reply = stub.Status(pb.StatusRequest(), timeout=10, metadata=metadata)
    for presence in reply.presence:
        presence.ClearField("last_seen_s")
    return {f.name: v for f, v in reply.ListFields() if f.name != "open_round_age_s"}


@pytest.mark.timeout(60)
def test_bad_token_changes_no_state_and_no_token_is_ever_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    good = (("authorization", f"Bearer {TOKEN}"),)
    bad = (("authorization", "Bearer wrong-token-42"),)
    with running_server(SPEC, token=TOKEN) as (_, addr), stub_for(addr) as stub:
        for peer in range(2):
            stub.Join(join_request(peer), timeout=10, metadata=good)
        stub.Upload(upload_messages(0, 1, good_chunks(0)), timeout=10, metadata=good)
        before = status_fields(stub, good)
        assert before["peers_uploaded"] == [0] and before["bytes_in"] > 0
        for peer, step in ((1, 1), (0, 1), (1, 2)):
            expect_code(
                StatusCode.UNAUTHENTICATED,
                "missing or wrong token",
                stub.Upload,
                upload_messages(peer, step, good_chunks(peer)),
                metadata=bad,
            )
        expect_code(StatusCode.UNAUTHENTICATED, "missing or wrong token", stub.Join, join_request(1), metadata=bad)
        assert status_fields(stub, good) == before
        with make_client(addr, SPEC, 1, token="wrong-token-42", rpc_timeout_s=5, max_retries=1) as client:
            with pytest.raises(SyncError, match="UNAUTHENTICATED"):
                client.join()
        assert status_fields(stub, good) == before
    assert "refused /spes.v1.ParameterServer/Upload: missing or wrong token" in caplog.text
    assert TOKEN not in caplog.text and "wrong-token-42" not in caplog.text


def overrunning_upload(counter: list[int], num_chunks: int = 20_000) -> Iterator[pb.UploadMessage]:
    """embed.weight (512 bytes by the manifest) followed by ~10 MB more of it; counts what was pulled."""
    data = bytes(512)
    header = pb.TensorHeader(name="embed.weight", dtype="fp32", shape=[16, 8], num_bytes=512, checksum=checksum(data))
    yield pb.UploadMessage(meta=pb.UploadMeta(peer_id=0, round=1))
    for i in range(num_chunks):
        counter[0] += 1
        chunk = pb.TensorChunk(header=header if i == 0 else None, offset=512 * i, data=data, checksum=checksum(data))
        yield pb.UploadMessage(chunk=chunk)


@pytest.mark.timeout(60)
def test_oversized_uploads_are_refused_before_they_are_read() -> None:
    with running_server() as (server, addr), stub_for(addr) as stub:
        for peer in range(2):
            stub.Join(join_request(peer), timeout=10)
        pulled = [0]
        expect_code(
            StatusCode.INVALID_ARGUMENT,
            "'embed.weight': chunk at offset 512 overruns the header's 512 bytes",
            stub.Upload,
            overrunning_upload(pulled),
        )
        assert pulled[0] < 2_000, pulled  # the rest of the stream was never sent
        huge = bytes(5 * 2**20)  # one message larger than --max_message_mb=4: gRPC refuses it unread
        header = pb.TensorHeader(name="embed.weight", dtype="fp32", shape=[16, 8], num_bytes=512, checksum=0)
        message = pb.TensorChunk(header=header, offset=0, data=huge, checksum=checksum(huge))
        expect_code(StatusCode.RESOURCE_EXHAUSTED, "", stub.Upload, upload_messages(0, 1, [message]))
        assert server.service.state.snapshot().open_round is None and status_fields(stub)["bytes_in"] == 512
        finish_round(addr, 1)


@pytest.mark.timeout(60)
def test_a_restarted_server_resumes_from_its_state_dir(tmp_path: Path) -> None:
    state_dir = str(tmp_path / "state")
    with running_server(SPEC10, state_dir=state_dir) as (_, addr), stub_for(addr) as stub:
        run_id = {stub.Join(join_request(peer, spec=SPEC10), timeout=10).run_id for peer in range(2)}.pop()
        finish_round(addr, 10)
        first = list(stub.Download(pb.DownloadRequest(peer_id=0, round=10, full=True), timeout=10))
        stub.Upload(upload_messages(0, 20, good_chunks(0)), timeout=10)  # round 20 open: not persisted
    with running_server(SPEC10, state_dir=state_dir) as (_, addr), stub_for(addr) as stub:
        status = stub.Status(pb.StatusRequest(), timeout=10)
        assert (status.current_round, status.open_round, list(status.round_peers), status.persistent) == (
            10,
            -1,
            [0, 1],
            True,
        )
        reason = expect_code(
            StatusCode.FAILED_PRECONDITION,
            "peer 0 has not joined this server: call Join first",
            stub.Download,
            pb.DownloadRequest(peer_id=0, round=10),
        )
        assert reason == "not_joined"
        bad = {**MANIFEST, "embed.weight": (17, 8)}
        expect_code(
            StatusCode.INVALID_ARGUMENT,
            r"'embed.weight' has shape \[17, 8\], the run's is \[16, 8\]",
            stub.Join,
            join_request(0, spec=SPEC10, manifest=bad),
        )  # the persisted manifest is the run's
        other_run = expect_code(
            StatusCode.FAILED_PRECONDITION,
            f"peer 0 starts a fresh run, but this server holds run {run_id} at round 10: .*--resume=auto",
            stub.Join,
            join_request(0, spec=SPEC10),
        )  # a node of the run resumes with its id (its checkpoint's): a fresh one would mix two runs
        assert other_run == "other_run"
        expect_code(
            StatusCode.FAILED_PRECONDITION,
            f"peer 0 belongs to run elsewhere .* but this server holds run {run_id} at round 10",
            stub.Join,
            join_request(0, spec=SPEC10, run_id="elsewhere"),
        )
        for peer in range(2):
            assert stub.Join(join_request(peer, spec=SPEC10, run_id=run_id), timeout=10).current_round == 10
        assert stub.Upload(upload_messages(1, 10, good_chunks(1)), timeout=10).duplicate
        again = list(stub.Download(pb.DownloadRequest(peer_id=0, round=10, full=True), timeout=10))
        assert again == first  # byte for byte the same global model
        reason = expect_code(
            StatusCode.FAILED_PRECONDITION,
            "holds no upload of peer 0 for round 20",
            stub.Download,
            pb.DownloadRequest(peer_id=0, round=20),
        )
        assert reason == "unknown_round"
        finish_round(addr, 20)
    with pytest.raises(ValueError, match="written by a run with mode='spes'"):
        with running_server(tiny_spec(mode="diloco", sync_steps=10), state_dir=state_dir):
            pass


@pytest.mark.timeout(60)
def test_a_second_server_on_a_state_dir_in_use_is_refused_and_a_stopped_servers_is_free(tmp_path: Path) -> None:
    """Two servers sharing one --state_dir would write their rounds over each other's: the second is refused before
    it touches the directory or binds a port, the first serves on; once it stops, a server restarts there."""
    state_dir = str(tmp_path / "state")
    with running_server(SPEC10, state_dir=state_dir) as (first, addr), stub_for(addr) as stub:
        with pytest.raises(ValueError) as refused:
            with running_server(SPEC10, state_dir=state_dir):
                pass
        assert str(refused.value) == (
            f"--state_dir {state_dir} is in use by another parameter server ({lock_holder()}); stop it or pass "
            "another --state_dir"
        )
        for peer in range(2):
            stub.Join(join_request(peer, spec=SPEC10), timeout=10)
        finish_round(addr, 10)
        run_id = first.service.run_id
    with running_server(SPEC10, state_dir=state_dir) as (again, addr), stub_for(addr) as stub:
        assert again.service.run_id == run_id and stub.Status(pb.StatusRequest(), timeout=10).current_round == 10


@pytest.mark.timeout(60)
def test_a_server_that_cannot_bind_leaves_no_thread_behind() -> None:
    """A failed start (a port in use, a TLS file missing) undoes the coordinator whole: a status reporter left
    running logged `waiting:` lines for a server that never served, into whatever ran next in the process."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        before = set(threading.enumerate())
        with pytest.raises(ValueError, match="cannot listen on"):
            start_server(ServerConfig(SPEC, DeployConfig(host="127.0.0.1", port=taken.getsockname()[1])))

    def left() -> list[str]:
        return [t.name for t in set(threading.enumerate()) - before if t.name.startswith("spes-")]

    wait_until(lambda: left() in ([], ["spes-stalls"]), "no thread but the process's one stall watch", 5.0)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_server_process_on_a_state_dir_in_use_exits_in_one_line_and_a_killed_ones_restarts(tmp_path: Path) -> None:
    """The lock is the process's: a second `python -m spes.server` on a live server's --state_dir exits 2 with one
    line naming the first one's pid; the first one SIGKILLed, the system has released it and a restart serves."""
    state_dir = str(tmp_path / "state")
    command = [sys.executable, "-m", "spes.server", "--total_peers", "2", "--num_train_experts_per_node", "2"]
    command += ["--host", "127.0.0.1", "--state_dir", state_dir, "--port", "0"]
    first, _ = start_subprocess_server({}, command)
    procs = [first]
    try:
        second = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=30)
        assert second.returncode == 2
        assert second.stderr.strip().splitlines() == [
            f"error: --state_dir {state_dir} is in use by another parameter server "
            f"(pid {first.pid} on {socket.gethostname()}); stop it or pass another --state_dir"
        ]
        assert first.poll() is None
        first.kill()  # SIGKILL: the server releases nothing itself
        first.wait(timeout=10)
        restarted, port = start_subprocess_server({}, command)
        procs.append(restarted)
        with stub_for(f"127.0.0.1:{port}") as stub:
            assert stub.Status(pb.StatusRequest(), timeout=10).persistent
        restarted.send_signal(signal.SIGTERM)
        assert restarted.wait(timeout=30) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def start_subprocess_server(env_extra: dict[str, str], args: list[str]) -> tuple[subprocess.Popen[str], int]:
    env = {**os.environ, "PYTHON": sys.executable, **env_extra}
    proc = subprocess.Popen(args, cwd=REPO, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    assert proc.stderr is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        match = re.search(r"listening on [\d.]+:(\d+)", line)
        if match:
            return proc, int(match.group(1))
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"server did not start: {proc.stderr.read()}")


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_real_server_process_serves_a_round_and_exits_0_on_sigterm() -> None:
    env = {"TOTAL_PEERS": "2", "NUM_TRAIN_EXPERTS_PER_NODE": "2", "PORT": "0", "SPES_TOKEN": TOKEN}
    proc, port = start_subprocess_server(env, ["bash", "run_scripts/run_parameter_server.sh", "--host", "127.0.0.1"])
    try:
        spec = tiny_spec(sync_steps=500)  # the first implementation's server knows neither the model nor sync_steps
        clients = [
            make_client(f"127.0.0.1:{port}", spec, p, token=TOKEN, rpc_timeout_s=10, round_timeout_s=30)
            for p in range(2)
        ]
        for client in clients:
            client.join()
        results = sync_all(clients, 500, {p: peer_upload(spec, p, seed=9) for p in range(2)})
        assert results[0][1].merged and results[0][1].alpha == pytest.approx(0.01 * (1 - 500 / 10000))
        for client in clients:
            client.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0  # the alternative, a server that does not stop, never exits
        assert proc.stderr is not None
        log = proc.stderr.read()
        assert "round 500 complete: peers 2" in log and "merged yes" in log
        assert TOKEN not in log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_sigint_also_exits_0_and_help_works() -> None:
    proc, _ = start_subprocess_server(
        {},
        [
            sys.executable,
            "-m",
            "spes.server",
            "--total_peers",
            "1",
            "--num_train_experts_per_node",
            "1",
            "--port",
            "0",
            "--host",
            "127.0.0.1",
        ],
    )
    try:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    help_text = subprocess.run(
        [sys.executable, "-m", "spes.server", "--help"], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    for flag in ("--total_peers", "server.merge_topk", "--token_file", "--tls_client_ca", "server.outer_optimizer"):
        assert flag in help_text


def server_config(*argv: str) -> ServerConfig:
    """What `python -m spes.server ARGV` serves: its command read (without torch), then its run spec built."""
    return config_of(command_from_args(build_parser().parse_args(list(argv))))


def test_command_line_builds_the_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first implementation's flags are spellings of config overrides; spes's own run settings are overrides."""
    base = ["--total_peers", "4", "--num_train_experts_per_node=2"]
    monkeypatch.setenv("SPES_TOKEN", "from-env")
    cfg = server_config(*base, "--server.merge_topk=2", "--using_dilico=true", "--merge_interval", "7")
    spec = cfg.spec  # a DiLoCo run: its block holds every expert of the model, which the first node says
    assert (spec.num_peers, spec.experts_per_block, spec.mode, spec.server.merge_topk, cfg.deploy.token) == (
        4,
        None,
        "diloco",
        2,
        "from-env",
    )
    assert spec.server.merge_interval == 7 and spec.origin == "the server's command line"
    assert "from-env" not in repr(cfg)
    secret = tmp_path / "secret"
    secret.write_text("from-file\n")
    assert server_config(*base, "--token_file", str(secret)).deploy.token == "from-file"
    secret.write_text("  \n")
    with pytest.raises(ValueError, match="is empty"):
        server_config(*base, "--token_file", str(secret))
    with pytest.raises(FileNotFoundError, match="--token_file"):
        server_config(*base, "--token_file", str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="--tls_cert and --tls_key"):
        server_config(*base, "--tls_cert", "x.crt")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("plane", ["grpc", "tcp"])
def test_downloads_hash_again_only_what_the_round_changed(plane: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Experts taken verbatim from their owners go out under the checksum verified on receipt; averaged and
    merged tensors are hashed anew. Every peer's download is still checked against its checksums."""
    hashed: list[torch.Tensor] = []
    encode_whole = wire.encode_whole
    monkeypatch.setattr(wire, "encode_whole", lambda t, *args: hashed.append(t) or encode_whole(t, *args))
    spec = tiny_spec(server=ServerSection(merge_interval=100, merge_alpha_start=0.5, merge_topk=2), sync_steps=50)
    manifest = spec.manifest or {}
    experts = {n for n in manifest if parse_expert_block(n) is not None}
    with (
        running_server(spec, data_port=0 if plane == "tcp" else -1) as (server, addr),
        joined_clients(addr, spec, data_plane=plane) as clients,
    ):
        for step, merged in ((50, False), (100, True), (150, False)):
            hashed.clear()
            uploads = {p: peer_upload(spec, p, seed=step) for p in range(2)}
            check_round(sync_all(clients, step, uploads), uploads, spec, step=step)
            global_model = server.service.state.completed.global_model  # type: ignore[union-attr]
            again = {n for n, t in global_model.items() if any(t is h for h in hashed)}
            assert again == (set(manifest) if merged else set(manifest) - experts), step


@pytest.mark.timeout(60)
def test_bf16_rounds_sum_their_fp32_means_into_kept_buffers() -> None:
    """Shared tensors uploaded in bf16 are averaged in fp32: from round 3 on into round 1's buffers, not fresh
    memory (the means are retired with round 1 once round 2 replaces it and round 1's downloads are done)."""
    spec = tiny_spec(codec="bf16", server=NO_MERGE)
    pointers = []
    with running_server(spec) as (server, addr), joined_clients(addr, spec) as clients:
        for step in (1, 2, 3):
            uploads = {p: peer_upload(spec, p, seed=step) for p in range(2)}
            results = sync_all(clients, step, uploads)
            wire = {p: {n: t.bfloat16() for n, t in up.items()} for p, up in uploads.items()}
            want = build_global(wire, spec=spec, step=step).tensors
            for got, _ in results.values():
                for name, tensor in got.items():
                    torch.testing.assert_close(tensor, want[name].bfloat16(), rtol=0, atol=0)
            global_model = server.service.state.completed.global_model  # type: ignore[union-attr]
            pointers.append({t.data_ptr() for t in global_model.values() if t.dtype == torch.float32})
    assert pointers[0] and pointers[2] == pointers[0] and not pointers[1] & pointers[0]


def test_off_loopback_needs_a_token_and_tls_unless_insecure(tmp_path: Path) -> None:
    """The quickstart (127.0.0.1) needs no flag; any other address refuses to start without protection."""
    for host in ("127.0.0.1", "localhost", "::1"):
        DeployConfig(host=host).check_exposure()
    with pytest.raises(ValueError, match="no token is set.*--insecure"):
        DeployConfig(host="0.0.0.0").check_exposure()
    with pytest.raises(ValueError, match="clear text.*--tls_cert"):
        DeployConfig(host="10.1.2.3", token=TOKEN).check_exposure()
    DeployConfig(host="0.0.0.0", insecure=True).check_exposure()
    DeployConfig(host="0.0.0.0", token=TOKEN, tls_cert="c.pem", tls_key="k.pem").check_exposure()
    with pytest.raises(ValueError, match="--insecure"):
        start_server(ServerConfig(SPEC, DeployConfig(host="0.0.0.0", port=0)))


def test_the_runs_yaml_gives_the_spec_and_the_manifest() -> None:
    config = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")
    spec = server_config(config).spec
    assert (spec.num_peers, spec.experts_per_block, spec.mode, spec.sync_steps) == (4, 2, "spes", 10)
    assert spec == spec_of_run(config) and spec.manifest is not None and "lm_head.weight" in spec.manifest
    eight = server_config(config, "--spes_config.num_peers=8").spec
    assert eight.num_peers == 8 and eight.block_owners == (0, 1, 2, 3)  # peers past the last block train shared
    agreeing = server_config(config, "--total_peers", "4").spec  # checked, not set
    assert agreeing == spec
    legacy = server_config().spec  # the defaults: a server for a 4-peer SPES run
    assert (legacy.mode, legacy.num_peers, legacy.manifest, legacy.sync_steps) == ("spes", 4, None, None)


def test_an_oversized_manifest_is_refused_before_anything_is_allocated() -> None:
    open_spec = dataclasses.replace(SPEC, manifest=None, sync_steps=None, block_owners=None)  # no YAML given
    with running_server(open_spec, max_model_gb=0.001, max_tensors=20) as (server, addr):
        huge = dataclasses.replace(SPEC, manifest={**MANIFEST, "embed.weight": (1 << 20, 1 << 20)})
        with make_client(addr, huge, 0, max_retries=0) as client:
            with pytest.raises(SyncError, match=r"4398 GB in fp32, more than --max_model_gb=0.001") as err:
                client.join()
            assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        many = dataclasses.replace(SPEC, manifest={**MANIFEST, **{f"extra.{i}": (1,) for i in range(10)}})
        with make_client(addr, many, 0, max_retries=0) as client:
            with pytest.raises(SyncError, match="names 30 tensors, more than --max_tensors=20") as err:
                client.join()
            assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert server.service.spec.manifest is None  # nothing was learned from either


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_diloco_server_killed_after_an_outer_step_resumes_bit_identically(tmp_path: Path) -> None:
    """SIGKILL once round 2 is complete: its outer Nesterov step made the momentum the next steps build on (round
    1's mean is only the starting point, so a kill before round 2 finds no momentum to lose). A server restarted
    on the same --state_dir and port must then build rounds 3 and 4 bit for bit as the uninterrupted run does,
    which it can only do from the persisted momentum."""
    spec = tiny_spec(mode="diloco", server=ServerSection(outer_optimizer="nesterov"))
    uploads = {step: {p: peer_upload(spec, p, seed=step) for p in range(2)} for step in (1, 2, 3, 4)}
    want: dict[int, dict[str, torch.Tensor]] = {}
    previous: dict[str, torch.Tensor] = {}
    momentum: dict[str, torch.Tensor] = {}
    for step, peers in uploads.items():
        built = build_global(peers, spec=spec, step=step, previous=previous, momentum=momentum)
        previous, momentum, want[step] = built.tensors, built.momentum, built.tensors
    settings = ["--total_peers", "2", "--num_train_experts_per_node", "2", "--using_dilico=true"]
    settings += ["--server.outer_optimizer=nesterov", "--state_dir", str(tmp_path / "state"), "--host", "127.0.0.1"]
    command = [sys.executable, "-m", "spes.server", *settings, "--port"]
    proc, port = start_subprocess_server({}, [*command, "0"])
    procs = [proc]
    try:
        with joined_clients(f"127.0.0.1:{port}", spec, max_retries=10) as clients:
            for step in (1, 2):
                results = sync_all(clients, step, uploads[step])
            proc.kill()  # SIGKILL: nothing is flushed or saved on the way out
            proc.wait(timeout=10)
            procs.append(start_subprocess_server({}, [*command, str(port)])[0])
            assert clients[0].status().current_round == 2
            for step in (3, 4):
                results = sync_all(clients, step, uploads[step])
                for peer in range(2):
                    got = results[peer][0]
                    assert sorted(got) == sorted(want[step])
                    assert all(torch.equal(got[n], want[step][n]) for n in got), (peer, step)
    finally:
        for running in procs:
            if running.poll() is None:
                running.kill()
                running.wait()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_a_rounds_tensors_are_freed_with_it_not_left_to_the_cycle_collector(codec: str) -> None:
    """Nothing a round makes (encoded downloads, re-encoded held tensors) sits in a reference cycle: it is freed as
    soon as the round is superseded. A cycle would keep it until CPython's rare full collection, so a long-running
    server's memory crept round after round (bench/bench_soak.py measured it) and fell back only then."""
    spec = tiny_spec(num_peers=2, codec=codec)
    with running_server(spec) as (_, addr), joined_clients(addr, spec) as clients:
        for step in (1, 2):  # the first rounds set up what every later one reuses
            sync_all(clients, step, {p: peer_upload(spec, p, seed=step) for p in range(2)})
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for step in range(3, 9):
                sync_all(clients, step, {p: peer_upload(spec, p, seed=step) for p in range(2)})
            gc.collect()
            cyclic = sorted({type(o).__qualname__ for o in gc.garbage if _made_here_or_tensor(o)})
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    assert cyclic == [], f"in reference cycles after {codec} rounds: {cyclic}"


def _made_here_or_tensor(obj: object) -> bool:
    return isinstance(obj, torch.Tensor) or type(obj).__module__.startswith("spes.")


def test_the_start_line_names_the_run_by_its_settings_not_a_python_repr() -> None:
    """It read `run RunSpec(mode='spes', ..., codec_settings=(), origin=...)` and left out the merge warm-up the
    server applies; an open setting (a server started without the run's YAML) reads `open`."""
    merge = ServerSection(merge_interval=20, merge_alpha_start=0.05, merge_decay_steps=200)
    spes = dataclasses.replace(
        tiny_spec(num_peers=4, sync_steps=10, server=merge), last_step=400, origin="configs/tiny.yaml"
    )
    assert describe_run(spes) == (
        "mode spes, num_peers 4, experts per block 2, sync_steps 10, last step 400, codec fp32, merge warm-up every "
        "20 steps, alpha 0.05 decaying to 0 at step 200 (from configs/tiny.yaml)"
    )
    diloco = tiny_spec(mode="diloco", codec="int8", codec_settings={"block": 256}, overlap_fragments=2, sync_steps=4)
    assert describe_run(dataclasses.replace(diloco, sync_steps=None)).endswith(
        "sync_steps open, last step open, codec int8 block=256, overlap_fragments 2, outer_optimizer none"
    )
    assert describe_run(tiny_spec(server=ServerSection(merge_interval=0))).endswith(", no merge warm-up")
