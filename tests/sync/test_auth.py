"""Who may talk to the parameter server: the shared token (files, environment, the gRPC interceptor that checks it
on every call) and peer ids bound to certificates."""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from spes.sync.auth import (
    TokenAuthInterceptor,
    check_peer_identity,
    grpc_common_name,
    read_token,
    tls_common_name,
    token_matches,
)
from spes.sync.protocol import Refused
from spes.sync.throttle import ThrottledLog, left_out


def test_token_matches_only_the_exact_secret() -> None:
    assert token_matches("s3cret", "s3cret") and token_matches(None, None) and token_matches("anything", None)
    assert not token_matches("s3cre", "s3cret") and not token_matches(None, "s3cret")
    assert not token_matches(b"s3cret", "s3cret")  # not a str: refused, never decoded


def test_read_token_from_file_then_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPES_TOKEN", raising=False)
    assert read_token(None, "--token_file") is None
    monkeypatch.setenv("SPES_TOKEN", "from-env")
    assert read_token(None, "--token_file") == "from-env"
    monkeypatch.setenv("SPES_TOKEN", "from-env\n")  # a secret store's value, as a file's is read
    assert read_token(None, "--token_file") == "from-env"
    monkeypatch.setenv("SPES_TOKEN", " ")
    assert read_token(None, "--token_file") is None
    secret = tmp_path / "token"
    secret.write_text("from-file\n")
    assert read_token(str(secret), "--token_file") == "from-file"
    secret.write_text("  \n")
    with pytest.raises(ValueError, match="config key 'spes_config.token_file' .* is empty"):
        read_token(str(secret), "config key 'spes_config.token_file'")
    with pytest.raises(FileNotFoundError, match="--token_file .*nope"):
        read_token(str(tmp_path / "nope"), "--token_file")


@pytest.mark.parametrize(
    ("claimed", "common_name", "ok"),
    [
        (0, "peer-0", True),
        (12, "peer-12", True),
        (1, "peer-0", False),
        (0, None, False),
        (0, "client", False),
        (0, "peer-0x", False),
        (0, "xpeer-0", False),
    ],
)
def test_a_peer_may_only_act_as_the_peer_its_certificate_names(claimed: int, common_name: str | None, ok: bool) -> None:
    if ok:
        check_peer_identity(claimed, common_name)
        return
    with pytest.raises(Refused) as err:
        check_peer_identity(claimed, common_name)
    assert err.value.code == grpc.StatusCode.PERMISSION_DENIED and f"'peer-{claimed}'" in str(err.value)
    shown = "no client certificate" if common_name is None else f"a certificate for {common_name!r}"
    assert str(err.value).startswith(f"a call for peer {claimed} came with {shown}: with --tls_peer_ids, ")


class _Context:
    """What `grpc_common_name` reads of a call: its auth context."""

    def __init__(self, auth: dict[str, list[bytes]]) -> None:
        self.auth = auth

    def auth_context(self) -> dict[str, list[bytes]]:
        return self.auth


class _TlsSocket(ssl.SSLSocket):
    """A TLS socket as far as `tls_common_name` asks: the certificate its peer presented."""

    cert: dict[str, Any] | None

    def getpeercert(self, binary_form: bool = False) -> Any:
        return self.cert


def tls_socket(cert: dict[str, Any] | None) -> _TlsSocket:
    sock = _TlsSocket.__new__(_TlsSocket)  # not connected: SSLSocket's constructor is the context's to call
    sock.cert = cert
    return sock


def test_the_common_name_of_a_calls_certificate_on_each_plane() -> None:
    assert grpc_common_name(_Context({"x509_common_name": [b"peer-3"]})) == "peer-3"  # type: ignore[arg-type]
    assert grpc_common_name(_Context({})) is None  # type: ignore[arg-type]
    subject = ((("countryName", "US"),), (("organizationName", "run"), ("commonName", "peer-2")))
    assert tls_common_name(tls_socket({"subject": subject})) == "peer-2"
    assert tls_common_name(tls_socket({})) is None  # a certificate not validated: nothing to read
    assert tls_common_name(tls_socket(None)) is None  # no certificate
    assert tls_common_name(tls_socket({"subject": ((("organizationName", "run"),),)})) is None
    with socket.socket() as plain:  # no TLS
        assert tls_common_name(plain) is None


def test_a_token_file_others_can_read_is_a_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A command (spes.status, a node) prints it as the project prints warnings: it came through a logger with no
    handler, so the line had no `warning:`; the server passes its log's."""
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    secret.chmod(0o600)
    assert read_token(str(secret), "--token_file") == "s3cret" and capsys.readouterr().err == ""
    secret.chmod(0o644)
    assert read_token(str(secret), "--token_file") == "s3cret"
    said = f"--token_file {secret} is readable by group or others: run `chmod 600 {secret}`"
    assert capsys.readouterr().err == f"warning: {said}\n"
    logged: list[str] = []
    assert read_token(str(secret), "--token_file", logged.append) == "s3cret"
    assert logged == [said] and capsys.readouterr().err == ""


# ---------------------------------------------------------------------------------------------------------------
# The interceptor on its own: a real gRPC server on loopback with one method of each streaming kind.

SERVICE = "spes.test.Echo"
KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
SECRET = "S3cret-Token"


@dataclass
class EchoServer:
    """What reached the service behind the interceptor: the methods that ran, the requests deserialized."""

    port: int
    ran: list[str] = field(default_factory=list)
    deserialized: list[bytes] = field(default_factory=list)


@contextlib.contextmanager
def echo_server() -> Iterator[EchoServer]:
    """A gRPC server behind `TokenAuthInterceptor(SECRET)` whose four methods echo raw bytes."""
    server = grpc.server(ThreadPoolExecutor(4), interceptors=[TokenAuthInterceptor(SECRET)])
    port = server.add_insecure_port("127.0.0.1:0")
    echo = EchoServer(port)

    def deserialize(data: bytes) -> bytes:
        echo.deserialized.append(data)
        return data

    def method(kind: str) -> grpc.RpcMethodHandler:
        def handler(request: Any, _context: grpc.ServicerContext) -> Any:
            echo.ran.append(kind)
            requests = list(request) if kind.startswith("stream") else [request]
            return iter(requests) if kind.endswith("stream") else b"".join(requests)

        make = getattr(grpc, f"{kind}_rpc_method_handler")
        return make(handler, request_deserializer=deserialize)

    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {k: method(k) for k in KINDS})])
    server.start()
    try:
        yield echo
    finally:
        server.stop(grace=None)


def call(port: int, kind: str, metadata: tuple[tuple[str, str], ...], method: str | None = None) -> list[bytes]:
    """Call `kind`'s method (or `method`) with two request messages where the kind streams them; the replies."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = getattr(channel, kind)(f"/{SERVICE}/{method or kind}")
        request = iter([b"ab", b"cd"]) if kind.startswith("stream") else b"ab"
        reply = stub(request, metadata=metadata, timeout=10)
        return list(reply) if kind.endswith("stream") else [reply]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
def test_the_interceptor_lets_the_right_bearer_token_through(kind: str) -> None:
    with echo_server() as echo:
        replies = call(echo.port, kind, (("authorization", f"Bearer {SECRET}"),))
    sent = [b"ab", b"cd"] if kind.startswith("stream") else [b"ab"]
    assert replies == (sent if kind.endswith("stream") else [b"".join(sent)])
    assert echo.ran == [kind] and echo.deserialized == sent


BAD_METADATA = {
    "none": (),
    "longer": (("authorization", f"Bearer {SECRET}x"),),
    "shorter": (("authorization", f"Bearer {SECRET[:-1]}"),),
    "no scheme": (("authorization", SECRET),),
    "lowercase scheme": (("authorization", f"bearer {SECRET}"),),
    "other key": (("x-token", f"Bearer {SECRET}"),),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
def test_the_interceptor_refuses_a_missing_or_wrong_token_before_any_byte_is_read(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Every streaming kind is answered UNAUTHENTICATED in one line saying what to set; the method never runs and
    no request is deserialized; the log names the method, never the token."""
    with echo_server() as echo:
        for case, metadata in BAD_METADATA.items():
            with pytest.raises(grpc.RpcError) as err:
                call(echo.port, kind, metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, case
            assert err.value.details() == (
                "missing or wrong token: set SPES_TOKEN, or a node's spes_config.token_file (spes.status: "
                "--token_file), to this run's shared secret"
            ), case
    assert echo.ran == [] and echo.deserialized == []
    refused = f"refused /{SERVICE}/{kind}: missing or wrong token"
    assert caplog.messages == [refused] * len(BAD_METADATA) and SECRET not in caplog.text


@dataclass
class _Details:
    method: str
    invocation_metadata: tuple[tuple[str, str], ...]


def test_refused_calls_are_throttled_as_wrong_token_warnings(caplog: pytest.LogCaptureFixture) -> None:
    """The kind the soak benchmark counts (`left_out`) is 'wrong token'; a refused call gets a denying handler, an
    unknown method stays None (UNIMPLEMENTED)."""
    warn = ThrottledLog(logging.getLogger("spes.server"), burst=1)
    interceptor = TokenAuthInterceptor(SECRET, warn)
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
    for _ in range(3):
        denied = interceptor.intercept_service(lambda _: handler, _Details("/s/m", (("authorization", "x"),)))
        assert denied is not None and denied is not handler
    assert interceptor.intercept_service(lambda _: None, _Details("/s/m", ())) is None
    ok = interceptor.intercept_service(lambda _: handler, _Details("/s/m", (("authorization", f"Bearer {SECRET}"),)))
    assert ok is handler
    warn.flush()
    assert caplog.messages[0] == "refused /s/m: missing or wrong token" and left_out(caplog.text) == {"wrong token": 3}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("token", [SECRET, "wrong"])
def test_an_unknown_method_stays_unimplemented_whatever_the_token(token: str) -> None:
    with echo_server() as echo, pytest.raises(grpc.RpcError) as err:
        call(echo.port, "unary_unary", (("authorization", f"Bearer {token}"),), method="Missing")
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED and echo.ran == []
