"""What a connection to the parameter server needs and no tensor: the gRPC channel and its options, the PEM and
secret files, TLS contexts, and what a failed handshake means.

Both ends share it (`spes.sync.server`, `spes.sync.connection`, both planes), and `python -m spes.status` needs
nothing else of the transport: it imports no torch, so the command answers in a fraction of a second
(tests/test_startup.py). A server that hangs up on the client's certificate (`certificate_refusal`) is told from one
going down by a handshake of its own.
"""

from __future__ import annotations

import _ssl
import socket
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import grpc

from spes.config import SpesConfig

KEEPALIVE_S = 20
"""Seconds between HTTP/2 keepalive pings (both ends, also on idle connections)."""
KEEPALIVE_TIMEOUT_S = 10
"""A ping unanswered this long closes the connection: a vanished peer or server is noticed within 30 s."""
KEEPALIVE_SERVER_OPTIONS = [
    # NOTE: grpc servers by default refuse pings more often than every 5 minutes (GOAWAY too_many_pings).
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_S * 1000 // 2),
    ("grpc.http2.max_ping_strikes", 0),
]


def grpc_options(max_message_mb: int) -> list[tuple[str, int]]:
    """Channel options shared by server and client: message limits and keepalive for long round waits."""
    limit = max_message_mb * 2**20
    return [
        ("grpc.max_send_message_length", limit),
        ("grpc.max_receive_message_length", limit),
        ("grpc.keepalive_time_ms", KEEPALIVE_S * 1000),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_S * 1000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_S * 1000),
        ("grpc.http2.max_pings_without_data", 0),
        # NOTE: grpc's default reconnect backoff grows to 120 s, longer than our own retry schedule.
        ("grpc.max_reconnect_backoff_ms", 5_000),
    ]


def read_file(path: str, what: str) -> bytes:
    """The bytes of a certificate, key or secret file; FileNotFoundError naming the flag or key `what` and, for a
    relative path, the directory it was looked for in (run_single_node.sh runs from the repository, not the caller's
    directory)."""
    if not Path(path).is_file():
        where = "" if Path(path).is_absolute() else f" in {Path.cwd()} (give an absolute path)"
        raise FileNotFoundError(f"{what} {path!r}: file not found{where}")
    return Path(path).read_bytes()


# -- TLS ----------------------------------------------------------------------------------------------------------
def check_key_pair(cert: str | None, key: str | None, names: tuple[str, str], what: str = "") -> None:
    """ValueError naming both settings (`names`: the certificate's and the key's) and the fix unless a certificate
    and its key are given together. Why: gRPC's core aborts the process (SIGABRT) on one without the other, and
    `server_tls` took one for no TLS at all (a data plane in clear text)."""
    if (cert is None) == (key is None):
        return
    cert_name, key_name = names
    given, missing = (cert_name, key_name) if key is None else (key_name, cert_name)
    raise ValueError(
        f"{cert_name} and {key_name}{what} must be given together: give {missing} too, or leave out {given}"
    )


def server_tls(cert: str | None, key: str | None, client_ca: str | None) -> ssl.SSLContext | None:
    """The data plane's TLS context from the server's PEM files (mutual TLS with `client_ca`); None without TLS
    (neither file; one without the other is a ValueError). The server builds it before its gRPC port: gRPC reports
    an unusable file only as a port it cannot bind."""
    check_key_pair(cert, key, ("--tls_cert", "--tls_key"))
    if cert is None or key is None:
        return None
    for path, flag in ((cert, "--tls_cert"), (key, "--tls_key"), (client_ca, "--tls_client_ca")):
        if path is not None:
            read_file(path, flag)  # FileNotFoundError naming the flag
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _pem(lambda: context.load_cert_chain(cert, key), f"--tls_cert {cert!r} and --tls_key {key!r}")
    check_validity(cert, "--tls_cert")
    if client_ca is not None:
        _pem(lambda: context.load_verify_locations(cafile=client_ca), f"--tls_client_ca {client_ca!r}")
        context.verify_mode = ssl.CERT_REQUIRED
    return context


CONFIG_TLS_NAMES = tuple(f"config key 'spes_config.{name}'" for name in ("tls_ca", "tls_cert", "tls_key"))
"""How a node's errors name its TLS files: by the YAML keys they come from."""


def client_tls(
    ca: str | None, cert: str | None, key: str | None, names: tuple[str, ...] = CONFIG_TLS_NAMES
) -> ssl.SSLContext | None:
    """The client's TLS context from the same files as its gRPC channel (system roots when `ca` is None); the
    files are checked here, before gRPC, whose core names neither file nor setting. `names`: the settings `ca`,
    `cert` and `key` come from (a node's YAML keys, or a command's flags)."""
    ca_name, cert_name, key_name = names
    check_key_pair(cert, key, (cert_name, key_name), " (mutual TLS)")
    if ca is None and cert is None:
        return None
    for path, name in ((ca, ca_name), (cert, cert_name), (key, key_name)):
        if path is not None:
            read_file(path, name)
    context = _pem(lambda: ssl.create_default_context(cafile=ca), f"{ca_name} {ca!r}")
    if cert is not None and key is not None:
        _pem(lambda: context.load_cert_chain(cert, key), f"{cert_name} {cert!r} and {key_name} {key!r}")
        check_validity(cert, cert_name)
    return context


def check_validity(path: str, name: str, now: float | None = None) -> None:
    """ValueError naming `name` unless the (first) certificate of the PEM file `path` is valid at `now` (default:
    the present). Why: gRPC serves an expired certificate without a word, and every handshake with it then fails
    as if the peer were down."""
    decode = getattr(_ssl, "_test_decode_cert", None)  # NOTE: CPython's; the stdlib has no public decoder
    if decode is None:
        return
    fields = decode(path)
    now = time.time() if now is None else now
    if now < ssl.cert_time_to_seconds(fields["notBefore"]):
        raise ValueError(
            f"{name} {path!r} is not valid before {fields['notBefore']}: check this machine's clock, or issue it anew"
        )
    if now > ssl.cert_time_to_seconds(fields["notAfter"]):
        raise ValueError(
            f"{name} {path!r} expired on {fields['notAfter']}: issue a new one (docs/running.md, Security)"
        )


T = TypeVar("T")


def _pem(load: Callable[[], T], files: str) -> T:
    """`load()` of PEM files; ValueError naming them (ssl's own error names no file)."""
    try:
        return load()
    except ssl.SSLError as e:
        raise ValueError(f"{files}: not a usable PEM certificate or key ({e.reason or e})") from None


# -- the client's channel -----------------------------------------------------------------------------------------
PROBE_TIMEOUT_S = 10.0  # how long `auto` waits for the data plane to answer at join
MAX_MESSAGE_MB = 64
"""The client's gRPC message limit: chunks are 1 MiB, the control messages a few KiB."""
OWN_CONNECTION = ("grpc.use_local_subchannel_pool", 1)
"""Each channel keeps its connection state to itself. In gRPC's process-wide pool, a new channel to a server restarted
on the same address took over an older channel's failed connection: refused at once, for as long as that one's
reconnect backoff ran."""


def open_channel(settings: SpesConfig) -> grpc.Channel:
    """The gRPC channel to `settings.server_addr`: TLS (and a client certificate) when the settings name them; a
    file not found or a certificate without its key is an error naming the config key (`CONFIG_TLS_NAMES`)."""
    s, options = settings, [*grpc_options(MAX_MESSAGE_MB), OWN_CONNECTION]
    ca_name, cert_name, key_name = CONFIG_TLS_NAMES
    check_key_pair(s.tls_cert, s.tls_key, (cert_name, key_name), " (mutual TLS)")
    if s.tls_ca is None and s.tls_cert is None:
        return grpc.insecure_channel(s.server_addr, options=options)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=read_file(s.tls_ca, ca_name) if s.tls_ca else None,
        private_key=read_file(s.tls_key, key_name) if s.tls_key else None,
        certificate_chain=read_file(s.tls_cert, cert_name) if s.tls_cert else None,
    )
    return grpc.secure_channel(s.server_addr, credentials, options=options)


def tls_fix(
    ca: str | None, cert: str | None, names: tuple[str, str] = ("spes_config.tls_ca", "spes_config.tls_cert/tls_key")
) -> str:
    """What to check when a server cannot be reached and TLS may be why (`names`: the CA's and the client
    certificate's settings). gRPC's core says only `Socket closed` when a mutual-TLS server refused the client's
    certificate, or its lack of one: the line named only the address and the firewall."""
    ca_name, cert_name = names
    if ca is None and cert is None:
        return f"a server that serves TLS needs {ca_name}"
    return (
        f"over TLS, {ca_name} must be the CA that signed the server's certificate for the host in the address, and a "
        f"server started with --tls_client_ca (mutual TLS) needs {cert_name} signed by that CA"
    )


def host_port(addr: str) -> tuple[str, int]:
    """The host (an IPv6 address without its brackets) and port of a HOST:PORT address."""
    host, port = addr.rsplit(":", 1)
    return host.strip("[]"), int(port)


CERTIFICATE_REFUSED = "hung up after the handshake"
"""What `probe_handshake` says of a server that closed the connection before HTTP/2's first frame: gRPC's way of
refusing a client certificate, checked after a TLS 1.3 handshake has completed on the client."""
CERTIFICATE_ALERTS = frozenset(
    {
        "TLSV13_ALERT_CERTIFICATE_REQUIRED",
        "TLSV1_ALERT_UNKNOWN_CA",
        "SSLV3_ALERT_BAD_CERTIFICATE",
        "SSLV3_ALERT_CERTIFICATE_UNKNOWN",
        "TLSV1_ALERT_ACCESS_DENIED",
    }
)
"""The alerts (OpenSSL's reasons) with which other TLS servers (a proxy before the server) refuse a client
certificate, or its lack of one."""
NODE = ("this node", "spes_config.tls_cert/tls_key")
"""The client and its certificate's settings, as a node's refused certificate's line names them."""


def certificate_refusal(s: SpesConfig, names: tuple[str, str] = NODE) -> str | None:
    """Whether the server at `s.server_addr` refuses the client certificate of `s` (or its lack of one): what that
    means (`client_refusal` of `probe_handshake`), or None (no TLS; a server down or restarting). Asked when gRPC's
    core said `Socket closed`, which was retried for the whole backoff (80 s) as a server down."""
    if s.tls_ca is None and s.tls_cert is None:
        return None
    try:
        context = client_tls(s.tls_ca, s.tls_cert, s.tls_key)
    except (ValueError, OSError):  # NOTE: files changed since the channel read them (which keeps its copy): no evidence
        return None
    assert context is not None
    said = probe_handshake(s.server_addr, context, min(s.rpc_timeout_s, PROBE_TIMEOUT_S))
    return client_refusal(said, s.tls_cert, names)


def client_refusal(said: str | None, cert: str | None, names: tuple[str, str] = NODE) -> str | None:
    """What the server's answer to `probe_handshake` means for a client holding certificate `cert` (None: none),
    or None when it shows no refusal of it. `names`: the client and its certificate's settings."""
    if said != CERTIFICATE_REFUSED and said not in CERTIFICATE_ALERTS:
        return None
    client, cert_name = names
    fix = f"give {client} {cert_name} signed by the server's --tls_client_ca"
    if cert is None:
        return f"the server requires a client certificate (mutual TLS): {fix}"
    return f"the server refused the client certificate {cert!r}: {fix}"


def probe_handshake(addr: str, context: ssl.SSLContext, timeout: float) -> str | None:
    """What the TLS server at `addr` (HOST:PORT) does after a handshake as gRPC's (TLS 1.3, ALPN h2) with `context`:
    `CERTIFICATE_REFUSED` when it hangs up before sending a byte (an HTTP/2 server speaks first), the reason of a
    TLS alert it sends, None when it answers or no handshake completes (a server down, or one going down: no
    evidence). Why: gRPC's core says `Socket closed` of both a mutual-TLS refusal and a server that went away."""
    host, port = host_port(addr)
    context.minimum_version = ssl.TLSVersion.TLSv1_3  # NOTE: with TLS 1.2 a refusal fails the handshake itself
    context.set_alpn_protocols(["h2"])
    try:
        with socket.create_connection((host, port), timeout=timeout) as raw:
            with context.wrap_socket(raw, server_hostname=host) as tls:
                try:
                    return None if tls.recv(1) else CERTIFICATE_REFUSED
                except (ssl.SSLEOFError, ConnectionResetError):
                    return CERTIFICATE_REFUSED
    except ssl.SSLError as exc:
        return exc.reason if exc.reason in CERTIFICATE_ALERTS else None
    except OSError:
        return None


NOT_SIGNED = "the server's TLS certificate is not signed by the CA this client was given"
TLS_FAILURES = (
    ("certificate has expired", "the server's TLS certificate has expired: renew it and restart the server"),
    (
        "certificate is not yet valid",
        "the server's TLS certificate is not valid yet: check the clocks of the server and of this machine",
    ),
    (
        "Hostname Verification Check failed",
        "the server's TLS certificate does not name the host in the address: address the server by a name its "
        "certificate's subjectAltName holds",
    ),
    *((words, NOT_SIGNED) for words in ("CERTIFICATE_VERIFY_FAILED", "certificate signature failure")),
    (
        "WRONG_VERSION_NUMBER",
        "the server does not serve TLS: give this client no CA, or start the server with --tls_cert/--tls_key",
    ),
)
"""What gRPC's core says of a TLS handshake this client refused (the first match wins), and what it means. No retry
mends one: retried as an unreachable server, a wrong CA took the whole backoff (80 s) to end a node."""


HUNG_UP = "Socket closed"
"""What gRPC's core says of a connection the server closed: one going down, or a mutual-TLS server refusing this
client's certificate (or its lack of one), which it ends without a word (no TLS alert)."""


def tls_cause(details: str, refusal: Callable[[], str | None] | None = None) -> str | None:
    """What a refused TLS handshake means (`TLS_FAILURES`), from gRPC's details of an UNAVAILABLE error; None for
    any other failure. `refusal` tells a server that refused the client certificate from one going down, when the
    server hung up (`HUNG_UP`): the meaning of the one, None for the other."""
    cause = next((meaning for words, meaning in TLS_FAILURES if words in details), None)
    if cause is None and refusal is not None and HUNG_UP in details:
        return refusal()
    return cause
