"""Where a SPES run stands, asked of its parameter server from anywhere: the run, its rounds, who is in, who is
missing and when each peer was last heard from.

    python -m spes.status server.example.org:50051 [--token_file spes.token] [--tls_ca ca.crt] [--watch 30]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import grpc

from spes.cli import ArgumentParser, DefaultsHelpFormatter
from spes.config import SpesConfig, is_host_port
from spes.interrupt import outliving_readers, still_read
from spes.schema import number_flag
from spes.sync.auth import TOKEN_ENV, WRONG_TOKEN, read_token
from spes.sync.channel import certificate_refusal, client_tls, open_channel, tls_cause, tls_fix
from spes.sync.proto import spes_pb2 as pb
from spes.sync.proto import spes_pb2_grpc as pb_grpc
from spes.sync.status import describe

FIXES = {
    "UNAVAILABLE": "is the parameter server running there (python -m spes.server) and its port open to this machine? ",
    "DEADLINE_EXCEEDED": "no answer within --timeout: check the address and the network, or raise --timeout",
    "UNAUTHENTICATED": f"pass the run's shared secret (--token_file, or env {TOKEN_ENV})",
    "PERMISSION_DENIED": "this server wants a client certificate it accepts (--tls_cert, --tls_key)",
}
"""What to do when the server does not answer Status, or refuses it, by gRPC status code (unless its answer says)."""
CLIENT = ("this client", "--tls_cert/--tls_key")
"""The client and its certificate's flags, as a refused client certificate's line names them."""
TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
"""No answer, as from a server restarting: a `--watch` that has had an answer asks again."""


def refusal(
    addr: str,
    err: grpc.RpcError,
    tls: tuple[str | None, str | None] = (None, None),
    refused: Callable[[], str | None] | None = None,
) -> str:
    """The one line of a Status call that failed: the server's answer, then what to do (`FIXES`; unreachable, what
    TLS needs of `tls`, the --tls_ca and --tls_cert given) unless the answer already says it, as a spes server's
    wrong-token refusal does (printing both gave the fix twice). `refused`: whether the server hung up on the
    client certificate (`spes.sync.channel.certificate_refusal`)."""
    code, details = err.code().name, err.details() or ""
    fix = None if details == WRONG_TOKEN else FIXES.get(code)
    if code == "UNAVAILABLE":
        cause = tls_cause(details, refused)  # NOTE: a refused TLS handshake is no server down: what it means instead
        fix = cause or f"{fix}({tls_fix(*tls, names=('--tls_ca', '--tls_cert/--tls_key'))})"
    return f"error: {addr}: {code}" + (f": {details}" if details else "") + (f"; {fix}" if fix else "")


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        prog="python -m spes.status", description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter
    )
    parser.add_argument("addr", metavar="HOST:PORT", help="the parameter server (spes_config.server_addr)")
    parser.add_argument(
        "--token_file", default=None, help=f"file holding the run's shared secret (default: env {TOKEN_ENV})"
    )
    parser.add_argument("--tls_ca", default=None, help="CA certificate to verify the server (TLS)")
    parser.add_argument("--tls_cert", default=None, help="client certificate (mutual TLS)")
    parser.add_argument("--tls_key", default=None, help="client key (mutual TLS)")
    parser.add_argument(
        "--watch",
        type=number_flag(ge=0),
        default=0,
        help="ask again every this many seconds, until Ctrl-C, through a server restart (0: once)",
    )
    parser.add_argument("--timeout", type=number_flag(gt=0), default=10, help="seconds to wait for the server's answer")
    args = parser.parse_args(argv)
    if not is_host_port(args.addr):
        print(f"error: {args.addr!r} is not HOST:PORT (e.g. server.example.org:50051)", file=sys.stderr)
        return 2
    try:
        token = read_token(args.token_file, "--token_file")
        # NOTE: before gRPC sees them: its core aborts the process on a certificate without its key, and meets a
        # file that is no PEM with log lines naming neither the file nor the flag
        client_tls(args.tls_ca, args.tls_cert, args.tls_key, names=("--tls_ca", "--tls_cert", "--tls_key"))
        settings = SpesConfig(server_addr=args.addr, tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key)
        channel = open_channel(settings)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    with channel:
        try:
            return ask(pb_grpc.ParameterServerStub(channel), args, metadata, settings)
        except KeyboardInterrupt:  # how a --watch ends: no traceback
            return 0


def ask(
    stub: pb_grpc.ParameterServerStub,
    args: argparse.Namespace,
    metadata: tuple[tuple[str, str], ...],
    settings: SpesConfig,
) -> int:
    """Ask the server once, or every `--watch` seconds. A watch outlives a server that stops answering once it has
    answered (a restart, which the nodes ride out too): its line, then the next question; a refusal, or no answer
    at the first question (a wrong address, port or flag), ends it with 1. A watch whose reader has gone (`| head -n
    3`, `less` quit) ends with 0, as Ctrl-C ends it. `settings`: the address and TLS files."""
    answered = False
    while True:
        try:
            reply = stub.Status(pb.StatusRequest(), timeout=args.timeout, metadata=metadata)
        except grpc.RpcError as err:
            line = refusal(args.addr, err, (args.tls_ca, args.tls_cert), lambda: certificate_refusal(settings, CLIENT))
            if not (args.watch and answered and err.code() in TRANSIENT):
                print(line, file=sys.stderr)
                return 1
            print(f"{time.strftime('%H:%M:%S')} {line} (asking again in {args.watch:g} s)", file=sys.stderr, flush=True)
        else:
            answered = True
            print(f"{time.strftime('%H:%M:%S')} {describe(reply)}", flush=True)
            if not args.watch or not still_read(sys.stdout):
                return 0
        time.sleep(args.watch)


if __name__ == "__main__":
    with outliving_readers(None):  # NOTE: a reader gone (`| head`, a closed terminal) loses lines, not the exit code
        raise SystemExit(main())
