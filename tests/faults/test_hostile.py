"""Hostile and careless input against a real server process on loopback, each case with its own crafted client.

Every case asserts the refusal code, that Status still answers within 1 s (a deadline on a connected channel),
that the server's resident memory stays under RSS_BOUND, and that a following legitimate round completes with
exactly the fault-free result. The server runs with small limits so the limits themselves are exercised:
--stream_idle_timeout 2, --max_streams 16 (per plane), --max_streams_per_peer 6, --handshake_timeout 3.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import resource
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import grpc
import pytest
import torch
from fault_helpers import (
    REPO,
    ServerProcess,
    assert_exact,
    fault_free,
    proc_usage,
    server_command,
    server_process,
    spec_overrides,
)

from conftest import wait_until
from spes.sync import plane_tcp
from spes.sync.client import SyncClient, SyncError
from spes.sync.proto import spes_pb2 as pb
from spes.sync.proto import spes_pb2_grpc as pb_grpc
from spes.sync.protocol import PROTOCOL_VERSION
from spes.sync.server import spec_of_run
from spes.sync.wire import encode_tensors, upload_digest
from sync_helpers import NO_MERGE, TOKEN, make_client, peer_upload, running_server, tiny_spec

PEERS = 2
SPEC = tiny_spec(num_peers=PEERS, server=NO_MERGE)
MANIFEST = SPEC.manifest or {}
RSS_BOUND = 1 << 30
"""The server process (torch imported, a tiny model) stays far below this; a 4 TiB manifest would not."""
IDLE_S = 2
HANDSHAKE_S = 3
SLOTS = 16
ARGS = [
    *spec_overrides(SPEC),
    "--data_port",
    "0",
    "--stream_idle_timeout",
    str(IDLE_S),
    "--max_streams",
    str(SLOTS),
    "--max_streams_per_peer",
    "6",
    "--handshake_timeout",
    str(HANDSHAKE_S),
]
UPLOAD = "/spes.v1.ParameterServer/Upload"
PROBE = "/spes.v1.ParameterServer/Probe"


class Run:
    """A server process, two live peers and a connected probe channel; `round()` runs one legitimate round."""

    def __init__(self, server: ServerProcess, stack: ExitStack, token: str | None = None) -> None:
        self.server, self.token, self.step, self.run_id, self.stack = server, token, 0, None, stack
        self.clients = [stack.enter_context(self.client(p)) for p in range(PEERS)]
        for client in self.clients:
            client.join()
        self.run_id = self.clients[0].run_id
        self.data_port: int = self.clients[0].plane.port  # type: ignore[attr-defined]
        """The server's data plane (a client may fall back to gRPC once it finds it busy)."""
        self.probe = stack.enter_context(grpc.insecure_channel(server.addr))
        grpc.channel_ready_future(self.probe).result(timeout=10)

    def client(self, peer: int, **kwargs: object) -> SyncClient:
        """A process acting as peer `peer` of this run (once it has one: a restarted or replacement node)."""
        settings: dict = {"rpc_timeout_s": 10, "round_timeout_s": 60, "max_retries": 8, "run_id": self.run_id}
        settings.update(kwargs)
        return make_client(self.server.addr, SPEC, peer, token=self.token, **settings)

    def status(self) -> pb.StatusReply:
        """Status must answer within 1 s, whatever else is going on."""
        metadata = (("authorization", f"Bearer {self.token}"),) if self.token else ()
        return pb_grpc.ParameterServerStub(self.probe).Status(pb.StatusRequest(), timeout=1.0, metadata=metadata)

    def round(self) -> None:
        """One round with both peers; the result must equal the fault-free one bit for bit."""
        self.step += 1
        uploads = {p: peer_upload(SPEC, p, seed=self.step) for p in range(PEERS)}
        with ThreadPoolExecutor(PEERS) as pool:
            futures = [pool.submit(c.sync, self.step, uploads[p]) for p, c in enumerate(self.clients)]
            results = [f.result(timeout=90) for f in futures]
        want = fault_free({self.step: uploads}, SPEC)
        for got, stats in results:
            assert stats.round == self.step
            assert_exact(got, want)

    def check_healthy(self) -> None:
        assert self.status().current_round == self.step
        assert proc_usage(self.server.proc.pid)["rss"] < RSS_BOUND
        self.round()
        assert self.status().current_round == self.step


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    log = tmp_path_factory.mktemp("hostile") / "server.log"
    with server_process(log, ARGS) as server, ExitStack() as stack:
        r = Run(server, stack)
        r.round()
        yield r


def rpc_code(call: grpc.Future) -> grpc.StatusCode:
    try:
        call.result(timeout=30)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def never_sends(stop: threading.Event) -> Iterator[bytes]:
    stop.wait()
    yield from ()


def error_code(sock: socket.socket) -> str:
    """The code of the data plane's error frame on `sock` ('closed' when it just hung up)."""
    try:
        reply = plane_tcp.recv_reply(sock)
    except (OSError, plane_tcp.TransportError):
        return "closed"
    return reply.error.code or str(reply.WhichOneof("kind"))


def hello(peer: int = 0, step: int = 1, token: str | None = None, version: int = PROTOCOL_VERSION) -> bytes:
    """A data-plane upload handshake, as bytes (the preamble of protocol `version`, then a `DataHello` frame)."""
    body = pb.DataHello(op=pb.DATA_OP_UPLOAD, peer_id=peer, step=step, token=token or "").SerializeToString()
    return struct.pack("<4sH", b"SPES", version) + struct.pack("<I", len(body)) + body


def tensor_header(shape: list[int], num_bytes: int) -> pb.TensorHeader:
    return pb.TensorHeader(name="embed.weight", dtype="fp32", shape=shape, num_bytes=num_bytes)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_flood_from_one_address_leaves_the_data_plane_to_the_others(run: Run) -> None:
    """Silent data-plane connections from 127.0.0.2 hold at most a quarter of the 16 pending slots, so the peers'
    round (from 127.0.0.1) still goes over the data plane (with all 16 held, they would fall back to gRPC)."""
    with ExitStack() as stack:
        flood = [stack.enter_context(connect_from("127.0.0.2", _data_port(run))) for _ in range(SLOTS)]
        time.sleep(0.3)
        assert [error_code(s) for s in flood[SLOTS // 4 :]] == ["RESOURCE_EXHAUSTED"] * (SLOTS - SLOTS // 4)
        run.check_healthy()
        assert [client.plane.name for client in run.clients] == ["tcp"] * PEERS


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_idle_streams_and_connections_hold_nothing(tmp_path: Path) -> None:
    """200 idle gRPC streams and 200 idle data-plane connections, half with the token and half without: the
    server refuses what exceeds its slots (RESOURCE_EXHAUSTED) or what has no token (UNAUTHENTICATED), closes
    the rest after --stream_idle_timeout (DEADLINE_EXCEEDED), Status answers throughout, a round completes."""
    stop = threading.Event()
    with server_process(tmp_path / "server.log", ARGS, env={"SPES_TOKEN": TOKEN}) as server, ExitStack() as stack:
        r = Run(server, stack, token=TOKEN)
        channels = [stack.enter_context(grpc.insecure_channel(server.addr)) for _ in range(4)]
        calls = []
        for i in range(200):
            metadata = (("authorization", f"Bearer {TOKEN}"),) if i % 2 else ()
            method = channels[i % 4].stream_unary(UPLOAD)
            calls.append((bool(i % 2), method.future(never_sends(stop), metadata=metadata, timeout=60)))
        socks = []
        for i in range(200):
            sock = socket.create_connection(("127.0.0.1", _data_port(r)), timeout=30)
            if i % 4 == 1:
                sock.sendall(hello(token=TOKEN)[:9])  # half-open: a partial handshake, then nothing
            elif i % 4 == 2:
                sock.sendall(hello(token=None))  # no token: refused at once
            socks.append(stack.enter_context(sock))
        time.sleep(0.5)
        r.status()
        r.round()  # clients retry what the full slots refuse; the idle holders are closed after IDLE_S
        stop.set()
        codes = [(authed, rpc_code(call)) for authed, call in calls]
        assert {c for a, c in codes if not a} == {grpc.StatusCode.UNAUTHENTICATED}
        authed = {c for a, c in codes if a}
        assert grpc.StatusCode.DEADLINE_EXCEEDED in authed and authed <= {
            grpc.StatusCode.DEADLINE_EXCEEDED,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        }, authed
        data_codes = {error_code(s) for s in socks}
        assert {"DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "UNAUTHENTICATED"} <= data_codes, data_codes
        r.check_healthy()
        assert "idle" in server.log_text()


def connect_from(source: str, port: int) -> socket.socket:
    """A connection to the server's `port` from loopback address `source` (all of 127/8 is this host's)."""
    sock = socket.socket()
    sock.bind((source, 0))
    sock.settimeout(30)
    sock.connect(("127.0.0.1", port))
    return sock


def _data_port(r: Run) -> int:
    assert r.data_port, "the data plane is on (--data_port 0)"
    return r.data_port


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_garbage_and_truncated_frames_on_both_planes(run: Run) -> None:
    port = _data_port(run)
    refusals = []
    for payload in (
        os.urandom(64),  # not a SPES client at all
        hello()[:6] + struct.pack("<I", 1 << 31),  # a hello declaring 2 GiB
        b"SPES" + b"\xff\xff" + os.urandom(32),  # another (newer) version: refused naming both
        hello()[:6] + struct.pack("<I", 11) + b"\xff\xfe\xfd garbage",  # a current preamble, then not a DataHello
    ):
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(payload)
            refusals.append(error_code(sock))
    assert refusals == ["closed", "closed", "FAILED_PRECONDITION", "FAILED_PRECONDITION"]
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:  # a v3 peer, refused in its own JSON
        sock.sendall(hello(version=3))
        (length,) = struct.unpack("<I", sock.recv(4, socket.MSG_WAITALL))
        assert "v3 but this server speaks v6" in json.loads(sock.recv(length, socket.MSG_WAITALL))["message"]
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:  # a truncated tensor, then hang-up
        sock.sendall(hello(step=run.step + 1))
        assert plane_tcp.recv_reply(sock).send
        plane_tcp.send_frame(sock, tensor_header([16, 8], 512))
        sock.sendall(b"\0" * 100)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:  # truncated, then silence
        sock.sendall(hello(step=run.step + 1)[:12])
        assert error_code(sock) == "DEADLINE_EXCEEDED"
    with socket.create_connection(("127.0.0.1", run.server.port), timeout=10) as sock:  # not HTTP/2 at all
        sock.sendall(os.urandom(256))
        with contextlib.suppress(OSError):  # an HTTP/2 GOAWAY, then the server hangs up
            while sock.recv(1024):
                pass
    garbage = run.probe.stream_unary(UPLOAD)
    with pytest.raises(grpc.RpcError) as err:
        garbage(iter([b"\xff\xfe\xfd garbage"]), timeout=10)
    assert err.value.code() == grpc.StatusCode.INTERNAL  # grpc's own: "Exception deserializing request!"
    upload = run.probe.stream_unary(
        UPLOAD, request_serializer=pb.UploadMessage.SerializeToString, response_deserializer=pb.UploadReply.FromString
    )
    header = pb.TensorHeader(name="embed.weight", dtype="fp32", shape=[16, 8], num_bytes=512)
    truncated = [
        pb.UploadMessage(meta=pb.UploadMeta(peer_id=0, round=run.step + 1)),
        pb.UploadMessage(chunk=pb.TensorChunk(header=header, offset=0, data=b"\0" * 100)),
    ]
    with pytest.raises(grpc.RpcError) as err:
        upload(iter(truncated), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = run.status()
    assert status.open_round == -1 and not status.peers_uploaded  # nothing of any of it was kept
    run.check_healthy()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_declared_sizes_and_counts_past_every_limit(run: Run, tmp_path: Path) -> None:
    def join(channel: grpc.Channel, manifest: dict[str, tuple[int, ...]]) -> grpc.RpcError:
        request = pb.JoinRequest(
            peer_id=1,
            manifest=[pb.TensorSpec(name=n, shape=s) for n, s in manifest.items()],
            protocol=PROTOCOL_VERSION,
            spec=SPEC.to_proto(),
        )
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.ParameterServerStub(channel).Join(request, timeout=10)
        return err.value

    huge_manifest = {**MANIFEST, "embed.weight": (1 << 20, 1 << 20)}  # 4 TiB in fp32
    with server_process(tmp_path / "server.log", ARGS) as fresh, grpc.insecure_channel(fresh.addr) as channel:
        # NOTE: a server without the run's YAML that no node has joined yet knows no model: the limit applies
        huge = join(channel, huge_manifest)
        assert huge.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max_model_gb=48" in huge.details()
        assert proc_usage(fresh.proc.pid)["rss"] < RSS_BOUND
    differs = join(run.probe, huge_manifest)  # the joined run knows its model from its first join
    assert differs.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'embed.weight' has shape [1048576, 1048576], the run's is [16, 8]" in differs.details()
    many = join(run.probe, {f"t{i}": (1,) for i in range(20000)})
    assert many.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max_tensors=16384" in many.details()
    big = run.probe.unary_unary("/spes.v1.ParameterServer/Status")
    with pytest.raises(grpc.RpcError) as err:
        big(b"\0" * (5 << 20), timeout=10)  # past --max_message_mb=4
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    port = _data_port(run)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(hello(step=run.step + 1))
        assert plane_tcp.recv_reply(sock).send
        plane_tcp.send_frame(sock, tensor_header([1 << 20, 1 << 20], 1 << 42))
        assert plane_tcp.recv_reply(sock).error.code == "INVALID_ARGUMENT"
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(hello(step=run.step + 1))
        assert plane_tcp.recv_reply(sock).send
        sock.sendall(struct.pack("<I", 1 << 30))  # a tensor header frame declaring 1 GiB
        assert error_code(sock) == "closed"
    run.check_healthy()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_duplicate_peer_ids_and_a_restarted_peer(run: Run) -> None:
    """A second live process claiming a joined peer id is refused naming both addresses, several at once too;
    once the first process is gone, a restarted one with the same id is admitted at once."""
    with ExitStack() as stack:
        intruders = [stack.enter_context(run.client(0, max_retries=0)) for _ in range(3)]
        with ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(c.join) for c in intruders]
            errors = [f.exception(timeout=30) for f in futures]
    for err in errors:
        assert isinstance(err, SyncError) and err.code == grpc.StatusCode.ALREADY_EXISTS, err
        assert str(err).count("ipv4:127.0.0.1:") == 2, err
    run.check_healthy()
    run.clients[0].close()  # the old process goes away; its restart takes over the id
    run.clients[0] = run.stack.enter_context(run.client(0))
    run.clients[0].join()
    run.check_healthy()


def test_two_processes_joining_with_one_peer_id_at_once() -> None:
    """With nobody joined yet, two processes claiming the same id at the same moment: exactly one gets it."""
    spec = tiny_spec()
    with running_server(spec) as (_, addr), ExitStack() as stack:
        clients = [stack.enter_context(make_client(addr, spec, 1, max_retries=0)) for _ in range(2)]
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(c.join) for c in clients]
            errors = [f.exception(timeout=30) for f in futures]
    refused = [e for e in errors if e is not None]
    assert len(refused) == 1 and isinstance(refused[0], SyncError)
    assert refused[0].code == grpc.StatusCode.ALREADY_EXISTS and refused[0].reason == "duplicate_peer"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_join_mid_round_and_a_replayed_old_upload(run: Run) -> None:
    """A peer joining again while a round is open keeps its upload; a replay of an old round is refused."""
    old = run.step
    step = run.step + 1
    uploads = {p: peer_upload(SPEC, p, seed=step) for p in range(PEERS)}
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(run.clients[0].sync, step, uploads[0])
        deadline = time.monotonic() + 30
        while run.status().open_round != step and time.monotonic() < deadline:
            time.sleep(0.05)
        assert run.status().peers_uploaded == [0]
        run.clients[1].join()  # mid-round
        assert run.status().peers_uploaded == [0]
        got, _ = run.clients[1].sync(step, uploads[1])
        assert_exact(got, fault_free({step: uploads}, SPEC))
        assert_exact(first.result(timeout=30)[0], fault_free({step: uploads}, SPEC))
    run.step = step
    with socket.create_connection(("127.0.0.1", _data_port(run)), timeout=30) as sock:
        sock.sendall(hello(step=old))  # a replay of a round the run has moved past
        error = plane_tcp.recv_reply(sock).error
    assert (error.code, error.reason) == ("FAILED_PRECONDITION", "stale_round"), error
    replay = run.probe.stream_unary(
        UPLOAD, request_serializer=pb.UploadMessage.SerializeToString, response_deserializer=pb.UploadReply.FromString
    )
    same = upload_digest(uploads[0], "fp32")  # what peer 0 sent: a retry of it is an idempotent no-op
    reply = replay(iter([pb.UploadMessage(meta=pb.UploadMeta(peer_id=0, round=step, digest=same))]), timeout=10)
    assert reply.duplicate  # the round just completed: an idempotent no-op
    with pytest.raises(grpc.RpcError) as err:  # other values for the committed round: refused
        replay(iter([pb.UploadMessage(meta=pb.UploadMeta(peer_id=0, round=step, digest=same ^ 1))]), timeout=10)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert f"peer 0 uploads round {step} again with other values" in err.value.details()
    run.check_healthy()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_server_knows_the_model_from_the_runs_yaml(tmp_path: Path) -> None:
    """`python -m spes.server RUN.yaml` refuses a peer whose model differs from the run's, naming the difference."""
    config = REPO / "configs" / "tiny.yaml"
    spec = spec_of_run(str(config), ["--server.merge_interval=0"])
    manifest, peers = spec.manifest or {}, spec.num_peers
    with (
        server_process(tmp_path / "server.log", [str(config), "--server.merge_interval=0"]) as server,
        ExitStack() as stack,
    ):
        wrong = dataclasses.replace(spec, manifest=dict(manifest, **{"lm_head.weight": (4097, 64)}))
        with make_client(server.addr, wrong, 0, rpc_timeout_s=10, max_retries=0) as stranger:
            with pytest.raises(SyncError) as err:
                stranger.join()
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "'lm_head.weight' has shape [4097, 64], the run's is [4096, 64]" in str(err.value)
        clients = [
            stack.enter_context(make_client(server.addr, spec, p, rpc_timeout_s=10, max_retries=0))
            for p in range(peers)
        ]
        for client in clients:
            client.join()
        step = spec.next_round(None)  # the run's first round: step sync_steps
        uploads = {p: peer_upload(spec, p, seed=1) for p in range(peers)}
        with ThreadPoolExecutor(peers) as pool:
            results = [
                f.result(timeout=90) for f in [pool.submit(c.sync, step, uploads[p]) for p, c in enumerate(clients)]
            ]
        assert clients[0].status().current_round == step
        assert proc_usage(server.proc.pid)["rss"] < RSS_BOUND
    want = fault_free({step: uploads}, spec)
    for got, _ in results:
        assert_exact(got, want)


def upload_stub(channel: grpc.Channel) -> grpc.StreamUnaryMultiCallable:
    return channel.stream_unary(
        UPLOAD, request_serializer=pb.UploadMessage.SerializeToString, response_deserializer=pb.UploadReply.FromString
    )


def status_while(run: Run, seconds: float) -> int:
    """Ask Status every 0.2 s for `seconds` (each within 1 s, or the test fails); returns how many answered."""
    answered, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        run.status()
        answered += 1
        time.sleep(0.2)
    return answered


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_hello_dribbled_byte_by_byte_loses_its_slot(run: Run) -> None:
    """Every data-plane slot taken by connections sending their hello one byte a second (from four addresses: one
    holds at most a quarter of the slots): each is closed once --handshake_timeout has passed since it connected,
    whatever it still sends; Status answers throughout and the peers' next round completes (over the freed slots or
    gRPC)."""
    port, stop = _data_port(run), threading.Event()

    def dribble(sock: socket.socket) -> float:
        start = time.monotonic()
        with contextlib.suppress(OSError):
            for byte in hello(token="t" * 50):  # 66 bytes: over a minute when dribbled in full
                if stop.wait(1.0):
                    break
                sock.sendall(bytes([byte]))
        return time.monotonic() - start

    with ExitStack() as stack, ThreadPoolExecutor(SLOTS) as pool:
        socks = [stack.enter_context(connect_from(f"127.0.0.{1 + i % 4}", port)) for i in range(SLOTS)]
        held = [pool.submit(dribble, s) for s in socks]
        assert status_while(run, HANDSHAKE_S - 1) > 0
        run.round()
        codes = {error_code(s) for s in socks}
        stop.set()
        seconds = [f.result(timeout=30) for f in held]
    assert codes <= {"DEADLINE_EXCEEDED", "closed"}, codes
    assert max(seconds) < 30, seconds  # cut off, not left to dribble its whole hello (half of that)
    run.check_healthy()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_slow_grpc_upload_is_closed_and_superseded(run: Run) -> None:
    """An upload that sends 4 bytes every half second is never idle, but moves far less than --min_stream_rate:
    it is closed, nothing of it kept; one in the name of a peer whose real upload comes next does not hold that
    upload up."""
    stop = threading.Event()
    chunks = list(encode_tensors({"embed.weight": torch.zeros(MANIFEST["embed.weight"])}, "fp32", chunk_bytes=4))

    def trickle() -> Iterator[pb.UploadMessage]:
        yield pb.UploadMessage(meta=pb.UploadMeta(peer_id=0, round=run.step + 1))
        for chunk in chunks:  # valid chunks, 4 bytes each
            if stop.wait(0.5):
                return
            yield pb.UploadMessage(chunk=chunk)

    started = time.monotonic()
    slow = upload_stub(run.probe).future(trickle(), timeout=60)
    assert rpc_code(slow) in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
    assert time.monotonic() - started < 30  # closed by the rate floor, not by its own 60 s deadline (half of it)
    assert "under --min_stream_rate" in run.server.log_text()
    assert not run.status().peers_uploaded  # nothing of it was kept
    stalled = upload_stub(run.probe).future(trickle(), timeout=60)
    time.sleep(0.5)
    run.round()  # peer 0 is not locked out: its real upload ends its stalled one (or the rate floor did already)
    stop.set()
    error = stalled.exception(timeout=30)
    assert isinstance(error, grpc.RpcError), error
    assert "superseded by a newer upload of peer 0" in error.details() or "min_stream_rate" in error.details()
    run.check_healthy()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_silent_probes_past_the_slots_hold_no_handler(run: Run) -> None:
    """--max_streams + 16 link tests that never send: the ones past the slots are refused at once
    (RESOURCE_EXHAUSTED), the rest closed when idle; Status answers within 1 s throughout; a round completes."""
    stop = threading.Event()

    def probe() -> grpc.StatusCode:
        call = run.probe.stream_stream(PROBE)(never_sends(stop), timeout=60)
        try:
            for _ in call:
                pass
        except grpc.RpcError as err:
            return err.code()
        return grpc.StatusCode.OK

    with ThreadPoolExecutor(SLOTS + 16) as pool:
        calls = [pool.submit(probe) for _ in range(SLOTS + 16)]
        assert status_while(run, IDLE_S + 1) > 0
        run.round()
        stop.set()
        codes = [f.result(timeout=30) for f in calls]
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes and grpc.StatusCode.DEADLINE_EXCEEDED in codes, codes
    assert set(codes) <= {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED}, codes
    run.check_healthy()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_upload_for_a_far_future_round_is_refused_naming_the_expected_one(run: Run) -> None:
    """Round 10**12 on either plane, from a crafted client and from a node: FAILED_PRECONDITION naming the round the
    run expects; no round is opened, and the run goes on."""
    far, expected = 10**12, run.step + 1
    with pytest.raises(grpc.RpcError) as err:
        upload_stub(run.probe)(iter([pb.UploadMessage(meta=pb.UploadMeta(peer_id=1, round=far))]), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"uploads round {far}, but the run's next round is {expected}" in err.value.details()
    with socket.create_connection(("127.0.0.1", _data_port(run)), timeout=30) as sock:
        sock.sendall(hello(peer=1, step=far))
        error = plane_tcp.recv_reply(sock).error
    assert (error.code, error.reason) == ("FAILED_PRECONDITION", "future_round"), error
    with pytest.raises(SyncError) as node:
        run.clients[0].sync(far, peer_upload(SPEC, 0, seed=1))
    assert f"the run's next round is {expected}" in str(node.value), node.value
    assert run.status().open_round == -1
    run.check_healthy()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_aggregate_that_overflows_is_never_published(run: Run) -> None:
    """Both peers upload finite 3.0e38 for a shared tensor: their fp32 mean overflows; the round is refused naming
    the tensor, the global model stays at the previous round, and the same round with sane values is exact."""
    step = run.step + 1
    uploads = {p: peer_upload(SPEC, p, seed=step) for p in range(PEERS)}
    for upload in uploads.values():
        upload["embed.weight"].fill_(3.0e38)
    with ThreadPoolExecutor(PEERS) as pool:
        futures = [pool.submit(c.sync, step, uploads[p]) for p, c in enumerate(run.clients)]
        errors = [f.exception(timeout=90) for f in futures]
    for err in errors:
        assert isinstance(err, SyncError), err
        assert "'embed.weight' holds NaN or Inf" in str(err), err
    status = run.status()
    assert status.current_round == run.step and not status.peers_uploaded
    run.check_healthy()  # round `step` again, with finite values: exactly the fault-free result


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_different_reupload_in_an_open_round_is_refused(run: Run) -> None:
    """Peer 0 uploads, then sends other values for the same open round: ALREADY_EXISTS naming the peer and the
    round; the first upload stands and the round completes exactly as without the second."""
    step = run.step + 1
    uploads = {p: peer_upload(SPEC, p, seed=step) for p in range(PEERS)}
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(run.clients[0].sync, step, uploads[0])
        wait_until(lambda: run.status().peers_uploaded == [0], "peer 0's upload")
        other = upload_digest(uploads[0], "fp32") ^ 1
        with pytest.raises(grpc.RpcError) as err:
            upload_stub(run.probe)(iter([pb.UploadMessage(meta=pb.UploadMeta(peer_id=0, round=step, digest=other))]))
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert f"peer 0 uploads round {step} again with other values" in err.value.details()
        got, _ = run.clients[1].sync(step, uploads[1])
        want = fault_free({step: uploads}, SPEC)
        assert_exact(got, want)
        assert_exact(first.result(timeout=30)[0], want)
    run.step = step
    run.check_healthy()


OPEN_FILES = 200
"""The flooded server's limit of open files (soft and hard): fewer than the flood's connections."""
FLOOD_ARGS = [*ARGS, "--max_connections", "32"]
"""Its descriptor budget: 32 gRPC connections + 2 x 16 data-plane ones + 64 of its own = 128."""


def still_open(sock: socket.socket) -> bool:
    """Whether the server still holds this silent connection: what it sent (gRPC's settings frame, a refusal) read,
    the connection has not ended."""
    sock.setblocking(False)
    try:
        while sock.recv(1 << 16):
            pass
    except BlockingIOError:
        return True
    except OSError:
        pass
    return False


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_connection_flood_holds_the_budget_and_the_run_goes_on(tmp_path: Path) -> None:
    """250 silent connections to the gRPC port and 100 to the data plane of a server that may open 200 files: it
    holds no more descriptors than its limits allow (--max_connections 32 + 2 x --max_streams 16 + 64), Status
    answers on the connected channel, a round completes exactly and is persisted, and every silent connection is
    closed within --handshake_timeout. Before those bounds (gRPC keeps a silent connection 120 s, with no cap) the
    same flood took every descriptor: the data plane's listener died and the round's state file could not be
    written, so the round failed for every peer."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1024:  # this process holds the flood's 350 client ends
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
    state = tmp_path / "state"
    args = [*FLOOD_ARGS, "--state_dir", str(state)]
    with (
        server_process(tmp_path / "server.log", args, open_files=(OPEN_FILES, OPEN_FILES)) as server,
        ExitStack() as stack,
    ):
        r = Run(server, stack)
        r.round()
        # NOTE: what the server has not accepted waits in the kernel's backlog (no descriptor of the server's); a
        # connect past a full backlog waits for the kernel's retries, hence the long connect timeout
        flood = [stack.enter_context(socket.create_connection(("127.0.0.1", server.port), 30)) for _ in range(250)]
        flood += [stack.enter_context(socket.create_connection(("127.0.0.1", r.data_port), 30)) for _ in range(100)]
        assert proc_usage(server.proc.pid)["fds"] <= 128
        r.check_healthy()
        assert (state / f"round-{r.step}.safetensors").exists()
        deadline = time.monotonic() + 3 * HANDSHAKE_S
        while (left := [i for i, s in enumerate(flood) if still_open(s)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert left == []
        r.check_healthy()
        assert "Too many open files" not in server.log_text()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_server_raises_its_open_file_limit_or_refuses_to_start(tmp_path: Path) -> None:
    """Its limits (--max_connections 256 and --max_streams 64 by default: 256 + 128 + 64 = 448 descriptors) need
    more open files than a soft limit of 200: raised to 448 when the hard limit allows, else a one-line refusal."""
    with server_process(tmp_path / "raised.log", spec_overrides(SPEC), open_files=(200, 1000)) as server:
        limits = Path(f"/proc/{server.proc.pid}/limits").read_text()
        assert re.search(r"Max open files\s+448\s+1000", limits), limits
    refused = subprocess.run(
        [*server_command((200, 200)), "--host", "127.0.0.1", "--port", "0", *spec_overrides(SPEC)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.strip().splitlines()[-1] == (
        "error: --max_connections=256 and --max_streams=64 need 448 open files, and this process may open 200 "
        "(ulimit -Hn): raise the limit or lower those flags"
    )


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_wrong_token_loop_is_refused_and_logged_at_a_bounded_rate(tmp_path: Path) -> None:
    """Thousands of wrong-token calls on one connection (each refused UNAUTHENTICATED) make at most 10 log lines a
    10 s window, and the server's stop says how many it left out: every call accounted for, the log a few lines
    (logged in full, ~1,500 calls a second wrote 165 KB of log a second)."""
    log = tmp_path / "server.log"
    with server_process(log, ARGS, env={"SPES_TOKEN": TOKEN}) as server, grpc.insecure_channel(server.addr) as channel:
        stub = pb_grpc.ParameterServerStub(channel)
        bad = (("authorization", "Bearer not-the-token"),)
        calls, started = 0, time.monotonic()
        while time.monotonic() - started < 2 or calls < 500:
            with pytest.raises(grpc.RpcError) as err:
                stub.Status(pb.StatusRequest(), timeout=5, metadata=bad)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            calls += 1
        assert server.stop() == 0
    lines = log.read_text().splitlines()
    logged = sum("refused /spes.v1.ParameterServer/Status: missing or wrong token" in line for line in lines)
    left_out = [int(m.group(1)) for line in lines if (m := re.search(r"(\d+) more 'wrong token' warnings", line))]
    assert 1 <= logged <= 10 * (1 + (time.monotonic() - started) // 10) and logged + sum(left_out) == calls
    assert len(lines) < 40 and "not-the-token" not in log.read_text()
