"""The raw-TCP data plane (spes.sync.plane_tcp), both ends, against a real in-process server on loopback."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import torch

from spes.sync import channel, plane_tcp
from spes.sync.codecs.lazy import Lazy
from spes.sync.merge import build_global
from spes.sync.proto import spes_pb2 as pb
from spes.sync.protocol import PROTOCOL_VERSION, Reason, SyncError
from spes.sync.server import ParameterServer
from spes.sync.wire import DIGEST, TensorDecoder, checksum, upload_digest
from sync_helpers import (
    NO_MERGE,
    TOKEN,
    check_round,
    join_request,
    joined_clients,
    peer_upload,
    running_server,
    stub_for,
    sync_all,
    tiny_spec,
    write_pki,
)


def raw_upload(server: ParameterServer, *, peer: int = 0, step: int = 1, token: str | None = TOKEN) -> socket.socket:
    """A hand-driven data-plane upload connection, handshake sent."""
    sock = plane_tcp.connect("127.0.0.1", server.data_port, None, timeout_s=10)
    plane_tcp.send_hello(sock, pb.DataHello(op=pb.DATA_OP_UPLOAD, peer_id=peer, step=step, token=token or ""))
    return sock


def tensor_header(name: str, shape: list[int], num_bytes: int, dtype: str = "fp32") -> pb.TensorHeader:
    return pb.TensorHeader(name=name, dtype=dtype, shape=shape, num_bytes=num_bytes)


def send_raw_frame(sock: socket.socket, body: bytes) -> None:
    """A control frame of any bytes (what another protocol, or an attacker, would send)."""
    sock.sendall(struct.pack("<I", len(body)) + body)


SPEC = tiny_spec(server=NO_MERGE)
MANIFEST = SPEC.manifest or {}


def nothing_staged(server: ParameterServer) -> bool:
    snap = server.service.state.snapshot()
    return snap.open_round is None and snap.completed_round is None and not snap.uploaded_peers


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["spes", "diloco"])
def test_two_peers_two_rounds_over_the_data_plane(mode: str) -> None:
    spec = tiny_spec(mode=mode, server=NO_MERGE, sync_steps=10)  # type: ignore[arg-type]
    with (
        running_server(spec, data_port=0) as (server, addr),
        joined_clients(addr, spec, data_plane="tcp") as clients,
    ):
        assert server.data_port > 0 and all(
            client.plane.name == "tcp" and client.plane.port == server.data_port for client in clients
        )
        for step in (10, 20):
            uploads = {p: peer_upload(spec, p, seed=step) for p in range(2)}
            results = sync_all(clients, step, uploads)
            check_round(results, uploads, spec, step=step)
        up = sum(t.numel() * 4 for p in range(2) for t in uploads[p].values())
        assert results[0][1].bytes_up + results[1][1].bytes_up == up
        assert clients[0].status().bytes_in == 2 * up


@pytest.mark.timeout(60)
def test_bf16_over_the_data_plane_equals_the_grpc_path() -> None:
    bf16 = tiny_spec(codec="bf16", server=NO_MERGE, sync_steps=5)
    uploads = {p: peer_upload(bf16, p, seed=4) for p in range(2)}
    got = {}
    for plane, port in (("tcp", 0), ("grpc", -1)):
        with running_server(bf16, data_port=port) as (_, addr):
            with joined_clients(addr, bf16, data_plane=plane) as clients:
                got[plane] = sync_all(clients, 5, uploads)
    for peer in range(2):
        assert got["tcp"][peer][1].bytes_down == got["grpc"][peer][1].bytes_down
        for name, tensor in got["grpc"][peer][0].items():
            torch.testing.assert_close(got["tcp"][peer][0][name], tensor, rtol=0, atol=0)


@pytest.mark.timeout(60)
def test_wrong_or_missing_token_is_refused_without_state_change() -> None:
    with running_server(SPEC, token=TOKEN, data_port=0) as (server, addr), joined_clients(addr, SPEC, token=TOKEN):
        for token in (None, "wrong-token", TOKEN + "x"):
            with raw_upload(server, token=token) as sock:
                error = plane_tcp.recv_reply(sock).error
            assert (error.code, error.reason) == ("UNAUTHENTICATED", "unauthenticated")
        assert nothing_staged(server)


@pytest.mark.timeout(60)
def test_corrupted_payload_is_refused_and_the_retry_succeeds() -> None:
    uploads = {p: peer_upload(SPEC, p, seed=6) for p in range(2)}
    with running_server(SPEC, data_port=0) as (server, addr), joined_clients(addr, SPEC) as clients:
        with raw_upload(server, token=None) as sock:
            assert plane_tcp.recv_reply(sock).send
            for name, tensor in uploads[0].items():
                data = bytearray(tensor.numpy().tobytes())
                digest = checksum(data)
                data[len(data) // 2] ^= 0x40  # one bit flipped in transit, after the checksum was taken
                plane_tcp.send_frame(sock, tensor_header(name, list(tensor.shape), len(data)))
                sock.sendall(data + DIGEST.pack(digest))
            reply = plane_tcp.recv_reply(sock)
        assert reply.error.reason == "corrupt", reply
        assert nothing_staged(server)
        results = sync_all(clients, 1, uploads)  # the clients' own (clean) uploads of the same round
        check_round(results, uploads, SPEC, step=1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "header",
    [
        tensor_header("embed.weight", [1 << 20, 1 << 20], 1 << 42),
        tensor_header("embed.weight", [16, 8], 1 << 40),
        tensor_header("not.in.the.model", [4], 16),
        tensor_header("embed.weight", [16, 8], 256, dtype="bf16"),
        tensor_header("embed.weight", [-16, -8], 512),
        json.dumps({"name": "embed.weight", "dtype": "fp32", "shape": [16, 8], "num_bytes": 512}).encode(),  # v3
        b"\xff\xfe\xfd not a TensorHeader",
    ],
)
def test_bad_headers_are_refused_before_any_payload(header: pb.TensorHeader | bytes) -> None:
    with running_server(SPEC, data_port=0) as (server, addr), joined_clients(addr, SPEC):
        with raw_upload(server, token=None) as sock:
            assert plane_tcp.recv_reply(sock).send
            # and no payload: the refusal must come without it
            send_raw_frame(sock, header if isinstance(header, bytes) else header.SerializeToString())
            reply = plane_tcp.recv_reply(sock)
        assert reply.error.code == "INVALID_ARGUMENT", reply
        assert nothing_staged(server)


@pytest.mark.timeout(60)
def test_a_peer_of_another_protocol_is_refused_naming_both_versions() -> None:
    """A v3 peer (JSON control frames) reads its refusal as the JSON frame it knows; a newer peer, and a hello
    that is not a current `DataHello`, get a current refusal; all of them name the versions, and nothing is staged."""
    v3_hello = json.dumps({"op": "upload", "peer_id": 0, "step": 1, "full": False, "token": None}).encode()
    with running_server(SPEC, data_port=0) as (server, addr), joined_clients(addr, SPEC):
        with plane_tcp.connect("127.0.0.1", server.data_port, None, timeout_s=10) as sock:
            sock.sendall(struct.pack("<4sH", b"SPES", 3))
            send_raw_frame(sock, v3_hello)
            (length,) = struct.unpack("<I", sock.recv(4, socket.MSG_WAITALL))
            legacy = json.loads(sock.recv(length, socket.MSG_WAITALL))
        assert legacy["status"] == "error" and legacy["code"] == "FAILED_PRECONDITION", legacy
        assert legacy["reason"] == "wrong_protocol" and "v3 but this server speaks v6" in legacy["message"]
        for version, body in ((PROTOCOL_VERSION + 1, b""), (PROTOCOL_VERSION, v3_hello)):
            with plane_tcp.connect("127.0.0.1", server.data_port, None, timeout_s=10) as sock:
                sock.sendall(struct.pack("<4sH", b"SPES", version))
                send_raw_frame(sock, body)
                error = plane_tcp.recv_reply(sock).error
            assert (error.code, error.reason) == ("FAILED_PRECONDITION", Reason.WRONG_PROTOCOL), error
            assert f"v{version}" in error.message and f"this server speaks v{PROTOCOL_VERSION}" in error.message
        assert nothing_staged(server)


@pytest.mark.timeout(60)
def test_a_duplicated_tensor_is_refused() -> None:
    upload = peer_upload(SPEC, 0, seed=7)
    name = next(iter(upload))
    with running_server(SPEC, data_port=0) as (server, addr), joined_clients(addr, SPEC):
        with raw_upload(server, token=None) as sock:
            assert plane_tcp.recv_reply(sock).send
            plane_tcp.send_tensors(sock, {name: upload[name]}, "fp32")
            plane_tcp.send_tensors(sock, {name: upload[name]}, "fp32")
            reply = plane_tcp.recv_reply(sock)
        assert "sent twice" in reply.error.message
        assert nothing_staged(server)


class _Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.marker,))


@pytest.mark.timeout(60)
def test_a_pickle_blob_is_only_ever_bytes(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    blob = pickle.dumps(_Exploit(marker))
    name = "embed.weight"
    num_bytes = 16 * 8 * 4
    payload = (blob * (num_bytes // len(blob) + 1))[:num_bytes]
    with running_server(SPEC, data_port=0) as (server, addr), joined_clients(addr, SPEC):
        with raw_upload(server, token=None) as sock:  # as a payload with a valid checksum
            assert plane_tcp.recv_reply(sock).send
            plane_tcp.send_frame(sock, tensor_header(name, [16, 8], num_bytes))
            sock.sendall(payload + DIGEST.pack(checksum(payload)))
            sock.shutdown(socket.SHUT_WR)  # the rest of the upload never comes
            assert sock.recv(1 << 16) == b""  # the server dropped the broken-off upload
        assert nothing_staged(server)
        with raw_upload(server, token=None) as sock:  # as a control frame
            assert plane_tcp.recv_reply(sock).send
            send_raw_frame(sock, blob)
            assert plane_tcp.recv_reply(sock).error.code == "INVALID_ARGUMENT"  # refused: not a TensorHeader
        with plane_tcp.connect("127.0.0.1", server.data_port, None, timeout_s=10) as sock:  # as the hello
            sock.sendall(struct.pack("<4sH", b"SPES", PROTOCOL_VERSION))
            send_raw_frame(sock, blob)
            assert plane_tcp.recv_reply(sock).error.reason == Reason.WRONG_PROTOCOL
        assert nothing_staged(server)
    assert not marker.exists()


@pytest.mark.timeout(60)
def test_tls_and_mutual_tls_on_the_data_plane(tmp_path: Path) -> None:
    pki = write_pki(tmp_path)
    uploads = {p: peer_upload(SPEC, p, seed=3) for p in range(2)}
    tls = {**pki.server, "data_port": 0}
    with (
        running_server(SPEC, **tls) as (_, addr),
        joined_clients(addr, SPEC, tls_ca=pki.ca, data_plane="tcp") as clients,
    ):
        check_round(sync_all(clients, 1, uploads), uploads, SPEC, step=1)
    with running_server(SPEC, **tls, tls_client_ca=pki.ca) as (server, addr):
        with joined_clients(addr, SPEC, tls_ca=pki.ca, **pki.client, data_plane="tcp") as clients:
            check_round(sync_all(clients, 1, uploads), uploads, SPEC, step=1)
        with pytest.raises(OSError):  # a plain-TCP client cannot speak to the TLS data plane
            with raw_upload(server, token=None) as sock:
                plane_tcp.recv_reply(sock)


def test_a_server_with_an_unusable_certificate_says_so_rather_than_blaming_the_port(tmp_path: Path) -> None:
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate\n")
    with pytest.raises(ValueError, match=r"--tls_cert '.*bad.pem' and --tls_key '.*bad.pem': not a usable PEM"):
        with running_server(SPEC, tls_cert=str(bad), tls_key=str(bad)):
            pass


@pytest.mark.timeout(60)
def test_auto_falls_back_to_grpc_when_the_data_port_does_not_answer(
    caplog: pytest.LogCaptureFixture, dead_port: int
) -> None:
    """A firewall may pass the gRPC port only: `auto` checks the advertised data port at join and, when it does
    not answer from here, sends payloads over gRPC instead of failing every transfer."""
    uploads = {p: peer_upload(SPEC, p, seed=4) for p in range(2)}
    with running_server(SPEC, data_port=0) as (server, addr):
        server.service.data_port = dead_port  # advertise a port nobody listens on
        with caplog.at_level(logging.WARNING, logger="spes.client"), joined_clients(addr, SPEC) as clients:
            assert all(c.plane.name == "grpc" for c in clients)
            check_round(sync_all(clients, 1, uploads), uploads, SPEC, step=1)
        assert "does not answer from here" in caplog.text and "over gRPC" in caplog.text
        server.service.data_port = server.data_port  # the real one answers: it is used
        with joined_clients(addr, SPEC, run_id=server.service.run_id) as clients:
            assert all(c.plane.name == "tcp" and c.plane.port == server.data_port for c in clients)  # type: ignore[attr-defined]


@pytest.mark.timeout(30)
def test_tcp_needs_an_advertised_data_port() -> None:
    with running_server(SPEC) as (_, addr):
        with pytest.raises(Exception, match="--data_port"):
            with joined_clients(addr, SPEC, data_plane="tcp"):
                pass
        with joined_clients(addr, SPEC) as clients:  # auto falls back to gRPC
            assert sync_all(clients, 1, {p: peer_upload(SPEC, p, seed=1) for p in range(2)})


@pytest.mark.timeout(60)
def test_tcp_plane_round_trip_and_refusals() -> None:
    """`TcpPlane` on its own: ping, an upload and a download, and a refusal carrying its `Reason`."""
    spec = tiny_spec(server=NO_MERGE, sync_steps=2)
    uploads = {p: peer_upload(spec, p, seed=2) for p in range(2)}
    want = build_global(uploads, spec=spec, step=2).tensors
    with running_server(spec, data_port=0) as (server, addr), stub_for(addr) as stub:
        tcp = [
            plane_tcp.TcpPlane(
                "127.0.0.1",
                server.data_port,
                None,
                peer_id=p,
                wire_dtype="fp32",
                token=None,
                session="",
                rpc_timeout_s=10,
            )
            for p in range(2)
        ]
        tcp[0].ping(5)
        with pytest.raises(SyncError, match="has not joined") as err:
            tcp[0].upload(2, uploads[0], timeout=10, digest=upload_digest(uploads[0], "fp32"))
        assert (err.value.code, err.value.reason, err.value.retryable) == (
            grpc.StatusCode.FAILED_PRECONDITION,
            Reason.NOT_JOINED,
            False,
        )
        for peer in range(2):
            stub.Join(join_request(peer, spec=spec), timeout=10)
        for peer in range(2):
            assert tcp[peer].upload(2, uploads[peer], timeout=10, digest=upload_digest(uploads[peer], "fp32")) == (
                sum(t.numel() * 4 for t in uploads[peer].values()),
                False,
            )
        names = spec.downloads(1, merged=False)
        info, got, received = tcp[1].download(
            2,
            10,
            full=False,
            base_round=-1,
            decoder_for=lambda i: TensorDecoder({n: MANIFEST[n] for n in i.names}, "fp32"),
        )
        assert info.round == 2 and sorted(got) == sorted(names)
        assert received == sum(t.numel() * 4 for t in got.values())
        assert all(torch.equal(got[n], want[n]) for n in names)


@pytest.mark.timeout(60)
def test_an_upload_makes_its_first_item_while_the_servers_go_is_on_its_way() -> None:
    """A codec makes an item when a plane first reads it (`spes.sync.codecs.lazy`): the plane reads the first one
    right after its hello, so its encoding overlaps the round trip to the server's go instead of following it. The
    hand-driven server here answers only once the first item is made (a duplicate: nothing more is sent), or after
    20 s without it: far enough past a prompt answer for a slow machine not to blur the two."""
    made = threading.Event()
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            assert plane_tcp.recv_hello(conn).op == pb.DATA_OP_UPLOAD
            made.wait(timeout=20)
            plane_tcp.send_frame(conn, pb.DataReply(uploaded=pb.UploadReply(duplicate=True)))

    server = threading.Thread(target=serve, daemon=True)
    server.start()

    def make(name: str) -> torch.Tensor:
        if name == "a":
            made.set()
        return torch.ones(2)

    items = Lazy(["a", "b"], make)
    plane = plane_tcp.TcpPlane(
        "127.0.0.1",
        listener.getsockname()[1],
        None,
        peer_id=0,
        wire_dtype="fp32",
        token=None,
        session="s",
        rpc_timeout_s=30,
    )
    start = time.monotonic()
    assert plane.upload(1, items, timeout=30, digest=0) == (0, True)
    assert time.monotonic() - start < 10 and list(items.made()) == ["a"]  # half the server's wait
    server.join(timeout=5)
    listener.close()


@pytest.mark.timeout(60)
def test_the_listener_outlives_failed_accepts(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Accepts failing with EMFILE (the process out of descriptors) leave the data plane listening: once they
    succeed again, a round goes over it (the listener's thread used to die on the first one)."""
    accept, failures = socket.socket.accept, [3]

    def out_of_files(sock: socket.socket) -> tuple[socket.socket, object]:
        if failures[0] and threading.current_thread().name == "spes-data-accept":
            failures[0] -= 1
            raise OSError(24, "Too many open files")
        return accept(sock)

    spec = tiny_spec(server=NO_MERGE, sync_steps=5)
    with running_server(spec, data_port=0) as (_, addr), caplog.at_level(logging.WARNING, "spes.transport"):
        monkeypatch.setattr(socket.socket, "accept", out_of_files)
        with joined_clients(addr, spec, data_plane="tcp") as clients:
            uploads = {p: peer_upload(spec, p, seed=5) for p in range(2)}
            results = sync_all(clients, 5, uploads)
            check_round(results, uploads, spec, step=5)
            assert all(client.plane.name == "tcp" for client in clients)
    assert failures == [0]
    assert [r.message for r in caplog.records].count(
        "data plane: accept failed ([Errno 24] Too many open files): retrying every 0.1 s"
    ) == 1


class _Frozen:
    """`plane_tcp.STALLS` of a process frozen for `seconds` from now on: `awake` is `time.monotonic` less the part of
    the freeze that has passed (the process runs meanwhile: its waits are what the tests watch)."""

    def __init__(self, seconds: float) -> None:
        self.start, self.seconds = time.monotonic(), seconds

    def watch(self) -> _Frozen:
        return self

    def awake(self) -> float:
        now = time.monotonic()
        return now - min(max(0.0, now - self.start), self.seconds)


def _later(seconds: float, action: Callable[[], object]) -> threading.Thread:
    """`action()` on a thread `seconds` from now (a peer that sends or reads late)."""
    thread = threading.Thread(target=lambda: (time.sleep(seconds), action()), daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(30)
def test_a_receive_leaves_out_the_servers_own_stall_and_a_silent_peer_still_times_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Frozen for 0.45 s of a 0.5 s timeout, the server still takes bytes sent 0.8 s after its receive began (0.35 s
    of its time); it used to time out at 0.5 s, blaming the peer. A peer silent through a freeze still times out,
    once the server has run the timeout's 0.5 s; the socket keeps its timeout."""
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(0.5)
        buf = bytearray(4)
        monkeypatch.setattr(plane_tcp, "STALLS", _Frozen(0.45))
        late = _later(0.8, lambda: a.sendall(b"late"))
        plane_tcp.recv_exactly(b, memoryview(buf))
        late.join()
        assert buf == b"late" and b.gettimeout() == 0.5
        monkeypatch.setattr(plane_tcp, "STALLS", _Frozen(0.45))
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            plane_tcp.recv_exactly(b, memoryview(buf))
        assert 0.9 <= time.monotonic() - start < 2.0 and b.gettimeout() == 0.5


@pytest.mark.timeout(30)
def test_a_send_leaves_out_the_servers_own_stall(monkeypatch: pytest.MonkeyPatch) -> None:
    """A send of more than the sockets hold to a peer that starts reading 0.8 s later goes through when 0.45 s of it
    was the server's own freeze (a 0.5 s timeout); `sendall` timed out, as if the peer had stopped reading."""
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(0.5)
        b.settimeout(10)
        data, got = bytes(range(256)) * (32 << 10), bytearray(8 << 20)
        monkeypatch.setattr(plane_tcp, "STALLS", _Frozen(0.45))
        reader = _later(0.8, lambda: plane_tcp.recv_exactly(b, memoryview(got)))
        plane_tcp.send_all(a, data)
        reader.join()
    assert got == data


def _answer_ok(sock: socket.socket, authenticated: Callable[[], contextlib.AbstractContextManager[None]]) -> None:
    """A listener's handler for its own tests: one byte of hello, then "ok" once authenticated."""
    plane_tcp.recv_exactly(sock, memoryview(bytearray(1)))
    with authenticated():
        plane_tcp.send_all(sock, b"ok")


@pytest.mark.timeout(30)
def test_a_handshake_deadline_leaves_out_the_servers_own_stall(monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection whose hello arrives 0.8 s after it was accepted is served when 0.45 s of that was the server's
    own freeze (--handshake_timeout 0.5): the deadline's timer shut it on waking. One silent through a freeze is still
    shut, once the server has run 0.5 s."""
    listener = plane_tcp.DataPlaneListener(
        "127.0.0.1", 0, _answer_ok, tls=None, max_connections=4, io_timeout_s=10, handshake_s=0.5
    )
    try:
        monkeypatch.setattr(plane_tcp, "STALLS", _Frozen(0.45))
        with socket.create_connection(("127.0.0.1", listener.port), timeout=10) as sock:
            _later(0.8, lambda: sock.sendall(b"h")).join()
            assert sock.recv(2) == b"ok"
        monkeypatch.setattr(plane_tcp, "STALLS", _Frozen(0.45))
        start = time.monotonic()
        with socket.create_connection(("127.0.0.1", listener.port), timeout=10) as sock:
            assert sock.recv(2) == b""
        assert 0.9 <= time.monotonic() - start < 2.0
    finally:
        listener.stop()


@pytest.mark.timeout(30)
def test_a_tls_handshake_leaves_out_the_servers_own_stall(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A client that starts its TLS handshake 0.8 s after connecting is served when 0.45 s of that was the server's
    own freeze (a 0.5 s socket timeout): the server's handshake timed out on waking and closed the connection."""
    pki = write_pki(tmp_path)
    server_tls = channel.server_tls(pki.server["tls_cert"], pki.server["tls_key"], None)
    client_tls = channel.client_tls(pki.ca, None, None)
    assert server_tls is not None and client_tls is not None
    listener = plane_tcp.DataPlaneListener(
        "127.0.0.1", 0, _answer_ok, tls=server_tls, max_connections=4, io_timeout_s=0.5, handshake_s=10
    )
    try:
        monkeypatch.setattr(plane_tcp, "STALLS", _Frozen(0.45))
        with socket.create_connection(("127.0.0.1", listener.port), timeout=10) as raw:
            time.sleep(0.8)
            with client_tls.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
                sock.sendall(b"h")
                assert sock.recv(2) == b"ok"
    finally:
        listener.stop()


def _tls_pair(tmp_path: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """The server's and a client's TLS contexts over a fresh test PKI."""
    pki = write_pki(tmp_path)
    server_tls = channel.server_tls(pki.server["tls_cert"], pki.server["tls_key"], None)
    client_tls = channel.client_tls(pki.ca, None, None)
    assert server_tls is not None and client_tls is not None
    return server_tls, client_tls


@pytest.mark.timeout(60)
def test_a_tls_connection_silent_after_its_tls_handshake_is_shut_at_the_handshake_deadline(tmp_path: Path) -> None:
    """--handshake_timeout bounds a TLS connection's hello too: the deadline shut the plain socket the TLS one had
    taken over (a closed descriptor, the error ignored), so a client done with TLS that sent nothing held its pending
    slot until the idle timeout, and one sending a byte now and then held it for good."""
    server_tls, client_tls = _tls_pair(tmp_path)
    listener = plane_tcp.DataPlaneListener(
        "127.0.0.1", 0, _answer_ok, tls=server_tls, max_connections=4, io_timeout_s=60, handshake_s=0.2
    )
    try:
        raw = socket.create_connection(("127.0.0.1", listener.port), timeout=10)
        with client_tls.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
            with contextlib.suppress(ssl.SSLEOFError, ConnectionResetError):
                assert sock.recv(2) == b""
    finally:
        listener.stop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_every_connection_leaves_no_thread_or_descriptor_behind(tls: bool, tmp_path: Path) -> None:
    """A connection has a handler thread and, until it authenticates or ends, a handshake-deadline thread: after
    connections served, closed mid-hello and reset before their hello (or their TLS handshake), neither thread is
    left, long before the deadline would have ended it, nor a descriptor (a reset before the TLS socket was made
    left its descriptor to the garbage collector)."""
    server_tls, client_tls = _tls_pair(tmp_path) if tls else (None, None)
    listener = plane_tcp.DataPlaneListener(
        "127.0.0.1", 0, _answer_ok, tls=server_tls, max_connections=128, io_timeout_s=60, handshake_s=60
    )

    def connect() -> socket.socket:
        raw = socket.create_connection(("127.0.0.1", listener.port), timeout=10)
        return client_tls.wrap_socket(raw, server_hostname="127.0.0.1") if client_tls else raw

    def connections() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name in ("spes-data-conn", "spes-data-handshake")]

    try:
        descriptors = len(os.listdir("/proc/self/fd"))
        for _ in range(6):  # NOTE: 18 connections, fewer than the 32 pending ones one address may hold
            with connect() as sock:
                sock.sendall(b"h")
                assert sock.recv(2) == b"ok"
            with connect():
                pass  # closed before its hello
            with socket.create_connection(("127.0.0.1", listener.port), timeout=10) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset, not a FIN
        with connect() as sock:  # served once every connection before it was accepted, its threads started
            sock.sendall(b"h")
            assert sock.recv(2) == b"ok"
        deadline = time.monotonic() + 20
        while connections() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert connections() == []
        assert len(os.listdir("/proc/self/fd")) == descriptors
    finally:
        listener.stop()
