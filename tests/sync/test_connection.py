"""A client's channel to the server (`spes.sync.connection`)."""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from conftest import wait_until
from spes.config import SpesConfig
from spes.sync import connection as connection_module
from spes.sync.channel import (
    CERTIFICATE_REFUSED,
    certificate_refusal,
    client_refusal,
    client_tls,
    probe_handshake,
)
from spes.sync.client import SyncClient
from spes.sync.connection import Lost
from spes.sync.plane_grpc import GrpcPlane, failure_of
from spes.sync.plane_tcp import TcpPlane
from spes.sync.proto import spes_pb2 as pb
from spes.sync.protocol import Reason, SyncError
from spes.sync.retry import Deadline
from spes.sync.server import ParameterServer, start_server
from spes.sync.settings import DeployConfig, ServerConfig
from spes.sync.stalls import Stalls
from sync_helpers import (
    check_round,
    joined_clients,
    make_client,
    peer_upload,
    running_server,
    sync_all,
    tiny_spec,
    write_pki,
)


@pytest.mark.timeout(60)
def test_a_new_client_of_a_server_restarted_on_the_same_port_connects_at_once() -> None:
    """An older client's channel to the stopped server is in its reconnect backoff; a new client of the server started
    again on that port joins on its first try. (In gRPC's process-wide subchannel pool the new channel took over the
    old one's failed connection and was refused at once: the error with which a CI run failed a test that joins
    with max_retries=0.)"""
    spec = tiny_spec()
    with running_server(spec) as (_, addr):
        old = make_client(addr, spec, 0, rpc_timeout_s=5, max_retries=0)
        old.join()
    with old:
        with pytest.raises(SyncError) as err:
            old.status_reply()
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        port = int(addr.rsplit(":", 1)[1])
        with running_server(spec, port=port) as (_, again), make_client(again, spec, 1, max_retries=0) as new:
            assert new.join() == -1


FELL_BACK = "payloads go over gRPC until the next join finds it again"
UNREACHABLE = SyncError(
    "upload round 2: data plane 127.0.0.1:1 unreachable", grpc.StatusCode.UNAVAILABLE, retryable=True
)
STALLED = SyncError("download of round 2: timed out", grpc.StatusCode.DEADLINE_EXCEEDED, retryable=True)
BUSY = grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.fixture
def grpc_payloads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every upload or download a client starts over gRPC (refused ones too), as "upload 2" or "download 2"."""
    calls: list[str] = []

    def recording(op: str) -> Callable[..., object]:
        original = getattr(GrpcPlane, op)

        def recorded(plane: GrpcPlane, step: int, *args: object, **kwargs: object) -> object:
            calls.append(f"{op} {step}")
            return original(plane, step, *args, **kwargs)

        return recorded

    for op in ("upload", "download"):
        monkeypatch.setattr(GrpcPlane, op, recording(op))
    return calls


@pytest.mark.timeout(60)
@pytest.mark.parametrize("plane", ["auto", "tcp"])
def test_a_node_mid_round_on_the_data_plane_finds_a_restarted_server_s_new_data_port(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, grpc_payloads: list[str], plane: str
) -> None:
    """Peer 0 waits for round 2 on the data plane when the server stops and starts again on its --state_dir, its
    data plane on another port. The old port is unreachable, as a data plane down while gRPC lives is: the node fell
    back to gRPC and began the round there (refused: not joined) before the re-join found the new port. Now it asks
    gRPC why first: every payload of the round, peer 1's too, goes over the restarted server's data plane."""
    spec = tiny_spec()
    uploads = {step: {p: peer_upload(spec, p, seed=step) for p in range(2)} for step in (1, 2)}

    def server(port: int) -> ParameterServer:
        deploy = DeployConfig(host="127.0.0.1", port=port, data_port=0, state_dir=str(tmp_path))
        return start_server(ServerConfig(spec, deploy))

    running = server(0)
    port = running.port
    try:
        with joined_clients(f"127.0.0.1:{port}", spec, data_plane=plane, max_retries=8) as clients:
            check_round(sync_all(clients, 1, uploads[1]), uploads[1], spec, step=1)
            with caplog.at_level(logging.WARNING, "spes.client"), ThreadPoolExecutor(1) as pool:
                waiting = pool.submit(clients[0].sync, 2, uploads[2][0])
                wait_until(lambda: clients[1].status().peers_uploaded == (0,), "peer 0's upload of round 2")
                running.stop(grace_s=0)
                running = server(port)  # a new process: resumes round 1, its data plane on a port of its own
                results = {1: clients[1].sync(2, uploads[2][1]), 0: waiting.result(timeout=30)}
            check_round(results, uploads[2], spec, step=2)
            assert [(c.plane.name, getattr(c.plane, "port", None)) for c in clients] == [("tcp", running.data_port)] * 2
    finally:
        running.stop(grace_s=0)
    assert grpc_payloads == [] and FELL_BACK not in caplog.text
    assert "the server does not know peer 0 (restarted?): joining again" in caplog.text


@pytest.mark.timeout(60)
@pytest.mark.parametrize("plane", ["auto", "tcp"])
def test_a_data_plane_gone_while_grpc_lives_leaves_the_round_to_grpc(
    caplog: pytest.LogCaptureFixture, grpc_payloads: list[str], plane: str
) -> None:
    """The fall-back a restart must not take: peer 0's data port stops answering (a firewall closed it) while the
    server, which knows the peer, answers on gRPC. The round goes over gRPC, said once; under `tcp` too, as before
    (it demands a data port at join, and a node does not stop mid-run for a data plane gRPC stands in for)."""
    spec = tiny_spec()
    uploads = {p: peer_upload(spec, p, seed=1) for p in range(2)}
    with running_server(spec, data_port=0) as (_, addr), joined_clients(addr, spec, data_plane=plane) as clients:
        with socket.socket() as closed, caplog.at_level(logging.WARNING, "spes.client"):
            closed.bind(("127.0.0.1", 0))  # bound, never listening: connections to it are refused
            clients[0].plane.port = closed.getsockname()[1]  # type: ignore[attr-defined]
            check_round(sync_all(clients, 1, uploads), uploads, spec, step=1)
    assert [c.plane.name for c in clients] == ["grpc", "tcp"]
    assert grpc_payloads == ["upload 1", "download 1"] and caplog.text.count(FELL_BACK) == 1


@pytest.mark.timeout(60)
def test_one_question_tells_what_a_failure_of_the_data_plane_lost() -> None:
    """The server knows the peer and its data plane answers a ping: only the connection was lost; a second loss
    soon after, or a data port that is closed, or busy: the data plane; gRPC gone too, or the server stopping: the
    server; a server that answers and does not know the peer is a new process. A failure of another kind, or one
    on gRPC, loses nothing of the data plane. The fall-back to gRPC acts on this answer only."""
    spec = tiny_spec()
    with running_server(spec, data_port=0) as (server, addr):
        client = make_client(addr, spec, 0, rpc_timeout_s=5)
        client.join()
        connection, tcp = client.connection, client.plane
        assert isinstance(tcp, TcpPlane)
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))  # bound, never listening: its data plane alone is gone
            port, tcp.port = tcp.port, closed.getsockname()[1]
            assert connection.why_lost(UNREACHABLE) is Lost.PLANE_DOWN
            tcp.port = port
        assert connection.why_lost(UNREACHABLE) is Lost.CONNECTION
        assert connection.why_lost(STALLED) is Lost.PLANE_DOWN  # a second loss within KEEP_WINDOW rpc timeouts
        assert connection.why_lost(SyncError("busy", BUSY, reason=Reason.BUSY, retryable=True)) is Lost.PLANE_DOWN
        assert connection.why_lost(SyncError("no", grpc.StatusCode.FAILED_PRECONDITION)) is None
        assert not connection.fall_back(UNREACHABLE, Lost.CONNECTION) and client.plane is tcp
        stopping = SyncError("shutting down", grpc.StatusCode.UNAVAILABLE, reason=Reason.SHUTTING_DOWN)
        assert connection.why_lost(stopping) is Lost.SERVER_DOWN
        server.service.shutdown(0)  # a stopping server closes its data plane before its gRPC side: it goes
        assert connection.why_lost(UNREACHABLE) is Lost.SERVER_DOWN
    with client:
        assert connection.why_lost(UNREACHABLE) is Lost.SERVER_DOWN
        with running_server(spec, port=int(addr.rsplit(":", 1)[1]), data_port=0):
            client.status()  # NOTE: retried until the channel has reconnected; a probe does not wait for that
            assert connection.why_lost(UNREACHABLE) is Lost.RESTARTED
            assert not connection.fall_back(UNREACHABLE, Lost.RESTARTED) and client.plane is tcp
            assert connection.fall_back(UNREACHABLE, Lost.PLANE_DOWN) and connection.why_lost(UNREACHABLE) is None


class _Left(Deadline):
    """A round's deadline with `left_s` seconds left whenever asked: no clock, no stall counted."""

    def __init__(self, left_s: float) -> None:
        super().__init__(3600.0, Stalls())
        self.left_s = left_s

    def remaining(self) -> float:
        return self.left_s


class _Stub:
    """A server's gRPC side that notes every call's timeout and answers a Status with `status`: a reply, an error it
    raises, or a function it calls for either; a Join times out."""

    def __init__(self, status: object) -> None:
        self.status, self.timeouts = status, []

    def Status(self, _request: object, *, timeout: float, metadata: object) -> object:  # noqa: N802 (gRPC's name)
        self.timeouts.append(("status", timeout))
        if isinstance(self.status, BaseException):
            raise self.status
        return self.status() if callable(self.status) else self.status

    def Join(self, _request: object, *, timeout: float, metadata: object) -> object:  # noqa: N802
        self.timeouts.append(("join", timeout))
        raise _Failed(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")


@contextlib.contextmanager
def _on_a_data_plane(stub: _Stub, data_port: int, **settings: object) -> Iterator[SyncClient]:
    """A client whose data plane is at `data_port` and whose gRPC side is `stub` (nothing joined; no server)."""
    own = {"rpc_timeout_s": 60, "round_timeout_s": 3600, "data_plane": "tcp", **settings}
    with make_client("127.0.0.1:1", tiny_spec(), 0, **own) as client:  # type: ignore[arg-type]
        client.connection.use_data_plane(pb.JoinReply(data_port=data_port))
        client.connection.stub = stub  # type: ignore[assignment]
        yield client


@pytest.fixture
def pings(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The timeout of every data-plane ping (each then refused as a closed port would refuse it)."""
    timeouts: list[float] = []

    def ping(_plane: TcpPlane, timeout: float) -> None:
        timeouts.append(timeout)
        raise ConnectionRefusedError("refused")

    monkeypatch.setattr(TcpPlane, "ping", ping)
    return timeouts


@pytest.mark.timeout(60)
def test_what_was_lost_is_asked_within_what_the_round_has_left(pings: list[float]) -> None:
    """Each probe waited min(rpc_timeout_s, 10 s) whatever the round had left: against a silent host the round ran
    a whole probe past round_timeout_s. Now each waits at most what the round has left (and the cap)."""
    joined = pb.StatusReply(peers_joined=[0])
    for left_s, want in ((0.25, 0.25), (3600.0, 10.0)):
        with _on_a_data_plane(stub := _Stub(joined), data_port=1) as client:
            assert client.connection.why_lost(UNREACHABLE, _Left(left_s)) is Lost.PLANE_DOWN
            assert stub.timeouts == [("status", want)] and pings[-1:] == [want]
    with _on_a_data_plane(stub := _Stub(joined), data_port=1, rpc_timeout_s=2) as client:
        assert client.connection.why_lost(STALLED, _Left(3600.0)) is Lost.PLANE_DOWN
        assert stub.timeouts == [] and pings[-1:] == [2]  # a stalled call pings only


@pytest.mark.timeout(60)
def test_a_round_with_no_time_left_to_ask_ends_with_its_timeout_and_keeps_its_plane(
    monkeypatch: pytest.MonkeyPatch, pings: list[float]
) -> None:
    """Nothing left: nothing is asked. A probe that failed as the round's end came during it was cut short by it and
    tells nothing: no verdict on the plane for the rest of the run, the round's one-line timeout instead."""
    timed_out = "the round did not finish within round_timeout_s=3600.0"
    with _on_a_data_plane(stub := _Stub(pb.StatusReply(peers_joined=[0])), data_port=1) as client:
        for failure in (UNREACHABLE, STALLED):
            with pytest.raises(SyncError, match=timed_out) as err:
                client.connection.why_lost(failure, _Left(0.0))
            assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert stub.timeouts == [] and pings == []
    round_ = _Left(0.25)

    def status_cut_short() -> pb.StatusReply:
        round_.left_s = 0.0
        raise _Failed(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

    def ping_cut_short(_plane: TcpPlane, _timeout: float) -> None:
        round_.left_s = 0.0
        raise TimeoutError("timed out")

    monkeypatch.setattr(TcpPlane, "ping", ping_cut_short)
    for status in (status_cut_short, pb.StatusReply(peers_joined=[0])):  # the Status cut short; then the ping
        round_.left_s = 0.25
        with _on_a_data_plane(_Stub(status), data_port=1) as client, pytest.raises(SyncError, match=timed_out):
            client.connection.why_lost(UNREACHABLE, round_)
        assert client.plane.name == "tcp"


@pytest.mark.timeout(60)
def test_a_restarted_server_is_joined_again_within_what_the_round_has_left() -> None:
    """The re-join a restart asks for waited rpc_timeout_s per try whatever the round had left."""
    with _on_a_data_plane(stub := _Stub(pb.StatusReply()), data_port=1, max_retries=0) as client:
        with pytest.raises(SyncError, match="DEADLINE_EXCEEDED"):
            client._recover(UNREACHABLE, _Left(0.25))
        assert stub.timeouts == [("status", 0.25), ("join", 0.25)]


@contextlib.contextmanager
def _silent() -> Iterator[int]:
    """A loopback port that takes connections (the kernel's backlog) and never answers: a host that drops packets
    is as silent."""
    with socket.create_server(("127.0.0.1", 0), backlog=64) as listener:
        yield listener.getsockname()[1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("silent", ["grpc", "data plane"])
def test_a_round_whose_server_went_silent_ends_at_its_deadline_with_its_timeout(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, silent: str
) -> None:
    """round_timeout_s=1 and a probe cap as long as the rpc timeout (30 s), so that only the round can end a probe.
    gRPC silent, the data port closed: the Status asked why waited its whole timeout past the round's end; gRPC
    alive, the data plane silent: the ping after the upload's timeout did, then left the plane for gRPC. Now the
    round ends near its deadline (the margin is generous: the probe alone took 30 s), on its plane."""
    monkeypatch.setattr(connection_module, "PROBE_TIMEOUT_S", 30.0)
    spec = tiny_spec()
    with contextlib.ExitStack() as stack:
        if silent == "grpc":
            refused = stack.enter_context(socket.socket())
            refused.bind(("127.0.0.1", 0))
            stub = stack.enter_context(_silent())
            client = stack.enter_context(make_client(f"127.0.0.1:{stub}", spec, 0, data_plane="tcp"))
            client.connection.use_data_plane(pb.JoinReply(data_port=refused.getsockname()[1]))
            client._joined = True
        else:
            _, addr = stack.enter_context(running_server(spec, data_port=0))
            client = stack.enter_context(make_client(addr, spec, 0, data_plane="tcp"))
            client.join()
            client.plane.port = stack.enter_context(_silent())  # type: ignore[attr-defined]
        client.round_timeout_s, client.connection.settings.rpc_timeout_s = 1.0, 30.0
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, "spes.client"), pytest.raises(SyncError) as err:
            client.sync(1, peer_upload(spec, 0, seed=1))
        took = time.monotonic() - start
    assert str(err.value) == "the round did not finish within round_timeout_s=1.0"
    assert took < 15, took
    assert client.plane.name == "tcp" and FELL_BACK not in caplog.text


def test_a_ca_file_that_is_no_pem_is_refused_naming_its_key_on_either_plane(tmp_path: Path) -> None:
    """Under data_plane grpc only gRPC read it: its core logged lines naming no file, and the join failed as
    UNAVAILABLE, retried as a server that is down. Now the key is named at once, whichever plane carries payloads."""
    bad = tmp_path / "ca.pem"
    bad.write_text("not a certificate\n")
    for plane in ("grpc", "auto"):
        with pytest.raises(ValueError, match=r"^config key 'spes_config.tls_ca' '.*ca.pem': not a usable PEM"):
            make_client("127.0.0.1:1", tiny_spec(), 0, tls_ca=str(bad), data_plane=plane)


@pytest.mark.timeout(60)
def test_a_server_certificate_this_client_cannot_trust_ends_the_join_at_once(tmp_path: Path) -> None:
    """A wrong CA was retried as an unreachable server: a node took the whole backoff (80 s) to end. Now the first
    handshake that fails verification ends it, saying why."""
    (tmp_path / "server").mkdir(), (tmp_path / "other").mkdir()
    server, other = write_pki(tmp_path / "server"), write_pki(tmp_path / "other")
    with running_server(tiny_spec(), **server.server) as (_, addr):
        named = addr.replace("127.0.0.1", "localhost")
        start = time.monotonic()
        with make_client(named, tiny_spec(), 0, tls_ca=other.ca) as client, pytest.raises(SyncError) as err:
            client.join()
        assert time.monotonic() - start < 30  # not retried for the backoff's 80 s
        assert not err.value.retryable and err.value.code == grpc.StatusCode.UNAVAILABLE
        assert "the server's TLS certificate is not signed by the CA this client was given" in str(err.value)
        with make_client(named, tiny_spec(), 0, tls_ca=server.ca) as client:
            assert client.join() == -1


class _Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()


@pytest.mark.parametrize(
    ("said", "meaning"),
    [
        ("CERTIFICATE_VERIFY_FAILED: certificate has expired: OK", "has expired: renew it and restart the server"),
        ("CERTIFICATE_VERIFY_FAILED: certificate is not yet valid", "is not valid yet: check the clocks"),
        ("Custom verification check failed with error: UNAUTHENTICATED: Hostname Verification Check failed.", "does "
         "not name the host in the address: address the server by a name its certificate's subjectAltName holds"),
        ("CERTIFICATE_VERIFY_FAILED: unable to get local issuer certificate", "is not signed by the CA this client"),
        ("BAD_SIGNATURE: certificate signature failure: OK", "is not signed by the CA this client"),
        ("SSL_ERROR_SSL: error:100000f7:SSL routines:OPENSSL_internal:WRONG_VERSION_NUMBER", "does not serve TLS"),
    ],
)  # fmt: skip
def test_each_tls_handshake_failure_is_named_and_not_retried(said: str, meaning: str) -> None:
    """What gRPC's core says of each (seen with openssl-made certificates against a real server), and a server that
    is only down, which is retried."""
    details = f"failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Tls handshake failed: {said}"
    failure = failure_of("join", _Failed(grpc.StatusCode.UNAVAILABLE, details))
    assert not failure.retryable and meaning in str(failure) and str(failure).endswith(f"({details})")
    down = failure_of("join", _Failed(grpc.StatusCode.UNAVAILABLE, "ipv4:127.0.0.1:1: Socket closed"))
    assert down.retryable and str(down) == "join failed (UNAVAILABLE): ipv4:127.0.0.1:1: Socket closed"


@pytest.mark.timeout(60)
def test_a_mutual_tls_server_refusing_the_client_certificate_ends_the_join_at_once(tmp_path: Path) -> None:
    """gRPC's core says only `Socket closed` of a mutual-TLS server refusing a node's certificate, or its lack of
    one: the join was retried as a server down for the whole backoff (80 s), then ended with the generic line. Now
    a probe handshake sees the server hang up on it, and the join ends at once saying which setting to give."""
    (tmp_path / "server").mkdir(), (tmp_path / "other").mkdir()
    pki, other = write_pki(tmp_path / "server"), write_pki(tmp_path / "other")
    stranger = other.client
    with running_server(tiny_spec(), tls_client_ca=pki.ca, **pki.server) as (_, addr):
        for cert, said in (
            ({}, "the server requires a client certificate (mutual TLS): "),
            (stranger, f"the server refused the client certificate {stranger['tls_cert']!r}: "),
        ):
            start = time.monotonic()
            with make_client(addr, tiny_spec(), 0, tls_ca=pki.ca, **cert) as client, pytest.raises(SyncError) as err:
                client.join()
            assert time.monotonic() - start < 30  # not retried for the backoff's 80 s
            assert not err.value.retryable and err.value.code == grpc.StatusCode.UNAVAILABLE
            assert f"{said}give this node spes_config.tls_cert/tls_key signed by the server's --tls_client_ca (" in str(
                err.value
            )
        with make_client(addr, tiny_spec(), 0, tls_ca=pki.ca, **pki.client) as client:
            assert client.join() == -1


@contextlib.contextmanager
def _listening(serve: Callable[[socket.socket], None]) -> Iterator[int]:
    """A loopback port whose every connection `serve` handles on a thread, until the block ends."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                conn, _ = listener.accept()
                with conn, contextlib.suppress(OSError):
                    conn.settimeout(5)
                    serve(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def _hang_up_mid_handshake(conn: socket.socket) -> None:
    conn.recv(4096)  # the ClientHello, then the server goes away


@pytest.mark.timeout(60)
def test_a_server_that_hangs_up_while_it_restarts_is_still_retried(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A server going down mid-handshake is also `Socket closed` to gRPC: the probe finds no completed handshake to
    judge, and the join retries until the server, started again on that port, answers."""
    pki = write_pki(tmp_path)
    with _listening(_hang_up_mid_handshake) as port:
        client = make_client(f"127.0.0.1:{port}", tiny_spec(), 0, tls_ca=pki.ca, rpc_timeout_s=5, max_retries=20)
        joined: list[int] = []
        thread = threading.Thread(target=lambda: joined.append(client.join()), daemon=True)
        with caplog.at_level(logging.WARNING, "spes.client"):
            thread.start()
            deadline = time.monotonic() + 20
            while "Socket closed); retry 2/" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.1)
    assert "Socket closed); retry 2/" in caplog.text  # what a mutual-TLS refusal says too: probed, then retried
    with client, running_server(tiny_spec(), port=port, **pki.server):
        thread.join(40)
        assert joined == [-1]


def _require_a_certificate(pki_ca: str, server: dict[str, str]) -> Callable[[socket.socket], None]:
    """A TLS server (not gRPC's) that refuses a client without a certificate with an alert, as a proxy does."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(server["tls_cert"], server["tls_key"])
    context.load_verify_locations(pki_ca)
    context.verify_mode = ssl.CERT_REQUIRED
    context.set_alpn_protocols(["h2"])

    def serve(conn: socket.socket) -> None:
        context.wrap_socket(conn, server_side=True).sendall(b"\0")

    return serve


@pytest.mark.timeout(60)
def test_the_probe_tells_a_refused_client_certificate_from_every_other_server(tmp_path: Path) -> None:
    """Only a completed handshake the server then hangs up on, or a certificate alert, is evidence; a server that
    answers, a closed port or a hang-up mid-handshake (a server going down) is none."""
    pki = write_pki(tmp_path)

    def probe(port: int) -> str | None:
        context = client_tls(pki.ca, None, None)
        assert context is not None
        return probe_handshake(f"localhost:{port}", context, 5)

    with running_server(tiny_spec(), tls_client_ca=pki.ca, **pki.server) as (_, addr):
        assert probe(int(addr.rsplit(":", 1)[1])) == CERTIFICATE_REFUSED
    with running_server(tiny_spec(), **pki.server) as (_, addr):
        port = int(addr.rsplit(":", 1)[1])
        assert probe(port) is None
    assert probe(port) is None  # stopped: nothing listens there
    with _listening(_hang_up_mid_handshake) as port:
        assert probe(port) is None
    with _listening(_require_a_certificate(pki.ca, pki.server)) as port:
        assert probe(port) == "TLSV13_ALERT_CERTIFICATE_REQUIRED"


@pytest.mark.timeout(60)
def test_a_refused_certificate_is_told_in_the_names_of_whoever_asks(tmp_path: Path) -> None:
    """`python -m spes.status` names itself and its flags where a node names its YAML keys; a client without TLS is
    not probed (nothing to refuse), and a certificate the server accepts is no refusal."""
    (tmp_path / "server").mkdir(), (tmp_path / "other").mkdir()
    pki, other = write_pki(tmp_path / "server"), write_pki(tmp_path / "other")
    stranger, fix = other.client, "give this command --tls_cert/--tls_key signed by the server's --tls_client_ca"
    with running_server(tiny_spec(), tls_client_ca=pki.ca, **pki.server) as (_, addr):

        def refusal(**tls: str) -> str | None:
            return certificate_refusal(SpesConfig(server_addr=addr, **tls), ("this command", "--tls_cert/--tls_key"))

        assert refusal() is None
        assert refusal(tls_ca=pki.ca) == f"the server requires a client certificate (mutual TLS): {fix}"
        assert refusal(tls_ca=pki.ca, **stranger) == (
            f"the server refused the client certificate {stranger['tls_cert']!r}: {fix}"
        )
        assert refusal(tls_ca=pki.ca, **pki.client) is None


@pytest.mark.timeout(60)
def test_the_probe_waits_for_a_silent_server_no_longer_than_its_timeout(tmp_path: Path) -> None:
    """A server that takes the connection and never answers the handshake (hung) is no evidence either: the probe a
    failed join asks gives up on it within the node's rpc_timeout_s, not when the server at last lets go (after
    30 s here: far enough past the probe's timeout for a slow machine not to blur the two)."""
    pki, released = write_pki(tmp_path), threading.Event()

    def hold(conn: socket.socket) -> None:
        released.wait(30)

    with _listening(hold) as port:
        addr, context = f"127.0.0.1:{port}", client_tls(pki.ca, None, None)
        assert context is not None
        try:
            for ask in (
                lambda: probe_handshake(addr, context, 0.5),
                lambda: certificate_refusal(SpesConfig(server_addr=addr, tls_ca=pki.ca, rpc_timeout_s=0.5)),
            ):
                start = time.monotonic()
                assert ask() is None
                assert time.monotonic() - start < 15  # half the hold
        finally:
            released.set()


@pytest.mark.parametrize(
    ("said", "cert", "line"),
    [
        (CERTIFICATE_REFUSED, None, "the server requires a client certificate (mutual TLS): give this node "
         "spes_config.tls_cert/tls_key signed by the server's --tls_client_ca"),
        ("TLSV13_ALERT_CERTIFICATE_REQUIRED", None, "the server requires a client certificate (mutual TLS): give "
         "this node spes_config.tls_cert/tls_key signed by the server's --tls_client_ca"),
        ("TLSV1_ALERT_UNKNOWN_CA", "a.crt", "the server refused the client certificate 'a.crt': give this node "
         "spes_config.tls_cert/tls_key signed by the server's --tls_client_ca"),
        (None, None, None),
        ("UNEXPECTED_EOF_WHILE_READING", "a.crt", None),
    ],
)  # fmt: skip
def test_what_the_probe_saw_is_a_refusal_only_of_the_client_certificate(
    said: str | None, cert: str | None, line: str | None
) -> None:
    assert client_refusal(said, cert) == line


def test_a_hang_up_is_asked_about_only_when_no_other_tls_failure_explains_it() -> None:
    """`Socket closed` asks the probe (a refusal: not retried); any other failure never does."""
    closed = "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: Socket closed"
    refused = failure_of("join", _Failed(grpc.StatusCode.UNAVAILABLE, closed), lambda: "the server refused it")
    assert not refused.retryable and str(refused) == f"join failed (UNAVAILABLE): the server refused it ({closed})"
    assert failure_of("join", _Failed(grpc.StatusCode.UNAVAILABLE, closed), lambda: None).retryable

    def unasked() -> str | None:
        raise AssertionError("probed")

    refused_port = "ipv4:127.0.0.1:1: Failed to connect to remote host: Connection refused"
    assert failure_of("join", _Failed(grpc.StatusCode.UNAVAILABLE, refused_port), unasked).retryable
