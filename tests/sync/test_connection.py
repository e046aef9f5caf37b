"""A client's channel to the server (`spes.sync.connection`)."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from spes.sync.plane_grpc import failure_of
from spes.sync.protocol import SyncError
from sync_helpers import make_client, running_server, tiny_spec, write_pki


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
        assert time.monotonic() - start < 10
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
