"""Who may talk to the parameter server: the run's shared token, and (optionally) peer ids bound to certificates.

The token is checked on every call of both planes, in constant time over SHA-256 digests (neither its
content nor its length leaks), before any handler runs or any request byte is deserialized.

With mutual TLS a node shows a certificate signed by the run's CA. With `--tls_peer_ids` the server also
requires that certificate to name the peer (common name `peer-<id>`) and refuses a call made for any other
peer id, so a node holding the token cannot upload, download or join as another node.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import ssl
import sys
from collections.abc import Callable
from typing import Any, NoReturn, cast

import grpc

from spes.sync.channel import read_file
from spes.sync.protocol import Refused
from spes.sync.throttle import ThrottledLog

log = logging.getLogger("spes.server")

TOKEN_ENV = "SPES_TOKEN"
WRONG_TOKEN = (
    "missing or wrong token: set SPES_TOKEN, or a node's spes_config.token_file (spes.status: --token_file), to this "
    "run's shared secret"
)
"""What the server answers a call (either plane) without the run's token: the reason and what to do."""
PEER_NAME = re.compile(r"peer-(\d+)")
"""The common name of a node certificate under `--tls_peer_ids`: `peer-<id>`."""


def print_warning(message: str) -> None:
    """A command's warning as the project prints them: one line `warning: ...` on stderr."""
    print(f"warning: {message}", file=sys.stderr)


def read_token(token_file: str | None, what: str, warn: Callable[[str], None] = print_warning) -> str | None:
    """The run's shared secret from `token_file` (named `what` in errors), else $SPES_TOKEN, else None (either
    stripped of surrounding whitespace); a file others can read is a `warn`ing (the server passes its log's)."""
    if token_file:
        token = read_file(token_file, what).decode().strip()
        if os.stat(token_file).st_mode & 0o077:
            warn(f"{what} {token_file} is readable by group or others: run `chmod 600 {token_file}`")
        if not token:
            raise ValueError(f"{what} {token_file!r} is empty: write the run's shared secret into it")
        return token
    # NOTE: stripped as a file is: a secret store's value often ends in a newline, and the node's token then
    # differed from a server's read from the same secret's file (refused as a wrong token)
    return os.environ.get(TOKEN_ENV, "").strip() or None


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode()).digest()


def token_matches(given: object, token: str | None) -> bool:
    """Constant-time comparison over SHA-256 digests; None: no authentication."""
    if token is None:
        return True
    return isinstance(given, str) and hmac.compare_digest(_digest(given), _digest(token))


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Refuses every call whose `authorization: Bearer <token>` metadata is missing or wrong (UNAUTHENTICATED).

    A refused call never reaches a handler and its request is never deserialized, so it changes no state.
    """

    def __init__(self, token: str, warn: ThrottledLog | None = None) -> None:
        """`warn`: the server's throttled warnings (its own when not given)."""
        self._bearer = f"Bearer {token}"
        self._warn = warn or ThrottledLog(log)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        metadata = dict(handler_call_details.invocation_metadata or ())
        handler = continuation(handler_call_details)
        if token_matches(metadata.get("authorization", ""), self._bearer):
            return handler
        self._warn.warning("wrong token", "refused %s: missing or wrong token", handler_call_details.method)
        return None if handler is None else _deny_like(handler)


def _deny_like(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as `handler` that only answers UNAUTHENTICATED (no deserializing)."""

    def deny(_request: Any, context: grpc.ServicerContext) -> NoReturn:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, WRONG_TOKEN)
        raise AssertionError("unreachable: context.abort raises")

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    return kinds[(handler.request_streaming, handler.response_streaming)](deny)


def grpc_common_name(context: grpc.ServicerContext) -> str | None:
    """The common name of the client certificate of a gRPC call (None without one)."""
    names = context.auth_context().get("x509_common_name") or []
    return names[0].decode() if names else None


def tls_common_name(sock: Any) -> str | None:
    """The common name of the client certificate of a data-plane connection (None without TLS or one)."""
    cert = sock.getpeercert() if isinstance(sock, ssl.SSLSocket) else None
    # the stub types every field of the certificate alike; the subject is a tuple of RDNs of (key, value) pairs
    subject = cast("tuple[tuple[tuple[str, str], ...], ...]", (cert or {}).get("subject", ()))
    for rdn in subject:
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None


def check_peer_identity(claimed: int, common_name: str | None) -> None:
    """Refuse (PERMISSION_DENIED) a call for peer `claimed` unless the certificate names exactly that peer."""
    match = PEER_NAME.fullmatch(common_name or "")
    if match is None or int(match.group(1)) != claimed:
        shown = "no client certificate" if common_name is None else f"a certificate for {common_name!r}"
        raise Refused(
            grpc.StatusCode.PERMISSION_DENIED,
            f"a call for peer {claimed} came with {shown}: with --tls_peer_ids, peer {claimed} must "
            f"present a client certificate whose common name is 'peer-{claimed}'",
        )
