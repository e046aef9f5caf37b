"""The torch-free connection settings (`spes.sync.channel`): gRPC options, secret files, TLS contexts and what
they refuse, each naming the file and the key or flag that gave it."""

from __future__ import annotations

import _ssl
import datetime
import re
import ssl
import time
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization

from spes.config import SpesConfig
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
    # ssl's reason, or its whole message where it gives no reason
    no_pem, no_ca = r"\[SSL\] PEM lib \(_ssl\.c:\d+\)", "NO_CERTIFICATE_OR_CRL_FOUND"
    refused = [
        (lambda: channel.server_tls(str(bad), key, None), f"--tls_cert {str(bad)!r} and --tls_key {key!r}", no_pem),
        (lambda: channel.server_tls(cert, key, str(bad)), f"--tls_client_ca {str(bad)!r}", no_ca),
        (lambda: channel.client_tls(str(bad), None, None), f"config key 'spes_config.tls_ca' {str(bad)!r}", no_ca),
        (
            lambda: channel.client_tls(pki.ca, str(bad), key),
            f"config key 'spes_config.tls_cert' {str(bad)!r} and config key 'spes_config.tls_key' {key!r}",
            no_pem,
        ),
    ]
    for build, files, why in refused:
        with pytest.raises(ValueError) as err:
            build()
        assert re.fullmatch(rf"{re.escape(files)}: not a usable PEM certificate or key \({why}\)", str(err.value))
    with pytest.raises(FileNotFoundError, match=r"^config key 'spes_config.tls_ca' '/nope.pem': file not found$"):
        channel.client_tls("/nope.pem", None, None)
    for one, fix in (
        ((cert, None), "give config key 'spes_config.tls_key' too, or leave out config key 'spes_config.tls_cert'"),
        ((None, key), "give config key 'spes_config.tls_cert' too, or leave out config key 'spes_config.tls_key'"),
    ):  # gRPC's core aborted the node's process (SIGABRT) on either
        with pytest.raises(ValueError) as err:
            channel.client_tls(None, *one)
        assert str(err.value) == (
            "config key 'spes_config.tls_cert' and config key 'spes_config.tls_key' (mutual TLS) must be given "
            f"together: {fix}"
        )
    assert channel.client_tls(None, None, None) is None  # no TLS
    client = pki.client
    assert channel.client_tls(None, client["tls_cert"], client["tls_key"]) is not None  # the system's roots


def test_the_servers_tls_context_serves_and_names_each_missing_file_by_its_flag(tmp_path: Path) -> None:
    pki, nope = write_pki(tmp_path), str(tmp_path / "nope.pem")
    cert, key = pki.server["tls_cert"], pki.server["tls_key"]
    for files, flag in (
        ((nope, key, None), "--tls_cert"),
        ((cert, nope, None), "--tls_key"),
        ((cert, key, nope), "--tls_client_ca"),
    ):
        with pytest.raises(FileNotFoundError, match=rf"^{flag} '{nope}': file not found$"):
            channel.server_tls(*files)
    for client_ca, verify in ((None, ssl.CERT_NONE), (pki.ca, ssl.CERT_REQUIRED)):
        context = channel.server_tls(cert, key, client_ca)
        assert context is not None and (context.protocol, context.verify_mode) == (ssl.PROTOCOL_TLS_SERVER, verify)
    assert channel.server_tls(None, None, None) is None  # no TLS


@pytest.mark.parametrize(
    ("files", "fix"),
    [
        (("server.crt", None, None), "give --tls_key too, or leave out --tls_cert"),
        ((None, "server.key", None), "give --tls_cert too, or leave out --tls_key"),
        (("server.crt", None, "ca.crt"), "give --tls_key too, or leave out --tls_cert"),
    ],
)
def test_the_servers_certificate_without_its_key_is_refused_not_served_in_clear(
    files: tuple[str | None, str | None, str | None], fix: str
) -> None:
    """server_tls took half a pair for no TLS: its data plane served in clear text without a word (DeployConfig
    refuses it first, with the same line)."""
    with pytest.raises(ValueError) as err:
        channel.server_tls(*files)
    assert str(err.value) == f"--tls_cert and --tls_key must be given together: {fix}"


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


def test_a_certificate_is_valid_from_its_first_to_its_last_second(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RFC 5280: the validity period includes both of its dates. On a Python without CPython's certificate decoder
    the check is left to the handshake (no error at start)."""
    valid = write_pki(tmp_path).server["tls_cert"]
    issued = x509.load_pem_x509_certificate(Path(valid).read_bytes())
    first, last = issued.not_valid_before_utc.timestamp(), issued.not_valid_after_utc.timestamp()
    for now in (first, last):
        channel.check_validity(valid, "--tls_cert", now=now)
    with pytest.raises(ValueError, match=r"is not valid before "):
        channel.check_validity(valid, "--tls_cert", now=first - 1)
    with pytest.raises(ValueError, match=r"expired on "):
        channel.check_validity(valid, "--tls_cert", now=last + 1)
    monkeypatch.delattr(_ssl, "_test_decode_cert")
    channel.check_validity(valid, "--tls_cert", now=last + 1)


def test_open_channel_hands_grpc_the_files_and_options_its_settings_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each file as the credentials' own argument (a certificate without its key aborts gRPC's core), the system's
    roots where no CA is given, and the same options (message limits, keepalive, a connection of its own) either
    way."""
    pki = write_pki(tmp_path)
    client = pki.client
    ca, cert, key = (Path(path).read_bytes() for path in (pki.ca, client["tls_cert"], client["tls_key"]))
    opened: list[tuple[str, tuple[object, ...], dict[str, object]]] = []
    monkeypatch.setattr(grpc, "insecure_channel", lambda *args, **kw: opened.append(("insecure", args, kw)))
    monkeypatch.setattr(grpc, "ssl_channel_credentials", lambda **files: files)
    monkeypatch.setattr(grpc, "secure_channel", lambda *args, **kw: opened.append(("secure", args, kw)))
    addr = "server.example.org:50051"
    for tls in ({}, {"tls_ca": pki.ca}, {"tls_ca": pki.ca, **client}, client):
        channel.open_channel(SpesConfig(server_addr=addr, **tls))
    options = {"options": [*channel.grpc_options(channel.MAX_MESSAGE_MB), channel.OWN_CONNECTION]}
    assert opened == [
        ("insecure", (addr,), options),
        ("secure", (addr, {"root_certificates": ca, "private_key": None, "certificate_chain": None}), options),
        ("secure", (addr, {"root_certificates": ca, "private_key": key, "certificate_chain": cert}), options),
        ("secure", (addr, {"root_certificates": None, "private_key": key, "certificate_chain": cert}), options),
    ]
    nope = str(tmp_path / "nope.pem")
    for name in ("tls_ca", "tls_cert", "tls_key"):  # named as every other error names a config key
        with pytest.raises(FileNotFoundError, match=rf"^config key 'spes_config.{name}' '{nope}': file not found$"):
            channel.open_channel(SpesConfig(server_addr=addr, **{"tls_ca": pki.ca, **client, name: nope}))
    for name, other in (("tls_cert", "tls_key"), ("tls_key", "tls_cert")):  # half a pair, before gRPC's core aborts
        with pytest.raises(ValueError) as err:
            channel.open_channel(SpesConfig(server_addr=addr, tls_ca=pki.ca, **{name: client[name]}))
        assert str(err.value) == (
            "config key 'spes_config.tls_cert' and config key 'spes_config.tls_key' (mutual TLS) must be given "
            f"together: give config key 'spes_config.{other}' too, or leave out config key 'spes_config.{name}'"
        )
    assert len(opened) == 4  # neither reached gRPC


def test_what_to_check_when_a_server_that_may_serve_tls_cannot_be_reached() -> None:
    assert channel.tls_fix(None, None) == "a server that serves TLS needs spes_config.tls_ca"
    assert (
        channel.tls_fix(None, None, ("--tls_ca", "--tls_cert/--tls_key")) == "a server that serves TLS needs --tls_ca"
    )
    over_tls = (
        "over TLS, --tls_ca must be the CA that signed the server's certificate for the host in the address, and a "
        "server started with --tls_client_ca (mutual TLS) needs --tls_cert/--tls_key signed by that CA"
    )
    for ca, cert in (("ca.crt", None), (None, "a.crt"), ("ca.crt", "a.crt")):
        assert channel.tls_fix(ca, cert, ("--tls_ca", "--tls_cert/--tls_key")) == over_tls
    assert channel.tls_fix("ca.crt", None).startswith("over TLS, spes_config.tls_ca must be the CA ")
    assert channel.tls_fix("ca.crt", None).endswith(" needs spes_config.tls_cert/tls_key signed by that CA")


def test_host_port_keeps_the_host_whole_and_drops_only_an_ipv6_addresss_brackets() -> None:
    assert channel.host_port("127.0.0.1:50051") == ("127.0.0.1", 50051)
    assert channel.host_port("[::1]:50051") == ("::1", 50051)
    assert channel.host_port("[2001:db8::7]:443") == ("2001:db8::7", 443)
    assert channel.host_port("NODE-X:7") == ("NODE-X", 7)
