"""The torch-free connection settings (`spes.sync.channel`): gRPC options, secret files, TLS contexts and what
they refuse, each naming the file and the key or flag that gave it."""

from __future__ import annotations

import datetime
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization

from spes.sync import channel
from sync_helpers import Pki, running_server, tiny_spec, write_pki

SPEC = tiny_spec()


def test_channel_options_and_secret_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert channel.grpc_options(4) == [
        ("grpc.max_send_message_length", 4 << 20),
        ("grpc.max_receive_message_length", 4 << 20),
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 20_000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.max_reconnect_backoff_ms", 5_000),
    ]
    secret = tmp_path / "token"
    secret.write_bytes(b"s3cret\n")
    assert channel.read_file(str(secret), "--token_file") == b"s3cret\n"
    with pytest.raises(FileNotFoundError, match=rf"^--tls_cert '{tmp_path}/nope.pem': file not found$"):
        channel.read_file(str(tmp_path / "nope.pem"), "--tls_cert")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        FileNotFoundError, match=rf"^--tls_ca 'ca.crt': file not found in {tmp_path} \(give an absolute"
    ):
        channel.read_file("ca.crt", "--tls_ca")


def test_a_pem_file_ssl_cannot_use_is_refused_naming_it(tmp_path: Path) -> None:
    """ssl names no file, and gRPC reports a bad server certificate only as a port it cannot bind."""
    pki, bad = write_pki(tmp_path), tmp_path / "bad.pem"
    bad.write_text("not a certificate\n")
    cert, key = pki.server["tls_cert"], pki.server["tls_key"]
    assert channel.server_tls(cert, key, pki.ca) is not None and channel.client_tls(pki.ca, None, None) is not None
    refused = [
        (lambda: channel.server_tls(str(bad), key, None), f"--tls_cert {str(bad)!r} and --tls_key {key!r}"),
        (lambda: channel.server_tls(cert, key, str(bad)), f"--tls_client_ca {str(bad)!r}"),
        (lambda: channel.client_tls(str(bad), None, None), f"config key 'spes_config.tls_ca' {str(bad)!r}"),
        (
            lambda: channel.client_tls(pki.ca, str(bad), key),
            f"config key 'spes_config.tls_cert' {str(bad)!r} and config key 'spes_config.tls_key' {key!r}",
        ),
    ]
    for build, files in refused:
        with pytest.raises(ValueError) as err:
            build()
        assert str(err.value).startswith(f"{files}") and ": not a usable PEM certificate or key (" in str(err.value)
    with pytest.raises(FileNotFoundError, match=r"^config key 'spes_config.tls_ca' '/nope.pem': file not found$"):
        channel.client_tls("/nope.pem", None, None)
    for one in ((cert, None), (None, key)):  # gRPC's core aborted the node's process (SIGABRT) on either
        with pytest.raises(ValueError) as err:
            channel.client_tls(None, *one)
        assert str(err.value) == (
            "config key 'spes_config.tls_cert' and config key 'spes_config.tls_key' (mutual TLS) must be given together"
        )


def _expired_copy(pki: Pki, name: str) -> str:
    """A certificate for `name`'s key (issued by `pki`) that expired yesterday."""
    issued = x509.load_pem_x509_certificate(Path(pki.server["tls_cert"]).read_bytes())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder(extensions=list(issued.extensions))
        .subject_name(issued.subject)
        .issuer_name(issued.issuer)
        .public_key(issued.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=10))
        .not_valid_after(now - datetime.timedelta(days=1))
        .sign(pki.ca_key, hashes.SHA256())
    )
    path = pki.directory / f"{name}-expired.crt"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(path)


def test_an_expired_or_not_yet_valid_certificate_is_refused_at_start_naming_it(tmp_path: Path) -> None:
    """gRPC served an expired --tls_cert without a word: the server started, and every node's handshake failed as if
    the server were down. A node's own client certificate is checked alike."""
    pki = write_pki(tmp_path)
    expired, key = _expired_copy(pki, "server"), pki.server["tls_key"]
    with pytest.raises(ValueError, match=rf"^--tls_cert {expired!r} expired on .* GMT: issue a new one"):
        with running_server(SPEC, tls_cert=expired, tls_key=key):
            pass
    with pytest.raises(ValueError, match=r"^config key 'spes_config.tls_cert' '.*-expired.crt' expired on "):
        channel.client_tls(pki.ca, expired, key)
    valid = pki.server["tls_cert"]  # valid from 5 minutes ago for a day
    channel.check_validity(valid, "--tls_cert")
    with pytest.raises(ValueError, match=r"is not valid before .* GMT: check this machine's clock"):
        channel.check_validity(valid, "--tls_cert", now=time.time() - 3600)
